"""Held-out mixture-of-experts runs (`published_runs.HELD_OUT_MOE`): Megatron-MoE-ModelZoo's Qwen3
tables on 256 H100 and Megatron-Bridge 25.11's Qwen3 rows, each with its source and assumptions
(`published_runs`'s docstring lists what is used and what is left out, and why).

Split from `published_runs` (which defines `Run` and the sources), whose `all_runs` adds these.
"""
from __future__ import annotations

from pathlib import Path

from published_dgx_cloud_runs import GB200_UNVALIDATED, dgx_cloud_grok1_runs
from published_runs import (BRIDGE_BF16_GRADS, BRIDGE_TE_LOSS, HELD_OUT_MOE, MEGATRON_BRIDGE_BLACKWELL, MEGATRON_BRIDGE_H100,
                            MEGATRON_MOE_QWEN3, MEGATRON_MOE_QWEN3_GB200, Run, account_for_split)

# The engine's maintainers on two of the 25.11 MoE figures (NVIDIA-NeMo/Megatron-Bridge):
QWEN3_30B_DROPLESS_REGRESSION = (
    "issue #1998, '[Regression] Low QWEN3 30B B200 and H100 performance with dropless' (2026-01-20): "
    "'2X slower performance in QWEN3 30B on H100 and B200 with the dropless schedule compared to the "
    "token-drop schedule ... the perf in 25.11 is 2X slower than 25.09' (25.09's token-drop rows of the "
    "same layouts: 10494 tokens/s/GPU on H100, 18066 on B200)")
QWEN3_235B_B200_REGRESSION = (
    "issue #1705, 'Fix QWEN3 235B B200 MXFP8 performance regression', fixed by PR #1760 (2025-12-17): "
    "'MXFP8 step time improved from 20.1s to 16.9s ... Disable moe_a2a_overlap due to CPU overhead'")
# The recipes that set moe_a2a_overlap (Megatron-Bridge's name for --overlap-moe-expert-parallel-comm).
A2A_OVERLAPPED = ("Megatron-Core's alltoall dispatcher under the recipe's moe_a2a_overlap: the combined 1F1B "
                  "(--moe-a2a-overlap, `costing.moe_overlap`)")
MEGATRON_MOE_ASSUMPTIONS = (
    "balanced routing (--moe-imbalance 1), no token dropping",
    "Megatron-Core's alltoall dispatcher: meshplan's all-to-all over the EP group, not overlapped with compute",
    "sequence parallelism on (Megatron-LM requires it with TP and EP)",
)


# The Blackwell rows' "FP8-MX": Transformer Engine's MXFP8BlockScaling, meshplan's mxfp8 recipe.
MXFP8 = "FP8-MX: Transformer Engine's MXFP8 block scaling (32-value blocks, E8M0 scales; --fp8-recipe mxfp8)"


# Transformer Engine's attention backend choice (transformer_engine/pytorch/attention/
# dot_product_attention/utils.py, get_attention_backend): "Disabling FlashAttention to give
# FusedAttention preference on Hopper+ for performance reasons" (compute capability 9.0 and up).
CUDNN_ATTENTION = "cuDNN fused attention (Transformer Engine's choice on Hopper and Blackwell)"


# The ModelZoo's Qwen3-235B config (model_configs/benchmarking/Qwen3-235B-A22B.yaml) and Megatron-
# Bridge's Qwen3-235B recipe (src/megatron/bridge/recipes/qwen/qwen3_moe.py, qwen3_235b_a22b_pretrain_config)
# set --account-for-embedding-in-pipeline-split and --account-for-loss-in-pipeline-split
# (`published_runs.account_for_split`).
QWEN3_235B_BLOCKS = 94


def qwen3_235b_stage_blocks(chunks: int) -> tuple[int, ...]:
    """Blocks per virtual chunk of Qwen3-235B under its recipes' pipeline split over `chunks`."""
    return account_for_split(QWEN3_235B_BLOCKS, chunks)


ZOO_SPLIT = ("the embedding and the loss counted as a layer each in the pipeline split (the config's "
             "--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split)")
BRIDGE_235B_SPLIT = ("the embedding and the loss counted as a layer each in the pipeline split (the recipe's "
                     "account_for_embedding_in_pipeline_split and account_for_loss_in_pipeline_split)")
# Neither the config nor sbatch_benchmarking.sh passes --tp-comm-overlap, which Megatron-LM leaves off.
ZOO_TP = "TP communication not overlapped (the ModelZoo's scripts pass no --tp-comm-overlap; Megatron-LM's default)"
# The config's --cross-entropy-loss-fusion with --cross-entropy-fusion-impl te.
ZOO_LOSS = "Transformer Engine's fused cross-entropy (the config's --cross-entropy-fusion-impl te)"


