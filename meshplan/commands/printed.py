"""The printed prediction of `estimate` (one configuration, or an engine's config read with
`--from`): step time by cause, throughput, utilisation and memory per pipeline rank."""
from __future__ import annotations

from dataclasses import dataclass

from meshplan.commands.common import GIB, throughput_line
from meshplan.planner.contracts.config import EXECUTOR_MEMORY_ENGINES, ParallelConfig
from meshplan.planner.contracts.engine_rules import runs_compiled
from meshplan.planner.costing import torchtitan_sac
from meshplan.planner.costing.compute_time import early_stops
from meshplan.planner.costing.fp8 import is_fp8


@dataclass(frozen=True)
class Heading:
    """What a printed estimate names: the model, the cluster, the configuration and the
    recomputation (a mode, or the modes' counts when an engine config mixes them)."""

    spec: str
    cluster: str
    config: ParallelConfig
    recompute: str
    seq: int | None = None


def format_prediction(prediction, heading: Heading, usable_memory_bytes: float, cluster=None) -> str:
    """The human-readable breakdown: step time by cause, memory per stage by kind, throughput; with
    the `cluster` and offloading, the host memory its nodes hold."""
    step = prediction.step_time_s
    moe = any(getattr(mem, "experts", 0.0) > 0 for mem in prediction.memory)
    cfg = heading.config
    lines = [_heading_line(heading, cluster), overlap_line(cfg), "", f"step time        {step * 1e3:10.1f} ms"]
    for kind, seconds in prediction.breakdown.items():
        if seconds > 0:
            lines.append(f"  {kind:<14} {seconds * 1e3:10.1f} ms  {seconds / step:6.1%}"
                         + (_recompute_note(cfg) if kind == "recompute" else ""))
    from meshplan.reports.plans import is_sequence_model

    sequence_model = is_sequence_model(heading.spec)
    seq = heading.seq or _default_seq(heading.spec)
    lines += ["", throughput_line(heading.spec, prediction.tokens_per_s, seq),
              f"model TFLOP/s    {prediction.model_tflops_per_gpu:10.1f} per GPU",
              f"hw TFLOP/s       {prediction.hw_tflops_per_gpu:10.1f} per GPU",
              f"MFU              {prediction.mfu:10.1%}"
              + ("   (attention counted in full; step time uses causal FLOPs)" if sequence_model else ""),
              f"HFU              {prediction.hfu:10.1%}   (FLOPs the GPUs execute: "
              + ("causal attention, " if sequence_model else "") + "recomputation)",
              f"bubble           {prediction.bubble_fraction:10.1%}",
              "", "memory per rank (GiB)" + ("; experts: the routed experts' part of params + grads + optim"
                                            if moe else ""),
              f"  {'stage':>5} {'params':>8} {'grads':>8} {'optim':>8} {'activ':>8} {'buffers':>8} {'total':>8}"
              + (f" {'experts':>8}" if moe else "")]
    lines += _memory_rows(prediction, moe)
    from meshplan.planner.costing.state_memory import executed_zero

    if executed_zero(cfg.zero, cfg.data_ranks, cfg.pp, cfg.schedule) != cfg.zero:
        lines += ["", f"note: ZeRO-{cfg.zero} with the {cfg.schedule} schedule runs as ZeRO-1 (a split backward "
                      "defers gradient sync and resharding to the step's end); priced as executed"]
    on_device = prediction.peak_memory_bytes <= usable_memory_bytes
    verdict = "yes" if prediction.fits else "NO (largest rank exceeds the device's usable memory)" if not on_device \
        else "NO (the offloaded states exceed the host memory)"
    lines += ["", f"peak memory      {prediction.peak_memory_bytes / GIB:10.2f} GiB of {usable_memory_bytes / GIB:.2f} "
              f"GiB usable   fits: {verdict}"]
    if prediction.host_state_bytes_per_node and cluster is not None:
        from meshplan.planner.costing.offload import usable_host_memory_bytes

        lines.append(f"host memory      {prediction.host_state_bytes_per_node / GIB:10.2f} GiB of offloaded states on "
                     f"the busiest node, {usable_host_memory_bytes(cluster) / GIB:.2f} GiB usable")
    if not on_device:
        lines += top_consumers(prediction, cfg)
    return "\n".join(lines)


