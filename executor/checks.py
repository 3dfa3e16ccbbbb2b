"""Refuse, before any process starts, a plan the executor cannot run as planned."""
from __future__ import annotations

from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.contracts.plan import Plan, check_plan_matches_model


def check_plan_runnable(plan: Plan, world_size: int) -> None:
    """Raise MeshplanError naming what is unsupported and what would work."""
    cfg = plan.config
    if not plan.executable:
        reason = f" ({plan.not_executable_reason})" if plan.not_executable_reason else ""
        raise MeshplanError(f"this plan is not executable{reason}: it uses per-layer degrees outside the executor's "
                            "space; re-plan without --layerwise")
    if world_size != cfg.gpus:
        raise MeshplanError(f"the plan needs {cfg.gpus} processes (pp {cfg.pp} x dp {cfg.dp} x tp {cfg.tp}) but "
                            f"{world_size} were asked for; use --nproc {cfg.gpus}"
                            + (f" or re-plan with --gpus {world_size}" if world_size > 0 else ""))
    from meshplan.planner.models.registry import build_model

    built = build_model(plan.model.spec, plan.model.seq, tp=cfg.tp, device="meta")
    if built.config is None:
        from meshplan.executor.filemodel import check_file_plan

        check_file_plan(plan, built)
        check_plan_matches_model(plan, [name for name, _, _ in built.layer_modules])
        return
    check_plan_matches_model(plan, [name for name, _, _ in built.layer_modules])
    _check_tp(plan, built.config)


def _check_tp(plan: Plan, model_cfg) -> None:
    tp = plan.config.tp
    if tp == 1:
        return
    for what, value in (("attention heads", model_cfg.num_heads), ("key/value heads", model_cfg.kv_heads),
                        ("MLP width", model_cfg.ffn_dim)):
        if value % tp:
            raise MeshplanError(f"tp={tp} does not divide the model's {what} ({value}); use a tp that divides it")
    if plan.config.sp and plan.model.seq % tp:
        raise MeshplanError(f"sequence parallelism splits the sequence ({plan.model.seq} tokens) over tp={tp} "
                            f"ranks; use a sequence length divisible by {tp} or turn --sp off")
