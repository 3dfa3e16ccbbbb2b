"""Any nn.Module from a Python file: the `path/model.py:fn` spec.

`fn()` takes no arguments and returns `(module, example_inputs)` for ONE sample (batch dimension
1); `example_inputs` is a tensor or a tuple of the module's positional inputs. The file may also
define `loss_fn(output, inputs) -> scalar tensor`; then the model can train, otherwise the
profiler runs backward from its float outputs with gradient ones. `fn` runs under
`torch.device(device)`, so modules and tensors it creates land on the meta device by default.
"""
from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.contracts.graph import ModelInfo


def parse_file_spec(spec: str) -> tuple[Path, str]:
    """`path/model.py:fn` -> (path, function name)."""
    path_text, sep, fn_name = spec.rpartition(":")
    if not sep or not path_text.endswith(".py") or not fn_name.isidentifier():
        raise MeshplanError(f"malformed file model spec {spec!r}: expected path/model.py:function_name")
    return Path(path_text), fn_name


def build_file_model(spec: str, device: str = "meta", dtype=None):
    import torch

    from meshplan.planner.models.built import BuiltModel, LayerGroup

    path, fn_name = parse_file_spec(spec)
    namespace = _load_file(path)
    fn = namespace.get(fn_name)
    if not callable(fn):
        defined = sorted(n for n, v in namespace.items() if callable(v) and not n.startswith("_"))
        raise MeshplanError(f"{path} has no function {fn_name!r}; it defines: {', '.join(defined) or 'nothing callable'}")
    try:
        with torch.device(device):
            result = fn()
    except MeshplanError:
        raise
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - even sys.exit: the user's bug
        raise MeshplanError(f"{path}:{fn_name}() raised {type(exc).__name__}: {' '.join(str(exc).split())[:300]}") from None
    module, inputs = _check_result(result, f"{path}:{fn_name}")
    loss_fn = namespace.get("loss_fn")
    if loss_fn is not None and not callable(loss_fn):
        raise MeshplanError(f"{path}: loss_fn must be a function loss_fn(output, inputs), got {type(loss_fn).__name__}")
    try:
        module = module.to(device=device, dtype=dtype) if dtype is not None else module.to(device=device)
        inputs = tuple(_move_input(x, device, dtype) for x in inputs)
    except Exception as exc:  # noqa: BLE001
        raise MeshplanError(f"{path}:{fn_name}: cannot move the model to the {device} device "
                            f"({type(exc).__name__}: {' '.join(str(exc).split())[:200]})") from None
    children = list(module.named_children()) or [("model", module)]
    groups = tuple(LayerGroup(name, "other", (child,)) for name, child in children)
    return BuiltModel(module=module, example_inputs=inputs, info=ModelInfo(family="file"),
                      layer_modules=tuple((name, "other", child) for name, child in children),
                      loss_fn=loss_fn, layer_groups=groups)


def _load_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise MeshplanError(f"model file {str(path)!r} not found; --model takes path/model.py:function_name")
    source = path.read_bytes()
    # A private module name per file content: two files never collide, and no import caches it.
    module_name = "meshplan_model_" + hashlib.sha256(str(path.resolve()).encode() + source).hexdigest()[:16]
    import_spec = importlib.util.spec_from_file_location(module_name, path)
    if import_spec is None or import_spec.loader is None:
        raise MeshplanError(f"cannot import {path} as a Python file")
    module = importlib.util.module_from_spec(import_spec)
    sys.modules[module_name] = module  # dataclasses and pickling look the module up by name
    try:
        import_spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - even sys.exit: the user's bug
        raise MeshplanError(f"importing {path} failed: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}") from None
    finally:
        sys.modules.pop(module_name, None)
    return vars(module)


def _check_result(result, where: str):
    import torch

    expected = "(nn.Module, example_inputs) with example_inputs a tensor or a tuple of tensors for one sample"
    if not isinstance(result, tuple) or len(result) != 2:
        raise MeshplanError(f"{where} must return {expected}; got {_describe(result)}")
    module, inputs = result
    if not isinstance(module, torch.nn.Module):
        raise MeshplanError(f"{where} must return {expected}; its first item is {_describe(module)}")
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    if isinstance(inputs, list):
        inputs = tuple(inputs)
    if not isinstance(inputs, tuple) or not inputs:
        raise MeshplanError(f"{where} must return {expected}; its second item is {_describe(inputs)}")
    return module, inputs


def _describe(value) -> str:
    if isinstance(value, tuple):
        return f"a tuple of {len(value)}"
    return type(value).__name__


def _move_input(value, device: str, dtype):
    import torch

    if not isinstance(value, torch.Tensor):
        return value
    if dtype is not None and value.is_floating_point():
        return value.to(device=device, dtype=dtype)
    return value.to(device=device)
