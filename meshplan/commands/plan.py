"""`meshplan plan`: search the fastest plan that fits, print the top candidates and why the winner wins."""
from __future__ import annotations

import json
import sys

from meshplan.planner.contracts.config import (DEFAULT_MOE_DISPATCHER, ENGINES, EXECUTOR_MEMORY_ENGINES,
                                               EXTERNAL_ENGINES, PRECISIONS, SCHEDULES)
from meshplan.commands.common import (ADVICE_MIN_SAVING, GIB, add_attention_argument, add_axis_arguments, add_fp8_filter_argument,
                                     add_fp8_recipe_argument,
                                     add_cross_entropy_fusion_argument, add_grad_reduce_argument, add_job_arguments, add_offload_argument,
                                     add_moe_a2a_overlap_argument, add_recompute_early_stop_argument, add_compile_argument,
                                     add_tp_comm_overlap_argument,
                                     announce_model_code, check_seq, check_sizes,
                                     finite_float, job_notes, spec_file, recompute_early_stop_of, compile_loss_of,
                                     saves_memory, tp_comm_overlap_of)
from meshplan.planner.contracts.atomicfile import refuse_output_over_input


def add_arguments(parser) -> None:
    add_job_arguments(parser)
    parser.add_argument("-o", "--out", default=None, help="write the plan JSON here (e.g. plan.json)")
    parser.add_argument("--top", type=int, default=5, help="how many candidates to show and keep (default 5)")
    parser.add_argument("--json", action="store_true", help="print the plan JSON only")
    pins = parser.add_argument_group("pins (fix a choice; everything else is searched)")
    add_axis_arguments(pins, None)
    pins.add_argument("--zero", type=int, default=None, choices=(0, 1, 2, 3), help="ZeRO stage")
    pins.add_argument("--shard-group", type=int, default=None, metavar="N",
                      help="HSDP: shard ZeRO state over groups of N data-parallel ranks, replicate across them")
    pins.add_argument("--recompute", default=None, choices=("none", "selective", "full"),
                      help="recomputation of every transformer block")
    pins.add_argument("--sp", action="store_true", default=None, help="sequence parallelism on")
    pins.add_argument("--schedule", default=None, choices=SCHEDULES, help="pipeline schedule")
    pins.add_argument("--vpp", type=int, default=None, help="virtual stages per pipeline rank (interleaved, zb-interleaved; zbv and dualpipev: 2)")
    pins.add_argument("--mbs", type=int, default=None, help="micro-batch size")
    add_offload_argument(pins, None)
    parser.add_argument("--max-mbs", type=int, default=None, metavar="M",
                        help="largest micro-batch size searched (default: up to the samples per data-parallel "
                             "replica, as far as memory allows)")
    parser.add_argument("--train-tokens", type=finite_float, default=None,
                        help="also print time to train on this many tokens and the GPU-hours")
    parser.add_argument("--layerwise", action="store_true",
                        help="per-layer tp/dp inside a stage (analysis only: the plan is marked not executable)")
    parser.add_argument("--precision", default=None, choices=PRECISIONS,
                        help="precision recipe (default bf16-mixed on GPUs, fp32 on the cpu profile; fp8 only when asked (it changes numerics): FP8 Linears on Hopper and newer, planned not executed)")
    add_fp8_recipe_argument(parser)
    add_fp8_filter_argument(parser)
    add_grad_reduce_argument(parser)
    add_cross_entropy_fusion_argument(parser)
    add_tp_comm_overlap_argument(parser)
    add_recompute_early_stop_argument(parser)
    add_compile_argument(parser)
    add_moe_a2a_overlap_argument(parser)
    add_attention_argument(parser, default=None)
    parser.add_argument("--engine", default="meshplan", choices=ENGINES,
                        help="plan under this engine's memory recipe (default meshplan, its own executor); "
                             "recorded in the plan as `engine`")
    parser.add_argument("--time-limit", type=finite_float, default=2.5,
                        help="seconds per candidate ILP (default 2.5; the re-ranked ones get twice that again if needed)")
    parser.add_argument("--seed", type=int, default=0, help="seed recorded in the plan (training data order)")
    parser.add_argument("--memory-headroom", type=finite_float, default=0.0, metavar="GIB",
                        help="GiB each GPU keeps free beyond the profile's reserved_memory_bytes (default 0: the "
                             "reserve alone, e.g. 3 GB on h100-sxm, plus a 0.1%% rounding margin; under --engine "
                             "megatron, torchtitan, deepspeed or llm-foundry the caching allocator's fragmentation is counted too, "
                             "15%% of activations and buffers, from GMLake, ASPLOS 2024)")
    parser.add_argument("--candidates-csv", metavar="FILE", default=None,
                        help="write every candidate configuration the search enumerated, one CSV row each: its "
                             "degrees and switches, lower bound, how it left the search (winner, alternative, "
                             "simulated, solved, or pruned and why) and, when simulated, its step and memory")
    from meshplan.commands import sizing

    sizing.add_arguments(parser)


