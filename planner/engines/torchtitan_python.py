"""torchtitan's Python job configs: since its releases after 0.2 a job is a function returning
`Trainer.Config` (its `models/<name>/config_registry.py`), built from the same fields the 0.2 job
TOML had (`TrainingConfig`, `ParallelismConfig`, `ActivationCheckpointConfig`, a
`Float8LinearConverter.Config` among the model converters).

Both directions go through the TOML's sections (`torchtitan.job_sections`, `read_torchtitan`), so
the two formats cannot drift apart. Reading parses the file's syntax tree and executes nothing:
only literal keyword arguments of those constructors count.
"""
from __future__ import annotations

import ast

from meshplan.planner.contracts.errors import MeshplanError

# section of the job TOML -> the torchtitan dataclass that holds its fields (torchtitan/config/configs.py)
SECTION_CLASSES = {"training": "TrainingConfig", "parallelism": "ParallelismConfig",
                   "activation_checkpoint": "ActivationCheckpointConfig"}
FLOAT8_CLASS = "Float8LinearConverter"  # torchtitan.components.quantization.float8
FUNCTION = "meshplan_job"  # the config function the export writes (torchtitan.train --config meshplan_job)
HEADER = "# meshplan: model="  # the model SPEC, which no torchtitan field holds


def is_python_config(text: str) -> bool:
    """Whether a torchtitan config is the Python form (it builds a Trainer.Config)."""
    return "Trainer.Config(" in text or f"{SECTION_CLASSES['parallelism']}(" in text


def python_config(sections: dict[str, dict], spec: str, label: str) -> str:
    """The config function of `sections` (what `torchtitan.job_sections` gives)."""
    model = sections["model"]
    fp8 = sections.get("float8")
    lines = [f"{HEADER}{spec}", f"# torchtitan job config written by meshplan export: {label}",
             f"# run: torchrun ... -m torchtitan.train --module <this module> --config {FUNCTION}"]
    if fp8 is not None:
        lines.append(f"from torchtitan.components.quantization.float8 import {FLOAT8_CLASS}")
    lines.append(f"from torchtitan.config import {', '.join(sorted(SECTION_CLASSES.values()))}")
    lines.append(f"from torchtitan.models.{model['name']} import model_registry")
    if fp8 is not None:
        lines.append("from torchtitan.protocols.model_converter import ModelConvertersContainer")
    lines += ["from torchtitan.trainer import Trainer", "", "", f"def {FUNCTION}() -> Trainer.Config:",
              "    return Trainer.Config(", f"        model_spec=model_registry({model['flavor']!r}),"]
    for section, cls in SECTION_CLASSES.items():
        lines.append(f"        {section}={cls}(")
        lines += [f"            {key}={value!r}," for key, value in sections[section].items()]
        lines.append("        ),")
    if fp8 is not None:
        arguments = ", ".join(f"{key}={value!r}" for key, value in fp8.items())
        lines.append(f"        model_converters=ModelConvertersContainer.Config(converters=[{FLOAT8_CLASS}.Config("
                     f"{arguments})]),")
    lines.append("    )")
    return "\n".join(lines) + "\n"


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
    data: dict[str, dict] = {"model": {"name": _model_name(tree)}}
    for call in (node for node in ast.walk(functions[0]) if isinstance(node, ast.Call)):
        name = _callee(call)
        if name in SECTION_CLASSES.values():
            section = next(key for key, cls in SECTION_CLASSES.items() if cls == name)
            data[section] = _literal_keywords(call, name)
        elif name == f"{FLOAT8_CLASS}.Config":
            data["float8"] = _literal_keywords(call, name)
            data["model"]["converters"] = ["float8"]
        elif name == "model_registry" and call.args and isinstance(call.args[0], ast.Constant):
            data["model"]["flavor"] = str(call.args[0].value)
    for line in text.splitlines():
        if line.startswith(HEADER):
            data["job"] = {"description": "meshplan: " + line[len(HEADER):].strip()}
    return data, notes


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
