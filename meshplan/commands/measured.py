"""`meshplan measured`: a training log of Megatron-LM, NeMo, torchtitan or DeepSpeed as a
measured.json, which `report --measured` sets against the plan's prediction."""
from __future__ import annotations

import sys

from meshplan.planner.contracts.config import EXTERNAL_ENGINES


def add_arguments(parser) -> None:
    parser.add_argument("--from", dest="from_file", required=True, metavar="LOG",
                        help="the engine's training log (rank 0's output; NeMo's log is read as Megatron-LM's)")
    parser.add_argument("--engine", required=True, choices=EXTERNAL_ENGINES, help="engine that wrote the log")
    parser.add_argument("--config", default=None, metavar="FILE",
                        help="the engine config of the run (gives GPUs, global batch and sequence length)")
    parser.add_argument("--plan", default=None, metavar="PLAN_JSON",
                        help="the plan the run followed (gives what --config would)")
    parser.add_argument("--gpus", type=int, default=None, help="GPUs of the run (overrides --config/--plan)")
    parser.add_argument("--gbs", type=int, default=None, help="global batch in samples (overrides the log)")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (overrides --config/--plan)")
    parser.add_argument("-o", "--out", required=True, help="measured.json to write")


def run(args) -> int:
    from meshplan.planner.contracts.atomicfile import refuse_output_over_input
    from meshplan.planner.contracts.errors import MeshplanError
    from meshplan.planner.contracts.jsonfile import read_input_text
    from meshplan.planner.contracts.measurement import save_measurement
    from meshplan.planner.engines.logs import RunFacts, measurement_from_log

    refuse_output_over_input("--out", args.out, [("--from", args.from_file), ("--config", args.config),
                                                 ("--plan", args.plan)])
    gpus, gbs, seq = _facts(args)
    if gpus is None:
        raise MeshplanError("the log does not say how many GPUs ran; pass --gpus N, --config FILE or --plan FILE")
    for name, value in (("--gpus", gpus), ("--gbs", gbs), ("--seq", seq)):
        if value is not None and value <= 0:
            raise MeshplanError(f"{name} must be positive, got {value}")
    text = read_input_text(args.from_file, "training log", "give the engine's training log")
    measurement = measurement_from_log(text, args.engine, RunFacts(gpus=gpus, seq=seq, global_batch=gbs),
                                       source=str(args.from_file))
    save_measurement(measurement, args.out)
    timed = measurement.timed_steps_s
    print(f"wrote {args.out}: {len(measurement.step_times_s)} logged steps ({measurement.warmup_steps} warm-up), "
          f"median step {measurement.median_step_time_s * 1e3:.1f} ms over {len(timed)}", file=sys.stderr)
    return 0


def _facts(args) -> tuple[int | None, int | None, int | None]:
    """(GPUs, global batch, sequence length): the flags', else the plan's or the config's."""
    gpus = gbs = seq = None
    if args.plan:
        from meshplan.planner.contracts.plan import load_plan

        plan = load_plan(args.plan)
        gpus, gbs, seq = plan.config.gpus, plan.config.global_batch, plan.model.seq
    elif args.config:
        from meshplan.planner.engines.bridge import read_engine_file

        job = read_engine_file(args.config, args.engine)
        if job is not None:
            gpus, gbs, seq = job.world_size(), job.global_batch, job.seq
    return args.gpus or gpus, args.gbs or gbs, args.seq or seq