def moe_runs() -> list[Run]:
    """Published mixture-of-experts runs on H100 whose whole layout is in text (HELD_OUT_MOE)."""
    # Expert TP 1 (MoE parallel folding) keeps each EP group of 8 inside one node.
    qwen = MEGATRON_MOE_ASSUMPTIONS + (CUDNN_ATTENTION,)
    # The table's Dispatcher column: DeepEP for every row but the PP 32 one (A2A); the model config
    # (model_configs/benchmarking/Qwen3-235B-A22B.yaml) runs --moe-token-dispatcher-type flex
    # --moe-enable-deepep unless a row overrides it.
    deepep = ("DeepEP's dispatch and combine (the table's Dispatcher column; --moe-dispatcher deepep), not "
              "overlapped with compute",)
    norm_act = ("the norms and the experts' activation functions recomputed (Megatron-Core's --recompute-modules "
                "layernorm moe_act)",)
    runs = [
        # Intra-node EP: TP 2, EP 8, DP 128 with Megatron FSDP, MBS 4, GA 4, full recomputation.
        Run("Megatron-MoE Qwen3-235B tp2 ep8 fsdp full", HELD_OUT_MOE, MEGATRON_MOE_QWEN3, "h100-sxm",
            "qwen3-235b-a22b", 256, 2048, 4096, tp=2, mbs=4, zero=3, recompute="full", sp=True, ep=8, etp=1,
            published_step_s=17.6, moe_dispatcher="deepep", engine="megatron", attention="cudnn", tp_comm_overlap=False,
            cross_entropy_fusion="te",
            assumptions=qwen[:1] + qwen[2:] + deepep + ("Megatron FSDP costed as ZeRO-3 over the 128 data ranks", ZOO_TP,
                                                        ZOO_LOSS)),
        # TP 4, PP 8 with 4 virtual stages, EP 8, DP 8, no recomputation.
        Run("Megatron-MoE Qwen3-235B tp4 pp8 vpp4 ep8", HELD_OUT_MOE, MEGATRON_MOE_QWEN3, "h100-sxm",
            "qwen3-235b-a22b", 256, 2048, 4096, tp=4, pp=8, vpp_options=(4,), sp=True, zero=1, ep=8, etp=1,
            published_step_s=29.0, moe_dispatcher="deepep", engine="megatron", attention="cudnn",
            stage_blocks=qwen3_235b_stage_blocks(32), tp_comm_overlap=False, cross_entropy_fusion="te",
            assumptions=qwen[:1] + qwen[2:] + deepep + ("distributed optimizer costed as ZeRO-1", ZOO_SPLIT, ZOO_TP,
                                                        ZOO_LOSS)),
        # Folded layouts, expert TP 1: EP 32 over the TP 2 x DP 16 ranks of a stage (cross-node EP),
        # and EP 8 over TP 2 x DP 4 with PP 32; both recompute norms and activations only.
        Run("Megatron-MoE Qwen3-235B tp2 pp8 vpp4 ep32 etp1", HELD_OUT_MOE, MEGATRON_MOE_QWEN3, "h100-sxm",
            "qwen3-235b-a22b", 256, 2048, 4096, tp=2, pp=8, vpp_options=(4,), sp=True, zero=1, ep=32, etp=1,
            recompute_modules=("layernorm", "moe_act"), published_step_s=19.7, moe_dispatcher="deepep", engine="megatron", attention="cudnn",
            stage_blocks=qwen3_235b_stage_blocks(32), tp_comm_overlap=False, cross_entropy_fusion="te",
            assumptions=qwen[:1] + qwen[2:] + norm_act + deepep + ("distributed optimizer costed as ZeRO-1", ZOO_SPLIT,
                                                                   ZOO_TP, ZOO_LOSS)),
        # The same layout with the all-to-alls overlapped (the table's "+1f1b overlap" note: Megatron-
        # Core's combined 1F1B, --overlap-moe-expert-parallel-comm), 17.6 s where the row above reads 19.7.
        Run("Megatron-MoE Qwen3-235B tp2 pp8 vpp4 ep32 etp1 a2a-overlap", HELD_OUT_MOE, MEGATRON_MOE_QWEN3,
            "h100-sxm", "qwen3-235b-a22b", 256, 2048, 4096, tp=2, pp=8, vpp_options=(4,), sp=True, zero=1, ep=32,
            etp=1, recompute_modules=("layernorm", "moe_act"), published_step_s=17.6, moe_dispatcher="deepep",
            engine="megatron", attention="cudnn", moe_a2a_overlap=True, stage_blocks=qwen3_235b_stage_blocks(32),
            tp_comm_overlap=False, cross_entropy_fusion="te",
            assumptions=qwen[:1] + qwen[2:] + norm_act + ("DeepEP's dispatch and combine (the table's Dispatcher "
                                                          "column; --moe-dispatcher deepep), overlapped by "
                                                          "Megatron-Core's combined 1F1B (--moe-a2a-overlap)",
                                                          "distributed optimizer costed as ZeRO-1", ZOO_SPLIT, ZOO_TP,
                                                          ZOO_LOSS)),
        Run("Megatron-MoE Qwen3-235B tp2 pp32 vpp3 ep8 etp1", HELD_OUT_MOE, MEGATRON_MOE_QWEN3, "h100-sxm",
            "qwen3-235b-a22b", 256, 2048, 4096, tp=2, pp=32, vpp_options=(3,), sp=True, zero=1, ep=8, etp=1,
            recompute_modules=("layernorm", "moe_act"), published_step_s=24.2, engine="megatron", attention="cudnn",
            stage_blocks=qwen3_235b_stage_blocks(96), tp_comm_overlap=False, cross_entropy_fusion="te",
            assumptions=qwen + norm_act + ("distributed optimizer costed as ZeRO-1", ZOO_SPLIT, ZOO_TP, ZOO_LOSS)),
        # 16 H100, FP8 current scaling, PP 2 with 24 virtual stages, EP 8, force-balanced, dropless.
        Run("Megatron-Bridge Qwen3-30B-A3B fp8 pp2 vpp24 ep8", HELD_OUT_MOE, MEGATRON_BRIDGE_H100, "h100-sxm",
            "qwen3-30b-a3b", 16, 512, 4096, pp=2, mbs=2, vpp_options=(24,), zero=1, ep=8, precision="fp8",
            fp8_recipe="tensorwise", published_tokens_per_s=5275.0 * 16, grad_reduce_in_bf16=True, engine="megatron", attention="cudnn",
            regression=QWEN3_30B_DROPLESS_REGRESSION, moe_a2a_overlap=True, cross_entropy_fusion="te",
            assumptions=MEGATRON_MOE_ASSUMPTIONS[:1] + (A2A_OVERLAPPED, CUDNN_ATTENTION, BRIDGE_TE_LOSS,
                "no recomputation (the recipe's set_qwen3_common_configs clears it)",
                "distributed optimizer costed as ZeRO-1",
                "FP8-CS: Transformer Engine's per-tensor current scaling (--fp8-recipe tensorwise)",
                BRIDGE_BF16_GRADS)),
    ]
    return (runs + [qwen3_next_run()] + moe_long_context_runs() + moe_gb200_runs()
            + megatron_bridge_blackwell_moe_runs()
            + megatron_bridge_2026_h100_moe_runs() + megatron_bridge_docs_qwen3_30b_runs()
            + dgx_cloud_deepseek_v3_runs() + dgx_cloud_grok1_runs() + megatron_bridge_deepseek_v3_card_runs()
            + megatron_bridge_blackwell_deepseek_v3_runs())


