"""torchtitan's published runs (held out): its A100 and H100 performance tables, a user's H200
benchmark in its repository and the figures of its Float8 auto-filter commit, each under
`--engine torchtitan`. Split from `published_runs` (which
defines `Run` and the sources), whose `all_runs` adds these.

"selective op" rows ran torchtitan's per-op selective activation checkpointing, the default of its
Llama 3 8B config (`selective_ac_option = "op"`), priced as its policy reruns
(`planner/costing/torchtitan_sac.py`); "selective layer" rows checkpoint every second block whole
(`Run.recompute_every`, the rule `estimate --from` reads a torchtitan config by). torch.compile
(`Run.torch_compile`, `--compile`) is priced for its Float8 casts only (fused with the ops before
them, torchao's float8 roofline); Inductor's other fusion is not modelled.
"""
from __future__ import annotations

from published_runs import (HELD_OUT, HELD_OUT_FP8, LLAMA2_13B, LLAMA2_70B, TORCHAO_FLOAT8, TORCHTITAN_A100,
                            TORCHTITAN_ASYNC_TP, TORCHTITAN_H100, TORCHTITAN_H100_SAC, TORCHTITAN_ROWWISE_FILTER,
                            TRAINY_H200, Run)

FLOAT8 = ("torchao Float8 tensorwise with float8 all-gather (--fp8-recipe tensorwise); torch.compile (--compile) "
          "priced for its fused casts only")
H100_PEAK = "h100-96g-500w's peak: midpoint of H100 SXM and NVL (torchtitan: 'between SXM and NVL')"
# torchtitan's layer SAC at the A100 table's commit: `selective_ac_option` defaults to "2"
# (torchtitan/config_manager.py), every second block checkpointed whole
LAYER_SAC_EVERY = 2
LAYER_SAC = "selective layer checkpointing: every second block fully recomputed (torchtitan's default option '2')"
OP_SAC = ("selective op activation checkpointing: torchtitan's policy (every second mm and everything but the "
          "attention kernel rerun; Float8 Linears alike: the policy sees their aten.mm on torchao's subclass)")


def torchtitan_runs() -> list[Run]:
    """64 A100 80GB, FSDP2 (ZeRO-3) over all 64, local batch = micro-batch (no accumulation).
    WPS is tokens per second per GPU; the "selective op" rows under torchtitan's per-op policy."""
    assumptions = (
        "FSDP2 fully_shard = ZeRO-3 over the 64 GPUs, no gradient accumulation",
        "Meta's A100 fabric costed as DGX A100 (8 x 200 Gb/s rails per node)",
        "SDPA flash attention, causal; no torch.compile",
    )
    rows = [("Llama3 70B bs1 full", "llama3-70b", 8192, 1, "full", 331.0),
            ("Llama2 13B bs2 none", LLAMA2_13B, 4096, 2, "none", 2162.0),
            ("Llama2 70B bs2 full", LLAMA2_70B, 4096, 2, "full", 353.0),
            ("Llama3 8B bs1 selective op", "llama3-8b", 8192, 1, "selective", 2973.0),
            ("Llama2 13B bs2 selective op", LLAMA2_13B, 4096, 2, "selective", 1904.0),
            ("Llama2 70B bs1 selective op", LLAMA2_70B, 4096, 1, "selective", 355.0),
            ("Llama3 8B bs1 selective layer", "llama3-8b", 8192, 1, "layer", 2904.0),
            ("Llama2 13B bs2 selective layer", LLAMA2_13B, 4096, 2, "layer", 1914.0)]
    return [Run(f"torchtitan {name}", HELD_OUT, TORCHTITAN_A100, "a100-80g", spec, 64, 64 * mbs, seq, mbs=mbs,
                zero=3, recompute="full" if recompute == "layer" else recompute,
                recompute_every=LAYER_SAC_EVERY if recompute == "layer" else 1, published_tokens_per_s=wps * 64,
                assumptions=assumptions + {"selective": (OP_SAC,), "layer": (LAYER_SAC,)}.get(recompute, ()),
                engine="torchtitan", attention="sdpa-flash")
            for name, spec, seq, mbs, recompute, wps in rows]


