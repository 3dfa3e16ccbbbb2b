"""Bad input to every command: exit 0 or exit 2 with one line on stderr, never a traceback or exit 1.

Property tests (hypothesis) generate cluster TOML files, parametric model specs and command-line
values, valid and broken, and run the commands in-process through `meshplan.cli.main` (a
subprocess per example would cost seconds). Where a generated input is broken by construction
(a required field deleted, a bandwidth set to zero, heads not dividing hidden) the test also
demands exit 2 and a message naming the problem; where it is valid by construction, exit 0.
Plan files are in test_bad_plans.py.
"""
from __future__ import annotations

import json
import math
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshplan.planner.costing.hardware import PROFILES_DIR
from meshplan.planner.models.registry import known_models
from tests.bad_input_helpers import SEQ, SMALL, assert_clean, base_cluster, fast, private_cache, toml_text  # noqa: F401


# ---------------------------------------------------------------------------------------------
# Cluster TOML files

def _leaf_paths(data: dict, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = []
    for key, value in data.items():
        out.append(prefix + (key,))
        if isinstance(value, dict):
            out += _leaf_paths(value, prefix + (key,))
    return out


CLUSTER_PATHS = _leaf_paths(base_cluster())
# Fields without a default: deleting one must be refused, naming it.
REQUIRED = {("name",), ("device",), ("topology",), ("device", "name"), ("device", "memory_bytes"),
            ("device", "memory_bw_bytes_per_s"), ("device", "peak_flops_per_s"), ("topology", "gpus_per_node"),
            ("topology", "intra_node"), ("topology", "inter_node")}
REQUIRED |= {("topology", level, key) for level in ("intra_node", "inter_node")
             for key in ("bw_bytes_per_s", "latency_s")}
# Numbers that must be finite and > 0: anything else (0, negative, text, true, a list) is refused.
POSITIVE = {("device", "memory_bytes"), ("device", "memory_bw_bytes_per_s"), ("device", "matmul_efficiency"),
            ("device", "memory_efficiency"), ("topology", "gpus_per_node"), ("topology", "max_nodes"),
            ("optimizer_bytes_per_param",)}
POSITIVE |= {("device", "peak_flops_per_s", dtype) for dtype in ("fp32", "bf16")}
POSITIVE |= {("topology", level, "bw_bytes_per_s") for level in ("intra_node", "inter_node")}

ANY_VALUE = st.one_of(st.integers(-3, 3), st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=4),
                      st.booleans(), st.lists(st.integers(0, 2), max_size=2), st.builds(dict))
MUTATION = st.one_of(
    st.tuples(st.just("set"), st.sampled_from(CLUSTER_PATHS), ANY_VALUE),
    st.tuples(st.just("delete"), st.sampled_from(CLUSTER_PATHS), st.none()),
    st.tuples(st.just("unknown"), st.sampled_from([(), ("device",), ("topology",), ("topology", "inter_node")]),
              st.sampled_from(["bandwidth", "gpus", "memory_gib", "flops"])),
)


def _is_bad_positive(value) -> bool:
    return (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or value <= 0)


def _apply(data: dict, mutation) -> tuple[tuple[str, ...], bool]:
    """Apply one mutation; return (the path it changed, () if none, and whether it must be refused)."""
    action, path, value = mutation
    parent = data
    for key in path[:-1] if action != "unknown" else path:
        if not isinstance(parent.get(key), dict):
            return (), False  # an earlier mutation removed or replaced this table
        parent = parent[key]
    if action == "unknown":
        parent[value] = 1.0
        return path + (value,), True
    if path[-1] not in parent:
        return (), False
    if action == "delete":
        del parent[path[-1]]
        return path, path in REQUIRED
    parent[path[-1]] = value
    return path, path in POSITIVE and _is_bad_positive(value)