# Qwen3-Next-80B-A3B: 36 gated DeltaNet and 12 gated-attention blocks (3:1) over MoE (512 experts, top 10,
# a gated shared expert), the config Qwen3NextConfig defaults to (transformers' docstring: Qwen3-Next-80B-A3B),
# with the ModelZoo config's RoPE base and context (model_configs/benchmarking/Qwen3-Next-80B-A3B.yaml).
QWEN3_NEXT = Path(__file__).parent / "models" / "qwen3_next_80b_a3b.json"


def qwen3_next_run() -> Run:
    """The ModelZoo table's Qwen3-Next row (HELD_OUT_MOE): 128 H100, BF16, TP 1, PP 4, VP 3, EP 32, MBS 1,
    GBS 256, 2.2 s, under run_next_80b.sh and the model config at the source's commit: DeepEP, the norms,
    expert activations and shared experts recomputed, forced balancing, one multi-token-prediction layer,
    Transformer Engine's loss; its blocks split evenly, 4 a chunk. The table notes the model's performance
    is "not well tuned"; it is scored like any other."""
    return Run("Megatron-MoE Qwen3-Next-80B-A3B pp4 vpp3 ep32", HELD_OUT_MOE, MEGATRON_MOE_QWEN3, "h100-sxm",
               f"hf:{QWEN3_NEXT}", 128, 256, 4096, pp=4, vpp_options=(3,), zero=1, ep=32, etp=1,
               recompute_modules=("layernorm", "moe_act", "shared_experts"), published_step_s=2.2,
               moe_dispatcher="deepep", engine="megatron", attention="cudnn", stage_blocks=(4,) * 12, mtp_num_layers=1,
               cross_entropy_fusion="te", assumptions=MEGATRON_MOE_ASSUMPTIONS[:1] + (
                   CUDNN_ATTENTION, "DeepEP's dispatch and combine (the config's --moe-enable-deepep), not overlapped",
                   "recompute_modules moe_act shared_experts layernorm (run_next_80b.sh)",
                   "one multi-token-prediction layer (the config's --mtp-num-layers 1) on the last stage",
                   "the distributed optimizer costed as ZeRO-1", ZOO_LOSS,
                   "gated DeltaNet as flash-linear-attention's chunked kernel runs it (`hf_ssm.KernelGDN`)",
                   "the table's note: 'The performance of Qwen3-Next-80B-A3B is not well tuned'"))


def megatron_bridge_blackwell_moe_runs() -> list[Run]:
    """Megatron-Bridge 25.11's DGX-GB200 and DGX-B200 Qwen3 rows (HELD_OUT_MOE): every one, FSDP 0, TP 1.

    The recipes at the source's commit (scripts/performance/configs/qwen/qwen3_workload_base_configs.py):
    GB200 runs the flex dispatcher with HybridEP and Transformer Engine CUDA graphs, costed as the
    all-to-all inside one NVLink domain; B200 the alltoall dispatcher, the 235B with moe_a2a_overlap
    (the combined 1F1B, `Run.moe_a2a_overlap`)."""
    assumptions = MEGATRON_MOE_ASSUMPTIONS[:2] + (CUDNN_ATTENTION, BRIDGE_TE_LOSS,
        "no recomputation (the recipe's set_qwen3_common_configs clears it); the distributed optimizer costed as "
        "ZeRO-1",
        "the profile's efficiencies are H100 SXM's fit at each part's measured matmul ceilings (gb200-nvl72 and b200 "
        "are not validated on Blackwell)")
    regressions = {"B200 Qwen3-235B-A22B fp8 pp8 vpp2 ep8": QWEN3_235B_B200_REGRESSION,
                   "B200 Qwen3-30B-A3B fp8 ep8": QWEN3_30B_DROPLESS_REGRESSION}
    mxfp8 = (MXFP8,)
    # (name, cluster, spec, gpus, gbs, mbs, pp, vpp, ep, precision, tokens/s/GPU)
    rows = [("GB200 Qwen3-235B-A22B bf16 pp8 vpp3 ep32", "gb200-nvl72", "qwen3-235b-a22b", 256, 8192, 1, 8, 3, 32,
             "bf16-mixed", 4916.0),
            ("GB200 Qwen3-30B-A3B fp8 ep8", "gb200-nvl72", "qwen3-30b-a3b", 8, 512, 4, 1, 1, 8, "fp8", 23766.0),
            ("B200 Qwen3-235B-A22B fp8 pp8 vpp2 ep8", "b200", "qwen3-235b-a22b", 64, 1024, 1, 8, 2, 8, "fp8", 3269.0),
            ("B200 Qwen3-30B-A3B fp8 ep8", "b200", "qwen3-30b-a3b", 8, 512, 1, 1, 1, 8, "fp8", 9299.0)]
    overlapped = {"B200 Qwen3-235B-A22B fp8 pp8 vpp2 ep8"}  # the recipe's moe_a2a_overlap
    return [Run(f"Megatron-Bridge {name}", HELD_OUT_MOE, MEGATRON_BRIDGE_BLACKWELL, cluster, spec, gpus, gbs, 4096,
                pp=pp, mbs=mbs, vpp_options=(vpp,), zero=1, ep=ep, precision=precision,
                published_tokens_per_s=tps * gpus, grad_reduce_in_bf16=True, engine="megatron", attention="cudnn",
                fp8_recipe="mxfp8" if precision == "fp8" else None, regression=regressions.get(name, ""),
                moe_a2a_overlap=name in overlapped, cross_entropy_fusion="te",
                assumptions=assumptions + (BRIDGE_BF16_GRADS,) + (mxfp8 if precision == "fp8" else ())
                + ((A2A_OVERLAPPED,) if name in overlapped else ())
                + ((BRIDGE_235B_SPLIT,) if spec == "qwen3-235b-a22b" else ()),
                stage_blocks=qwen3_235b_stage_blocks(pp * vpp) if spec == "qwen3-235b-a22b" else None)
            for name, cluster, spec, gpus, gbs, mbs, pp, vpp, ep, precision, tps in rows]


