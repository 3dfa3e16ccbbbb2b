"""The held-out error band beside a predicted step, as the commands print and write it
(`planner.costing.error_bands`): the band of the prediction's regime, or, on a profile that is not
validated and has too few runs of its own, the line saying there is none and why."""
from __future__ import annotations


def with_band(data: dict, step_time_s: float, config, spec: str, seq: int | None, cluster) -> dict:
    """A prediction's JSON with its band under `uncertainty`, or, on an unvalidated profile without
    one, what its runs read under `unvalidated_profile` (additive keys)."""
    from meshplan.planner.costing.error_bands import missing_band_json, prediction_band

    band = prediction_band(config, spec, seq, cluster)
    if band is not None:
        data["uncertainty"] = {**band.to_json(step_time_s), "profile_validated": cluster.validated,
                               "runs": "fitted" if band.fitted else "own" if band.profile else "validated profiles"}
    missing = missing_band_json(config, spec, seq, cluster)
    if missing is not None:
        data["unvalidated_profile"] = missing
    return data


def band_line(step_time_s: float, config, spec: str, seq: int | None, cluster) -> str:
    from meshplan.planner.costing.error_bands import band_text, missing_band_text, prediction_band

    band = prediction_band(config, spec, seq, cluster)
    text = band_text(band, step_time_s, 1e3, "ms") if band is not None else missing_band_text(config, spec, seq,
                                                                                               cluster)
    return f"step time band   {text}" if text else ""