def _apply_all(data: dict, mutations) -> dict[tuple[str, ...], bool]:
    """Apply mutations in order; {changed path: must be refused} for the changes still in the file
    (a later change to the same field or to a table above it replaces an earlier one)."""
    effective: dict[tuple[str, ...], bool] = {}
    for mutation in mutations:
        path, must_fail = _apply(data, mutation)
        if path:
            effective = {p: fail for p, fail in effective.items() if p[:len(path)] != path}
            effective[path] = must_fail
    return effective


@fast(40)
@given(mutations=st.lists(MUTATION, min_size=1, max_size=3))
def test_broken_cluster_files_exit_2_naming_file_and_field(run_cli, tmp_path, mutations):
    data = base_cluster()
    effective = _apply_all(data, mutations)
    path = tmp_path / "cluster.toml"
    path.write_text(toml_text(data))
    code, out, err = run_cli("estimate", "--model", SMALL, "--seq", SEQ, "--cluster", path, "--gpus", 1,
                             "--gbs", 2, "--json")
    assert_clean("estimate", code, err)
    if any(effective.values()):
        assert code == 2, f"{mutations} was accepted"
        assert str(path) in err
        assert any(changed[-1] in err for changed in effective), err
        assert re.search(r"must|missing|unknown|not supported|fraction|needs", err), err
    if code == 0:
        assert json.loads(out)["step_time_s"] > 0


@fast(25)
@given(memory_gib=st.floats(2.0, 1024.0), bw=st.floats(1e6, 1e13), flops=st.floats(1e9, 1e16),
       efficiency=st.floats(0.05, 1.0), latency_s=st.floats(0.0, 1e-3), gpus_per_node=st.integers(1, 16))
def test_valid_cluster_files_are_accepted(run_cli, tmp_path, memory_gib, bw, flops, efficiency, latency_s,
                                          gpus_per_node):
    data = base_cluster()
    device, topology = data["device"], data["topology"]
    device.update(memory_bytes=memory_gib * 2**30, memory_bw_bytes_per_s=bw, matmul_efficiency=efficiency,
                  peak_flops_per_s={"fp32": flops, "bf16": flops / 4})
    topology.update(gpus_per_node=gpus_per_node, max_nodes=1)
    for level in ("intra_node", "inter_node"):
        topology[level].update(bw_bytes_per_s=bw, latency_s=latency_s, efficiency=efficiency)
    path = tmp_path / "cluster.toml"
    path.write_text(toml_text(data))
    code, out, err = run_cli("estimate", "--model", SMALL, "--seq", SEQ, "--cluster", path, "--gpus", 1,
                             "--gbs", 2, "--json")
    assert code == 0, err
    assert json.loads(out)["step_time_s"] > 0


@fast(25)
@given(data=st.data())
def test_corrupted_cluster_text_never_crashes(run_cli, tmp_path, data):
    text = (PROFILES_DIR / "cpu.toml").read_text()
    start = data.draw(st.integers(0, len(text)), label="start")
    end = data.draw(st.integers(start, min(len(text), start + 40)), label="end")
    insert = data.draw(st.text(alphabet="[]={}\"'.,#=\n 0-1aZ", max_size=6), label="insert")
    path = tmp_path / "cluster.toml"
    path.write_text(text[:start] + insert + text[end:])
    code, _, err = run_cli("estimate", "--model", SMALL, "--seq", SEQ, "--cluster", path, "--gpus", 1, "--gbs", 2)
    assert_clean("estimate", code, err)
    if code == 2:
        assert str(path) in err


def _set(*path_and_value):
    *path, value = path_and_value

    def mutate(data):
        for key in path[:-1]:
            data = data[key]
        data[path[-1]] = value
    return mutate


