"""Published, measured training runs meshplan is judged on, split into fit sets and a held-out set.

Only the fit sets may tune the efficiency fields of `profiles/*.toml` (`fit_efficiency.py`); the
held-out runs are never looked at by a fit. Every run carries its source and the settings its
source does not publish, as assumptions.

Fit sets:
- `a100`: Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters
  Using Megatron-LM" (SC21, arXiv:2104.04473), Table 1.
- `h100`: Dubey et al. 2024, "The Llama 3 Herd of Models" (arXiv:2407.21783), Table 4, the two
  rows without context parallelism; and the Megatron-LM README's H100 weak-scaling table (GPT
  1.7B to 462B on 48 to 6144 H100s, Megatron-Core), every row: the README prints it as an image
  (`images/model_table.png`), transcribed by hand with every column, and the printed MFU and
  aggregate columns check the transcription (`MEGATRON_LM_H100_TABLE`).
- `fabric`: NVIDIA's published nccl-tests all-reduce bus bandwidths (one row per profile), which
  fit each profile's inter-node link efficiency.

Held out:
- Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
  (arXiv:2205.05198), Table 5 (A100 80GB).
- MosaicML llm-foundry's MPT training benchmarks (`data/mpt_llm_foundry.csv`): FSDP (ZeRO-3)
  on A100 40GB, A100 80GB and H100 80GB, every BF16 row.
- torchtitan's Llama 2 / Llama 3 FSDP2 figures on 64 A100 80GB (`docs/performance.md`), the rows
  whose activation checkpointing meshplan expresses (none or full).
- NVIDIA's DGX Cloud benchmarking recipes (github.com/NVIDIA/dgxc-benchmarking), their dense H100
  pre-training tables, every GPU count: Llama 3.1 8B, 70B, 405B and its proxies (v25.04; 405B on
  512 GPUs from v25.05.04, the later release printing that layout), GPT-3 175B and Nemotron-4 15B
  and 340B (v25.04), BF16 here and FP8 below, each under its release's NeMo recipe
  (`published_dgx_cloud_runs`); and v25.05.04's GB200 tables of the dense models meshplan builds
  (Llama 3.1 405B, Nemotron-4 340B weak- and strong-scaled; 128, 256 and 512 GPUs) under the
  launch.sh GB200 layouts, on the `gb200-nvl72` profile, which is not validated (H100's fit at
  GB200's measured matmul ceilings: these runs say how far that carries).

Held out, FP8 (`HELD_OUT_FP8`, reported apart from the BF16 held-out set): MosaicML's "H100 80GB
FP8" table (`data/mpt_llm_foundry_fp8.csv`), every row, under delayed scaling (Composer's amp_fp8);
torchtitan's Float8 tables on Meta's H100 96GB at a 500 W cap (`h100-96g-500w`, whose peak
torchtitan places between H100 SXM's and NVL's), the rows meshplan expresses: Table 2 (Llama 3.1
8B, FSDP x CP, 32K-256K tokens) and Table 4's "2D" row (Llama 3.1 70B, FSDP 32 x TP 8);
Megatron-Bridge's 25.11 DGX-H100 dense Llama rows (FP8 current scaling: 8B, 70B, 405B); the DGX
Cloud tables' FP8 rows (delayed scaling with fp8 parameters: NeMo's bf16_with_fp8_mixed), among
them v25.05.04's Nemotron-H 56B table (hybrid Mamba-2 / attention / MLP layers, TP 8, 32-2,048 H100;
`published_dgx_cloud_runs.dgx_cloud_nemotron_h_runs`), FP8 only, so in no FP8/BF16 pair.

Held out, MoE (`HELD_OUT_MOE`, reported apart, "MoE (held out)"), every run with expert
parallelism, costed under balanced routing:
- Megatron-MoE-ModelZoo's Qwen3 best-practice table (`best_practice/Qwen3/readme.md`, 256 H100,
  BF16, seq 4096, GBS 2048): the intra-node-EP row with Megatron FSDP and full recomputation
  (17.6 s), the TP 4 / PP 8 / VPP 4 / EP 8 row (29.0 s), and the two rows whose experts fold over
  tensor and data ranks at expert TP 1: the cross-node TP 2 / PP 8 / VPP 4 / EP 32 row without
  overlap (19.7 s), the same layout's "+1f1b overlap" row (17.6 s: Megatron-Core's combined 1F1B,
  `Run.moe_a2a_overlap`, priced by `costing.moe_overlap` from the schedule, not fitted) and the
  TP 2 / PP 32 / VPP 3 / EP 8 row (24.2 s), and its Qwen3-Next-80B-A3B row (128 H100, PP 4, VP 3,
  EP 32, 2.2 s; gated DeltaNet traced as its kernel runs it, `published_moe_runs.qwen3_next_run`); and
  its long-context table
  (TP 4, CP 1-8, PP 8, VPP 4, EP 8, 16K-128K tokens, the MoE layers recomputed), the forced-balance
  TFLOP/s, in the FLOP convention the short rows' step times and TFLOP/s together give; and the
  later readme's (`best_practice/qwen3/readme.md`) GB200 BF16 row (TP 1, PP 8, EP 8, 256 GPUs).
  (`published_moe_runs` builds them.) Its best-practice scripts' H100 figures
  (`published_zoo_script_runs`, which lists what it leaves out and why): run_h100_235b.sh's
  Qwen3-235B-A22B at TP 2 / PP 8 / VP 4 / EP 32 with the combined 1F1B, TP overlap and CUDA graphs of
  the router (320 TFLOP/s), and run_mixtral_8x22B.sh's Mixtral 8x22B on 128 GPUs at TP 2 / PP 8 / VP 7
  / EP 8, force-balanced (465) and dropping tokens at capacity 1 with padding (470).
- Megatron-Bridge's performance summary (`docs/performance-summary.md`), 25.11 container,
  DGX-H100: Qwen3-30B-A3B on 16 GPUs, FP8 current scaling, force-balanced and dropless.
- The same page's DGX-GB200 and DGX-B200 tables (`MEGATRON_BRIDGE_BLACKWELL`), every Qwen3 row:
  Qwen3-235B-A22B in BF16 on 256 GB200 (EP 32 inside an NVL72 domain) and in MXFP8 on 64 B200,
  Qwen3-30B-A3B in MXFP8 on 8 GB200 (micro-batch 4) and 8 B200 (micro-batch 1); MXFP8 under
  meshplan's mxfp8 recipe. Their profiles (`gb200-nvl72`, `b200`) carry H100's fit at each part's
  measured matmul ceilings, not validated on Blackwell.
- Megatron-Bridge's performance archive (`docs/performance-summary-archive.md`, commit 4ab94df):
  every distinct DGX-H100 MoE layout of its 2026 releases, once, from the latest release that
  prints it, with that release's recipes (the tag's `scripts/performance/configs`): Qwen3-30B-A3B
  on 16 GPUs, FP8-CS, EP 16 with HybridEP (26.06, tag v0.5.0), and GPT-OSS 120B on 64 GPUs, BF16,
  PP 4, EP 8, the norms and expert activations recomputed (26.04.01, tag v0.4.2), Nemotron 3 Nano
  (hybrid Mamba-2 / MoE / attention, the hub's config.json in `models/`) on 16 GPUs, FP8-CS, EP 8 with
  HybridEP, its MoE layers, norms, attention cores and expert activations recomputed (26.06, tag
  v0.5.0; `published_moe_runs.nemotron_3_nano_run`); and the DGX-H100
  Qwen3-235B-A22B layout (FP8-CS, TP 2, PP 8, VP 4, EP 32, the recipes' moe_a2a_overlap: Megatron-Core's
  combined 1F1B) at GBS 2048 (25.11, as the page's own correction, commit
  5776a6d90b4dd8692902ab2eb581369484e19283, restored the row) and at GBS 8192 (26.04.01, the latest
  release printing it) (`published_moe_runs.qwen3_235b_h100_overlapped_runs`).
- Megatron-Bridge's guides (skills/perf-expert-parallel-overlap/SKILL.md at commits 750d0d3 and
  7ded17d): Qwen3-30B-A3B in BF16 on 16 H100, EP 16, GBS 1024, with and without Megatron-Core's
  combined 1F1B, under the alltoall dispatcher (41.25 and 31.31 s) and under HybridEP with CUDA
  graphs over the router (24.71 and 20.99 s) (`published_moe_runs.megatron_bridge_docs_qwen3_30b_runs`,
  which lists the guides' other runs of the same layouts, left out).
- Megatron-Bridge's DeepSeek-V3 verification card (examples/model_verification_cards/deepseek-v3/card.yaml):
  its canonical H100 performance run, BF16 on 1,024 GPUs, TP 2 / PP 8 / VP 4 / EP 64, 61.756 s a step,
  under the recipe at the card's commit (`published_moe_runs.megatron_bridge_deepseek_v3_card_runs`); the
  other cards' H100 runs are Qwen3-30B-A3B's (the guides' HybridEP layout, above) and hybrid Mamba or
  linear-attention models meshplan does not profile (Nemotron 3, Qwen3.6).
- NVIDIA's DGX Cloud benchmarking recipes (github.com/NVIDIA/dgxc-benchmarking, commit
  1f6d9f40e4117d7c71b726f86074ac01c29f87f5): DeepSeek-V3 in BF16 on 512 and 1,024 H100 (TP 2, PP 8
  or 16, EP 64, 48.9 and 52.0 s a step), each under its recipe: NeMo's pretrain_deepseek_v3.py at
  the commit its setup.sh pins (token dropping at capacity factor 1 with padding, TP overlap off,
  its first- and last-stage block counts, the latent attention's up-projections recomputed, one
  multi-token-prediction layer on the last stage: `--mtp-num-layers 1`)
  (`published_moe_runs.dgx_cloud_deepseek_v3_runs`); and Grok-1 314B on 512 H100 in BF16 and FP8 (TP 4,
  PP 8, VP 8, CP 2, EP 8, 8,192 tokens, 15.933 and 13.433 s a step), under NeMo's
  pretrain_grok1_314b.py at the commit its setup.sh pins (Mixtral's config at Grok-1's shape, token
  dropping at capacity factor 1 with padding, userbuffers TP overlap), and the same README's GB200 table
  (128, 256 and 512 GPUs, BF16 and FP8: TP 4, expert TP 4, EP 8, no pipeline, launch.sh's GB200 layout
  with its CUDA graphs, which meshplan does not price) (`published_dgx_cloud_runs.dgx_cloud_grok1_runs`);
  and the DeepSeek-V3 README's GB200 table (128, 256 and 512 GPUs, BF16: TP 2, PP 4, EP 32 or 64, the
  attention core recomputed, no CUDA graphs) (`published_moe_runs.dgx_cloud_deepseek_v3_runs`).
Megatron-Bridge's rows are priced as `--engine megatron`, as its dense rows are, and so are the
ModelZoo's (Megatron-Core's main and MoE development branches of 2025, which the megatron recipe's
overlap and memory describe: its PP rows fit under that recipe, not under meshplan's executor's). Where the
engine's maintainers call a published figure a regression of that release, the run carries their
words (`Run.regression`); it is scored like any other, and bench_fidelity prints the set
without those runs beside it.

Left out, MoE: Megatron-Bridge 25.11's DeepSeek-V3 rows on DGX-GB200 (their printed layouts are not
the recipes' at the cited commit) and GB300 (no profile); its DGX-B200 row is held out
(`published_moe_runs.megatron_bridge_blackwell_deepseek_v3_runs`); its GB200 and GB300 rows (Blackwell recipes with CUDA graphs and
activation offloading); its long-context table's dropless figures (routing imbalance unpublished);
the 2026 archive's other DGX-H100 MoE rows: Qwen3-30B-A3B's PP 2 / VP 12 / EP 8 row of 26.02.01 (the recipe at
its tag, v0.3.1, runs EP 16 without pipelining, so the printed layout is not the recipe's) and
older releases' rows of the layouts above; 25.11's
GPT-OSS rows (the DGX-H100 row's PP 4 contradicts its GA 2 = 512 / (64 x 4), which only PP 1
gives; the Blackwell rows' printed layouts are not the recipes' at the cited commit: GB200 prints GBS
1280, MBS 1 and 8K tokens where gpt_oss_workload_base_configs.py runs 512, 4 and 4K, B200 prints EP 8
where it runs EP 64) and its 25.09 tables
(precision not stated), its DGX-GB300 rows (no GB300 profile). Megatron-LM's MoE README
(`megatron/core/transformer/moe/README.md`) quotes
468 TFLOP/s for Mixtral 8x7B without the layout, so no Mixtral 8x7B run is used (Mixtral 8x22B's
come from the ModelZoo's script, above).

Left out, DGX Cloud: the Llama 4 Maverick rows (chunked attention and MoE blocks alternating with dense
ones, which meshplan's `moe:` family does not build; the H100 table also prints VP 12 at PP 1),
the fine-tuning tables and MaxText's (JAX); the Llama 3.1 READMEs after v25.05.04 print no H100 figure.

Held out, torchtitan's selective op checkpointing (priced as its per-op policy reruns,
`planner/costing/torchtitan_sac.py`; `published_torchtitan_runs` builds them): its A100 table's
three "selective op" rows (Llama 3 8B at local batch 1, Llama 2 13B at 2 and 70B at 1, 64 GPUs) and
its two "selective layer" rows (every second block checkpointed whole, `Run.recompute_every`),
its H100 Tables 1 and 3 (Llama 3.1 8B, FSDP on 8 and 128 GPUs at local batch 2, every row: eager,
torch.compile, torch.compile + Float8, the compiled ones priced as eager), and Trainy's H200 rows
in torchtitan's repository (benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md: Llama 3.1 8B on
32 and 64 H200, torch.compile + Float8 with float8 all-gather).

Held out, torchtitan's async-TP tables (benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md: Llama 3.1
70B on 256 H100 at FSDP 32 x TP 8, full AC, local batch 16, and 8B on 64 at FSDP 8 x TP 8, per-op SAC,
local batch 12; BF16, Float8 tensorwise and rowwise, with and without async TP; compiled), every row
(`published_torchtitan_runs.torchtitan_async_tp_runs`).

Held out, torchao's float8 training benchmarks (its docs' workflows/training.md, NVIDIA H100 table:
Llama3-8b on 8 H100 under torchtitan, FSDP2, torch.compile, per-op SAC, local batch 1; BF16, Float8
tensorwise with float8 all-gather and rowwise with bf16 all-gather), every row
(`published_torchtitan_runs.torchao_float8_runs`).

Left out, with the reason: Llama 3 Table 4's 131,072-token row (a fit-set table: scoring it would
refit the H100 profile); torchtitan's Tables 5 and 6 (their pipelines' micro-batch counts and, for
interleaving, stages per rank are unpublished). Table 4's async-TP row is held out with its
vanilla-TP row since async TP is priced (`overlap.unpipelined_tp_comm_s`).
"""
from __future__ import annotations

