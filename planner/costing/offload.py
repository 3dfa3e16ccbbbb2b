"""Model states in host memory (`ParallelConfig.offload`): what leaves the device and what it costs.

The engines' offloading, which meshplan prices and exports (its own executor keeps every state on
the device, `costing.executable`):
- "optimizer": the optimizer's states (fp32 master weights and Adam moments) live in host memory
  and the optimizer steps there: DeepSpeed ZeRO-Offload (`zero_optimization.offload_optimizer`,
  any ZeRO stage), Megatron-LM's `--optimizer-cpu-offload` (its offload fraction 1.0). Each step
  the rank's owned gradients go down to the host and the updated parameters come back up, in the
  compute dtype: 2 + 2 bytes per parameter under bf16-mixed, the "4M" of ZeRO-Offload (Ren et al.
  2021, "ZeRO-Offload: Democratizing Billion-Scale Model Training", USENIX ATC, section 4.1).
- "params": also the parameters and gradients (ZeRO-3 only): DeepSpeed ZeRO-Infinity
  (`offload_param`), FSDP2's `CPUOffloadPolicy` (torchtitan's `enable_cpu_offload`). Each
  micro-batch's forward and backward copy the rank's shard up before gathering it; the step
  updates the parameters where they live, so nothing comes back after it.

Time, per step on one rank owning P parameters' states (`LayerCost.owned_params`):
- the CPU optimizer step: Adam is memory-bound, so P x `optimizer_bytes_per_param` (the bytes
  the device's step streams) at the host's DRAM bandwidth, shared by the node's GPUs stepping
  together: `host_memory_bw_bytes_per_s` / `gpus_per_node`. It replaces the device's own streaming
  of those bytes (the per-tensor fixed costs stay: the CPU step loops over tensors as well);
- the gradients' copy down overlaps the backward (ZeRO-Offload section 4.2: the copy of each
  gradient partition starts as soon as it is reduced, on its own stream; DeepSpeed's
  `overlap_comm`), so only what the layer's backward compute cannot hide is charged;
- the parameters' copy up after the CPU step is on the critical path (the next forward needs
  them; ZeRO-Offload's one-step delayed update, which would hide it, is off by default);
- "params" adds the shard's copy up before each forward and each backward, on the compute path.
Bytes move at `host_link_bw_bytes_per_s` (one GPU's PCIe or C2C link, one direction).

Memory: the moved states leave the device; ZeRO-3's gathered copy and the backward's transient
gradient stay where `activation_memory` / `layer_cost` count them (buffers). On the host, the
states of every GPU of a node share its DRAM (`host_memory_bytes`): their sum on the heaviest node
(`host_state_bytes_per_node`) must fit in what the node's processes leave free
(`usable_host_memory_bytes`). That one rule decides `Prediction.fits` for the simulator and so
for estimate and simulate, and prunes the search's candidates (`search.offloading`).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from meshplan.planner.contracts.cluster import ClusterProfile
from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.costing.precision import recipe

# The LayerCost memory fields each mode moves to host memory.
MOVED_STATES = {"none": (), "optimizer": ("optimizer_bytes",),
                "params": ("param_bytes", "grad_bytes", "optimizer_bytes")}
# Host memory each GPU's training process keeps for itself, not for offloaded states: the process's
# own resident memory (PyTorch, the CUDA and NCCL libraries and their host allocations, a few GiB),
# its data loader's worker processes (each a forked copy of the trainer's Python state, a few GiB
# apiece at the usual 2-4 workers) with their pinned batch buffers, the pinned staging buffers the
# offloading engines copy through (DeepSpeed's `pin_memory`, FSDP2's pinned CPU shards), and its
# share of the OS and page cache. 32 GiB per GPU: 1/8 of a 2 TB DGX node, 256 GiB of the node.
HOST_RESERVED_BYTES_PER_GPU = 32 * 2**30


def check_offload(config: ParallelConfig, cluster: ClusterProfile) -> None:
    """MeshplanError unless the profile describes the host link and memory offloading uses."""
    if config.offload == "none":
        return
    device = cluster.device
    missing = [name for name in ("host_link_bw_bytes_per_s", "host_memory_bw_bytes_per_s")
               if getattr(device, name) <= 0]
    if missing:
        raise MeshplanError(
            f"--offload {config.offload}: profile {cluster.name!r} describes no {' or '.join(missing)} "
            "(a CPU profile's device is the host: offloading moves nothing); add the field to the profile "
            "or use --offload none")


def offloaded_state_bytes(param_bytes: float, grad_bytes: float, optimizer_bytes: float,
                          offload: str) -> dict[str, float]:
    """Device bytes of the model states `(params, grads, optimizer)` under `offload`, and what
    moved to the host (`host`): the one memory rule of offloading, whichever recipe gave the bytes."""
    if offload not in MOVED_STATES:
        raise ValueError(f"offload must be one of {', '.join(MOVED_STATES)}, got {offload!r}")
    states = {"param_bytes": param_bytes, "grad_bytes": grad_bytes, "optimizer_bytes": optimizer_bytes}
    moved = MOVED_STATES[offload]
    return {**{name: 0.0 if name in moved else value for name, value in states.items()},
            "host": sum(states[name] for name in moved)}


def usable_host_memory_bytes(cluster: ClusterProfile) -> float:
    """Host bytes a node leaves for offloaded states: its DRAM less `HOST_RESERVED_BYTES_PER_GPU`
    for each of its GPUs' processes. A profile without `host_memory_bytes` (one written before the
    field, as embedded in an older plan) leaves them unchecked: inf."""
    if cluster.device.host_memory_bytes <= 0:
        return math.inf
    return max(0.0, cluster.device.host_memory_bytes - HOST_RESERVED_BYTES_PER_GPU * cluster.gpus_per_node)


def host_state_bytes_per_node(rank_host_bytes: Sequence[float], gpus: int, gpus_per_node: int) -> float:
    """Offloaded bytes on the heaviest node: `rank_host_bytes[r]` on each GPU of pipeline rank r.
    Ranks are numbered pipeline-major (`contracts.axes`: pp outermost, so a pipeline stage is
    gpus / pp consecutive GPUs) and filled into nodes of `gpus_per_node` in order."""
    pp = len(rank_host_bytes)
    if pp == 0 or gpus % pp:
        raise ValueError(f"{gpus} GPUs do not split into {pp} pipeline stages")
    if not any(rank_host_bytes):
        return 0.0
    stage_gpus = gpus // pp
    heaviest = 0.0
    for first in range(0, gpus, gpus_per_node):
        last = min(first + gpus_per_node, gpus)  # GPUs [first, last) share one host
        total = 0.0
        for stage in range(first // stage_gpus, (last - 1) // stage_gpus + 1):
            shared = min(last, (stage + 1) * stage_gpus) - max(first, stage * stage_gpus)
            total += shared * rank_host_bytes[stage]
        heaviest = max(heaviest, total)
    return heaviest


def host_fits(bytes_per_node: float, usable_host_bytes: float) -> bool:
    """Whether a node's offloaded states fit in the host bytes it leaves them
    (`usable_host_memory_bytes`); nothing offloaded always fits."""
    return bytes_per_node <= 0 or bytes_per_node <= usable_host_bytes


def host_refusal(bytes_per_node: float, config: ParallelConfig, cluster: ClusterProfile) -> str:
    """Why `config`'s offloaded states do not fit on a node's host, and what would."""
    gpus_on_node = min(config.gpus, cluster.gpus_per_node)
    moved = {"optimizer": "optimizer states", "params": "parameters, gradients and optimizer states"}[config.offload]
    if config.zero == 0:  # every data-parallel rank holds all the states
        fixes = ["--zero 1 or higher, which shards the offloaded optimizer states over the data-parallel ranks"]
    elif config.shard_group:  # HSDP replicates them across shard groups
        fixes = ["a larger --shard-group (HSDP keeps a copy of the states in each shard group)"]
    else:  # ZeRO shards them over the data-parallel ranks, so each node holds 1 / nodes of them
        fixes = ["more nodes (ZeRO shards the offloaded states over the data-parallel ranks of all of them)"]
    if config.offload == "params":
        fixes.append("--offload optimizer (the parameters and gradients stay on the GPUs)")
    return (f"does not fit in host memory: the offloaded {moved} of {gpus_on_node} GPU(s) take "
            f"{bytes_per_node / 2**30:.1f} GiB on the busiest node, which leaves "
            f"{usable_host_memory_bytes(cluster) / 2**30:.1f} GiB of its {cluster.device.host_memory_bytes / 2**30:.0f} "
            f"GiB to them ({HOST_RESERVED_BYTES_PER_GPU / 2**30:.0f} GiB kept per GPU for its process and data "
            f"loader); use {', or '.join(fixes)}")


def host_times_s(owned_params: float, bwd_compute_s: float, config: ParallelConfig,
                 cluster: ClusterProfile) -> dict[str, float]:
    """The offloading's times on one rank: `step_s` added to the optimizer step (CPU step less the
    device's own streaming, parameters up, gradients down beyond the backward), `pass_s` added to
    each forward and each backward ("params": the shard up)."""
    if config.offload == "none" or owned_params <= 0:
        return {"step_s": 0.0, "pass_s": 0.0}
    device = cluster.device
    link = device.host_link_bw_bytes_per_s
    host_bw = device.host_memory_bw_bytes_per_s / cluster.gpus_per_node
    bytes_per_param = recipe(config.precision)
    streamed = owned_params * cluster.optimizer_bytes_per_param
    cpu_step_s = streamed / host_bw - streamed / (device.memory_bw_bytes_per_s * device.memory_efficiency)
    grad_down_s = owned_params * bytes_per_param["grad"] / link
    shard_up_s = owned_params * bytes_per_param["param"] / link
    step_s = cpu_step_s + max(0.0, grad_down_s - bwd_compute_s)
    if config.offload == "params":
        return {"step_s": step_s, "pass_s": shard_up_s}
    return {"step_s": step_s + shard_up_s, "pass_s": 0.0}


def with_offload(cost, config: ParallelConfig, cluster: ClusterProfile):
    """`cost` (a `layer_cost.LayerCost`) with `config.offload`'s states moved to the host and its
    transfers and CPU step added."""
    if config.offload == "none":
        return cost
    check_offload(config, cluster)
    states = offloaded_state_bytes(cost.param_bytes, cost.grad_bytes, cost.optimizer_bytes, config.offload)
    times = host_times_s(cost.owned_params, cost.bwd_compute_s, config, cluster)
    before = cost.param_bytes + cost.grad_bytes + cost.optimizer_bytes
    kept = (before - states["host"]) / before if before > 0 else 1.0  # the experts' states move alike
    return cost.replaced(param_bytes=states["param_bytes"], grad_bytes=states["grad_bytes"],
                   optimizer_bytes=states["optimizer_bytes"], host_state_bytes=states["host"],
                   expert_state_bytes=cost.expert_state_bytes * kept,
                   optimizer_step_s=cost.optimizer_step_s + times["step_s"],
                   fwd_compute_s=cost.fwd_compute_s + times["pass_s"],
                   bwd_compute_s=cost.bwd_compute_s + times["pass_s"])
