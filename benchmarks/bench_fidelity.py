"""How close `estimate` comes to published, measured training runs: fit sets and held-out apart.

The runs and their sources are in `published_runs.py`. The efficiency fields of the GPU profiles
are fitted on the fit sets only (`fit_efficiency.py`: Narayanan et al. 2021 Table 1 for A100,
Llama 3 Table 4 and the Megatron-LM README's H100 table for H100, NVIDIA's nccl-tests figures
for the NICs); the held-out runs
(Korthikanti et al. 2022 Table 5, the Megatron-LM README's H100 strong-scaling ends, MosaicML's
MPT benchmarks, torchtitan's FSDP2 runs) never
tuned anything. No run has its own correction. A run whose engine meshplan models (torchtitan,
Megatron-Bridge's recipes: `Run.engine`) is priced as `--engine` prices it, with that engine's
overlap (`planner/contracts/overlap.py`) and memory. MosaicML's FP8 runs are held out too and
reported in a section of their own ("FP8 (held out)"), costed with `--precision fp8`; so are
the published mixture-of-experts runs ("MoE (held out)": Qwen3 with expert parallelism,
Megatron-MoE-ModelZoo on H100 and Megatron-Bridge on H100, GB200 and B200), costed under balanced
routing; the MoE runs whose published figure the engine's maintainers call a regression
(`Run.regression`) are listed after that section, with the set's figure without them.

Run: python benchmarks/bench_fidelity.py [--no-cv] [--brief] [--write-bands] [SUBSTRING]

`--write-bands` writes the held-out errors of each regime (dense BF16, FP8, MoE) into
`profiles/error_bands.json`, the bands every prediction is shown with
(`planner.costing.error_bands`).

For the fit sets and the held-out set, each grouped by source, it prints predicted vs published
step time and the error per run (a run whose virtual-stage count or micro-batch is unpublished
prints the spread over the options and is scored at their geometric mean), then mean and max |error| and
the Spearman rank correlation of predicted against published throughput, per GPU in tokens/s, in
model TFLOP/s and as MFU (the MFU ranking is the harder one: model size does not order it), and
beside them the mean |error| of a rule of thumb on the same runs: every run at 50% of the BF16
peak. Then every held-out run by regime (dense, FSDP, long sequence, long-sequence FSDP, CP,
FP8, MoE, small model), each with how many of its runs are within 15%, and by the engine that
prices it (`--engine`: llm-foundry, megatron, torchtitan, generic). Last, unless
`--no-cv`, a cross-validated figure: each fit set split in two halves (alternate rows), fitted
on one, scored on the other, both ways, averaged. `--brief` prints the summaries only.
"""
from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from fit_efficiency import base_clusters, fit_a100, fit_h100, fit_links, graph_of, layouts, predictions, published_step_s  # noqa: E402
from fidelity_targets import WITHIN, print_targets, regime_groups  # noqa: E402
from published_dgx_cloud_runs import (DGX_CLOUD_250504_LLAMA, DGX_CLOUD_250504_LLAMA_GB200, DGX_CLOUD_GROK1,  # noqa: E402
                                      DGX_CLOUD_GROK1_GB200, DGX_CLOUD_2504_GPT3, DGX_CLOUD_2504_LLAMA,
                                      DGX_CLOUD_2504_NEMOTRON, DGX_CLOUD_NEMOTRON_H, NEMOTRON_GB200_STRONG,
                                      NEMOTRON_GB200_WEAK)
from published_zoo_script_runs import ZOO_MIXTRAL_SCRIPT, ZOO_QWEN3_H100_SCRIPT  # noqa: E402
from published_moe_runs import (DGX_CLOUD_DEEPSEEK_V3, DGX_CLOUD_DEEPSEEK_V3_GB200_SOURCE,  # noqa: E402
                                MEGATRON_BRIDGE_2511_ARCHIVE_H100, MEGATRON_BRIDGE_260401_H100, MEGATRON_BRIDGE_2606_H100,
                                MEGATRON_BRIDGE_DEEPSEEK_V3_CARD,
                                MEGATRON_BRIDGE_EP_OVERLAP_SKILL, MEGATRON_BRIDGE_EP_OVERLAP_SMOKE)