import csv
from dataclasses import dataclass, field, replace
from pathlib import Path

DATA_DIR = Path(__file__).parent / "data"
FIT_SETS = ("a100", "h100")
HELD_OUT = "held-out"
HELD_OUT_FP8 = "held-out-fp8"  # FP8 runs: held out, and scored apart from the BF16 ones
HELD_OUT_MOE = "held-out-moe"  # mixture-of-experts runs: held out, and scored apart from the dense ones
GROUPS = FIT_SETS + (HELD_OUT, HELD_OUT_FP8, HELD_OUT_MOE)

NARAYANAN_2021 = ("Narayanan et al. 2021 (SC21, arXiv:2104.04473), Table 1; micro-batch sizes and "
                  "interleaving from Megatron-LM examples/sc21/run_table_1.sh")
KORTHIKANTI_2022 = "Korthikanti et al. 2022 (arXiv:2205.05198), Table 5"
LLAMA3_2024 = "Dubey et al. 2024, The Llama 3 Herd of Models (arXiv:2407.21783), Table 4"
MPT_SOURCE = ("MosaicML llm-foundry scripts/train/benchmarking/README.md "
              "(commit 061f2c7ce64e655100286584a7629e2a09f827ba)")
MPT_SWEEP_SOURCE = ("MosaicML llm-foundry scripts/train/benchmarking/ack_ckpt_limits.md, a micro-batch sweep "
                    "(commit beb8dee6922c5e31d27a24a713a1315b4013185d)")
