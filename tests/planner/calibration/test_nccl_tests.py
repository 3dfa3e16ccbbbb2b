"""The cluster a user has: stated topology and nccl-tests imports (planner.calibration.fabric,
planner.calibration.nccl_tests, `meshplan calibrate --nodes/--gpus-per-node/--nics-per-node/--nccl-tests`).

The files under data/ are synthetic samples in the shape nccl-tests prints (2.x with `root` and
`#wrong`, and the older shape without them), generated from meshplan's ring model with 46 GB/s
per NIC, 20 us inter-node and 6 us NVLink latency on 4 nodes x 8 GPUs: the fit must return those
numbers to the precision the table prints them with.
"""
from pathlib import Path

import pytest

from meshplan.planner.calibration.fabric import apply_topology, import_nccl_tests
from meshplan.planner.calibration.nccl_tests import parse_nccl_tests, read_nccl_tests
from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.costing.collectives import bus_bandwidth_factor, collective_time_s
from meshplan.planner.costing.hardware import load_cluster

DATA = Path(__file__).parent / "data"
ALL_REDUCE = DATA / "all_reduce_perf_4x8.txt"
ALL_GATHER = DATA / "all_gather_4x8.txt"
H100 = load_cluster("h100-sxm")  # its NVLink latency is the 6 us the samples were made with


def test_parse_reads_kind_ranks_nodes_and_the_faster_time():
    run = read_nccl_tests(ALL_REDUCE)
    assert (run.kind, run.num_ranks, run.num_nodes) == ("all_reduce", 32, 4)
    assert run.samples[0] == (1048576.0, pytest.approx(461.5e-6))  # out-of-place beat in-place (463.4 us)
    assert len(run.samples) == 7
    older = read_nccl_tests(ALL_GATHER)  # no root / #wrong columns, kind from the file name
    assert (older.kind, older.num_ranks, older.num_nodes) == ("all_gather", 32, 4)


@pytest.mark.parametrize("files", [[ALL_REDUCE], [ALL_GATHER], [ALL_REDUCE, ALL_GATHER]])
def test_fit_recovers_the_nic_bandwidth_and_latency(files):
    profile, notes = import_nccl_tests(H100, files)
    assert profile.inter_node.bw_bytes_per_s == pytest.approx(46e9, rel=0.01)
    assert profile.inter_node.latency_s == pytest.approx(20e-6, rel=0.05)
    assert profile.inter_node.efficiency == 1.0 and "nccl-tests" in profile.inter_node.source
    assert notes == []  # 4 nodes: rings, no two-node tree caveat
    # the profile now prices the file's own all-reduce as it measured: ~368 GB/s of bus bandwidth
    # (8 rails x 46), capped by H100's NVLink at 360
    seconds = collective_time_s("all_reduce", 2**36, 32, profile, algorithm="ring")
    assert bus_bandwidth_factor("all_reduce", 32) * 2**36 / seconds == pytest.approx(360e9, rel=0.01)


def test_stated_topology_places_a_file_without_rank_lines():
    text = "\n".join(line for line in ALL_REDUCE.read_text().splitlines() if "Rank" not in line)
    run = parse_nccl_tests(text, "all_reduce.txt")
    assert run.num_ranks is None
    with pytest.raises(MeshplanError, match="--nodes and --gpus-per-node"):
        import_nccl_tests(H100, [run])
    profile, _ = import_nccl_tests(apply_topology(H100, nodes=4, gpus_per_node=8, nics_per_node=8), [run],
                                   stated_nodes=4)
    assert profile.inter_node.bw_bytes_per_s == pytest.approx(46e9, rel=0.01)


def test_apply_topology_overrides_only_what_is_stated():
    cpu = load_cluster("cpu")
    stated = apply_topology(cpu, nodes=16, gpus_per_node=8, nics_per_node=4)
    assert (stated.max_nodes, stated.gpus_per_node, stated.nics_per_node) == (16, 8, 4)
    assert "16 nodes x 8 GPUs, 4 NICs" in stated.description
    assert apply_topology(cpu) == cpu
    assert apply_topology(cpu, nics_per_node=2).gpus_per_node == cpu.gpus_per_node
    with pytest.raises(MeshplanError, match="--nics-per-node must be a positive integer, got 0"):
        apply_topology(cpu, nics_per_node=0)
    with pytest.raises(MeshplanError, match="runs 4 processes on this node, but --gpus-per-node says 2"):
        apply_topology(cpu, gpus_per_node=2, measured_ranks=4)