from published_runs import (HELD_OUT, HELD_OUT_FP8, HELD_OUT_MOE, KORTHIKANTI_2022, LLAMA3_2024,  # noqa: E402
                            MEGATRON_BRIDGE_BLACKWELL, MEGATRON_BRIDGE_H100, MEGATRON_LM_H100, MEGATRON_LM_H100_STRONG,
                            MEGATRON_MOE_QWEN3,
                            MEGATRON_MOE_QWEN3_GB200, MPT_LARGE_SCALE_SOURCE, MPT_SOURCE, MPT_SWEEP_SOURCE,
                            NARAYANAN_2021, TORCHTITAN_A100,
                            TORCHAO_FLOAT8, TORCHTITAN_ASYNC_TP, TORCHTITAN_H100, TORCHTITAN_H100_SAC,
                            TORCHTITAN_ROWWISE_FILTER, TRAINY_H200, Run, all_runs, fit_runs)


@dataclass(frozen=True)
class Scored:
    run: Run
    published_s: float
    predicted_s: tuple[float, ...]   # one per layout option (unpublished micro-batch, virtual stages)
    fits: bool
    layouts: tuple[tuple[int, int], ...]  # (micro-batch, virtual stages) of each prediction

    @property
    def error(self) -> float:
        """Relative step-time error at the geometric mean over the options."""
        logs = [math.log(p / self.published_s) for p in self.predicted_s]
        return math.exp(sum(logs) / len(logs)) - 1

    @property
    def predicted_mean_s(self) -> float:
        return self.published_s * (1 + self.error)


def score(runs: Sequence[Run], clusters: dict[str, object]) -> list[Scored]:
    out = []
    for run in runs:
        options = predictions(run, clusters[run.cluster])
        out.append(Scored(run, published_step_s(run), tuple(p.step_time_s for p in options),
                          all(p.fits for p in options), layouts(run, clusters[run.cluster])))
    return out


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rho: Pearson's correlation of the ranks (ties share their mean rank)."""
    def ranks(values):
        values = np.asarray(values, dtype=float)
        order = np.argsort(values, kind="stable")
        rank = np.empty(len(values))
        rank[order] = np.arange(len(values), dtype=float)
        for value in np.unique(values):
            tied = values == value
            rank[tied] = rank[tied].mean()
        return rank
    if len(a) < 3:
        return float("nan")
    ra, rb = ranks(a), ranks(b)
    if ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


# The constant-utilisation rule every figure is printed beside: each run at half the BF16 peak.
CONSTANT_MFU = 0.5


def metrics(scored: Sequence[Scored], clusters: dict[str, object]) -> dict[str, float]:
    """The figures `summary` prints: mean, max and signed error, the Spearman rank correlations of
    predicted against published throughput (tokens/s, model TFLOP/s and MFU per GPU; nan under 3
    runs) and the constant-MFU rule's mean |error| on the same runs."""
    errors = [abs(s.error) for s in scored]
    per_gpu_published = [s.run.tokens_per_step / s.published_s / s.run.gpus for s in scored]
    per_gpu_predicted = [s.run.tokens_per_step / s.predicted_mean_s / s.run.gpus for s in scored]
    # MFU = model FLOPs / (step x GPUs x peak); the FLOPs cancel in the ratio but not across runs.
    def mfu(s: Scored, step_s: float) -> float:
        graph = graph_of(s.run.spec, s.run.seq, s.run.attention)
        peak = clusters[s.run.cluster].device.peak_flops("bf16")
        return float(graph.fwd_flops + graph.bwd_flops) * s.run.global_batch / (step_s * s.run.gpus * peak)
    mfu_published = [mfu(s, s.published_s) for s in scored]
    mfu_predicted = [mfu(s, s.predicted_mean_s) for s in scored]
    # model TFLOP/s per GPU: MFU times the device's peak (orders runs across devices too)
    tflops_published = [m * clusters[s.run.cluster].device.peak_flops("bf16") for m, s in zip(mfu_published, scored)]
    tflops_predicted = [m * clusters[s.run.cluster].device.peak_flops("bf16") for m, s in zip(mfu_predicted, scored)]
    # The rule of thumb on the same runs: every run at CONSTANT_MFU of the dense BF16 peak (the
    # step whose MFU that is: mfu(s, 1 s) / CONSTANT_MFU seconds). Nothing is fitted in it.
    rule_errors = [abs(mfu(s, 1.0) / CONSTANT_MFU / s.published_s - 1) for s in scored]
    return {"runs": len(scored), "mean": float(np.mean(errors)), "max": max(errors),
            "signed": float(np.mean([s.error for s in scored])),
            "rho_tokens": spearman(per_gpu_predicted, per_gpu_published),
            "rho_tflops": spearman(tflops_predicted, tflops_published),
            "rho_mfu": spearman(mfu_predicted, mfu_published), "rule": float(np.mean(rule_errors))}


