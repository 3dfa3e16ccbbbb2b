"""The held-out error band beside a predicted step, as the commands print and write it
(`planner.costing.error_bands`)."""
from __future__ import annotations


def step_band(config, spec: str, seq: int | None = None):
    """The band of this configuration's regime, or None (no bands measured)."""
    from meshplan.planner.costing.error_bands import band_for
    from meshplan.planner.models.registry import is_moe_spec

    try:
        moe = is_moe_spec(spec, seq or 2048)
    except (ValueError, OSError):  # an hf: config that cannot be read: judged by its ep
        moe = False
    return band_for(config, moe)


def with_band(data: dict, step_time_s: float, config, spec: str, seq: int | None = None) -> dict:
    """A prediction's JSON with its band under `uncertainty` (additive)."""
    band = step_band(config, spec, seq)
    if band is not None:
        data["uncertainty"] = band.to_json(step_time_s)
    return data


def band_line(step_time_s: float, config, spec: str, seq: int | None = None) -> str:
    from meshplan.planner.costing.error_bands import band_text

    band = step_band(config, spec, seq)
    return "" if band is None else f"step time band   {band_text(band, step_time_s, 1e3, 'ms')}"
