"""Memory of one layer on one rank as each training engine allocates it (`ParallelConfig.engine`).

"meshplan" is meshplan's own executor (`state_memory`'s "executor" recipe, `activation_memory`,
`executor_memory`), which `layer_cost` prices itself. For the other engines `layer_cost` replaces
the layer's memory fields with `engine_layer_memory`: model states, the bytes saved for backward
per micro-batch and the transient working set, each rule citing the engine's code or docs. Nothing
only meshplan's executor does (autocast's copies, its loss's fp32 copies, a vocab-parallel
embedding's whole gradient, its K/V kept under context parallelism) is charged to another engine.
The simulator, the ILP's cost tables and `estimate` all read `layer_cost`, so one rule per engine
serves them all; beside it, `keeps_stage_outputs` (pipeline boundaries) and
`allocator_reserve_fraction` (the caching allocator's fragmentation, which the event engine and
the ILP's tables add to the transient bytes).

Activations are counted per token of the rank's micro-batch (`rank_microbatch` samples x seq:
context parallelism's 1/cp is in it), per transformer layer, Korthikanti et al. 2022
("Reducing Activation Recomputation in Large Transformer Models", section 4.1) term by term, with
b the compute dtype's bytes, h the hidden size, hq = heads x head_dim, hkv = kv_heads x head_dim,
f the MLP width, a the heads, t the TP degree (sp_t = t under sequence parallelism, else 1):

- Megatron-LM with Transformer Engine (`megatron/core/transformer/transformer_layer.py`,
  TE `LayerNormLinear`, `DotProductAttention`): each LayerNormLinear saves its input and the
  norm's output (2 x 2bh /sp_t); flash attention saves Q, K, V, its output and the fp32
  log-sum-exp (b(2hq + 2hkv) + 4a, /t); the MLP saves fc1's output (bf, 2bf gated: `bias_swiglu`)
  and fc2's input (bf), /t; GPT's dropout 0.1 adds two 1-byte masks (h /sp_t). GPT-3's shapes
  give Korthikanti's 34sbh/t. Unfused attention (`--attention math`) without recomputation adds
  the score terms 5as (2as without dropout), /t. Selective recomputation (`--recompute-granularity
  selective`, core attention) drops only those. Full recomputation (`--recompute-granularity full
  --recompute-method uniform --recompute-num-layers 1`) keeps the layer's input (2bh /sp_t).
  FP8 (TE): the Linears' inputs are kept as fp8 (1 byte: TE's `_Linear.forward` saves the fp8 cast
  or its fp8 transpose, not the bf16 input: `transformer_engine/pytorch/module/linear.py` at commit
  3ec878759cc601d088dfa5c0a4772acf4317b190), the projection's beside flash's output.
  Term by term, with MoE blocks, multi-head latent attention and the fine-grained recompute
  modules (`--recompute-modules`): `megatron_activations`.
- torchtitan (`torchtitan/models/llama3/model.py`, `parallelize.py`): plain bf16 modules under
  FSDP2's cast, SDPA flash with K/V repeated to all heads (`repeat_kv`), SwiGLU as silu(w1) x w3;
  TP always with sequence parallel norms whose outputs are all-gathered before the column
  Linears, which keep the gathered (whole) input. Its SAC (`activation_checkpoint.mode =
  "selective"`, op policy: mm, sdpa and reductions saved, every second mm recomputed) keeps the
  block input, attention's output and the outputs of the Linears `torchtitan_sac.saved_linear_shapes`
  names (wq, wv, w1, w2; Float8 Linears alike: the policy sees their `aten.mm` on torchao's
  subclass); full AC keeps the block input.
  Float8 (torchao `Float8Linear`) saves the Linears' inputs in bf16 (`matmul_with_hp_or_float8_args`
  keeps `input_hp`): fp8 keeps bf16's activations.
- Context parallelism: Transformer Engine's context-parallel attention (`AttnFuncWithCPAndKVP2P`,
  `...KVAllGather`) and torchtitan's ring attention save the rank's own K/V and exchange them
  again in backward: nothing beyond the rank's 1/cp of the tokens.
- DeepSpeed runs the model as written: the profile's Korthikanti accounting
  (`activation_memory.activation_bytes` without meshplan's executor choices).
- MosaicML llm-foundry (Composer, FSDP, fused cross-entropy on bf16 logits): `foundry_memory`.

Model states are documented at `engine_state_bytes`.
"""
from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from typing import NamedTuple

