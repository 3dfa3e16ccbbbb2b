"""Plan checks that need the model but not torch: the layers of built-in and parametric specs.

`load_plan` validates a plan on its own (schema, types, mesh, stage order). Whether its layers are
the model's layers needs the model: for built-in and parametric specs the names follow from the
spec alone (`embed`, `blocks.0` .. `blocks.{n-1}`, `head`, as `build_model` names them), so they
are checked here without importing torch. File and Hugging Face models are checked by the
commands that build them (`simulate`, `train`): where a plan is only read, their files may
legitimately be absent.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

from meshplan.planner.contracts.plan import Plan, check_plan_matches_model, model_file


def zoo_layer_names(spec: str, seq: int) -> list[str] | None:
    """The layer names of a built-in or parametric spec; None for file and HF specs.

    An unknown or malformed spec raises MeshplanError (for an unknown name the message lists the
    known models).
    """
    from meshplan.planner.models.registry import build_model, hf_config_path, parse_spec

    if hf_config_path(spec) is not None or spec.partition(":")[0].endswith(".py"):
        return None
    config = parse_spec(spec, seq)
    if config is None:
        build_model(spec, seq)  # an unknown name: raises before importing torch
        raise AssertionError(f"build_model accepted the unknown spec {spec!r}")
    return ["embed"] + [f"blocks.{index}" for index in range(config.num_layers)] + ["head"]


def check_plan_model(plan: Plan) -> None:
    """Refuse (MeshplanError) a plan whose model is unknown or whose layers are not that model's."""
    names = zoo_layer_names(plan.model.spec, plan.model.seq)
    if names is not None:
        check_plan_matches_model(plan, names)


def model_digest(spec: str) -> str:
    """sha256 of what defines a model: the bytes of the file an hf: or file spec names (the
    config or the Python file; modules it imports are not covered), else the spec string. ""
    when the file cannot be read (the build reports that)."""
    path = spec_file(spec)
    if path is None:
        return hashlib.sha256(spec.encode()).hexdigest()
    if not Path(path).is_file():  # a device such as /dev/zero would never end
        return ""
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return ""


def model_changed(plan: Plan) -> str:
    """One line saying the model's definition changed since the plan was made ("" when it did not,
    or the plan records no digest)."""
    recorded = plan.model.digest
    if not recorded:
        return ""
    current = model_digest(plan.model.spec)
    if current == recorded:
        return ""
    where = spec_file(plan.model.spec)
    what = f"{where} changed" if where and current else (f"{where} cannot be read" if where else "the spec changed")
    return (f"the model of this plan ({plan.model.spec}) is not the one it was planned for: {what} since "
            f"(digest {recorded[:12]} in the plan, {current[:12] or 'none'} now); re-plan it")


def is_sequence_model(spec: str) -> bool:
    """File models (`path/model.py:fn`) take whatever inputs their file builds: meshplan counts them in
    samples, with no sequence length or attention kernel; every other model is a causal LM whose
    samples are sequences of `seq` tokens."""
    return not spec.partition(":")[0].endswith(".py")


def spec_file(spec: str) -> str | None:
    """The file an hf: or file spec names (the config, a hub repository's from the local cache, or
    the Python file); None for other specs."""
    if spec.startswith("hf:"):
        from meshplan.planner.models.hf_hub import config_file

        return config_file(spec[3:])
    return model_file(spec)
