"""Reading a Hugging Face config.json for `hf:` specs, and refusing bad ones early and in one line.

What is checked before any model is built:

- the file is JSON with a `model_type`, and that type is one transformers knows (a typo gets the
  nearest known types, not transformers' list of every type on one line);
- no key is a misspelling of a key the config class takes (`intermediate_sise`): transformers
  would keep the misspelt key as an unused attribute and build the model with the default, a
  different model. A key counts as known when the config class's `__init__` takes it, its default
  `to_dict()` holds it, its `attribute_map` aliases it, or the config's or model's source reads it
  (many published configs carry keys their architecture's code reads with `getattr`, or legacy
  keys such as `rope_theta` that transformers converts). An unknown key whose nearest known key
  (difflib) differs by at most two characters in length is refused with that key suggested; other
  unknown keys are reported as ignored (`ModelInfo.notes`), since published configs carry keys
  of the code they were written for (DeepSeek-V3's `topk_method`, Gemma-2's `sliding_window_size`);
- `--seq` above the config's `max_position_embeddings` (`n_positions` for GPT-2 style configs).

transformers' own errors are cut to their first line (the chained exception, shown under
`--debug`, keeps all of it).
"""
from __future__ import annotations

import difflib
import functools
import inspect
import re
import sys
from pathlib import Path

from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.models.hf_hub import config_file

POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
# An unknown key this close to a known one (difflib ratio) and this near in length is a misspelling.
TYPO_CUTOFF = 0.8
TYPO_MAX_LENGTH_DIFFERENCE = 2


def read_config(path_text: str) -> dict:
    path = Path(config_file(path_text))
    if not path.is_file():
        raise MeshplanError(f"HF config {str(path)!r} not found; use hf:path/config.json, hf:dir/ (a directory "
                            "holding config.json) or hf:owner/name (a Hugging Face hub repository; no weights needed)")
    data = _read_json(path_text)
    if not isinstance(data, dict) or "model_type" not in data:
        raise MeshplanError(f"HF config {path_text!r} has no \"model_type\"; it must be a transformers config.json")
    return data


def max_positions(data: dict) -> tuple[str, int]:
    """(key, value) of the config's position limit; ("", 0) when it states none."""
    for key in POSITION_KEYS:
        value = data.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return key, value
    return "", 0


def positive_int(value) -> int:
    """`value` when it is a positive int (not a bool), else 0: a config key that may be absent or null."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def rope_theta(data: dict) -> float:
    """The config's RoPE base: `rope_theta`, or inside `rope_parameters` (transformers 5), else 10000."""
    parameters = data.get("rope_parameters") if isinstance(data.get("rope_parameters"), dict) else {}
    return float(data.get("rope_theta") or parameters.get("rope_theta") or 10000.0)


def _read_json(path_text: str):
    """The config's JSON, read as every meshplan input is (a regular file, bounded in size and depth)."""
    from meshplan.planner.contracts.jsonfile import read_json_file

    return read_json_file(config_file(path_text), "HF config", "use hf:path/config.json (a config file, no weights)")


def hf_max_positions(path_text: str) -> int:
    """The position limit of a config file (0 when absent or unreadable): caps the default --seq."""
    try:
        data = _read_json(path_text)
    except MeshplanError:
        return 0
    return max_positions(data)[1] if isinstance(data, dict) else 0


def check_seq_limit(path_text: str, seq: int) -> None:
    """Refuse a sequence longer than the positions the config declares (no torch, no transformers)."""
    try:
        data = _read_json(path_text)
    except MeshplanError:
        return  # the build reports it
    key, limit = max_positions(data) if isinstance(data, dict) else ("", 0)
    if limit and seq > limit:
        raise MeshplanError(f"sequence length {seq} exceeds the {limit:,} positions of HF config {path_text!r} "
                            f"({key}); use --seq <= {limit}")


