"""torchtitan's Python job configs (torchtitan 0.3): a job is a function returning `Trainer.Config`
that `torchtitan.config.manager.ConfigManager` imports by `--module` (a model name's
`config_registry`, or any module path) and calls by `--config <function>`. Its fields: `TrainingConfig`
and `ParallelismConfig` (torchtitan/config/configs.py), `activation_checkpoint` a policy config
(`FullAC.Config()`, `SelectiveAC.Config()` or None, torchtitan/distributed/activation_checkpoint.py),
and Float8 a converter of the model spec (`model_registry(flavor, converters=[Float8LinearConverter.Config()])`).

Both directions go through the 0.2 TOML's sections (`torchtitan.job_sections`, `read_torchtitan`), so
the two formats cannot drift apart; what 0.3 has no field for is left out with a note. Reading parses
the file's syntax tree and executes nothing: only literal keyword arguments of those constructors count.
"""
from __future__ import annotations

import ast

from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.contracts.fp8_choice import FLOAT8_CONVERTER

# section of the job TOML -> the torchtitan 0.3 dataclass that holds its fields
SECTION_CLASSES = {"training": "TrainingConfig", "parallelism": "ParallelismConfig"}
# the 0.2 TOML's expert TP key, which 0.3's ParallelismConfig lacks: with expert parallelism 0.3's experts
# take dp_shard·cp·tp ranks as ep x efsdp and are not TP-sharded (etp 1); without it they follow tp
EXPERT_TP_KEY = "expert_tensor_parallel_degree"
FLOAT8_CLASS = "Float8LinearConverter"  # torchtitan.components.quantization
HEAD_FQN_03 = "lm_head"  # 0.3's output head (0.2's `output`)
# Its Config's recipe_name default, and the only scaling it runs (rowwise; rowwise_with_gw_hp).
FLOAT8_RECIPE = "rowwise"
# [activation_checkpoint] mode -> 0.3's policy config (None: no checkpointing)
AC_CLASSES = {"full": "FullAC", "selective": "SelectiveAC"}
FUNCTION = "meshplan_job"  # the config function the export writes (torchtitan.train --config meshplan_job)
HEADER = "# meshplan: model="  # the model SPEC, which no torchtitan field holds
ASSETS_KEY = "hf_assets_path"  # 0.2's [model] key, 0.3's Trainer.Config field: the checkpoint's HF files


def is_python_config(text: str) -> bool:
    """Whether a torchtitan config is the Python form (it builds a Trainer.Config)."""
    return "Trainer.Config(" in text or f"{SECTION_CLASSES['parallelism']}(" in text


def python_config(sections: dict[str, dict], spec: str, label: str, notes: list[str]) -> str:
    """The config function of `sections` (what `torchtitan.job_sections` gives)."""
    model = sections["model"]
    ac_class = _ac_class(sections["activation_checkpoint"], notes)
    fp8 = FLOAT8_CONVERTER in sections
    lines = [f"{HEADER}{spec}", f"# torchtitan 0.3 job config written by meshplan export: {label}",
             f"# run: torchrun ... -m torchtitan.train --module <this module> --config {FUNCTION}"]
    if fp8:
        lines.append(f"from torchtitan.components.quantization import {FLOAT8_CLASS}")
        _note_float8(sections[FLOAT8_CONVERTER], notes)
    lines.append(f"from torchtitan.config import {', '.join(sorted(SECTION_CLASSES.values()))}")
    if ac_class:
        lines.append(f"from torchtitan.distributed.activation_checkpoint import {ac_class}")
    if "compile" in sections:  # the 0.2 TOML's [compile] section; 0.3's config field is not written here
        notes.append(f"torch.compile of the {' and the '.join(sections['compile']['components'])}: not written in "
                     "the 0.3 config; turn on the Trainer's compile config for them (the TOML form writes [compile])")
    converters = f", converters=[{FLOAT8_CLASS}.Config({_float8_filter(sections[FLOAT8_CONVERTER])})]" if fp8 else ""
    lines += [f"from torchtitan.models.{model['name']} import model_registry",
              "from torchtitan.trainer import Trainer", "", "", f"def {FUNCTION}() -> Trainer.Config:",
              "    return Trainer.Config(", f"        model_spec=model_registry({model['flavor']!r}{converters}),"]
    for section, cls in SECTION_CLASSES.items():
        lines.append(f"        {section}={cls}(")
        lines += [f"            {key}={value!r}," for key, value in _fields(section, sections[section], notes).items()]
        lines.append("        ),")
    lines += [f"        activation_checkpoint={f'{ac_class}.Config()' if ac_class else None},", "    )"]
    return "\n".join(lines) + "\n"


def _fields(section: str, values: dict, notes: list[str]) -> dict:
    if section != "parallelism":
        return values
    expert_tp, runs = values.get(EXPERT_TP_KEY, 1), _expert_tp(values)
    if expert_tp != runs:
        notes.append(f"[parallelism] {EXPERT_TP_KEY} = {expert_tp}: torchtitan 0.3 has no such field and runs "
                     f"expert TP {runs}; the 0.2 TOML (--format toml) keeps it")
    return {key: value for key, value in values.items() if key != EXPERT_TP_KEY}


def _expert_tp(parallelism: dict) -> int:
    """The expert TP torchtitan 0.3 runs: 1 under expert parallelism, else the experts follow tp."""
    if parallelism.get("expert_parallel_degree", 1) > 1:
        return 1
    return parallelism.get("tensor_parallel_degree", 1)


