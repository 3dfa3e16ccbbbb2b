"""The held-out error band beside a predicted step, as the commands print and write it
(`planner.costing.error_bands`): the band of the prediction's regime, or, on a profile that is not
validated and has too few runs of its own, the line saying there is none and why."""
from __future__ import annotations


def with_band(data: dict, step_time_s: float, config, spec: str, seq: int | None, cluster) -> dict:
    """A prediction's JSON with its band under `uncertainty`, or, on an unvalidated profile without
    one, what its runs read under `unvalidated_profile` (additive keys)."""
    from meshplan.planner.costing.error_bands import Band, step_uncertainty

    uncertainty = step_uncertainty(config, spec, seq, cluster)
    if isinstance(uncertainty, Band):
        data["uncertainty"] = {**uncertainty.to_json(step_time_s), "profile_validated": cluster.validated,
                               "runs": uncertainty.runs}
    elif uncertainty is not None:
        data["unvalidated_profile"] = uncertainty.to_json()
    return data


def band_line(step_time_s: float, config, spec: str, seq: int | None, cluster) -> str:
    from meshplan.planner.costing.error_bands import step_uncertainty, uncertainty_text

    text = uncertainty_text(step_uncertainty(config, spec, seq, cluster), step_time_s, 1e3, "ms")
    return f"step time band   {text}" if text else ""