def run(args) -> int:
    from dataclasses import replace

    from meshplan.planner.contracts.plan import save_plan
    from meshplan.planner.search.driver import search

    from meshplan.commands import sizing

    _check_args(args)
    announce_model_code("plan", args.model)
    pins = sizing.pins_from(args)  # the pin flags, completed by --like FILE
    from meshplan.planner.costing.hardware import load_cluster

    cluster = load_cluster(args.cluster)  # loaded once: the kernel note and the request take it
    notes = job_notes(args, cluster, searched=True)
    if notes:
        sys.stderr.write("".join(f"{note}\n" for note in notes))  # one write: a Ctrl-C never splits a line

    request = _request(args, cluster, pins)

    # one row per candidate only when asked for: tens of thousands of labels otherwise unread
    rows: list[dict] | None = [] if args.candidates_csv else None

    def plan_at(gpus: int, progress: bool = False):
        if rows is not None:
            rows.clear()  # the rows of the last search, the one whose plan is written
        return search(replace(request, gpus=gpus), progress=progress, candidate_rows=rows)

    result = plan_at(args.gpus, progress=not args.json)
    sized, sizing_lines = None, []
    if args.train_tokens is not None:  # time, GPU-hours, cost; with --deadline-days the size that meets it
        result, sized, sizing_lines = sizing.size(args, result, plan_at)
    from meshplan.planner.profiling.profiler import carry_model_graph

    result = carry_model_graph(result)  # file and hf: models: reading the plan never runs their code
    data = result.to_json()
    if sized is not None:
        data["sizing"] = sized.to_json()
    if args.out and sized is not None:
        sizing.write_plan_json(data, args.out)  # the plan with its `sizing` key, in one write
    elif args.out:
        save_plan(result, args.out)
    if args.candidates_csv:
        _write_candidates(rows, args.candidates_csv)
    if args.json:  # the plan file's document (its band: simulate --json or estimate --from --json)
        print(json.dumps(data))
    else:
        _print_plan(args, result, data, sizing_lines)
    return 0


def _request(args, cluster, pins: dict):
    """The search's `PlanRequest` of the command's flags."""
    from meshplan.planner.search.request import PlanRequest

    return PlanRequest.of(args.model, cluster, args.gpus, args.gbs, args.seq, top_k=args.top,
                          precision=args.precision, attention=args.attention, layerwise=args.layerwise,
                          time_limit_s=args.time_limit, seed=args.seed, max_mbs=args.max_mbs,
                          moe_imbalance=args.moe_imbalance,
                          moe_capacity_factor=args.moe_capacity_factor,
                          moe_pad_to_capacity=args.moe_pad_expert_input_to_capacity,
                          moe_dispatcher=args.moe_dispatcher or DEFAULT_MOE_DISPATCHER,
                          memory_headroom_bytes=args.memory_headroom * GIB, engine=args.engine,
                          fp8_recipe=args.fp8_recipe, fp8_filter=args.fp8_filter,
                          grad_reduce_in_bf16=args.grad_reduce_in_bf16,
                          tp_comm_overlap=tp_comm_overlap_of(args), mtp_num_layers=args.mtp_num_layers,
                          moe_a2a_overlap=args.moe_a2a_overlap, cross_entropy_fusion=args.cross_entropy_fusion,
                          recompute_early_stop=recompute_early_stop_of(args), torch_compile=args.torch_compile,
                          compile_loss=compile_loss_of(args), **pins)


def _check_args(args) -> None:
    """The flags' values, before anything is read or searched: each bad one a clear error."""
    from meshplan.commands import sizing
    from meshplan.planner.contracts.errors import MeshplanError

    if args.train_tokens is not None and args.train_tokens <= 0:
        raise MeshplanError(f"--train-tokens must be positive, got {args.train_tokens}")
    if not args.time_limit > 0:
        raise MeshplanError(f"--time-limit is seconds per candidate ILP and must be positive, got {args.time_limit}")
    sizing.check(args)
    check_seq(args.seq)
    check_sizes(args)
    for flag, path in (("--out", args.out), ("--candidates-csv", args.candidates_csv)):
        refuse_output_over_input(flag, path, [("--cluster", args.cluster), ("--like", args.like),
                                              ("--model", spec_file(args.model))])