MPT_LARGE_SCALE_SOURCE = ("MosaicML llm-foundry scripts/train/benchmarking/README.md, H100 80GB BF16 (Large Scale, "
                          ">= 128 GPUs) (commit 5e85bd62d4ec9e13353ca95877477602ab538e5b)")
# Composer's FSDP sharding strategies as ZeRO stages: FULL_SHARD reshards parameters after each
# forward and backward (ZeRO-3); SHARD_GRAD_OP keeps them gathered from the forward through the
# backward and shards gradients and optimizer state (ZeRO-2).
FSDP_SHARDING_ZERO = {"FULL_SHARD": 3, "SHARD_GRAD_OP": 2}
TORCHTITAN_A100 = ("torchtitan docs/performance.md, Llama 2 / Llama 3 on 64 A100 80GB with FSDP2 "
                   "(commit 041336434916bdc0f88c1f89fda176fd3c2092e4)")


@dataclass(frozen=True)
class Run:
    """One published configuration and what it measured.

    Exactly one of `published_step_s`, `published_tokens_per_s` (whole job),
    `published_model_tflops_per_gpu` (MFU convention, attention counted in full) and
    `published_causal_tflops_per_gpu` (Megatron-LM's `num_floating_point_operations`: causal
    attention, half the score products, no recomputation) is set.
    `vpp_options`: the virtual stages per rank; more than one when the source does not publish
    it, and then a fit weighs every option equally and the benchmark prints the spread.
    `mbs_options`: likewise the micro-batch sizes where the source does not publish it (empty:
    `mbs` is the published one); `layouts()` crosses the two under the engine's batch rules.
    """

    name: str
    group: str                 # "a100" or "h100" (fit sets) or HELD_OUT
    source: str
    cluster: str
    spec: str
    gpus: int
    global_batch: int
    seq: int
    tp: int = 1
    pp: int = 1
    mbs: int = 1
    zero: int = 0
    recompute: str = "none"
    sp: bool = False
    vpp_options: tuple[int, ...] = (1,)
    # the fused kernel the run ran: FlashAttention-2 as its papers publish it unless a row names
    # another (torchtitan's rows: torch SDPA's flash backend, whose Hopper speed meshplan measured)
    attention: str = "flash2"
    published_step_s: float = 0.0
    published_tokens_per_s: float = 0.0
    published_model_tflops_per_gpu: float = 0.0
    published_causal_tflops_per_gpu: float = 0.0
    assumptions: tuple[str, ...] = field(default=())
    precision: str = "bf16-mixed"
    cp: int = 1
    ep: int = 1
    etp: int | None = None  # expert tensor parallelism; None: the mesh's tp
    fp8_recipe: str | None = None  # under fp8, the recipe its source names (contracts.config.FP8_RECIPES)
    # the engine whose overlap (`contracts.overlap`) and memory price the step in bench_fidelity:
    # set where the run's engine and version are one meshplan models (torchtitan, Megatron-Bridge
    # 25.11, the Megatron-MoE-ModelZoo's Megatron-Core, llm-foundry's MPT runs); "generic"
    # otherwise (Megatron-LM of 2021-2022 predates the overlap `--engine megatron` prices; Llama 3's
    # stack is none of the engines): fused kernels, overlap and memory as meshplan's executor's
    engine: str = "generic"
    # Megatron-Core's --recompute-modules the run used; only the megatron memory recipe prices them
    # (bench_engine_memory); step-time fits cost the run's `recompute` (their time is elementwise work)
    recompute_modules: tuple[str, ...] = ()
    # the MoE token dispatcher the run's engine ran (`contracts.config.MOE_DISPATCHERS`)
    moe_dispatcher: str = "alltoall"
    # Megatron-LM's bf16 gradient buffer (--grad-reduce-in-bf16), which Megatron-Bridge's performance
    # recipes set (`ddp.grad_reduce_in_fp32 = False`); only the megatron memory recipe prices it
    grad_reduce_in_bf16: bool = False
    # where the engine's maintainers call the published figure a performance regression of that
    # release: their words and where they said them (the run is scored all the same)
    regression: str = ""
    # the TP overlap the run's recipe set apart from its engine's record (`ParallelConfig.tp_comm_overlap`)
    tp_comm_overlap: bool | None = None
    # torch's checkpoint early stop set apart from the engine's rule (`ParallelConfig.recompute_early_stop`):
    # False for runs measured under torch 2.0 or older, which rerun a checkpointed block whole
    recompute_early_stop: bool | None = None
    # token dropping: each expert's capacity in balanced shares, and whether inputs are padded to it
    moe_capacity_factor: float | None = None
    moe_pad_to_capacity: bool = False
    # transformer blocks per pipeline stage where the recipe cuts the model itself (Megatron-LM's
    # --decoder-first/last-pipeline-num-layers), the embedding on the first stage and the output
    # layer on the last; None: the engine's own cut (`costing.uniform.balanced_layer_chunks`)
    stage_blocks: tuple[int, ...] | None = None
    # torchtitan's layer SAC (`selective_ac_option = "N"`): with recompute "full", only every N-th block
    # is checkpointed (`engines.job.resolve_recompute`'s rule); pipelines not supported here
    recompute_every: int = 1
    # torch.compile on (torchtitan's `training.compile`, `ParallelConfig.torch_compile`): its Float8
    # casts priced fused, Inductor's other fusion not; an FP8/BF16 pair of one layout shares it
    # (bench_fidelity's `layout_of`)
    torch_compile: bool = False
    # the loss compiled apart from the model (`ParallelConfig.compile_loss`; None: with it): torchtitan
    # compiled the model alone before April 2025 (its runs of that time: False)
    compile_loss: bool | None = None
    # multi-token-prediction depths the recipe trains (Megatron-LM's --mtp-num-layers; `profiling.mtp`)
    mtp_num_layers: int = 0
    # Megatron-Core's combined 1F1B (--overlap-moe-expert-parallel-comm; `costing.moe_overlap`)
    moe_a2a_overlap: bool = False
    # under engine megatron, Megatron-Core's loss kernels (`costing.loss_kernels`): "native" where
    # the recipe's stack turns the fused loss on (NeMo's GPTConfig defaults cross_entropy_loss_fusion
    # to true; the ModelZoo's scripts pass --cross-entropy-loss-fusion), "te" where it also picks
    # Transformer Engine's kernel (Megatron-Bridge's performance scripts: `BRIDGE_TE_LOSS`), "none"
    # for Megatron-LM's own default
    cross_entropy_fusion: str = "native"
    # unpublished micro-batch sizes, each a candidate (see `layouts`); () when `mbs` is published
    mbs_options: tuple[int, ...] = ()
    # under fp8, the block Linears the run left in bf16 (torchtitan's filter_fqns; `contracts.fp8_choice`)
    fp8_filter: tuple[str, ...] = ()
    # where a source publishes FP8 runs against another source's BF16 runs of the same job (its own
    # words name that baseline): that source, for bench_fidelity's FP8/BF16 pairs; "" pairs within `source`
    bf16_baseline_source: str = ""

    def __post_init__(self):
        published = [self.published_step_s, self.published_tokens_per_s, self.published_model_tflops_per_gpu,
                     self.published_causal_tflops_per_gpu]
        if sum(value > 0 for value in published) != 1:
            raise ValueError(f"{self.name}: set exactly one published figure, got {published}")
        if not self.source:
            raise ValueError(f"{self.name}: every run needs its source")
        if self.group not in GROUPS:
            raise ValueError(f"{self.name}: group {self.group!r} is none of {GROUPS}")
        if self.recompute_every > 1 and (self.recompute != "full" or self.pp > 1):
            raise ValueError(f"{self.name}: recompute_every {self.recompute_every} needs recompute 'full' and no "
                             f"pipeline, got {self.recompute!r} at pp {self.pp}")

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq

    def layouts(self) -> tuple[tuple[int, int], ...]:
        """Every (micro-batch, virtual stages) the run may have run: the published ones, or each
        unpublished option the engine accepts (the micro-batch divides a data rank's batch into at
        least one micro-batch a pipeline stage; under interleaving their count is a multiple of
        the stages, as Megatron-LM required). Which of them fit memory is the caller's to ask."""
        per_rank = self.global_batch * self.tp * self.pp * self.cp // self.gpus
        out = []
        for mbs in self.mbs_options or (self.mbs,):
            microbatches = per_rank // mbs
            if self.mbs_options and (per_rank % mbs or microbatches < self.pp):
                continue
            out += [(mbs, vpp) for vpp in self.vpp_options
                    if not (self.mbs_options and vpp > 1 and microbatches % self.pp)]
        if not out:
            raise ValueError(f"{self.name}: no micro-batch of {self.mbs_options} splits {per_rank} samples a data "
                             f"rank over {self.pp} stages")
        return tuple(out)

    def recompute_for(self, engine: str) -> tuple[str, tuple[str, ...]]:
        """(recompute, recompute modules) as `engine` prices the run: Megatron-Core's modules under
        selective recomputation where the engine is megatron, else the run's `recompute` alone."""
        modules = self.recompute_modules if engine == "megatron" else ()
        return ("selective" if modules else self.recompute), modules