EARLY_STOP_NOTE = "   (torch's early stop: dense blocks do not rerun their MLP down projection)"
# torchtitan's per-op selective checkpointing (`costing.torchtitan_sac`)
SAC_NOTE = "   (torchtitan's op policy: blocks rerun all but attention and every other matmul)"
SAC_FP8_NOTE = "   (torchtitan's op policy: blocks rerun all but attention and every other matmul, Float8 alike)"


def _heading_line(heading: Heading, cluster) -> str:
    """The estimate's first line: model, cluster (and whether its profile is validated), layout."""
    cfg = heading.config
    unvalidated = " (profile not validated)" if cluster is not None and not cluster.validated else ""
    return (f"{heading.spec} on {cfg.gpus} x {heading.cluster}{unvalidated}: tp={cfg.tp} pp={cfg.pp} dp={cfg.dp}"
            + (f" cp={cfg.cp}" if cfg.cp > 1 else "") + (f" ep={cfg.ep}" if cfg.ep > 1 else "")
            + (f" etp={cfg.etp}" if cfg.etp is not None else "")
            + f" mbs={cfg.microbatch_size} zero={cfg.zero}"
            + (f" shard_group={cfg.shard_group}" if cfg.shard_group else "")
            + f" recompute={heading.recompute} sp={'on' if cfg.sp else 'off'} schedule={cfg.schedule}"
            + (f" vpp={cfg.virtual_stages}" if cfg.schedule_spec.free_chunks else "")
            + (f" fp8={cfg.fp8_recipe}" if cfg.fp8_recipe else "")
            + (f" fp8_filter={','.join(cfg.fp8_filter)}" if cfg.fp8_filter else "")
            + (f" offload={cfg.offload}" if cfg.offload != "none" else "")
            + (" compile=on" if cfg.torch_compile else " compile=on (async TP needs it)" if runs_compiled(cfg) else "")
            + ("" if cfg.compile_loss is None else " compile_loss=on" if cfg.compile_loss else " compile_loss=off")
            + (f" (memory as {cfg.engine} allocates it)" if cfg.engine not in EXECUTOR_MEMORY_ENGINES else ""))


def _memory_rows(prediction, moe: bool) -> list[str]:
    """One row of memory by kind per pipeline rank shown (`_ranks_to_show`: '...' where skipped)."""
    rows = []
    for rank in _ranks_to_show(prediction):
        if rank is None:
            rows.append(f"  {'...':>5}")
            continue
        mem = prediction.memory[rank]
        rows.append(f"  {rank:>5} {mem.params / GIB:8.2f} {mem.grads / GIB:8.2f} {mem.optimizer / GIB:8.2f} "
                    f"{mem.activations / GIB:8.2f} {mem.buffers / GIB:8.2f} {mem.total / GIB:8.2f}"
                    + (f" {mem.experts / GIB:8.2f}" if moe else ""))
    return rows


def _recompute_note(config) -> str:
    """What the recompute line's time reruns, where the engine's rule says more than the mode."""
    if torchtitan_sac.applies(config):
        return SAC_FP8_NOTE if is_fp8(config.precision) else SAC_NOTE
    return EARLY_STOP_NOTE if early_stops(config) else ""


def overlap_line(config) -> str:
    """Which engine's communication overlap the prediction assumes (`contracts.overlap`, with the
    configuration's own TP overlap: `costing.overlap.overlap_of`)."""
    from meshplan.planner.costing.overlap import overlap_of

    return f"overlap as {overlap_of(config).summary()}"


