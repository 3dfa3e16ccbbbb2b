"""`meshplan memory --model SPEC [--seq N] [--gpus N,...] [--json]`: model states across precisions,
ZeRO stages and GPU counts, and one sample's activations per sequence length; no cluster or batch
needed."""
from __future__ import annotations

import argparse
import json

from meshplan.commands.common import GIB, announce_model_code, check_seq

DEFAULT_SEQS = (1024, 2048, 4096, 8192)
# More GPU counts than this make a table nobody reads; the states scale as 1/N past the first few.
MAX_GPU_COUNTS = 16


def gpu_counts(text: str) -> tuple[int, ...]:
    """`--gpus 8,64,512`: the data-parallel GPU counts the states table shards over, ascending."""
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated GPU counts such as 8,64,512, got {text!r}")
    if any(count <= 0 for count in counts):
        raise argparse.ArgumentTypeError(f"GPU counts must be positive, got {text!r}")
    if len(set(counts)) > MAX_GPU_COUNTS:
        raise argparse.ArgumentTypeError(f"at most {MAX_GPU_COUNTS} GPU counts, got {len(set(counts))}")
    return tuple(sorted(set(counts)))


def add_arguments(parser) -> None:
    parser.add_argument("--model", required=True,
                        help="model SPEC (built-in name, gpt:/llama: spec, file.py:fn, hf:config.json or hf:owner/name)")
    parser.add_argument("--seq", type=int, default=None,
                        help=f"sequence length of the activation rows (default: {', '.join(map(str, DEFAULT_SEQS))}, "
                             "up to the model's positions)")
    parser.add_argument("--gpus", type=gpu_counts, default=None, metavar="N[,N...]",
                        help="data-parallel GPU counts of the model-states rows (default: 1,8,64)")
    parser.add_argument("--json", action="store_true", help="print one JSON object (keys: docs/architecture.md)")


def run(args) -> int:
    from meshplan.planner.costing import memory_table as mt
    from meshplan.planner.models.plan_check import is_sequence_model
    from meshplan.planner.models.registry import default_seq
    from meshplan.planner.profiling.profiler import profile

    check_seq(args.seq)
    announce_model_code("memory", args.model)
    sequences = is_sequence_model(args.model)
    if args.seq is not None:
        seqs = [args.seq]
    elif sequences:
        seqs = sorted({default_seq(args.model, seq) for seq in DEFAULT_SEQS})
    else:
        seqs = [default_seq(args.model)]
    graphs = [(seq, profile(args.model, seq)) for seq in seqs]
    num_params = graphs[0][1].total_params
    states = mt.state_rows(num_params, args.gpus or mt.GPU_COUNTS)
    activations = [mt.activation_row(graph, precision, seq if sequences else None)
                   for seq, graph in graphs for precision in mt.MEMORY_PRECISIONS]
    if args.json:
        print(json.dumps({"model": args.model, "total_params": num_params, "states": [r.to_json() for r in states],
                          "activations_per_sample": [r.to_json() for r in activations]}))
        return 0
    print(format_table(args.model, num_params, states, activations))
    return 0


def format_table(spec: str, num_params: int, states, activations) -> str:
    from meshplan.planner.costing.memory_table import RECOMPUTE_MODES

    lines = [f"{spec}: {num_params / 1e9:.3f} B parameters",
             "",
             "model states per GPU (GiB), ZeRO paper's recipe (bf16-mixed 2 + 2 + 12 bytes per parameter, "
             "fp32 4 + 4 + 8), sharded over data-parallel GPUs",
             f"  {'precision':<11} {'zero':>4} {'GPUs':>5} {'params':>9} {'grads':>9} {'optim':>9} {'total':>9}"]
    for row in states:
        lines.append(f"  {row.precision:<11} {row.zero:>4} {row.gpus:>5} {row.params_bytes / GIB:9.2f} "
                     f"{row.grads_bytes / GIB:9.2f} {row.optimizer_bytes / GIB:9.2f} {row.total_bytes / GIB:9.2f}")
    with_seq = activations and activations[0].seq is not None
    lines += ["", "activations of one sample through the whole model on one GPU (GiB), by recomputation"
                  + ("; multiply by the micro-batch size, divide by tp (and pp) as the plan splits it" if with_seq
                     else "; multiply by the micro-batch size"),
              f"  {'precision':<11}" + (f" {'seq':>7}" if with_seq else "")
              + "".join(f" {mode:>10}" for mode in RECOMPUTE_MODES)]
    for row in activations:
        lines.append(f"  {row.precision:<11}" + (f" {row.seq:>7}" if with_seq else "")
                     + "".join(f" {row.bytes_by_recompute[mode] / GIB:10.3f}" for mode in RECOMPUTE_MODES))
    lines += ["", "add the runtime's reserve and the allocator's fragmentation (meshplan plan --memory-headroom) "
                  "before comparing with a GPU's memory"]
    return "\n".join(lines)