@dataclass(frozen=True)
class FabricRun:
    """A published nccl-tests all-reduce: `busbw_gb_s` over `group` ranks `stride` apart."""

    cluster: str
    size_bytes: float
    group: int
    stride: int
    busbw_gb_s: float
    source: str


# ------------------------------------------------------------------------------------------------
# Fit set a100: Narayanan et al. 2021 Table 1 (DGX A100 80GB, Selene; seq 2048, vocab 51200,
# full recomputation). The paper reports TFLOP/s per GPU counting recomputation,
# 96 B s l h^2 (1 + s/6h + V/16lh) FLOPs per step (its eq. 3); the step time is that over
# (GPUs x TFLOP/s).
SEQ_2048, VOCAB_51200 = 2048, 51200
# (name, layers, hidden, heads, tp, pp, gpus, gbs, mbs, layers per virtual stage or 0, TFLOP/s per GPU)
NARAYANAN_TABLE_1 = [
    ("1.7B", 24, 2304, 24, 1, 1, 32, 512, 16, 0, 137), ("3.6B", 30, 3072, 32, 2, 1, 64, 512, 16, 0, 138),
    ("7.5B", 36, 4096, 32, 4, 1, 128, 512, 16, 0, 142), ("18.4B", 40, 6144, 48, 8, 1, 256, 1024, 8, 0, 135),
    ("39.1B", 48, 8192, 64, 8, 2, 512, 1536, 4, 0, 138), ("76.1B", 60, 10240, 80, 8, 4, 1024, 1792, 2, 5, 140),
    ("145.6B", 80, 12288, 96, 8, 8, 1536, 2304, 2, 5, 148), ("310.1B", 96, 16384, 128, 8, 16, 1920, 2160, 1, 3, 155),
    ("529.6B", 105, 20480, 128, 8, 35, 2520, 2520, 1, 1, 163), ("1T", 128, 25600, 160, 8, 64, 3072, 3072, 1, 0, 163),
]
MEGATRON_2021_ASSUMPTIONS = (
    "unfused (math) attention, as Megatron-LM ran in 2021-2022",
    "ZeRO 0: plain data parallelism with the gradient all-reduce",
    "GPT-3 shape: learned positions, tied embedding, vocab 51200",
)
# (name, layers, hidden, heads, tp, pp, gpus, gbs, full-recompute s, SP + selective s)
KORTHIKANTI_TABLE_5 = [
    ("22B", 48, 6144, 64, 8, 1, 8, 4, 1.42, 1.10), ("175B", 96, 12288, 96, 8, 8, 64, 64, 18.13, 13.75),
    ("530B", 105, 20480, 128, 8, 35, 280, 280, 49.05, 37.83), ("1T", 128, 25600, 160, 8, 64, 512, 512, 94.42, 71.49),
]


