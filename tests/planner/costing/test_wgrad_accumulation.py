"""Weight-gradient GEMMs that accumulate into the gradient buffer (`engine_rules.WGRAD_ACCUMULATING_ENGINES`,
Megatron-Core's `gradient_accumulation_fusion`): the GEMM reads and writes `main_grad` in the buffer's dtype
each micro-batch (`gemm.gemm_time_s`'s `accumulate_bytes`), worked by hand on H100 SXM."""
from __future__ import annotations

from functools import lru_cache

import pytest

from meshplan.planner.contracts.engine_rules import grad_buffer_bytes, wgrad_accumulator_bytes
from meshplan.planner.costing import gemm, moe_compute
from meshplan.planner.costing.engine_memory import engine_state_bytes
from meshplan.planner.costing.hardware import load_cluster
from tests.planner.costing.meshes import mesh

H100 = load_cluster("h100-sxm")
# A Qwen3-235B-shaped routed expert (hidden 4096, width 1536) on 512 rows: the ModelZoo's TP 4, EP 8 layout at 4K.
HIDDEN, WIDTH, ROWS = 4096, 1536, 512
QWEN3_LIKE = "moe:layers=1,hidden=4096,heads=32,kv_heads=4,experts=128,top_k=8,expert_ffn=1536,vocab=1024"


def _bandwidth() -> float:
    return H100.device.memory_bw_bytes_per_s * H100.device.memory_efficiency


def _compute_s(m: int, n: int, k: int) -> float:
    """FLOPs at peak x matmul_efficiency x size curve x wave efficiency, by hand."""
    device = H100.device
    flops = 2.0 * m * n * k
    return flops / (device.peak_flops("bf16") * device.matmul_efficiency * flops
                    / (flops + device.matmul_half_efficiency_flops) * gemm.wave_efficiency(m, n, device.num_sms))


def test_an_accumulating_weight_gradient_reads_and_writes_the_buffer():
    """The expert's weight gradient (4096 x 1536 over 512 rows): 6.4 GFLOP, about 14 us of compute.
    Written once in bf16 it moves 2 (m k + k n) + 2 m n = 18.4 MB (6.5 us): compute-bound. Accumulated
    into an fp32 buffer it moves 2 (m k + k n) + 8 m n = 56.1 MB (19.7 us): memory-bound. Into a bf16
    buffer 30.9 MB (10.9 us): compute-bound again."""
    m, n, k = HIDDEN, WIDTH, ROWS
    assert gemm.wave_efficiency(m, n, H100.device.num_sms) == pytest.approx(384 / 396)  # 128 x 128 tiles, 3 waves
    operands = 2.0 * (m * k + k * n)
    compute_s = _compute_s(m, n, k)
    assert compute_s == pytest.approx(13.7e-6, rel=0.01)
    written_s = gemm.gemm_time_s(m, n, k, H100, "bf16")
    assert written_s == pytest.approx(compute_s, rel=1e-12) and (operands + 2 * m * n) / _bandwidth() < compute_s
    fp32_s = gemm.gemm_time_s(m, n, k, H100, "bf16", accumulate_bytes=4)
    assert fp32_s == pytest.approx((operands + 8.0 * m * n) / _bandwidth(), rel=1e-12)
    assert fp32_s == pytest.approx(19.7e-6, rel=0.01)
    assert gemm.gemm_time_s(m, n, k, H100, "bf16", accumulate_bytes=2) == pytest.approx(compute_s, rel=1e-12)
    # on enough rows the same accumulation hides under the FLOPs: 2048 rows are compute-bound either way
    assert gemm.gemm_time_s(m, n, 2048, H100, "bf16", accumulate_bytes=4) == pytest.approx(
        gemm.gemm_time_s(m, n, 2048, H100, "bf16"), rel=1e-12)


def test_only_the_linears_weight_gradient_accumulates():
    shape = (HIDDEN, WIDTH, True)
    fwd, dgrad, wgrad = gemm.linear_gemms_s(shape, ROWS, 1, H100, "bf16", wgrad_accumulate_bytes=4)
    assert (fwd, dgrad) == gemm.linear_gemms_s(shape, ROWS, 1, H100, "bf16")[:2]
    assert wgrad == gemm.gemm_time_s(HIDDEN, WIDTH, ROWS, H100, "bf16", accumulate_bytes=4)
    assert gemm.linear_times_s((shape,), ROWS, 1, H100, "bf16", wgrad_accumulate_bytes=4) == (fwd, dgrad + wgrad)


