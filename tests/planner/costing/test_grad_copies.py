"""FSDP2's (and FSDP1's) mixed-precision gradient copies (`state_memory.grad_copy_bytes_per_param`): the bytes by
engine, ZeRO stage and precision; a layer's backward under meshplan's executor is the "generic"
engine's (the same rules without what only FSDP2 pays) plus exactly those bytes at the profile's
memory bandwidth; and the engine "generic" has no config file to read."""
from __future__ import annotations

from dataclasses import replace

import pytest

from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.costing.device_time import memory_time_s
from meshplan.planner.costing.hardware import load_cluster
from meshplan.planner.costing.layer_cost import grad_copy_params, layer_cost
from meshplan.planner.costing.state_memory import grad_copy_bytes_per_param
from meshplan.planner.profiling.profiler import profile


def _config(**kw) -> ParallelConfig:
    base = dict(gpus=8, global_batch=64, dp=8, microbatch_size=2, zero=1, precision="bf16-mixed")
    return ParallelConfig(**{**base, **kw})


@pytest.mark.parametrize("kw, expected", [
    (dict(), 10.0),  # ZeRO-1: sync waits for the last micro-batch, fp32 accumulation: read 2 + 4, write 4
    (dict(zero=0), 10.0),
    (dict(zero=2), 6.0),  # every micro-batch's bf16 gradient cast into the fp32 reduce-scatter input
    (dict(zero=3), 6.0),
    (dict(engine="torchtitan"), 6.0),  # its trainer reduces every micro-batch
    (dict(engine="megatron"), 0.0),  # accumulated inside the weight-gradient GEMM
    (dict(engine="generic"), 0.0),
    (dict(precision="fp32"), 0.0),
    (dict(precision="fp8"), 0.0),
    # torch FSDP1 under Composer's DEFAULT mixed precision (llm-foundry): the bf16 gradient cast to
    # fp32 (read 2, write 4) and divided in place before the reduction (read 4, write 4), every
    # micro-batch at every stage, fp8 Linears' bf16 parameters alike; no divide without a data group
    (dict(engine="llm-foundry", zero=3), 14.0),
    (dict(engine="llm-foundry", zero=0), 14.0),
    (dict(engine="llm-foundry", zero=3, precision="fp8"), 14.0),
    (dict(engine="llm-foundry", gpus=1, dp=1, global_batch=8, zero=0), 6.0),
    (dict(engine="llm-foundry", precision="fp32"), 0.0),
])
def test_bytes_per_parameter(kw, expected):
    assert grad_copy_bytes_per_param(_config(**kw)) == expected


def test_a_split_backward_schedule_runs_zero2_as_zero1_and_pays_its_copies():
    config = _config(gpus=16, pp=2, zero=2, schedule="zbv", virtual_stages=2, global_batch=64, microbatch_size=1)
    assert grad_copy_bytes_per_param(config) == 10.0


@pytest.mark.parametrize("spec", ["llama:layers=2,hidden=1024,heads=8,vocab=32000",
                                  "moe:layers=2,hidden=512,heads=8,kv_heads=4,experts=8,top_k=2,expert_ffn=256,vocab=8000"])
def test_meshplan_backward_is_generic_plus_the_copies(spec, without_eager_count):
    """With its eager kernels' and loss's counts set aside (each tested on its own), meshplan's
    executor on a GPU prices a layer as `generic` does plus FSDP2's gradient copies."""
    graph = profile(spec, 1024, dtype="bf16")
    cluster = load_cluster("h100-sxm")
    config = _config(tp=2, dp=4, ep=2 if spec.startswith("moe") else 1)
    for layer in graph.layers:
        own = layer_cost(layer, config, cluster, graph.info)
        generic = layer_cost(layer, replace(config, engine="generic"), cluster, graph.info)
        assert own.fwd_compute_s == generic.fwd_compute_s
        assert (own.param_bytes, own.grad_bytes, own.activation_bytes, own.buffer_bytes) == \
            (generic.param_bytes, generic.grad_bytes, generic.activation_bytes, generic.buffer_bytes)
        extra_s = own.bwd_compute_s - generic.bwd_compute_s
        params = grad_copy_params(layer, graph.info, 2, config.ep, config.expert_tp)  # what the search's bounds read
        assert extra_s == pytest.approx(memory_time_s(10.0 * params, cluster), rel=1e-6), layer.name
        if layer.kind == "block":  # by hand: the dense part split over tp 2, routed experts over ep 2 x etp 2
            assert params == pytest.approx((layer.num_params - layer.expert_params) / 2 + layer.expert_params / 4)

def test_generic_has_no_config_file(run_cli, tmp_path):
    config = tmp_path / "job.toml"
    config.write_text("[job]\n")
    code, _, err = run_cli("estimate", "--from", config, "--engine", "generic", "--cluster", "h100-sxm")
    assert code == 2 and "engine generic has no config file" in err
