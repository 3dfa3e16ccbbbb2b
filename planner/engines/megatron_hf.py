"""Megatron-LM model arguments for Hugging Face configs of the architectures Megatron-Core builds
from flags: DeepSeek-V2 / V3 (multi-head latent attention, shared and routed experts, leading
dense layers, grouped sigmoid routing) and GPT-OSS (grouped-query attention with biases, routed
experts). The published-config presets (`registry.PUBLISHED_CONFIGS`) are of these types.

Flag names follow Megatron-LM's `arguments.py` and its DeepSeek-V3 examples. What a config holds
that these flags do not say is returned as a note, not guessed: GPT-OSS's sliding windows,
attention sinks and clamped SwiGLU. Multi-token prediction is the plan's (`--mtp-num-layers`,
`profiling.mtp`), written by `megatron.export_megatron`, not the config's.
"""
from __future__ import annotations

from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.engines.shapes import zoo_shape
from meshplan.planner.models.hf_config import read_config
from meshplan.planner.models.registry import PUBLISHED_CONFIGS, hf_config_path

MLA_TYPES = ("deepseek_v2", "deepseek_v3")
GPT_OSS_TYPES = ("gpt_oss",)
HYBRID_TYPES = ("nemotron_h",)
# transformers' NemotronH `layers_block_type` names, in Megatron-Core's hybrid pattern letters
HYBRID_LETTERS = {"mamba": "M", "attention": "*", "mlp": "-", "moe": "E"}
# Megatron-LM's hybrid layer pattern, `|` at each pipeline chunk's end (its flexible pipeline layout)
HYBRID_FLAG = "--hybrid-layer-pattern"
# The arguments that tell the published presets apart from each other and from zoo shapes.
SHAPE_FLAGS = ("--num-layers", "--hidden-size", "--num-attention-heads", "--num-query-groups", "--kv-channels",
               "--multi-latent-attention", "--q-lora-rank", "--kv-lora-rank", "--num-experts", "--moe-router-topk",
               "--moe-ffn-hidden-size", "--moe-shared-expert-intermediate-size")


def hf_megatron_args(config_path: str, notes: list[str]) -> list[tuple[str, object]] | None:
    """Megatron-LM's model arguments for the config (None: a type this module does not write, or
    an `hf:` file no longer where the plan says: the plan carries its graph, so export needs none)."""
    try:
        data = read_config(config_path)
    except MeshplanError:
        return None
    model_type = data["model_type"]
    if model_type in MLA_TYPES:
        return _common(data) + _mla(data) + _deepseek_moe(data, notes)
    if model_type in GPT_OSS_TYPES:
        return _common(data) + _gpt_oss(data, notes)
    if model_type in HYBRID_TYPES and hybrid_pattern(config_path):
        return _hybrid(data, notes)
    return None


def plan_hybrid_pattern(plan) -> str | None:
    """The plan's model's hybrid layer pattern (`hybrid_pattern`), None for any other model."""
    if zoo_shape(plan.model.spec, plan.model.seq) is not None:
        return None
    config_path = hf_config_path(plan.model.spec)
    return hybrid_pattern(config_path) if config_path is not None else None


def hybrid_pattern(config_path: str) -> str | None:
    """A hybrid config's layer pattern in Megatron-Core's letters (M a Mamba-2 mixer, * attention, - an
    MLP, E a MoE layer), one per decoder layer: Nemotron-H's `hybrid_override_pattern`, or its
    `layers_block_type` list; None for any other config."""
    try:
        data = read_config(config_path)
    except MeshplanError:
        return None
    if data["model_type"] not in HYBRID_TYPES:
        return None
    pattern = data.get("hybrid_override_pattern")
    if not pattern and isinstance(data.get("layers_block_type"), list):
        pattern = "".join(HYBRID_LETTERS.get(kind, "?") for kind in data["layers_block_type"])
    return pattern if pattern and set(pattern) <= set(HYBRID_LETTERS.values()) else None