# The ModelZoo's "Long Context" table (same readme and commit): Qwen3-235B-A22B on 32 nodes, BF16,
# DeepEP, TP 4, CP 1-8, GBS 256, its command's PP 8, VPP 4, EP 8 (expert TP 1, MBS 1 and the rest
# from model_configs/benchmarking/Qwen3-235B-A22B.yaml), without all-to-all overlap (A2A_OVERLAP=0)
# and with the layer norms and the whole MoE layers recomputed (--recompute-modules layernorm moe).
# Its TFLOP/s are the forced-balance figures (--moe-router-force-load-balancing: meshplan's balanced
# routing), in Megatron-LM's convention: causal attention, no recomputation (the table above prints
# step time and TFLOP/s together; its four rows give 147.3-148.2 GFLOP per token at 4096 tokens,
# meshplan's causal count of the model is 148.3).
# (sequence, CP, TFLOP/s per GPU)
MEGATRON_MOE_QWEN3_LONG_CONTEXT = ((16384, 1, 295.0), (32768, 2, 335.0), (65536, 4, 368.0), (131072, 8, 389.0))


def moe_long_context_runs() -> list[Run]:
    """The ModelZoo's long-context rows (HELD_OUT_MOE), forced balance."""
    assumptions = MEGATRON_MOE_ASSUMPTIONS[:1] + MEGATRON_MOE_ASSUMPTIONS[2:] + (CUDNN_ATTENTION,
        "DeepEP's dispatch and combine (--moe-dispatcher deepep), not overlapped with compute (A2A_OVERLAP=0)",
        "the layer norms and MoE layers recomputed (Megatron-Core's --recompute-modules layernorm moe)",
        "distributed optimizer costed as ZeRO-1", ZOO_SPLIT, ZOO_TP, ZOO_LOSS,
        "TFLOP/s in Megatron-LM's convention (causal attention, no recomputation): the short-sequence rows of the "
        "same table give it",
    )
    return [Run(f"Megatron-MoE Qwen3-235B tp4 cp{cp} pp8 vpp4 ep8 s{seq}", HELD_OUT_MOE, MEGATRON_MOE_QWEN3, "h100-sxm",
                "qwen3-235b-a22b", 256, 256, seq, tp=4, pp=8, vpp_options=(4,), sp=True, zero=1, cp=cp, ep=8, etp=1,
                recompute_modules=("layernorm", "moe"), published_causal_tflops_per_gpu=tflops,
                stage_blocks=qwen3_235b_stage_blocks(32), tp_comm_overlap=False, cross_entropy_fusion="te",
                moe_dispatcher="deepep", engine="megatron", attention="cudnn", assumptions=assumptions)
            for seq, cp, tflops in MEGATRON_MOE_QWEN3_LONG_CONTEXT]


# The same repository's later readme (best_practice/qwen3/readme.md) adds a GB200 table: its BF16 row
# is Qwen3-235B-A22B on 64 GB200 nodes (256 GPUs), TP 1, PP 8, no VPP, EP 8, MBS 1, GBS 8192, 750
# TFLOP/s, with HybridEP, forced balance, no all-to-all overlap and Transformer Engine CUDA graphs of
# attention and the router (its command); the MXFP8 row needs activation offloading, which meshplan
# does not express, and the GB300 rows have no profile.


def moe_gb200_runs() -> list[Run]:
    """The ModelZoo's GB200 BF16 row (HELD_OUT_MOE), its TFLOP/s in Megatron-LM's causal convention."""
    assumptions = MEGATRON_MOE_ASSUMPTIONS[:1] + (CUDNN_ATTENTION,
        "HybridEP inside the NVL72 domain costed as the all-to-all inside one NVLink domain (as Megatron-Bridge's "
        "GB200 rows), not overlapped with compute (A2A_OVERLAP=0)",
        "no recomputation (the command names none); the distributed optimizer costed as ZeRO-1", ZOO_SPLIT, ZOO_LOSS,
        "TFLOP/s in Megatron-LM's convention (causal attention, no recomputation)",
        GB200_UNVALIDATED + "; CUDA graphs not priced")
    return [Run("Megatron-MoE GB200 Qwen3-235B bf16 pp8 ep8", HELD_OUT_MOE, MEGATRON_MOE_QWEN3_GB200, "gb200-nvl72",
                "qwen3-235b-a22b", 256, 8192, 4096, pp=8, zero=1, ep=8, etp=1, published_causal_tflops_per_gpu=750.0,
                stage_blocks=qwen3_235b_stage_blocks(8), cross_entropy_fusion="te",
                engine="megatron", attention="cudnn", assumptions=assumptions)]


# Megatron-Bridge's later releases print DGX-H100 MoE rows in its performance archive. Every distinct
# H100 MoE layout is taken once, from the latest release that prints it, with that release's recipe
# (the release tag's scripts/performance/configs); layouts the recipe at the tag contradicts, or
# whose recipe overlaps the all-to-all with another micro-batch (moe_a2a_overlap: no source gives
# the hidden share), are left out (`published_runs`'s docstring says which).
MEGATRON_BRIDGE_ARCHIVE = ("Megatron-Bridge docs/performance-summary-archive.md, DGX-H100 rows of the {release} "
                           "NeMo container, recipes at tag {tag} (github.com/NVIDIA-NeMo/Megatron-Bridge, archive at "
                           "commit 4ab94dfad36641cabdeb96452b21bf676aac4772)")
MEGATRON_BRIDGE_2606_H100 = MEGATRON_BRIDGE_ARCHIVE.format(release="26.06", tag="v0.5.0")
MEGATRON_BRIDGE_260401_H100 = MEGATRON_BRIDGE_ARCHIVE.format(release="26.04.01", tag="v0.4.2")
HYBRIDEP = ("the flex dispatcher with HybridEP (the recipe's moe_flex_dispatcher_backend) costed as DeepEP's traffic "
            "(--moe-dispatcher deepep): HybridEP sends a token over RDMA once per destination node and forwards it "
            "over NVLink (DeepEP's hybrid-ep README, 'Hierarchical Communication Design'); not overlapped with compute "
            "(moe_a2a_overlap=False)")


# What every 2026 Megatron-Bridge DGX-H100 MoE row assumes (its performance scripts and recipes).
BRIDGE_2026_COMMON = (MEGATRON_MOE_ASSUMPTIONS[0], CUDNN_ATTENTION, "the distributed optimizer costed as ZeRO-1",
                      BRIDGE_BF16_GRADS, BRIDGE_TE_LOSS)