def _print_plan(args, result, data: dict, sizing_lines: list[str]) -> None:
    """The plan as text: the plan, its step time's band, the sizing, loss-fusion, compile and fp8
    filter lines."""
    from meshplan.commands.bands import band_line

    step = data["prediction"]["step_time_s"]
    print("\n".join([format_plan(data, args), band_line(step, result.config, result.model.spec, result.model.seq,
                                                       result.cluster)]
                    + sizing_lines + loss_fusion_lines(result, step) + compile_lines(result, step)
                    + fp8_filter_lines(result, step)))


def loss_fusion_lines(plan, step_s: float) -> list[str]:
    """Under Megatron-LM's unfused loss (`--cross-entropy-fusion none`, its default), what Transformer
    Engine's loss kernel would take off the winner's step, simulated (`costing.loss_kernels`); none
    where it saves under 1%."""
    from dataclasses import replace

    from meshplan.planner.contracts.engine_rules import CE_FUSION_ENGINES
    from meshplan.planner.simulation.simulator import simulate

    config = plan.config
    if config.engine not in CE_FUSION_ENGINES or config.cross_entropy_fusion != "none":
        return []
    saved_s = step_s - simulate(replace(plan, config=replace(config, cross_entropy_fusion="te"))).step_time_s
    if saved_s < ADVICE_MIN_SAVING * step_s:
        return []
    return [f"loss: Megatron-LM's unfused fp32 cross-entropy; --cross-entropy-fusion te (Transformer Engine's kernel, "
            f"with --cross-entropy-loss-fusion --cross-entropy-fusion-impl te) takes {saved_s * 1e3:.3g} ms "
            f"({saved_s / step_s:.1%}) off the step"]


def compile_lines(plan, step_s: float) -> list[str]:
    """Under an engine that compiles (torchtitan) planned without it, what torch.compile takes off
    the winner's step and peak memory, simulated (`estimate`'s compile hint, for a plan); none under
    `ADVICE_MIN_SAVING` of the step and `saves_memory`'s share of the peak."""
    from dataclasses import replace

    from meshplan.planner.contracts.engine_rules import could_compile
    from meshplan.planner.simulation.simulator import simulate

    config = plan.config
    if not could_compile(config):
        return []
    compiled = simulate(replace(plan, config=replace(config, torch_compile=True)), timeline=False)
    saved_s, peak_bytes = step_s - compiled.step_time_s, plan.prediction["peak_memory_bytes"]
    faster, leaner = saved_s >= ADVICE_MIN_SAVING * step_s, saves_memory(peak_bytes, compiled.peak_memory_bytes)
    if not (faster or leaner):
        return []
    takes = ([f"{saved_s * 1e3:.3g} ms ({saved_s / step_s:.1%}) off the step"] if faster else []) + (
        [f"{(peak_bytes - compiled.peak_memory_bytes) / GIB:.1f} GiB off the peak (its compiled loss keeps the "
         "logits in bf16; plan with --compile to use it)"] if leaner else [])
    return [f"compile: --compile (torch.compile, {config.engine}'s training.compile) takes {' and '.join(takes)}"]


def fp8_filter_lines(plan, step_s: float) -> list[str]:
    """Under fp8, the block Linears the cost model finds faster left in bf16 on the winner's shards
    (`costing.fp8_advice.best_on_path`: the filter on its path whose simulated step is shortest)
    and that step; none where no filter saves anything."""
    from dataclasses import replace

    from meshplan.planner.costing.fp8_advice import best_on_path
    from meshplan.planner.simulation.simulator import plan_graph, simulate

    config = plan.config
    if config.precision != "fp8":
        return []
    graph = plan_graph(plan)
    best = best_on_path(graph, plan.cluster, config, lambda names: simulate(
        replace(plan, config=replace(config, fp8_filter=names)), graph, timeline=False))
    if best is None or best[1] >= step_s:
        return []
    names, best_s = best
    slower = ", ".join(name for name in names if name not in config.fp8_filter)
    return [f"fp8: {slower} run faster in bf16 on these shards (their casts cost more than fp8 saves); re-plan with "
            f"--fp8-filter {','.join(names)}: this plan then takes {best_s * 1e3:.1f} ms per step "
            f"({1 - best_s / step_s:.1%} less)"]


def _write_candidates(rows: list[dict], path: str) -> None:
    import csv
    import io

    from meshplan.planner.contracts.atomicfile import write_text_atomic
    from meshplan.planner.search.alternatives import CSV_FIELDS

    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=CSV_FIELDS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    write_text_atomic(path, text.getvalue(), "--candidates-csv")
    print(f"{len(rows)} candidates written to {path}", file=sys.stderr)