def summary(scored: Sequence[Scored], clusters: dict[str, object]) -> str:
    m = metrics(scored, clusters)
    def rho(value) -> str:
        return "n/a (under 3 runs)" if math.isnan(value) else f"{value:.2f}"
    return (f"{m['runs']} runs: mean |error| {m['mean']:.1%}, max {m['max']:.1%}, mean signed "
            f"{m['signed']:+.1%}; rank correlation tokens/s/GPU "
            f"{rho(m['rho_tokens'])}, model TFLOP/s/GPU {rho(m['rho_tflops'])}, "
            f"MFU {rho(m['rho_mfu'])}; "
            f"a constant {CONSTANT_MFU:.0%}-MFU rule: mean |error| {m['rule']:.1%}")


def print_rows(scored: Sequence[Scored]) -> None:
    print(f"  {'run':<44} {'gpus':>6} {'published s':>12} {'predicted s':>12} {'error':>8}  fits")
    for s in scored:
        spread = ""
        if len(s.predicted_s) > 1:
            options = ", ".join(f"{'mbs %d ' % m if s.run.mbs_options else ''}vpp {v} {p / s.published_s - 1:+.1%}"
                                for (m, v), p in zip(s.layouts, s.predicted_s))
            spread = f"  ({options})"
        print(f"  {s.run.name:<44} {s.run.gpus:>6} {s.published_s:>12.3f} {s.predicted_mean_s:>12.3f} "
              f"{s.error:>+8.1%}  {'yes' if s.fits else 'NO '}{spread}")


SOURCE_LABELS = {NARAYANAN_2021: "Narayanan et al. 2021 Table 1", LLAMA3_2024: "Llama 3 Table 4",
                 MEGATRON_LM_H100: "Megatron-LM README H100 table",
                 MEGATRON_LM_H100_STRONG: "Megatron-LM README H100 strong scaling, its two ends",
                 KORTHIKANTI_2022: "Korthikanti et al. 2022 Table 5", MPT_SOURCE: "MosaicML MPT (llm-foundry)",
                 MPT_SWEEP_SOURCE: "MosaicML MPT micro-batch sweep (llm-foundry)",
                 MPT_LARGE_SCALE_SOURCE: "MosaicML MPT at 128-512 GPUs (llm-foundry)",
                 TORCHTITAN_A100: "torchtitan FSDP2, 64 A100", MEGATRON_MOE_QWEN3: "Megatron-MoE-ModelZoo Qwen3",
                 MEGATRON_MOE_QWEN3_GB200: "Megatron-MoE-ModelZoo Qwen3 GB200",
                 ZOO_QWEN3_H100_SCRIPT: "Megatron-MoE-ModelZoo run_h100_235b.sh",
                 ZOO_MIXTRAL_SCRIPT: "Megatron-MoE-ModelZoo run_mixtral_8x22B.sh",
                 MEGATRON_BRIDGE_H100: "Megatron-Bridge 25.11 DGX-H100",
                 MEGATRON_BRIDGE_BLACKWELL: "Megatron-Bridge 25.11 DGX-GB200 and DGX-B200",
                 TORCHTITAN_H100: "torchtitan Float8, H100 at 500 W",
                 TORCHTITAN_H100_SAC: "torchtitan selective op checkpointing, H100 at 500 W",
                 TRAINY_H200: "torchtitan on H200 (Trainy)",
                 TORCHTITAN_ASYNC_TP: "torchtitan async-TP tables, H100 at 500 W",
                 TORCHTITAN_ROWWISE_FILTER: "torchtitan auto-filter commit (rowwise, wk and wv in bf16), H100 at 500 W",
                 TORCHAO_FLOAT8: "torchao float8 training benchmarks (torchtitan), H100 at 500 W",
                 MEGATRON_BRIDGE_2606_H100: "Megatron-Bridge 26.06 DGX-H100",
                 MEGATRON_BRIDGE_2511_ARCHIVE_H100: "Megatron-Bridge 25.11 DGX-H100 (archive)",
                 MEGATRON_BRIDGE_260401_H100: "Megatron-Bridge 26.04.01 DGX-H100",
                 DGX_CLOUD_DEEPSEEK_V3: "DGX Cloud benchmarking DeepSeek-V3",
                 DGX_CLOUD_DEEPSEEK_V3_GB200_SOURCE: "DGX Cloud benchmarking DeepSeek-V3, GB200",
                 DGX_CLOUD_GROK1: "DGX Cloud benchmarking Grok-1 314B",
                 DGX_CLOUD_GROK1_GB200: "DGX Cloud benchmarking Grok-1 314B, GB200",
                 MEGATRON_BRIDGE_EP_OVERLAP_SMOKE: "Megatron-Bridge EP-overlap guide, alltoall, 16 H100",
                 MEGATRON_BRIDGE_EP_OVERLAP_SKILL: "Megatron-Bridge EP-overlap guide, HybridEP, 16 H100",
                 MEGATRON_BRIDGE_DEEPSEEK_V3_CARD: "Megatron-Bridge DeepSeek-V3 verification card, 1,024 H100",
                 DGX_CLOUD_2504_LLAMA: "DGX Cloud benchmarking v25.04 Llama 3.1",
                 DGX_CLOUD_250504_LLAMA: "DGX Cloud benchmarking v25.05.04 Llama 3.1 405B",
                 DGX_CLOUD_2504_GPT3: "DGX Cloud benchmarking v25.04 GPT-3 175B",
                 DGX_CLOUD_2504_NEMOTRON: "DGX Cloud benchmarking v25.04 Nemotron-4",
                 DGX_CLOUD_250504_LLAMA_GB200: "DGX Cloud benchmarking v25.05.04 Llama 3.1 405B, GB200",
                 NEMOTRON_GB200_WEAK: "DGX Cloud benchmarking v25.05.04 Nemotron-4 340B, GB200",
                 NEMOTRON_GB200_STRONG: "DGX Cloud benchmarking v25.05.04 Nemotron-4 340B, GB200, GBS 512",
                 DGX_CLOUD_NEMOTRON_H: "DGX Cloud benchmarking v25.05.04 Nemotron-H 56B"}


