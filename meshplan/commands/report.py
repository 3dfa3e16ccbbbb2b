"""`meshplan report`: one self-contained HTML strategy report for a plan (and its measured runs)."""
from __future__ import annotations


def add_arguments(parser):
    parser.add_argument("--plan", required=True, action="append", metavar="PLAN_JSON",
                        help="plan.json written by `meshplan plan`; repeat it to show plans side by side (the "
                             "first is detailed, and --measured belongs to it)")
    parser.add_argument("--measured", nargs="+", action="extend", default=[], metavar="MEASURED_JSON",
                        help="measured.json from `meshplan train` (several: repeated runs of this plan)")
    parser.add_argument("--trace", help="trace.json from `meshplan simulate --trace` (default: re-simulate the plan)")
    parser.add_argument("-o", "--out", required=True, help="where to write the HTML report")
    parser.add_argument("--title", help="page title (default: model and cluster)")


def run(args) -> int:
    from meshplan.planner.contracts.plan import load_plan
    from meshplan.planner.models.plan_check import check_plan_model
    from meshplan.reports import write_report  # plotly is imported only for this command

    import sys

    from meshplan.planner.contracts.atomicfile import refuse_output_over_input
    from meshplan.planner.models.plan_check import model_changed

    refuse_output_over_input("--out", args.out, [*(("--plan", path) for path in args.plan),
                                                 *(("--measured", path) for path in args.measured),
                                                 ("--trace", args.trace)])
    for path in args.plan:
        plan = load_plan(path)
        check_plan_model(plan)  # a report of layers the model does not have would mislead
        if model_changed(plan):
            print(f"warning: {path}: {model_changed(plan)}", file=sys.stderr)
    out = write_report(args.plan[0], measurements=args.measured, trace=args.trace, out=args.out, title=args.title,
                       others=args.plan[1:])
    print(f"wrote {out}")
    return 0
