"""The one error type users see: bad input or an impossible request (exit code 2)."""


class MeshplanError(ValueError):
    """A problem the user can fix. The message names the problem and the fix, on one line."""