def layout_band(scored: Sequence[Scored]) -> str | None:
    """How much of a group's error the unpublished layouts leave open: of the rows scored over
    several options (`Run.layouts`), how many published steps lie within the range the options
    predict, how wide that range is, and the mean |error| if every row were scored at its option
    nearest the published step. That last figure picks options by their error, so it is a bound
    on what knowing the layouts could give, never a fit or held-out figure. None when every row
    is scored at one layout."""
    several = [s for s in scored if len(s.predicted_s) > 1]
    if not several:
        return None
    inside = sum(min(s.predicted_s) <= s.published_s <= max(s.predicted_s) for s in several)
    widths = [max(s.predicted_s) / min(s.predicted_s) - 1 for s in several]
    nearest = [min(abs(p / s.published_s - 1) for p in s.predicted_s) for s in scored]
    return (f"unpublished layouts: {len(several)} of {len(scored)} runs scored over several; the published step "
            f"lies within their options' predictions in {inside}; that range spans {np.median(widths):.1%} "
            f"(median, max {max(widths):.1%}); at each run's option nearest the published step the mean |error| "
            f"would read {np.mean(nearest):.1%} (options picked by their error: a bound, not a fit figure)")


def report(title: str, scored: Sequence[Scored], clusters, brief: bool, by_cluster: bool = False) -> None:
    print(f"\n== {title} ==")
    groups: dict[str, list[Scored]] = {}
    for s in scored:
        key = SOURCE_LABELS[s.run.source] + (f" on {s.run.cluster}" if by_cluster else "")
        groups.setdefault(key, []).append(s)
    for key, members in groups.items():
        print(f"{key}:")
        if not brief:
            print_rows(members)
        print(f"  {summary(members, clusters)}")
    if len(groups) > 1:
        print(f"all {title}: {summary(scored, clusters)}")
    band = layout_band(scored)
    if band:
        print(f"{title}, {band}")


def report_regressions(scored: Sequence[Scored], clusters, brief: bool) -> None:
    """The runs whose engine's maintainers call the published figure a regression of that release
    (`Run.regression`), and the set's figure without them beside the whole set's (which stays the
    headline: they are scored like any other run)."""
    flagged = [s for s in scored if s.run.regression]
    if not flagged:
        return
    print(f"of which {len(flagged)} published figures their engine's maintainers call regressions:")
    for s in flagged:
        print(f"  {s.run.name}: {s.error:+.1%}" + ("" if brief else f" ({s.run.regression})"))
    rest = [s for s in scored if not s.run.regression]
    print(f"the other {len(rest)}: {summary(rest, clusters)}")


