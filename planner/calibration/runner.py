"""`calibrate`: measure this machine with the processes it will train with, into a ClusterProfile.

`calibrate(nproc, backend)` spawns `nproc` processes (torch.multiprocessing, file rendezvous)
that, all at once as in training:

- time square matmuls at several sizes and fit time = f / R + f_half / R (the cost model's
  efficiency curve: a GEMM of f FLOPs runs at R f / (f + f_half)); R / peak becomes
  `matmul_efficiency`, f_half `matmul_half_efficiency_flops` (on GPUs with the tile and wave
  quantisation `costing.gemm` adds taken out first, `fits.without_waves`);
- time a large copy (memory bandwidth) and one tiny transformer block forward (the fixed
  per-layer dispatch cost, `kernel_overhead_s`);
- time 3x3 convolutions forward + backward (`CONV_SHAPES`): their throughput against the GEMM
  curve's for the same FLOPs is `conv_efficiency`;
- time causal flash attention (SDPA) forward + backward at several sequence lengths: its FLOPs (the causal half) over its time, against peak, is
  `attention_efficiency`, which takes the attention core off the GEMM curve;
- time a GPT block's forward + backward at several shapes, count its FLOPs (FlopCounterMode) and
  the bytes autograd saves; what the GEMM curve and the overhead do not explain is memory-bound
  traffic: `elementwise_bytes_per_activation_byte` is fitted to that leftover over all shapes;
- time GEMMs across widths on CPU (`gemm_sweep`): `matmul_width_efficiency`;
- time all-reduce, all-gather, reduce-scatter and send/recv at several sizes (in
  `conditions.COLLECTIVE_ROUNDS` rounds, each the median of its rounds), and fit the ring
  alpha-beta model of `planner.costing.collectives` jointly: t = volume(S, n) / B + hops(n) * alpha;
  then each kind's own bandwidth at that alpha: B is the fastest kind's, the others' fractions
  of it are the link's `kind_efficiency`;
- on CPU processes, the fixed costs of `planner.costing.fixed_costs` (optimizer per tensor and per
  parameter, TP and FSDP per layer pass, pipeline per action) and the share of a core each
  process gets when all compute at once (`planner.calibration.microbench`), which scales every rate
  measured in CPU time, so that more processes than cores are costed as they run.

The CPU convention: one "GPU" is one local process; memory_bytes = this machine's RAM / nproc.
The processes run as `meshplan train`'s do (`host.threads_per_process` threads each, all at once),
and the profile's `calibration` table records those conditions, the rounds' spread and the host's
load (`conditions`).
The shapes are the device's (`compute_bench.BenchShapes`): small on CPU, training-sized on GPUs.
On GPUs the backend is NCCL and times come from CUDA events. Peak FLOP/s and anything not
measured come from a base profile (`cpu` for gloo; the shipped GPU profile whose device name
matches, else `h100-sxm`). One GPU (`--nproc 1`) measures the device alone: its links, intra-
and inter-node, are the base profile's.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.contracts.cluster import ClusterProfile, LinkProfile
from meshplan.planner.calibration import fits
from meshplan.planner.calibration.conditions import (COLLECTIVE_ROUNDS, calibration_conditions, load_average,
                                                    median_of_rounds)
from meshplan.planner.calibration.compute_bench import (COMPUTE_ROUNDS, Timer, bench_shapes, measure_compute,
                                                       measure_copy)
from meshplan.planner.calibration.gemm_sweep import SWEEP_TOKENS, SWEEP_WIDTHS, measure_gemm_widths
from meshplan.planner.calibration.fits import fit_alpha_beta, fit_conv_efficiency, fit_elementwise_traffic, fit_matmul
from meshplan.planner.costing import attention_kernels
from meshplan.planner.costing.hardware import builtin_profiles, load_cluster

FULL_SIZES = {"comm_bytes": (2**12, 2**16, 2**20, 2**22, 2**24), "copy_bytes": 2**28, "reps": 10}
QUICK_SIZES = {"comm_bytes": (2**12, 2**16, 2**20, 2**22), "copy_bytes": 2**26, "reps": 4}
# GPUs: collectives up to 256 MiB (NVLink's bandwidth term dominates only past tens of MiB) and a
# 1 GiB copy, well past the L2 (50-60 MB on Hopper)
GPU_FULL_SIZES = {"comm_bytes": (2**16, 2**20, 2**22, 2**24, 2**26, 2**28), "copy_bytes": 2**30, "reps": 10}
GPU_QUICK_SIZES = {"comm_bytes": (2**16, 2**20, 2**24, 2**26), "copy_bytes": 2**29, "reps": 4}
MEASURED_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")


def calibrate(nproc: int = 2, backend: str = "gloo", quick: bool = False, name: str = "calibrated",
              base: str | None = None, progress=False) -> ClusterProfile:
    """Measure this machine with `nproc` processes and return the fitted cluster profile.

    `progress`: False, True (a bar of the measurement phases on stderr when it is a terminal) or
    fn(done, total)."""
    import torch
    import torch.multiprocessing as mp

    if backend not in ("gloo", "nccl"):
        raise MeshplanError(f"--backend must be gloo or nccl, got {backend!r}")
    least = 1 if backend == "nccl" else 2  # CPU fixed costs (TP, FSDP, pipeline) are measured between processes
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < least:
        raise MeshplanError(f"--nproc must be at least {least} with --backend {backend}, got {nproc!r}"
                            + ("" if least == 1 else " (the fixed costs of TP, FSDP and pipelines need two processes)"))
    if backend == "nccl" and (not torch.cuda.is_available() or torch.cuda.device_count() < nproc):
        found = torch.cuda.device_count() if torch.cuda.is_available() else 0
        raise MeshplanError(f"--backend nccl needs {nproc} CUDA devices, found {found}; use --backend gloo on CPU")
    cuda = backend == "nccl"
    sizes = {**((GPU_QUICK_SIZES if quick else GPU_FULL_SIZES) if cuda else (QUICK_SIZES if quick else FULL_SIZES)),
             "matmul_n": getattr(bench_shapes(cuda), "quick_matmul_n" if quick else "matmul_n")}
    with tempfile.TemporaryDirectory(prefix="meshplan-calibrate-") as workdir:
        # fork is instant (torch is already imported here); CUDA needs fresh processes
        context = mp.start_processes(_worker, args=(nproc, backend, sizes, workdir), nprocs=nproc, join=False,
                                     start_method="spawn" if backend == "nccl" else "fork")
        _join(context, Path(workdir), NUM_PHASES[backend], progress)
        measured = json.loads((Path(workdir) / "rank0.json").read_text())
    return build_profile(measured, nproc, backend, name, base)


# Phases rank 0 reports (copy, compute, collectives, and on CPU the fixed costs)
NUM_PHASES = {"gloo": 4, "nccl": 3}


def _join(context, workdir: Path, num_phases: int, progress) -> None:
    """Wait for the measuring processes, reporting rank 0's phases; on Ctrl-C stop them all."""
    from meshplan.planner.contracts.progress import progress_reporter

    reporter = progress_reporter(progress, num_phases, "meshplan calibrate", "phase")
    try:
        while not context.join(timeout=0.5):
            if reporter is not None:
                reporter.advance_to(_phases_done(workdir))
    except KeyboardInterrupt:
        for process in context.processes:
            if process.is_alive():
                process.terminate()
        for process in context.processes:
            process.join(timeout=5)
        raise
    finally:
        if reporter is not None:
            reporter.advance_to(_phases_done(workdir))
            reporter.close()


