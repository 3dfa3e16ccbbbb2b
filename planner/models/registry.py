"""Model specs: built-in presets, parametric `gpt:`/`llama:` specs, `file.py:fn` and `hf:config.json`.

`build_model(spec, seq, tp=1, device="meta") -> BuiltModel` is the one way every command and the
executor turn a spec string into a module. `build_for_profile` builds the same model with its
repeated blocks collapsed to one of each type, which is all the profiler needs. Importing this
package does not import torch.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.contracts.graph import ModelInfo, TPSplit
from meshplan.planner.models.built import MAX_PARAMETRIC_LAYERS, BuiltModel, LayerGroup, ProfileModel
from meshplan.planner.models.config import TransformerConfig

# Published shapes: GPT-2 (Radford et al. 2019, HF configs); Llama 2 (Touvron et al. 2023,
# Table 1 + params.json); Llama 3 / 3.1 (Dubey et al. 2024, Table 3).
PRESETS: dict[str, TransformerConfig] = {
    "gpt2": TransformerConfig("gpt", 12, 768, 12, 50257),
    "gpt2-medium": TransformerConfig("gpt", 24, 1024, 16, 50257),
    "gpt2-large": TransformerConfig("gpt", 36, 1280, 20, 50257),
    "gpt2-xl": TransformerConfig("gpt", 48, 1600, 25, 50257),
    "llama2-7b": TransformerConfig("llama", 32, 4096, 32, 32000, ffn=11008, tied_embeddings=False),
    "llama2-13b": TransformerConfig("llama", 40, 5120, 40, 32000, ffn=13824, tied_embeddings=False),
    "llama2-70b": TransformerConfig("llama", 80, 8192, 64, 32000, ffn=28672, num_kv_heads=8,
                                    tied_embeddings=False),
    "llama3-8b": TransformerConfig("llama", 32, 4096, 32, 128256, ffn=14336, num_kv_heads=8,
                                   tied_embeddings=False, rope_theta=500000.0),
    "llama3-70b": TransformerConfig("llama", 80, 8192, 64, 128256, ffn=28672, num_kv_heads=8,
                                    tied_embeddings=False, rope_theta=500000.0),
    "llama3-405b": TransformerConfig("llama", 126, 16384, 128, 128256, ffn=53248, num_kv_heads=8,
                                     tied_embeddings=False, rope_theta=500000.0),
}

_PARAMETRIC_KEYS = {
    "gpt": {"layers", "hidden", "heads", "vocab", "ffn", "tied", "positions"},
    "llama": {"layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "tied", "rope_theta"},
}


def known_models() -> list[str]:
    return sorted(PRESETS)


def parse_spec(spec: str, seq: int) -> TransformerConfig | None:
    """A TransformerConfig for a preset or parametric spec; None for file/hf specs."""
    if spec in PRESETS:
        return PRESETS[spec]
    family, sep, rest = spec.partition(":")
    if not sep or family not in _PARAMETRIC_KEYS:
        return None
    values: dict[str, str] = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or not value.strip():
            raise MeshplanError(f"malformed model spec {spec!r}: expected key=value, got {item!r}; "
                                f"e.g. gpt:layers=12,hidden=768,heads=12,vocab=50257")
        if key not in _PARAMETRIC_KEYS[family]:
            raise MeshplanError(f"malformed model spec {spec!r}: unknown key {key!r}; "
                                f"{family} specs take {', '.join(sorted(_PARAMETRIC_KEYS[family]))}")
        values[key] = value.strip()
    required = {"layers", "hidden", "heads", "vocab"}
    missing = sorted(required - set(values))
    if missing:
        raise MeshplanError(f"malformed model spec {spec!r}: missing {', '.join(missing)}")
    for key, value in values.items():
        if key == "tied" and value.lower() not in ("1", "true", "yes", "0", "false", "no"):
            raise MeshplanError(f"malformed model spec {spec!r}: tied must be true or false, got {value!r}")
        if key not in ("tied", "rope_theta") and not value.lstrip("+-").isdigit():
            raise MeshplanError(f"malformed model spec {spec!r}: {key} must be an integer, got {value!r}")
    significant = values["layers"].lstrip("+-").lstrip("0")
    if len(significant) > len(str(MAX_PARAMETRIC_LAYERS)) or int(significant or 0) > MAX_PARAMETRIC_LAYERS:
        raise MeshplanError(f"malformed model spec {spec!r}: layers={values['layers'][:20]} is more than "
                            f"meshplan lays out (at most {MAX_PARAMETRIC_LAYERS:,})")
    try:
        ints = {k: int(v) for k, v in values.items() if k not in ("tied", "rope_theta")}
        kwargs: dict[str, Any] = dict(
            family=family, num_layers=ints["layers"], hidden=ints["hidden"], num_heads=ints["heads"],
            vocab=ints["vocab"], ffn=ints.get("ffn", 0), num_kv_heads=ints.get("kv_heads", 0))
        if family == "gpt":
            kwargs["max_positions"] = ints.get("positions", seq)
            kwargs["tied_embeddings"] = values.get("tied", "1").lower() in ("1", "true", "yes")
        else:
            kwargs["tied_embeddings"] = values.get("tied", "0").lower() in ("1", "true", "yes")
            if "rope_theta" in values:
                kwargs["rope_theta"] = float(values["rope_theta"])
        return TransformerConfig(**kwargs)
    except ValueError as exc:
        raise MeshplanError(f"malformed model spec {spec!r}: {exc}") from None


def build_model(spec: str, seq: int, tp: int = 1, device: str = "meta", dtype=None) -> BuiltModel:
    """Build the model a spec names, on `device` (meta by default: no memory, no weights)."""
    if not isinstance(seq, int) or seq <= 0:
        raise MeshplanError(f"sequence length must be a positive integer, got {seq!r}")
    if spec.startswith("hf:"):
        from meshplan.planner.models.hf import build_hf_model
        return build_hf_model(spec[3:], seq, device=device, dtype=dtype)
    cfg = parse_spec(spec, seq)
    if cfg is not None:
        return _build_zoo(spec, cfg, seq, tp, device, dtype)
    if spec.partition(":")[0].endswith(".py"):
        from meshplan.planner.models.filemodel import build_file_model
        return build_file_model(spec, device=device, dtype=dtype)
    raise MeshplanError(f"unknown model {spec!r}; known models: {', '.join(known_models())}; or a parametric "
                        "spec (gpt:layers=..,hidden=..,heads=..,vocab=..), path/model.py:fn, or hf:config.json")


def _build_zoo(spec: str, cfg: TransformerConfig, seq: int, tp: int, device: str, dtype) -> BuiltModel:
    import torch

    from meshplan.planner.models.transformer import CausalLM, lm_loss

    if cfg.family == "gpt" and seq > cfg.max_positions:
        raise MeshplanError(f"sequence length {seq} exceeds the {cfg.max_positions} learned positions of {spec!r}; "
                            f"use --seq <= {cfg.max_positions} or a parametric gpt: spec")
    with torch.device(device):
        module = CausalLM(cfg, tp=tp)
    if dtype is not None:
        module = module.to(dtype)
    tokens = torch.zeros(1, seq, dtype=torch.long, device=device)
    info = ModelInfo(family=cfg.family, num_layers=cfg.num_layers, hidden=cfg.hidden, num_heads=cfg.num_heads,
                     num_kv_heads=cfg.kv_heads, ffn=cfg.ffn_dim, vocab=cfg.vocab,
                     padded_vocab=module.padded_vocab, tied_embeddings=cfg.tied_embeddings,
                     max_positions=cfg.max_positions if cfg.family == "gpt" else 0)
    layers = [("embed", "embedding", module.embed)]
    layers += [(f"blocks.{i}", "block", block) for i, block in enumerate(module.blocks)]
    layers.append(("head", "head", module.head))
    splits = zoo_tp_splits(cfg, module.padded_vocab)
    groups = tuple(LayerGroup(name, kind, (mod,), splits[kind]) for name, kind, mod in layers)
    return BuiltModel(module=module, example_inputs=(tokens,), info=info, layer_modules=tuple(layers),
                      loss_fn=lambda logits, inputs: lm_loss(logits, inputs[-1] if len(inputs) > 1 else inputs[0]),
                      config=cfg, targets=tokens, layer_groups=groups)


def zoo_tp_splits(cfg: TransformerConfig, padded_vocab: int) -> dict[str, TPSplit]:
    """Megatron splits of the zoo's layers by kind; Linear names are relative to the layer module."""
    column = ("attn.q", "attn.k", "attn.v") + (("mlp.gate",) if cfg.family == "llama" else ()) + ("mlp.up",)
    block = TPSplit(kind="block", column_linears=column, row_linears=("attn.o", "mlp.down"),
                    num_heads=cfg.num_heads, num_kv_heads=cfg.kv_heads, num_allreduce_per_pass=2)
    vocab = TPSplit(kind="vocab", vocab_size=padded_vocab)
    return {"embedding": vocab, "block": block, "head": vocab}


