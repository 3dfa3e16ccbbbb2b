"""The precision recipes: bytes per parameter of each recipe's model states, the compute dtype
of everything but FP8's Linears, and activation bytes in that dtype over the profile's."""
from __future__ import annotations

from meshplan.planner.costing.device_time import DTYPE_BYTES


# Bytes per parameter of each precision recipe (the ZeRO paper's mixed-precision
# Adam; plain fp32 Adam needs no master copy: 4 param + 4 grad + 2 x 4 moments).
PRECISION_RECIPES: dict[str, dict[str, float]] = {
    "bf16-mixed": {"param": 2.0, "grad": 2.0, "optimizer": 12.0},
    "fp32": {"param": 4.0, "grad": 4.0, "optimizer": 8.0},
    "fp8": {"param": 2.0, "grad": 2.0, "optimizer": 12.0},  # bf16-mixed's states; see planner.costing.fp8
}
# The dtype of everything but the fp8 Linears' GEMMs (fp8: attention, norms, activations in bf16).
COMPUTE_DTYPE = {"bf16-mixed": "bf16", "fp32": "fp32", "fp8": "bf16"}


def recipe(precision: str) -> dict[str, float]:
    """Bytes per parameter of `precision`'s params, grads and optimizer states."""
    if precision not in PRECISION_RECIPES:
        raise ValueError(f"precision must be one of {', '.join(PRECISION_RECIPES)}, got {precision!r}")
    return PRECISION_RECIPES[precision]


def activation_scale(precision: str, profile_dtype: str | None) -> float:
    """Bytes per activation element in the precision's compute dtype over the profile's."""
    dtype = COMPUTE_DTYPE[precision]
    return DTYPE_BYTES[dtype] / DTYPE_BYTES.get(profile_dtype or dtype, 2)
