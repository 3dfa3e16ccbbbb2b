"""Rules of what one engine runs, each a function that says why not (or None), for `ParallelConfig`,
the estimator and the search to ask alike (re-exported by `contracts.config`)."""
from __future__ import annotations

# Engines that train a mixture of experts under TP only with SP (Megatron-LM's arguments.py asserts it;
# Megatron-Core's TransformerConfig refuses ep > 1 with tp > 1 without it).
MOE_SP_ENGINES = ("megatron",)
# Engines whose tensor parallelism always shards the sequence around the norms (torchtitan's TP plans:
# SequenceParallel on the norms, the embedding's output Shard(1); no option turns it off).
TP_SP_ENGINES = ("torchtitan",)
# Engines whose column-parallel Linears keep their sequence-parallel input all-gathered whole for the
# weight gradients: DTensor's ColwiseParallel matmul saves the tensor its input redistribution (or torch's
# fused all-gather matmul under async TP) gathered, so a block without recomputation gathers nothing again
# in backward (torchtitan's TP plans; its memory rule keeps that input, `costing.engine_memory`).
# Megatron-LM keeps the sequence shard and all-gathers it again beside the input-gradient GEMM
# (`LinearWithGradAccumulationAndAsyncCommunication.backward`), and so does meshplan's executor.
GATHERED_INPUT_ENGINES = ("torchtitan",)
# Engines whose column Linears keep the sequence shard and gather it again for the weight gradients in
# every backward, a recomputed block's too: Transformer Engine's Linears save the shard whenever SP is on
# (`ln_out_needs_gather`), in a recomputation's rerun forward as in the first, and so do Megatron-Core's own
# (`LinearWithGradAccumulationAndAsyncCommunication`). Elsewhere a recomputed block gathers its input in the
# rerun and keeps it.
SHARD_REGATHER_ENGINES = ("megatron",)
# Engines with an expert all-to-all overlap schedule (Megatron-Core's combined 1F1B).
A2A_OVERLAP_ENGINES = ("megatron",)
# Megatron-Core's cross-entropy kernels (`ParallelConfig.cross_entropy_fusion`): "none", its unfused
# vocab-parallel loss (Megatron-LM's default); "native", --cross-entropy-loss-fusion; "te", that
# flag with --cross-entropy-fusion-impl te (Transformer Engine's parallel cross-entropy).
CE_FUSIONS = ("none", "native", "te")
# Engines whose loss kernels meshplan counts (`costing.loss_kernels`), and so the only ones that take a fusion.
CE_FUSION_ENGINES = ("megatron",)
# Engines whose full recomputation is torch.utils.checkpoint's non-reentrant variant, which since
# torch 2.1 stops rerunning a checkpointed block once it has rebuilt every tensor the block's
# backward needs (early stop, on by default; `torch.utils.checkpoint.set_checkpoint_early_stop`
# turns it off): the last tensor a dense block saves is its MLP's down-projection input, packed
# before that GEMM runs, so the down projection and the residual add after it are not rerun
# (`costing.compute_time.early_stop_skipped_s`). meshplan's executor (`executor.parallel.recompute`:
# use_reentrant=False), torchtitan (`ptd_checkpoint_wrapper`, CheckpointImpl.NO_REENTRANT) and
# llm-foundry (Composer's FSDP checkpoint wrapper; its yamls set activation_checkpointing_reentrant
# false, and it has required torch 2.1 or later since January 2024) run it by default.
EARLY_STOP_RECOMPUTE_ENGINES = ("meshplan", "torchtitan", "llm-foundry")
# Engines whose checkpoint function reruns the whole forward whatever torch does: Megatron-Core's
# `tensor_parallel.checkpoint` and DeepSpeed's activation checkpointing are reentrant autograd
# functions, so an early stop cannot be asked of them (`ParallelConfig.recompute_early_stop`).
FULL_RERUN_RECOMPUTE_ENGINES = ("megatron", "deepspeed")
# Engines whose tensor parallelism splits the embedding and the output layer over the vocabulary
# whatever model they train: Megatron-Core builds every GPT model (a Hugging Face one through
# Megatron-Bridge's conversion too) with a VocabParallelEmbedding and a ColumnParallelLinear output
# layer; torchtitan's parallelize functions shard tok_embeddings row-wise and output column-wise.
# meshplan's executor keeps a Hugging Face model's embedding and head whole on every rank
# (`executor.parallel.hf`), so under it those layers stay replicated (`costing.tp_split.as_engine_splits`).
VOCAB_PARALLEL_ENGINES = ("megatron", "torchtitan")
# Engines a configuration can ask to compile the model with torch.compile (`ParallelConfig.torch_compile`):
# torchtitan's `training.compile` (0.2; `[compile] enable` later). What it prices: torchao's Float8 casts
# fused with the ops before them (`costing.fp8.cast_times_s`), and a Llama block's elementwise kernels by
# the fused rule, not counted op by op as eagerly (`costing.eager_kernels`).
# The engines whose own TP code splits any model's sequence between the TP regions (Megatron-Core's
# --sequence-parallel, torchtitan's SequenceParallel norms), a Hugging Face one too: the search offers
# SP for such a model under them, where meshplan's executor keeps its norms and residual whole.
SEQUENCE_SPLIT_ENGINES = ("megatron", "torchtitan")
COMPILE_ENGINES = ("torchtitan",)
# Engines whose weight-gradient GEMMs accumulate into the gradient buffer in place: Megatron-Core's
# `gradient_accumulation_fusion` (on unless --no-gradient-accumulation-fusion) hands each Linear's
# `main_grad` to the GEMM as its output with beta = 1 (`wgrad_gemm_accum_fp32` / `_fp16` in
# `LinearWithGradAccumulationAndAsyncCommunication.backward`; Transformer Engine's Linear and
# GroupedLinear under `fuse_wgrad_accumulation`, Megatron-FSDP's `_wgrad_gemm`), so every micro-batch's
# weight-gradient GEMM reads and writes the buffer in its dtype (`grad_buffer_bytes`). Elsewhere autograd
# writes the weight gradient once as a new tensor in the compute dtype.
WGRAD_ACCUMULATING_ENGINES = ("megatron",)