def torchtitan_h100_runs() -> list[Run]:
    """torchtitan's H100 tables whose layouts meshplan expresses (HELD_OUT_FP8): Table 2, Llama 3.1
    8B on 8 GPUs with FSDP x CP at 32K-256K tokens, and Table 4's two rows, Llama 3.1 70B on 256
    GPUs with FSDP 32 x TP 8, vanilla and async TP. Float8 is torchao's tensorwise recipe
    (--fp8-recipe tensorwise)."""
    assumptions = (
        FLOAT8,
        "full activation checkpointing = full recomputation; no gradient accumulation",
        "FSDP2 over dp x cp = ZeRO-3 over the data ranks; TP with sequence parallelism (torchtitan's)",
        H100_PEAK,
    )
    rows = [(32768, 1, 3890.0), (65536, 2, 2540.0), (131072, 4, 1071.0), (262144, 8, 548.0)]
    runs = [Run(f"torchtitan H100 Llama3.1 8B fp8 cp{cp} s{seq}", HELD_OUT_FP8, TORCHTITAN_H100, "h100-96g-500w",
                "llama3-8b", 8, 8 // cp, seq, zero=3, recompute="full", cp=cp, precision="fp8",
                fp8_recipe="tensorwise", published_tokens_per_s=tps * 8, assumptions=assumptions, engine="torchtitan",
                attention="sdpa-flash", torch_compile=True, compile_loss=False)
            for seq, cp, tps in rows]
    for overlap, tps in ((False, 829.0), (True, 876.0)):  # Table 4's "2D" and "2D + AsyncTP" rows
        runs.append(Run(f"torchtitan H100 Llama3.1 70B fp8 fsdp32 tp8{' async-tp' if overlap else ''}", HELD_OUT_FP8,
                        TORCHTITAN_H100, "h100-96g-500w", "llama3-70b", 256, 512, 8192, tp=8, mbs=16, zero=3,
                        recompute="full", sp=True, precision="fp8", fp8_recipe="tensorwise", tp_comm_overlap=overlap,
                        published_tokens_per_s=tps * 256, engine="torchtitan", attention="sdpa-flash",
                        torch_compile=True, compile_loss=False,
                        assumptions=assumptions + (("async TP: torch's micro-pipelined all-gather and reduce-scatter "
                                                    "matmuls, priced as TP communication overlap (--tp-comm-overlap)",)
                                                   if overlap else ())))
    return runs