from meshplan.planner.contracts.config import EXECUTOR_MEMORY_ENGINES, ParallelConfig
from meshplan.planner.contracts.engine_rules import GATHERED_INPUT_ENGINES, grad_buffer_bytes
from meshplan.planner.contracts.graph import LayerProfile, ModelInfo
from meshplan.planner.costing.activation_memory import activation_bytes
from meshplan.planner.costing.device_time import DTYPE_BYTES
from meshplan.planner.costing import foundry_memory, gemm, megatron_activations, torchtitan_sac
from meshplan.planner.costing.expert_parallel import dense_part, load_factor
from meshplan.planner.costing.fp8 import fp8_primary_weights
from meshplan.planner.costing.loss_kernels import torch_ce_held_bytes_per_logit, torch_ce_kind
from meshplan.planner.costing.precision import COMPUTE_DTYPE
from meshplan.planner.costing.tp_split import is_split, rank_params, vocab_scale

# Families whose blocks the formulas describe (GPT-3 style, Llama style, their mixtures of experts);
# other models (file, hf:) fall back on the profile's accounting of what autograd keeps.
_FORMULA_FAMILIES = ("gpt", "llama", "moe")


# Guo et al. 2024, "GMLake: Efficient and Transparent GPU Memory Defragmentation for Large-scale
# DNN Training with Virtual Memory Stitching" (ASPLOS 2024, arXiv:2401.08156): PyTorch's caching
# allocator leaves 15% of what it reserves fragmented on average (up to 33%) over eight LLMs
# trained on A100 80GB with the memory-reduction techniques it studies (recomputation, offloading,
# LoRA), which "introduce frequent and irregular memory (de)allocation requests". Without them the
# pattern is regular: its strategy figures (github.com/intelligent-machine-learning/glake,
# GMLake/README.md, "Scalability on Memory-efficient Strategy", DeepSpeed ZeRO-3 on four A100 80GB)
# read a PyTorch utilisation (peak active / peak reserved) of about 0.93, 0.97 and 0.96 for
# OPT-1.3B, Vicuna-13B and GPT-NeoX-20B under "N" (no strategy), 5% fragmented on average, against
# 0.67, 0.84 and 0.96 under "R" (recomputation alone) and 0.64-0.80 under its combinations. The
# engines' published memory figures are what the allocator reserved (torchtitan logs
# `max_reserved`), and a job runs out of memory when reserving fails.
ALLOCATOR_FRAGMENTATION = 0.15
ALLOCATOR_FRAGMENTATION_PLAIN = 0.05


def allocator_reserve_fraction(engine: str, rebuilt_share: float = 1.0) -> float:
    """The share of the memory allocated and freed during a step (activations, transient buffers)
    that the caching allocator holds fragmented beside it under `engine`; none for meshplan's
    executor, planned against its profile's reserve alone. Model states are allocated once, before
    the first step (Megatron-LM's contiguous parameter and gradient buffers, FSDP2's and DeepSpeed's
    flat shards), and do not fragment.

    GMLake's no-strategy figure (5%) where nothing is rebuilt, its average (15%) where a layer's
    whole saved activations are dropped and rebuilt in backward (whole-block checkpointing, its
    "R", alone or with offloading and LoRA); a recomputation that rebuilds `rebuilt_share` of the
    layer's activations (selective: the attention core; Megatron-Core's recompute modules) is
    priced in proportion between the two. The proportion keeps the reserved bytes of a layer
    falling as it rebuilds more: kept x (1 - d) / (1 - f(d)) decreases in d for f(d) = 0.05 +
    0.10 d, so a recomputation never reserves more than none. (GMLake measures offloading only
    beside recomputation, so offloading alone keeps the plain figure.)"""
    if engine in EXECUTOR_MEMORY_ENGINES:
        return 0.0
    share = min(1.0, max(0.0, rebuilt_share))
    return ALLOCATOR_FRAGMENTATION_PLAIN + (ALLOCATOR_FRAGMENTATION - ALLOCATOR_FRAGMENTATION_PLAIN) * share