def default_seq(spec: str, wanted: int = 2048) -> int:
    """`wanted`, capped by the learned positions of a GPT preset or an HF config (no torch import)."""
    if spec.startswith("hf:"):
        from meshplan.planner.models.hf import hf_max_positions
        limit = hf_max_positions(spec[3:])
        return min(wanted, limit) if limit else wanted
    try:
        cfg = parse_spec(spec, wanted)
    except MeshplanError:
        return wanted  # the build reports the malformed spec
    if cfg is not None and cfg.family == "gpt":
        return min(wanted, cfg.max_positions)
    return wanted


def build_for_profile(spec: str, seq: int, dtype=None) -> ProfileModel:
    """The model on the meta device with identical blocks collapsed to one, plus the full layout.

    Zoo blocks are identical by construction, and HF decoder layers when the config gives them
    one type, so one block is built instead of all of them (a 126-block model costs one block).
    File models are built whole: only their forward knows how the children connect.
    """
    if not isinstance(seq, int) or seq <= 0:
        raise MeshplanError(f"sequence length must be a positive integer, got {seq!r}")
    if spec.startswith("hf:"):
        from meshplan.planner.models.hf import build_hf_for_profile
        return build_hf_for_profile(spec[3:], seq, dtype=dtype)
    cfg = parse_spec(spec, seq)
    if cfg is None:
        return ProfileModel(build_model(spec, seq, device="meta", dtype=dtype), ())
    built = _build_zoo(spec, replace(cfg, num_layers=1), seq, 1, "meta", dtype)
    built = replace(built, info=replace(built.info, num_layers=cfg.num_layers), config=cfg)
    layout = (("embed", "embedding", "embed"),) + tuple(
        (f"blocks.{i}", "block", "blocks.0") for i in range(cfg.num_layers)) + (("head", "head", "head"),)
    return ProfileModel(built, layout)
