"""Pure fits of `meshplan calibrate`: measurements in, profile fields out (no torch, no timing).

Each fit says what it models; the measuring lives in `runner` (compute, collectives) and
`microbench` (the fixed costs of `costing.fixed_costs`).
"""
from __future__ import annotations

from dataclasses import replace

from meshplan.planner.contracts.cluster import ClusterProfile, LinkProfile
from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.costing.collectives import (Placement, all_gather_time_s, all_reduce_time_s,
                                                   bus_bandwidth_factor, reduce_scatter_time_s, ring_steps,
                                                   send_recv_time_s)


def fit_matmul(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(asymptotic FLOP/s R, half-efficiency FLOPs f_half) from t = (f + f_half) / R.

    Least squares on relative error (each row divided by its time), so small and large GEMMs
    count alike; f_half is clipped at 0.
    """
    rows = [(f / t, 1.0 / t) for f, t in points]  # (f/t) * a + (1/t) * b = 1
    a, b = lstsq2(rows, [1.0] * len(rows))
    if a <= 0:
        raise MeshplanError("matmul timings did not grow with size; rerun calibrate on an idle machine")
    return 1.0 / a, max(0.0, b / a)



def without_waves(points: list[tuple[float, float]], num_sms: int) -> list[tuple[float, float]]:
    """Square-GEMM timings [(FLOPs, seconds)] with their tile and wave quantisation taken out
    (`costing.gemm.wave_efficiency`, which prices every GEMM on a device with SMs), so the fitted
    size curve and that factor together give back the measured times; unchanged without SMs."""
    from meshplan.planner.costing.gemm import wave_efficiency

    if num_sms <= 0:
        return points
    out = []
    for flops, seconds in points:
        n = round((flops / 2) ** (1 / 3))
        out.append((flops, seconds * wave_efficiency(n, n, num_sms)))
    return out


def fit_alpha_beta(samples: list[tuple[str, int, float]], nproc: int) -> tuple[float, float]:
    """(bandwidth bytes/s, latency s) of the ring model fitted to all collectives at once."""
    rows = [(bus_bandwidth_factor(kind, nproc) * size / t, _ring_hops(kind, nproc) / t) for kind, size, t in samples]
    inv_bw, alpha = lstsq2(rows, [1.0] * len(rows))
    if inv_bw <= 0:
        raise MeshplanError("collective timings did not grow with size; rerun calibrate on an idle machine")
    return 1.0 / inv_bw, max(0.0, alpha)


def _ring_hops(kind: str, nproc: int) -> int:
    """Latency terms of one ring collective over `nproc` ranks (one for a send/recv)."""
    return {"all_reduce": 2 * (nproc - 1), "all_gather": nproc - 1, "reduce_scatter": nproc - 1}.get(kind, 1)


def fit_kind_bandwidths(samples: list[tuple[str, int, float]], nproc: int, alpha: float) -> dict[str, float]:
    """{kind: bytes/s} of each measured collective kind on the ring model, its latency held at the
    joint fit's `alpha` (least squares on relative error): implementations move bytes at their
    own rates (gloo's all-gather and reduce-scatter copy through staging buffers, its all-reduce
    and send/recv do not), which one shared bandwidth averages away. A kind whose times do not
    grow with size is left out."""
    out = {}
    for kind in sorted({kind for kind, _, _ in samples}):
        rows = [(bus_bandwidth_factor(kind, nproc) * size / t, 1.0 - _ring_hops(kind, nproc) * alpha / t)
                for k, size, t in samples if k == kind]
        denominator = sum(x * x for x, _ in rows)
        inv_bw = sum(x * r for x, r in rows) / denominator if denominator else 0.0
        if inv_bw > 0:
            out[kind] = 1.0 / inv_bw
    return out


def fit_inter_node_link(runs: list[tuple[str, float, float, Placement]], cluster: ClusterProfile) -> tuple[float, float]:
    """(bandwidth of one NIC in bytes/s, inter-node latency s) from multi-node collective timings.

    `runs` are (kind, size bytes, seconds, placement) samples of rings over nodes (nccl-tests'
    all_reduce_perf / all_gather_perf). The model is the ring of `planner.costing.collectives`:
    t = factor(n) S / (m b) + (steps - inter_steps) alpha_nv + inter_steps alpha_net, with m rails
    each at b; NVLink's latency alpha_nv comes from `cluster`. It assumes the NICs, not NVLink,
    limit the ring (true when rails x NIC is below a GPU's NVLink port, as on DGX A100/H100).
    Least squares on relative error, like `fit_alpha_beta`.
    """
    rows, rhs = [], []
    for kind, size, seconds, placement in runs:
        rails = min(placement.ranks_per_node, cluster.nics_per_node)
        steps, inter_steps = ring_steps(kind, placement)
        volume = bus_bandwidth_factor(kind, placement.num_ranks) * size
        rows.append((volume / rails / seconds, inter_steps / seconds))
        rhs.append(1.0 - (steps - inter_steps) * cluster.intra_node.latency_s / seconds)
    inv_bw, alpha = lstsq2(rows, rhs)
    if inv_bw <= 0:
        raise MeshplanError("the nccl-tests times did not grow with the message size; pass a run that spans "
                            "small and large sizes (e.g. -b 1M -e 8G -f 2)")
    return 1.0 / inv_bw, max(0.0, alpha)


def lstsq2(rows: list[tuple[float, float]], rhs: list[float]) -> tuple[float, float]:
    """Two-unknown least squares by the normal equations (no numpy needed)."""
    s11 = sum(x * x for x, _ in rows)
    s12 = sum(x * y for x, y in rows)
    s22 = sum(y * y for _, y in rows)
    r1 = sum(x * r for (x, _), r in zip(rows, rhs))
    r2 = sum(y * r for (_, y), r in zip(rows, rhs))
    det = s11 * s22 - s12 * s12
    if det == 0:
        raise MeshplanError("calibration measurements are degenerate (need at least two sizes)")
    return (r1 * s22 - r2 * s12) / det, (s11 * r2 - s12 * r1) / det



def fit_elementwise_traffic(samples: list[dict[str, float]], device, dtype: str) -> float:
    """Bytes of memory traffic per saved byte that explain the block's forward + backward time
    beyond its GEMMs, fitted over all measured shapes.

    The GEMM time is what the cost model charges a GPT block (`planner.costing.compute_time.compute_times_s`:
    the forward as 8 equal GEMMs, the backward as 16 with two launches) with the fitted curve and
    `kernel_overhead_s`; the elementwise traffic is k x saved bytes forward and 2k backward. k is
    the least-squares fit on relative error, over several shapes, so one disturbed timing moves
    it less than a single-shape difference would; never negative.
    """
    from meshplan.planner.costing.device_time import memory_time_s

    probe = probe_profile(replace(device, elementwise_bytes_per_activation_byte=0.0))
    numerator = denominator = 0.0
    for sample in samples:
        leftover_s = sample["fwd_bwd_s"] - block_time_s(sample, probe, dtype)
        per_k_s = memory_time_s(3.0 * sample["saved_bytes"], probe)  # forward once, backward twice
        weight = 1.0 / sample["fwd_bwd_s"] ** 2
        numerator += weight * leftover_s * per_k_s
        denominator += weight * per_k_s**2
    return max(0.0, numerator / denominator) if denominator > 0 else 0.0


def fit_width_efficiency(samples: list[tuple[int, int, int, float]], device, dtype: str) -> dict[str, float]:
    """`matmul_width_efficiency` from timed GEMMs [(m, n, k, seconds)] on a device without a
    roofline (`num_sms` 0, the CPU): per narrowest dimension, the median over its shapes of the
    size curve's time (`costing.gemm.gemm_time_s` without a width table) over the measured time,
    so that the priced GEMMs at each swept width take the measured time (`gemm.width_factor`)."""
    import statistics

    from meshplan.planner.costing.gemm import gemm_time_s

    if device.num_sms:
        raise ValueError(f"a width table is fitted on devices without tiles and roofline (num_sms 0), "
                         f"got num_sms {device.num_sms}")
    probe = probe_profile(replace(device, matmul_width_efficiency={}))
    ratios: dict[int, list[float]] = {}
    for m, n, k, seconds in samples:
        if seconds > 0:
            ratios.setdefault(min(m, n, k), []).append(gemm_time_s(m, n, k, probe, dtype) / seconds)
    return {str(width): statistics.median(values) for width, values in sorted(ratios.items())}


def probe_profile(device) -> ClusterProfile:
    """A one-device profile with ideal links: what `block_time_s` charges on `device` alone."""
    return ClusterProfile(name="probe", device=device, gpus_per_node=1, intra_node=LinkProfile(1.0, 0.0),
                          inter_node=LinkProfile(1.0, 0.0))



def block_time_s(sample: dict[str, float], cluster: ClusterProfile, dtype: str) -> float:
    """The cost model's forward + backward seconds of a measured GPT block sample (as
    `planner.costing.compute_time.compute_times_s` charges a block: 8 GEMMs forward, 16 in two launches
    backward, elementwise traffic once forward and twice backward)."""
    from meshplan.planner.costing.device_time import ATTENTION_BMMS_PER_BLOCK, gemm_and_attention_times_s, memory_time_s
    from meshplan.planner.costing.gemm import linear_flops, linear_times_s

    traffic = 3.0 * cluster.device.elementwise_bytes_per_activation_byte * sample["saved_bytes"]
    # flash attention's core at the device's attention_efficiency, when it gives one (as layer_costs)
    attn = sample.get("attn_fwd_flops", 0.0) if cluster.device.attention_efficiency > 0 else 0.0
    shapes = tuple(tuple(shape) for shape in sample.get("linear_shapes") or ())
    if not shapes:  # samples without the block's shapes: 8 equal GEMMs on the size curve
        fwd_s, bwd_s = gemm_and_attention_times_s(sample["fwd_flops"], sample["bwd_flops"], attn, 8, cluster, dtype)
        return fwd_s + bwd_s + memory_time_s(traffic, cluster)
    # the Linears one GEMM at a time by shape, the rest as attention's products (`compute_time`)
    linear_fwd = linear_flops(shapes, sample["tokens"], 1)
    linear_fwd_s, linear_bwd_s = linear_times_s(shapes, sample["tokens"], 1, cluster, dtype)
    rest_fwd_s, rest_bwd_s = gemm_and_attention_times_s(
        max(0.0, sample["fwd_flops"] - linear_fwd), max(0.0, sample["bwd_flops"] - 2 * linear_fwd), attn,
        ATTENTION_BMMS_PER_BLOCK, cluster, dtype)
    return linear_fwd_s + linear_bwd_s + rest_fwd_s + rest_bwd_s + memory_time_s(traffic, cluster)


def fit_conv_efficiency(samples: list[tuple[float, float, float]], device, dtype: str) -> float:
    """`conv_efficiency` from [(forward FLOPs, backward FLOPs, seconds)] of timed convolutions: the
    time the GEMM curve gives those FLOPs (one GEMM forward, two backward, as `compute_time` charges
    a convolution) over the measured time, the median over samples, capped at 1."""
    import statistics

    from meshplan.planner.costing.device_time import compute_time_s

    cluster = probe_profile(device)
    ratios = [(compute_time_s(fwd, 1, cluster, dtype, num_launches=0)
               + compute_time_s(bwd, 2, cluster, dtype, num_launches=0)) / seconds
              for fwd, bwd, seconds in samples if seconds > 0]
    return min(1.0, statistics.median(ratios)) if ratios else 1.0


def fit_attention_efficiency(samples: list[tuple[float, float]], device, dtype: str) -> float:
    """`attention_efficiency` from [(FLOPs, seconds)] of timed causal flash attention (forward +
    backward): the rate R of t = FLOPs / R by least squares on relative error, over peak, capped
    at 1; 0 (attention stays on the GEMM curve) without samples."""
    rows = [flops / seconds for flops, seconds in samples if seconds > 0 and flops > 0]
    if not rows:
        return 0.0
    rate = sum(x * x for x in rows) / sum(rows)  # 1/R = sum(x) / sum(x^2) with x = f/t
    return min(1.0, rate / device.peak_flops(dtype))


def fit_model_update(per_tensor_s: float, model: tuple[int, int, float], fallback_s: float) -> float:
    """Seconds per parameter of a real model's update beyond its per-tensor cost (`fallback_s`,
    the tensor sets' fit, when the model's update is all per-tensor cost)."""
    tensors, elements, seconds = model
    leftover = seconds - tensors * per_tensor_s
    return leftover / elements if leftover > 0 else fallback_s



def fit_optimizer(samples: list[tuple[int, int, float]]) -> tuple[float, float]:
    """(seconds per tensor, seconds per element) from t = tensors * a + elements * b (relative
    least squares, both clipped at 0)."""

    rows = [(count / t, numel / t) for count, numel, t in samples]
    per_tensor, per_param = lstsq2(rows, [1.0] * len(rows))
    if per_param <= 0:  # no bandwidth signal: all of it is per tensor
        return max(t / count for count, _, t in samples), 0.0
    return max(0.0, per_tensor), per_param



def fit_fsdp_overheads(block: dict[str, float], nproc: int, link) -> tuple[float, float]:
    """(FSDP overhead per layer per pass, per byte gathered or reduced), never negative.

    Three timings of a block's forward + backward under `fully_shard`, each less the plain block
    and less its collectives (alpha-beta): the tiny block resharding after forward (two
    all-gathers and one reduce-scatter of its B_t fp32 parameter bytes), the real-shape block
    keeping its gathered parameters (one all-gather) and resharding them (two). With F the fixed
    part per pass and c the part per byte:
        tiny = 2F + 3 B_t c,  kept = 2F + 2 B_r c,  resharded = 2F + 3 B_r c,
    fitted by least squares on relative error (each row over its block's measured time).
    Without the real-shape timings: the tiny block's overhead, all of it fixed."""
    tiny_bytes = block["block_params"] * 4
    tiny = block["fsdp_s"] - block["plain_s"] - _fsdp_comm_s(tiny_bytes, 2, nproc, link)
    if "real_fsdp_s" not in block:
        return max(0.0, tiny / 2), 0.0
    real_bytes = block["real_block_params"] * 4
    kept = block["real_fsdp_kept_s"] - block["real_plain_s"] - _fsdp_comm_s(real_bytes, 1, nproc, link)
    resharded = block["real_fsdp_s"] - block["real_plain_s"] - _fsdp_comm_s(real_bytes, 2, nproc, link)
    samples = ((tiny, 3 * tiny_bytes, block["fsdp_s"]), (kept, 2 * real_bytes, block["real_fsdp_kept_s"]),
               (resharded, 3 * real_bytes, block["real_fsdp_s"]))
    fixed, per_byte = lstsq2([(2 / t, moved / t) for _, moved, t in samples], [o / t for o, _, t in samples])
    if per_byte < 0:
        return max(0.0, tiny / 2), 0.0
    if fixed < 0:  # all of it per byte: the relative least squares through the origin
        rows = [(moved / t, o / t) for o, moved, t in samples]
        return 0.0, max(0.0, sum(x * y for x, y in rows) / sum(x * x for x, _ in rows))
    return fixed, per_byte


def _fsdp_comm_s(param_bytes: float, num_gathers: int, nproc: int, link) -> float:
    return num_gathers * all_gather_time_s(param_bytes, nproc, link) + reduce_scatter_time_s(param_bytes, nproc, link)


def fit_tp_overheads(block: dict[str, float], nproc: int, link) -> tuple[float, float]:
    """(TP overhead per layer per pass, and per byte of its residual-stream input), never negative.

    At each of the two block shapes, the TP block's forward + backward less the local shard's
    (the same compute without DTensor) and less its four all-reduces of the stream (Megatron:
    two per pass) is two passes' overhead; a line through the two points splits it into a fixed
    and a per-byte part. Without the local and real-shape timings: the tiny block less the
    plain one, all of it fixed."""
    tiny_bytes = block["seq"] * block["hidden"] * 4
    reference_s = block.get("local_s", block["plain_s"])
    tiny_s = (block["tp_s"] - reference_s - 4 * all_reduce_time_s(tiny_bytes, nproc, link)) / 2
    if "real_tp_s" not in block:
        return max(0.0, tiny_s), 0.0
    real_bytes = block["real_stream_bytes"]
    real_s = (block["real_tp_s"] - block["real_local_s"] - 4 * all_reduce_time_s(real_bytes, nproc, link)) / 2
    per_byte_s = max(0.0, (real_s - tiny_s) / (real_bytes - tiny_bytes))
    return max(0.0, tiny_s - per_byte_s * tiny_bytes), per_byte_s



def fit_sp_and_loss(block: dict[str, float], nproc: int, link) -> tuple[float, float]:
    """(Sequence parallelism's extra overhead per block pass, the vocab-parallel loss's overhead
    per micro-batch), never negative; 0 without the real-shape timings.

    SP's all-gathers and reduce-scatters move what TP's all-reduces move, so the SP block less
    the TP block is DTensor's extra work (norms and residual glue as DTensors), over two passes.
    The loss: `loss_parallel` cross entropy less the local shard's and less its three all-reduces
    of one value per token (max, sum of exponentials, target logit)."""
    if "real_sp_s" not in block:
        return 0.0, 0.0
    sp_s = max(0.0, (block["real_sp_s"] - block["real_tp_s"]) / 2)
    reductions_s = 3 * all_reduce_time_s(block["loss_tokens"] * 4, nproc, link)
    loss_s = max(0.0, block["loss_parallel_s"] - block["loss_local_s"] - reductions_s)
    return sp_s, loss_s



def fit_redistribute(block: dict[str, float], nproc: int, link) -> float:
    """A small Partial -> Replicate redistribution beyond its all-reduce; never negative."""
    if "redistribute_s" not in block:
        return 0.0
    return max(0.0, block["redistribute_s"] - all_reduce_time_s(block["hidden"] * 4, nproc, link))



def fit_pipeline_action(pipeline: dict[str, float], nproc: int, link, stage_compute_s: float) -> float:
    """Per-action overhead: 1F1B's critical path is (m + p - 1) forward + backward pairs of one
    stage (`stage_compute_s`, the cost model's time for the measured stage), 2 (m + p - 1)
    actions and 2 (p - 1) boundary transfers; what they do not explain, per action."""
    m, p = pipeline["microbatches"], nproc
    transfers_s = 2 * (p - 1) * send_recv_time_s(pipeline["boundary_bytes"], link)
    compute_s = (m + p - 1) * stage_compute_s
    return max(0.0, (pipeline["step_s"] - transfers_s - compute_s) / (2 * (m + p - 1)))


def fixed_cost_fields(measured: dict, nproc: int, link: LinkProfile, share: float, device) -> dict[str, float]:
    """The profile fields of `planner.costing.fixed_costs` from the workers' measurements."""
    plain_tensor_s, plain_param_s = fit_optimizer([tuple(s) for s in measured["optimizer"]["plain"]])
    if measured["optimizer"].get("model"):  # a real model's update sets the per-parameter cost
        plain_param_s = fit_model_update(plain_tensor_s, tuple(measured["optimizer"]["model"][0]), plain_param_s)
    dtensor_tensor_s, _ = fit_optimizer([tuple(s) for s in measured["optimizer"]["dtensor"]])
    dp_unit_s, dp_per_byte_s = fit_fsdp_overheads(measured["block_fixed"], nproc, link)
    tp_s, tp_per_byte_s = fit_tp_overheads(measured["block_fixed"], nproc, link)
    sp_s, loss_s = fit_sp_and_loss(measured["block_fixed"], nproc, link)
    out = {"optimizer_per_tensor_s": plain_tensor_s / share, "dtensor_optimizer_per_tensor_s": dtensor_tensor_s / share,
           "tp_layer_overhead_s": tp_s, "tp_overhead_s_per_stream_byte": tp_per_byte_s,
           "sp_layer_overhead_s": sp_s, "tp_loss_overhead_s": loss_s, "dp_unit_overhead_s": dp_unit_s,
           "dp_overhead_s_per_byte": dp_per_byte_s,
           "dtensor_redistribute_s": fit_redistribute(measured["block_fixed"], nproc, link),
           "pipeline_action_overhead_s": fit_pipeline_action(
               measured["pipeline"], nproc, link, block_time_s(measured["block"][0], probe_profile(device), measured["dtype"]))}
    if plain_param_s > 0:  # AdamW's bytes per parameter at the measured bandwidth
        out["optimizer_bytes_per_param"] = plain_param_s / share * device.memory_bw_bytes_per_s
    return out