def _broken(tmp_path, text, name="all_reduce_perf.txt"):
    path = tmp_path / name
    path.write_text(text)
    return path


def _table_text():
    return ALL_REDUCE.read_text()


@pytest.mark.parametrize("edit, message", [
    (lambda text: "just some log\nno table here\n", "no nccl-tests table found"),
    (lambda text: text.replace("  4294967296    1073741824     float     sum      -1", "  4294967296  float"),
     r"line \d+: \d+ columns where the header names 13"),
    (lambda text: text.replace("sum      -1   1869.3  143.60  278.23      0", "sum      -1   1869.3  143.60  278.23      3"),
     "counted 3 wrong results"),
    (lambda text: "\n".join(line for line in text.splitlines()  # the comments and the 1 MiB row only
                            if line.startswith("#") or line.split()[:1] == ["1048576"]), "at least two"),
    (lambda text: text.replace("all_reduce_perf", "alltoall_perf"), "alltoall_perf output"),
    (lambda text: text.replace("on     node02", "on     node01").replace("on     node03", "on     node01")
     .replace("on     node04", "on     node01"), "ran on one node"),
    (lambda text: text.replace("    461.5 ", "    N/A   ").replace("    463.4 ", "    N/A   "), "no positive time"),
])
def test_malformed_files_are_one_clear_error(tmp_path, edit, message):
    path = _broken(tmp_path, edit(_table_text()))
    with pytest.raises(MeshplanError, match=message) as error:
        import_nccl_tests(H100, [path])
    assert str(path) in str(error.value) or "one node" in str(error.value)


def test_unknown_kind_and_binary_and_missing_files(tmp_path):
    text = "\n".join(line for line in _table_text().splitlines() if "Collective test starting" not in line)
    # neither the header line nor the file name says; the busbw / algbw ratio (62/32) does
    assert parse_nccl_tests(text, "run1.log").kind == "all_reduce"
    no_ranks = "\n".join(line for line in text.splitlines() if "Rank" not in line)
    with pytest.raises(MeshplanError, match="cannot tell which collective"):
        parse_nccl_tests(no_ranks, "run1.log")
    binary = tmp_path / "x.txt"
    binary.write_bytes(b"\xff\xfe\x00\x01" * 10)
    with pytest.raises(MeshplanError, match="not a text file"):
        read_nccl_tests(binary)
    with pytest.raises(MeshplanError, match="not found"):
        read_nccl_tests(tmp_path / "absent.txt")


def test_calibrate_command_imports_the_fabric_without_measuring(run_cli, tmp_path):
    out = tmp_path / "mine.toml"
    code, stdout, err = run_cli("calibrate", "--no-measure", "--base", "h100-sxm", "--nodes", "4", "--gpus-per-node", "8",
                                "--nics-per-node", "8", "--nccl-tests", ALL_REDUCE, "--nccl-tests", ALL_GATHER,
                                "--out", out)
    assert code == 0, err
    profile = load_cluster(out)
    assert (profile.name, profile.max_nodes, profile.gpus_per_node, profile.nics_per_node) == ("mine", 4, 8, 8)
    assert profile.inter_node.bw_bytes_per_s == pytest.approx(46e9, rel=0.01)
    assert profile.device == H100.device and profile.nvls == H100.nvls  # the rest is the base's
    assert "4 nodes x 8 GPUs, 8 NICs per node" in stdout and "fitted to nccl-tests" in stdout


def test_calibrate_command_refuses_bad_files_and_topology_in_one_line(run_cli, tmp_path):
    bad = _broken(tmp_path, "hello\n")
    code, _, err = run_cli("calibrate", "--no-measure", "--base", "h100-sxm", "--nccl-tests", bad,
                           "--out", tmp_path / "x.toml")
    assert code == 2 and str(bad) in err and "no nccl-tests table" in err and len(err.strip().splitlines()) == 1
    code, _, err = run_cli("calibrate", "--nics-per-node", "0", "--out", tmp_path / "x.toml")
    assert code == 2 and "--nics-per-node must be a positive integer" in err
    code, _, err = run_cli("calibrate", "--no-measure", "--out", tmp_path / "x.toml")
    assert code == 2 and "--base" in err
    assert not (tmp_path / "x.toml").exists()