def first_line(exc: BaseException, limit: int = 300) -> str:
    """The first line of an exception's message (transformers' can run to kilobytes)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text if len(text) <= limit else text[:limit] + " ..."


def make_config(path_text: str, data: dict | None = None):
    """transformers' config object for the file, after the checks in the module docstring."""
    data = read_config(path_text) if data is None else data
    try:
        import transformers
    except ImportError:
        raise MeshplanError("hf: model specs and the published-config presets need transformers, a meshplan "
                            "dependency: pip install 'transformers>=5'") from None
    config_class = _config_class(path_text, data["model_type"])
    notes = check_keys(path_text, data, config_class)
    try:
        config = transformers.AutoConfig.for_model(**data)
    except Exception as exc:  # noqa: BLE001 - transformers' own validation errors are not ValueErrors
        raise MeshplanError(f"HF config {path_text!r}: transformers cannot read it: {first_line(exc)}") from exc
    return text_backbone(config, notes)


def text_backbone(config, notes: tuple[str, ...]):
    """A multimodal config (a `text_config` beside a vision or audio one: Gemma-3, Llama-4, ...)
    stands for its text decoder, which is what a causal LM trains; the note says so."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    if text is config:
        return config, notes
    others = sorted(key for key, value in vars(config).items()
                    if key.endswith("_config") and key != "text_config" and value is not None)
    return text, notes + (f"multimodal config ({config.model_type}): meshplan profiles its text backbone "
                          f"({text.model_type}); {', '.join(others) or 'the other towers'} not modelled",)


def _config_class(path_text: str, model_type) -> type:
    from transformers import CONFIG_MAPPING

    known = list(CONFIG_MAPPING.keys())
    if isinstance(model_type, str) and model_type in CONFIG_MAPPING:
        return CONFIG_MAPPING[model_type]
    nearest = difflib.get_close_matches(str(model_type), known, n=3, cutoff=0.6)
    hint = f"nearest known: {', '.join(nearest)}" if nearest else f"transformers knows {len(known)} types, e.g. llama"
    raise MeshplanError(f"HF config {path_text!r}: transformers cannot read it: unknown model_type {model_type!r}; "
                        f"{hint}")


def check_keys(path_text: str, data: dict, config_class) -> tuple[str, ...]:
    """Refuse misspelt keys (MeshplanError naming the nearest known key); return a note listing the
    keys transformers does not read (empty when there are none)."""
    declared = _declared_keys(config_class)
    known = declared | _source_identifiers(config_class)
    ignored = []
    for key in data:
        if key in known:
            continue
        nearest = difflib.get_close_matches(key, sorted(declared), n=1, cutoff=TYPO_CUTOFF)
        # a near miss of a key the file also sets is another code's name for it (GPT-OSS's
        # `experts_per_token` beside `num_experts_per_tok`), not a misspelling
        if nearest and nearest[0] not in data and abs(len(nearest[0]) - len(key)) <= TYPO_MAX_LENGTH_DIFFERENCE:
            raise MeshplanError(f"HF config {path_text!r}: unknown key {key!r}, did you mean {nearest[0]!r}? "
                                f"({config_class.__name__} would ignore it and build the model with its default)")
        ignored.append(key)
    if not ignored:
        return ()
    return (f"config keys {config_class.__name__} does not read (ignored): {', '.join(ignored)}",)


@functools.cache
def _declared_keys(config_class) -> frozenset[str]:
    """Once per class: profiling and planning read a config several times, and this instantiates it."""
    import transformers

    keys = set(inspect.signature(config_class.__init__).parameters) - {"self", "kwargs"}
    keys |= set(getattr(config_class, "attribute_map", {}) or {})
    for make in (config_class, transformers.PretrainedConfig):
        try:
            keys |= set(make().to_dict())
        except Exception:  # noqa: BLE001 - a config class without defaults: its signature still counts
            pass
    return frozenset(keys)


@functools.cache
def _source_identifiers(config_class) -> frozenset[str]:
    """Identifiers in the source of the config class's module, its model's modeling module and
    transformers' config and RoPE utilities (where legacy keys are converted); once per class (it
    reads and tokenises those modules' source)."""
    import transformers
    from transformers import configuration_utils, modeling_rope_utils

    modules = [sys.modules.get(config_class.__module__), configuration_utils, modeling_rope_utils]
    try:
        modules.append(sys.modules.get(transformers.AutoModelForCausalLM._model_mapping[config_class].__module__))
    except KeyError:  # not a causal LM: the build says so
        pass
    names: set[str] = set()
    for module in filter(None, modules):
        try:
            names |= set(re.findall(r"[A-Za-z_]\w*", inspect.getsource(module)))
        except (OSError, TypeError):
            continue
    return frozenset(names)