def account_for_split(num_blocks: int, chunks: int) -> tuple[int, ...]:
    """Blocks per virtual chunk under Megatron-Core's --account-for-embedding-in-pipeline-split and
    --account-for-loss-in-pipeline-split: the embedding and the loss each count as a layer, the
    num_blocks + 2 "layers" split evenly over the chunks, so the first and last chunks hold one
    block fewer (`Run.stage_blocks`)."""
    per_chunk, rest = divmod(num_blocks + 2, chunks)
    if rest or chunks < 2:
        raise ValueError(f"{num_blocks} blocks, the embedding and the loss do not split evenly over {chunks} chunks")
    return (per_chunk - 1,) + (per_chunk,) * (chunks - 2) + (per_chunk - 1,)


def gpt_spec(layers: int, hidden: int, heads: int, vocab: int = VOCAB_51200) -> str:
    return f"gpt:layers={layers},hidden={hidden},heads={heads},vocab={vocab}"


def megatron_step_s(layers: int, hidden: int, gpus: int, gbs: int, tflops_per_gpu: float) -> float:
    """Narayanan et al. eq. (3): FLOPs per step with full recomputation, over the achieved rate."""
    seq, vocab = SEQ_2048, VOCAB_51200
    flops = 96 * gbs * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))
    return flops / (gpus * tflops_per_gpu * 1e12)


def narayanan_runs() -> list[Run]:
    runs = []
    for name, layers, hidden, heads, tp, pp, gpus, gbs, mbs, per_vstage, tflops in NARAYANAN_TABLE_1:
        # Megatron's layers per virtual stage -> virtual stages per rank (embedding and head are
        # extra layers here, so a chunk may hold one more).
        vpp = layers // (pp * per_vstage) if per_vstage else 1
        runs.append(Run(f"Narayanan21 T1 {name}", "a100", NARAYANAN_2021, "a100-80g", gpt_spec(layers, hidden, heads),
                        gpus, gbs, SEQ_2048, tp=tp, pp=pp, mbs=mbs, recompute="full", vpp_options=(vpp,),
                        attention="math", published_step_s=megatron_step_s(layers, hidden, gpus, gbs, tflops),
                        assumptions=MEGATRON_2021_ASSUMPTIONS))
    return runs


def korthikanti_runs() -> list[Run]:
    assumptions = MEGATRON_2021_ASSUMPTIONS + (
        "micro-batch 1 and no interleaving (Table 5 does not publish them)",
        "published figure: the measured iteration time",
    )
    runs = []
    for name, layers, hidden, heads, tp, pp, gpus, gbs, full_s, selective_s in KORTHIKANTI_TABLE_5:
        spec = gpt_spec(layers, hidden, heads)
        runs.append(Run(f"Korthikanti22 T5 {name} full", HELD_OUT, KORTHIKANTI_2022, "a100-80g", spec, gpus, gbs,
                        SEQ_2048, tp=tp, pp=pp, recompute="full", attention="math", published_step_s=full_s,
                        assumptions=assumptions))
        runs.append(Run(f"Korthikanti22 T5 {name} sp+sel", HELD_OUT, KORTHIKANTI_2022, "a100-80g", spec, gpus, gbs,
                        SEQ_2048, tp=tp, pp=pp, recompute="selective", sp=True, attention="math",
                        published_step_s=selective_s, assumptions=assumptions))
    return runs


def llama3_runs() -> list[Run]:
    """Table 4: TP 8, PP 16, seq 8192, 16M tokens per step (2048 sequences), BF16."""
    assumptions = (
        "interleaved 1F1B with 8 virtual stages per rank, one layer a chunk: the paper states no V, "
        "but 'we reduce one Transformer layer each from the first and the last stages ... This means "
        "that the first model chunk on the first stage has only the embedding, and the last model chunk "
        "on the last stage has only output projection and loss calculation' (Section 3.3.2) leaves "
        "chunks of one layer, and 126 layers with the embedding and the output in the two freed slots "
        "make 128 chunks, 8 on each of the 16 ranks (meshplan's 128 layers, embedding and head counted, "
        "chunked the same way)",
        "micro-batch 1 (the paper's 'batch size per DP' is micro-batches per replica)",
        "Meta's FSDP without resharding parameters ~ ZeRO-1 under pipelining",
        "model TFLOP/s in meshplan's MFU convention (attention counted in full)",
    )
    return [Run(f"Llama3 T4 405B {gpus} GPUs", "h100", LLAMA3_2024, "h100-sxm", "llama3-405b", gpus, 2048, 8192,
                tp=8, pp=16, zero=1, sp=True, vpp_options=(8,), published_model_tflops_per_gpu=tflops,
                assumptions=assumptions)
            for gpus, tflops in ((8192, 430.0), (16384, 400.0))]


# Megatron-LM README, "Training Speed and Scalability" (the table is the image
# images/model_table.png, read at commit d98e8a64ddf34856e74b24714e3bedb2f5a39553; the image last
# changed in f2e5db402c44ae309aa6448bcb4ae87e8ae0f5f4, 2024-07-15). Stated in the README's text:
# GPT models, vocab 131,072, sequence 4096, up to 6144 H100 GPUs, DP overlap
# (--overlap-grad-reduce --overlap-param-gather), TP overlap (--tp-comm-overlap) and PP overlap.
MEGATRON_LM_H100 = ("Megatron-LM README, Training Speed and Scalability, images/model_table.png "
                    "(commit d98e8a64ddf34856e74b24714e3bedb2f5a39553; image of 2024-07-15)")