def transient_scale(engine: str, rebuilt_share: float = 1.0) -> float:
    """Reserved bytes per byte of activations and transient buffers: 1 / (1 - the fragmentation)."""
    return 1.0 / (1.0 - allocator_reserve_fraction(engine, rebuilt_share))


def layer_transient_scale(config: ParallelConfig, kept_bytes: float, plain_bytes: float) -> float:
    """`transient_scale` of one layer's bytes under `config` (`layer_cost.LayerCost.reserve_scale`):
    the share its recomputation rebuilds, from what the layer keeps with it (`kept_bytes`) and
    without it (`plain_bytes`: `engine_layer_memory` under `without_recompute(config)`). The ILP's
    tables and the simulator both scale each layer's activations and buffers by it."""
    rebuilt = 1.0 - kept_bytes / plain_bytes if plain_bytes > 0 else 0.0
    return transient_scale(config.engine, rebuilt)


@lru_cache(maxsize=1024)
def without_recompute(config: ParallelConfig) -> ParallelConfig:
    """`config` with no recomputation (whole layers, selective or Megatron-Core's modules)."""
    return replace(config, recompute="none", recompute_modules=())


class EngineMemory(NamedTuple):
    """One layer's bytes on one rank (see `LayerCost` for the meaning of each)."""

    param_bytes: float
    grad_bytes: float
    optimizer_bytes: float
    activation_bytes: float
    buffer_bytes: float
    expert_state_bytes: float = 0.0  # of params + grads + optimizer: the routed experts'


def keeps_stage_outputs(engine: str) -> bool:
    """Whether a pipeline stage keeps each in-flight micro-batch's output until its backward.
    torch's `PipelineStage` (meshplan, torchtitan) and DeepSpeed's `PipelineEngine`
    (`pipe_buffers["outputs"]`) do; Megatron-LM frees the sent output's storage
    (`deallocate_output_tensor`, `--deallocate-pipeline-outputs` on by default in Megatron-Core's
    schedules), the next stage's input being its copy."""
    return engine != "megatron"