def megatron_bridge_2026_h100_moe_runs() -> list[Run]:
    """Megatron-Bridge's 2026 DGX-H100 MoE rows (HELD_OUT_MOE), force-balanced and dropless, FSDP 0, TP 1.

    - Qwen3-30B-A3B, 26.06 (tag v0.5.0): 16 GPUs, FP8-CS, GBS 1024, MBS 1, EP 16 over both nodes;
      qwen3_llm_pretrain.py's H100 config runs the flex dispatcher with HybridEP, and
      set_qwen3_common_configs clears recomputation and reduces gradients in bf16.
    - GPT-OSS 120B, 26.04.01 (tag v0.4.2, its last release with an H100 row): 64 GPUs, BF16,
      GBS 1280, MBS 1, PP 4 (no virtual stages), EP 8 (expert DP 2); the H100 workload config
      recomputes the norms and the experts' activations (recompute_modules layernorm, moe_act), the
      recipe keeps the alltoall dispatcher, and set_gpt_oss_common_configs reduces gradients in bf16.
    """
    qwen = Run("Megatron-Bridge 26.06 Qwen3-30B-A3B fp8 ep16", HELD_OUT_MOE,
               MEGATRON_BRIDGE_2606_H100, "h100-sxm", "qwen3-30b-a3b", 16, 1024,
               4096, zero=1, ep=16, etp=1, precision="fp8", fp8_recipe="tensorwise", published_tokens_per_s=8826.0 * 16,
               grad_reduce_in_bf16=True, moe_dispatcher="deepep", engine="megatron", attention="cudnn",
               cross_entropy_fusion="te", assumptions=BRIDGE_2026_COMMON + (
                   HYBRIDEP, "no recomputation (set_qwen3_common_configs clears it)",
                   "FP8-CS: Transformer Engine's per-tensor current scaling (--fp8-recipe tensorwise)"))
    gpt_oss = Run("Megatron-Bridge 26.04.01 GPT-OSS-120B bf16 pp4 ep8", HELD_OUT_MOE,
                  MEGATRON_BRIDGE_260401_H100, "h100-sxm", "gpt-oss-120b", 64,
                  1280, 4096, pp=4, zero=1, ep=8, etp=1, recompute_modules=("layernorm", "moe_act"),
                  published_tokens_per_s=5824.0 * 64, grad_reduce_in_bf16=True, engine="megatron", attention="cudnn",
                  cross_entropy_fusion="te", assumptions=BRIDGE_2026_COMMON + (
                      "Megatron-Core's alltoall dispatcher (the recipe's moe_token_dispatcher_type), not overlapped "
                      "with compute", "the norms and the experts' activation functions recomputed (recompute_modules "
                      "layernorm moe_act)", "36 layers, 9 a stage; the embedding and the output layer on the first and "
                      "last stages as meshplan places them", "the vocabulary of openai/gpt-oss-120b's config (201,088)"))
    return [qwen, gpt_oss, nemotron_3_nano_run()] + qwen3_235b_h100_overlapped_runs()


# Nemotron 3 Nano (30B-A3B): 23 Mamba-2, 23 MoE (128 experts, top 6, one shared expert, squared ReLU)
# and 6 attention layers; the Hugging Face hub's config.json of nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16
# (without auto_map), the shape Megatron-Bridge's nemotron_3_nano_pretrain_config builds.
NEMOTRON_3_NANO = Path(__file__).parent / "models" / "nemotron_3_nano_30b_a3b.json"


def nemotron_3_nano_run() -> Run:
    """Megatron-Bridge 26.06's DGX-H100 Nemotron 3 Nano row (HELD_OUT_MOE): 16 GPUs, FP8, GBS 1024, MBS 1,
    8K tokens, EP 8, 14,719 tokens/s/GPU, under the recipe at tag v0.5.0 (nemotron_3_llm_pretrain.py,
    nemotron_3_workload_base_configs.py's H100 FP8-CS preset): TP 1, expert TP 1, HybridEP, the MoE
    layers, norms, attention cores and expert activations recomputed, CUDA graphs over the Mamba
    mixers, current scaling with no layer kept in bf16, gradients reduced in bf16."""
    return Run("Megatron-Bridge 26.06 Nemotron-3-Nano fp8 ep8", HELD_OUT_MOE, MEGATRON_BRIDGE_2606_H100, "h100-sxm",
               f"hf:{NEMOTRON_3_NANO}", 16, 1024, 8192, zero=1, ep=8, etp=1, precision="fp8", fp8_recipe="tensorwise",
               recompute_modules=("moe", "layernorm", "core_attn", "moe_act"), published_tokens_per_s=14719.0 * 16,
               grad_reduce_in_bf16=True, moe_dispatcher="deepep", engine="megatron", attention="cudnn",
               cross_entropy_fusion="te", assumptions=BRIDGE_2026_COMMON + (
                   HYBRIDEP,
                   "recompute_modules moe, layernorm, core_attn and moe_act (the H100 FP8-CS preset)",
                   "FP8-CS: Transformer Engine's per-tensor current scaling (--fp8-recipe tensorwise), "
                   "first_last_layers_bf16 off",
                   "the Mamba-2 mixers as transformers' NemotronH builds them, their chunked scan as mamba_ssm's "
                   "kernel keeps it (`hf_ssm.KernelSSD`); Transformer Engine CUDA graphs over them (host launch "
                   "cost: not modelled)"))



# Step times Megatron-Bridge's own guides print for Qwen3-30B-A3B on 16 H100 (2 nodes), BF16, sequence
# 4096, TP 1, PP 1, EP 16 (expert TP 1), MBS 1, GBS 1024, force-balanced, no recomputation: the layout
# of the recipe's 16-GPU H100 BF16 preset (config variant v1), which each guide runs.
MEGATRON_BRIDGE_EP_OVERLAP_SMOKE = (
    "Megatron-Bridge skills/perf-expert-parallel-overlap/SKILL.md, 'Measured Short-Run Evidence' "
    "(github.com/NVIDIA-NeMo/Megatron-Bridge, commit 750d0d322a96cc28688fbb74aa767b12b852c1cd): mock pretraining, "
    "--config_variant v1, iterations 3-8")
