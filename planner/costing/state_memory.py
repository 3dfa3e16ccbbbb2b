"""Model-state bytes per rank (parameters, gradients, optimizer states) under each ZeRO stage.

Two recipes, named by `Strategy.state_recipe`:

"zero-paper" (Rajbhandari et al. 2020, the bf16-mixed recipe): bf16 parameters and
gradients, fp32 master weights and two fp32 Adam moments, 2 + 2 + 12 bytes per parameter;
stage 1 shards the 12, stage 2 also the gradients, stage 3 also the parameters over dp ranks:
16P, 4P + 12P/d, 2P + 14P/d, 16P/d. fp32: 4 + 4 + 8.

"executor" (what `meshplan train` allocates; its data-parallel wrapper per `dp_method`):
- no DP or DDP (ZeRO-0 on plain data parallelism): fp32 parameters and gradients, bf16 autocast
  for compute: 4 + 4 + 8 (the same 16P as the paper, split differently);
- FSDP2 `replicate` (ZeRO-0 with TP or PP): as DDP, plus the bf16 compute copy of every
  parameter the mixed-precision policy keeps unsharded: 6 + 4 + 8;
- FSDP2 `fully_shard`: fp32 sharded parameters (4/d), fp32 sharded gradients (4/d; the
  reduce dtype) and Adam moments (8/d). ZeRO-1/2 (`reshard_after_forward=False`) also hold the
  bf16 unsharded parameters during the step (+2); ZeRO-1 defers gradient sync to the last
  micro-batch, so the unsharded fp32 gradient accumulates in full (4 instead of 4/d):
  6P + 12P/d, 2P + 16P/d, 16P/d. Under fp32 the unsharded copy is fp32 (+4).
Gradients are reduced in fp32 by the executor (DDP on fp32 gradients; FSDP2 reduce dtype fp32),
4 bytes per parameter on the wire, as Megatron-LM does by default.

Communication the cost model counts once per step although the executor repeats it per
micro-batch: ZeRO-2/3 reduce-scatter after every micro-batch's backward (gradients stay
sharded), and FSDP2 re-gathers ZeRO-1/2 parameters before every micro-batch's forward unless
resharding after backward is turned off during gradient accumulation.
"""
from __future__ import annotations

STATE_RECIPES = ("executor", "zero-paper")

# bytes per parameter of the ZeRO paper's recipes: (param, grad, optimizer)
_PAPER = {"bf16-mixed": (2.0, 2.0, 12.0), "fp32": (4.0, 4.0, 8.0)}


def dp_method(zero: int, dp: int, tp: int, pp: int) -> str:
    """The executor's data-parallel wrapper: "none", "ddp", "replicate" or "fsdp".

    DDP only on plain data parallelism (it fails under DTensor TP and most pipeline schedules),
    so ZeRO-0 with TP or PP is FSDP2's `replicate`; ZeRO 1-3 are `fully_shard`.
    """
    if dp == 1:
        return "none"
    if zero == 0:
        return "ddp" if tp == 1 and pp == 1 else "replicate"
    return "fsdp"


def paper_state_bytes(num_params: float, dp: int, zero: int, precision: str) -> dict[str, float]:
    param, grad, optimizer = _paper(precision)
    return {"params": num_params * param / (dp if zero >= 3 else 1),
            "grads": num_params * grad / (dp if zero >= 2 else 1),
            "optimizer": num_params * optimizer / (dp if zero >= 1 else 1)}


def executor_state_bytes(num_params: float, dp: int, zero: int, precision: str, tp: int = 1,
                         pp: int = 1) -> dict[str, float]:
    _paper(precision)
    method = dp_method(zero, dp, tp, pp)
    compute_copy = 2.0 if precision == "bf16-mixed" else 4.0  # unsharded parameters FSDP2 gathers
    if method in ("none", "ddp"):
        return {"params": 4.0 * num_params, "grads": 4.0 * num_params, "optimizer": 8.0 * num_params}
    if method == "replicate":
        extra = compute_copy if precision == "bf16-mixed" else 0.0  # fp32 needs no cast copy
        return {"params": (4.0 + extra) * num_params, "grads": 4.0 * num_params, "optimizer": 8.0 * num_params}
    unsharded = compute_copy if zero <= 2 else 0.0
    return {"params": num_params * (4.0 / dp + unsharded),
            "grads": num_params * (4.0 if zero == 1 else 4.0 / dp),
            "optimizer": num_params * 8.0 / dp}


def state_bytes(num_params: float, dp: int, zero: int, precision: str, recipe: str = "zero-paper",
                tp: int = 1, pp: int = 1) -> dict[str, float]:
    """Resident params / grads / optimizer bytes per rank for `num_params` (already / tp)."""
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero must be 0, 1, 2 or 3, got {zero!r}")
    if recipe == "zero-paper":
        return paper_state_bytes(num_params, dp, zero, precision)
    if recipe == "executor":
        return executor_state_bytes(num_params, dp, zero, precision, tp, pp)
    raise ValueError(f"state recipe must be one of {', '.join(STATE_RECIPES)}, got {recipe!r}")


def grad_wire_bytes_per_param(precision: str, recipe: str) -> float:
    """Bytes per parameter the gradient reduction moves: bf16 in the paper, fp32 in the executor."""
    return _paper(precision)[1] if recipe == "zero-paper" else 4.0


def _paper(precision: str) -> tuple[float, float, float]:
    if precision not in _PAPER:
        raise ValueError(f"precision must be one of {', '.join(_PAPER)}, got {precision!r}")
    return _PAPER[precision]
