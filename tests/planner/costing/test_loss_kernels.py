"""Megatron-Core's cross-entropy kernels (`ParallelConfig.cross_entropy_fusion`, --cross-entropy-fusion):
the output layer's memory-bound time counted kernel by kernel, in the estimate, plan.json and the
Megatron-LM export and import."""
from __future__ import annotations

from dataclasses import replace

import pytest

from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.contracts.plan import plan_from_json
from meshplan.planner.costing.device_time import memory_time_s
from meshplan.planner.costing.hardware import load_cluster
from meshplan.planner.costing.layer_cost import layer_cost
from meshplan.planner.costing.loss_kernels import MEGATRON_CE_BYTES_PER_LOGIT
from meshplan.planner.engines.bridge import export_plan, read_engine_text
from meshplan.planner.profiling.profiler import profile
from meshplan.planner.simulation.estimator import estimate, parallel_config
from tests.planner.engines.helpers import make_plan

VOCAB, SEQ, MBS, TP = 32768, 512, 2, 2
SPEC = f"gpt:layers=2,hidden=256,heads=4,vocab={VOCAB}"


def _head_times(fusion: str, engine: str = "megatron") -> tuple[float, float]:
    cluster = load_cluster("h100-sxm")
    graph = profile(SPEC, SEQ, batch=1, dtype="bf16")
    config = parallel_config(cluster, gpus=TP, global_batch=MBS, tp=TP, mbs=MBS, sp=True, engine=engine,
                             cross_entropy_fusion=fusion)
    head = graph.layers[-1]
    assert head.kind == "head"
    cost = layer_cost(head, config, cluster, graph.info, state_recipe="zero-paper")
    return cost.fwd_compute_s, cost.bwd_compute_s


@pytest.mark.parametrize("fusion", ["native", "te"])
def test_each_fusion_saves_the_bytes_its_kernels_do_not_move(fusion):
    """The forward and backward of the output layer differ from the unfused loss's by exactly the
    bytes per logit the kernels skip, over the rank's logits (tokens x vocab / tp), at the device's
    achieved memory bandwidth: nothing else in the layer depends on the loss kernels."""
    cluster = load_cluster("h100-sxm")
    logits = MBS * SEQ * VOCAB / TP
    (fwd_none, bwd_none), (fwd, bwd) = _head_times("none"), _head_times(fusion)
    (fwd_bytes_none, bwd_bytes_none), (fwd_bytes, bwd_bytes) = (MEGATRON_CE_BYTES_PER_LOGIT[name]
                                                                for name in ("none", fusion))
    assert fwd_none - fwd == pytest.approx(memory_time_s((fwd_bytes_none - fwd_bytes) * logits, cluster), rel=1e-9)
    assert bwd_none - bwd == pytest.approx(memory_time_s((bwd_bytes_none - bwd_bytes) * logits, cluster), rel=1e-9)


def test_the_kernel_counts_are_the_passes_megatron_core_makes():
    """Unfused: cast to fp32 (2 read + 4 written), max (4), subtract (4 + 4), exp (4 + 4), sum (4),
    divide (4 + 4) forward; scale (4 + 4) and the cast back to bf16 (4 + 2) backward. Native fusion:
    three compiled kernels, cast+max (2 + 4), subtract+exp+sum (4 + 4), divide (4 + 4). Transformer
    Engine: one read for the running max and sum, one read and write of the gradient (2 + 2 + 2),
    scaled in place in backward (2 + 2)."""
    assert MEGATRON_CE_BYTES_PER_LOGIT == {"none": (6 + 4 + 8 + 8 + 4 + 8, 8 + 6), "native": (6 + 8 + 8, 8 + 6),
                                           "te": (2 + 2 + 2, 2 + 2)}


def test_other_engines_price_the_logits_by_the_bytes_they_save():
    """Under the generic engine (no loss code on record) the output layer keeps the fitted
    traffic-per-saved-byte rule, which differs from every counted loss, so the engine is part of
    what the time depends on."""
    generic = _head_times("none", engine="generic")
    assert all(generic != _head_times(fusion) for fusion in ("none", "native", "te"))


def test_only_megatron_names_its_loss_kernels():
    with pytest.raises(ValueError, match="use engine megatron"):
        ParallelConfig(gpus=2, global_batch=2, dp=2, engine="torchtitan", cross_entropy_fusion="native")
    with pytest.raises(ValueError, match="cross_entropy_fusion must be one of none, native, te"):
        ParallelConfig(gpus=2, global_batch=2, dp=2, engine="megatron", cross_entropy_fusion="liger")
    with pytest.raises(MeshplanError, match="--cross-entropy-fusion te .* use --engine megatron"):
        estimate(SPEC, "a100-80g", gpus=2, global_batch=2, seq=128, cross_entropy_fusion="te")