MEGATRON_BRIDGE_EP_OVERLAP_SKILL = (
    "Megatron-Bridge skills/nemo-mbridge-perf-expert-parallel-overlap/SKILL.md, 'HybridEP Production-Shape "
    "Benchmark' (github.com/NVIDIA-NeMo/Megatron-Bridge, commit 7ded17dae62523b664dd3d8d2dbc632c844b1cef)")


def megatron_bridge_docs_qwen3_30b_runs() -> list[Run]:
    """Qwen3-30B-A3B on 16 H100 from Megatron-Bridge's guides (HELD_OUT_MOE), two A/Bs of Megatron-Core's
    combined 1F1B (plain EP overlap, delayed weight gradients off):

    - the alltoall dispatcher, CUDA graphs off, unfused permutation: 41.25 s without overlap, 31.31 s
      with it (iterations 3-8 of 8-step runs);
    - HybridEP with Transformer Engine CUDA graphs over the router and the dispatch preprocessing:
      24.7138 s without overlap (iterations 5-20) and 20.9920 s with it (the independent validation,
      iterations 41-50).

    Left out, each the same layout as a run above: the CUDA-graph guide's eager alltoall run (41.36 s,
    iterations 5-8; docs/training/cuda-graphs.md), the verification card's canonical HybridEP run with
    overlap (20.147 s; HybridEP tuned to 32 SMs and 64-token combine chunks), the MoE guide's 5-step smoke
    run (45.65 s, alltoall with CUDA graphs). Later copies of the alltoall A/B's guide call it fine-tuning;
    its first text and command (--task pretrain) say pretraining."""
    common = BRIDGE_2026_COMMON + ("no recomputation (the 16-GPU H100 BF16 preset clears it)",)
    alltoall = ("Megatron-Core's alltoall dispatcher with its permutation unfused (moe_permute_fusion=false, "
                "costed as any permutation); no CUDA graphs",)
    hybridep = ("the flex dispatcher with HybridEP costed as DeepEP's traffic and SMs (--moe-dispatcher deepep)",
                "Transformer Engine CUDA graphs over moe_router and moe_preprocess (host launch cost: not modelled)")
    off, on = ("the all-to-alls not overlapped with compute (the A/B's overlap-off case)",), (A2A_OVERLAPPED,)
    layout = dict(cluster="h100-sxm", spec="qwen3-30b-a3b", gpus=16, global_batch=1024, seq=4096, zero=1, ep=16,
                  etp=1, grad_reduce_in_bf16=True, engine="megatron", attention="cudnn", cross_entropy_fusion="te")
    name = "Megatron-Bridge guide Qwen3-30B-A3B bf16 ep16"
    return [
        Run(f"{name} alltoall", HELD_OUT_MOE, MEGATRON_BRIDGE_EP_OVERLAP_SMOKE, published_step_s=41.25,
            moe_dispatcher="alltoall", assumptions=common + alltoall + off, **layout),
        Run(f"{name} alltoall a2a-overlap", HELD_OUT_MOE, MEGATRON_BRIDGE_EP_OVERLAP_SMOKE, published_step_s=31.31,
            moe_dispatcher="alltoall", moe_a2a_overlap=True, assumptions=common + alltoall + on, **layout),
        Run(f"{name} hybridep", HELD_OUT_MOE, MEGATRON_BRIDGE_EP_OVERLAP_SKILL, published_step_s=24.7138,
            moe_dispatcher="deepep", assumptions=common + hybridep + off, **layout),
        Run(f"{name} hybridep a2a-overlap", HELD_OUT_MOE, MEGATRON_BRIDGE_EP_OVERLAP_SKILL, published_step_s=20.9920,
            moe_dispatcher="deepep", moe_a2a_overlap=True, assumptions=common + hybridep + on, **layout),
    ]

MEGATRON_BRIDGE_2511_ARCHIVE_H100 = (
    "Megatron-Bridge docs/performance-summary-archive.md, DGX-H100 rows of the 25.11 NeMo container "
    "(github.com/NVIDIA-NeMo/Megatron-Bridge, archive at commit 4ab94dfad36641cabdeb96452b21bf676aac4772, the row "
    "as the 25.11 page's own correction, commit "
    "5776a6d90b4dd8692902ab2eb581369484e19283, restored it), recipes at commit "
    "00b7660be0254ac6f95f44164ddd0c3e9cc798ed")


def qwen3_235b_h100_overlapped_runs() -> list[Run]:
    """Megatron-Bridge's DGX-H100 Qwen3-235B-A22B rows (HELD_OUT_MOE): TP 2 (SP), PP 8, VP 4, EP 32,
    expert TP 1, FP8-CS, 256 GPUs, MBS 1, force-balanced and dropless; the layout at GBS 2048 (25.11)
    and at GBS 8192 (the V2 preset), from 26.04.01, the latest release that prints it (tag v0.4.2).
    Both recipes (qwen3_workload_base_configs.py's H100 FP8-CS presets and qwen3_llm_pretrain.py's
    H100 function): moe_a2a_overlap=True (Megatron-Core's combined 1F1B), the alltoall dispatcher,
    CommOverlapConfig(tp_comm_overlap=False), set_qwen3_common_configs (no recomputation, bf16
    gradient reduction)."""
    assumptions = (MEGATRON_MOE_ASSUMPTIONS[0], A2A_OVERLAPPED, CUDNN_ATTENTION, BRIDGE_TE_LOSS,
                   "the distributed optimizer costed as ZeRO-1", BRIDGE_BF16_GRADS, "no recomputation (set_qwen3_common_configs clears it)",
                   "TP communication not overlapped (the recipe's CommOverlapConfig(tp_comm_overlap=False))",
                   "FP8-CS: Transformer Engine's per-tensor current scaling (--fp8-recipe tensorwise)",
                   BRIDGE_235B_SPLIT)
    # (release, source, global batch, tokens/s/GPU)
    rows = [("25.11", MEGATRON_BRIDGE_2511_ARCHIVE_H100, 2048, 1575.0),
            ("26.04.01", MEGATRON_BRIDGE_260401_H100, 8192, 1712.0)]
    return [Run(f"Megatron-Bridge {release} Qwen3-235B-A22B fp8 tp2 pp8 vpp4 ep32 gbs{gbs}", HELD_OUT_MOE, source,
                "h100-sxm", "qwen3-235b-a22b", 256, gbs, 4096, tp=2, sp=True, pp=8, vpp_options=(4,), zero=1, ep=32,
                etp=1, precision="fp8", fp8_recipe="tensorwise", published_tokens_per_s=tps * 256,
                grad_reduce_in_bf16=True, tp_comm_overlap=False, moe_a2a_overlap=True, engine="megatron",
                attention="cudnn", cross_entropy_fusion="te", stage_blocks=qwen3_235b_stage_blocks(32),
                assumptions=assumptions)
            for release, source, gbs, tps in rows]