def engine_state_bytes(engine: str, num_params: float, ranks: int, zero: int, precision: str,
                       pp: int = 1, grad_reduce_in_bf16: bool = False) -> dict[str, float]:
    """params / grads / optimizer bytes of `num_params` parameters on one rank, ZeRO over `ranks`.

    - megatron: bf16 parameters, fp32 gradient buffer (`main_grad`: bf16 training accumulates
      and reduces in fp32), fp32 master weights and two Adam moments: 2 + 4 + 12, the 12 sharded
      by the distributed optimizer (zero >= 1): "18 / 6 + 12/d" in Megatron-LM's
      docs/source/api-guide/dist_optimizer.md; Megatron FSDP (zero 2/3) also shards gradients,
      then parameters. `--grad-reduce-in-bf16` (`grad_reduce_in_bf16`; Megatron-Bridge's performance
      recipes set `ddp.grad_reduce_in_fp32 = False`) makes the gradient buffer bf16: 2 + 2 + 12. fp32: 4 + 4 + 8. fp8 keeps the bf16 layout plus Transformer Engine's
      cached fp8 weights, or under --fp8-param-gather fp8 weights in the bf16 ones' place
      (`engine_layer_memory`, `fp8.fp8_primary_weights`).
    - torchtitan: zero 0 is DDP (`data_parallel_replicate_degree`): fp32 parameters, gradients
      and moments, 4 + 4 + 8 (the bucket copy: `DDP_BUCKET_COPY_BYTES`). Otherwise FSDP2 with
      `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`: fp32 sharded parameters,
      gradients and moments, 16/d; without resharding after forward (zero 1/2, or any zero under
      pipelining: torchtitan's "default" reshard policy is False with PP) the bf16 unsharded
      parameters stay through backward (+2); under pipelining torch's stage defers the gradient
      reduce-scatter to the last micro-batch (`set_requires_gradient_sync(False)`), so the
      unsharded gradient accumulates in the fp32 reduce dtype (+4).
    - deepspeed: its own estimators (`estimate_zero2_model_states_mem_needs`,
      `estimate_zero3_model_states_mem_needs` in deepspeed/runtime/zero/): ZeRO-1/2 keep the
      bf16 parameters and gradients (2 + 2) and 16/d (fp32 master, moments and the fp32 gradient
      partition); ZeRO-3 18/d (the largest layer's gathered copy is a buffer); without ZeRO the
      paper's 2 + 2 + 12 (Rajbhandari et al. 2020). Its pipeline engine runs ZeRO-1 at most.
    - llm-foundry: FSDP with `mixed_precision: DEFAULT` (`foundry_memory.foundry_state_bytes`).
    """
    from meshplan.planner.costing.state_memory import DDP_BUCKET_COPY_BYTES, paper_state_bytes

    wide = precision == "fp32"
    if engine == "megatron":
        grad = grad_buffer_bytes(precision, grad_reduce_in_bf16)
        param, optimizer = (4.0, 8.0) if wide else (2.0, 12.0)
        return {"params": num_params * param / (ranks if zero >= 3 else 1),
                "grads": num_params * grad / (ranks if zero >= 2 else 1),
                "optimizer": num_params * optimizer / (ranks if zero >= 1 else 1)}
    if engine == "torchtitan":
        if zero == 0 or ranks == 1:
            bucket = DDP_BUCKET_COPY_BYTES if ranks > 1 else 0.0
            return {"params": 4.0 * num_params, "grads": (4.0 + bucket) * num_params, "optimizer": 8.0 * num_params}
        gathered = (4.0 if wide else 2.0) if (zero <= 2 or pp > 1) else 0.0
        accumulated = 4.0 if pp > 1 else 0.0
        return {"params": num_params * (4.0 / ranks + gathered), "grads": num_params * (4.0 / ranks + accumulated),
                "optimizer": num_params * 8.0 / ranks}
    if engine == foundry_memory.ENGINE:
        return foundry_memory.foundry_state_bytes(num_params, ranks, zero, precision)
    if engine == "deepspeed":
        # its pipeline engine runs ZeRO-1 at most (`PipelineEngine` refuses ZeRO-2/3)
        zero = min(zero, 1) if pp > 1 else zero
        if zero == 0 or ranks == 1:
            return paper_state_bytes(num_params, ranks, 0, precision)
        low = 4.0 if wide else 2.0
        if zero <= 2:
            return {"params": low * num_params, "grads": num_params * (low + 4.0 / ranks),
                    "optimizer": num_params * 12.0 / ranks}
        return {"params": low * num_params / ranks, "grads": 4.0 * num_params / ranks,
                "optimizer": num_params * 12.0 / ranks}
    raise ValueError(f"no memory recipe for engine {engine!r}")


def engine_layer_memory(layer: LayerProfile, config: ParallelConfig, info: ModelInfo, *, act_scale: float,
                        profile_dtype: str, attention: str, holds_shared: bool) -> EngineMemory:
    """The layer's memory on one rank under `config.engine` (not "meshplan"), its routed experts
    and context parallelism included."""
    engine = config.engine
    dense_params, expert_params = rank_params(layer, info, config.tp, config.ep, config.expert_tp, holds_shared)
    ranks = config.shard_degree if config.shard_group else config.data_ranks
    states = engine_state_bytes(engine, dense_params, ranks, config.zero, config.precision, config.pp,
                                config.grad_reduce_in_bf16)
    if engine == "megatron" and config.precision == "fp8" and layer.kind == "block":
        # Transformer Engine keeps each Linear's fp8 weight row- and column-wise on Hopper across
        # micro-batches (`is_first_microbatch`): 2 bytes per parameter, every module at once; beside
        # the bf16 weight, or in its place under --fp8-param-gather (fp8 primary weights)
        if not fp8_primary_weights(config):
            states["params"] += 2.0 * (dense_params + expert_params)
    if engine == "torchtitan" and layer.kind in ("embedding", "head") and config.zero == 3 and config.pp == 1 \
            and ranks > 1:
        # the root FSDP unit (embedding, final norm, output: `fully_shard(model)`) is not resharded
        # after forward (FSDP2 keeps the root gathered for the backward that follows)
        states["params"] += dense_params * (4.0 if config.precision == "fp32" else 2.0)
    expert_states = 0.0
    if expert_params:
        experts = engine_state_bytes(engine, expert_params, config.expert_data_ranks, config.zero,
                                     config.precision, config.pp, config.grad_reduce_in_bf16)
        states = {key: states[key] + experts[key] for key in states}
        expert_states = sum(experts.values())
    saved, working = _activations(layer, config, info, act_scale, profile_dtype, attention)
    # a layer's gathered parameters are live while its recomputation and backward run
    buffer = working + _gather_buffer(engine, layer, config, dense_params + expert_params)
    return EngineMemory(states["params"], states["grads"], states["optimizer"], saved, buffer, expert_states)