def test_plan_json_and_the_megatron_arguments_carry_it():
    plan = make_plan(pp=2, dp=2, tp=2, zero=1)
    megatron = replace(plan, config=replace(plan.config, engine="megatron"))
    assert "cross_entropy_fusion" not in megatron.to_json()  # plans without it keep their digest
    for fusion in ("native", "te"):
        fused = replace(plan, config=replace(megatron.config, cross_entropy_fusion=fusion))
        assert plan_from_json(fused.to_json()).config.cross_entropy_fusion == fusion
        assert fused.digest != megatron.digest and fused.config.label().endswith(f", {fusion} fused loss")
        text = export_plan(fused, "megatron").text
        assert "--cross-entropy-loss-fusion" in text
        assert ("--cross-entropy-fusion-impl te" in text) == (fusion == "te")
        assert read_engine_text(text, "megatron").cross_entropy_fusion == fusion
    text = export_plan(megatron, "megatron").text
    assert "--cross-entropy-loss-fusion" not in text and read_engine_text(text, "megatron").cross_entropy_fusion == "none"


# torch's eager cross-entropy as torchtitan runs it (`cross_entropy(pred.float(), labels)`, `del pred`,
# backward), under `loss_parallel` on a fake process group of `tp` ranks (its collectives are no-ops;
# the shard shapes and what is allocated are the real ones): torch's MemTracker's peak, less the bf16
# logits (a leaf kept alive here, freed before backward in torchtitan), over one fp32 copy of the logits.
_MEASURE_CE = r"""
import contextlib, json, sys
import torch, torch.nn.functional as F, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import loss_parallel
from torch.distributed._tools.mem_tracker import MemTracker

tokens, vocab, tp = (int(a) for a in sys.argv[1:4])
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
mesh = init_device_mesh("cpu", (tp,))
local = torch.randn(tokens, vocab // tp, dtype=torch.bfloat16, requires_grad=True)
labels = torch.randint(0, vocab, (tokens,))
tracker = MemTracker()
with tracker:
    pred = DTensor.from_local(local, mesh, [Shard(1)]) if tp > 1 else local.view_as(local)
    with loss_parallel() if tp > 1 else contextlib.nullcontext():
        loss = F.cross_entropy(pred.float(), labels)
        del pred
        loss.backward()
peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
print(json.dumps((peak - local.numel() * 2) / (local.numel() * 4)))
dist.destroy_process_group()
"""


@pytest.mark.parametrize("tp", [1, 4])
def test_torchtitan_loss_holds_what_torch_allocates(tp):
    """torchtitan's output layer under `loss_parallel` (TP) or plain (TP 1): the fp32 log-probs it
    saves plus the copies its backward holds (`ce_backward_fp32_copies`: 2 plain, 3 under
    loss_parallel) equal the peak torch's own cross-entropy reaches, in fp32 copies of the rank's
    logits (exact up to the scalars: 1e-3)."""
    import json
    import subprocess
    import sys

    from meshplan.planner.costing.loss_kernels import ce_backward_fp32_copies

    vocab, seq, mbs = 32768, 256, 2
    done = subprocess.run([sys.executable, "-c", _MEASURE_CE, str(seq * mbs), str(vocab), str(tp)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    measured_copies = json.loads(done.stdout.strip().splitlines()[-1])
    assert measured_copies == pytest.approx(1 + ce_backward_fp32_copies(loss_parallel=tp > 1), rel=1e-3)
    cluster = load_cluster("h100-sxm")
    graph = profile(f"llama:layers=2,hidden=256,heads=4,kv_heads=2,ffn=512,vocab={vocab}", seq, batch=1, dtype="bf16")
    config = parallel_config(cluster, gpus=tp, global_batch=mbs, tp=tp, mbs=mbs, sp=tp > 1, engine="torchtitan")
    head = layer_cost(graph.layers[-1], config, cluster, graph.info, state_recipe="zero-paper")
    fp32_logits = 4.0 * seq * mbs * vocab / tp
    assert head.buffer_bytes == pytest.approx((measured_copies - 1) * fp32_logits, rel=1e-3)


def _ce(pred, labels):
    import torch.nn.functional as F

    return F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))


