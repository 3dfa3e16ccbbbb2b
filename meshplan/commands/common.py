"""Arguments that several commands share, defined once so their help and defaults agree."""
from __future__ import annotations

GIB = 2**30


def add_job_arguments(parser) -> None:
    """--model --cluster --gpus --gbs --seq: what is trained, where, and on how much data per step."""
    parser.add_argument("--model", required=True,
                        help="model SPEC (built-in name, gpt:/llama: spec, file.py:fn, hf:config.json)")
    parser.add_argument("--cluster", required=True, help="cluster profile name (a100-80g, h100-sxm, ...) or .toml path")
    parser.add_argument("--gpus", type=int, required=True, help="number of GPUs (cpu profile: local processes)")
    parser.add_argument("--gbs", type=int, required=True, help="global batch size in samples per optimizer step")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default 2048, GPT-2 presets 1024)")
    add_moe_imbalance_argument(parser)


def check_seq(seq: int | None) -> None:
    """--seq, when given, must be a positive length (0 is not "the default")."""
    from meshplan.planner.contracts.errors import MeshplanError

    if seq is not None and seq <= 0:
        raise MeshplanError(f"--seq must be a positive integer, got {seq}")


def throughput_line(spec: str, tokens_per_s: float, seq: int) -> str:
    """'tokens/s  N' for sequence models; file models (any nn.Module) are counted in samples."""
    from meshplan.reports.plans import is_sequence_model

    if is_sequence_model(spec):
        return f"tokens/s         {tokens_per_s:12,.0f}"
    return f"samples/s        {tokens_per_s / seq:12,.1f}"


def add_moe_imbalance_argument(parser) -> None:
    parser.add_argument("--moe-imbalance", type=float, default=1.0, metavar="F",
                        help="mixture of experts: the busiest expert receives F times the balanced tokens * top_k / "
                             "experts (>= 1.0, default 1.0 = balanced); the cost model scales the busiest rank's "
                             "expert GEMM time, saved expert activations and received all-to-all tokens by F")


def moe_notes(spec: str | None, moe_imbalance: float) -> list[str]:
    """Checks --moe-imbalance; for a mixture of experts, the routing assumption the costs rest on."""
    from meshplan.planner.contracts.errors import MeshplanError
    from meshplan.planner.models.registry import is_moe_spec

    if not 1.0 <= moe_imbalance < float("inf"):
        raise MeshplanError(f"--moe-imbalance must be >= 1.0 (1.0: balanced routing), got {moe_imbalance}")
    if spec is None:
        return []
    if not is_moe_spec(spec):
        if moe_imbalance != 1.0:
            raise MeshplanError(f"--moe-imbalance needs a mixture-of-experts model; {spec!r} has no experts")
        return []
    if moe_imbalance != 1.0:
        return [f"note: mixture of experts: the busiest rank's expert GEMMs, saved expert activations and "
                f"received all-to-all tokens are costed at {moe_imbalance:g}x the balanced share (--moe-imbalance)"]
    return ["note: mixture of experts, costed under balanced routing (every expert gets tokens * top_k / "
            "experts); --moe-imbalance F charges the busiest rank F times that"]
