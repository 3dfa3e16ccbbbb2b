"""`meshplan compare a.json b.json [...]`: plans side by side, the rows that differ marked."""
from __future__ import annotations


def add_arguments(parser) -> None:
    parser.add_argument("plans", nargs="+", metavar="PLAN_JSON", help="two or more plan.json files")


def run(args) -> int:
    from meshplan.planner.contracts.errors import MeshplanError
    from meshplan.reports.plans import compare_text

    if len(args.plans) < 2:
        raise MeshplanError(f"compare needs two or more plan files, got {len(args.plans)}")
    print(compare_text(args.plans))
    return 0