CLUSTER_ERRORS = [
    (_set("topology", "intra_node", "bw_bytes_per_s", 0),
     "topology.intra_node.bw_bytes_per_s must be a finite number > 0, got 0"),
    (_set("device", "peak_flops_per_s", "fp32", "fast"),
     "device.peak_flops_per_s.fp32 must be a finite number > 0, got 'fast'"),
    (_set("device", "memory_bytes", -1), "device.memory_bytes must be a finite number > 0, got -1"),
    (_set("device", "colour", 1), "unknown field device.colour; known fields: "),
    (_set("topology", "gpus_per_node", "2"), "topology.gpus_per_node must be a positive integer, got '2'"),
    (_set("schema_version", "1"), "schema_version '1' is not supported"),
    (lambda data: data["device"].pop("memory_bw_bytes_per_s"), "missing field device.memory_bw_bytes_per_s"),
]


@pytest.mark.parametrize("mutate,expected", CLUSTER_ERRORS)
def test_cluster_file_errors_name_file_field_and_expectation(run_cli, tmp_path, mutate, expected):
    data = base_cluster()
    mutate(data)
    path = tmp_path / "c.toml"
    path.write_text(toml_text(data))
    code, _, err = run_cli("estimate", "--model", SMALL, "--cluster", path, "--gpus", 1, "--gbs", 2)
    assert code == 2 and f"{path}: {expected}" in err, err


def test_unreadable_cluster_files(run_cli, tmp_path):
    path = tmp_path / "c.toml"
    for content, expected in ((b"[device\n", "not valid TOML"), (b'name = "x\xff"\n', "not a UTF-8 text file")):
        path.write_bytes(content)
        code, _, err = run_cli("estimate", "--model", SMALL, "--cluster", path, "--gpus", 1, "--gbs", 2)
        assert code == 2 and f"{path}: {expected}" in err, err
    code, _, err = run_cli("estimate", "--model", SMALL, "--cluster", "no-such-cluster", "--gpus", 1, "--gbs", 2)
    assert code == 2 and "built-in profiles: a100-40g" in err, err


# ---------------------------------------------------------------------------------------------
# Model specs

SPEC_VALUE = st.one_of(st.integers(-2, 130).map(str), st.sampled_from(["x", "2.5", "", "1e3", " 4", "0"]))


@st.composite
def parametric_specs(draw):
    """A valid gpt:/llama: spec about half the time, else one with a single corruption."""
    family = draw(st.sampled_from(["gpt", "llama"]))
    heads = draw(st.sampled_from([1, 2, 4]))
    values = {"layers": str(draw(st.integers(1, 3))), "hidden": str(heads * draw(st.sampled_from([2, 4, 8, 16]))),
              "heads": str(heads), "vocab": str(draw(st.sampled_from([1, 64, 130])))}
    if family == "llama" and draw(st.booleans()):
        values["kv_heads"] = str(draw(st.sampled_from([d for d in (0, 1, 2, 4) if d == 0 or heads % d == 0])))
    if family == "gpt" and draw(st.booleans()):
        values["positions"] = str(draw(st.sampled_from([8, 16, 64])))
    items = None
    corruption = draw(st.sampled_from(["none", "none", "none", "value", "delete", "unknown", "item", "odd"]))
    if corruption == "value":
        values[draw(st.sampled_from(sorted(values)))] = draw(SPEC_VALUE)
    elif corruption == "delete":
        del values[draw(st.sampled_from(sorted(values)))]
    elif corruption == "unknown":
        values[draw(st.sampled_from(["tied", "bogus", "ffn_mult"]))] = draw(st.sampled_from(["1", "true", "maybe"]))
    elif corruption == "odd":  # heads no longer divide hidden, or an odd RoPE head dim
        values["hidden"] = str(int(values["hidden"]) + draw(st.sampled_from([1, heads])))
    items = [f"{k}={v}" for k, v in values.items()]
    if corruption == "item":
        items.insert(draw(st.integers(0, len(items))), draw(st.sampled_from(["layers", "=3", "hidden:64"])))
    return f"{family}:" + ",".join(items)