# NVIDIA's DGX Cloud benchmarking recipes print DeepSeek-V3's BF16 pre-training step time on 512 and
# 1,024 H100 (its README's "H100 Performance" table, iterations 11-44 averaged), run by launch.sh
# through NeMo's scripts/performance/llm/pretrain_deepseek_v3.py at the NeMo commit setup.sh pins.
DGX_CLOUD_DEEPSEEK_V3 = ("NVIDIA dgxc-benchmarking deepseek_v3/pretraining/README.md, H100 Performance "
                         "(github.com/NVIDIA/dgxc-benchmarking, commit 1f6d9f40e4117d7c71b726f86074ac01c29f87f5); "
                         "recipe: its launch.sh and NeMo's scripts/performance/llm/pretrain_deepseek_v3.py at commit "
                         "7a8f1cc7bc40a84447c0681a9e4e956a135ae8a2 (github.com/NVIDIA/NeMo)")
# (GPUs, pipeline stages, step seconds): GBS 8 per GPU, TP 2, EP 64, expert TP 1, MBS 1 (launch.sh)
DGX_CLOUD_DEEPSEEK_V3_H100 = ((512, 8, 48.948), (1024, 16, 52.04))
# The same README's GB200 table: launch.sh's GB200 layout, TP 2, PP 4, EP 32 on 128 GPUs and 64 above,
# expert TP 1, MBS 1, GBS 8 per GPU, the attention core recomputed (RM='core_attn'); the recommended
# configs' GB200 rows set no CUDA graphs. (GPUs, EP, step seconds)
DGX_CLOUD_DEEPSEEK_V3_GB200_SOURCE = DGX_CLOUD_DEEPSEEK_V3.replace("H100 Performance", "GB200 Performance")
DGX_CLOUD_DEEPSEEK_V3_GB200 = ((128, 32, 34.168), (256, 64, 34.194), (512, 64, 34.274))


def dgx_cloud_deepseek_v3_runs() -> list[Run]:
    """DGX Cloud's DeepSeek-V3 rows on H100 and on GB200 (HELD_OUT_MOE), each under its recipe.

    pretrain_deepseek_v3.py: token dropping at capacity factor 1 with the experts' inputs padded to
    capacity (MegatronTokenDropCallback), so every expert computes its balanced share whatever the
    routing; TP communication not overlapped (MegatronCommOverlapCallback(tp_comm_overlap=False));
    64 / pp - 1 blocks on the first stage and 64 / pp - 2 on the last, 64 / pp on the others (61
    blocks: 7, 8 x 6, 6 at PP 8; 3, 4 x 14, 2 at PP 16); selective recomputation of the latent
    attention's up-projections (launch.sh's recompute_modules mla_up_proj); one multi-token-prediction
    layer (pretrain_recipe's use_mtp), on the last stage, which the cut gives two blocks fewer.
    NeMo's DeepSeek-V3 config runs Megatron-Core's alltoall dispatcher."""
    assumptions = (
        CUDNN_ATTENTION,
        "capacity factor 1, experts' inputs padded to capacity (--moe-capacity-factor 1 "
        "--moe-pad-expert-input-to-capacity): every expert computes its balanced share",
        "Megatron-Core's alltoall dispatcher (NeMo's DeepSeek config), not overlapped with compute; the shared "
        "expert computed beside the all-to-all (moe_shared_expert_overlap) priced after it",
        "TP communication not overlapped (the script's tp_comm_overlap=False, --tp-comm-overlap off)",
        "the recipe's multi-token-prediction layer (use_mtp: --mtp-num-layers 1) on the last stage with the output "
        "layer, as Megatron-Core builds it",
        "the distributed optimizer costed as ZeRO-1, gradients reduced in fp32 (NeMo's bf16 mixed precision)",
        "Transformer Engine's fused cross-entropy (the script's cross_entropy_fusion_impl = 'te' over NeMo's "
        "cross_entropy_loss_fusion = True)",
    )

    def cut(pp: int) -> tuple[int, ...]:
        middle = 64 // pp
        return (middle - 1,) + (middle,) * (pp - 2) + (middle - 2,)

    h100 = [(DGX_CLOUD_DEEPSEEK_V3, "h100-sxm", gpus, pp, 64, ("mla_up_proj",), step_s)
            for gpus, pp, step_s in DGX_CLOUD_DEEPSEEK_V3_H100]
    gb200 = [(DGX_CLOUD_DEEPSEEK_V3_GB200_SOURCE, "gb200-nvl72", gpus, 4, ep, ("core_attn",), step_s)
             for gpus, ep, step_s in DGX_CLOUD_DEEPSEEK_V3_GB200]
    on_gb200 = ("launch.sh's GB200 layout (TP 2, PP 4, EP 32 or 64, the attention core recomputed); no CUDA graphs "
                "(the recommended configs' GB200 rows)", GB200_UNVALIDATED)
    return [Run(f"DGX Cloud {'GB200 ' if cluster != 'h100-sxm' else ''}DeepSeek-V3 bf16 tp2 pp{pp} ep{ep}"
                + (f" x{gpus}" if cluster != "h100-sxm" else ""), HELD_OUT_MOE, source, cluster,
                "deepseek-v3", gpus, 8 * gpus, 4096, tp=2, pp=pp, sp=True, zero=1, ep=ep, etp=1,
                recompute_modules=modules, published_step_s=step_s, engine="megatron", attention="cudnn",
                tp_comm_overlap=False, moe_capacity_factor=1.0, moe_pad_to_capacity=True, stage_blocks=cut(pp),
                mtp_num_layers=1, cross_entropy_fusion="te",
                assumptions=assumptions + (on_gb200 if cluster != "h100-sxm" else ()))
            for source, cluster, gpus, pp, ep, modules, step_s in h100 + gb200]


