"""`benchmarks/gpu_step_profile.py`, the step profile `gpu_check.py` takes of each plan it trains:
the union of kernel intervals by hand, the refusals, and one profiled CPU step of a bf16-mixed
plan (the executor's FSDP2 `replicate`, whose hooks it times)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_step_profile.py"


def _module():
    spec = importlib.util.spec_from_file_location("gpu_step_profile", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_busy_time_is_the_union_of_kernel_intervals():
    busy = _module()._busy_us
    # [0, 10) and [5, 12) overlap (12 us), [20, 25) apart (5), [21, 22) inside it (0)
    assert busy([(20.0, 25.0), (0.0, 10.0), (5.0, 12.0), (21.0, 22.0)]) == 17.0
    assert busy([]) == 0.0


def test_kernel_kinds_of_names_an_h200_step_ran():
    kind = _module().kernel_kind
    assert kind("nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NTN") == "matmul"
    assert kind("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26") == "attention"
    assert kind("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<...>") == "optimizer"
    assert kind("ncclDevKernel_AllReduce_Sum_f32_RING_LL") == "communication"
    assert kind("Memcpy DtoD (Device -> Device)") == "copy"
    assert kind("void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<c10::BFloat16>>") \
        == "memory-bound"
    assert kind("void at::native::reduce_kernel<128, 4, at::native::ReduceOp<c10::BFloat16>>") == "memory-bound"


def test_a_missing_plan_is_refused_in_one_line(tmp_path, capsys):
    assert _module().main([str(tmp_path / "none.json")]) == 2
    assert "no plan at" in capsys.readouterr().err


def test_one_profiled_cpu_step(run_cli, tmp_path):
    plan = tmp_path / "plan.json"
    code, out, err = run_cli("plan", "--model", "gpt:layers=2,hidden=64,heads=4,vocab=256", "--cluster", "cpu",
                             "--gpus", 1, "--gbs", 4, "--seq", 32, "--mbs", 2, "--precision", "bf16-mixed",
                             "--out", plan)
    assert code == 0, err
    result = _module().profile_plan(str(plan), steps=1, warmup=1)
    assert result["dp_method"] == "replicate" and result["num_microbatches"] == 2
    assert result["device"] == "cpu" and result["kernels_per_step"] == 0
    assert result["wall_ms_per_step"] > 0 and result["device_busy_ms_per_step"] > 0
    assert result["host_ops_per_step"] > 100 and result["fsdp_hook_host_ms_per_step"] > 0
    assert any(name.startswith("aten::") for name, _ in result["top_host_ops_self_ms_per_step"])
    assert result["kernel_ms_per_step_by_kind"] == {}  # no kernels on CPU
    json.dumps(result)  # what gpu_check stores