def _hybrid(data: dict, notes: list[str]) -> list[tuple[str, object]]:
    """Megatron-Core's hybrid model (pretrain_hybrid.py, formerly pretrain_mamba.py): attention's
    query groups and head width, the Mamba-2 mixers' state width, head width, groups and heads,
    squared-ReLU MLPs, no position embedding. `--num-layers` is not written: Megatron-LM derives it
    from `--hybrid-layer-pattern`, which `megatron.export_megatron` writes with the plan's cut."""
    args: list[tuple[str, object]] = [
        ("--hidden-size", data["hidden_size"]), ("--ffn-hidden-size", data["intermediate_size"]),
        ("--num-attention-heads", data["num_attention_heads"]), ("--vocab-size", data["vocab_size"]),
        ("--group-query-attention", None), ("--num-query-groups", data["num_key_value_heads"]),
        ("--kv-channels", data.get("head_dim") or data["hidden_size"] // data["num_attention_heads"]),
        ("--mamba-state-dim", data["ssm_state_size"]), ("--mamba-head-dim", data["mamba_head_dim"]),
        ("--mamba-num-groups", data["n_groups"]), ("--mamba-num-heads", data["mamba_num_heads"]),
        ("--normalization", "RMSNorm"), ("--norm-epsilon", data.get("layer_norm_epsilon", 1e-5)),
        ("--position-embedding-type", "none")]
    if data.get("mlp_hidden_act", "relu2") == "relu2":
        args.append(("--squared-relu", None))
    else:
        notes.append(f"MLP activation {data['mlp_hidden_act']}: not written (Megatron-LM's hybrid models here run "
                     "squared ReLU); set it by hand")
    if not (data.get("use_bias") or data.get("mlp_bias") or data.get("attention_bias")):
        args.append(("--disable-bias-linear", None))
    if not data.get("tie_word_embeddings", False):
        args.append(("--untie-embeddings-and-output-weights", None))
    if "E" in (data.get("hybrid_override_pattern") or "") or "moe" in (data.get("layers_block_type") or ()):
        args += _hybrid_moe(data)
    return args


def _hybrid_moe(data: dict) -> list[tuple[str, object]]:
    """Nemotron 3's MoE layers (E): routed experts of the pattern's MLP activation, shared experts
    of their own width, and transformers' NemotronHTopkRouter as Megatron-Core's: sigmoid scores, an
    expert bias for choosing (`e_score_correction_bias`), group-limited top-k, the routed scaling
    factor."""
    args: list[tuple[str, object]] = [
        ("--num-experts", data["n_routed_experts"]), ("--moe-router-topk", data["num_experts_per_tok"]),
        ("--moe-ffn-hidden-size", data["moe_intermediate_size"]), ("--moe-grouped-gemm", None),
        ("--moe-router-score-function", "sigmoid"), ("--moe-router-enable-expert-bias", None)]
    shared = data.get("moe_shared_expert_intermediate_size") or 0
    if shared and data.get("n_shared_experts", 1):
        args.append(("--moe-shared-expert-intermediate-size", shared))
    if data.get("n_group", 1) > 1:
        args += [("--moe-router-num-groups", data["n_group"]), ("--moe-router-group-topk", data["topk_group"])]
    if data.get("routed_scaling_factor", 1.0) != 1.0:
        args.append(("--moe-router-topk-scaling-factor", data["routed_scaling_factor"]))
    return args


def published_spec(flags: dict[str, str | None]) -> str | None:
    """The published-config preset whose shape Megatron-LM arguments give (`SHAPE_FLAGS` equal,
    present in both or absent from both); None when none has it."""
    for name in PUBLISHED_CONFIGS:
        args = dict(hf_megatron_args(hf_config_path(name), []) or ())
        if all(_same_flag(args, flags, flag) for flag in SHAPE_FLAGS):
            return name
    return None


def _same_flag(args: dict, flags: dict, flag: str) -> bool:
    if (flag in args) != (flag in flags):
        return False
    return flag not in args or args[flag] is None or str(args[flag]) == str(flags[flag]).strip("'\"")


def _common(data: dict) -> list[tuple[str, object]]:
    """Depth, widths, vocabulary, RMSNorm, SwiGLU, RoPE; biases and tied embeddings as configured."""
    args: list[tuple[str, object]] = [
        ("--num-layers", data["num_hidden_layers"]), ("--hidden-size", data["hidden_size"]),
        ("--ffn-hidden-size", data["intermediate_size"]), ("--num-attention-heads", data["num_attention_heads"]),
        ("--vocab-size", data["vocab_size"]), ("--swiglu", None), ("--normalization", "RMSNorm"),
        ("--norm-epsilon", data.get("rms_norm_eps", 1e-6)), ("--position-embedding-type", "rope"),
        ("--rotary-base", int(data.get("rope_theta", 10000)))]
    if not data.get("attention_bias", False):
        args.append(("--disable-bias-linear", None))
    if not data.get("tie_word_embeddings", False):
        args.append(("--untie-embeddings-and-output-weights", None))
    return args


def _mla(data: dict) -> list[tuple[str, object]]:
    """Multi-head latent attention: the low ranks of q (absent: a full q projection) and of the
    shared K/V latent, the head widths without and with RoPE, the value width, the latent norms
    (`--qk-layernorm`), YaRN's scaling factor and mscales."""
    args: list[tuple[str, object]] = [("--multi-latent-attention", None)]
    if data.get("q_lora_rank"):
        args.append(("--q-lora-rank", data["q_lora_rank"]))
    args += [("--kv-lora-rank", data["kv_lora_rank"]), ("--qk-head-dim", data["qk_nope_head_dim"]),
             ("--qk-pos-emb-head-dim", data["qk_rope_head_dim"]), ("--v-head-dim", data["v_head_dim"]),
             ("--kv-channels", data["v_head_dim"]), ("--qk-layernorm", None)]
    scaling = data.get("rope_scaling") or {}
    if scaling.get("type", scaling.get("rope_type")) == "yarn":
        args += [("--rotary-scaling-factor", scaling["factor"]), ("--mscale", scaling.get("mscale", 1.0)),
                 ("--mscale-all-dim", scaling.get("mscale_all_dim", 1.0))]
    return args


def _deepseek_moe(data: dict, notes: list[str]) -> list[tuple[str, object]]:
    """Routed and shared experts, the leading dense layers, and the router: softmax or sigmoid
    scores, group-limited top-k, the routed scaling factor, DeepSeek-V3's expert bias (its
    auxiliary-loss-free balancing, `topk_method` noaux_tc)."""
    layers, dense = data["num_hidden_layers"], data.get("first_k_dense_replace", 0)
    expert_ffn = data["moe_intermediate_size"]
    args: list[tuple[str, object]] = [
        ("--num-experts", data["n_routed_experts"]), ("--moe-router-topk", data["num_experts_per_tok"]),
        ("--moe-ffn-hidden-size", expert_ffn), ("--moe-grouped-gemm", None)]
    if data.get("n_shared_experts"):
        args.append(("--moe-shared-expert-intermediate-size", data["n_shared_experts"] * expert_ffn))
    if data.get("moe_layer_freq", 1) != 1:
        notes.append(f"moe_layer_freq {data['moe_layer_freq']}: not written (Megatron's --moe-layer-freq below "
                     "puts every MoE layer after the dense ones)")
    if dense:  # quoted: the launch scripts pass it through a shell
        args.append(("--moe-layer-freq", f"'([0]*{dense}+[1]*{layers - dense})'"))
    args.append(("--moe-router-score-function", data.get("scoring_func", "softmax")))
    if data.get("n_group", 1) > 1:
        args += [("--moe-router-num-groups", data["n_group"]), ("--moe-router-group-topk", data["topk_group"])]
    if data.get("routed_scaling_factor", 1.0) != 1.0:
        args.append(("--moe-router-topk-scaling-factor", data["routed_scaling_factor"]))
    if data.get("topk_method") == "noaux_tc":
        args.append(("--moe-router-enable-expert-bias", None))
    return args


def _gpt_oss(data: dict, notes: list[str]) -> list[tuple[str, object]]:
    """Grouped-query attention at the config's head width, biases on (Megatron's default), the
    routed experts of every layer."""
    args: list[tuple[str, object]] = [
        ("--group-query-attention", None), ("--num-query-groups", data["num_key_value_heads"]),
        ("--kv-channels", data["head_dim"]), ("--num-experts", data["num_local_experts"]),
        ("--moe-router-topk", data["num_experts_per_tok"]), ("--moe-ffn-hidden-size", data["intermediate_size"]),
        ("--moe-grouped-gemm", None)]
    window = data.get("sliding_window")
    notes.append(f"GPT-OSS's sliding windows ({window} tokens, layer_types), per-head attention sinks and clamped "
                 f"SwiGLU (swiglu_limit {data.get('swiglu_limit')}) are not written as arguments; set them by hand")
    return args
