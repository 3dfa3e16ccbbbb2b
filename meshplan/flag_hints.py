"""What an engine's own flag names are called here: a hint on an unrecognized argument.

A Megatron-LM or torchtitan user reaches for the names their engine uses (`--global-batch-size`,
`--tensor-model-parallel-size`, `--parallelism.tensor_parallel_degree`); `meshplan` names the same
quantities `--gbs`, `--tp` and so on. The parallel axes' names come from the engines' readers
(`planner.engines.megatron.AXIS_FLAGS`, `planner.engines.torchtitan.AXIS_KEYS`), so a hint and the
reader that parses those flags in a file (`estimate --from`) never disagree.
"""
from __future__ import annotations

# Megatron-LM's names for what meshplan's batch, sequence and schedule flags set.
MEGATRON_NAMES = {"--global-batch-size": "--gbs", "--micro-batch-size": "--mbs", "--seq-length": "--seq",
                  "--sequence-parallel": "--sp", "--recompute-granularity": "--recompute",
                  "--virtual-pipeline-model-parallel-size": "--vpp"}
# torchtitan's TOML keys as its command line spells them.
TORCHTITAN_NAMES = {"--training.global_batch_size": "--gbs", "--training.seq_len": "--seq"}


def engine_names() -> dict[str, tuple[str, str]]:
    """{engine flag: (engine, meshplan flag)} for every name a hint knows."""
    from meshplan.planner.engines.megatron import AXIS_FLAGS
    from meshplan.planner.engines.torchtitan import AXIS_KEYS

    names = {flag: ("Megatron-LM", ours) for flag, ours in MEGATRON_NAMES.items()}
    names.update({flag: ("Megatron-LM", f"--{axis}") for axis, flag in AXIS_FLAGS.items()})
    names.update({flag: ("torchtitan", ours) for flag, ours in TORCHTITAN_NAMES.items()})
    names.update({f"--parallelism.{key}": ("torchtitan", f"--{axis}") for axis, key in AXIS_KEYS.items()})
    return names


def hint(extras: list[str], known_flags) -> str:
    """' (...)' naming meshplan's flag for each engine flag in `extras` that the command has
    (`known_flags`: its option strings), and `--from` where the command reads an engine's file;
    '' when there is nothing to say."""
    names = engine_names()
    said = []
    for arg in extras:
        flag = arg.split("=", 1)[0]
        if flag in names and names[flag][1] in known_flags:
            engine, ours = names[flag]
            said.append(f"{engine}'s {flag} is {ours} here")
    if not said:
        return ""
    if "--from" in known_flags:
        said.append("--from FILE reads a whole Megatron-LM script, torchtitan TOML or DeepSpeed JSON")
    return f" ({'; '.join(said)})"
