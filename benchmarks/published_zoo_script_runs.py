"""Held-out mixture-of-experts runs from the Megatron-MoE-ModelZoo's best-practice scripts
(`published_runs.HELD_OUT_MOE`): the TFLOP/s figures their comments publish beside the command that
ran them, on H100.

Every H100 figure of those scripts at the cited commit is taken unless it cannot be priced, and then
the reason is kept here:
- best_practice/qwen3/run_h100_235b.sh: "H100 config, 320 TFLOPS", Qwen3-235B-A22B on 256 GPUs.
- best_practice/mixtral/run_mixtral_8x22B.sh: Mixtral 8x22B on 128 GPUs under the layout
  runtime_configs/benchmarking/runtime.conf gives it (TP 2, PP 8, VP 7, EP 8, MBS 1, GBS 256, 4096
  tokens, the alltoall dispatcher): dropless with forced balancing, "around 465 TFLOPS", and token
  dropping at capacity factor 1 with the experts' inputs padded to it, "around 470TFLOPS". Left
  out: its dropless run without forced balancing ("around 445TFLOPS": the routing imbalance it ran
  is unpublished) and its FP8 run ("around 560 TFLOPS": `PR=fp8` is Transformer Engine's blockwise
  recipe, `--fp8-recipe blockwise`, which meshplan has no recipe for).
The GB200 and GB300 scripts' figures are the qwen3 readme's rows, which `published_moe_runs` takes or
leaves with its reasons (the 128K-token MXFP8 row is printed under GB300 at commit 020b813 and under
GB200 at the commit below, so its hardware is not certain: left out).

Each figure is TFLOP/s per GPU in Megatron-LM's convention (its `num_floating_point_operations`:
causal attention, no recomputation; `Run.published_causal_tflops_per_gpu`), as the ModelZoo's readme
tables print it beside step times. The scripts' `sbatch_benchmarking.sh` passes `--tp-comm-overlap`
to every BF16 run since commit b09773a (2025-12-16), which both scripts postdate.
"""
from __future__ import annotations

from published_moe_runs import (CUDNN_ATTENTION, MEGATRON_MOE_ASSUMPTIONS, ZOO_LOSS, ZOO_SPLIT,
                                qwen3_235b_stage_blocks)
from published_runs import HELD_OUT_MOE, Run

ZOO_SCRIPTS = ("Megatron-MoE-ModelZoo {script}'s TFLOPS comment, with model_configs/benchmarking/{model}.yaml, "
               "runtime_configs/benchmarking/runtime.conf and sbatch_benchmarking.sh "
               "(github.com/yanring/Megatron-MoE-ModelZoo, commit e8650517d60d71ab73fc6b3b0388cac4ba435181)")
ZOO_QWEN3_H100_SCRIPT = ZOO_SCRIPTS.format(script="best_practice/qwen3/run_h100_235b.sh", model="Qwen3-235B-A22B")
ZOO_MIXTRAL_SCRIPT = ZOO_SCRIPTS.format(script="best_practice/mixtral/run_mixtral_8x22B.sh", model="Mixtral-8x22B")
ZOO_TP_OVERLAP = ("TP communication overlapped (sbatch_benchmarking.sh passes --tp-comm-overlap to BF16 runs: "
                  "Transformer Engine's userbuffers)")
CAUSAL_TFLOPS = "TFLOP/s in Megatron-LM's convention (causal attention, no recomputation)"
# Mixtral 8x22B as Mixtral-8x22B.yaml builds it: 56 blocks, hidden 6144, 48 heads over 8 KV groups,
# 8 SwiGLU experts of 16384, top 2, RMSNorm, RoPE, untied embeddings, the Llama 2 tokenizer's
# 32,000 tokens (a multiple of --make-vocab-size-divisible-by 128 times TP 2).
MIXTRAL_8X22B = ("moe:layers=56,hidden=6144,heads=48,kv_heads=8,experts=8,top_k=2,expert_ffn=16384,vocab=32000,"
                 "tied=false")


def zoo_script_runs() -> list[Run]:
    """The scripts' H100 figures (HELD_OUT_MOE)."""
    return [qwen3_235b_h100_script_run()] + mixtral_8x22b_runs()