def report_by_cluster(title: str, scored: Sequence[Scored], clusters) -> None:
    """A set's figure on each cluster profile, those marked not validated (published specifications,
    no fit set: `ClusterProfile.validated`) named so; printed beside the set's figure, which counts
    every run."""
    groups: dict[str, list[Scored]] = {}
    for s in scored:
        groups.setdefault(s.run.cluster, []).append(s)
    if len(groups) < 2:
        return
    print(f"{title} by cluster profile:")
    for name, members in sorted(groups.items(), key=lambda item: -len(item[1])):
        mark = "" if clusters[name].validated else " (profile not validated)"
        print(f"  {name}{mark}: {summary(members, clusters)}")


def report_regimes(scored: Sequence[Scored], clusters) -> None:
    """Every held-out run (BF16, FP8 and MoE together) by regime, beside the constant-MFU rule."""
    print("\n== held out by regime (BF16, FP8 and MoE runs together; a run may be in several) ==")
    groups = regime_groups(scored)
    for regime in sorted(groups):
        members = groups[regime]
        within = sum(abs(s.error) <= WITHIN for s in members)
        # the regime's figure counts every run; beside it, the mean without the published figures their
        # engine's maintainers call regressions (`Run.regression`), where the regime holds any
        others = [s for s in members if not s.run.regression]
        apart = (f"; without the {len(members) - len(others)} published regressions: "
                 f"{np.mean([abs(s.error) for s in others]):.1%} over {len(others)}" if len(others) < len(members) else "")
        print(f"{regime}: {summary(members, clusters)}; within {WITHIN:.0%}: {within} of {len(members)}{apart}"
              f"{on_validated(members, clusters)}")
    print(f"every held-out run: {summary(scored, clusters)}{on_validated(scored, clusters)}")
    report_engines(scored, clusters)
    report_profiles(scored, clusters)


def on_validated(members: Sequence[Scored], clusters) -> str:
    """Where a set holds runs on profiles that are not validated (`report_profiles`), the mean
    |error| of the rest beside it: what the validated profiles read on their own."""
    validated = [s for s in members if clusters[s.run.cluster].validated]
    if len(validated) == len(members) or not validated:
        return ""
    m = metrics(validated, clusters)
    return f"; on validated profiles: {m['mean']:.1%} over {m['runs']} (the rule {m['rule']:.1%})"


def report_engines(scored: Sequence[Scored], clusters) -> None:
    """Every held-out run by the engine whose memory, overlap and kernels price it (`Run.engine`,
    `--engine`): what a prediction under each engine has read on published runs."""
    print("\n== held out by engine (--engine; BF16, FP8 and MoE runs together) ==")
    engines: dict[str, list[Scored]] = {}
    for s in scored:
        engines.setdefault(s.run.engine, []).append(s)
    for engine, members in sorted(engines.items(), key=lambda item: -len(item[1])):
        print(f"{engine}: {summary(members, clusters)}")


def report_profiles(scored: Sequence[Scored], clusters) -> None:
    """Every held-out run by the cluster profile that priced it: a profile marked not validated
    borrows its efficiencies (`ClusterProfile.validated`), so its runs say how far they carry. The
    regimes above count them all."""
    print("\n== held out by cluster profile (BF16, FP8 and MoE runs together) ==")
    profiles: dict[str, list[Scored]] = {}
    for s in scored:
        profiles.setdefault(s.run.cluster, []).append(s)
    for profile, members in sorted(profiles.items(), key=lambda item: -len(item[1])):
        mark = "" if clusters[profile].validated else " (profile not validated)"
        print(f"{profile}{mark}: {summary(members, clusters)}")


def fp8_pairs(fp8: Sequence[Run], bf16: Sequence[Run]) -> list[tuple[Run, Run]]:
    """(FP8, BF16) runs one source publishes for one model, sequence length, GPU count and profile,
    or an FP8 run and the BF16 runs of the source it names as its baseline (`Run.bf16_baseline_source`)."""
    return [(f, b) for f in fp8 for b in bf16 if b.source == (f.bf16_baseline_source or f.source)
            and b.cluster == f.cluster and b.seq == f.seq and b.gpus == f.gpus and b.spec == f.spec]


