"""The regimes `bench_fidelity.py` reports every held-out run by, and its closing checklist: each
accuracy target of meshplan's step-time model beside the figure this run of the benchmark scored,
met or not (nothing here is fitted; the figures are the ones printed above it).

Targets (held out unless a line says "fit"): the mean |error| of every held-out run <= 10%; every
regime of at least five runs <= 15% and below the constant-MFU rule on the same runs; the rank
correlation of predicted against published model TFLOP/s per GPU >= 0.9; each fit set <= 3%;
every long-sequence FSDP run (16K-64K tokens) within 15%; every FP8/BF16 speed-up of one layout
within 10% of the published one.
"""
from __future__ import annotations

from typing import Callable, Sequence

from fit_efficiency import graph_of

# Regimes every held-out run is also reported by (a run may be in several): where estimators err.
SMALL_HIDDEN = 2048      # "small models": hidden 2048 or less
LONG_SEQ = 16384         # "long sequences": 16K tokens or more
LONG_FSDP_MAX_SEQ = 65536  # the long-sequence FSDP regime: ZeRO-2/3 runs of 16K-64K tokens
LONG_FSDP = f"long-sequence FSDP ({LONG_SEQ // 1024}K-{LONG_FSDP_MAX_SEQ // 1024}K)"
WITHIN = 0.15            # each regime also counts its runs within this |error|
# The targets (module docstring).
HELD_OUT_MEAN, REGIME_MEAN, MIN_REGIME_RUNS, MIN_RANK, FIT_MEAN, FP8_PAIR = 0.10, 0.15, 5, 0.9, 0.03, 0.10


def regimes(run) -> tuple[str, ...]:
    """The regimes `run` belongs to: dense (no experts, bf16, no FSDP), FSDP (ZeRO-2/3 without TP/PP:
    FSDP's FULL_SHARD and SHARD_GRAD_OP), long sequence, long-sequence FSDP (16K-64K tokens), CP,
    FP8, MoE, small model."""
    hidden = graph_of(run.spec, run.seq, run.attention).info.hidden
    out = []
    fsdp = run.zero >= 2 and run.tp == run.pp == 1
    if run.ep == 1 and run.precision != "fp8" and not fsdp:
        out.append("dense (TP/PP/DP)")
    if fsdp:
        out.append("FSDP")
    if run.seq >= LONG_SEQ:
        out.append(f"long sequence (>= {LONG_SEQ // 1024}K)")
    if fsdp and LONG_SEQ <= run.seq <= LONG_FSDP_MAX_SEQ:
        out.append(LONG_FSDP)
    if run.cp > 1:
        out.append("CP")
    if run.precision == "fp8":
        out.append("FP8")
    if run.ep > 1:
        out.append("MoE")
    if hidden <= SMALL_HIDDEN:
        out.append(f"small model (hidden <= {SMALL_HIDDEN})")
    return tuple(out)


def regime_groups(scored: Sequence) -> dict[str, list]:
    """The scored runs of each regime, by name."""
    groups: dict[str, list] = {}
    for s in scored:
        for regime in regimes(s.run):
            groups.setdefault(regime, []).append(s)
    return groups


def print_targets(fit_means: dict[str, float], held: Sequence, metrics: Callable[[Sequence], dict],
                  fp8_pair_errors: Sequence[float]) -> None:
    """The checklist: `fit_means` each fit set's mean |error|, `held` every held-out run scored,
    `metrics` the benchmark's figures of a set of scored runs, `fp8_pair_errors` the FP8/BF16
    speed-up errors of the pairs of one layout."""
    lines = [(f"fit set {name}: mean |error| {mean:.1%} (target <= {FIT_MEAN:.0%})", mean <= FIT_MEAN)
             for name, mean in sorted(fit_means.items())]
    if held:
        every = metrics(held)
        lines.append((f"every held-out run ({every['runs']}): mean |error| {every['mean']:.1%} (target <= {HELD_OUT_MEAN:.0%})",
                      every["mean"] <= HELD_OUT_MEAN))
        lines.append((f"rank correlation of model TFLOP/s per GPU: {every['rho_tflops']:.2f} (target >= {MIN_RANK})",
                      every["rho_tflops"] >= MIN_RANK))
        groups = regime_groups(held)
        for regime in sorted(groups):
            if len(groups[regime]) >= MIN_REGIME_RUNS:
                m = metrics(groups[regime])
                lines.append((f"{regime} ({m['runs']} runs): {m['mean']:.1%} (target <= {REGIME_MEAN:.0%} and below the "
                              f"constant-MFU rule's {m['rule']:.1%})", m["mean"] <= REGIME_MEAN and m["mean"] < m["rule"]))
        long_fsdp = groups.get(LONG_FSDP, [])
        inside = sum(abs(s.error) <= WITHIN for s in long_fsdp)
        lines.append((f"{LONG_FSDP}: {inside} of {len(long_fsdp)} runs within {WITHIN:.0%} (target: all)",
                      bool(long_fsdp) and inside == len(long_fsdp)))
    if fp8_pair_errors:
        inside = sum(abs(e) <= FP8_PAIR for e in fp8_pair_errors)
        lines.append((f"FP8/BF16 speed-ups of one layout: {inside} of {len(fp8_pair_errors)} within {FP8_PAIR:.0%} (target: all)",
                      inside == len(fp8_pair_errors)))
    print("\n== targets ==")
    for text, met in lines:
        print(f"  {'met    ' if met else 'NOT MET'}  {text}")
    print(f"{sum(met for _, met in lines)} of {len(lines)} targets met")
