"""How far a predicted step may be from the measured one: the held-out error of its regime.

`benchmarks/bench_fidelity.py --write-bands` scores meshplan against the published runs that never
tuned a profile (`benchmarks/published_runs.py`'s held-out sets) and writes, per regime, what the
errors were (`profiles/error_bands.json`, through `bands_document`); nothing in it is typed by
hand. A regime is the set of runs a prediction resembles: dense BF16, FP8 (the fp8 recipe) or
mixture of experts (expert parallelism). The band is the 10th to 90th percentile of the regime's
relative error e = predicted / published - 1 (its extremes when it has fewer than
`MIN_RUNS_FOR_PERCENTILES` runs), turned around: the measured step is expected in
[predicted / (1 + e_high), predicted / (1 + e_low)]. Times and costs scale with the step, so
they carry the same band.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

REGIMES = ("dense", "fp8", "moe")
LOW_PERCENTILE, HIGH_PERCENTILE = 10.0, 90.0
MIN_RUNS_FOR_PERCENTILES = 10
BANDS_FILE = "error_bands.json"


@dataclass(frozen=True)
class Band:
    """One regime's held-out relative errors (predicted / published - 1): the band's ends."""

    regime: str
    error_low: float
    error_high: float
    num_runs: int
    how: str  # what was measured, on which runs

    def __post_init__(self):
        if self.regime not in REGIMES:
            raise ValueError(f"regime must be one of {', '.join(REGIMES)}, got {self.regime!r}")
        if not -1 < self.error_low <= self.error_high or self.num_runs <= 0:
            raise ValueError(f"band {self.regime}: errors {self.error_low}..{self.error_high} over {self.num_runs} "
                             "runs is not a band")

    def around(self, predicted: float) -> tuple[float, float]:
        """(low, high) of what a measurement of a predicted `predicted` is expected to read."""
        return predicted / (1 + self.error_high), predicted / (1 + self.error_low)

    def to_json(self, predicted_step_s: float) -> dict:
        low, high = self.around(predicted_step_s)
        return {"regime": self.regime, "step_time_s": [low, high], "error_low": self.error_low,
                "error_high": self.error_high, "num_runs": self.num_runs, "how": self.how}


def band_from_errors(regime: str, errors: list[float], how: str) -> Band:
    """The band of a regime's held-out errors (the benchmark's side of the file)."""
    if len(errors) >= MIN_RUNS_FOR_PERCENTILES:
        low, high = np.percentile(errors, [LOW_PERCENTILE, HIGH_PERCENTILE])
        how = f"{how}; 10th to 90th percentile of {len(errors)} runs"
    else:
        low, high = min(errors), max(errors)
        how = f"{how}; the extremes of {len(errors)} runs (too few for percentiles)"
    return Band(regime, float(low), float(high), len(errors), how)


def bands_document(bands: list[Band], written_by: str) -> str:
    """The JSON text of `profiles/error_bands.json`."""
    return json.dumps({"written_by": written_by, "bands": {band.regime: {
        "error_low": band.error_low, "error_high": band.error_high, "num_runs": band.num_runs, "how": band.how}
        for band in bands}}, indent=2) + "\n"


@lru_cache(maxsize=1)
def load_bands(path: str | None = None) -> dict[str, Band]:
    from meshplan.planner.costing.hardware import PROFILES_DIR

    data = json.loads(Path(path or PROFILES_DIR / BANDS_FILE).read_text())
    return {name: Band(name, **values) for name, values in data["bands"].items()}


def regime_of(config, moe_model: bool) -> str | None:
    """The regime a configuration's prediction belongs to; None for fp32 (every published run is
    bf16 or fp8, on GPUs: nothing measured the error of an fp32 or CPU prediction)."""
    if config.precision == "fp32":
        return None
    if config.precision == "fp8":
        return "fp8"
    if moe_model or config.ep > 1:
        return "moe"
    return "dense"


def band_for(config, moe_model: bool) -> Band | None:
    """The held-out band of a configuration's regime (None when none was measured)."""
    regime = regime_of(config, moe_model)
    return load_bands().get(regime) if regime else None


def band_text(band: Band, predicted: float, scale: float, unit: str) -> str:
    """`likely 1.2-1.5 s (held-out dense runs: -8% to +12%)`: a band in words, `scale` units per second."""
    low, high = band.around(predicted)
    return (f"likely {_figure(low * scale)}-{_figure(high * scale)} {unit} (held-out {band.regime} runs err "
            f"{band.error_low:+.0%} to {band.error_high:+.0%}, {band.num_runs} runs)")


def _figure(value: float) -> str:
    """Four significant digits below 10,000, whole numbers with thousands separators above (no
    exponent: `10,530 ms`, not `1.053e+04 ms`)."""
    return f"{value:,.0f}" if abs(value) >= 10_000 else f"{value:.4g}"