def qwen3_235b_h100_script_run() -> Run:
    """run_h100_235b.sh: Qwen3-235B-A22B, TP 2, PP 8, VP 4, EP 32 (expert TP 1), MBS 1, GBS 2048, 32
    nodes, DeepEP, the combined 1F1B (A2A_OVERLAP=1), the norms and expert activations recomputed,
    forced balancing, Transformer Engine CUDA graphs of the router and the dispatch's preprocessing:
    320 TFLOP/s. The readme's table prints the same layout without the graphs and TP overlap at 276."""
    return Run("Megatron-MoE script Qwen3-235B tp2 pp8 vpp4 ep32 etp1 a2a-overlap", HELD_OUT_MOE,
               ZOO_QWEN3_H100_SCRIPT, "h100-sxm", "qwen3-235b-a22b", 256, 2048, 4096, tp=2, pp=8, vpp_options=(4,),
               sp=True, zero=1, ep=32, etp=1, recompute_modules=("layernorm", "moe_act"),
               published_causal_tflops_per_gpu=320.0, moe_dispatcher="deepep", engine="megatron", attention="cudnn",
               moe_a2a_overlap=True, stage_blocks=qwen3_235b_stage_blocks(32), tp_comm_overlap=True,
               cross_entropy_fusion="te",
               assumptions=MEGATRON_MOE_ASSUMPTIONS[:1] + MEGATRON_MOE_ASSUMPTIONS[2:] + (
                   CUDNN_ATTENTION, "forced balancing (--moe-router-force-load-balancing)",
                   "DeepEP's dispatch and combine (DISPATCHER=deepep), overlapped by Megatron-Core's combined 1F1B "
                   "(A2A_OVERLAP=1: --overlap-moe-expert-parallel-comm --delay-wgrad-compute)",
                   "the norms and the experts' activation functions recomputed (--recompute-modules moe_act "
                   "layernorm)", "distributed optimizer costed as ZeRO-1", ZOO_SPLIT, ZOO_TP_OVERLAP, ZOO_LOSS,
                   "CUDA graphs of the router and the dispatch's preprocessing (--cuda-graph-scope moe_router "
                   "moe_preprocess) not priced: meshplan prices no host launch time", CAUSAL_TFLOPS))


def mixtral_8x22b_runs() -> list[Run]:
    """run_mixtral_8x22B.sh's two priceable figures: forced balance, and token dropping padded to
    capacity (which fixes every expert's tokens whatever the routing)."""
    assumptions = (CUDNN_ATTENTION, "Megatron-Core's alltoall dispatcher (runtime.conf), not overlapped with compute",
                   "sequence parallelism on (the config's --sequence-parallel)", "no recomputation (none passed)",
                   "distributed optimizer costed as ZeRO-1", ZOO_TP_OVERLAP,
                   "Megatron-Core's native fused cross-entropy (the config's --cross-entropy-fusion-impl native)",
                   "the Llama 2 tokenizer's 32,000-token vocabulary (the config's --tokenizer-type Llama2Tokenizer)",
                   CAUSAL_TFLOPS)
    layout = dict(tp=2, pp=8, vpp_options=(7,), sp=True, zero=1, ep=8, etp=1, engine="megatron", attention="cudnn",
                  stage_blocks=(1,) * 56, tp_comm_overlap=True, cross_entropy_fusion="native")
    return [Run("Megatron-MoE script Mixtral-8x22B tp2 pp8 vpp7 ep8 balanced", HELD_OUT_MOE, ZOO_MIXTRAL_SCRIPT,
                "h100-sxm", MIXTRAL_8X22B, 128, 256, 4096, published_causal_tflops_per_gpu=465.0,
                assumptions=("forced balancing (--moe-router-force-load-balancing), no token dropping",) + assumptions,
                **layout),
            Run("Megatron-MoE script Mixtral-8x22B tp2 pp8 vpp7 ep8 token-drop", HELD_OUT_MOE, ZOO_MIXTRAL_SCRIPT,
                "h100-sxm", MIXTRAL_8X22B, 128, 256, 4096, published_causal_tflops_per_gpu=470.0,
                moe_capacity_factor=1.0, moe_pad_to_capacity=True,
                assumptions=("token dropping at capacity factor 1, every expert's input padded to it "
                             "(--moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity)",) + assumptions,
                **layout)]
