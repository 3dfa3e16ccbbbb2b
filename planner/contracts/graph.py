"""The layer graph every later stage reads: `ModelGraph` of frozen `LayerProfile`s.

All per-layer quantities are for ONE sample (batch 1) at the graph's sequence length, in the
graph's dtype; multiply by the micro-batch size for a micro-batch. FLOPs count a multiply-add as 2.

Activation bytes are split by how parallelism treats them (Korthikanti et al., "Reducing
Activation Recomputation in Large Transformer Models", 2022):

- `act_tp_sharded_bytes`: saved tensors inside the tensor-parallel region (q/k/v, MLP
  intermediate, attention output before the row Linear): divided by t under TP.
- `act_tp_replicated_bytes`: saved tensors outside it (LayerNorm inputs, residual-stream tensors,
  dropout masks of the residual): replicated across TP ranks, divided by t only with sequence
  parallelism.
- `act_attn_score_bytes`: the s x s attention scores, softmax output and dropout mask (math
  attention only; zero under flash attention): divided by t under TP, and dropped by selective
  recomputation.
- `input_bytes`: the layer input, which full recomputation keeps instead of everything above.
- `act_rebuilt_bytes`: tensors a backward needs that are not kept but rebuilt when it needs them
  (the fused RMSNorm's output, from its kept input): in none of the totals above; the backward
  repeats the memory-bound kernel that made them. Outside the TP region, like the replicated bytes.

Mixture-of-experts blocks (zero elsewhere, so dense graphs are unchanged) add what expert
parallelism and routing imbalance act on, each already included in the totals above: the routed
experts' parameters (`expert_params`) and the share one token uses (`active_expert_params` =
expert_params * top_k / experts), their GEMM FLOPs (`expert_fwd_flops`, `expert_bwd_flops`), the
bytes saved inside them (`expert_act_bytes`), and `dispatch_bytes`, the routed copies of the
tokens the dispatch hands to the experts (tokens * top_k * hidden elements; the combine returns
as many). They are measured under balanced routing: every expert receives tokens * top_k /
experts copies (`ModelInfo.moe_imbalance` records how much more the busiest one gets).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any, Literal

from meshplan.planner.contracts.config import MOE_DISPATCHERS

if TYPE_CHECKING:  # imported where the graph is built: networkx alone costs 0.17 s per command
    import networkx as nx

LayerKind = Literal["embedding", "block", "head", "other"]
TPSplitKind = Literal["block", "vocab", "none"]
LAYER_KINDS = ("embedding", "block", "head", "other")
# The name prefix of multi-token-prediction depths (`profiling.mtp.with_mtp`): blocks after the
# decoder's, sharing the output layer's pipeline chunk.
MTP_LAYER_PREFIX = "mtp."
TP_SPLIT_KINDS = ("block", "vocab", "none")
# a block's token mixer and dense MLP (`TPSplit.mixer`, `TPSplit.mlp`); mixer "none": an MLP-only
# layer (Nemotron-H's "-" layers); mlp "": as the model family's blocks (the zoo's)
TOKEN_MIXERS = ("attention", "mamba2", "ssm", "none")
BLOCK_MLPS = ("", "gated", "plain", "none")


@dataclass(frozen=True)
class TPSplit:
    """How a layer can be split for tensor parallelism.

    kind "block": Megatron attention + MLP. `column_linears` are split on their output dim,
    `row_linears` on their input dim; each row Linear ends with one all-reduce of the hidden-size
    output in forward (and one in backward before the column Linears), so
    `num_allreduce_per_pass` = number of row Linears (2 for a transformer block). The TP degree
    must divide `num_heads` and `num_kv_heads`.
    kind "vocab": vocab-parallel embedding or output head; TP degree must divide `vocab_size`.
    kind "none": not splittable; replicated on every TP rank. `reason` says why (Hugging Face
    decoder layers whose modules match no known layout: `estimate` and `plan` refuse tp > 1).
    `mlp_width` (when known): the MLP's inner width, which the TP degree must divide too.
    `mixer` and `mlp`: what a block holds, recorded whether or not it splits (the engines' memory
    and kernel rules read them, `costing.megatron_activations`). `mixer`: "attention", "mamba2" (a
    Mamba-2 mixer, split as Megatron-Core splits it: `num_heads` its heads, `num_kv_heads` its
    B/C groups), "ssm" (another state-space or linear-attention mixer) or "none" (an MLP-only
    layer); `mlp`: "gated" (SwiGLU-style), "plain" (one activation), "none" (no dense MLP) or ""
    (as the model family's blocks: the zoo's).
    `executor_refusal`: why meshplan's executor does not run this split ("" when it does): the
    cost model prices it, `train` refuses the plan in one line (`costing.executable`).
    """

    kind: TPSplitKind = "none"
    column_linears: tuple[str, ...] = ()
    row_linears: tuple[str, ...] = ()
    num_heads: int = 0
    num_kv_heads: int = 0
    vocab_size: int = 0
    num_allreduce_per_pass: int = 0
    mlp_width: int = 0
    reason: str = ""
    mixer: str = "attention"
    mlp: str = ""
    executor_refusal: str = ""

    def __post_init__(self):
        if self.kind not in TP_SPLIT_KINDS:
            raise ValueError(f"TPSplit.kind must be one of {TP_SPLIT_KINDS}, got {self.kind!r}")
        if self.mixer not in TOKEN_MIXERS:
            raise ValueError(f"TPSplit.mixer must be one of {TOKEN_MIXERS}, got {self.mixer!r}")
        if self.mlp not in BLOCK_MLPS:
            raise ValueError(f"TPSplit.mlp must be one of {BLOCK_MLPS}, got {self.mlp!r}")
        for name in ("num_heads", "num_kv_heads", "vocab_size", "num_allreduce_per_pass", "mlp_width"):
            if getattr(self, name) < 0:
                raise ValueError(f"TPSplit.{name} must be >= 0, got {getattr(self, name)}")

    def max_degree_ok(self, tp: int) -> bool:
        """Whether this layer can be split `tp` ways."""
        if tp == 1 or self.kind == "none":
            return True
        if self.kind == "block":
            return (self.num_heads % tp == 0 and (self.num_kv_heads or self.num_heads) % tp == 0
                    and self.mlp_width % tp == 0)
        return self.vocab_size % tp == 0

    def gated_mlp(self, family: str) -> bool:
        """Whether the block's MLPs (and experts) are gated: as `mlp` records, else the model
        family's rule (Llama-style SwiGLU; GPT's is not)."""
        return self.mlp == "gated" if self.mlp in ("gated", "plain") else family != "gpt"

    def divisors_text(self) -> str:
        """What a TP degree must divide, in words (for messages)."""
        if self.kind == "vocab":
            return f"vocab {self.vocab_size}"
        heads = (f"{self.num_heads} Mamba heads, {self.num_kv_heads} groups" if self.mixer == "mamba2" else
                 f"{self.num_heads} heads, {self.num_kv_heads or self.num_heads} KV heads" if self.num_heads else "")
        width = f"MLP width {self.mlp_width}" if self.mlp_width else ""
        return ", ".join(part for part in (heads, width) if part)

    def to_json(self) -> dict[str, Any]:
        return {f.name: (list(v) if isinstance(v := getattr(self, f.name), tuple) else v)
                for f in fields(self)}


@dataclass(frozen=True)
class LayerProfile:
    """One layer of the model, for one sample at the profiled sequence length."""

    name: str
    kind: LayerKind
    fwd_flops: int
    bwd_flops: int
    num_params: int
    param_bytes: int
    act_tp_sharded_bytes: int
    act_tp_replicated_bytes: int
    act_attn_score_bytes: int
    input_bytes: int
    output_bytes: int
    tp_split: TPSplit = field(default_factory=TPSplit)
    repeat_of: str | None = None
    causal_fwd_flops: int = 0
    # Parameters this layer uses but another layer owns (tied embedding in the head): counted
    # there, but their gradient must be reduced between the two stages that hold copies.
    shared_params: int = 0
    # Mixture of experts (module docstring): parts of num_params, fwd/bwd FLOPs and activations.
    expert_params: int = 0
    active_expert_params: int = 0
    expert_fwd_flops: int = 0
    expert_bwd_flops: int = 0
    expert_act_bytes: int = 0
    dispatch_bytes: int = 0
    # Convolutions' part of fwd_flops / bwd_flops (traced models): costed at the device's
    # `conv_efficiency` rather than as GEMMs.
    conv_fwd_flops: int = 0
    conv_bwd_flops: int = 0
    # The attention core's part of fwd_flops (QK^T and x V over every entry, before a causal
    # kernel's skipping; backward does twice as many): under flash attention it runs at the
    # device's `attention_efficiency`.
    attn_fwd_flops: int = 0
    act_rebuilt_bytes: int = 0

    def __post_init__(self):
        if self.kind not in LAYER_KINDS:
            raise ValueError(f"layer {self.name!r}: kind must be one of {LAYER_KINDS}, got {self.kind!r}")
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, int) and not isinstance(value, bool) and value < 0:
                raise ValueError(f"layer {self.name!r}: {f.name} must be >= 0, got {value}")
        for part, whole in (("expert_params", "num_params"), ("active_expert_params", "expert_params"),
                            ("expert_fwd_flops", "fwd_flops"), ("expert_bwd_flops", "bwd_flops"),
                            ("conv_fwd_flops", "fwd_flops"), ("conv_bwd_flops", "bwd_flops"),
                            ("attn_fwd_flops", "fwd_flops")):
            if getattr(self, part) > getattr(self, whole):
                raise ValueError(f"layer {self.name!r}: {part} ({getattr(self, part)}) exceeds {whole} "
                                 f"({getattr(self, whole)})")

    @property
    def active_params(self) -> int:
        """Parameters one token uses: all but the routed experts it is not sent to."""
        return self.num_params - self.expert_params + self.active_expert_params

    @property
    def activation_bytes(self) -> int:
        """Bytes autograd saves for backward, without parallelism or recomputation."""
        return self.act_tp_sharded_bytes + self.act_tp_replicated_bytes + self.act_attn_score_bytes

    @property
    def flops(self) -> int:
        return self.fwd_flops + self.bwd_flops

    def to_json(self, batch: int = 1) -> dict[str, Any]:
        """JSON view for `meshplan profile --json`, scaled to `batch` samples."""
        per_sample = ("fwd_flops", "bwd_flops", "causal_fwd_flops", "act_tp_sharded_bytes",
                      "act_tp_replicated_bytes", "act_attn_score_bytes", "input_bytes", "output_bytes",
                      "expert_fwd_flops", "expert_bwd_flops", "expert_act_bytes", "dispatch_bytes",
                      "conv_fwd_flops", "conv_bwd_flops", "attn_fwd_flops", "act_rebuilt_bytes")
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "tp_split":
                value = value.to_json()
            elif f.name in per_sample:
                value = value * batch
            out[f.name] = value
        out["params"] = self.num_params
        out["activation_bytes"] = self.activation_bytes * batch
        return out


@dataclass(frozen=True)
class ModelInfo:
    """Architecture facts the cost model and the solver need beyond the per-layer numbers."""

    family: str  # "gpt", "llama", "file", "hf"
    num_layers: int = 0  # transformer blocks
    hidden: int = 0
    num_heads: int = 0
    num_kv_heads: int = 0
    ffn: int = 0
    vocab: int = 0  # as published
    padded_vocab: int = 0  # as built (padded to a multiple of 128 for tp=1)
    tied_embeddings: bool = False
    max_positions: int = 0
    head_dim: int = 0  # attention head width; 0: hidden / num_heads
    # Mixture of experts (0 for dense models): routed experts per MoE block, experts per token,
    # one routed expert's SwiGLU width, shared experts and their summed width, leading dense blocks.
    num_experts: int = 0
    top_k: int = 0
    expert_ffn: int = 0
    num_shared_experts: int = 0
    shared_ffn: int = 0
    dense_layers: int = 0
    # Routing assumption: the busiest expert receives moe_imbalance times the balanced
    # tokens * top_k / num_experts (1.0: balanced, as profiled).
    moe_imbalance: float = 1.0
    # Capacity: each expert takes at most moe_capacity_factor times the balanced copies, the rest
    # dropped (0.0: no capacity, none dropped); moe_pad_to_capacity pads every expert's input to
    # that capacity (planner.costing.expert_parallel has the rules).
    moe_capacity_factor: float = 0.0
    moe_pad_to_capacity: bool = False
    # The token dispatcher the engine runs (`contracts.config.MOE_DISPATCHERS`): what the dispatch
    # and combine exchanges cost (`planner.costing.moe_dispatch`).
    moe_dispatcher: str = MOE_DISPATCHERS[0]
    # Group-limited routing (DeepSeek's node-limited routing; HF n_group / topk_group): each token's
    # experts lie in moe_router_group_topk of moe_router_groups contiguous expert groups (1, 0: no limit).
    moe_router_groups: int = 1
    moe_router_group_topk: int = 0
    # Multi-head latent attention (DeepSeek-V2/V3; 0 without): the compressed K/V latent's width
    # (kv_lora_rank, 0: no MLA) and the query's (q_lora_rank, 0: a full-rank query), the rotary
    # part of each query/key head (head_dim is nope + rope) and each value head's width.
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # Mamba-2 mixers (hybrid Hugging Face models, Nemotron-H; 0 without): heads, head width, B/C
    # groups, state width and the chunked scan's chunk, as the engines' memory and kernel rules
    # read them (`TPSplit.mixer`).
    mamba_heads: int = 0
    mamba_head_dim: int = 0
    mamba_groups: int = 0
    mamba_state: int = 0
    mamba_chunk: int = 0
    # Traced Hugging Face models: the attention implementation transformers ran ("sdpa" or
    # "eager"; "" for meshplan's own models), and what the profile should say about the input
    # (config keys transformers ignores, ...), one line each.
    attn_implementation: str = ""
    # Multi-token-prediction depths the graph carries (`profiling.mtp.with_mtp`; 0: none).
    mtp_num_layers: int = 0
    notes: tuple[str, ...] = ()
    # Why the executor cannot cut the model into pipeline stages ("" when it can): Hugging Face
    # base models with parameters outside the embedding, decoder layers and final norm.
    pipeline_cut_problem: str = ""

    def __post_init__(self):
        if not self.moe_imbalance >= 1.0 or self.moe_imbalance == float("inf"):
            raise ValueError(f"moe_imbalance must be a finite number >= 1.0, got {self.moe_imbalance}")
        if not 0.0 <= self.moe_capacity_factor < float("inf"):
            raise ValueError(f"moe_capacity_factor must be a finite number > 0 (0: none), got {self.moe_capacity_factor}")
        if self.moe_pad_to_capacity and not self.moe_capacity_factor:
            raise ValueError("moe_pad_to_capacity needs a moe_capacity_factor")
        if self.moe_router_groups < 1 or not 0 <= self.moe_router_group_topk <= self.moe_router_groups:
            raise ValueError(f"group-limited routing needs groups >= 1 and 0 <= group top-k <= groups, got "
                             f"{self.moe_router_groups} groups, top-{self.moe_router_group_topk}")
        if self.moe_dispatcher not in MOE_DISPATCHERS:
            raise ValueError(f"moe_dispatcher must be one of {', '.join(MOE_DISPATCHERS)}, got {self.moe_dispatcher!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) exceeds num_experts ({self.num_experts})")

    @property
    def mamba_in_proj_width(self) -> int:
        """A Mamba-2 mixer's in_proj outputs: [z | x | B | C | dt] (0 without Mamba-2 mixers)."""
        inner = self.mamba_heads * self.mamba_head_dim
        return 2 * inner + 2 * self.mamba_groups * self.mamba_state + self.mamba_heads if inner else 0

    def mamba_scan_fwd_flops(self, seq: int) -> float:
        """One sample's forward FLOPs of a Mamba-2 chunked scan (`models.hf_ssm.ssd_products`: per
        chunk C B^T per group, the masked scores times x, the chunk states and their read-out per head)."""
        if not self.mamba_heads:
            return 0.0
        chunk = self.mamba_chunk or seq
        chunks = -(-seq // chunk)
        per_chunk = (self.mamba_groups * chunk * self.mamba_state * chunk
                     + self.mamba_heads * self.mamba_head_dim * chunk * (chunk + 2 * self.mamba_state))
        return 2.0 * chunks * per_chunk

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def attention_head_dim(self) -> int:
        """One attention head's width: `head_dim`, else hidden / heads (0 for a model without heads)."""
        return self.head_dim or (self.hidden // self.num_heads if self.num_heads else 0)

    @property
    def value_head_dim(self) -> int:
        """One value head's width: multi-head latent attention's `v_head_dim`, else the head width."""
        return self.v_head_dim or self.attention_head_dim

    @property
    def mlp_width(self) -> int:
        """A dense block's MLP width: `ffn`, else GPT's 4 x hidden."""
        return self.ffn or 4 * self.hidden

    @property
    def shared_experts_width(self) -> int:
        """The shared experts' summed SwiGLU width: `shared_ffn`, or, where a model names only their
        count, that many routed experts' width."""
        return self.shared_ffn or self.num_shared_experts * self.expert_ffn


def is_mtp_layer(layer) -> bool:
    """Whether `layer` (a LayerProfile, a plan's LayerAssignment: anything named, or a layer's
    name) is a multi-token-prediction depth (`MTP_LAYER_PREFIX`)."""
    return (layer if isinstance(layer, str) else layer.name).startswith(MTP_LAYER_PREFIX)


@dataclass(frozen=True)
class ModelGraph:
    """Layers in execution order, with the networkx DiGraph whose edges carry boundary bytes.

    `graph` nodes are layer names with attribute `profile` (the LayerProfile); edge (u, v) has
    attribute `bytes` = bytes per sample flowing from u to v.
    """

    spec: str
    seq: int
    dtype: str
    attention: str
    layers: tuple[LayerProfile, ...]
    info: ModelInfo

    def __post_init__(self):
        if not self.layers:
            raise ValueError(f"model {self.spec!r} has no layers")
        if self.seq <= 0:
            raise ValueError(f"sequence length must be positive, got {self.seq}")
        names = [layer.name for layer in self.layers]
        if len(set(names)) != len(names):
            raise ValueError(f"model {self.spec!r} has duplicate layer names")

    @property
    def graph(self) -> nx.DiGraph:
        """The networkx DiGraph of the layers, built on first use and kept."""
        built = self.__dict__.get("_graph")
        if built is None:
            built = build_chain_graph(self.layers)
            object.__setattr__(self, "_graph", built)
        return built

    @property
    def total_params(self) -> int:
        return sum(layer.num_params for layer in self.layers)

    @property
    def active_params(self) -> int:
        """Parameters one token uses (equal to total_params for dense models)."""
        return sum(layer.active_params for layer in self.layers)

    @property
    def fwd_flops(self) -> int:
        return sum(layer.fwd_flops for layer in self.layers)

    @property
    def bwd_flops(self) -> int:
        return sum(layer.bwd_flops for layer in self.layers)

    def layer(self, name: str) -> LayerProfile:
        for layer in self.layers:
            if layer.name == name:
                return layer
        raise KeyError(name)

    def repeat_groups(self) -> list[tuple[str, list[int]]]:
        """Runs of identical consecutive layers: [(type name, [indices])] in order."""
        groups: list[tuple[str, list[int]]] = []
        for index, layer in enumerate(self.layers):
            key = layer.repeat_of or layer.name
            if groups and groups[-1][0] == key:
                groups[-1][1].append(index)
            else:
                groups.append((key, [index]))
        return groups


def build_chain_graph(layers: tuple[LayerProfile, ...]) -> nx.DiGraph:
    """The execution-order chain: each layer feeds the next with its output bytes."""
    import networkx as nx

    graph = nx.DiGraph()
    for layer in layers:
        graph.add_node(layer.name, profile=layer)
    for prev, nxt in zip(layers, layers[1:]):
        graph.add_edge(prev.name, nxt.name, bytes=prev.output_bytes)
    return graph


def graph_to_json(graph: ModelGraph) -> dict[str, Any]:
    """The graph as JSON: the profile cache's entries and the layer graph a plan carries."""
    return {"spec": graph.spec, "seq": graph.seq, "dtype": graph.dtype, "attention": graph.attention,
            "info": asdict(graph.info), "layers": [asdict(layer) for layer in graph.layers]}


def graph_from_json(data: Any) -> ModelGraph:
    """A ModelGraph from `graph_to_json`'s document; ValueError names what is malformed."""
    try:
        layers = []
        for item in data["layers"]:
            split = {k: tuple(v) if isinstance(v, list) else v for k, v in item["tp_split"].items()}
            layers.append(LayerProfile(**{**item, "tp_split": TPSplit(**split)}))
        info = ModelInfo(**{**data["info"], "notes": tuple(data["info"].get("notes", ()))})
        return ModelGraph(spec=data["spec"], seq=data["seq"], dtype=data["dtype"], attention=data["attention"],
                          layers=tuple(layers), info=info)
    except KeyError as exc:
        raise ValueError(f"layer graph is missing the field {exc.args[0]!r}") from None
    except (TypeError, AttributeError) as exc:
        raise ValueError(f"layer graph has a malformed entry ({exc})") from None
