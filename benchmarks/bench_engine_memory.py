"""Per-GPU memory against the figures public sources print, each under the engine that ran it.

    python benchmarks/bench_engine_memory.py

Four parts, all held out (no figure here tunes any constant; the memory recipes are the engines'
own rules, `planner/costing/engine_memory.py`, `megatron_activations.py`):

1. Published per-GPU memory figures (`MEMORY_FIGURES`), each with its source: Korthikanti et al.
   2022 Figure 1 (first-stage activations, Megatron-LM), torchtitan's H100 tables (peak memory
   reserved by PyTorch's caching allocator, torchtitan's `max_reserved`: its FSDP rows eager, with
   torch.compile, and with torch.compile and Float8; its FSDP x CP rows at 32K-256K tokens and its
   70B FSDP x TP rows, compiled with Float8 under full activation checkpointing). An activation figure is
   compared with the first pipeline rank's activations; a reserved figure with the predicted
   peak, whose buffers hold the allocator's fragmentation (`engine_memory.allocator_reserve_fraction`).
   Target: every figure within 10%. (Korthikanti et al.'s Figure 7, activation memory per
   technique, prints its values only as bars; the Llama 3 paper and llm-foundry's tables print no
   per-GPU memory: their runs enter parts 3 and 4 as configurations that ran.)
2. Statements without a figure (`TORCHTITAN_A100_STATEMENTS`): torchtitan's A100 rows that ran
   under op-level selective checkpointing and its footnote that Llama 2 70B at local batch 2 ran
   out of memory; the prediction must agree (fits / does not fit).
3. Every held-out run of `published_runs.py` (they all ran) estimated under its engine, and the
   time fit sets' runs (Narayanan et al. 2021 Table 1, Llama 3 Table 4), which tune no memory
   constant: the runs still called out of memory are listed and counted (target: none). Megatron
   runs recompute the modules their source names (`Run.recompute_modules`), keep the gradient buffer
   in the dtype it names (`Run.grad_reduce_in_bf16`: Megatron-Bridge's performance recipes reduce
   in bf16) and scale FP8 as it names (`Run.fp8_recipe`).
4. MosaicML's llm-foundry runs under its own recipe (`planner/costing/foundry_memory.py`: Composer's
   FSDP with `mixed_precision: DEFAULT` and `limit_all_gathers`, MPT's packed QKV kept as views,
   flash-attn's fused cross-entropy on the bf16 logits), counted apart: their micro-batches are the
   largest that fit (Composer's automatic micro-batching), so any over-estimate calls them out of
   memory. The FP8 rows keep Transformer Engine's fp8 Linear inputs (`foundry_memory`).
   Megatron runs are cut into pipeline chunks as Megatron-LM cuts them (`uniform.engine_layer_chunks`);
   Llama 3's 405B runs come with a note on the schedule Meta ran (`print_llama3_pipeline_note`).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from published_runs import (FIT_SETS, HELD_OUT, HELD_OUT_FP8, HELD_OUT_MOE, LLAMA3_2024, MPT_LARGE_SCALE_SOURCE,  # noqa: E402
                            MPT_SOURCE, MPT_SWEEP_SOURCE, TORCHTITAN_A100, Run, all_runs)

GIB = 2**30
TOLERANCE = 0.10

KORTHIKANTI_FIGURE_1 = ("Korthikanti et al. 2022 (arXiv:2205.05198), Figure 1: activation memory of the first "
                        "pipeline stage with sequence parallelism and selective recomputation; shapes, degrees and "
                        "batches from its Table 3 (seq 2048, vocab 51200)")
TORCHTITAN_H100 = ("torchtitan docs/performance.md, Llama 3.1 8B on H100 (95 GiB HBM2e, Grand Teton), Tables 1 "
                   "and 3, 'FSDP', 'FSDP + torch.compile' and 'FSDP + torch.compile + Float8' rows (torch 1963fc8, "
                   "torchtitan 9dec370, 2024-12)")
# torchtitan's H100s hold 95 GiB (its docs/performance.md); the h100-sxm profile's other figures stand
TORCHTITAN_H100_TABLES = ("torchtitan docs/performance.md, Llama 3.1 on H100 (95 GiB HBM2e, Grand Teton), Table 2 "
                          "(8B, FSDP x CP) and Table 4 (70B, FSDP 32 x TP 8) (torch 1963fc8, torchtitan 9dec370, "
                          "2024-12)")
TORCHTITAN_H100_MEMORY_BYTES = 95 * GIB
TORCHAO_TRAINING = ("torchao docs/source/workflows/training.md, e2e training benchmarks, Llama3-8b 'Peak Memory' "
                    "(torchtitan's max reserved, GiB: benchmarks/float8/training/parse_torchtitan_logs.py): 8 H100 "
                    "(torch 2.7.0a0+gitb98af95, torchtitan 0.0.2) and 8 MI300X (torch 2.9.0.dev20250811+rocm6.4, "
                    "torchtitan 2c8b594)")


@dataclass(frozen=True)
class MemoryFigure:
    """One published per-GPU memory figure and the configuration it was measured on."""

    name: str
    source: str
    engine: str
    measure: str  # "first-stage activations" or "peak reserved"
    published_gib: float
    cluster: str
    spec: str
    gpus: int
    global_batch: int
    seq: int
    options: dict = field(default_factory=dict)  # the estimate's other keywords
    assumptions: tuple[str, ...] = ()


def korthikanti_figures() -> list[MemoryFigure]:
    # (name, layers, hidden, heads, pp, gpus, global batch, micro-batch, schedule, chunks per rank, GiB)
    rows = [("22B", 48, 6144, 64, 1, 8, 4, 4, "1f1b", 1, 9.6), ("175B", 96, 12288, 96, 8, 64, 64, 1, "interleaved", 3, 12.4),
            ("530B", 105, 20480, 128, 35, 280, 280, 1, "interleaved", 3, 23.1),
            ("1T", 128, 25600, 160, 64, 512, 512, 1, "1f1b", 1, 26.6)]
    assumptions = ("175B and 530B: interleaved 1F1B with 3 chunks per rank, the paper's (1 + (p-1)/(pm)) factor "
                   "at m = 3; 22B and 1T without interleaving",
                   "GPT-3 blocks with dropout 0.1 (the paper's 34sbh/t accounting)")
    return [MemoryFigure(f"Korthikanti22 Fig1 {name}", KORTHIKANTI_FIGURE_1, "megatron", "first-stage activations",
                         gib, "a100-80g", f"gpt:layers={layers},hidden={hidden},heads={heads},vocab=51200", gpus, gbs,
                         2048, dict(tp=8, pp=pp, mbs=mbs, sp=True, recompute="selective", schedule=schedule, vpp=vpp),
                         assumptions)
            for name, layers, hidden, heads, pp, gpus, gbs, mbs, schedule, vpp, gib in rows]


def torchtitan_figures() -> list[MemoryFigure]:
    """Each FSDP row of the tables: eager, torch.compile, and torch.compile with Float8 (torchao
    tensorwise with float8 all-gather, the Float8 rows' settings in `published_runs`)."""
    assumptions = ("FSDP2 fully_shard over all GPUs (ZeRO-3), local batch 2 = one micro-batch, seq 8192 "
                   "(torchtitan's llama3_8b.toml), selective op activation checkpointing",)
    # torchtitan compiled the model alone then: the loss ran eagerly (`compile_loss` False)
    techniques = (("", {}), (" compile", dict(torch_compile=True, compile_loss=False)),
                  (" compile Float8", dict(torch_compile=True, compile_loss=False, precision="fp8",
                                           fp8_recipe="tensorwise")))
    rows = ((8, (82.4, 77.0, 76.8)), (128, (67.0, 62.0, 61.8)))
    return [MemoryFigure(f"torchtitan 8B FSDP {gpus} GPUs{label}", TORCHTITAN_H100, "torchtitan", "peak reserved",
                         gib, "h100-sxm", "llama3-8b", gpus, 2 * gpus, 8192,
                         dict(mbs=2, zero=3, recompute="selective", **extra), assumptions)
            for gpus, figures in rows for (label, extra), gib in zip(techniques, figures)]


def torchtitan_float8_figures() -> list[MemoryFigure]:
    """The same tables' Table 2 (Llama 3.1 8B on 8 GPUs, FSDP x CP at 32K-256K tokens, local batch
    1) and Table 4 (Llama 3.1 70B on 256 GPUs, FSDP 32 x TP 8, local batch 16, vanilla and async
    TP): torch.compile, Float8 (tensorwise with float8 all-gather) and full activation
    checkpointing, as `published_torchtitan_runs.torchtitan_h100_runs` times them."""
    common = dict(zero=3, recompute="full", precision="fp8", fp8_recipe="tensorwise", torch_compile=True,
                  compile_loss=False, attention="sdpa-flash")  # the loss eager, as torchtitan then ran it
    assumptions = ("torch.compile + Float8 (torchao tensorwise, float8 all-gather), full activation checkpointing",)
    cp_rows = [MemoryFigure(f"torchtitan 8B FSDP x CP {cp} {seq // 1024}K", TORCHTITAN_H100_TABLES, "torchtitan",
                            "peak reserved", gib, "h100-sxm", "llama3-8b", 8, 8 // cp, seq, dict(cp=cp, **common),
                            assumptions)
               for seq, cp, gib in ((32768, 1, 83.9), (65536, 2, 84.2), (131072, 4, 84.0), (262144, 8, 84.5))]
    tp_rows = [MemoryFigure(f"torchtitan 70B FSDP 32 x TP 8{' async' if overlap else ''}", TORCHTITAN_H100_TABLES,
                            "torchtitan", "peak reserved", gib, "h100-sxm", "llama3-70b", 256, 512, 8192,
                            dict(tp=8, sp=True, mbs=16, tp_comm_overlap=overlap, **common), assumptions)
               for overlap, gib in ((False, 71.9), (True, 67.6))]
    return cp_rows + tp_rows


def torchao_training_figures() -> list[MemoryFigure]:
    """torchao's float8 training table (Llama 3 8B under torchtitan, FSDP2 over 8 GPUs, per-op SAC,
    local batch 1, torch.compile): its H100 rows, on a torchtitan of February 2025 that ran the loss
    eagerly (BF16, Float8 tensorwise and rowwise), and its MI300X BF16 row, on an August 2025
    torchtitan that compiled the loss with the model (`training.compile`). Its MI300X Float8 rows
    are left out: the mi300x profile names no fp8 GEMM efficiency."""
    common = dict(mbs=1, zero=3, recompute="selective", torch_compile=True, attention="sdpa-flash")
    assumptions = ("torchtitan's llama3_8b.toml at local batch 1 (torchao's benchmarks/float8/training/llama3.sh)",)
    h100 = [MemoryFigure(f"torchao 8B FSDP 8 H100 compile {label}", TORCHAO_TRAINING, "torchtitan", "peak reserved",
                         gib, "h100-96g-500w", "llama3-8b", 8, 8, 8192, dict(common, compile_loss=False, **extra),
                         assumptions + ("the loss eager (torchtitan compiled the model alone before April 2025)",))
            for label, extra, gib in (("bf16", {}, 47.65),
                                      ("Float8 tensorwise", dict(precision="fp8", fp8_recipe="tensorwise"), 47.77),
                                      ("Float8 rowwise", dict(precision="fp8", fp8_recipe="rowwise"), 47.79))]
    mi300x = MemoryFigure("torchao 8B FSDP 8 MI300X compile bf16", TORCHAO_TRAINING, "torchtitan", "peak reserved",
                          39.09, "mi300x", "llama3-8b", 8, 8, 8192, common,
                          assumptions + ("the loss compiled with the model (torchtitan's training.compile)",))
    return h100 + [mi300x]


MEMORY_FIGURES = korthikanti_figures() + torchtitan_figures() + torchtitan_float8_figures() + torchao_training_figures()

def memory_engine(run: Run) -> str:
    """The engine whose memory recipe prices a run: the one it ran (`Run.engine`); the runs priced
    as `generic` for their time (Megatron-LM 2021-22 and Llama 3's stack) allocate as Megatron-LM does."""
    return "megatron" if run.engine == "generic" else run.engine


# reported apart: the README's runs at the largest micro-batch that fits, and the sweep's smaller ones
FOUNDRY_SOURCES = (MPT_SOURCE, MPT_SWEEP_SOURCE, MPT_LARGE_SCALE_SOURCE)


def cluster_for(name: str, source: str):
    from meshplan.planner.costing.hardware import load_cluster

    cluster = load_cluster(name)
    if source in (TORCHTITAN_H100, TORCHTITAN_H100_TABLES):
        cluster = replace(cluster, device=replace(cluster.device, memory_bytes=TORCHTITAN_H100_MEMORY_BYTES))
    return cluster


def predicted_gib(figure: MemoryFigure) -> tuple[float, bool]:
    """(the predicted figure comparable to the published one, fits) under the figure's engine."""
    from meshplan.planner.simulation.estimator import estimate

    prediction = estimate(figure.spec, cluster_for(figure.cluster, figure.source), gpus=figure.gpus,
                          global_batch=figure.global_batch, seq=figure.seq, engine=figure.engine, **figure.options)
    if figure.measure == "first-stage activations":
        return prediction.memory[0].activations / GIB, prediction.fits
    return prediction.peak_memory_bytes / GIB, prediction.fits


def run_fits(run: Run, engine: str) -> tuple[bool, float]:
    """Whether any of the run's virtual-stage options fits under `engine`, and the least peak (GiB).
    Megatron-Core's recompute modules of the run (`Run.recompute_modules`) and its bf16 gradient
    buffer (`Run.grad_reduce_in_bf16`) under the megatron recipe."""
    from meshplan.planner.simulation.estimator import estimate

    recompute, modules = run.recompute_for(engine)
    bf16_grads = run.grad_reduce_in_bf16 and engine == "megatron"
    peaks, fits = [], False
    for vpp in run.vpp_options:
        prediction = estimate(run.spec, run.cluster, gpus=run.gpus, global_batch=run.global_batch, seq=run.seq,
                              tp=run.tp, pp=run.pp, mbs=run.mbs, zero=run.zero, recompute=recompute, sp=run.sp,
                              schedule="interleaved" if vpp > 1 else "1f1b", vpp=vpp, precision=run.precision,
                              fp8_recipe=run.fp8_recipe if run.precision == "fp8" else None,
                              attention=run.attention, cp=run.cp, ep=run.ep, etp=run.etp, engine=engine,
                              recompute_modules=modules, grad_reduce_in_bf16=bf16_grads,
                              fp8_filter=run.fp8_filter if run.precision == "fp8" else (),
                              torch_compile=run.torch_compile and engine == "torchtitan",
                              compile_loss=run.compile_loss if engine == "torchtitan" else None)
        peaks.append(prediction.peak_memory_bytes / GIB)
        fits = fits or prediction.fits
    return fits, min(peaks)


# What a source says of a configuration's memory without a figure: it ran (fits) or ran out of memory.
TORCHTITAN_A100_STATEMENTS = [
    # (name, spec, seq, local batch, recompute, ran): Llama 3 Table rows (8B "selective op") and Llama 2
    # rows ("selective op" at 13B bs2 and 70B bs1; footnote 1: 70B at local batch 2 with selective
    # activation checkpointing runs out of memory)
    ("torchtitan Llama3 8B bs1 selective op", "llama3-8b", 8192, 1, "selective", True),
    ("torchtitan Llama2 13B bs2 selective op", "LLAMA2_13B", 4096, 2, "selective", True),
    ("torchtitan Llama2 70B bs1 selective op", "LLAMA2_70B", 4096, 1, "selective", True),
    ("torchtitan Llama2 70B bs2 selective (OOM)", "LLAMA2_70B", 4096, 2, "selective", False),
]


def statement_rows() -> list[tuple[str, bool, float]]:
    """(name, published: ran, predicted fits) of each statement, under torchtitan's FSDP2 (ZeRO-3 over
    64 A100 80GB, no gradient accumulation) with its op-level SAC as selective recomputation."""
    import published_runs
    from meshplan.planner.simulation.estimator import estimate

    rows = []
    for name, spec, seq, mbs, recompute, ran in TORCHTITAN_A100_STATEMENTS:
        spec = getattr(published_runs, spec, spec)
        prediction = estimate(spec, "a100-80g", gpus=64, global_batch=64 * mbs, seq=seq, mbs=mbs, zero=3,
                              recompute=recompute, engine="torchtitan")
        rows.append((name, ran, prediction.fits, prediction.peak_memory_bytes / GIB))
    return rows


def print_statements() -> None:
    rows = statement_rows()
    print(f"\nstatements without a figure ({TORCHTITAN_A100}, footnote 1), under torchtitan:")
    for name, ran, fits, peak in rows:
        verdict = "agrees" if ran == fits else "MISS"
        print(f"  {name:<44} published {'ran' if ran else 'out of memory':<13} predicted "
              f"{'fits' if fits else 'out of memory':<13} {peak:6.1f} GiB  {verdict}")
    print(f"{sum(ran == fits for _, ran, fits, _ in rows)} of {len(rows)} statements agree")


def print_out_of_memory(title: str, runs: list[Run], engine_of=memory_engine) -> None:
    """The runs (all of which ran) that `engine_of` calls out of memory, and their count."""
    print(f"\n{title}, all of which ran: {len(runs)}")
    out_of_memory = []
    for run in runs:
        engine = engine_of(run)
        fits, peak = run_fits(run, engine)
        if not fits:
            out_of_memory.append((run, engine, peak))
    for run, engine, peak in out_of_memory:
        print(f"  called out of memory: {run.name} ({engine}, {run.cluster}): {peak:.1f} GiB")
    executor = sum(not run_fits(run, "meshplan")[0] for run in runs)
    print(f"{len(out_of_memory)} of {len(runs)} called out of memory (target 0); under meshplan's own "
          f"executor recipe: {executor}")


def print_llama3_pipeline_note() -> None:
    """Why Llama 3's 405B runs can stay out of memory: Meta's schedule is not one meshplan prices."""
    from meshplan.planner.simulation.schedules import max_in_flight, rank_actions

    run = next(run for run in all_runs() if run.source == LLAMA3_2024)
    microbatches = run.global_batch // (run.gpus // (run.tp * run.pp)) // run.mbs
    held = {vpp: max_in_flight(rank_actions("interleaved", run.pp, microbatches, vpp, 1)) for vpp in run.vpp_options}
    print(f"  Llama 3 405B (Dubey et al. 2024, section 3.3.2): meshplan prices interleaved 1F1B with micro-batches "
          f"in groups of pp = {run.pp} per virtual stage (torch's and Megatron-Core's default), so pipeline rank 1 "
          f"holds {', '.join(f'{n} chunk-micro-batches at vpp {v}' for v, n in held.items())}. Meta's schedule "
          "makes that group size N tunable and does not publish it. meshplan prices Megatron-Core's N "
          "(--microbatch-group-size, --microbatch-group-size-per-virtual-pipeline-stage), which must be at least "
          "pp: below it rank 0's warm-up forwards ((vpp - 1) x N + 2(pp - 1)) wait on forwards the last rank runs "
          "only after a backward that waits on rank 0, so the order deadlocks; a larger N holds more. Meta's "
          "smaller-N schedule (its warm-up rule unpublished) is not one meshplan can price, so these runs stay "
          "listed. Its other two memory measures are priced: the first and last stages hold one layer fewer (the "
          "embedding and the output layer count as layers in Megatron's cut), and sent outputs are freed "
          "(Megatron's deallocate_output_tensor).")


def main() -> int:
    print(f"published per-GPU memory, each under its engine (target |error| <= {TOLERANCE:.0%})")
    print(f"{'figure':<48} {'engine':<10} {'measure':<24} {'published':>9} {'predicted':>9} {'error':>7}")
    within = 0
    for figure in MEMORY_FIGURES:
        predicted, _ = predicted_gib(figure)
        error = predicted / figure.published_gib - 1
        within += abs(error) <= TOLERANCE
        print(f"{figure.name:<48} {figure.engine:<10} {figure.measure:<24} {figure.published_gib:9.1f} "
              f"{predicted:9.1f} {error:+7.1%}")
    print(f"{within} of {len(MEMORY_FIGURES)} figures within {TOLERANCE:.0%}")
    for source in dict.fromkeys(f.source for f in MEMORY_FIGURES):
        print(f"  source: {source}")
    print_statements()
    held = [run for run in all_runs() if run.group in (HELD_OUT, HELD_OUT_FP8, HELD_OUT_MOE)]
    print_out_of_memory("held-out runs of Megatron-LM and torchtitan",
                        [run for run in held if run.source not in FOUNDRY_SOURCES])
    # the fit sets tune time (efficiency fields) only: for memory they are held out too
    print_out_of_memory("fit-set runs (time fit sets; no memory constant is fitted), under Megatron-LM",
                        [run for run in all_runs() if run.group in FIT_SETS])
    print_llama3_pipeline_note()
    print_out_of_memory("held-out llm-foundry runs, under its recipe",
                        [run for run in held if run.source in FOUNDRY_SOURCES])
    return 0


if __name__ == "__main__":
    sys.exit(main())
