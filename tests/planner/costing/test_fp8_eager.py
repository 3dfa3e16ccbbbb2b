"""torchao's Float8Linear as meshplan prices it, checked in torchao itself on CPU, eagerly and
under AOTAutograd (the graph torch.compile's Inductor receives): the casts it makes eagerly and
compiled (`costing.fp8_eager`, priced against bytes derived by hand), and the kernels rowwise's
gradient GEMMs run (`fp8.Fp8Recipe.rescaled_gradient_gemms`)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.costing import fp8
from meshplan.planner.costing.device_time import memory_time_s
from meshplan.planner.costing.fp8_eager import CAST_BYTES_PER_VALUE, casts_eagerly, column_casts_per_region
from meshplan.planner.costing.fp8_filter import fp8_linears
from meshplan.planner.costing.hardware import load_cluster
from meshplan.planner.profiling.profiler import profile

TOKENS, HIDDEN, KV = 512, 256, 64


class Attention(nn.Module):
    """q, k and v as torchtitan keeps them: three Linears on one input."""

    def __init__(self):
        super().__init__()
        self.wq = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.wk = nn.Linear(HIDDEN, KV, bias=False)
        self.wv = nn.Linear(HIDDEN, KV, bias=False)

    def forward(self, x):
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        return q + (k + v).repeat(1, HIDDEN // KV)


class AbsOn(TorchDispatchMode):
    """Counts `aten.abs` (the first op of every torchao cast: its amax) on tensors of one storage."""

    def __init__(self):
        super().__init__()
        self.storages: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.abs.default:
            key = args[0].untyped_storage().data_ptr()
            self.storages[key] = self.storages.get(key, 0) + 1
        return func(*args, **(kwargs or {}))


def float8_attention(recipe: str):
    torchao_float8 = pytest.importorskip("torchao.float8")
    module = Attention().to(torch.bfloat16)
    torchao_float8.convert_to_float8_training(module, config=torchao_float8.Float8LinearConfig.from_recipe_name(recipe))
    return module


def aot_graphs(module, x):
    """(forward, backward) FX graphs AOTAutograd makes of `module` on `x` with Inductor's partitioner."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    graphs = []

    def keep(graph_module, _):
        graphs.append(graph_module.graph)
        return make_boxed_func(graph_module.forward)

    torch._dynamo.reset()
    compiled = torch.compile(module, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep,
                                                          partition_fn=min_cut_rematerialization_partition))
    compiled(x).float().sum().backward()
    torch._dynamo.reset()
    return graphs


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_eager_float8_linears_each_cast_their_input_twice_and_save_it_in_bf16(recipe):
    """Eagerly, q, k and v each cast the shared input forward and again backward (6 casts, where a
    fused stack makes one), save that input itself (bf16, its storage), and q's output gradient
    is cast once per gradient GEMM: what `fp8_eager` prices."""
    module = float8_attention(recipe)
    x = torch.randn(TOKENS, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(TOKENS, HIDDEN, dtype=torch.bfloat16)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        with AbsOn() as forward:
            y = module(x)
    with AbsOn() as backward:
        y.backward(grad)
    x_storage = x.untyped_storage().data_ptr()
    assert forward.storages.get(x_storage) == 3
    assert backward.storages.get(x_storage) == 3
    assert backward.storages.get(grad.untyped_storage().data_ptr()) == 2  # q's output gradient
    inputs = [t for t in saved if t.shape == x.shape]
    assert len(inputs) == 3 and all(t.dtype == torch.bfloat16 and t.untyped_storage().data_ptr() == x_storage
                                    for t in inputs)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_under_aot_autograd_one_cast_of_the_shared_input_feeds_q_k_and_v(recipe):
    """The graph torch.compile hands Inductor (AOTAutograd, Inductor's min-cut partitioner): its
    common-subexpression pass leaves one amax of the input where eager runs three, the casts a
    fused stack shares (`fp8.cast_values`' one cast per region)."""
    forward, _ = aot_graphs(float8_attention(recipe),
                            torch.randn(TOKENS, HIDDEN, dtype=torch.bfloat16, requires_grad=True))
    x = next(node for node in forward.nodes if node.op == "placeholder"
             and tuple(node.meta["val"].shape) == (TOKENS, HIDDEN))
    assert [user.target for user in x.users].count(torch.ops.aten.abs.default) == 1


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_rowwise_gradient_gemms_run_unscaled_and_are_rescaled_after(recipe):
    """The fp8 GEMMs of one Linear: forward with fast accumulation and the recipe's scales (one per
    tensor; rowwise one per row of the input and per column of the weight); both gradient GEMMs
    without fast accumulation, tensorwise with its scales in the kernel, rowwise on unit scales
    (the tensorwise kernel) with a multiply after each: the pass `gradient_rescale_s` prices."""
    assert fp8.RECIPES[recipe].rescaled_gradient_gemms == (recipe == "rowwise")
    torchao_float8 = pytest.importorskip("torchao.float8")
    module = nn.Sequential(nn.Linear(HIDDEN, KV, bias=False)).to(torch.bfloat16)
    torchao_float8.convert_to_float8_training(module, config=torchao_float8.Float8LinearConfig.from_recipe_name(recipe))
    forward, backward = aot_graphs(module, torch.randn(TOKENS, HIDDEN, dtype=torch.bfloat16, requires_grad=True))

    def gemms(graph):
        out = []
        for node in graph.nodes:
            if node.target is torch.ops.aten._scaled_mm.default:
                args = dict(zip(("a", "b", "scale_a", "scale_b", "bias", "scale_result", "out_dtype", "fast"), node.args))
                out.append((tuple(args["scale_a"].meta["val"].shape), tuple(args["scale_b"].meta["val"].shape),
                            args["scale_a"].target is torch.ops.aten.new_ones.default, bool(args.get("fast", False)),
                            [user.target for user in node.users] == [torch.ops.aten.mul.Tensor]))
        return out

    row_scales = ((TOKENS, 1), (1, KV)) if recipe == "rowwise" else ((), ())
    assert gemms(forward) == [(*row_scales, False, True, False)]
    unscaled = recipe == "rowwise"
    assert gemms(backward) == [((), (), unscaled, False, unscaled)] * 2


def test_only_torchtitan_without_compile_casts_eagerly():
    base = dict(gpus=8, global_batch=8, dp=8, zero=3, precision="fp8", engine="torchtitan")
    assert casts_eagerly(ParallelConfig(**base, fp8_recipe="tensorwise"))
    assert casts_eagerly(ParallelConfig(**base, fp8_recipe="rowwise"))
    assert not casts_eagerly(ParallelConfig(**base, fp8_recipe="rowwise", torch_compile=True))
    assert not casts_eagerly(ParallelConfig(**{**base, "engine": "megatron"}))  # TE's fused linear_qkv, fc1
    assert not casts_eagerly(ParallelConfig(**{**base, "precision": "bf16-mixed", "zero": 3}))
    async_tp = ParallelConfig(gpus=8, global_batch=1, tp=8, sp=True, precision="fp8", fp8_recipe="rowwise",
                              engine="torchtitan", tp_comm_overlap=True)
    assert not casts_eagerly(async_tp)  # async TP runs only compiled


@pytest.fixture(scope="module")
def llama_block():
    graph = profile("llama3-8b", 4096)
    return next(layer for layer in graph.layers if layer.kind == "block"), graph.info


def test_eager_casts_of_a_llama_block_are_each_linear_s_own(llama_block):
    """Llama 3 8B (h 4096, kv 1024, ffn 14336) on one GPU, tensorwise, 2 x 4096 tokens T: eagerly
    each Linear casts its input forward and backward and its output gradient twice, 5 bytes a
    cast (amax read, cast read, fp8 write): inputs T(3h + h + 2h + ffn), output gradients
    T(h + 2 kv + h + 2 ffn + h); the weights as the recipe casts them."""
    block, info = llama_block
    h100 = load_cluster("h100-sxm")
    config = ParallelConfig(gpus=1, global_batch=2, microbatch_size=2, precision="fp8", fp8_recipe="tensorwise",
                            engine="torchtitan")
    tokens, h, kv, ffn = 2 * 4096, 4096, 1024, 14336
    inputs = tokens * (6 * h + ffn)
    grads = tokens * (3 * h + 2 * kv + 2 * ffn)
    weights = fp8.linear_params(block, info) / 1
    linears = fp8_linears(block, info, config, "bf16")
    assert column_casts_per_region(block, linears) == 2.5  # (q, k, v) and (gate, up)
    forward_s, backward_s = fp8._block_cast_times_s(block, info, h100, config, linears, 1, tokens, 2.0)
    weight_bytes = fp8.RECIPES["tensorwise"].weight_cast_bytes
    assert forward_s == pytest.approx(memory_time_s(inputs * CAST_BYTES_PER_VALUE + weights * weight_bytes, h100))
    assert backward_s == pytest.approx(memory_time_s((inputs + 2 * grads) * CAST_BYTES_PER_VALUE, h100))
    compiled_s = fp8._block_cast_times_s(block, info, h100, replace(config, torch_compile=True),
                                         linears, 1, tokens, 2.0)
    assert sum(compiled_s) < 0.5 * (forward_s + backward_s)


def test_a_filter_changes_how_many_linears_cast_each_region(llama_block):
    block, info = llama_block
    config = ParallelConfig(gpus=1, global_batch=1, precision="fp8", fp8_recipe="rowwise", engine="torchtitan")
    for names, casts in ((("k", "v"), 1.5), (("q", "k", "v"), 2.0), (("gate",), 2.0), (("q", "k", "v", "up"), 1.0)):
        linears = fp8_linears(block, info, replace(config, fp8_filter=names), "bf16")
        assert column_casts_per_region(block, linears) == casts, names


# q, k and v as torchtitan's TP plan shards them (ColwiseParallel behind PrepareModuleInput, which
# all-gathers the sequence-sharded input), compiled, on a fake process group of two ranks (its
# collectives are no-ops; the graphs are the ones a TP group compiles): the forward graph's amax
# passes of the gathered input, printed.
_TP_COMPILED_CASTS = r"""
import sys, torch, torch.nn as nn, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, parallelize_module
from torchao import float8
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition

recipe, tokens, hidden, kv = sys.argv[1], 64, 128, 32
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
mesh = init_device_mesh("cpu", (2,))

class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv = (nn.Linear(hidden, n, bias=False) for n in (hidden, kv, kv))
    def forward(self, x):
        return torch.cat([self.wq(x), self.wk(x), self.wv(x)], dim=-1)

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = Attention()
    def forward(self, x):
        return self.attention(x)

block = Block().to(torch.bfloat16)
float8.convert_to_float8_training(block, config=float8.Float8LinearConfig.from_recipe_name(recipe))
parallelize_module(block, mesh, {
    "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
    "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel()})
graphs = []
def keep(gm, _):
    graphs.append(gm.graph)
    return make_boxed_func(gm.forward)
compiled = torch.compile(block, fullgraph=True, backend=aot_autograd(
    fw_compiler=keep, bw_compiler=keep, partition_fn=min_cut_rematerialization_partition))
compiled(torch.randn(2, tokens // 2, hidden, dtype=torch.bfloat16, requires_grad=True)).float().sum().backward()
print(sum(1 for n in graphs[0].nodes if n.target is torch.ops.aten.abs.default
          and tuple(n.args[0].meta["val"].shape) == (2, tokens, hidden)))
dist.destroy_process_group()
"""


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_under_tensor_parallelism_compiled_q_k_and_v_still_share_one_cast(recipe):
    """torchtitan's TP plan (q, k, v column-parallel on the gathered input), compiled: one amax
    pass of the gathered input feeds all three (AOTAutograd's common-subexpression pass sees
    through DTensor), as without TP, so `fp8.cast_values`' one cast per region holds under TP too."""
    import subprocess
    import sys

    pytest.importorskip("torchao.float8")
    done = subprocess.run([sys.executable, "-c", _TP_COMPILED_CASTS, recipe], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "1"
