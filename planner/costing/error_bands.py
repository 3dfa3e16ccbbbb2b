"""How far a predicted step may be from the measured one: the held-out error of its regime.

`benchmarks/bench_fidelity.py --write-bands` scores meshplan against the published runs that never
tuned a profile (`benchmarks/published_runs.py`'s held-out sets) and writes, per regime, what the
errors were (`profiles/error_bands.json`, through `bands_document`); nothing in it is typed by
hand. A regime is the set of runs a prediction resembles: dense BF16, dense FP8 (the fp8 recipe)
or mixture of experts (expert parallelism, in either precision). The band is the 10th to 90th
percentile of the regime's relative error e = predicted / published - 1 (its extremes when it has
fewer than `MIN_RUNS_FOR_PERCENTILES` runs), turned around: the measured step is expected in
[predicted / (1 + e_high), predicted / (1 + e_low)]. Times and costs scale with the step, so
they carry the same band.

Bands are per kind of profile. A validated profile (fitted or measured on its part) takes its
regime's band over every held-out run on a validated profile. A profile from published
specifications only (`ClusterProfile.validated` false: borrowed efficiencies, nothing fitted on the
part) can be off by more than any of them, so it takes only what runs on that very profile
measured (`unvalidated_profiles` in the file): a band from at least `MIN_RUNS_FOR_BAND` of its own
held-out runs in the regime, else no band and one line saying so, with what its runs read
(`step_uncertainty`, `MissingBand`). fp32 predictions have no regime: no published run was fp32 or on CPUs.
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
# An unvalidated profile's own runs make its band only from this many on (fewer: their extremes
# are reported, no band claimed).
MIN_RUNS_FOR_BAND = MIN_RUNS_FOR_PERCENTILES
BANDS_FILE = "error_bands.json"


@dataclass(frozen=True)
class Band:
    """One regime's held-out relative errors (predicted / published - 1): the band's ends."""

    regime: str
    error_low: float
    error_high: float
    num_runs: int
    how: str  # what was measured, on which runs
    profile: str = ""  # the profile whose own runs these are; "" for validated profiles pooled
    fitted: bool = False  # the runs `calibrate --from-runs` fitted `profile` to (leave-one-out), not published ones

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

    @property
    def runs(self) -> str:
        """Whose errors these are: `fitted` (the runs `calibrate --from-runs` fitted the profile to),
        `own` (published runs on this profile alone) or `validated profiles` (pooled)."""
        return "fitted" if self.fitted else "own" if self.profile else "validated profiles"

    def fields(self) -> dict:
        """The band as the file keeps it."""
        return {"error_low": self.error_low, "error_high": self.error_high, "num_runs": self.num_runs,
                "how": self.how}


def error_range(errors: list[float]) -> tuple[float, float]:
    """The 10th to 90th percentile of relative errors, or their extremes under
    `MIN_RUNS_FOR_PERCENTILES` of them."""
    if len(errors) >= MIN_RUNS_FOR_PERCENTILES:
        low, high = np.percentile(errors, [LOW_PERCENTILE, HIGH_PERCENTILE])
        return float(low), float(high)
    return float(min(errors)), float(max(errors))


def band_from_errors(regime: str, errors: list[float], how: str, profile: str = "") -> Band:
    """The band of a regime's held-out errors (the benchmark's side of the file)."""
    low, high = error_range(errors)
    how += (f"; 10th to 90th percentile of {len(errors)} runs" if len(errors) >= MIN_RUNS_FOR_PERCENTILES else
            f"; the extremes of {len(errors)} runs (too few for percentiles)")
    return Band(regime, low, high, len(errors), how, profile)


def bands_document(bands: list[Band], written_by: str) -> str:
    """The JSON text of `profiles/error_bands.json`: the validated profiles' bands under `bands`,
    each unvalidated profile's own under `unvalidated_profiles`."""
    own: dict[str, dict] = {}
    for band in bands:
        if band.profile:
            own.setdefault(band.profile, {})[band.regime] = band.fields()
    return json.dumps({"written_by": written_by,
                       "bands": {band.regime: band.fields() for band in bands if not band.profile},
                       "unvalidated_profiles": own}, indent=2) + "\n"


@lru_cache(maxsize=1)
def load_all_bands(path: str | None = None) -> tuple[Band, ...]:
    """Every band in the file: the validated profiles' (`profile` "") and each unvalidated one's."""
    from meshplan.planner.costing.hardware import PROFILES_DIR

    data = json.loads(Path(path or PROFILES_DIR / BANDS_FILE).read_text())
    return (tuple(Band(regime, **values) for regime, values in data["bands"].items())
            + tuple(Band(regime, **values, profile=profile)
                    for profile, regimes in data.get("unvalidated_profiles", {}).items()
                    for regime, values in regimes.items()))


def load_bands(path: str | None = None) -> dict[str, Band]:
    """The validated profiles' band of each regime."""
    return {band.regime: band for band in load_all_bands(path) if not band.profile}


def profile_runs(profile: str, regime: str) -> Band | None:
    """What the held-out runs on an unvalidated profile measured in a regime (None: none ran)."""
    return next((band for band in load_all_bands() if band.profile == profile and band.regime == regime), None)


def regime_of(config, moe_model: bool) -> str | None:
    """The regime a configuration's prediction belongs to; None for fp32 (every published run is
    bf16 or fp8, on GPUs: nothing measured the error of an fp32 or CPU prediction)."""
    if config.precision == "fp32":
        return None
    if moe_model or config.ep > 1:  # the MoE runs, fp8 ones among them, measured expert models apart
        return "moe"
    if config.precision == "fp8":
        return "fp8"
    return "dense"