def _phases_done(workdir: Path) -> int:
    try:
        return int((workdir / "phases").read_text() or 0)
    except (OSError, ValueError):
        return 0


def _phase_done(workdir: str, rank: int, count: int) -> None:
    if rank == 0:
        (Path(workdir) / "phases").write_text(str(count))


def _worker(rank: int, nproc: int, backend: str, sizes: dict, workdir: str) -> None:
    import torch
    import torch.distributed as dist

    cuda = backend == "nccl"
    if cuda:
        torch.cuda.set_device(rank)
    else:
        from meshplan.planner.calibration.host import reuse_freed_memory, threads_per_process

        torch.set_num_threads(threads_per_process(nproc))  # as `meshplan train` runs on CPU
        reuse_freed_memory()
    dist.init_process_group(backend, init_method=f"file://{workdir}/rendezvous", rank=rank, world_size=nproc)
    try:
        device = torch.device("cuda", rank) if cuda else torch.device("cpu")
        timer = Timer(cuda, torch.get_num_threads())
        load_before = load_average()
        result = {"dtype": "bf16" if cuda else "fp32", "threads": torch.get_num_threads(),
                  "copy_bw_bytes_per_s": measure_copy(torch, device, sizes["copy_bytes"], sizes["reps"], timer)}
        _phase_done(workdir, rank, 1)
        result.update(measure_compute(torch, device, sizes["matmul_n"], sizes["reps"], timer, cuda))
        if not cuda:  # the GEMM curve by width (GPUs: tiles and waves, `costing.gemm`)
            result["gemm_widths"] = measure_gemm_widths(torch, device, timer, sizes["reps"])
        _phase_done(workdir, rank, 2)
        dist.barrier()
        per_round = {**sizes, "reps": max(2, -(-sizes["reps"] // 2))}  # the rounds, not the repeats, carry the median
        result["collectives"], result["link_spread"] = median_of_rounds(  # one process: no link to measure
            [_measure_collectives(torch, dist, device, rank, nproc, per_round, timer) for _ in range(COLLECTIVE_ROUNDS)]
            if nproc > 1 else [])
        _phase_done(workdir, rank, 3)
        if not cuda:
            result.update(_measure_fixed_costs(torch, dist, nproc, sizes, timer))
            _phase_done(workdir, rank, 4)
        if cuda:
            props = torch.cuda.get_device_properties(rank)
            result.update(device_name=props.name, memory_bytes=props.total_memory)
        if rank == 0:
            result["load_avg_1m"] = max(load_before, load_average())
            (Path(workdir) / "rank0.json").write_text(json.dumps(result))
            if os.environ.get("MESHPLAN_CALIBRATE_DEBUG"):
                print(json.dumps(result, indent=1))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _measure_fixed_costs(torch, dist, nproc: int, sizes: dict, timer) -> dict:
    """CPU processes: core share under contention, optimizer, TP/FSDP and pipeline overheads."""
    from torch.distributed.device_mesh import init_device_mesh

    from meshplan.planner.calibration import microbench as fixed

    mesh = init_device_mesh("cpu", (nproc,))
    reps = sizes["reps"]
    return {"cpu_share": fixed.measure_cpu_share(torch, dist),
            "optimizer": fixed.measure_optimizer(torch, dist, timer, mesh, reps),
            "block_fixed": fixed.measure_block_overheads(torch, dist, mesh, nproc, reps),
            "pipeline": fixed.measure_pipeline(torch, dist, nproc, reps)}


def _measure_collectives(torch, dist, device, rank, nproc, sizes, timer) -> list[tuple[str, int, float]]:
    """[(kind, bytes of the full tensor, seconds)]; every rank runs the same calls."""
    out = []
    for size in sizes["comm_bytes"]:
        numel = max(nproc, size // 4 // nproc * nproc)
        full = torch.ones(numel, device=device)
        shard = torch.empty(numel // nproc, device=device)
        # torch >= 2.13 names the flat-tensor collectives *_single; older ones *_tensor
        all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        calls = {
            "all_reduce": lambda: dist.all_reduce(full),
            "all_gather": lambda: all_gather(full, shard),
            "reduce_scatter": lambda: reduce_scatter(shard, full),
            "send_recv": lambda: _ping(dist, rank, full),
        }
        for kind in MEASURED_COLLECTIVES:
            dist.barrier()
            seconds = timer(calls[kind], sizes["reps"])
            if kind == "send_recv":
                seconds /= 2  # a ping-pong is two transfers
            out.append((kind, numel * 4, seconds))
    return out


def _ping(dist, rank, tensor) -> None:
    """Rank 0 <-> rank 1 ping-pong; other ranks idle."""
    if rank == 0:
        dist.send(tensor, 1)
        dist.recv(tensor, 1)
    elif rank == 1:
        dist.recv(tensor, 0)
        dist.send(tensor, 0)


def base_profile_for(base: str | None, backend: str, device_name: str) -> ClusterProfile:
    """The profile a calibration starts from: `base` if named, `cpu` for gloo, else the shipped
    GPU profile whose device name matches `device_name` (h100-sxm when none does); the GPU check
    (`benchmarks/gpu_check.py`) predicts with the same one."""
    if base:
        return load_cluster(base)
    if backend == "gloo":
        return load_cluster("cpu")
    for candidate in builtin_profiles():
        profile = load_cluster(candidate)
        if profile.device.name.split()[0].lower() in device_name.lower():
            return profile
    return load_cluster("h100-sxm")


def _measured_link(samples, nproc: int, bw: float, alpha: float, source: str) -> LinkProfile:
    """The link of the joint alpha-beta fit, its bandwidth the fastest kind's, every slower
    kind's fraction of it in `kind_efficiency` (`fits.fit_kind_bandwidths`)."""
    kinds = fits.fit_kind_bandwidths([tuple(s) for s in samples], nproc, alpha)
    top = max(kinds.values(), default=bw)
    kind_efficiency = {kind: value / top for kind, value in kinds.items() if value / top < 0.995}
    return LinkProfile(bw_bytes_per_s=top, latency_s=alpha, efficiency=1.0, kind_efficiency=kind_efficiency,
                       source=f"{source}: ring alpha-beta fit of all-reduce/all-gather/reduce-scatter/send-recv, "
                              "a bandwidth per kind")


def build_profile(measured: dict, nproc: int, backend: str, name: str, base: str | None = None) -> ClusterProfile:
    """Turn rank 0's measurements into a ClusterProfile (peaks and factors from the base)."""
    base_profile = base_profile_for(base, backend, measured.get("device_name", ""))
    rate, half_flops = fit_matmul(fits.without_waves([tuple(p) for p in measured["matmul"]],
                                                     base_profile.device.num_sms if backend == "nccl" else 0))
    threads = measured["threads"] if backend == "gloo" else 1
    peaks = {dtype: value * threads for dtype, value in base_profile.device.peak_flops_per_s.items()}
    efficiency = rate / peaks[measured["dtype"]] if measured["dtype"] in peaks else 1.0
    if efficiency > 1.0:  # faster than the base's peak: the measured rate becomes the peak
        peaks = {dtype: value * efficiency for dtype, value in peaks.items()}
        efficiency = 1.0
    if backend == "gloo":
        memory_bytes = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / nproc
    else:
        memory_bytes = float(measured["memory_bytes"])
    source = f"meshplan calibrate --nproc {nproc} --backend {backend} on {time.strftime('%Y-%m-%d')}"
    device = replace(base_profile.device, name=measured.get("device_name", base_profile.device.name),
                     memory_bytes=memory_bytes, memory_bw_bytes_per_s=measured["copy_bw_bytes_per_s"],
                     memory_efficiency=1.0, peak_flops_per_s=peaks, matmul_efficiency=efficiency,
                     matmul_half_efficiency_flops=half_flops, kernel_overhead_s=measured["block_overhead_s"],
                     reserved_memory_bytes=min(base_profile.device.reserved_memory_bytes, memory_bytes / 4),
                     source=f"{source}; peaks scaled from {base_profile.name}: {base_profile.device.source}")
    if measured["collectives"]:
        bw, alpha = fit_alpha_beta([tuple(s) for s in measured["collectives"]], nproc)
        link = _measured_link(measured["collectives"], nproc, bw, alpha, source)
    else:  # one GPU: nothing to measure a link with
        link = replace(base_profile.intra_node, source=f"{base_profile.intra_node.source} (from {base_profile.name}: "
                                                       "calibrate measured one GPU, no link)")
    share = float(measured.get("cpu_share", 1.0))
    block = [dict(sample) for sample in measured["block"]]
    if share < 1.0:  # every process runs at this share of a core: CPU-time rates slow down by it
        device = replace(device, peak_flops_per_s={k: v * share for k, v in device.peak_flops_per_s.items()},
                         memory_bw_bytes_per_s=device.memory_bw_bytes_per_s * share,
                         kernel_overhead_s=device.kernel_overhead_s / share,
                         source=f"{device.source}; rates scaled by the {share:.2f} core share each of the {nproc} "
                                "processes got while all computed")
        for sample in block:
            sample["fwd_bwd_s"] /= share
    device = _fit_kernels(measured, device, block, share, backend)
    extra = fits.fixed_cost_fields(measured, nproc, link, share, device) if "optimizer" in measured else {}
    device = replace(device, **{k: v for k, v in extra.items() if k != "optimizer_bytes_per_param"})
    if "optimizer_bytes_per_param" in extra:
        base_profile = replace(base_profile, optimizer_bytes_per_param=extra["optimizer_bytes_per_param"])
    inter = link if backend == "gloo" else base_profile.inter_node
    return replace(base_profile, name=name, device=device, gpus_per_node=nproc, intra_node=link, inter_node=inter,
                   calibration=calibration_conditions(measured, nproc, backend, COMPUTE_ROUNDS),
                   max_nodes=1 if backend == "gloo" else base_profile.max_nodes, source=source,
                   description=f"measured with {nproc} {backend} processes"
                   + ("" if backend == "gloo" else f"; {'inter-node link' if nproc > 1 else 'links'} from "
                                                   f"{base_profile.name}"))


def _fit_kernels(measured: dict, device, block: list[dict], share: float, backend: str):
    """The device with its kernels' fitted fields: attention's efficiency (before the elementwise
    fit, which leaves attention to it), the CPU's narrow-GEMM widths, the elementwise traffic of
    the timed blocks and the convolutions' efficiency; measured seconds are per core `share`."""
    if measured.get("attention"):
        timed = fits.fit_attention_efficiency(
            [(flops, seconds / share) for flops, seconds in measured["attention"]], device, measured["dtype"])
        if device.architecture:  # a GPU's kernels are priced by shape: store the 16K, head-dim-128 figure
            shapes = bench_shapes(backend == "nccl")
            timed = attention_kernels.plateau_from_measured(
                timed, measured.get("attention_seqs", shapes.attention_seqs),
                measured.get("attention_head_dim", shapes.attention_head_dim), device.architecture)
        device = replace(device, attention_efficiency=timed)
    if measured.get("gemm_widths"):  # the CPU's narrow GEMMs below the size curve
        widths = [(m, n, k, seconds / share) for m, n, k, seconds in measured["gemm_widths"]]
        device = replace(device, matmul_width_efficiency=fits.fit_width_efficiency(widths, device, measured["dtype"]),
                         source=f"{device.source}; matmul_width_efficiency: {len(widths)} fp32 GEMMs of "
                                f"{SWEEP_TOKENS} rows at widths {SWEEP_WIDTHS[0]}-{SWEEP_WIDTHS[-1]} (w x w, w x 4w, "
                                "4w x w), the size curve's time over the measured, median per width")
    device = replace(device, elementwise_bytes_per_activation_byte=fit_elementwise_traffic(
        block, device, measured["dtype"]))
    if measured.get("conv"):
        device = replace(device, conv_efficiency=fit_conv_efficiency(
            [(fwd, bwd, seconds / share) for fwd, bwd, seconds in measured["conv"]], device, measured["dtype"]))
    return device