def torchtitan_sac_runs() -> list[Run]:
    """Llama 3.1 8B under FSDP2 over every GPU at local batch 2 and 8,192 tokens (torchtitan's
    llama3_8b.toml), selective op checkpointing: torchtitan's H100 Tables 1 (8 GPUs) and 3 (128),
    every row (eager, torch.compile, torch.compile + Float8; BF16 rows held out with the BF16 set,
    Float8 rows with the FP8 set), and Trainy's H200 rows (32 and 64 GPUs, torch.compile + Float8
    with float8 all-gather; torchtitan e7c0cae)."""
    runs = []
    for gpus, label, tps, precision in ((8, "", 5762.0, "bf16-mixed"), (8, " compile", 6667.0, "bf16-mixed"),
                                        (8, " compile", 8532.0, "fp8"), (128, "", 5605.0, "bf16-mixed"),
                                        (128, " compile", 6514.0, "bf16-mixed"), (128, " compile", 8380.0, "fp8")):
        fp8 = precision == "fp8"
        compiled = ("torch.compile (--compile): nothing of it priced in BF16",) if label and not fp8 else ()
        runs.append(Run(f"torchtitan H100 Llama3.1 8B{label}{' fp8' if fp8 else ''} fsdp{gpus} selective op",
                        HELD_OUT_FP8 if fp8 else HELD_OUT, TORCHTITAN_H100_SAC, "h100-96g-500w", "llama3-8b",
                        gpus, 2 * gpus, 8192, mbs=2, zero=3, recompute="selective", precision=precision,
                        fp8_recipe="tensorwise" if fp8 else None, published_tokens_per_s=tps * gpus,
                        engine="torchtitan", attention="sdpa-flash", torch_compile=bool(label), compile_loss=False,
                        assumptions=((FLOAT8,) if fp8 else ()) + compiled + (OP_SAC, H100_PEAK)))
    for gpus, tps in ((32, 10938.0), (64, 10753.0)):
        runs.append(Run(f"Trainy H200 Llama3.1 8B compile fp8 fsdp{gpus} selective op", HELD_OUT_FP8, TRAINY_H200,
                        "h200", "llama3-8b", gpus, 2 * gpus, 8192, mbs=2, zero=3, recompute="selective",
                        precision="fp8", fp8_recipe="tensorwise", published_tokens_per_s=tps * gpus,
                        engine="torchtitan", attention="sdpa-flash", torch_compile=True,
                        assumptions=(FLOAT8, OP_SAC, "WhiteFiber's hosts (8 H200 on NVLink, 400 Gb/s per GPU) "
                                                      "costed as DGX H200")))
    return runs


# What torchtitan's async-TP table says of its vanilla-TP Float8 rowwise rows (kept as the run's words;
# not a release regression, so the run is not set apart)
ROWWISE_TP_ISSUE = ("torchtitan's async-TP benchmark: 'the low baseline performance of the vanilla TP float8 rowwise "
                    "training is being addressed' (pytorch/torchtitan issue #1207)")


def torchtitan_async_tp_runs() -> list[Run]:
    """torchtitan's async-TP tables (June 2025), every row: Llama 3.1 70B on 256 GPUs (FSDP 32 x TP 8,
    local batch 16, full AC) and 8B on 64 (FSDP 8 x TP 8, local batch 12, per-op SAC), each in BF16,
    Float8 tensorwise and Float8 rowwise, with vanilla and async TP (`tp_comm_overlap`), all compiled,
    8,192 tokens (the configs' seq_len); TPS per GPU."""
    rows = (("70B", "llama3-70b", 256, 16, "full", ((None, 597.3, 652.4), ("tensorwise", 809.8, 942.4),
                                                    ("rowwise", 599.6, 624.8))),
            ("8B", "llama3-8b", 64, 12, "selective", ((None, 4378.0, 4809.4), ("tensorwise", 5078.1, 5570.1),
                                                      ("rowwise", 3708.5, 3914.9))))
    runs = []
    for size, spec, gpus, local, recompute, figures in rows:
        for recipe, vanilla, async_tp in figures:
            for overlap, tps in ((False, vanilla), (True, async_tp)):
                name = (f"torchtitan H100 Llama3.1 {size} {recipe or 'bf16'} fsdp{gpus // 8} tp8"
                        f"{' async-tp' if overlap else ''}")
                runs.append(Run(
                    name, HELD_OUT_FP8 if recipe else HELD_OUT, TORCHTITAN_ASYNC_TP, "h100-96g-500w", spec, gpus,
                    local * gpus // 8, 8192, tp=8, sp=True, mbs=local, zero=3, recompute=recompute,
                    precision="fp8" if recipe else "bf16-mixed", fp8_recipe=recipe, tp_comm_overlap=overlap,
                    published_tokens_per_s=tps * gpus, engine="torchtitan", attention="sdpa-flash", torch_compile=True,
                    assumptions=((FLOAT8.replace("tensorwise", recipe),) if recipe else ())
                    + ((ROWWISE_TP_ISSUE,) if recipe == "rowwise" and not overlap else ())
                    + ((OP_SAC,) if recompute == "selective" else ("full activation checkpointing",))
                    + ("async TP: torch's micro-pipelined all-gather and reduce-scatter matmuls, priced as TP "
                       "communication overlap (--tp-comm-overlap)" if overlap else "vanilla TP: blocking collectives",
                       H100_PEAK)))
    return runs