def early_stop_default(engine: str) -> bool:
    """Whether `engine`'s full recomputation stops early unless told otherwise."""
    return engine in EARLY_STOP_RECOMPUTE_ENGINES


def early_stop_of(config) -> bool:
    """Whether `config`'s full recomputation stops early: its `recompute_early_stop`, or where it
    leaves that to the engine, the engine's rule. The one rule the cost model and the executor read."""
    chosen = config.recompute_early_stop
    return early_stop_default(config.engine) if chosen is None else chosen


def early_stop_under(engine: str, early_stop: bool | None) -> bool | None:
    """The early stop a configuration keeps when it runs under `engine`: its own where the engine can
    run it (`early_stop_problem`), the engine's (None) otherwise."""
    return None if early_stop_problem(engine, early_stop) else early_stop


def stored_early_stop(engine: str, early_stop: bool | None) -> bool | None:
    """What `ParallelConfig.recompute_early_stop` keeps of `early_stop` under `engine`: None where the
    engine's rule says the same (equal layouts compare equal); ValueError where it cannot run."""
    if problem := early_stop_problem(engine, early_stop):
        raise ValueError(problem)
    return None if early_stop == early_stop_default(engine) else early_stop


def early_stop_problem(engine: str, early_stop: bool | None) -> str | None:
    """Why full recomputation cannot run with torch's early stop set to `early_stop` under `engine`, or
    None (None: the engine's default)."""
    if early_stop is not None and not isinstance(early_stop, bool):
        return f"recompute_early_stop must be true, false or null (the engine's default), got {early_stop!r}"
    if early_stop and engine in FULL_RERUN_RECOMPUTE_ENGINES:
        return (f"{engine}'s checkpoint function is reentrant and reruns the whole forward: torch's early stop "
                f"needs an engine on torch.utils.checkpoint's non-reentrant variant "
                f"({', '.join(EARLY_STOP_RECOMPUTE_ENGINES)}, or generic)")
    return None


def bf16_grads_problem(engine: str, precision: str) -> str | None:
    """Why Megatron-LM's bf16 gradient buffer (`grad_reduce_in_bf16`) cannot be asked for here, or None."""
    if engine != "megatron" or precision == "fp32":
        return (f"grad_reduce_in_bf16 keeps Megatron-LM's gradient buffer in bf16: use engine megatron with "
                f"precision bf16-mixed or fp8 (got engine {engine!r}, precision {precision!r})")
    return None


def ce_fusion_under(engine: str, fusion: str) -> str:
    """The loss kernels a configuration keeps when it runs under `engine`: its own where the engine's
    loss code is counted (`CE_FUSION_ENGINES`), the unpriced "none" elsewhere."""
    return fusion if engine in CE_FUSION_ENGINES else "none"


def ce_fusion_problem(engine: str, fusion: str) -> str | None:
    """Why the loss cannot run as `fusion` (`cross_entropy_fusion`) under `engine`, or None."""
    if fusion not in CE_FUSIONS:
        return f"cross_entropy_fusion must be one of {', '.join(CE_FUSIONS)}, got {fusion!r}"
    if fusion != "none" and engine not in CE_FUSION_ENGINES:
        return (f"cross_entropy_fusion {fusion} is Megatron-LM's --cross-entropy-loss-fusion: use engine megatron "
                f"(got engine {engine!r})")
    return None


def moe_sp_problem(engine: str, tp: int, sp: bool, moe: bool) -> str | None:
    """Why `engine` cannot train this mixture of experts (`moe`) at tp without SP, or None."""
    if engine in MOE_SP_ENGINES and moe and tp > 1 and not sp:
        return (f"{engine} trains a mixture of experts under tensor parallelism only with sequence parallelism "
                f"(Megatron-LM refuses tp={tp} without it): add --sp (Megatron-LM's --sequence-parallel)")
    return None