def _gather_buffer(engine: str, layer: LayerProfile, config: ParallelConfig, params: float) -> float:
    """Transient bytes of the engine's parameter gathers and gradient reductions for this layer.

    - megatron: Megatron FSDP (zero 3) gathers a layer's bf16 parameters (2).
    - torchtitan FSDP2 resharding after forward: the unit's bf16 parameters and the next unit's,
      prefetched (`FSDPParamGroup` forward prefetch): 2 x 2; in backward a unit's bf16 gradient
      next to its fp32 reduce-scatter input (2 + 4). The root unit (embedding, head) stays
      gathered: counted with the parameters.
    - deepspeed ZeRO-3: its estimator's largest layer, 4 bytes per parameter (`largest_layer_memory`).
    - llm-foundry: `foundry_memory.foundry_gather_bytes` (two units gathered, or a unit's gradient
      beside its fp32 reduce-scatter copy).
    """
    data_ranks, zero = config.data_ranks, config.zero
    compute = 4.0 if config.precision == "fp32" else 2.0
    out = 0.0
    if engine == "megatron" and zero == 3 and data_ranks > 1:
        out = compute * params
    elif engine == "torchtitan" and zero >= 1 and data_ranks > 1 and layer.kind not in ("embedding", "head"):
        if zero == 3 and config.pp == 1:
            out = 2 * compute * params
        if config.pp == 1:
            out = max(out, (compute + 4.0) * params)
    elif engine == "deepspeed" and zero == 3 and data_ranks > 1:
        out = 4.0 * params
    elif engine == foundry_memory.ENGINE:
        out = foundry_memory.foundry_gather_bytes(layer, config, params)
    return out


def _activations(layer: LayerProfile, config: ParallelConfig, info: ModelInfo, act_scale: float,
                 profile_dtype: str, attention: str) -> tuple[float, float]:
    """(bytes saved for backward per micro-batch, transient working set) of the layer on one rank."""
    engine = config.engine
    if engine == "deepspeed" or not formulas_describe(info, engine) or layer.kind not in ("embedding", "block", "head"):
        # the profile's accounting; a MoE block's routed experts apart, on the busiest rank
        dense = dense_part(layer) if layer.expert_params else layer
        saved, working = activation_bytes(dense, config, act_scale * vocab_scale(layer, config.tp, info))
        if layer.expert_params:
            saved, working = _with_routed_experts(saved, working, layer, config, info, act_scale)
        return saved, working
    stream = layer.output_bytes if layer.kind == "embedding" else layer.input_bytes
    seq = stream / (info.hidden * DTYPE_BYTES.get(profile_dtype, 2))  # tokens per sample
    tokens = seq * config.rank_microbatch
    per_token = _block_per_token if layer.kind == "block" else _head_per_token if layer.kind == "head" \
        else _embedding_per_token
    if engine == foundry_memory.ENGINE:
        saved, working = foundry_memory.foundry_per_token(layer, config, info)
    else:
        saved, working = per_token(layer, config, info, attention, seq)
    saved, working = saved * tokens, working * tokens
    if layer.expert_params and engine != "megatron":  # Megatron's terms hold its routed experts
        saved, working = _with_routed_experts(saved, working, layer, config, info, act_scale)
    return saved, working