# Megatron-Bridge's model verification card for DeepSeek-V3: its canonical H100 performance run.
MEGATRON_BRIDGE_DEEPSEEK_V3_CARD = (
    "Megatron-Bridge examples/model_verification_cards/deepseek-v3/card.yaml, pretrain_performance.H100 "
    "(github.com/NVIDIA-NeMo/Megatron-Bridge, card at commit 6d9a87d6a0ba7550fdd9455ef2a97a62a7dcdef3; steps 41-50 "
    "of 50); recipe: src/megatron/bridge/perf_recipes/deepseek/h100/deepseek_v3.py at the card's bridge_commit "
    "79308d0d99fb8c09b3f1a22baa68a4ffa4f4ce1e")


def megatron_bridge_deepseek_v3_card_runs() -> list[Run]:
    """DeepSeek-V3 in BF16 on 1,024 H100 (HELD_OUT_MOE), the verification card's canonical run: 61.756 s a
    step. deepseek_v3_pretrain_1024gpu_h100_bf16_config: TP 2 (SP), PP 8, VP 4, EP 64, expert TP 1,
    GBS 16384, MBS 1, sequence 4096; the pipeline layout "Et|(tt|)*30mL" (the embedding and one block,
    thirty chunks of two blocks, the multi-token-prediction layer and the loss: `stage_blocks` per virtual
    chunk); the flex dispatcher with HybridEP; forced balancing (random logits, group-limited routing
    kept); the latent attention's up-projections and the dense MLPs recomputed; gradients reduced in
    bf16; TP communication and the combined 1F1B off."""
    assumptions = (
        CUDNN_ATTENTION, BRIDGE_TE_LOSS,
        "balanced routing inside DeepSeek-V3's group limit (4 of 8 expert groups, one group a node at EP 64): "
        "Megatron-Core's forced balancing draws random logits and keeps the group-limited top-k",
        "the flex dispatcher with HybridEP costed as DeepEP's node-deduplicated traffic (--moe-dispatcher deepep), "
        "not overlapped with compute",
        "recompute_modules mla_up_proj and mlp (the latent attention's up-projections, the dense blocks' MLPs)",
        "TP communication not overlapped (CommOverlapConfig(tp_comm_overlap=False))",
        "the distributed optimizer costed as ZeRO-1, gradients reduced in bf16; the recipe turns "
        "--overlap-grad-reduce off, priced as overlapped as every megatron run is",
        "one multi-token-prediction layer (--mtp-num-layers 1) with the loss in the last virtual chunk",
    )
    return [Run("Megatron-Bridge card DeepSeek-V3 bf16 tp2 pp8 vpp4 ep64", HELD_OUT_MOE, MEGATRON_BRIDGE_DEEPSEEK_V3_CARD,
                "h100-sxm", "deepseek-v3", 1024, 16384, 4096, tp=2, pp=8, vpp_options=(4,), sp=True, zero=1, ep=64,
                etp=1, recompute_modules=("mla_up_proj", "mlp"), published_step_s=61.75613, engine="megatron",
                attention="cudnn", tp_comm_overlap=False, moe_dispatcher="deepep", grad_reduce_in_bf16=True,
                stage_blocks=(1,) + (2,) * 30 + (0,), mtp_num_layers=1, cross_entropy_fusion="te",
                assumptions=assumptions)]


def megatron_bridge_blackwell_deepseek_v3_runs() -> list[Run]:
    """Megatron-Bridge 25.11's DGX-B200 DeepSeek-V3 row (HELD_OUT_MOE): MXFP8 on 256 B200, PP 16, EP 8,
    GBS 2048, MBS 1, 2139 tokens/s/GPU, as the recipe at the source's commit runs it
    (scripts/performance/configs/deepseek/: the B200 preset, deepseek_llm_pretrain.py and the DeepSeek-V3
    recipe's layout for PP 16: the embedding and 4 blocks, fourteen stages of 4, one block with the
    multi-token-prediction layer and the loss). Left out: its DGX-GB200 rows, whose printed layouts (GBS
    4096; PP 8 / EP 32 for MXFP8) are not the recipe's at that commit (GBS 2048, PP 4 / EP 64), and its
    GB300 rows (no GB300 profile)."""
    assumptions = (
        CUDNN_ATTENTION, BRIDGE_TE_LOSS,
        "balanced routing inside DeepSeek-V3's group limit (set_deepseek_v3_common_configs forces balancing: "
        "random logits, group-limited top-k kept)",
        "Megatron-Core's alltoall dispatcher (the B200 preset names no flex backend), not overlapped with compute",
        "recompute_modules mla_up_proj (the B200 preset); one multi-token-prediction layer with the loss on the "
        "last stage (the recipe's layout for PP 16)",
        "the distributed optimizer costed as ZeRO-1, gradients reduced in bf16 (set_deepseek_v3_common_configs)",
        MXFP8,
        "the profile's efficiencies are H100 SXM's fit at B200's measured matmul ceilings (b200 is not validated on "
        "Blackwell)",
    )
    return [Run("Megatron-Bridge B200 DeepSeek-V3 fp8 pp16 ep8", HELD_OUT_MOE, MEGATRON_BRIDGE_BLACKWELL, "b200",
                "deepseek-v3", 256, 2048, 4096, pp=16, zero=1, ep=8, etp=1, recompute_modules=("mla_up_proj",),
                precision="fp8", fp8_recipe="mxfp8", published_tokens_per_s=2139.0 * 256, engine="megatron",
                attention="cudnn", grad_reduce_in_bf16=True, stage_blocks=(4,) * 15 + (1,), mtp_num_layers=1,
                cross_entropy_fusion="te", assumptions=assumptions)]
