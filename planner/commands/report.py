"""`meshplan report` (being built)."""
from planner.errors import MeshplanError


def add_arguments(parser):
    parser.add_argument("rest", nargs="*", help="arguments")


def run(args) -> int:
    raise MeshplanError("meshplan report is not available in this build yet")