def band_for(config, moe_model: bool, cluster) -> Band | None:
    """The held-out band of a configuration's regime on `cluster` (None when none was measured):
    the validated profiles' band, or an unvalidated profile's own when it ran enough runs."""
    regime = regime_of(config, moe_model)
    if regime is None:
        return None
    fitted = fitted_band(cluster, regime)
    if _enough(fitted):
        return fitted
    if cluster.validated:
        return load_bands().get(regime)
    own = profile_runs(cluster.name, regime)
    return own if _enough(own) else None


def fitted_band(cluster, regime: str) -> Band | None:
    """The band of the measured runs `calibrate --from-runs` fitted the profile to (their leave-one-out
    errors, all of them, `contracts.cluster.FittedRuns`) where some of them ran in `regime`; None
    otherwise."""
    fitted = cluster.fitted_runs
    if fitted is None or regime not in fitted.regimes.split():
        return None
    return Band(regime, fitted.error_low, fitted.error_high, fitted.num_runs,
                f"leave-one-out step error of the {fitted.num_runs} measured runs profile {cluster.name} was fitted to "
                "(meshplan calibrate --from-runs)", cluster.name, fitted=True)


def _enough(own: Band | None) -> bool:
    """Whether an unvalidated profile's own runs make a band."""
    return own is not None and own.num_runs >= MIN_RUNS_FOR_BAND


def is_moe_model(spec: str, seq: int | None) -> bool:
    """Whether a model SPEC builds experts (an hf: config that cannot be read: no, judged by its ep)."""
    from meshplan.planner.models.registry import is_moe_spec

    try:
        return is_moe_spec(spec, seq or 2048)
    except (ValueError, OSError):
        return False


def prediction_band(config, spec: str, seq: int | None, cluster) -> Band | None:
    """`band_for` a prediction of model `spec` at `seq` tokens."""
    return band_for(config, is_moe_model(spec, seq), cluster)


@dataclass(frozen=True)
class MissingBand:
    """Why a prediction on a profile that is not validated has no band: what the published runs on
    that profile (`own`) and the runs it was fitted to (`fitted`) read, both too few, if any."""

    profile: str
    regime: str
    own: Band | None
    fitted: Band | None

    def text(self) -> str:
        measured = (f"its {self.own.num_runs} held-out {self.regime} run{'s' if self.own.num_runs > 1 else ''} "
                    f"read {self.own.error_low:+.0%} to {self.own.error_high:+.0%}, too few for a band"
                    if self.own is not None else f"no held-out {self.regime} run has checked it")
        if self.fitted is not None:
            measured += (f"; the {self.fitted.num_runs} measured runs it was fitted to read "
                         f"{self.fitted.error_low:+.0%} to {self.fitted.error_high:+.0%} left out in turn, too few "
                         "for a band")
        # a few steps measured on the part are what such a profile lacks (on gb200-nvl72, five of its
        # published runs take the other four from 13% to 3%: benchmarks/bench_calibrate_runs.py)
        hint = "" if self.fitted is not None else "; `meshplan calibrate --from-runs` fits it to steps you measured"
        return (f"none: profile '{self.profile}' is not validated (from published specifications; its efficiencies "
                f"are borrowed, not measured on the part): {measured}{hint}")

    def to_json(self) -> dict:
        data = {"profile": self.profile, "regime": self.regime, "num_runs": self.own.num_runs if self.own else 0}
        if self.own is not None:
            data.update(error_low=self.own.error_low, error_high=self.own.error_high, how=self.own.how)
        if self.fitted is not None:
            data["fitted_runs"] = {"num_runs": self.fitted.num_runs, "error_low": self.fitted.error_low,
                                   "error_high": self.fitted.error_high}
        return data


def step_uncertainty(config, spec: str, seq: int | None, cluster) -> Band | MissingBand | None:
    """What a prediction of model `spec` at `seq` tokens on `cluster` is told of its error, decided
    once: its band; on a profile that is not validated without one, why (`MissingBand`); None for
    fp32, which no published run measured (or a validated profile the file has no band for)."""
    moe = is_moe_model(spec, seq)
    band = band_for(config, moe, cluster)
    regime = regime_of(config, moe)
    if band is not None or regime is None or cluster.validated:
        return band
    return MissingBand(cluster.name, regime, profile_runs(cluster.name, regime), fitted_band(cluster, regime))


def uncertainty_text(uncertainty: Band | MissingBand | None, predicted: float, scale: float, unit: str) -> str:
    """`step_uncertainty` in words: the band around `predicted`, or why there is none ("" for None)."""
    if isinstance(uncertainty, Band):
        return band_text(uncertainty, predicted, scale, unit)
    return uncertainty.text() if uncertainty is not None else ""


def band_text(band: Band, predicted: float, scale: float, unit: str) -> str:
    """`likely 1.2-1.5 s (held-out dense runs: -8% to +12%)`: a band in words, `scale` units per second."""
    low, high = band.around(predicted)
    runs = {"fitted": "the runs it was fitted to, left out in turn,",
            "own": f"held-out {band.regime} runs on profile {band.profile} (not validated)",
            "validated profiles": f"held-out {band.regime} runs"}[band.runs]
    return (f"likely {_figure(low * scale)}-{_figure(high * scale)} {unit} ({runs} err "
            f"{band.error_low:+.0%} to {band.error_high:+.0%}, {band.num_runs} runs)")


def _figure(value: float) -> str:
    """Four significant digits below 10,000, whole numbers with thousands separators above (no
    exponent: `10,530 ms`, not `1.053e+04 ms`)."""
    return f"{value:,.0f}" if abs(value) >= 10_000 else f"{value:.4g}"