def _ac_class(section: dict, notes: list[str]) -> str | None:
    mode = section.get("mode", "none")
    option = section.get("selective_ac_option", "op")
    if mode == "selective" and option != "op":
        notes.append(f"activation checkpointing of every {option}-th block: torchtitan 0.3 has no such policy; "
                     "exported as per-op selective (SelectiveAC), the 0.2 TOML (--format toml) keeps it")
    return AC_CLASSES.get(mode)


def _float8_filter(section: dict) -> str:
    """The converter's `filter_fqns` keyword: the 0.2 section's list, its output head named as 0.3
    names it (`lm_head`)."""
    fqns = [HEAD_FQN_03 if fqn == "output" else fqn for fqn in section.get("filter_fqns", [])]
    return f"filter_fqns={fqns!r}" if fqns else ""


def _note_float8(section: dict, notes: list[str]) -> None:
    recipe = section.get("recipe_name") or "tensorwise"  # the 0.2 section's recipe (unset: tensorwise)
    if recipe != FLOAT8_RECIPE:
        notes.append(f"fp8 recipe {recipe}: torchtitan 0.3's {FLOAT8_CLASS} runs rowwise scaling only; exported as "
                     f"rowwise (the 0.2 TOML, --format toml, keeps {recipe})")
    flags = sorted(key for key, value in section.items() if value and key not in ("recipe_name", "filter_fqns"))
    if flags:
        notes.append(f"[float8] {', '.join(flags)}: torchtitan 0.3's {FLOAT8_CLASS}.Config has no such fields; "
                     "left out")


def read_sections(text: str) -> tuple[dict[str, dict], list[str]]:
    """(the job TOML's sections, notes) of the first config function in a Python config."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError) as exc:
        raise MeshplanError(f"not a valid torchtitan Python config: {exc}") from None
    functions = [node for node in tree.body if isinstance(node, ast.FunctionDef) and _builds_config(node)]
    if not functions:
        raise MeshplanError("the torchtitan Python config has no function returning Trainer.Config(...); give the "
                            "config_registry module that defines the job")
    notes = [f"{len(functions)} config functions in the file: read the first, {functions[0].name}"] \
        if len(functions) > 1 else []
    data: dict[str, dict] = {"model": {"name": _model_name(tree)}, "activation_checkpoint": {"mode": "none"}}
    for call in (node for node in ast.walk(functions[0]) if isinstance(node, ast.Call)):
        _read_call(call, data)
    if "parallelism" in data:
        data["parallelism"].setdefault(EXPERT_TP_KEY, _expert_tp(data["parallelism"]))
    for line in text.splitlines():
        if line.startswith(HEADER):
            data["job"] = {"description": "meshplan: " + line[len(HEADER):].strip()}
    return data, notes


def _read_call(call: ast.Call, data: dict[str, dict]) -> None:
    name = _callee(call)
    if name in SECTION_CLASSES.values():
        section = next(key for key, cls in SECTION_CLASSES.items() if cls == name)
        data[section] = _literal_keywords(call, name)
    elif name in (f"{cls}.Config" for cls in AC_CLASSES.values()):
        mode = next(key for key, cls in AC_CLASSES.items() if name == f"{cls}.Config")
        data["activation_checkpoint"] = {"mode": mode, **({"selective_ac_option": "op"} if mode == "selective" else {})}
    elif name == f"{FLOAT8_CLASS}.Config":
        data["float8"] = {"recipe_name": FLOAT8_RECIPE, **_literal_keywords(call, name)}
        data["model"]["converters"] = ["float8"]
    elif name == "model_registry" and call.args and isinstance(call.args[0], ast.Constant):
        data["model"]["flavor"] = str(call.args[0].value)
    elif name == "Trainer.Config":  # the one field of the job itself meshplan reads: where its HF assets are
        assets = next((keyword.value for keyword in call.keywords if keyword.arg == ASSETS_KEY), None)
        if isinstance(assets, ast.Constant) and isinstance(assets.value, str):
            data["model"][ASSETS_KEY] = assets.value


def _builds_config(function: ast.FunctionDef) -> bool:
    return any(isinstance(node, ast.Call) and _callee(node) == "Trainer.Config" for node in ast.walk(function))


def _callee(call: ast.Call) -> str:
    """`Name` or `Name.attr` of a call's function ("" for anything else)."""
    func = call.func
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        return f"{func.value.id}.{func.attr}"
    return ""


def _literal_keywords(call: ast.Call, name: str) -> dict:
    out = {}
    for keyword in call.keywords:
        if keyword.arg is None:
            raise MeshplanError(f"torchtitan config: {name}(**...) cannot be read without running it; write its "
                                "fields as keyword arguments")
        try:
            out[keyword.arg] = ast.literal_eval(keyword.value)
        except ValueError:
            raise MeshplanError(f"torchtitan config: {name}({keyword.arg}=...) is not a literal; write the value "
                                "itself") from None
    return out


def _model_name(tree: ast.Module) -> str:
    """The model family the config's `model_registry` comes from (torchtitan.models.<name>)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and any(alias.name == "model_registry" for alias in node.names):
            parts = (node.module or "").split(".")
            if len(parts) >= 3 and parts[:2] == ["torchtitan", "models"]:
                return parts[2]
    return "llama3"