@pytest.mark.parametrize("engine, precision, bf16_grads, expected", [
    ("megatron", "bf16-mixed", False, 4.0),   # fp32 main_grad: Megatron-LM accumulates bf16 training in fp32
    ("megatron", "bf16-mixed", True, 2.0),    # --grad-reduce-in-bf16
    ("megatron", "fp8", False, 4.0),
    ("megatron", "fp32", False, 4.0),
    ("torchtitan", "bf16-mixed", False, 0.0),  # autograd writes a new gradient
    ("meshplan", "bf16-mixed", False, 0.0),
    ("llm-foundry", "bf16-mixed", False, 0.0),
    ("deepspeed", "bf16-mixed", False, 0.0),
])
def test_which_engines_accumulate_and_in_what(engine, precision, bf16_grads, expected):
    config = mesh(dp=2, engine=engine, precision=precision, grad_reduce_in_bf16=bf16_grads)
    assert wgrad_accumulator_bytes(config) == expected
    assert wgrad_accumulator_bytes(None) == 0.0
    if engine == "megatron":  # the buffer the GEMM accumulates into is the one the memory model holds
        grads = engine_state_bytes("megatron", 1.0, 1, 0, precision, grad_reduce_in_bf16=bf16_grads)["grads"]
        assert grad_buffer_bytes(precision, bf16_grads) == grads == expected


@lru_cache(maxsize=1)
def _qwen3_like():
    from meshplan.planner.profiling.profiler import profile

    graph = profile(QWEN3_LIKE, 2048, dtype="bf16")
    return graph, next(layer for layer in graph.layers if layer.expert_params)


def test_megatrons_routed_experts_pay_the_fp32_buffer_on_few_rows():
    """EP 4 of 128 experts at 2048 tokens, top 8: G = 32 experts of m = 2048 x 8 x 4 / 128 = 512 rows.
    Each expert's three weight gradients accumulate into fp32 `main_grad` (memory-bound, above); the
    forward and the input gradients do not change. With a bf16 buffer all three are compute-bound,
    as without accumulation."""
    graph, block = _qwen3_like()
    fp32, bf16 = (mesh(dp=4, ep=4, engine="megatron", grad_reduce_in_bf16=flag) for flag in (False, True))
    assert moe_compute.tokens_per_expert(block, fp32, graph.info, 1.0) == ROWS
    assert moe_compute.local_experts(fp32, graph.info) == 32
    fwd32, bwd32 = moe_compute.grouped_gemm_times_s(block, fp32, H100, graph.info, "bf16", 1.0)
    fwd16, bwd16 = moe_compute.grouped_gemm_times_s(block, bf16, H100, graph.info, "bf16", 1.0)
    extra_s = sum(gemm.gemm_time_s(i, o, ROWS, H100, "bf16", accumulate_bytes=4)
                  - gemm.gemm_time_s(i, o, ROWS, H100, "bf16")
                  for i, o, _ in moe_compute.expert_linear_shapes(block, graph.info))
    assert extra_s > 0
    assert fwd32 == pytest.approx(fwd16, rel=1e-12)
    assert bwd32 - bwd16 == pytest.approx(32 * extra_s, rel=1e-9)
    torchtitan = moe_compute.grouped_gemm_times_s(block, mesh(dp=4, ep=4), H100, graph.info, "bf16", 1.0)
    assert torchtitan == pytest.approx((fwd16, bwd16), rel=1e-12)


def test_a_megatron_command_without_the_fusion_is_named_as_priced_with_it():
    from meshplan.planner.engines.megatron import read_megatron

    args = ("--num-layers 4 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 --vocab-size 32000 "
            "--micro-batch-size 1 --global-batch-size 8 --bf16")
    assert not any("gradient-accumulation" in note for note in read_megatron(args).notes)
    notes = read_megatron(args + " --no-gradient-accumulation-fusion").notes
    assert any(note.startswith("--no-gradient-accumulation-fusion: not modelled by meshplan; priced with") for note in notes)
