"""Held-out runs from NVIDIA's DGX Cloud benchmarking recipes (github.com/NVIDIA/dgxc-benchmarking):
every H100 pre-training row of their dense Llama 3.1, GPT-3 175B and Nemotron-4 tables, in BF16 (`HELD_OUT`)
and FP8 (`HELD_OUT_FP8`), and of their Grok-1 table (`HELD_OUT_MOE`), each under the recipe its release
runs (`published_runs`'s docstring lists what is used and what is left out, and why; DeepSeek-V3's rows
are in `published_moe_runs`).

The tables weak-scale one layout per model and precision (the global batch grows with the GPUs, the
data-parallel degree with it), so each GPU count is a run of its own; a layout printed by two releases
is taken once, from the later. The step time is the one the release prints (v25.04: the log's last
step of 50; v25.05.04: iterations 11-44 averaged).

Split from `published_runs` (which defines `Run` and the groups), whose `all_runs` adds these.
"""
from __future__ import annotations

import re
from pathlib import Path

from published_runs import HELD_OUT, HELD_OUT_FP8, HELD_OUT_MOE, Run, account_for_split, gpt_spec

# The DGX Cloud benchmarking release v25.04 (NeMo 25.02.01 container for Llama 3.1, 24.12 for GPT-3).
DGX_CLOUD_2504_LLAMA = (
    "NVIDIA dgxc-benchmarking v25.04 llama3.1/README.md, H100 tables (github.com/NVIDIA/dgxc-benchmarking, commit "
    "741c886025a7665a1d690c05ff12ac29c1be7252); recipe: its pretrain_llama31.py and llama31_utils.py over NeMo's "
    "llama3_8b, llama3_70b and llama31_405b recipes (performance_mode) at commit "
    "d2b21556f2455b52ad7217f334bb66eaa13c0f83 (github.com/NVIDIA/NeMo)")
DGX_CLOUD_250504_LLAMA = (
    "NVIDIA dgxc-benchmarking v25.05.04 llama3.1/README.md, H100 Performance (github.com/NVIDIA/dgxc-benchmarking, "
    "commit 1f6d9f40e4117d7c71b726f86074ac01c29f87f5); recipe: NeMo's scripts/performance/llm/pretrain_llama31_405b.py "
    "at commit 6f2c6fdaffcc0af97a9e2219fcc104e2399627e4 (github.com/NVIDIA/NeMo)")
DGX_CLOUD_2504_GPT3 = (
    "NVIDIA dgxc-benchmarking v25.04 nemo_megatron/README_175b.md, H100 tables (github.com/NVIDIA/dgxc-benchmarking, "
    "commit 741c886025a7665a1d690c05ff12ac29c1be7252); recipe: its cfg/gpt3_175b_hydra.yaml and configure.sh "
    "(NeMo 24.12 container)")

NEMO_LLAMA_ASSUMPTIONS = (
    "the distributed optimizer costed as ZeRO-1; sequence parallelism with TP (set_primary_perf_configs)",
    "gradients reduced in bf16 (the recipes' performance optimizations set grad_reduce_in_fp32 = False)",
    "cuDNN fused attention (Transformer Engine's choice on Hopper); context parallelism as Transformer Engine's "
    "p2p ring",
    "no recomputation (the recipes set none)",
    "Megatron-Core's fused cross-entropy (NeMo's GPTConfig: cross_entropy_loss_fusion = True, native kernel)",
    "TP communication overlapped with userbuffers for 70B and 405B (MegatronCommOverlapCallback(tp_comm_overlap=True)); "
    "8B runs TP 1",
)
NEMO_FP8 = ("FP8: bf16_with_fp8_mixed, Transformer Engine's delayed scaling (hybrid E4M3/E5M2, amax history 1024) "
            "with fp8 parameters (--fp8-recipe delayed, gathered in fp8)")