def expected_layers(spec: str, seq: int) -> int | None:
    """The layer count a valid spec gives (blocks + embedding + head); None when it must be refused.

    The rules from the spec grammar and the model shapes, written out independently of the parser.
    """
    family, _, rest = spec.partition(":")
    allowed = {"gpt": {"layers", "hidden", "heads", "vocab", "positions", "tied"},
               "llama": {"layers", "hidden", "heads", "vocab", "kv_heads", "tied"}}[family]
    values = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not value.strip() or key not in allowed:
            return None
        values[key] = value.strip()
    if values.get("tied", "1") not in ("1", "0", "true"):
        return None
    ints = {}
    for key, value in values.items():
        if key == "tied":
            continue
        if not re.fullmatch(r"[+-]?\d+", value):
            return None
        ints[key] = int(value)
    if not {"layers", "hidden", "heads", "vocab"} <= set(ints):
        return None
    if min(ints["layers"], ints["hidden"], ints["heads"], ints["vocab"], ints.get("positions", seq)) <= 0:
        return None
    if ints["layers"] > 100_000:
        return None  # the per-layer graph of more blocks would not fit in memory
    kv_heads = ints.get("kv_heads", 0)
    if kv_heads < 0 or ints["hidden"] % ints["heads"] or ints["heads"] % (kv_heads or ints["heads"]):
        return None
    if family == "llama" and (ints["hidden"] // ints["heads"]) % 2:
        return None  # RoPE rotates pairs of channels
    if ints.get("positions", seq) < seq:
        return None
    return ints["layers"] + 2


@fast(40)
@given(spec=parametric_specs())
def test_parametric_specs_profile_or_exit_2(run_cli, spec):
    code, out, err = run_cli("profile", "--model", spec, "--seq", 16, "--json")
    assert_clean("profile", code, err)
    layers = expected_layers(spec, 16)
    if layers is None:
        assert code == 2, f"{spec!r} was accepted"
        assert spec in err, err
    else:
        assert code == 0, err
        assert len(json.loads(out)["layers"]) == layers


@fast(15)
@given(name=st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-_.", min_size=1, max_size=12))
def test_unknown_model_names_list_the_known_ones(run_cli, name):
    code, _, err = run_cli("profile", f"--model={name}")  # a name may start with "-"
    if name in known_models():
        assert code == 0, err
        return
    assert code == 2, err
    assert f"unknown model {name!r}" in err or "malformed file model spec" in err, err
    if "unknown model" in err:
        assert all(known in err for known in known_models())


@pytest.mark.parametrize("layers", ["100001", "9" * 30, "9" * 5000])
def test_absurd_layer_counts_exit_2_instead_of_running_out_of_memory(run_cli, layers):
    code, _, err = run_cli("profile", "--model", f"gpt:layers={layers},hidden=64,heads=4,vocab=128")
    assert_clean("profile", code, err)
    assert code == 2 and "layers" in err, err


FILE_MODELS = {
    "raises": ("def fn():\n    raise RuntimeError('no weights here')\n", "raised RuntimeError: no weights here"),
    "wrong_type": ("def fn():\n    return 42\n", "must return (nn.Module, example_inputs)"),
    "module_only": ("import torch\ndef fn():\n    return torch.nn.Linear(4, 4)\n", "must return (nn.Module"),
    "not_meta": ("import torch\nclass M(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
                 "        self.lin = torch.nn.Linear(4, 4)\n    def forward(self, x):\n"
                 "        return self.lin(x) if x.sum().item() > 0 else x\n"
                 "def fn():\n    return M(), torch.zeros(1, 4)\n", "cannot run its forward on the meta device"),
    "exits": ("import sys\ndef fn():\n    sys.exit(3)\n", "raised SystemExit"),
    "syntax": ("def fn(:\n", "SyntaxError"),
    "missing_fn": ("def other():\n    pass\n", "has no function 'fn'; it defines: other"),
}


@pytest.mark.parametrize("case", sorted(FILE_MODELS))
def test_broken_file_models_exit_2_with_one_line(run_cli, tmp_path, case):
    source, expected = FILE_MODELS[case]
    path = tmp_path / f"{case}.py"
    path.write_text(source)
    code, _, err = run_cli("profile", "--model", f"{path}:fn", "--no-cache")
    assert_clean("profile", code, err)
    assert code == 2 and expected in err, err


HF_SHAPE = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
            "intermediate_size": 128, "vocab_size": 100}
HF_CONFIGS = {
    "not_json": ("{not json", "is not valid JSON"),
    "no_model_type": ("[1]", 'has no "model_type"'),
    # Refused by transformers' config validation or, in versions without it, by the model build;
    # transformers words the reason itself, so only meshplan's part is checked.
    "heads_not_dividing": (json.dumps(dict(HF_SHAPE, num_attention_heads=3)), "HF config '"),
    "string_width": (json.dumps(dict(HF_SHAPE, hidden_size="x")), "HF config '"),
    "zero_layers": (json.dumps(dict(HF_SHAPE, num_hidden_layers=0)), "num_hidden_layers must be between 1 and"),
    "absurd_layers": (json.dumps(dict(HF_SHAPE, num_hidden_layers=10**12)), "num_hidden_layers must be between 1 and"),
    "unknown_architecture": (json.dumps(dict(HF_SHAPE, model_type="no_such_arch")), "transformers cannot read it"),
}


@pytest.mark.parametrize("case", sorted(HF_CONFIGS))
def test_broken_hf_configs_exit_2(run_cli, tmp_path, case):
    content, expected = HF_CONFIGS[case]
    if case not in ("not_json", "no_model_type"):  # these are refused before transformers is imported
        pytest.importorskip("transformers")
    path = tmp_path / "config.json"
    path.write_text(content)
    code, _, err = run_cli("profile", "--model", f"hf:{path}", "--seq", 16, "--no-cache")
    assert_clean("profile", code, err)
    assert code == 2 and expected in err and str(path) in err, err


# ---------------------------------------------------------------------------------------------
# Command-line values

SMALL_INT = st.integers(-1, 5)


@fast(40)
@given(gpus=SMALL_INT, gbs=st.integers(-1, 9), tp=SMALL_INT, pp=SMALL_INT, mbs=SMALL_INT, vpp=SMALL_INT,
       schedule=st.sampled_from(["1f1b", "gpipe", "interleaved"]), zero=st.integers(0, 3), sp=st.booleans(),
       seq=st.sampled_from([-1, 0, 16, 32]))
def test_estimate_any_configuration(run_cli, gpus, gbs, tp, pp, mbs, vpp, schedule, zero, sp, seq):
    argv = ["estimate", "--model", SMALL, "--cluster", "cpu", "--gpus", gpus, "--gbs", gbs, "--tp", tp, "--pp", pp,
            "--mbs", mbs, "--vpp", vpp, "--schedule", schedule, "--zero", zero, "--seq", seq, "--json"]
    code, out, err = run_cli(*argv, *(["--sp"] if sp else []))
    assert_clean("estimate", code, err)
    if min(gpus, gbs, tp, pp, mbs, vpp, seq) <= 0:
        assert code == 2, f"{argv} was accepted"
    if code == 0:
        prediction = json.loads(out)
        assert prediction["step_time_s"] > 0 and len(prediction["memory_bytes"]) == pp


@fast(10)
@given(gpus=st.integers(0, 3), gbs=st.integers(0, 6), pin=st.sampled_from(["--tp", "--pp", "--dp", "--mbs", "--vpp"]),
       value=SMALL_INT)
def test_plan_any_pin(run_cli, gpus, gbs, pin, value):
    code, out, err = run_cli("plan", "--model", SMALL, "--seq", SEQ, "--cluster", "cpu", "--gpus", gpus,
                             "--gbs", gbs, pin, value, "--time-limit", 5, "--json")
    assert_clean("plan", code, err)
    if min(gpus, gbs, value) <= 0:
        assert code == 2
    if code == 0:
        plan = json.loads(out)
        mesh = plan["mesh"]
        assert mesh["pp"] * mesh["dp"] * mesh["tp"] == gpus and plan["executable"]