def fp8_speedups(fp8: Sequence[Run], bf16: Sequence[Run], clusters,
                 title: str = "FP8 over BF16 throughput, same model, sequence and GPUs:") -> list[float]:
    """FP8 over BF16 throughput where the source publishes both for one model, sequence length and
    GPU count (their batch splits may differ), or an FP8 run names the source of its BF16 baseline
    (`Run.bf16_baseline_source`): the fp8 rule's own error, apart from the step's. Dense and MoE
    runs are paired apart (each among its own held-out group), under `title`.
    Returns the speed-up errors of the pairs of one layout."""
    pairs = fp8_pairs(fp8, bf16)
    if not pairs:
        return []
    print(title)
    errors, same, recipes = [], [], []
    for f, b in pairs:
        (sf, sb) = score([f, b], clusters)
        published = (f.tokens_per_step / sf.published_s) / (b.tokens_per_step / sb.published_s)
        predicted = (f.tokens_per_step / sf.predicted_mean_s) / (b.tokens_per_step / sb.predicted_mean_s)
        errors.append(predicted / published - 1)
        same.append(layout_of(f) == layout_of(b))
        recipes.append(f.fp8_recipe)
        print(f"  {f.name:<44} published {published:.2f}x predicted {predicted:.2f}x ({errors[-1]:+.1%})"
              f"{'' if same[-1] else ' (layout or compilation differs)'}")
    within = sum(abs(e) <= 0.10 for e in errors)
    print(f"  {len(pairs)} pairs: mean |speedup error| {np.mean(np.abs(errors)):.1%}, within 10%: {within} of {len(pairs)}")
    kept = [e for e, s in zip(errors, same) if s]
    if kept:
        print(f"  {len(kept)} pairs of one layout (TP, PP, CP, virtual stages, micro-batch, TP overlap, torch.compile): "
              f"mean |speedup error| "
              f"{np.mean(np.abs(kept)):.1%}, max {max(np.abs(kept)):.1%}, within 10%: "
              f"{sum(abs(e) <= 0.10 for e in kept)} of {len(kept)}")
        by_recipe = {}
        for error, one, recipe in zip(errors, same, recipes):
            if one:
                by_recipe.setdefault(recipe, []).append(error)
        print("  of one layout, by recipe: " + "; ".join(
            f"{recipe} {len(e)}: {np.mean(np.abs(e)):.1%}, within 10%: {sum(abs(x) <= 0.10 for x in e)}"
            for recipe, e in sorted(by_recipe.items())))
    return kept


def layout_of(run: Run) -> tuple:
    """A run's parallel layout, TP overlap and compilation: what an FP8/BF16 pair of one layout shares."""
    return run.tp, run.pp, run.cp, run.vpp_options, run.mbs, run.zero, run.tp_comm_overlap, run.torch_compile


def switch_pairs(scored: Sequence[Scored], on, off, layout) -> list[tuple[Scored, Scored]]:
    """(on, off) pairs of runs a source publishes in one `layout`, a setting on (`on(run)`) and off."""
    return [(a, b) for a in scored if on(a.run) for b in scored if off(b.run) and layout(b.run) == layout(a.run)]


def print_speedups(title: str, pairs: Sequence[tuple[Scored, Scored]]) -> None:
    """The off/on step-time ratio each pair's source prints beside the one meshplan predicts."""
    if not pairs:
        return
    print(title)
    for on, off in pairs:
        published, predicted = off.published_s / on.published_s, off.predicted_mean_s / on.predicted_mean_s
        print(f"  {on.run.name:<44} published {published:.2f}x predicted {predicted:.2f}x "
              f"({predicted / published - 1:+.1%})")


def a2a_overlap_speedups(scored: Sequence[Scored]) -> None:
    """Where a source publishes one layout with and without Megatron-Core's combined 1F1B
    (`Run.moe_a2a_overlap`): the overlap model's own error (`costing.moe_overlap`) apart from the step's."""
    def layout(run: Run) -> tuple:
        return (run.source, run.cluster, run.spec, run.gpus, run.global_batch, run.seq, run.tp, run.pp, run.ep,
                run.etp, run.vpp_options, run.recompute_modules, run.moe_dispatcher)

    print_speedups("combined 1F1B (--moe-a2a-overlap) over the same layout without it, step-time speed-up:",
                   switch_pairs(scored, lambda run: run.moe_a2a_overlap, lambda run: not run.moe_a2a_overlap, layout))