def formulas_describe(info: ModelInfo, engine: str) -> bool:
    """Whether the formulas describe the model's blocks under `engine`: the GPT, Llama and MoE
    families; under megatron also a traced mixture of experts whose widths the config names
    (GPT-OSS, DeepSeek-V2/V3 with multi-head latent attention) or a hybrid with Mamba-2 mixers
    (Nemotron-H): Megatron-Core runs it as its own GPT or Mamba model, with its own modules and
    fused kernels, not the traced transformers ones (whose eager experts keep several more
    tensors per routed copy, and whose Mamba-2 torch path several more per token)."""
    if not (info.hidden and info.num_heads):
        return False
    if engine == foundry_memory.ENGINE:  # its MPT-style dense blocks (MoE blocks: the profile's accounting)
        return info.family in ("gpt", "llama")
    traced_moe = info.family == "hf" and bool(info.num_experts and info.expert_ffn)
    hybrid = bool(info.mamba_heads)  # Megatron-Core's hybrid Mamba model (`megatron_activations.mamba2_terms`)
    return info.family in _FORMULA_FAMILIES or (engine == "megatron" and (bool(info.kv_lora_rank) or traced_moe
                                                                           or hybrid))


def _with_routed_experts(saved: float, working: float, layer: LayerProfile, config: ParallelConfig,
                         info: ModelInfo, act_scale: float) -> tuple[float, float]:
    """Plus the routed experts' saved bytes on the busiest rank (the profile's, which counts the
    dispatched tokens' Linear inputs and outputs), rebuilt instead under full recomputation and
    under torchtitan's per-op policy (its grouped GEMMs are not on the list, `torchtitan_sac`)."""
    shard = config.tp if is_split(layer, config.tp) else 1
    experts = layer.expert_act_bytes * config.rank_microbatch * act_scale / shard * load_factor(info)
    if config.recompute == "full" or torchtitan_sac.applies(config):
        return saved, working + experts
    return saved + experts, working


def _shape(info: ModelInfo) -> tuple[int, int, int, int]:
    """(hidden, hq, hkv, heads) of the model's attention."""
    head_dim = info.attention_head_dim
    return info.hidden, info.num_heads * head_dim, (info.num_kv_heads or info.num_heads) * head_dim, info.num_heads


def _mlp_width(layer: LayerProfile, info: ModelInfo) -> tuple[float, bool]:
    """(f, gated) of the layer's dense MLP: a MoE block's shared experts (its routed experts are
    counted apart), else the model's FFN; Llama-style MLPs are gated (SwiGLU)."""
    gated = megatron_activations.is_gated(layer, info)
    if layer.expert_params:
        return float(info.shared_experts_width), gated
    return float(info.mlp_width), gated


def _block_per_token(layer: LayerProfile, config: ParallelConfig, info: ModelInfo, attention: str,
                     seq: float) -> tuple[float, float]:
    """(saved, working) bytes per token of one transformer block (module docstring)."""
    if config.engine == "megatron":
        return megatron_activations.block_per_token(layer, config, info, attention, seq)
    recompute = config.recompute
    t = config.tp if is_split(layer, config.tp) else 1
    b = DTYPE_BYTES[COMPUTE_DTYPE[config.precision]]
    h, hq, hkv, heads = _shape(info)
    f, gated = _mlp_width(layer, info)
    router = 4.0 * info.num_experts if layer.expert_params else 0.0  # fp32 router logits, replicated
    # torchtitan: norms sequence-sharded, their outputs gathered whole for the column Linears, which keep
    # them so (`GATHERED_INPUT_ENGINES`: the rule by which its backward gathers nothing again)
    gathered = 2 * b * h if t > 1 and config.engine in GATHERED_INPUT_ENGINES else 0.0
    norms = 2 * b * h / t + (0.0 if t > 1 else 2 * b * h) + router
    attention_bytes = (5 * b * hq + 4.0 * heads) / t
    mlp = (4 if gated else 2) * b * f / t  # w1, w3 outputs, silu output, w2 input (GELU: fc1 output, fc2 input)
    full = norms + gathered + attention_bytes + mlp
    if recompute == "full":
        return b * h / t, full
    if recompute == "selective":  # op SAC: the input, attention's output and the saved Linears' outputs
        saved = torchtitan_sac.saved_linear_shapes(gemm.block_linear_shapes(layer, info, seq))
        outputs = sum(out / t if column else out for _, out, column in saved)  # a row Linear's: its partial sum
        kept = b * h / t + (b * hq + 4.0 * heads) / t + b * outputs
        return kept, max(0.0, full - kept)
    return full, 0.0


