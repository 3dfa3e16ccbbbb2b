"""Tensor-parallel layouts of Hugging Face decoder layers, read off their modules and weight shapes.

A decoder layer splits Megatron-style when its attention and MLP Linears form one of the layouts
below; column Linears are split on their output features, row Linears on their input features,
and each row Linear ends with one all-reduce:

| attention | Linears (relative to the layer's attention module) | fused output rows |
| --- | --- | --- |
| `separate` | `q_proj`, `k_proj`, `v_proj` + `o_proj` (Llama, Mistral, Qwen2/3, Gemma-2/3) | - |
| `blocks` | `qkv_proj` + `o_proj` (Phi-3) | [q | k | v] |
| `per_head` | `query_key_value` + `dense` (GPT-NeoX, Falcon without multi-query) | [heads, (q, k, v), head_dim] |
| `grouped` | `query_key_value` + `dense` (Falcon `new_decoder_architecture`) | [kv heads, (q.., k, v), head_dim] |
| `multi_query` | `query_key_value` + `dense` (Falcon multi-query) | [q heads.., k, v]: one K/V head |
| `mla` | `q_proj` or `q_b_proj`, `kv_b_proj` + `o_proj` (DeepSeek-V2/V3 multi-head latent attention) | - |

Multi-head latent attention splits as Megatron-Core's MLA does: the per-head up-projections
(`q_b_proj`, or `q_proj` without a query low rank, and `kv_b_proj`, whose rows run head by head)
column-parallel, `o_proj` row-parallel; the down-projections to the latents (`q_a_proj`,
`kv_a_proj_with_mqa`, the latter also giving the one rotary key all heads share) and their norms
stay whole on every rank (`HFLayout.replicated`): they read the replicated hidden state and
their gradients arrive whole through the column-parallel inputs' all-reduce.

| MLP | Linears (relative to the layer's MLP module) |
| --- | --- |
| `gated` | `gate_proj`, `up_proj` + `down_proj` |
| `fused_gated` | `gate_up_proj` ([gate | up]) + `down_proj` (Phi-3) |
| `plain` | `up_proj` + `down_proj`, `dense_h_to_4h` + `dense_4h_to_h` (GPT-NeoX, Falcon), `fc1` + `fc2`, `c_fc` + `c_proj` (StarCoder2) |

Head counts come from the weight shapes (query rows / head_dim); a tp must divide the heads, the
K/V heads and the MLP width (`TPSplit.max_degree_ok`). Biases split with their Linears (a row
Linear's bias is added once, after the all-reduce). Per-head norms (Gemma-3, Qwen3 q/k norms, one
weight of head_dim) stay replicated. Norms over the whole query or key width (OLMo-2's q/k norms,
one weight of heads x head_dim: `HFLayout.width_norms`) are split with the heads; their mean square
then sums over the TP ranks, one all-reduce of one value per token and norm, about 1/head_dim of a
row Linear's all-reduce in bytes, which the cost model leaves out.

A mixture-of-experts layer (DeepSeek-V2/V3, Qwen MoE traced through transformers) splits its
attention and shared-expert MLP (if any) as above, and its routed experts (transformers' stacked
experts, `HFLayout.experts`) as the cost model prices experts under tp, each expert's width split
(Megatron's expert TP = TP); the MoE output (routed + shared) ends with one all-reduce, as a dense
MLP's does. The TP degree must divide the experts' width too. The executor does not split
transformers' experts: `planner.costing.executable` refuses such plans for `train` in one line.

Anything else (a state-space mixer, GPT-2's Conv1D, another parameter sized by the heads) gets
kind "none" with the reason.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from meshplan.planner.contracts.graph import TPSplit

# attention layout -> (fused or separate q/k/v Linear names, output Linear names)
_ATTENTION_NAMES = {"separate": (("q_proj", "k_proj", "v_proj"), ("o_proj",)),
                    "blocks": (("qkv_proj",), ("o_proj",)),
                    "query_key_value": (("query_key_value",), ("dense",)),
                    "mla": (("q_b_proj", "kv_b_proj"), ("o_proj",)),
                    "mla_full_rank_query": (("q_proj", "kv_b_proj"), ("o_proj",))}
# multi-head latent attention: the Linears to the latents, kept whole (module docstring)
MLA_REPLICATED = ("q_a_proj", "kv_a_proj_with_mqa", "q_a_layernorm", "kv_a_layernorm")
_MLP_NAMES = (("gated", ("gate_proj", "up_proj"), "down_proj"), ("fused_gated", ("gate_up_proj",), "down_proj"),
              ("plain", ("up_proj",), "down_proj"), ("plain", ("dense_h_to_4h",), "dense_4h_to_h"),
              ("plain", ("fc1",), "fc2"), ("plain", ("c_fc",), "c_proj"))
_MLP_GATING = {"gated": "gated", "fused_gated": "gated", "plain": "plain", "none": "none"}
# attributes of an attention module (or its config) that count heads: divided by tp when split
HEAD_ATTRIBUTES = ("num_heads", "num_attention_heads")
_NO_ATTENTION = ("no attention of q/k/v/o_proj, qkv_proj/o_proj, query_key_value/dense or "
                 "q(_b)_proj/kv_b_proj/o_proj Linears")
KV_HEAD_ATTRIBUTES = ("num_key_value_heads", "num_kv_heads")


@dataclass(frozen=True)
class HFLayout:
    """One decoder layer's TP layout (module paths relative to the layer)."""

    attention: str  # the attention module's (or Mamba-2 mixer's) path; "" in an MLP-only layer
    qkv: str  # separate | blocks | per_head | grouped | multi_query | mla | mamba2 | none (no token mixer)
    mlp: str  # the MLP module's path
    mlp_kind: str  # gated | fused_gated | plain
    column_linears: tuple[str, ...]
    row_linears: tuple[str, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mlp_width: int
    replicated: tuple[str, ...] = ()  # attention modules kept whole on every rank (MLA's latents)
    width_norms: tuple[str, ...] = ()  # norms over the whole q or k width, split with the heads
    experts: tuple[str, ...] = ()  # routed experts (stacked), split by the cost model only

    @property
    def fused_qkv(self) -> str | None:
        """The fused q/k/v Linear's path (None for separate q/k/v)."""
        return None if self.qkv in ("separate", "mla", "mamba2", "none") else self.column_linears[0]

    @property
    def executor_refusal(self) -> str:
        """Why meshplan's executor does not run this layout ("" when it does)."""
        if self.qkv == "mamba2":
            return ("meshplan's executor does not split Mamba-2 mixers (in_proj's z/x/B/C/dt rows by heads and "
                    "groups, the conv and the gated norm by channel)")
        if self.qkv == "none" or not (self.mlp or self.experts):
            return "meshplan's executor splits decoder layers of attention and an MLP, not attention or an MLP alone"
        return ""

    @property
    def fused_gate_up(self) -> str | None:
        """The fused [gate | up] Linear's path (None for other MLPs)."""
        return self.column_linears[-1] if self.mlp_kind == "fused_gated" else None

    def split(self) -> TPSplit:
        return TPSplit(kind="block", column_linears=self.column_linears, row_linears=self.row_linears,
                       num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                       num_allreduce_per_pass=(self.qkv != "none") + bool(self.mlp or self.experts),
                       mlp_width=self.mlp_width, mixer={"mamba2": "mamba2", "none": "none"}.get(self.qkv, "attention"),
                       mlp=_MLP_GATING[self.mlp_kind], executor_refusal=self.executor_refusal)


def block_split(layer, experts: list[str] = ()) -> TPSplit:
    """The layer's `TPSplit`: kind "block" with its Linears and head counts, or "none" with why;
    either way with what the block holds (`block_contents`). `experts`: the layer's routed
    experts (`hf.expert_modules`), which have no layout."""
    layout = tp_layout(layer, experts)
    if isinstance(layout, HFLayout):
        return layout.split()
    mixer, mlp = block_contents(layer)
    return TPSplit(reason=layout, mixer=mixer, mlp=mlp)


def block_contents(layer) -> tuple[str, str]:
    """(token mixer, dense MLP) of a decoder layer, as `TPSplit.mixer` and `TPSplit.mlp` name them:
    a Mamba-2 mixer, another state-space or linear-attention mixer (a parameter `A_log`), attention
    Linears of a known layout or else "none"; a dense MLP of known Linears, gated or plain, or none."""
    import torch

    linears = {name: m for name, m in layer.named_modules() if isinstance(m, torch.nn.Linear)}
    ssm = ssm_mixer_path(layer)
    if ssm is not None:
        mixer = "ssm" if isinstance(mamba2_mixer(layer, ssm), str) else "mamba2"
    else:
        mixer = "none" if isinstance(_find_attention(layer, linears), str) else "attention"
    mlp = _find_mlp(linears)
    return mixer, "none" if mlp is None else _MLP_GATING[mlp[1]]


def tp_layout(layer, experts: list[str] = ()) -> HFLayout | str:
    """The layer's layout, or a one-phrase reason why it has none (`experts` as in `block_split`)."""
    import torch

    linears = {name: m for name, m in layer.named_modules() if isinstance(m, torch.nn.Linear)}
    mixer = _find_token_mixer(layer, linears)
    expert_width = _expert_width(layer, experts)
    if isinstance(expert_width, str):
        return expert_width
    mlp = _find_mlp(linears)
    # a hybrid's single-purpose layers (Nemotron-H): an MLP or a MoE alone, or attention or a Mamba-2
    # mixer alone, when nothing but norms sits outside it
    body = _common_path(([mlp[0]] if mlp else []) + [name.rpartition(".")[0] for name in experts])
    if isinstance(mixer, str) and not ((mlp or experts) and _only_norms_outside(layer, body)):
        return mixer
    if mlp is None and not experts and not _only_norms_outside(layer, mixer[0]):
        return "no MLP of gate/up/down, gate_up/down, dense_h_to_4h/dense_4h_to_h, fc1/fc2 or c_fc/c_proj Linears"
    attn_path, qkv, qkv_names, out_name, heads, kv_heads, head_dim = (
        mixer if not isinstance(mixer, str) else ("", "none", (), "", 0, 0, 0))
    mlp_path, mlp_kind, mlp_columns, mlp_row, width = mlp or ("", "none", (), "", 0)
    columns = tuple(_join(attn_path, n) for n in qkv_names) + tuple(_join(mlp_path, n) for n in mlp_columns)
    rows = ((_join(attn_path, out_name),) if out_name else ()) + ((_join(mlp_path, mlp_row),) if mlp else ())
    width = math.gcd(width, expert_width)
    attention_module = layer.get_submodule(attn_path) if attn_path else layer
    replicated = tuple(_join(attn_path, n) for n in MLA_REPLICATED
                       if qkv == "mla" and isinstance(getattr(attention_module, n, None), torch.nn.Module))
    others = sorted(set(linears) - set(columns) - set(rows) - set(replicated))
    if others:
        return f"Linears outside a known attention/MLP layout ({', '.join(others[:3])})"
    width_norms: tuple[str, ...] = ()
    if qkv not in ("mamba2", "none"):
        widths = {heads * head_dim, kv_heads * head_dim}
        sized, width_norms = _head_sized_parameters(layer, attn_path, columns + rows + replicated, widths, heads,
                                                     head_dim)
        if sized:
            return f"parameter {sized} is sized by the heads and meshplan does not shard it"
    return HFLayout(attention=attn_path, qkv=qkv, mlp=mlp_path, mlp_kind=mlp_kind, column_linears=columns,
                    row_linears=rows, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, mlp_width=width,
                    replicated=replicated, width_norms=width_norms, experts=tuple(experts))


def _find_token_mixer(layer, linears: dict):
    """The attention's or Mamba-2 mixer's (path, layout, input names, output name, heads, kv heads
    or groups, head_dim), or the reason the layer has none that splits."""
    ssm = ssm_mixer_path(layer)
    if ssm is not None:
        return mamba2_mixer(layer, ssm)
    return _find_attention(layer, linears)


def ssm_mixer_path(layer) -> str | None:
    """The path of the layer's state-space mixer (the module holding a state decay `A_log`: Mamba,
    Mamba-2, gated DeltaNet), or None."""
    return next((name.rpartition(".")[0] for name, _ in layer.named_parameters()
                 if name.rpartition(".")[2] == "A_log"), None)


def mamba2_mixer(layer, path: str):
    """A Mamba-2 mixer's split (Megatron-Core's MambaMixer under TP): `in_proj` column-parallel, its
    [z | x | B | C | dt] rows each cut by heads or groups; the depthwise conv, A_log, D, dt_bias and
    the gated norm by channel, head or group; `out_proj` row-parallel, one all-reduce. The TP degree
    divides the heads and the groups. A reason for any other state-space mixer (Mamba-1's
    x_proj/dt_proj: Megatron-Core splits Mamba-2 only)."""
    mixer = layer.get_submodule(path) if path else layer
    heads, groups, head_dim, state = (_first_int(mixer, (n,)) for n in ("num_heads", "n_groups", "head_dim",
                                                                         "ssm_state_size"))
    where = path or "the layer"
    if not (heads and groups and head_dim and state) or not all(
            hasattr(mixer, n) for n in ("in_proj", "out_proj", "conv1d")):
        return (f"a state-space mixer ({where}) has no tensor-parallel split unless it is a Mamba-2 mixer (in_proj, "
                "conv1d, out_proj, num_heads, n_groups, head_dim, ssm_state_size)")
    inner = heads * head_dim
    rows = 2 * inner + 2 * groups * state + heads
    if mixer.in_proj.out_features != rows or mixer.out_proj.in_features != inner:
        return (f"Mamba-2 mixer {where}: in_proj rows {mixer.in_proj.out_features} / out_proj width "
                f"{mixer.out_proj.in_features} do not match {heads} heads of {head_dim}, {groups} groups of {state}")
    split = {heads, inner, inner + 2 * groups * state}
    for name, param in mixer.named_parameters():
        if not name.startswith(("in_proj.", "out_proj.")) and param.shape[0] not in split:
            return f"parameter {_join(path, name)} of the Mamba-2 mixer is not sized by its heads or channels"
    return path, "mamba2", ("in_proj",), "out_proj", heads, groups, head_dim


def _common_path(paths: list[str]) -> str:
    """The deepest module path holding every one of `paths` ("" for the layer itself)."""
    parts = [path.split(".") if path else [] for path in paths]
    common = []
    for names in zip(*parts) if parts else ():
        if len(set(names)) > 1:
            break
        common.append(names[0])
    return ".".join(common)


def _only_norms_outside(layer, path: str) -> bool:
    """Whether every parameter outside the module at `path` is a norm's weight or bias."""
    prefix = f"{path}." if path else ""
    return all(name.startswith(prefix) or (param.dim() == 1 and "norm" in name)
               for name, param in layer.named_parameters())


def _expert_width(layer, experts) -> int | str:
    """The routed experts' inner width (0 without experts): the dimension of their stacked weights
    that is not the hidden size (gate_up: 2 x width); a reason when they are not stacked weights."""
    if not experts:
        return 0
    params = list(layer.get_submodule(experts[0]).parameters(recurse=False))
    dims = {d for p in params if p.dim() == 3 for d in p.shape[1:]}
    if len(params) < 2 or len(dims) < 2:
        return f"routed experts ({experts[0]}) that are not transformers' stacked expert weights"
    # the hidden size: a norm's width where the layer has one, else the dimension in every weight (a
    # plain MLP's experts hold both of theirs in both weights)
    norms = {p.shape[0] for name, p in layer.named_parameters() if p.dim() == 1 and "norm" in name} & dims
    hidden = next(iter(norms)) if len(norms) == 1 else max(dims, key=lambda d: sum(d in p.shape[1:] for p in params))
    return math.gcd(*(d for d in dims if d != hidden))


def _find_attention(layer, linears: dict):
    """(path, layout, q/k/v names, output name, heads, kv heads, head_dim), or a reason."""
    for layout, (inputs, (output,)) in _ATTENTION_NAMES.items():
        for name in linears:
            path, _, leaf = name.rpartition(".")
            if leaf != inputs[0] or not all(_join(path, n) in linears for n in inputs[1:] + (output,)):
                continue
            module = layer.get_submodule(path) if path else layer
            found = _heads(module, [linears[_join(path, n)] for n in inputs], linears[_join(path, output)],
                           layout)
            if isinstance(found, str):
                return found
            qkv, heads, kv_heads, head_dim = found
            return path, qkv, inputs, output, heads, kv_heads, head_dim
    attention = sorted(name for name in linears if "att" in name.rpartition(".")[0])
    found = f" (its attention Linears: {', '.join(attention[:4])})" if attention else ""
    return _NO_ATTENTION + found


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _heads(module, qkv: list, out, layout: str):
    """(qkv layout, heads, kv heads, head_dim) from the module's head_dim and the weight shapes."""
    config = getattr(module, "config", None)
    heads = _first_int(module, HEAD_ATTRIBUTES) or _first_int(config, HEAD_ATTRIBUTES)
    head_dim = _first_int(module, ("head_dim", "head_size")) or (out.in_features // heads if heads else 0)
    if not head_dim or out.in_features % head_dim:
        return "attention head size not readable from the module"
    if layout.startswith("mla"):
        return _mla_heads(module, qkv, out)
    heads = out.in_features // head_dim
    rows = sum(linear.out_features for linear in qkv)
    if layout == "separate":
        kv_heads, kind = qkv[1].out_features // head_dim, "separate"
    elif layout == "blocks":
        kv_heads, kind = (rows - heads * head_dim) // (2 * head_dim), "blocks"
    elif getattr(module, "new_decoder_architecture", False):
        kv_heads, kind = (rows - heads * head_dim) // (2 * head_dim), "grouped"
    elif getattr(module, "multi_query", False):
        kv_heads, kind = 1, "multi_query"
    else:
        kv_heads, kind = heads, "per_head"
    if kv_heads < 1 or heads % kv_heads or rows != (heads + 2 * kv_heads) * head_dim:
        return (f"fused q/k/v rows ({rows}) do not match {heads} heads and {kv_heads} K/V heads of "
                f"{head_dim}")
    return kind, heads, kv_heads, head_dim


def _mla_heads(module, qkv: list, out):
    """("mla", heads, heads, v_head_dim): the query rows are heads x (nope + rope) head widths,
    the K/V up-projection's heads x (nope + value), the output's input heads x value."""
    heads = _first_int(module, HEAD_ATTRIBUTES)
    nope, rope, value = (_first_int(module, (name,)) for name in ("qk_nope_head_dim", "qk_rope_head_dim",
                                                                   "v_head_dim"))
    if not (heads and nope and rope and value):
        return "multi-head latent attention without num_heads, qk_nope/qk_rope/v_head_dim attributes"
    expected = (heads * (nope + rope), heads * (nope + value), heads * value)
    found = (qkv[0].out_features, qkv[1].out_features, out.in_features)
    if found != expected:
        return f"latent attention widths {found} do not match {heads} heads of {nope}+{rope} / {value}"
    return "mla", heads, heads, value


def _first_int(obj, names) -> int:
    for name in names:
        value = getattr(obj, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 0


def _find_mlp(linears: dict):
    for kind, columns, row in _MLP_NAMES:
        for name, linear in linears.items():
            path, _, leaf = name.rpartition(".")
            if leaf != row or not all(_join(path, c) in linears for c in columns):
                continue
            return path, kind, columns, row, linear.in_features
    return None


def _head_sized_parameters(layer, attn_path: str, split_linears: tuple, widths: set[int], heads: int,
                           head_dim: int) -> tuple[str, tuple[str, ...]]:
    """(a parameter of the attention module outside the split Linears with a dimension of a
    q or k/v width, or a matrix with one of the head count, which would need sharding too;
    the norms over a whole q or k width, which are split with the heads). Per-head norms of
    head_dim stay replicated."""
    covered = tuple(f"{name}." for name in split_linears)
    attention = layer.get_submodule(attn_path) if attn_path else layer
    width_norms = []
    for name, param in attention.named_parameters():
        full = _join(attn_path, name)
        if full.startswith(covered):
            continue
        module_path, _, leaf = full.rpartition(".")
        if tuple(param.shape) == (head_dim,) and "norm" in module_path:
            continue  # a per-head norm
        if leaf == "weight" and param.dim() == 1 and param.shape[0] in widths and "norm" in module_path:
            width_norms.append(module_path)
            continue
        if widths & set(param.shape) or heads in param.shape:  # GPT-OSS's per-head sinks too
            return full, ()
    return "", tuple(width_norms)