# What every GB200 row here assumes of the part (`gb200-nvl72`).
GB200_UNVALIDATED = ("the profile's efficiencies are H100 SXM's fit at GB200's measured matmul ceilings "
                     "(gb200-nvl72 is not validated on Blackwell)")
CUDNN_BLACKWELL = "cuDNN fused attention (Transformer Engine's choice on Blackwell)"
PROXY = ("a 405B proxy: Llama 3.1 405B's shape with the layer count llama31_utils.py sets for this GPU count; the "
         "embedding and the loss counted as a layer each in the pipeline split (the recipe's "
         "account_for_embedding/loss_in_pipeline_split)")


def nemo_run(name: str, source: str, spec: str, gpus: int, global_batch: int, seq: int, precision: str,
             step_s: float, assumptions: tuple[str, ...], cluster: str = "h100-sxm", **layout) -> Run:
    """One DGX Cloud row as every NeMo recipe here runs it: on `cluster` under `--engine megatron`, the
    distributed optimizer (ZeRO-1), cuDNN attention unless `layout` names another, FP8 as delayed
    scaling (`NEMO_FP8`), held out with the BF16 or the FP8 runs; `layout` holds the row's degrees
    and its recipe's switches."""
    fp8 = precision == "fp8"
    attention = layout.pop("attention", "cudnn")
    return Run(f"DGX Cloud {name} {'fp8' if fp8 else 'bf16'} {_degrees(layout)} x{gpus}",
               HELD_OUT_FP8 if fp8 else HELD_OUT, source, cluster, spec, gpus, global_batch, seq, zero=1,
               precision=precision, fp8_recipe="delayed" if fp8 else None, engine="megatron", attention=attention,
               published_step_s=step_s, assumptions=assumptions + ((NEMO_FP8,) if fp8 else ()), **layout)


def _degrees(layout: dict) -> str:
    """The name's layout: tp and pp always, cp where the rows print it."""
    cp = f" cp{layout['cp']}" if "cp" in layout else ""
    return f"tp{layout.get('tp', 1)} pp{layout.get('pp', 1)}{cp}"


def llama_405b_spec(layers: int) -> str:
    """Llama 3.1 405B's shape (meshplan's llama3-405b) at `layers` blocks: the recipe's proxies."""
    return f"llama:layers={layers},hidden=16384,heads=128,kv_heads=8,ffn=53248,vocab=128256,rope_theta=500000"


