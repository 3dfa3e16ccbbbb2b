"""Synthetic plans, predictions and measured runs for the report tests (no profiler or solver)."""
from __future__ import annotations

from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.contracts.cluster import ClusterProfile, DeviceProfile, LinkProfile
from meshplan.planner.contracts.plan import LayerAssignment, ModelRef, Plan
from meshplan.planner.contracts.prediction import Interval

GIB = 1024**3


def cluster(memory_gib: float = 80.0) -> ClusterProfile:
    # Made-up test numbers (not a real device): only their arithmetic matters here.
    device = DeviceProfile(name="TestGPU", memory_bytes=memory_gib * GIB, memory_bw_bytes_per_s=2e12,
                           peak_flops_per_s={"bf16": 500e12, "fp32": 50e12}, reserved_memory_bytes=2 * GIB)
    link = LinkProfile(bw_bytes_per_s=100e9, latency_s=5e-6)
    return ClusterProfile(name="test-cluster", device=device, gpus_per_node=8, intra_node=link,
                          inter_node=LinkProfile(bw_bytes_per_s=25e9, latency_s=1e-5))


def memory(params_gib: float, acts_gib: float) -> dict:
    parts = {"params": params_gib * GIB, "grads": params_gib * GIB, "optimizer": 6 * params_gib * GIB,
             "activations": acts_gib * GIB, "buffers": 0.5 * GIB}
    return {**parts, "total": sum(parts.values())}


def prediction(step_time_s: float, pp: int, fits: bool = True, params_gib: float = 2.0) -> dict:
    per_rank = [memory(params_gib, 4.0 + rank) for rank in range(pp)]
    bubble = (pp - 1) / (pp - 1 + 8) if pp > 1 else 0.0
    compute = step_time_s * (1 - bubble) * 0.8
    return {"step_time_s": step_time_s, "tokens_per_s": 8 * 1024 / step_time_s, "model_tflops_per_gpu": 120.0,
            "hw_tflops_per_gpu": 150.0, "mfu": 0.24, "peak_memory_bytes": max(m["total"] for m in per_rank),
            "memory_bytes": per_rank, "bubble_fraction": bubble, "fits": fits,
            "breakdown": {"compute": compute, "tp_comm": step_time_s * 0.1, "dp_comm": step_time_s * 0.05,
                          "pp_comm": step_time_s * 0.05 * (1 - bubble), "bubble": step_time_s * bubble,
                          "optimizer": 0.0}}


def make_plan(spec: str = "gpt:layers=4,hidden=64,heads=4,vocab=128", num_blocks: int = 4, pp: int = 2,
              dp: int = 2, tp: int = 2, step_time_s: float = 0.5, with_alternatives: bool = True) -> Plan:
    config = ParallelConfig(gpus=pp * dp * tp, global_batch=16, tp=tp, pp=pp, dp=dp, microbatch_size=1)
    names = ["embed"] + [f"blocks.{i}" for i in range(num_blocks)] + ["head"]  # the zoo's layer names
    per_stage = -(-len(names) // pp)
    layers = tuple(LayerAssignment(name=name, stage=min(i // per_stage, pp - 1), tp=tp, dp=dp,
                                   recompute="full" if i % 3 == 1 else "none",
                                   fwd_time_s=1e-3 * (1 + i % 2), bwd_time_s=2e-3 * (1 + i % 2),
                                   comm_time_s=2e-4, mem_bytes=0.25 * GIB * (1 + i % 3))
                   for i, name in enumerate(names))
    alternatives = ()
    if with_alternatives:
        alternatives = (
            {"mesh": {"pp": 1, "dp": 8, "tp": 1}, "zero": 0, "sp": False, "recompute": "none",
             "schedule": {"name": "1f1b", "microbatches": 2, "microbatch_size": 1, "virtual_stages": 1},
             "prediction": prediction(step_time_s * 0.8, 1, fits=False, params_gib=20.0)},
            {"pp": 4, "dp": 2, "tp": 1, "zero": 1, "sp": False, "recompute": "selective", "schedule": "gpipe",
             "microbatch_size": 1, "virtual_stages": 1, "prediction": prediction(step_time_s * 1.3, 4)},
        )
    return Plan(model=ModelRef(spec=spec, seq=1024), cluster=cluster(), config=config, layers=layers,
                prediction=prediction(step_time_s, pp), alternatives=alternatives)


def gpipe_intervals(pp: int, num_microbatches: int, fwd_s: float, bwd_s: float) -> list[Interval]:
    """GPipe by hand: all forwards then all backwards, each stage waiting for its neighbour."""
    out = []
    for stage in range(pp):
        for mb in range(num_microbatches):
            start = (stage + mb) * fwd_s
            out.append(Interval(stage, "compute", "forward", start, start + fwd_s, mb))
        fwd_end = (pp - 1 + num_microbatches) * fwd_s
        for mb in range(num_microbatches):
            start = fwd_end + (pp - 1 - stage + mb) * bwd_s
            out.append(Interval(stage, "compute", "backward", start, start + bwd_s, mb))
    return out


def measured(plan: Plan, step_times_s: list[float], warmup_steps: int = 1, peak_scale: float = 1.0) -> dict:
    ranks_per_stage = plan.config.dp * plan.config.tp
    peaks = [plan.prediction["memory_bytes"][rank // ranks_per_stage]["total"] * peak_scale
             for rank in range(plan.config.gpus)]
    return {"world_size": plan.config.gpus, "plan_digest": plan.digest, "step_times_s": step_times_s,
            "warmup_steps": warmup_steps, "peak_memory_bytes_per_rank": peaks,
            "losses": [5.0 - 0.1 * i for i in range(len(step_times_s))], "tokens_per_s": 1000.0,
            "host": {"hostname": "<testhost>"}, "versions": {"torch": "2.x"}}