VOCAB_131072, SEQ_4096 = 131072, 4096
H100_BF16_PEAK_TFLOPS = 989.0  # the README's MFU denominator: H100 SXM's dense BF16 peak (datasheet)
# (name, heads, hidden, layers, tp, pp, dp, gpus, batch size, per-GPU teraFLOP/s, MFU %, aggregate
# petaFLOP/s), every row and column as printed; MFU and the aggregate are kept to check the
# transcription (MFU is the TFLOP/s over H100_BF16_PEAK_TFLOPS, to its rounding).
MEGATRON_LM_H100_TABLE = [
    ("1.7B", 16, 2048, 24, 1, 1, 48, 48, 192, 408.8, 41, 19.6),
    ("7.1B", 32, 4096, 30, 2, 1, 48, 96, 192, 465.9, 47, 44.7),
    ("16B", 48, 6144, 32, 4, 1, 48, 192, 192, 489.1, 49, 93.9),
    ("32B", 56, 7168, 48, 8, 1, 48, 384, 192, 459.6, 46, 176.5),
    ("70B", 64, 8192, 84, 8, 2, 48, 768, 384, 419.7, 42, 322.3),
    ("119B", 80, 10240, 92, 8, 4, 48, 1536, 768, 420.5, 43, 645.9),
    ("177B", 96, 12288, 96, 8, 6, 48, 2304, 1152, 432.8, 44, 997.2),
    ("314B", 128, 16384, 96, 8, 8, 48, 3072, 1536, 474.4, 48, 1457.4),
    ("462B", 144, 18432, 112, 8, 16, 48, 6144, 3072, 459.9, 47, 2825.6),
]
MEGATRON_LM_H100_ASSUMPTIONS = (
    # implied, not stated: Megatron-LM accepts --tp-comm-overlap only with --sequence-parallel and
    # --overlap-param-gather only with --use-distributed-optimizer
    "sequence parallelism wherever TP > 1, and the distributed optimizer (ZeRO 1): both implied by "
    "the overlap flags the README names",
    "BF16 (the README does not name the precision; its MFU column is TFLOP/s over the BF16 peak)",
    "micro-batch not published: 1, 2 and 4 where they split a data rank's batch (at least one "
    "micro-batch a stage; under interleaving a multiple of the stages) and fit in memory; fits "
    "weigh the options equally",
    "no activation recomputation (not published; Megatron-LM's default)",
    "virtual stages per rank not published: 1 and every count that splits a rank's layers evenly "
    "(Megatron-LM accepts any such --num-layers-per-virtual-pipeline-stage, one layer a chunk "
    "included); fits weigh the options equally",
    "GPT shape: 4h MLP, untied embedding (the parameter counts match: 24 x 12 x 2048^2 + 2 x "
    "131072 x 2048 = 1.74B for '1.7B')",
    "attention priced at FlashAttention-2's speed, though Transformer Engine runs cuDNN's fused "
    "kernel on Hopper (its backend choice since 1.2): at cuDNN's published speed these rows read "
    "1.7B -8.8% and 7.1B -4.4%, a gap that halves as the hidden size doubles, so the slower kernel "
    "stands in for something of that scaling these runs pay and meshplan does not price",
    "model TFLOP/s in meshplan's MFU convention (attention counted in full, no recomputation)",
    "priced as --engine megatron: the README's overlap flags are the ones that engine's overlap "
    "prices; the Megatron-Core release of mid-2024 that ran it is not named",
    "gradients reduce-scattered in fp32: Megatron-LM at the image's commit (f2e5db4) forces "
    "accumulate_allreduce_grads_in_fp32 under --bf16 and has no --grad-reduce-in-bf16",
    "the unfused loss (--cross-entropy-fusion none): the README names no --cross-entropy-loss-fusion, "
    "off by default in Megatron-LM",
)


def megatron_lm_h100_runs() -> list[Run]:
    """Every row of the README's H100 weak-scaling table (fit set h100); each layout (TP, PP, DP,
    GPUs, batch) is printed in full, so no row is skipped."""
    runs = []
    for name, heads, hidden, layers, tp, pp, dp, gpus, gbs, tflops, _mfu, _aggregate in MEGATRON_LM_H100_TABLE:
        if tp * pp * dp != gpus:
            raise ValueError(f"Megatron-LM H100 {name}: TP {tp} x PP {pp} x DP {dp} != {gpus} GPUs")
        per_rank = layers // pp
        vpp_options = tuple(v for v in range(1, per_rank + 1) if per_rank % v == 0) if pp > 1 else (1,)
        runs.append(Run(f"Megatron-LM H100 GPT {name} tp{tp} pp{pp} dp{dp}", "h100", MEGATRON_LM_H100, "h100-sxm",
                        gpt_spec(layers, hidden, heads, VOCAB_131072) + ",tied=false", gpus, gbs, SEQ_4096,
                        tp=tp, pp=pp, zero=1, sp=tp > 1, vpp_options=vpp_options, mbs_options=(1, 2, 4),
                        published_model_tflops_per_gpu=tflops, assumptions=MEGATRON_LM_H100_ASSUMPTIONS,
                        engine="megatron", cross_entropy_fusion="none"))
    return runs


# The same README's "Strong Scaling Results" (images/strong_scaling.png, Megatron-Core r0.8.0): "the
# standard GPT-3 model (slightly more than 175 billion parameters due to larger vocabulary size)
# from 96 H100 GPUs to 4,608 GPUs, using the same batch size of 1,152 sequences throughout ...
# a reduction in MFU from 47% to 42%". The two ends, whose MFU the text states, are held out (the
# points between are only plotted). (GPUs, MFU %)
MEGATRON_LM_H100_STRONG = ("Megatron-LM README, Strong Scaling Results (text and images/strong_scaling.png; "
                           "commit d98e8a64ddf34856e74b24714e3bedb2f5a39553)")
MEGATRON_LM_H100_STRONG_ENDS = ((96, 47.0), (4608, 42.0))


def megatron_lm_strong_scaling_runs() -> list[Run]:
    """The strong-scaling series' two ends (held out): the weak-scaling table's 177B run (its model,
    TP, PP, batch and unpublished-layout options) on 96 and 4,608 GPUs at the MFU the README's text
    gives."""
    row = next(run for run in megatron_lm_h100_runs() if " 177B " in run.name)
    assumptions = row.assumptions + (
        f"the weak-scaling row's TP {row.tp} and PP {row.pp} (not stated for this series; the plotted points at "
        "96, 144 and 288 GPUs leave PP 1, 2, 3 or 6 under TP 8, and 6 is the 177B row's), DP the rest",
        f"MFU as the README's text rounds it (47% and 42% of the {H100_BF16_PEAK_TFLOPS:.0f} TFLOP/s peak)",
    )
    return [replace(row, name=f"Megatron-LM H100 strong GPT 177B tp{row.tp} pp{row.pp} dp{gpus // (row.tp * row.pp)}",
                    group=HELD_OUT, source=MEGATRON_LM_H100_STRONG, gpus=gpus,
                    published_model_tflops_per_gpu=mfu / 100 * H100_BF16_PEAK_TFLOPS, assumptions=assumptions)
            for gpus, mfu in MEGATRON_LM_H100_STRONG_ENDS]


# MPT shapes from llm-foundry's scripts/train/yamls/pretrain/mpt-*.yaml: (layers, d_model, heads);
# GPT-style blocks as MPTConfig's defaults at the benchmarks' commit build them (biases, learned
# positions, no ALiBi: `no_bias`, `learned_pos_emb` and `alibi` unset by the yamls), tied embedding, vocab 50368.
# The `gpt:` spec keeps biases and a learned position table: its parameter count is within 0.1%
# of the NumParams the tables print.
MPT_SHAPES = {"125m": (12, 768, 12), "350m": (24, 1024, 16), "760m": (24, 1536, 12), "1b": (24, 2048, 16),
              "3b": (32, 2560, 20), "7b": (32, 4096, 32), "13b": (40, 5120, 40), "30b": (48, 7168, 56),
              "70b": (80, 8192, 64)}
MPT_VOCAB = 50368
MPT_CLUSTERS = {"h100_80gb": "h100-sxm", "a100_80gb": "a100-80g", "a100_40gb": "a100-40g"}


MPT_OLD_TORCH = ("measured under torch 2.0 or older: a checkpointed block reruns whole (torch's early stop came "
                 "with 2.1)")
MPT_FP8_ASSUMPTIONS = (
    "amp_fp8: Composer's Transformer Engine Linears under TE's default recipe, delayed scaling (--fp8-recipe "
    "delayed); FSDP1 gathers bf16 weights (meshplan gathers delayed-scaled weights in bf16 outside Megatron)",
)