def tp_overlap_speedups(scored: Sequence[Scored]) -> None:
    """Where a source publishes one layout with and without TP communication overlap (torchtitan's
    async TP): the overlap rule's own error (`costing.overlap`) apart from the step's."""
    def layout(run: Run) -> tuple:
        return (run.source, run.cluster, run.spec, run.gpus, run.global_batch, run.seq, run.tp, run.mbs,
                run.recompute, run.precision, run.fp8_recipe)

    print_speedups("TP communication overlap over blocking TP, the same layout, step-time speed-up:",
                   switch_pairs(scored, lambda run: run.tp_comm_overlap, lambda run: run.tp_comm_overlap is False,
                                layout))


def recompute_ratios(scored: Sequence[Scored]) -> None:
    """Where a source publishes one layout with and without activation recomputation: the step-time
    ratio it prints beside the one meshplan predicts, the recomputation rule's own error (torchtitan's
    op and layer policies, `costing.torchtitan_sac`; full recomputation) apart from the step's."""
    def layout(run: Run) -> tuple:
        return (run.source, run.cluster, run.spec, run.gpus, run.global_batch, run.seq, layout_of(run), run.precision)

    pairs = switch_pairs(scored, lambda run: run.recompute != "none", lambda run: run.recompute == "none", layout)
    if not pairs:
        return
    print("recomputation over none, the same layout, step-time ratio:")
    for on, off in pairs:
        published, predicted = on.published_s / off.published_s, on.predicted_mean_s / off.predicted_mean_s
        every = f" every {on.run.recompute_every}" if on.run.recompute_every > 1 else ""
        print(f"  {on.run.name:<44} {on.run.recompute}{every}: published {published:.3f}x predicted {predicted:.3f}x "
              f"({predicted / published - 1:+.1%})")


def cross_validated() -> None:
    """Each fit set in two halves (alternate rows): fit on one, score the other, both ways. The
    nccl-tests link fits are shared (they use no run); the H100 folds take A100's full fit."""
    from dataclasses import replace

    links = fit_links()
    a100_runs, h100_runs = fit_runs("a100"), fit_runs("h100")
    a100_full = fit_a100(a100_runs, links)
    print("\n== cross-validated (fit on one half of a fit set, scored on the other, both ways) ==")
    pooled = []
    for label, runs in (("a100", a100_runs), ("h100", h100_runs)):
        halves = (runs[0::2], runs[1::2])
        errors = []
        for train, test in (halves, halves[::-1]):
            base = base_clusters(links)
            if label == "a100":
                values = fit_a100(train, links)
                name = "a100-80g"
            else:
                values = fit_h100(train, links, a100_full)
                name = "h100-sxm"
            base[name] = replace(base[name], device=replace(base[name].device, **values))
            errors += [abs(s.error) for s in score(test, base)]
        pooled += errors
        print(f"fit set {label}: held-out half mean |error| {np.mean(errors):.1%}, max {max(errors):.1%} "
              f"over {len(errors)} runs")
    print(f"both fit sets: mean |error| {np.mean(pooled):.1%}")


BAND_SETS = {"dense": "held-out BF16 runs (Korthikanti et al. 2022 T5, the Megatron-LM README's H100 strong-scaling "
                      "ends, MosaicML MPT, torchtitan FSDP2 on A100 and H100, DGX Cloud's Llama 3.1, GPT-3 and Nemotron-4)",
             "fp8": "held-out FP8 runs (MosaicML MPT H100 FP8, torchtitan Float8 on H100 and H200, Megatron-Bridge's DGX-H100 Llama, "
                    "DGX Cloud's Llama 3.1, GPT-3, Nemotron-4 and Nemotron-H)",
             "moe": "held-out MoE runs (Megatron-MoE-ModelZoo Qwen3; Megatron-Bridge Qwen3 and GPT-OSS on DGX-H100, "
                    "DGX-GB200 and DGX-B200; DGX Cloud's DeepSeek-V3, and Grok-1 on H100 and GB200)"}