# (label, spec, gpus, global batch, tp, pp, cp, virtual stages, precision, step s, source)
LLAMA_ROWS = (
    [("8B", "llama3-8b", gpus, 16 * gpus, 1, 1, 2, 1, "bf16-mixed", step, DGX_CLOUD_2504_LLAMA)
     for gpus, step in zip((8, 16, 32, 64, 128), (12.27, 12.3, 12.32, 12.33, 12.33))]
    + [("8B", "llama3-8b", gpus, 16 * gpus, 1, 1, 2, 1, "fp8", step, DGX_CLOUD_2504_LLAMA)
       for gpus, step in zip((8, 16, 32, 64, 128), (9.33, 9.36, 9.43, 9.48, 9.54))]
    + [("70B", "llama3-70b", gpus, 2 * gpus, 4, 4, 2, 5, "bf16-mixed", step, DGX_CLOUD_2504_LLAMA)
       for gpus, step in zip((64, 128, 256, 512, 1024, 2048), (14.66, 14.67, 14.68, 14.67, 14.65, 14.66))]
    + [("70B", "llama3-70b", gpus, 2 * gpus, 4, 8, 1, 5, "fp8", step, DGX_CLOUD_2504_LLAMA)
       for gpus, step in zip((64, 128, 256, 512, 1024, 2048), (9.86, 9.95, 10.0, 10.07, 10.08, 10.15))]
    # the proxies: 8 layers on 32 GPUs (PP 1), 30 on 64 and 62 on 128 (PP 4, 8 virtual stages)
    + [(f"405B proxy {layers} layers", llama_405b_spec(layers), gpus, gbs, 8, pp, 2, vpp, precision, step,
        DGX_CLOUD_2504_LLAMA)
       for layers, gpus, gbs, pp, vpp, steps in ((8, 32, 64, 1, 1, (5.4, 3.53)), (30, 64, 64, 4, 8, (10.1, 6.32)),
                                                 (62, 128, 128, 4, 8, (19.62, 12.18)))
       for precision, step in zip(("bf16-mixed", "fp8"), steps)]
    # 512 GPUs: v25.05.04's figures for v25.04's layout; 1,024 and 2,048 from v25.04
    + [("405B", "llama3-405b", 512, 256, 8, 8, 2, 8, precision, step, DGX_CLOUD_250504_LLAMA)
       for precision, step in (("bf16-mixed", 19.810), ("fp8", 13.020))]
    + [("405B", "llama3-405b", gpus, gpus // 2, 8, 8, 2, 8, precision, step, DGX_CLOUD_2504_LLAMA)
       for gpus, steps in ((1024, (19.84, 12.42)), (2048, (19.87, 12.56)))
       for precision, step in zip(("bf16-mixed", "fp8"), steps)]
)


def dgx_cloud_llama_runs() -> list[Run]:
    """DGX Cloud's Llama 3.1 H100 rows: 8B (TP 1, CP 2), 70B (BF16: TP 4, PP 4, CP 2; FP8: TP 4,
    PP 8; 5 virtual stages), 405B (TP 8, PP 8, CP 2, 8 virtual stages) and its proxies, MBS 1, 8K
    tokens, at every GPU count the tables print."""
    return [nemo_run(f"Llama3.1 {label}", source, spec, gpus, gbs, 8192, precision, step,
                     _llama_assumptions(source) + ((PROXY,) if "proxy" in label else ()), tp=tp, pp=pp, cp=cp,
                     sp=tp > 1, vpp_options=(vpp,), grad_reduce_in_bf16=True,
                     cross_entropy_fusion="te" if source == DGX_CLOUD_250504_LLAMA else "native",
                     stage_blocks=_proxy_blocks(label, pp * vpp))
            for label, spec, gpus, gbs, tp, pp, cp, vpp, precision, step, source in LLAMA_ROWS]


# v25.05.04's performance scripts (NeMo 6f2c6fd and b4148d2) pick Transformer Engine's loss kernel:
# set_primary_perf_configs sets cross_entropy_fusion_impl = "te"; v25.04's (d2b2155) leave the native one.
TE_LOSS = "Transformer Engine's fused cross-entropy (set_primary_perf_configs: cross_entropy_fusion_impl = 'te')"


def _llama_assumptions(source: str) -> tuple[str, ...]:
    return NEMO_LLAMA_ASSUMPTIONS[:-2] + (TE_LOSS,) + NEMO_LLAMA_ASSUMPTIONS[-1:] if source != DGX_CLOUD_2504_LLAMA \
        else NEMO_LLAMA_ASSUMPTIONS


# The same README's GB200 table (v25.05.04: 128-512 GPUs, weak scaling): launch.sh's GB200 layout, TP 4,
# PP 8, CP 2, 8 virtual stages, GBS GPUs / 2; the recommended configs' GB200 row sets no CUDA graphs;
# userbuffers under the b200 h16384 tp4 cp2 configs.
DGX_CLOUD_250504_LLAMA_GB200 = DGX_CLOUD_250504_LLAMA.replace("H100 Performance", "GB200 Performance")


def dgx_cloud_gb200_llama_runs() -> list[Run]:
    """DGX Cloud's Llama 3.1 405B GB200 rows (v25.05.04), BF16 and FP8, 128, 256 and 512 GPUs."""
    steps = {"bf16-mixed": (9.347, 9.484, 9.508), "fp8": (6.131, 6.183, 6.244)}
    hopper = _llama_assumptions(DGX_CLOUD_250504_LLAMA_GB200)[:-1]
    assumptions = tuple(a.replace("cuDNN fused attention (Transformer Engine's choice on Hopper)", CUDNN_BLACKWELL)
                        for a in hopper) + (
        "TP communication overlapped with userbuffers (the b200 h16384 tp4 cp2 configs the script picks for GB200)",
        "no CUDA graphs (the recommended configs' GB200 row)", GB200_UNVALIDATED)
    return [nemo_run("GB200 Llama3.1 405B", DGX_CLOUD_250504_LLAMA_GB200, "llama3-405b", gpus, gpus // 2, 8192,
                     precision, step, assumptions, cluster="gb200-nvl72", tp=4, pp=8, cp=2, sp=True, vpp_options=(8,),
                     grad_reduce_in_bf16=True, cross_entropy_fusion="te")
            for precision, row in steps.items() for gpus, step in zip((128, 256, 512), row)]


def _proxy_blocks(label: str, chunks: int) -> tuple[int, ...] | None:
    """A pipelined proxy's blocks per chunk under its recipe's account_for_* split (`PROXY`); None
    for the other rows, whose blocks meshplan splits."""
    layers = re.fullmatch(r"405B proxy (\d+) layers", label)
    return account_for_split(int(layers.group(1)), chunks) if layers and chunks > 1 else None


GPT3_ASSUMPTIONS = (
    "NeMo's Megatron-Core GPT (mcore_gpt) under the hydra config: TP 4 with sequence parallelism and userbuffers "
    "TP overlap (ub_tp_comm_overlap), PP 8 with 6 virtual stages, MBS 1, no recomputation",
    "distributed_fused_adam with overlapped gradient and parameter syncs, costed as ZeRO-1; gradients synced in bf16 "
    "(grad_sync_dtype bf16)",
    "cuDNN fused attention (Transformer Engine's choice on Hopper); dropout 0.1 not priced",
    "the unfused vocab-parallel cross-entropy (the config sets no loss fusion)",
    "the GPT-2 BPE vocabulary padded as Megatron-LM pads it (51,200)",
    "global batch 2 x GPUs (configure.sh: 16 per node); the README's 1204 at 512 GPUs is its tokens/s's 1024",
)


def dgx_cloud_gpt3_runs() -> list[Run]:
    """DGX Cloud's GPT-3 175B H100 rows (NeMo Megatron), BF16 and FP8, 128-2,048 GPUs."""
    steps = {"bf16-mixed": (8.309, 8.408, 8.42, 8.453, 8.49), "fp8": (5.626, 5.725, 5.774, 5.82, 5.96)}
    return [nemo_run("GPT-3 175B", DGX_CLOUD_2504_GPT3, gpt_spec(96, 12288, 96), gpus, 2 * gpus, 2048, precision, step,
                     GPT3_ASSUMPTIONS, tp=4, pp=8, sp=True, vpp_options=(6,), grad_reduce_in_bf16=True,
                     cross_entropy_fusion="none")
            for precision, row in steps.items() for gpus, step in zip((128, 256, 512, 1024, 2048), row)]


DGX_CLOUD_2504_NEMOTRON = (
    "NVIDIA dgxc-benchmarking v25.04 nemotron/README.md, H100 tables (github.com/NVIDIA/dgxc-benchmarking, commit "
    "741c886025a7665a1d690c05ff12ac29c1be7252); recipe: its launch.sh over NeMo's nemotron4_15b and nemotron4_340b "
    "recipes (performance_mode) at commit d2b21556f2455b52ad7217f334bb66eaa13c0f83 (github.com/NVIDIA/NeMo)")
# Nemotron-4 (NeMo's Nemotron4Config15B / 340B): grouped-query attention (8 KV heads), a plain MLP of
# width 4h with squared ReLU, LayerNorm, RoPE, no biases, untied embeddings, a 256,000-token vocabulary.
NEMOTRON4 = {"15B": "gpt:layers=32,hidden=6144,heads=48,kv_heads=8,ffn=24576,vocab=256000,tied=0,positions=4096",
             "340B": "gpt:layers=96,hidden=18432,heads=96,kv_heads=8,ffn=73728,vocab=256000,tied=0,positions=4096"}
NEMOTRON_ASSUMPTIONS = (
    "Nemotron-4 as meshplan's GPT block with grouped-query attention (`kv_heads`): its squared ReLU priced as "
    "GELU's elementwise work, its learned positions (RoPE in the model) and biases (none in the model) under "
    "0.3% of the parameters",
    "the distributed optimizer costed as ZeRO-1; sequence parallelism with TP; TP communication overlapped with "
    "userbuffers (the recipes' MegatronCommOverlapCallback(tp_comm_overlap=True))",
    "gradients reduced in bf16 (the recipes' pretrain_performance_optimizations set grad_reduce_in_fp32 = False, "
    "and the performance scripts set it False again with the FP8 plugin)",
    "cuDNN fused attention (Transformer Engine's choice on Hopper); no recomputation; Megatron-Core's fused "
    "cross-entropy (NeMo's GPTConfig default)",
    "340B: 12 virtual stages, one layer a chunk (launch.sh's VP=12; the README's table prints VP as NA)",
)


def dgx_cloud_nemotron_runs() -> list[Run]:
    """DGX Cloud's Nemotron-4 H100 rows: 15B (TP 2, micro-batch 2, global batch 4 x GPUs) on 16-2,048
    GPUs and 340B (TP 8, PP 8, 12 virtual stages, micro-batch 1, global batch GPUs / 4) on 256-2,048,
    BF16 and FP8, 4,096 tokens (launch.sh's settings)."""
    steps = {("15B", "bf16-mixed"): (2.66, 2.66, 2.67, 2.67, 2.68, 2.71, 2.74, 2.78),
             ("15B", "fp8"): (1.98, 1.98, 1.98, 1.99, 2.0, 2.02, 2.03, 2.09),
             ("340B", "bf16-mixed"): (4.36, 4.39, 4.41, 4.43), ("340B", "fp8"): (2.93, 2.97, 3.0, 3.05)}
    runs = []
    for (size, precision), row in steps.items():
        small = size == "15B"
        gpu_counts = (16, 32, 64, 128, 256, 512, 1024, 2048) if small else (256, 512, 1024, 2048)
        tp, pp, vpp, mbs = (2, 1, 1, 2) if small else (8, 8, 12, 1)
        runs += [nemo_run(f"Nemotron-4 {size}", DGX_CLOUD_2504_NEMOTRON, NEMOTRON4[size], gpus,
                          4 * gpus if small else gpus // 4, 4096, precision, step, NEMOTRON_ASSUMPTIONS, tp=tp, pp=pp,
                          mbs=mbs, sp=True, vpp_options=(vpp,), grad_reduce_in_bf16=True,
                          cross_entropy_fusion="native")
                 for gpus, step in zip(gpu_counts, row)]
    return runs


# The v25.05.04 README's GB200 tables of Nemotron-4 340B (NeMo b4148d2, the commit its setup.sh pins):
# launch.sh's GB200 layout, TP 8, PP 4, 12 virtual stages, MBS 1, CUDA graphs on, weak-scaled (GBS
# GPUs / 4) in one table and strong-scaled (GBS 512) in another, each its own source so that an FP8
# row pairs with the BF16 row of its own batch.
DGX_CLOUD_250504_NEMOTRON_GB200 = (
    "NVIDIA dgxc-benchmarking v25.05.04 nemotron/README.md, GB200 Performance{table} (github.com/NVIDIA/"
    "dgxc-benchmarking, commit 1f6d9f40e4117d7c71b726f86074ac01c29f87f5); recipe: its launch.sh and NeMo's "
    "scripts/performance/llm/pretrain_nemotron4_340b.py at commit b4148d21695de467d50ebf050566555429c26919 "
    "(github.com/NVIDIA/NeMo), the commit its setup.sh pins")
NEMOTRON_GB200_WEAK = DGX_CLOUD_250504_NEMOTRON_GB200.format(table="")
NEMOTRON_GB200_STRONG = DGX_CLOUD_250504_NEMOTRON_GB200.format(table=", Strong Scaling")


def dgx_cloud_gb200_nemotron_runs() -> list[Run]:
    """DGX Cloud's Nemotron-4 340B GB200 rows (v25.05.04): BF16 and FP8 on 128, 256 and 512 GPUs, at
    GBS GPUs / 4 and at GBS 512."""
    steps = {(NEMOTRON_GB200_WEAK, "bf16-mixed"): (2.189, 2.19, 2.229),
             (NEMOTRON_GB200_WEAK, "fp8"): (1.483, 1.517, 1.549),
             (NEMOTRON_GB200_STRONG, "bf16-mixed"): (32.66, 16.58, 8.468),
             (NEMOTRON_GB200_STRONG, "fp8"): (21.83, 11.21, 5.668)}
    assumptions = NEMOTRON_ASSUMPTIONS[:3] + (
        f"{CUDNN_BLACKWELL}; no recomputation; {TE_LOSS}",
        "TP 8, PP 4, 12 virtual stages (launch.sh's GB200 layout), one layer a chunk; userbuffers under the b200 "
        "h18432 tp8 configs the script picks for GB200",
        "launch.sh's CUDA graphs (--cuda_graphs true) not priced: meshplan prices no host time", GB200_UNVALIDATED)
    return [nemo_run(f"GB200 Nemotron-4 340B{' gbs512' if source == NEMOTRON_GB200_STRONG else ''}", source,
                     NEMOTRON4["340B"], gpus, 512 if source == NEMOTRON_GB200_STRONG else gpus // 4, 4096, precision,
                     step, assumptions, cluster="gb200-nvl72", tp=8, pp=4, mbs=1, sp=True, vpp_options=(12,),
                     grad_reduce_in_bf16=True, cross_entropy_fusion="te")
            for (source, precision), row in steps.items() for gpus, step in zip((128, 256, 512), row)]


# The v25.05.04 README's Nemotron-H 56B table (FP8 only, 32-2,048 H100, weak-scaled: GBS 3 x GPUs) run by
# its launch.sh through NeMo's scripts/performance/llm/pretrain_nemotronh_56b.py at the commit its setup.sh pins.
DGX_CLOUD_NEMOTRON_H = (
    "NVIDIA dgxc-benchmarking v25.05.04 nemotronh/README.md, Expected Performance (github.com/NVIDIA/"
    "dgxc-benchmarking, commit 1f6d9f40e4117d7c71b726f86074ac01c29f87f5; iterations 11-44); recipe: its launch.sh "
    "and NeMo's scripts/performance/llm/pretrain_nemotronh_56b.py at commit 7a8f1cc7bc40a84447c0681a9e4e956a135ae8a2 "
    "(github.com/NVIDIA/NeMo)")
# Nemotron-H 56B as Megatron-LM's examples/post_training/modelopt/conf/nvidia/Nemotron-H-56B-Base-8K.sh
# builds it (hidden 8,192, 118 layers: 54 Mamba-2, 10 attention, 54 squared-ReLU MLP layers; 64 heads, 8
# query groups of 128; FFN 32,768; Mamba-2 state 256, its defaults' 8 groups and heads of 64, expand 2;
# untied embeddings, vocabulary 131,072), written as the Hugging Face config transformers' NemotronH takes.
NEMOTRON_H_56B = Path(__file__).parent / "models" / "nemotron_h_56b_base_8k.json"
NEMOTRON_H_ASSUMPTIONS = (
    "launch.sh's layout: TP 8 with sequence parallelism (the recipe's default), PP 1, CP 1, MBS 1, GBS 3 x GPUs "
    "(24 micro-batches a data rank), no recomputation, no CUDA graphs",
    "TP communication not overlapped (the recipe adds no MegatronCommOverlapCallback outside performance mode)",
    "the distributed optimizer costed as ZeRO-1; gradients reduced in bf16 (the FP8 branch of "
    "set_primary_perf_configs: grad_reduce_in_fp32 = False)",
    "flash attention through Transformer Engine (the script sets NVTE_FUSED_ATTN=0): FlashAttention-2",
    "the Mamba-2 mixers as Megatron-Core's MambaMixer runs them (mamba_ssm's fused conv + chunked scan, "
    "`megatron_activations.mamba2_terms`), split over TP by heads and groups",
    TE_LOSS,
)


def dgx_cloud_nemotron_h_runs() -> list[Run]:
    """DGX Cloud's Nemotron-H 56B rows (FP8, `HELD_OUT_FP8`): 32 to 2,048 H100, 8K tokens."""
    steps = zip((32, 64, 128, 256, 512, 1024, 2048), (15.119, 15.058, 15.496, 15.892, 15.586, 15.678, 15.723))
    return [nemo_run("Nemotron-H 56B", DGX_CLOUD_NEMOTRON_H, f"hf:{NEMOTRON_H_56B}", gpus, 3 * gpus, 8192, "fp8",
                     step, NEMOTRON_H_ASSUMPTIONS, tp=8, sp=True, attention="flash2", tp_comm_overlap=False,
                     grad_reduce_in_bf16=True, cross_entropy_fusion="te")
            for gpus, step in steps]


def dgx_cloud_dense_runs() -> list[Run]:
    return (dgx_cloud_llama_runs() + dgx_cloud_gpt3_runs() + dgx_cloud_nemotron_runs() + dgx_cloud_gb200_llama_runs()
            + dgx_cloud_gb200_nemotron_runs() + dgx_cloud_nemotron_h_runs())


# Grok-1 (314B, 8 experts, top 2): NeMo's scripts/performance/llm/pretrain_grok1_314b.py builds it as
# MixtralConfig8x7B with 64 layers, hidden 6144, 48 heads, 8 query groups, expert FFN 32,768, 8
# experts (SwiGLU, RMSNorm, RoPE, untied embeddings, top-2 routing with an auxiliary loss), over the
# Llama 3 70B tokenizer (128,256 tokens): meshplan's `moe:` spec of that shape.
DGX_CLOUD_GROK1 = (
    "NVIDIA dgxc-benchmarking grok1/README.md, H100 Performance (github.com/NVIDIA/dgxc-benchmarking, commit "
    "1f6d9f40e4117d7c71b726f86074ac01c29f87f5, the last release printing it; NeMo 25.04 container); recipe: its "
    "launch.sh and NeMo's scripts/performance/llm/pretrain_grok1_314b.py at commit "
    "6f2c6fdaffcc0af97a9e2219fcc104e2399627e4 (github.com/NVIDIA/NeMo), the commit its setup.sh pins")
GROK1_SPEC = "moe:layers=64,hidden=6144,heads=48,kv_heads=8,experts=8,top_k=2,expert_ffn=32768,vocab=128256"
GROK1_ASSUMPTIONS = (
    "Grok-1 as the script builds it: MixtralConfig8x7B at Grok-1's shape (SwiGLU experts), the Llama 3 tokenizer",
    "launch.sh's H100 layout: TP 4 with sequence parallelism, PP 8 with 8 virtual stages (one block a chunk, "
    "Megatron-Core's even split), CP 2, EP 8, expert TP 1, MBS 1, GBS 2 x GPUs, no CUDA graphs",
    "token dropping at capacity factor 1 with the experts' inputs padded to capacity (MegatronTokenDropCallback): "
    "every expert computes its balanced share; Megatron-Core's alltoall dispatcher (MixtralConfig), not overlapped",
    "TP communication overlapped with userbuffers (MegatronCommOverlapCallback(tp_comm_overlap=True))",
    "the distributed optimizer costed as ZeRO-1; gradients reduced in bf16 (pretrain_performance_optimizations "
    "and the FP8 branch set grad_reduce_in_fp32 = False)",
    "cuDNN fused attention (Transformer Engine's choice on Hopper); context parallelism as Transformer Engine's "
    "p2p ring; no recomputation (no recommended H100 row for grok1)",
    TE_LOSS,
)


# The same README's GB200 table (weak scaling, 128-512 GPUs): launch.sh's GB200 layout, CUDA graphs on.
DGX_CLOUD_GROK1_GB200 = DGX_CLOUD_GROK1.replace("H100 Performance", "GB200 Performance")
GROK1_GB200_ASSUMPTIONS = GROK1_ASSUMPTIONS[:1] + (
    "launch.sh's GB200 layout: TP 4 with sequence parallelism, expert TP 4, EP 8, no pipeline, no CP, MBS 1, "
    "GBS 2 x GPUs (8 micro-batches a data rank)",) + GROK1_ASSUMPTIONS[2:5] + (
    f"{CUDNN_BLACKWELL}; no recomputation", GROK1_ASSUMPTIONS[6], GB200_UNVALIDATED,
    "launch.sh's CUDA graphs (enable_cuda_graph: Megatron-Core's per-layer graphs) not priced: meshplan prices no "
    "host time")


def dgx_cloud_grok1_runs() -> list[Run]:
    """DGX Cloud's Grok-1 314B rows (HELD_OUT_MOE), 8,192 tokens, GBS 2 x GPUs, each under the recipe
    (`GROK1_ASSUMPTIONS`; FP8 as `NEMO_FP8`): on 512 H100, BF16 15.933 s and FP8 13.433 s a step; on
    128, 256 and 512 GB200 (`GROK1_GB200_ASSUMPTIONS`), BF16 7.325, 7.39 and 7.324 s, FP8 5.298, 5.224
    and 5.193 s."""
    return _grok1_h100_runs() + [
        Run(f"DGX Cloud GB200 Grok-1 314B {'fp8' if precision == 'fp8' else 'bf16'} tp4 etp4 ep8 x{gpus}",
            HELD_OUT_MOE, DGX_CLOUD_GROK1_GB200, "gb200-nvl72", GROK1_SPEC, gpus, 2 * gpus, 8192, tp=4, sp=True,
            zero=1, ep=8, etp=4, precision=precision, fp8_recipe="delayed" if precision == "fp8" else None,
            published_step_s=step_s, engine="megatron", attention="cudnn", tp_comm_overlap=True,
            grad_reduce_in_bf16=True, moe_capacity_factor=1.0, moe_pad_to_capacity=True, cross_entropy_fusion="te",
            assumptions=GROK1_GB200_ASSUMPTIONS + ((NEMO_FP8,) if precision == "fp8" else ()))
        for precision, steps in (("bf16-mixed", (7.325, 7.39, 7.324)), ("fp8", (5.298, 5.224, 5.193)))
        for gpus, step_s in zip((128, 256, 512), steps)]


def _grok1_h100_runs() -> list[Run]:
    return [Run(f"DGX Cloud Grok-1 314B {'fp8' if precision == 'fp8' else 'bf16'} tp4 pp8 vpp8 cp2 ep8",
                HELD_OUT_MOE, DGX_CLOUD_GROK1, "h100-sxm", GROK1_SPEC, 512, 1024, 8192, tp=4, pp=8, cp=2,
                vpp_options=(8,), sp=True, zero=1, ep=8, etp=1, precision=precision,
                fp8_recipe="delayed" if precision == "fp8" else None, published_step_s=step_s, engine="megatron",
                attention="cudnn", tp_comm_overlap=True, grad_reduce_in_bf16=True, moe_capacity_factor=1.0,
                moe_pad_to_capacity=True, stage_blocks=(1,) * 64, cross_entropy_fusion="te",
                assumptions=GROK1_ASSUMPTIONS + ((NEMO_FP8,) if precision == "fp8" else ()))
            for precision, step_s in (("bf16-mixed", 15.933), ("fp8", 13.433))]
