"""What an engine's own flag names are called here: a hint on an unrecognized argument.

A Megatron-LM or torchtitan user reaches for the names their engine uses (`--global-batch-size`,
`--tensor-model-parallel-size`, `--parallelism.tensor_parallel_degree`); `meshplan` names the same
quantities `--gbs`, `--tp` and so on. Every name comes from the engine's reader and writer
(`planner.engines.megatron`'s `AXIS_FLAGS`, `BATCH_FLAGS` and schedule flags, `planner.engines.torchtitan`'s
`AXIS_KEYS` and `TRAINING_KEYS`), so a hint, `estimate --from` and `export` never disagree.
"""
from __future__ import annotations

# How alike (difflib's ratio) an unknown flag and one of the command's must be to be suggested:
# `--torch-compile` and `--compile` read 0.75; unrelated flags of like length stay under 0.6.
TYPO_CUTOFF = 0.7


def engine_names() -> dict[str, tuple[str, str]]:
    """{engine flag: (engine, meshplan flag)} for every name a hint knows: the flags each engine's
    reader parses (Megatron-LM's as its command line spells them, torchtitan's TOML keys as its
    command line does)."""
    from meshplan.planner.engines.megatron import AXIS_FLAGS, BATCH_FLAGS, RECOMPUTE_FLAG, SP_FLAG, VPP_FLAG
    from meshplan.planner.engines.torchtitan import AXIS_KEYS, TRAINING_KEYS

    megatron = {**{flag: f"--{ours}" for ours, flag in {**AXIS_FLAGS, **BATCH_FLAGS}.items()},
                SP_FLAG: "--sp", VPP_FLAG: "--vpp", RECOMPUTE_FLAG: "--recompute"}
    torchtitan = {**{f"--parallelism.{key}": f"--{axis}" for axis, key in AXIS_KEYS.items()},
                  **{f"--training.{key}": f"--{ours}" for ours, key in TRAINING_KEYS.items()}}
    return {**{flag: ("Megatron-LM", ours) for flag, ours in megatron.items()},
            **{flag: ("torchtitan", ours) for flag, ours in torchtitan.items()}}


def hint(extras: list[str], known_flags) -> str:
    """' (...)' naming meshplan's flag for each engine flag in `extras` that the command has
    (`known_flags`: its option strings), and `--from` where the command reads the engine's own file
    (`estimate`: a config or launch script; `measured`: a training log); for any other flag, the
    command's own flag nearest in spelling (`--torch-compile`: did you mean `--compile`);
    '' when there is nothing to say."""
    import difflib

    names = engine_names()
    ours = sorted(flag for flag in known_flags if flag.startswith("--"))
    said, engine_said = [], False
    for arg in extras:
        flag = arg.split("=", 1)[0]
        if flag in names and names[flag][1] in known_flags:
            engine, mine = names[flag]
            said.append(f"{engine}'s {flag} is {mine} here")
            engine_said = True
        elif flag.startswith("--"):
            nearest = difflib.get_close_matches(flag, ours, n=1, cutoff=TYPO_CUTOFF)
            said.extend(f"{flag}: did you mean {match}?" for match in nearest)
    if not said:
        return ""
    if engine_said and "--from" in known_flags:
        said.append("--from FILE reads the engine's own file whole")
    return f" ({'; '.join(said)})"