def mpt_runs(path: Path = DATA_DIR / "mpt_llm_foundry.csv", group: str = HELD_OUT,
             precision: str = "bf16-mixed", source: str = MPT_SOURCE, label: str = "",
             before_torch_2_1: bool = False) -> list[Run]:
    """The rows of one of llm-foundry's benchmark tables (`label` tells a table's run names apart).
    `before_torch_2_1`: the whole table was measured under torch 2.0 or older; otherwise a row whose
    MP Mode is PURE was (the tables' runs before their October 2023 update: torch 1.13.1)."""
    assumptions = (
        "Composer FSDP FULL_SHARD = ZeRO-3 over all GPUs (SHARD_GRAD_OP, where a row names it, = ZeRO-2); "
        "activation checkpointing = full recomputation",
        "llm-foundry's Triton flash attention (attn_impl triton, submit_benchmarks.py's default; no ALiBi bias: "
        "MPTConfig's default), causal",
        "the MPT block run eagerly (Composer, no torch.compile): its elementwise kernels counted from llm-foundry's "
        "code (`eager_kernels.foundry_bytes_per_token`)",
        "MosaicML's RoCE fabric (8 x 200 Gb/s per node) costed as the profile's InfiniBand rails",
    ) + (MPT_FP8_ASSUMPTIONS if precision == "fp8" else ())
    runs = []
    with path.open() as handle:
        for row in csv.DictReader(line for line in handle if not line.startswith("#")):
            layers, hidden, heads = MPT_SHAPES[row["model"]]
            gpus, mbs, accum, gbs = (int(row[k]) for k in ("gpus", "mbs", "grad_accum", "gbs"))
            if gbs != gpus * mbs * accum:
                raise ValueError(f"{path}: {row} has global batch {gbs} != gpus x mbs x accumulation")
            name = (f"MPT {row['model']} {row['table']}{' fp8' if precision == 'fp8' else ''}{label} s{row['seq']} "
                    f"x{gpus} mbs{mbs}")
            old_torch = before_torch_2_1 or row.get("mp_mode") == "PURE"
            runs.append(Run(name, group, source, MPT_CLUSTERS[row["table"]],
                            gpt_spec(layers, hidden, heads, MPT_VOCAB), gpus, gbs, int(row["seq"]), mbs=mbs,
                            zero=FSDP_SHARDING_ZERO[row.get("sharding") or "FULL_SHARD"],
                            recompute="full" if row["activation_checkpointing"] == "True" else "none",
                            attention="triton-alibi", published_tokens_per_s=float(row["tokens_per_s"]),
                            assumptions=assumptions + ((MPT_OLD_TORCH,) if old_torch else ()), precision=precision,
                            fp8_recipe="delayed" if precision == "fp8" else None, engine="llm-foundry",
                            recompute_early_stop=False if old_torch else None))
    return runs


def mpt_fp8_runs() -> list[Run]:
    return mpt_runs(DATA_DIR / "mpt_llm_foundry_fp8.csv", HELD_OUT_FP8, "fp8")


def mpt_sweep_runs() -> list[Run]:
    """llm-foundry's micro-batch sweep (held out): the same model and sequence at micro-batches 1, 2
    and 4, which isolates what a micro-batch costs beyond its FLOPs under FSDP."""
    # measured in August 2023 under sweep.sh's image of then, mosaicml/pytorch:2.0.1_cu118
    return mpt_runs(DATA_DIR / "mpt_llm_foundry_mbs_sweep.csv", source=MPT_SWEEP_SOURCE, label=" sweep",
                    before_torch_2_1=True)


def mpt_large_scale_runs() -> list[Run]:
    """llm-foundry's H100 table at 128-512 GPUs (held out): FSDP across 16-64 nodes, ZeRO-3 for 7B
    and up, ZeRO-2 (SHARD_GRAD_OP) for 1B and 3B."""
    return mpt_runs(DATA_DIR / "mpt_llm_foundry_large_scale.csv", source=MPT_LARGE_SCALE_SOURCE, label=" large")


TORCHTITAN_H100 = ("torchtitan docs/performance.md, Llama 3.1 on Grand Teton H100 (96GB HBM2e, 500 W cap), "
                   "torch.compile + Float8 (commit 9dec370ad26b5f8e9a7333a0e36165018262644b tested; page as of "
                   "commit 0edd2fb, tables 2 and 4)")
TORCHTITAN_H100_SAC = ("torchtitan docs/performance.md, Llama 3.1 8B on Grand Teton H100 (96GB HBM2e, 500 W "
                       "cap), FSDP with selective op checkpointing (commit 9dec370ad26b5f8e9a7333a0e36165018262644b "
                       "tested; page as of commit 0edd2fb, tables 1 and 3)")
TORCHTITAN_ASYNC_TP = ("torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md, Llama 3.1 8B and 70B on "
                       "Grand Teton H100 (96GB HBM2e, 500 W cap), FSDP x TP 8 with and without async TP, "
                       "torch.compile (torch 38410cf9, torchtitan 820504e, June 2025)")
# The commit message of torchtitan's auto filter (pytorch/torchtitan#1319, commit b0902b2, July 2025):
# the async-TP table's 70B job, Float8 rowwise with attention.wk and attention.wv left in bf16. It gives
# "~660" and "~695" TPS where its other figures ("~597", "~600", "~625") are the table's 597.3, 599.6
# and 624.8 rounded, so its baseline is the table's BF16 runs (`Run.bf16_baseline_source`).
TORCHTITAN_ROWWISE_FILTER = ("torchtitan commit b0902b2 ([float8] add _auto_filter_for_recipe, #1319), Llama 3 70B "
                             "on 256 Grand Teton H100, FSDP 32 x TP 8, torch.compile, full AC, local batch 16: "
                             "Float8 rowwise without attention.wk, attention.wv converted ('~' figures, rounded "
                             "to the TPS)")
TORCHAO_FLOAT8 = ("torchao docs/source/workflows/training.md, e2e training benchmarks: Llama3-8b on 8 H100, "
                  "torchtitan 0.0.2 with FSDP2, torch.compile and per-op SAC, local batch 1, 8,192 tokens (torch "
                  "2.7.0a0+gitb98af95, torchao 0.10.0+git890e0ac8)")
TRAINY_H200 = ("torchtitan benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md, Llama 3.1 8B on 4 and 8 hosts of "
               "8 H200 (Trainy on WhiteFiber, June 2025; torchtitan e7c0cae, torch 2.8.0a0 of NGC 25.05)")


LLAMA2_13B = "llama:layers=40,hidden=5120,heads=40,kv_heads=40,ffn=13824,vocab=32000"
LLAMA2_70B = "llama:layers=80,hidden=8192,heads=64,kv_heads=8,ffn=28672,vocab=32000"


# Held out, MoE. Both sources run Megatron-Core MoE (grouped GEMMs, the distributed optimizer),
# on DGX H100 (8 GPUs per node on NVLink, 8 x 400 Gb/s InfiniBand rails), and Megatron-Bridge
# also on DGX-GB200 (NVL72 racks) and DGX-B200.
MEGATRON_MOE_QWEN3 = ("Megatron-MoE-ModelZoo best_practice/Qwen3/readme.md, Performance Results, 256 H100 "
                      "(github.com/yanring/Megatron-MoE-ModelZoo, commit c1ad0b5c89f425d60febddc38e7f741a16f08bd1)")