def _head_per_token(layer: LayerProfile, config: ParallelConfig, info: ModelInfo, attention: str,
                    seq: float) -> tuple[float, float]:
    """(saved, working) bytes per token of the final norm, output layer and loss.

    megatron: the norm's input and the output layer's (sequence-sharded under SP,
    `linear_with_grad_accumulation_and_async_allreduce` gathers again in backward) and the fp32
    softmax `vocab_parallel_cross_entropy` saves (`exp_logits`; its fused variant,
    `--cross-entropy-loss-fusion`, alike); the bf16 logits live until cast. Transformer Engine's
    loss (`cross_entropy_fusion` "te") writes the gradient into the logits in place and saves them
    (transformer_engine/pytorch/cross_entropy.py, `CrossEntropyFunction`), its backward scaling
    them in place: bV kept, nothing beside it.
    torchtitan: the norm's input, the gathered output-layer input under TP, then the loss
    (`cross_entropy(pred.float())`, vocab-sharded by `loss_parallel` under TP). Eager
    (`engine_rules.compiles_loss` false: torchtitan before April 2025, or `[compile] components`
    without "loss"): log_softmax's fp32 output is saved, `del pred` before backward frees the bf16
    logits, and beside the saved output the backward holds fp32 copies of the logits
    (`loss_kernels.ce_backward_fp32_copies`: nll_loss's gradient and log_softmax's, 8V; under
    `loss_parallel` its fused backward's one-hot mask, exp and sum, 12V). Compiled (torchtitan 0.2's
    default with the model): Inductor's partitioner saves the logits in the compute dtype (bV) and two
    fp32 values per token (the max and the log-sum-exp) and recomputes the log-probs; the forward
    and the backward fuse into reductions and one pointwise kernel whose one output is the logits'
    gradient (bV): tests/planner/costing/test_loss_kernels.py reads both graphs. Both per logit:
    `loss_kernels.torch_ce_held_bytes_per_logit` of `torch_ce_kind`."""
    split = is_split(layer, config.tp)
    t = config.tp if split else 1
    sp_t = t if config.sp else 1
    b = DTYPE_BYTES[COMPUTE_DTYPE[config.precision]]
    vocab = (info.padded_vocab or info.vocab) * vocab_scale(layer, config.tp, info) / t
    if config.engine == "megatron":
        if config.cross_entropy_fusion == "te":
            return 2 * b * info.hidden / sp_t + b * vocab, 0.0
        return 2 * b * info.hidden / sp_t + 4.0 * vocab, b * vocab
    gathered = b * info.hidden if t > 1 else 0.0
    kind = torch_ce_kind(layer, config)
    kept, working = torch_ce_held_bytes_per_logit(kind, compute_bytes=b)
    stats = 2 * 4.0 if kind == "compiled" else 0.0  # the compiled loss's max and log-sum-exp per token
    return 2 * b * info.hidden / t + gathered + kept * vocab + stats, working * vocab


def _embedding_per_token(layer: LayerProfile, config: ParallelConfig, info: ModelInfo, attention: str,
                         seq: float) -> tuple[float, float]:
    """(saved, working) bytes per token of the embedding: a lookup saves only its indices; GPT's
    embedding dropout keeps a 1-byte mask (Korthikanti's sbhp/t term, /t under SP)."""
    if config.engine == "megatron" and info.family in megatron_activations.DROPOUT_FAMILIES:
        sp_t = config.tp if config.sp and is_split(layer, config.tp) else 1
        return info.hidden / sp_t, 0.0
    return 0.0, 0.0