def test_compiled_loss_keeps_the_logits_in_bf16():
    """torchtitan's loss under torch.compile (`compile_loss`): the graph Inductor receives
    (AOTAutograd with Inductor's decompositions and min-cut partitioner) saves the bf16 logits and
    two fp32 values per token (the max and the log-sum-exp), not fp32 log-probs, and its backward's
    one logits-sized output is their bf16 gradient; where a C++ compiler is at hand, Inductor's CPU
    code allocates no other logits-sized buffer. meshplan's head keeps bV + 8 bytes per token and
    works on bV (exact)."""
    import shutil

    import torch
    from functorch.compile import aot_function, make_boxed_func, min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    tokens, vocab = 256, 1024
    graphs = {}

    def keep(name):
        def compiler(gm, _):
            graphs[name] = gm
            return make_boxed_func(gm)
        return compiler

    compiled = aot_function(_ce, fw_compiler=keep("fw"), bw_compiler=keep("bw"),
                            partition_fn=min_cut_rematerialization_partition, decompositions=select_decomp_table())
    pred = torch.randn(2, tokens // 2, vocab, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, vocab, (2, tokens // 2))
    compiled(pred, labels).backward()
    outputs = [n.meta["val"] for n in graphs["fw"].graph.output_node().args[0][1:]]  # after the loss: saved
    assert sorted((tuple(v.shape), v.dtype) for v in outputs if v.numel() > 1) == sorted(
        [((2, tokens // 2, vocab), torch.bfloat16), ((2, tokens // 2), torch.int64),
         ((tokens, 1), torch.float32), ((tokens, 1), torch.float32)])
    grads = [n.meta["val"] for n in graphs["bw"].graph.output_node().args[0] if n is not None]
    assert [(tuple(g.shape), g.dtype) for g in grads] == [((2, tokens // 2, vocab), torch.bfloat16)]
    if shutil.which("g++") or shutil.which("c++"):
        from torch._inductor.utils import run_and_get_code

        torch._dynamo.reset()
        _, codes = run_and_get_code(lambda: torch.compile(_ce)(pred, labels).backward())
        sizes = [line for code in codes for line in code.splitlines() if "empty_strided_cpu((" in line]
        assert [line for line in sizes if f"{vocab}" in line] == [line for line in sizes if "bfloat16" in line
                                                                   and f"{vocab}" in line], sizes
        assert len([line for line in sizes if f"{vocab}" in line]) == 1, sizes

    cluster = load_cluster("h100-sxm")
    seq, mbs = 256, 2
    graph = profile(f"llama:layers=2,hidden=256,heads=4,kv_heads=2,ffn=512,vocab={vocab * 32}", seq, batch=1,
                    dtype="bf16")
    head = graph.layers[-1]

    def cost(**kw):
        config = parallel_config(cluster, gpus=1, global_batch=mbs, mbs=mbs, engine="torchtitan", **kw)
        return layer_cost(head, config, cluster, graph.info, state_recipe="zero-paper")

    eager, compiled_loss = cost(torch_compile=True, compile_loss=False), cost(torch_compile=True)
    logits = seq * mbs * vocab * 32
    assert compiled_loss.buffer_bytes == pytest.approx(2 * logits)
    assert eager.activation_bytes - compiled_loss.activation_bytes == pytest.approx(4 * logits - 2 * logits - 8 * seq * mbs)
    assert cost(compile_loss=True).buffer_bytes == compiled_loss.buffer_bytes  # the loss alone compiled


def test_megatron_head_under_te_loss_keeps_the_bf16_logits_alone():
    """Megatron's output layer (TP 2, SP): its own and the fused (`native`) loss keep the fp32
    softmax (4V) beside the bf16 logits until cast (bV working); Transformer Engine's (`te`) writes
    the gradient into the bf16 logits in place and saves them: bV kept, nothing working (exact)."""
    cluster = load_cluster("h100-sxm")
    graph = profile(SPEC, SEQ, batch=1, dtype="bf16")

    def head(fusion):
        config = parallel_config(cluster, gpus=TP, global_batch=MBS, tp=TP, mbs=MBS, sp=True, engine="megatron",
                                 cross_entropy_fusion=fusion)
        return layer_cost(graph.layers[-1], config, cluster, graph.info, state_recipe="zero-paper")

    logits = SEQ * MBS * VOCAB / TP
    none, native, te = head("none"), head("native"), head("te")
    assert (native.activation_bytes, native.buffer_bytes) == (none.activation_bytes, none.buffer_bytes)
    assert none.buffer_bytes == pytest.approx(2 * logits)
    assert none.activation_bytes - te.activation_bytes == pytest.approx((4 - 2) * logits)
    assert te.buffer_bytes == 0
