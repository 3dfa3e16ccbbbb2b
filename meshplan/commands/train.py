"""`meshplan train`: run a plan for real with torch.distributed (torchrun) and write measured.json."""
from __future__ import annotations

from meshplan.commands.common import finite_float


def add_arguments(parser):
    parser.add_argument("--plan", required=True, help="plan.json written by `meshplan plan`")
    parser.add_argument("--nproc", type=int, help="processes on this node (default: the plan's GPU count)")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps to train (default 20)")
    parser.add_argument("-o", "--out", default="measured.json", help="where to write the measurement JSON")
    parser.add_argument("--checkpoint-dir", help="directory for distributed checkpoints (DIR/step_N/)")
    parser.add_argument("--checkpoint-every", type=int, default=0, help="checkpoint every K steps (0: never)")
    parser.add_argument("--resume", action="store_true",
                        help="continue this run from the newest checkpoint in --checkpoint-dir that verifies "
                             "(another run's is refused)")
    parser.add_argument("--resume-from", metavar="DIR",
                        help="start from this checkpoint (DIR/step_N, or the newest that verifies in DIR), whatever "
                             "run, seed or layout wrote it")
    parser.add_argument("--max-restarts", type=int, default=0, help="torchrun restarts of failed workers")
    parser.add_argument("--data", default="synthetic", help="'synthetic' (default) or a text file (byte tokens)")
    parser.add_argument("--seed", type=int, help="weights and data seed (default: the plan's)")
    parser.add_argument("--force", action="store_true",
                        help="launch even when the preflight finds that this machine cannot hold the plan (a GPU "
                             "plan without GPUs, more ranks than GPUs or CPUs allow, predicted memory beyond this "
                             "machine's)")
    parser.add_argument("--timeout-s", type=finite_float,
                        help="collective timeout: a rank that waits longer for the others (a hung worker) fails the "
                             "run, which names the rank it waited for (default 600)")


def run(args) -> int:
    import sys

    from meshplan.commands.common import announce_model_code
    from meshplan.planner.contracts.atomicfile import refuse_output_over_input
    from meshplan.planner.contracts.plan import load_plan

    # before the executor clears an old measurement at --out: that file may be the plan itself
    refuse_output_over_input("--out", args.out, [("--plan", args.plan),
                                                 ("--data", None if args.data == "synthetic" else args.data)])
    announce_model_code("train", load_plan(args.plan).model.spec)

    from meshplan.executor import train
    from meshplan.executor.launch import Terminated

    try:
        measurement = train(args.plan, nproc=args.nproc, steps=args.steps, out=args.out,
                            checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
                            resume=args.resume, resume_from=args.resume_from, max_restarts=args.max_restarts,
                            data=args.data, seed=args.seed, timeout_s=args.timeout_s, echo=True, force=args.force,
                            progress=True)  # a bar only on a terminal
    except Terminated as exc:
        print("meshplan train: terminated (SIGTERM); the workers were stopped", file=sys.stderr)
        return int(exc.code)
    from meshplan.reports.plans import throughput_text

    plan = load_plan(args.plan)
    print(f"{len(measurement.losses)} steps on {measurement.world_size} processes: final loss "
          f"{measurement.losses[-1]:.4f}, {measurement.mean_step_time_s * 1e3:.1f} ms/step, "
          f"{throughput_text(plan.model.spec, measurement.tokens_per_s, plan.model.seq)}, peak memory "
          f"{max(measurement.peak_memory_bytes_per_rank) / 2**20:.1f} MiB/rank -> {args.out}")
    return 0