def tp_sp_problem(engine: str, tp: int, sp: bool) -> str | None:
    """Why `engine` cannot run tp without SP, or None."""
    if engine in TP_SP_ENGINES and tp > 1 and not sp:
        return (f"{engine}'s tensor parallelism always shards the sequence around the norms (its TP plan's "
                f"SequenceParallel), so tp={tp} without sequence parallelism is not what it runs: add --sp")
    return None


def a2a_overlap_engine_problem(engine: str) -> str | None:
    """Why `engine` cannot run the combined 1F1B (--moe-a2a-overlap), or None."""
    if engine not in A2A_OVERLAP_ENGINES:
        return (f"{engine} has no combined 1F1B schedule: the expert all-to-all overlap (--moe-a2a-overlap) is "
                "Megatron-LM's --overlap-moe-expert-parallel-comm; use --engine megatron")
    return None


def runs_compiled(config) -> bool:
    """Whether the model runs under torch.compile: the configuration's `torch_compile`, or
    torchtitan's async TP, which its parallelize refuses without it ("Async TP requires
    --training.compile"; the export writes `[compile] enable` with it)."""
    return bool(config.torch_compile) or (config.engine == "torchtitan" and bool(config.tp_comm_overlap))


def could_compile(config) -> bool:
    """Whether the configuration runs uncompiled under an engine that compiles (`COMPILE_ENGINES`):
    where `estimate` and `plan` say what torch.compile would take off the step."""
    return config.engine in COMPILE_ENGINES and not runs_compiled(config)


def compiles_loss(config) -> bool:
    """Whether the loss runs under torch.compile: the configuration's `compile_loss`, or, unset, with
    the model (torchtitan 0.2's `[compile] components` default, ["model", "loss"]: `runs_compiled`).
    torchtitan compiled only the model's blocks before April 2025 (its loss compile was commented out:
    "compiling loss function causes CUDA errors"), so its published runs of that time say false."""
    return runs_compiled(config) if config.compile_loss is None else config.compile_loss


def stored_compile_loss(config) -> bool | None:
    """What `ParallelConfig.compile_loss` keeps of `config.compile_loss`: None where compiling the loss
    with the model (`runs_compiled`) says the same (equal layouts compare equal); ValueError where it
    cannot run (`compile_loss_problem`)."""
    if problem := compile_loss_problem(config.engine, config.compile_loss):
        raise ValueError(problem)
    # an engine that does not compile runs nothing compiled: false is its default, true is refused above
    return None if config.compile_loss == runs_compiled(config) else config.compile_loss


def compile_loss_problem(engine: str, compile_loss: bool | None) -> str | None:
    """Why a configuration under `engine` cannot set the loss's compilation to `compile_loss`, or None."""
    if compile_loss is not None and not isinstance(compile_loss, bool):
        return f"compile_loss must be true, false or null (with the model), got {compile_loss!r}"
    if compile_loss and engine not in COMPILE_ENGINES:
        return (f"torch.compile of the loss (--compile-loss on) is torchtitan's [compile] components; under engine "
                f"{engine} meshplan does not price it: use --engine {' or '.join(COMPILE_ENGINES)}, or leave "
                "--compile-loss out")
    return None


def compile_problem(engine: str, torch_compile: bool) -> str | None:
    """Why a configuration under `engine` cannot ask for torch.compile, or None."""
    if not isinstance(torch_compile, bool):
        return f"torch_compile must be true or false, got {torch_compile!r}"
    if torch_compile and engine not in COMPILE_ENGINES:
        return (f"torch.compile (--compile) is torchtitan's training.compile; under engine {engine} meshplan "
                f"does not price it: use --engine {' or '.join(COMPILE_ENGINES)}, or leave --compile out")
    return None


def grad_buffer_bytes(precision: str, grad_reduce_in_bf16: bool) -> float:
    """Bytes per element of Megatron-Core's gradient buffer (`main_grad`): fp32, because Megatron-LM
    accumulates and reduces bf16 training's gradients in fp32 (arguments.py sets
    accumulate_allreduce_grads_in_fp32 for fp32 main grads), unless `--grad-reduce-in-bf16` makes it the
    parameters' bf16 (`grad_reduce_in_bf16`); fp32 training keeps fp32."""
    return 2.0 if grad_reduce_in_bf16 and precision != "fp32" else 4.0


def wgrad_accumulator_bytes(config) -> float:
    """Bytes per element of the buffer a weight-gradient GEMM reads and writes under `config`'s engine
    (`WGRAD_ACCUMULATING_ENGINES`: the gradient buffer, `grad_buffer_bytes`); 0 where the GEMM writes a
    new gradient once in its output dtype."""
    if config is None or config.engine not in WGRAD_ACCUMULATING_ENGINES:
        return 0.0
    return grad_buffer_bytes(config.precision, config.grad_reduce_in_bf16)
