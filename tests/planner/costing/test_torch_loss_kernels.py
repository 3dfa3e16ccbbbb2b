"""torch's cross-entropy as torchtitan and meshplan's executor run it on a GPU: the output layer's
memory-bound time counted kernel by kernel (`loss_kernels.TORCH_CE_BYTES_PER_LOGIT`), eager,
under `loss_parallel` and compiled."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from meshplan.planner.costing.device_time import memory_time_s
from meshplan.planner.costing.hardware import load_cluster
from meshplan.planner.costing.layer_cost import layer_cost
from meshplan.planner.costing.loss_kernels import TORCH_CE_BYTES_PER_LOGIT
from meshplan.planner.profiling.profiler import profile
from meshplan.planner.simulation.estimator import parallel_config

# Every aten op torch's loss runs on the rank's logits (`cross_entropy(pred.float(), labels)` and its
# backward; under TP the ops of `loss_parallel`'s own log-softmax and fused backward, on a fake
# process group whose collectives are no-ops): bytes of logits-sized tensors each reads and writes,
# per logit. zeros_like reads only its argument's shape; nll_loss, index_put_ and nll_loss_backward
# read or write one value per token, bar nll_loss_backward's zeroed output; views move nothing.
_COUNT_OPS = r"""
import json, sys, torch, torch.distributed as dist, torch.nn.functional as F
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import loss as tp_loss
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

tokens, vocab, tp = (int(a) for a in sys.argv[1:4])
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
mesh = init_device_mesh("cpu", (tp,))
n = tokens * vocab // tp
SHAPE_ONLY, PER_TOKEN = {"aten.zeros_like.default"}, {"aten.nll_loss_forward.default", "aten.index_put_.default"}
ALIASES = {"aten.detach.default", "aten.view.default", "aten._unsafe_view.default", "aten.t.default"}


class Bytes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops, self.total = [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        big = lambda tree: [t.element_size() for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor) and t.numel() == n]
        read, written = sum(big((args, kwargs))), sum(big(out))
        name = str(func)
        if name in SHAPE_ONLY or name == "aten.nll_loss_backward.default":
            read = 0
        if name in PER_TOKEN or name in ALIASES:
            read = written = 0
        if read or written:
            self.ops.append(name.split(".")[1])
            self.total += read + written
        return out


local = torch.randn(tokens, vocab // tp, dtype=torch.bfloat16, requires_grad=tp == 1)
labels = torch.randint(0, vocab, (tokens,))
fwd, bwd = Bytes(), Bytes()
if tp == 1:
    with fwd:
        loss = F.cross_entropy(local.float(), labels)
    with bwd:
        loss.backward()
else:
    with fwd:
        logp = tp_loss._log_softmax(local.float(), 1, False, mesh, 0)
    with bwd:
        grad = tp_loss._nll_loss_and_log_softmax_backward(torch.tensor(1.0), logp, labels, None, 1, -100,
                                                          torch.tensor(float(tokens)), torch.Size((tokens, vocab)),
                                                          1, mesh, 0)
        grad.to(torch.bfloat16)
print(json.dumps([fwd.total, fwd.ops, bwd.total, bwd.ops]))
dist.destroy_process_group()
"""


def _op_bytes(tp: int) -> tuple[float, list[str], float, list[str]]:
    done = subprocess.run([sys.executable, "-c", _COUNT_OPS, "64", "4096", str(tp)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return tuple(json.loads(done.stdout.strip().splitlines()[-1]))


def test_loss_parallel_counts_are_its_ops():
    """Under TP every pass is an aten op of torch's `loss_parallel` (cast, amax, shift, exp, sum,
    log-probs; zeroed mask, exp, add, product, cast back): the counts are their bytes (exact)."""
    fwd, fwd_ops, bwd, bwd_ops = _op_bytes(tp=4)
    assert fwd_ops == ["_to_copy", "amax", "sub", "exp", "sum", "sub"]
    assert bwd_ops == ["zeros_like", "exp", "add", "mul", "_to_copy"]
    assert TORCH_CE_BYTES_PER_LOGIT["loss_parallel"] == (fwd, bwd) == (38, 38)


def test_eager_counts_are_its_ops_and_the_softmax_kernels_extra_passes():
    """Unsharded, log_softmax and its backward are one op each; torch's CUDA kernels for a row too
    long for their shared-memory variant (SoftMax.cu, above 12K fp32 values: every LLM vocabulary)
    read the input twice more forward (max, then sum of exponentials, before the pass that writes)
    and the gradient once more backward (its sum): 8 and 4 bytes per logit beyond the ops'."""
    fwd, fwd_ops, bwd, bwd_ops = _op_bytes(tp=1)
    assert fwd_ops == ["_to_copy", "_log_softmax"]
    assert bwd_ops == ["nll_loss_backward", "_log_softmax_backward_data", "_to_copy"]
    assert TORCH_CE_BYTES_PER_LOGIT["eager"] == (fwd + 2 * 4, bwd + 4) == (22, 26)


def _head(cluster_name: str, tp: int, **kw):
    vocab, seq, mbs = 65536, 256, 2
    cluster = load_cluster(cluster_name)
    graph = profile(f"llama:layers=2,hidden=256,heads=4,kv_heads=2,ffn=512,vocab={vocab}", seq, batch=1, dtype="bf16")
    config = parallel_config(cluster, gpus=tp, global_batch=mbs, tp=tp, mbs=mbs, sp=tp > 1, engine="torchtitan",
                             torch_compile=True, **kw)
    cost = layer_cost(graph.layers[-1], config, cluster, graph.info, state_recipe="zero-paper")
    return cost, cluster, seq * mbs * vocab / tp


@pytest.mark.parametrize("tp,eager", [(1, "eager"), (2, "loss_parallel")])
def test_compiling_the_loss_saves_the_bytes_its_kernels_do_not_move(tp, eager):
    """torchtitan's output layer with the loss eager or compiled (`compile_loss`): forward and
    backward differ by exactly the bytes per logit the compiled kernels skip, over the rank's logits,
    at the device's achieved bandwidth; nothing else in the layer depends on it (rel 1e-9)."""
    (compiled, cluster, logits), (eagerly, _, _) = _head("h100-sxm", tp), _head("h100-sxm", tp, compile_loss=False)
    (fwd_eager, bwd_eager), (fwd_compiled, bwd_compiled) = TORCH_CE_BYTES_PER_LOGIT[eager], TORCH_CE_BYTES_PER_LOGIT["compiled"]
    assert eagerly.fwd_compute_s - compiled.fwd_compute_s == pytest.approx(
        memory_time_s((fwd_eager - fwd_compiled) * logits, cluster), rel=1e-9)
    assert eagerly.bwd_compute_s - compiled.bwd_compute_s == pytest.approx(
        memory_time_s((bwd_eager - bwd_compiled) * logits, cluster), rel=1e-9)


def test_a_cpu_profile_keeps_the_calibrated_rule():
    """On a CPU profile the loss is another library's kernels, which `calibrate` measures: the
    output layer's time does not depend on how torch's CUDA kernels would run it."""
    compiled, _, _ = _head("cpu", 1)
    eagerly, _, _ = _head("cpu", 1, compile_loss=False)
    assert (compiled.fwd_compute_s, compiled.bwd_compute_s) == (eagerly.fwd_compute_s, eagerly.bwd_compute_s)
