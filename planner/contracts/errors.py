"""The one error type users see: bad input or an impossible request (exit code 2)."""


class MeshplanError(ValueError):
    """A problem the user can fix. The message names the problem and the fix, on one line."""


class PlanNeedsModelCode(MeshplanError):
    """Reading a plan would need its model's code run (an older plan of a file or hf: model that
    carries no layer graph): refused, since commands that read plans never run model code."""
