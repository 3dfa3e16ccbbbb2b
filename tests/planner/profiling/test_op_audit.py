"""No silent zero: every op a traced step runs is counted by a formula or known FLOP-free."""
from __future__ import annotations

import textwrap

import pytest
import torch

from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.profiling.op_audit import flop_formulas, is_flop_free
from meshplan.planner.profiling.profiler import profile

aten = torch.ops.aten


def test_grouped_mm_formula_counts_every_routed_row():
    """2 M N K for tokens x expert weights, whatever the offsets; the weight gradient likewise."""
    from torch.utils.flop_counter import FlopCounterMode

    tokens, hidden, width, experts = 12, 16, 8, 4
    a = torch.zeros(tokens, hidden, dtype=torch.bfloat16, device="meta", requires_grad=True)
    b = torch.zeros(experts, hidden, width, dtype=torch.bfloat16, device="meta", requires_grad=True)
    offs = torch.zeros(experts, dtype=torch.int32, device="meta")
    with FlopCounterMode(display=False, custom_mapping=flop_formulas()) as counter:
        out = torch._grouped_mm(a, b, offs=offs)
        forward = counter.get_total_flops()
        out.backward(torch.ones_like(out))
    assert forward == 2 * tokens * hidden * width
    assert counter.get_total_flops() == 3 * forward  # input and weight gradients, each as many


@pytest.mark.parametrize("op,free", [(aten.view.default, True), (aten.add.Tensor, True),
                                     (aten.silu_backward.default, True), (aten._softmax.default, True),
                                     (aten.mm.default, False), (aten.mv.default, False),
                                     (aten._grouped_mm.default, False)])
def test_flop_free_classification(op, free):
    assert is_flop_free(op) is free


_MV_FILE = """
import torch
from torch import nn

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(8, 8))

    def forward(self, x):
        return torch.mv(self.weight, x)

def build():
    return Model(), torch.zeros(8)
"""


def test_an_uncounted_compute_op_is_refused_by_name(tmp_path):
    path = tmp_path / "mv_model.py"
    path.write_text(textwrap.dedent(_MV_FILE))
    with pytest.raises(MeshplanError, match="runs aten.mv, which meshplan's FLOP counter has no formula for") as err:
        profile(f"{path}:build", 8, cache=False)
    # the fix is the user's model, never meshplan's source
    assert "planner/" not in str(err.value) and "write that operation in the model as matmuls" in str(err.value)


@pytest.mark.parametrize("spec", ["gpt:layers=2,hidden=64,heads=4,vocab=256",
                                  "llama:layers=2,hidden=64,heads=4,kv_heads=2,ffn=96,vocab=256",
                                  "moe:layers=2,hidden=64,heads=4,kv_heads=2,experts=4,top_k=2,expert_ffn=32,vocab=256,"
                                  "dense_layers=1,ffn=96,shared_experts=1"])
@pytest.mark.parametrize("attention", ["flash", "math"])
def test_zoo_traces_with_no_uncounted_op(spec, attention):
    """The audit refuses any uncounted compute op, so tracing the zoo at all is the check."""
    graph = profile(spec, 32, attention=attention, trace=True, cache=False)
    assert graph.fwd_flops > 0