def torchtitan_rowwise_filter_runs() -> list[Run]:
    """The async-TP table's Llama 3.1 70B job (256 GPUs, FSDP 32 x TP 8, local batch 16, full AC,
    compiled) under Float8 rowwise with attention.wk and attention.wv left in bf16 (`fp8_filter`
    k, v: what torchao's auto filter leaves for 70B), vanilla and async TP: the figures of
    torchtitan's auto-filter commit, scored against the table's BF16 runs of the job."""
    runs = []
    for overlap, tps in ((False, 660.0), (True, 695.0)):
        runs.append(Run(
            f"torchtitan H100 Llama3.1 70B rowwise k,v bf16 fsdp32 tp8{' async-tp' if overlap else ''}", HELD_OUT_FP8,
            TORCHTITAN_ROWWISE_FILTER, "h100-96g-500w", "llama3-70b", 256, 16 * 256 // 8, 8192, tp=8, sp=True,
            mbs=16, zero=3, recompute="full", precision="fp8", fp8_recipe="rowwise", fp8_filter=("k", "v"),
            tp_comm_overlap=overlap, published_tokens_per_s=tps * 256, engine="torchtitan", attention="sdpa-flash",
            torch_compile=True, bf16_baseline_source=TORCHTITAN_ASYNC_TP,
            assumptions=(FLOAT8.replace("tensorwise with float8", "rowwise with bfloat16"),
                         "attention.wk and attention.wv in bf16 (filter_fqns; --fp8-filter k,v)",
                         "full activation checkpointing",
                         "async TP: torch's micro-pipelined all-gather and reduce-scatter matmuls, priced as TP "
                         "communication overlap (--tp-comm-overlap)" if overlap else "vanilla TP: blocking collectives",
                         H100_PEAK)))
    return runs


def torchao_float8_runs() -> list[Run]:
    """torchao's float8 training benchmarks on H100, every row: Llama 3 8B under torchtitan's
    llama3_8b.toml (FSDP2 over the 8 GPUs, per-op SAC, 8,192 tokens) at local batch 1, compiled;
    BF16, Float8 tensorwise with float8 all-gather and Float8 rowwise with bf16 all-gather (its
    benchmarks/float8/training/llama3.sh); median tokens/s per GPU."""
    runs = []
    for recipe, tps in ((None, 6150.0), ("tensorwise", 7689.5), ("rowwise", 6768.0)):
        runs.append(Run(f"torchao H100 Llama3 8B compile {recipe or 'bf16'} fsdp8 selective op",
                        HELD_OUT_FP8 if recipe else HELD_OUT, TORCHAO_FLOAT8, "h100-96g-500w", "llama3-8b", 8, 8,
                        8192, mbs=1, zero=3, recompute="selective", precision="fp8" if recipe else "bf16-mixed",
                        fp8_recipe=recipe, published_tokens_per_s=tps * 8, engine="torchtitan",
                        attention="sdpa-flash", torch_compile=True, compile_loss=False,
                        assumptions=((FLOAT8.replace("tensorwise with float8", f"{recipe} with float8" if recipe ==
                                                     "tensorwise" else f"{recipe} with bfloat16"),) if recipe else
                                     ("torch.compile (--compile): nothing of it priced in BF16",))
                        + (OP_SAC, "Meta's H100 hosts, which the docs name only as H100, costed as torchtitan's own "
                                   "H100 tables' Grand Teton parts (96 GB, 500 W)", H100_PEAK)))
    return runs
