"""`meshplan profile`: per-layer FLOPs, parameters and activation bytes of a model (closed form for
the zoo's transformers, else traced on the meta device)."""
from __future__ import annotations

import json
import re

from meshplan.planner.contracts.errors import MeshplanError

DEFAULT_SEQ = 2048
GIB = 2**30
MIB = 2**20


def add_arguments(parser):
    parser.add_argument("--model", required=True, metavar="SPEC",
                        help="gpt2 | llama3-8b | ... | gpt:layers=..,hidden=..,heads=..,vocab=.. | "
                             "llama:... | path/model.py:fn | hf:path/config.json | hf:owner/name (a hub repository)")
    parser.add_argument("--seq", type=int, default=None, metavar="N",
                        help=f"sequence length (default {DEFAULT_SEQ}, capped at the learned positions of a "
                             "GPT-2 preset or an HF config; file models take shapes from their example inputs)")
    parser.add_argument("--batch", type=int, default=1, metavar="B",
                        help="samples per micro-batch; scales the printed per-layer figures (default 1)")
    parser.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16",
                        help="parameter and activation dtype (default bf16)")
    from meshplan.commands.common import add_attention_argument

    add_attention_argument(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object and nothing else")
    parser.add_argument("--csv", metavar="FILE", help="also write the per-layer table to FILE as CSV")
    parser.add_argument("--no-cache", action="store_true",
                        help="profile afresh and do not touch the on-disk profile cache")
    parser.add_argument("--trace", action="store_true",
                        help="trace a preset or gpt:/llama: spec on the meta device instead of computing its "
                             "graph in closed form (the two are equal; file and hf: models are always traced)")
    from meshplan.commands.common import add_moe_imbalance_argument, add_mtp_argument

    add_moe_imbalance_argument(parser)
    add_mtp_argument(parser)


def run(args) -> int:
    from meshplan.commands.common import announce_model_code, check_seq, spec_file
    from meshplan.planner.contracts.atomicfile import refuse_output_over_input
    from meshplan.planner.models.registry import default_seq
    from meshplan.planner.profiling.profiler import profile

    check_seq(args.seq)
    if args.batch <= 0:
        raise MeshplanError(f"--batch must be a positive integer, got {args.batch}")
    seq = args.seq if args.seq is not None else default_seq(args.model, DEFAULT_SEQ)
    refuse_output_over_input("--csv", args.csv, [("--model", spec_file(args.model))])
    announce_model_code("profile", args.model)
    graph = profile(args.model, seq, batch=args.batch, dtype=args.dtype, attention=args.attention,
                    cache=not args.no_cache, trace=args.trace, moe_imbalance=args.moe_imbalance,
                    mtp_num_layers=args.mtp_num_layers)
    rows = [layer.to_json(args.batch) for layer in graph.layers]
    if args.csv:
        _write_csv(rows, args.csv)
    if args.json:
        from meshplan.planner.models.plan_check import is_sequence_model

        # a file model has neither a sequence length nor an attention kernel: no such keys
        shape = ({"seq": graph.seq, "batch": args.batch, "dtype": graph.dtype, "attention": graph.attention}
                 if is_sequence_model(graph.spec) else {"batch": args.batch, "dtype": graph.dtype})
        print(json.dumps({"model": graph.spec, **shape, "total_params": graph.total_params,
                          **_moe_json(graph), **_hf_json(graph),
                          "fwd_flops": graph.fwd_flops * args.batch, "bwd_flops": graph.bwd_flops * args.batch,
                          "layers": rows}))
    else:
        print(format_table(graph, args.batch))
    return 0


def _hf_json(graph) -> dict:
    """A traced Hugging Face model: the attention implementation transformers ran, and the notes."""
    info = graph.info
    return {**({"attn_implementation": info.attn_implementation} if info.attn_implementation else {}),
            **({"notes": list(info.notes)} if info.notes else {})}


def _hf_summary(graph) -> str:
    info = graph.info
    lines = []
    if info.attn_implementation:
        why = ("SDPA, which transformers supports for this architecture" if info.attn_implementation == "sdpa" else
               "transformers' eager attention: it supports no SDPA for this architecture; the s x s scores "
               "are computed and saved as eager saves them, whatever --attention says")
        lines.append(f"attention implementation: {info.attn_implementation} ({why})")
    lines += [f"note: {note}" for note in info.notes]
    lines += _hub_lines(graph.spec)
    if info.family == "hf" and any(layer.kind in ("embedding", "head") and layer.tp_split.kind == "none"
                                   for layer in graph.layers):
        from meshplan.planner.contracts.engine_rules import VOCAB_PARALLEL_ENGINES

        engines = " and ".join(VOCAB_PARALLEL_ENGINES)
        lines.append(f"tp split of the embedding and head: none as meshplan's executor runs them (whole on every TP "
                     f"rank); under --engine {engines} they are split over the vocabulary, as those engines split "
                     "every model's")
    lines += _engine_lines(graph.spec)
    return "".join(f"\n{line}" for line in lines)


def _hub_lines(spec: str) -> list[str]:
    """For an `hf:owner/name` spec: which file was read (the cache's copy of which revision)."""
    from meshplan.planner.models.hf_hub import config_file, is_local_path

    if not spec.startswith("hf:") or is_local_path(spec[3:]):
        return []
    return [f"config: {config_file(spec[3:])} (the local Hugging Face cache's copy of {spec[3:]})"]


def _engine_lines(spec: str) -> list[str]:
    """For an `hf:` config an engine builds as its own Llama-style model: which engines price it so."""
    from meshplan.planner.models.hf_engine import OWN_MODELS, engine_config, engine_model_note
    from meshplan.planner.models.registry import hf_config_path

    path = hf_config_path(spec)
    if path is None:
        return []
    return [f"under --engine {engine}: {engine_model_note(path, engine)}" for engine in OWN_MODELS
            if engine_config(path, engine) is not None]


def _moe_json(graph) -> dict:
    """`active_params` and the routing facts of a mixture of experts (nothing for dense models)."""
    info = graph.info
    if not info.is_moe:
        return {}
    return {"active_params": graph.active_params, "num_experts": info.num_experts, "top_k": info.top_k,
            "routing": "balanced", "moe_imbalance": info.moe_imbalance}


def _write_csv(rows: list[dict], path: str) -> None:
    import pandas as pd

    flat = []
    for row in rows:
        item = {k: v for k, v in row.items() if k != "tp_split"}
        item["tp_split"] = row["tp_split"]["kind"]
        flat.append(item)
    from meshplan.planner.contracts.atomicfile import write_text_atomic

    write_text_atomic(path, pd.DataFrame(flat).to_csv(index=False), "--csv")


def _group_name(names: list[str]) -> str:
    """`blocks.0-125 (x126)` for a run of numbered layers, else `first..last (xN)`."""
    if len(names) == 1:
        return names[0]
    first = re.fullmatch(r"(.*\.)(\d+)", names[0])
    last = re.fullmatch(r"(.*\.)(\d+)", names[-1])
    if first and last and first.group(1) == last.group(1):
        return f"{first.group(1)}{first.group(2)}-{last.group(2)} (x{len(names)})"
    return f"{names[0]}..{names[-1]} (x{len(names)})"


def format_table(graph, batch: int) -> str:
    """Per-layer table (runs of identical layers collapsed to one row, figures per layer) and totals."""
    import pandas as pd

    records = []
    for _, indices in graph.repeat_groups():
        layer = graph.layers[indices[0]]
        records.append({
            "layer": _group_name([graph.layers[i].name for i in indices]),
            "kind": layer.kind,
            "params": f"{layer.num_params:,}",
            "fwd GFLOP": f"{layer.fwd_flops * batch / 1e9:,.1f}",
            "bwd GFLOP": f"{layer.bwd_flops * batch / 1e9:,.1f}",
            "act MiB": f"{layer.activation_bytes * batch / MIB:,.1f}",
            "TP-sharded": f"{layer.act_tp_sharded_bytes * batch / MIB:,.1f}",
            "replicated": f"{layer.act_tp_replicated_bytes * batch / MIB:,.1f}",
            "scores": f"{layer.act_attn_score_bytes * batch / MIB:,.1f}",
            "out MiB": f"{layer.output_bytes * batch / MIB:,.1f}",
            "tp split": layer.tp_split.kind,
        })
    table = pd.DataFrame(records).to_string(index=False)
    total_act = sum(layer.activation_bytes for layer in graph.layers) * batch
    from meshplan.reports.plans import is_sequence_model

    # a file model's shapes come from its example inputs: no sequence length, no attention kernel
    shape = (f"seq {graph.seq}  batch {batch}  dtype {graph.dtype}  attention {graph.attention}"
             if is_sequence_model(graph.spec) else f"batch {batch} sample(s)  dtype {graph.dtype}")
    header = (f"model {graph.spec}  {shape}  (figures per layer; repeated layers collapsed; act = activation "
              "bytes saved for backward = TP-sharded + replicated + attention scores)")
    scale = (1e9, "B") if graph.total_params >= 1e9 else (1e6, "M")
    totals = (f"total: {graph.total_params:,} params ({graph.total_params / scale[0]:,.2f} {scale[1]}), "
              f"forward {graph.fwd_flops * batch / 1e9:,.1f} GFLOP, backward {graph.bwd_flops * batch / 1e9:,.1f} GFLOP, "
              f"activations {total_act / GIB:,.2f} GiB (no recomputation, no parallelism)")
    return f"{header}\n{table}\n{totals}" + _moe_summary(graph) + _hf_summary(graph)


def _moe_summary(graph) -> str:
    """Active parameters and the routing assumption of a mixture of experts ("" for dense models)."""
    info = graph.info
    if not info.is_moe:
        return ""
    active = graph.active_params
    scale = (1e9, "B") if graph.total_params >= 1e9 else (1e6, "M")
    balanced = f"each expert gets tokens x {info.top_k} / {info.num_experts}"
    skew = (f"; imbalance {info.moe_imbalance:g} recorded: the busiest expert gets {info.moe_imbalance:g}x that"
            if info.moe_imbalance != 1.0 else "")
    return (f"\nmixture of experts: {graph.total_params / scale[0]:,.1f} {scale[1]} total, {active / scale[0]:,.1f} "
            f"{scale[1]} active per token ({active:,}; {info.num_experts} experts, top-{info.top_k}); "
            f"profiled with balanced routing ({balanced}){skew}")