def candidates_table(data: dict, train_tokens: float | None = None):
    """pandas DataFrame of the winner and the alternatives, one row each."""
    import pandas as pd

    from meshplan.planner.search.assembly import configuration_rows

    rows = []
    tokens_per_step = data["global_batch"] * data["model"]["seq"]
    gpus = data["cluster"]["gpus"]
    moe = _is_moe(data)
    for rank, entry in enumerate(configuration_rows(data), start=1):
        pred, sched = entry["prediction"], entry["schedule"]
        row = {
            "#": rank,
            "pp x dp x cp x tp": (f"{entry['mesh']['pp']}x{entry['mesh']['dp']}x{entry['mesh'].get('cp', 1)}"
                                  f"x{entry['mesh']['tp']}"),
            **({"ep": entry["mesh"].get("ep", 1), "etp": entry["mesh"].get("etp", entry["mesh"]["tp"])} if moe else {}),
            "sp": "on" if entry["sp"] else "",
            "schedule": sched["name"] + (f" x{sched['virtual_stages']}" if sched["virtual_stages"] > 1 else ""),
            "mbs": sched["microbatch_size"], "m": sched["microbatches"],
            "zero": f"{entry['zero']}" + (f" /{entry['shard_group']}" if entry.get("shard_group") else ""),
            "recompute": ", ".join(f"{k} {v}" for k, v in entry["recompute_summary"].items() if v) or "none",
            "step ms": round(pred["step_time_s"] * 1e3, 1),
            "ILP ms": "-" if entry.get("ilp_objective_s") is None else round(entry["ilp_objective_s"] * 1e3, 1),
            "MFU %": round(100 * pred["mfu"], 1),
            "bubble %": round(100 * pred["bubble_fraction"], 1),
            "peak GiB": round(pred["peak_memory_bytes"] / GIB, 1),
        }
        if moe:  # expert parallelism: the all-to-alls and the experts' states per rank
            row["a2a ms"] = round(pred["breakdown"].get("ep_comm", 0.0) * 1e3, 1)
            row["experts GiB"] = round(max((m.get("experts", 0.0) for m in pred["memory_bytes"]), default=0.0) / GIB, 1)
        if train_tokens:
            seconds = train_tokens / tokens_per_step * pred["step_time_s"]
            row["train days"] = round(seconds / 86400, 2)
            row["GPU-hours"] = round(seconds * gpus / 3600)
        row["note"] = "conventional" if entry.get("conventional") else ""
        rows.append(row)
    table = pd.DataFrame(rows)
    # Configurations that differ only in what the table does not show read as one row: keep the first.
    table = table.drop_duplicates(subset=[c for c in table.columns if c != "#"]).reset_index(drop=True)
    table["#"] = range(1, len(table) + 1)
    return table.set_index("#")


def _is_moe(data: dict) -> bool:
    """A mixture of experts (its routed experts' states are counted apart), or a plan with EP."""
    memory = (data.get("prediction") or {}).get("memory_bytes") or []
    return data["mesh"].get("ep", 1) > 1 or any(m.get("experts", 0.0) > 0 for m in memory)


def format_plan(data: dict, args) -> str:
    import pandas as pd

    from meshplan.planner.search.assembly import explain

    table = candidates_table(data, args.train_tokens)
    with pd.option_context("display.width", 200, "display.max_columns", 30):
        text = table.rename_axis(None).to_string()  # the index unnamed: no row holding only its name
    text = "#" + text[1:]  # the rank column's heading, on the header row
    from meshplan.reports.plans import is_sequence_model

    seq = f" (seq {data['model']['seq']})" if is_sequence_model(data["model"]["spec"]) else ""
    head = (f"{data['model']['spec']}{seq} on {data['cluster']['gpus']} x "
            f"{data['cluster']['profile']}, global batch {data['global_batch']}, {data['precision']}"
            + (f" {data['fp8_recipe']}" if data.get("fp8_recipe") else "")
            + (f" ({','.join(data['fp8_filter'])} in bf16)" if data.get("fp8_filter") else "")
            + (f", memory as {data['engine']} allocates it" if data.get("engine", "meshplan") not in EXECUTOR_MEMORY_ENGINES else ""))
    lines = [head, "", text, "", explain(data)]
    if not data["executable"]:
        engine = data.get("engine", "meshplan")
        lines += ["", f"NOT EXECUTABLE: {data['not_executable_reason']}" if engine not in EXTERNAL_ENGINES else
                  f"planned for {engine} (`meshplan export --to {engine}` writes its job); meshplan's own `train` "
                  f"does not run it: {data['not_executable_reason']}"]
    if args.train_tokens:
        best = table.iloc[0]
        lines += ["", f"training on {args.train_tokens:.3g} tokens: {best['train days']} days, "
                      f"{best['GPU-hours']:,} GPU-hours with the winner"]
    if args.out:
        lines += ["", f"plan written to {args.out}"]
    return "\n".join(lines)