def with_overlap(data: dict, config) -> dict:
    """`estimate --json` with the key `overlap`: the overlap the prediction assumed
    (`contracts.overlap.EngineOverlap.to_json` of `costing.overlap.overlap_of`)."""
    from meshplan.planner.costing.overlap import overlap_of

    return {**data, "overlap": overlap_of(config).to_json()}


# the ZeRO stage that first shards each kind of model state, and how it is named as a lever
_SHARDED_FROM = {"optimizer": (1, "--zero 1 or more"), "grads": (2, "--zero 2 or 3"), "params": (3, "--zero 3")}


def _remedies(kind: str, cfg) -> str:
    """What would lower `kind` of memory from where `cfg` stands: only levers not already pulled
    (a ZeRO stage that shards it, offloading, a stronger recomputation, sequence parallelism under
    TP, a smaller micro-batch)."""
    smaller_mbs = ["a smaller --mbs"] if cfg.microbatch_size > 1 else []
    if kind in _SHARDED_FROM:
        stage, flag = _SHARDED_FROM[kind]
        single = cfg.dp * cfg.cp == 1  # ZeRO shards over the data ranks: none to shard over yet
        levers = ["more data ranks (--gpus)" if cfg.zero >= stage else flag + (" with more data ranks" if single else "")]
        # offloading parameters needs them sharded (ZeRO-3); the optimizer's states go at any stage
        offload = kind == "optimizer" or (kind == "params" and cfg.zero == 3)
        levers += [f"--offload {kind}"] if offload and cfg.offload == "none" else []
        return ", ".join(levers + ["more --tp or --pp"])
    if kind == "activations":
        stronger = {"none": ["--recompute selective/full"], "selective": ["--recompute full"]}.get(cfg.recompute, [])
        sp = ["--sp"] if cfg.tp > 1 and not cfg.sp else []
        return ", ".join(stronger + sp + smaller_mbs + ["more --tp, --cp or --pp"])
    return ", ".join(smaller_mbs + ["more --tp (logits)"] + (["less ZeRO-3 prefetch"] if cfg.zero == 3 else []))


def top_consumers(prediction, cfg, count: int = 3) -> list[str]:
    """The largest rank's biggest kinds of memory, each with what would lower it from `cfg`."""
    rank = max(range(len(prediction.memory)), key=lambda r: prediction.memory[r].total)
    mem = prediction.memory[rank]
    kinds = {"params": mem.params, "grads": mem.grads, "optimizer": mem.optimizer,
             "activations": mem.activations, "buffers": mem.buffers}
    largest = sorted(kinds, key=kinds.get, reverse=True)[:count]
    held = {"buffers": f", of which {mem.fragmented / GIB:.2f} GiB the caching allocator holds fragmented"
            if mem.fragmented else ""}
    return [f"top consumers on pipeline rank {rank}:"] + [
        f"  {kind:<12} {kinds[kind] / GIB:8.2f} GiB  ({kinds[kind] / mem.total:.0%}{held.get(kind, '')}; lower it "
        f"with {_remedies(kind, cfg)})" for kind in largest]


def _default_seq(spec: str) -> int:
    from meshplan.planner.models.registry import default_seq
    from meshplan.planner.simulation.estimator import DEFAULT_SEQ

    return default_seq(spec, DEFAULT_SEQ)


def _ranks_to_show(prediction, limit: int = 8) -> list:
    """Every pipeline rank when few; else the first two, the largest, the last two (None = gap)."""
    count = len(prediction.memory)
    if count <= limit:
        return list(range(count))
    largest = max(range(count), key=lambda r: prediction.memory[r].total)
    shown = sorted({0, 1, largest, count - 2, count - 1})
    out: list = []
    for rank in shown:
        if out and rank != out[-1] + 1:
            out.append(None)
        out.append(rank)
    return out