MEGATRON_MOE_QWEN3_GB200 = ("Megatron-MoE-ModelZoo best_practice/qwen3/readme.md, GB200, BF16 row "
                            "(github.com/yanring/Megatron-MoE-ModelZoo, commit 020b8136b3bc6f47e4143849f54e400cf0f71e8a)")
MEGATRON_BRIDGE_H100 = ("Megatron-Bridge docs/performance-summary.md, 25.11 NeMo container, DGX-H100 "
                        "(github.com/NVIDIA-NeMo/Megatron-Bridge, commit 00b7660be0254ac6f95f44164ddd0c3e9cc798ed)")
MEGATRON_BRIDGE_BLACKWELL = ("Megatron-Bridge docs/performance-summary.md, 25.11 NeMo container, DGX-GB200 and "
                             "DGX-B200 (github.com/NVIDIA-NeMo/Megatron-Bridge, commit "
                             "00b7660be0254ac6f95f44164ddd0c3e9cc798ed)")
# Megatron-Bridge 25.11's performance configs (`scripts/performance/configs/llama/llama3_llm_pretrain.py`,
# `llama31_llm_pretrain.py`, `qwen/qwen3_llm_pretrain.py`: `set_*_common_configs`) set
# `ddp.grad_reduce_in_fp32 = False` for every Llama 3, Llama 3.1 and Qwen3 row.
BRIDGE_BF16_GRADS = "gradients accumulated and reduced in bf16 (the performance configs' grad_reduce_in_fp32 = False)"
# Megatron-Bridge's performance runs compute the loss with Transformer Engine's fused cross-entropy:
# GPTModelProvider defaults cross_entropy_loss_fusion to True, and the performance scripts set
# cross_entropy_fusion_impl = "te" (scripts/performance/utils/overrides.py, _set_common_perf_overrides, at
# 25.11's commit 00b7660 and at tags v0.4.2 and v0.5.0; src/megatron/bridge/perf_recipes/_common.py,
# _benchmark_common, at the DeepSeek-V3 card's commit 6d9a87d).
BRIDGE_TE_LOSS = ("Transformer Engine's fused cross-entropy (--cross-entropy-fusion te: the performance scripts set "
                  "cross_entropy_fusion_impl = 'te')")
def megatron_bridge_dense_runs() -> list[Run]:
    """Megatron-Bridge's 25.11 DGX-H100 dense Llama rows (FP8 current scaling, HELD_OUT_FP8)."""
    assumptions = (
        "FP8-CS: Transformer Engine's per-tensor current scaling (--fp8-recipe tensorwise)",
        "no recomputation (not published); the distributed optimizer costed as ZeRO-1, Megatron FSDP as ZeRO-3",
        "sequence parallelism with TP and its communication overlap (Megatron-Bridge's performance recipes: "
        "--engine megatron's overlap)",
        "Llama 3.1 405B costed as llama3-405b (the same shape)",
        "cuDNN fused attention (Transformer Engine's default on Hopper)",
    )
    rows = [("LLAMA3_8B", "llama3-8b", 8, 128, 1, 3, 1, 1, 1, 1, 14451.0),
            ("LLAMA3_70B", "llama3-70b", 64, 128, 1, 1, 4, 8, 1, 5, 1602.0),
            ("LLAMA3.1_405B", "llama3-405b", 1024, 512, 1, 1, 8, 8, 2, 8, 292.0)]
    return [Run(f"Megatron-Bridge {name} fp8 tp{tp} pp{pp} cp{cp}", HELD_OUT_FP8, MEGATRON_BRIDGE_H100, "h100-sxm",
                spec, gpus, gbs, 8192, tp=tp, pp=pp, mbs=mbs, zero=zero, sp=tp > 1, cp=cp, vpp_options=(vpp,),
                precision="fp8", fp8_recipe="tensorwise", engine="megatron", attention="cudnn",
                published_tokens_per_s=tps * gpus, assumptions=assumptions + (BRIDGE_BF16_GRADS, BRIDGE_TE_LOSS),
                grad_reduce_in_bf16=True, cross_entropy_fusion="te")
            for name, spec, gpus, gbs, mbs, zero, tp, pp, cp, vpp, tps in rows]


# Fabric fit set: NVIDIA's NCCL team's published all-reduce bus bandwidths at large sizes.
FABRIC_RUNS = [
    # "On an Nvidia DGX-A100 system we have 8x200Gbit/s IB cards and we measure 192GB/s AllReduce
    # BusBW" (github.com/NVIDIA/nccl/issues/812, 2023-03-31): 4 nodes, 8 GiB.
    FabricRun("a100-80g", 2**33, 32, 1, 192.0, "github.com/NVIDIA/nccl/issues/812"),
    # "For NDR @ 400Gbps you should see 46-48GB/s per NIC" (github.com/NVIDIA/nccl-tests/issues/290,
    # 2025-03-03): a per-NIC figure, so it is fitted as what one NIC carries, a group of one GPU
    # per node (8 nodes, stride 8) at 47 GB/s. (A full-node group's ring is capped by NVLink's
    # 360 GB/s in meshplan's model, below 8 x 47, so it cannot identify the NIC's efficiency.)
    FabricRun("h100-sxm", 2**33, 8, 8, 47.0, "github.com/NVIDIA/nccl-tests/issues/290"),
]


def all_runs() -> list[Run]:
    return (narayanan_runs() + llama3_runs() + megatron_lm_h100_runs() + korthikanti_runs()
            + megatron_lm_strong_scaling_runs() + mpt_runs() + mpt_sweep_runs()
            + mpt_large_scale_runs() + torchtitan_runs() + mpt_fp8_runs()
            + torchtitan_h100_runs() + torchtitan_sac_runs() + torchtitan_async_tp_runs() + torchtitan_rowwise_filter_runs() + torchao_float8_runs() + megatron_bridge_dense_runs()
            + dgx_cloud_dense_runs()
            + moe_runs() + zoo_script_runs())


def fit_runs(fit_set: str) -> list[Run]:
    if fit_set not in FIT_SETS:
        raise ValueError(f"unknown fit set {fit_set!r}; known: {', '.join(FIT_SETS)}")
    return [run for run in all_runs() if run.group == fit_set]


def held_out_runs() -> list[Run]:
    return [run for run in all_runs() if run.group == HELD_OUT]


# The MoE, DGX Cloud, torchtitan and ModelZoo-script runs build on this module's Run and sources, all
# defined above.
from published_dgx_cloud_runs import dgx_cloud_dense_runs  # noqa: E402
from published_moe_runs import moe_runs  # noqa: E402
from published_torchtitan_runs import (torchao_float8_runs, torchtitan_async_tp_runs,  # noqa: E402
                                       torchtitan_h100_runs, torchtitan_rowwise_filter_runs, torchtitan_runs,
                                       torchtitan_sac_runs)
from published_zoo_script_runs import zoo_script_runs  # noqa: E402  (after published_moe_runs, which it reads)