def write_bands(scored_by_regime: dict[str, Sequence[Scored]], clusters) -> None:
    """Each regime's held-out step-time errors as its band, into profiles/error_bands.json: over the
    runs on validated profiles, and apart, each unvalidated profile's own runs (`error_bands`)."""
    from meshplan.planner.costing.error_bands import BANDS_FILE, band_from_errors, bands_document
    from meshplan.planner.costing.hardware import PROFILES_DIR

    bands = []
    for regime, scored in scored_by_regime.items():
        how = f"step-time error (predicted / published - 1) of the {BAND_SETS[regime]}"
        pooled = [s.error for s in scored if clusters[s.run.cluster].validated]
        if pooled:
            bands.append(band_from_errors(regime, pooled, f"{how} on validated profiles, scored by "
                                          "benchmarks/bench_fidelity.py"))
        for profile in sorted({s.run.cluster for s in scored if not clusters[s.run.cluster].validated}):
            own = [s.error for s in scored if s.run.cluster == profile]
            bands.append(band_from_errors(regime, own, f"{how} on profile {profile} (not validated) alone, "
                                          "scored by benchmarks/bench_fidelity.py", profile))
    path = Path(PROFILES_DIR) / BANDS_FILE
    path.write_text(bands_document(bands, "benchmarks/bench_fidelity.py --write-bands"))
    print("\nbands written to " + str(path) + ": " + "; ".join(
        f"{b.regime}{' on ' + b.profile if b.profile else ''} {b.error_low:+.1%}..{b.error_high:+.1%} "
        f"({b.num_runs} runs)" for b in bands))


def main(argv: list[str]) -> int:
    from meshplan.planner.costing.hardware import load_cluster

    brief, no_cv = "--brief" in argv, "--no-cv" in argv
    only = next((a for a in argv if not a.startswith("--")), "")
    start = time.perf_counter()
    runs = [r for r in all_runs() if only in r.name]
    clusters = {name: load_cluster(name) for name in sorted({r.cluster for r in runs})}
    fit_means, fp8_pair_errors = {}, []
    for fit_set in ("a100", "h100"):
        members = [r for r in runs if r.group == fit_set]
        if members:
            scored_fit = score(members, clusters)
            report(f"fit set {fit_set} (tunes the profiles)", scored_fit, clusters, brief)
            fit_means[fit_set] = float(np.mean([abs(s.error) for s in scored_fit]))
    held = [r for r in runs if r.group == HELD_OUT]
    if held:
        scored = score(held, clusters)
        report("held out (never tuned on)", scored, clusters, brief, by_cluster=True)
        recompute_ratios(scored)
        tp_overlap_speedups(scored)
        for family in ("a100", "h100", "gb200"):
            members = [s for s in scored if s.run.cluster.startswith(family)]
            if members:
                print(f"held out on {family.upper()}: {summary(members, clusters)}")
    fp8 = [r for r in runs if r.group == HELD_OUT_FP8]
    if fp8:  # apart: the fp8 recipe's efficiency is not fitted, and these runs tuned nothing
        report("FP8 (held out; --precision fp8, fp8_matmul_efficiency not fitted)", score(fp8, clusters), clusters,
               brief, by_cluster=True)
        fp8_pair_errors = fp8_speedups(fp8, [r for r in all_runs() if r.group == HELD_OUT], clusters)
        tp_overlap_speedups(score(fp8, clusters))
    moe = [r for r in runs if r.group == HELD_OUT_MOE]
    if moe:  # apart: expert parallelism's costs are not fitted, and these runs tuned nothing
        scored_moe = score(moe, clusters)
        report("MoE (held out; expert parallelism, balanced routing)", scored_moe, clusters, brief,
               by_cluster=True)
        report_regressions(scored_moe, clusters, brief)
        report_by_cluster("MoE", scored_moe, clusters)
        a2a_overlap_speedups(scored_moe)
        # a source's FP8 and BF16 runs of one MoE layout are pairs like the dense ones: the target counts them
        fp8_pair_errors = fp8_pair_errors + fp8_speedups(
            [r for r in moe if r.precision == "fp8"], [r for r in moe if r.precision != "fp8"], clusters,
            "MoE FP8 over BF16 throughput, same model, sequence and GPUs:")
    every_held = score([r for r in runs if r.group in (HELD_OUT, HELD_OUT_FP8, HELD_OUT_MOE)], clusters)
    if every_held:
        report_regimes(every_held, clusters)
    if "--write-bands" in argv and not only:
        write_bands({"dense": scored if held else [], "fp8": score(fp8, clusters) if fp8 else [],
                     "moe": score(moe, clusters) if moe else []}, clusters)
    print_targets(fit_means, every_held, lambda scored: metrics(scored, clusters), fp8_pair_errors)
    if not no_cv and not only:
        cross_validated()
    print(f"\n({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
