"""Cluster profiles: every shipped profile loads, round-trips, and bad files fail clearly."""
import tomllib

import pytest

from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.contracts.cluster import cluster_from_dict, dump_cluster_toml
from meshplan.planner.costing.hardware import builtin_profiles, load_cluster


def test_shipped_profiles_load_and_round_trip():
    names = builtin_profiles()
    assert {"a100-40g", "a100-80g", "h100-sxm", "h200", "cpu"} <= set(names)
    for name in names:
        cluster = load_cluster(name)
        assert cluster.name == name
        assert cluster.device.source and cluster.intra_node.source and cluster.inter_node.source
        assert cluster_from_dict(tomllib.loads(dump_cluster_toml(cluster))) == cluster


def test_datasheet_numbers():
    h100 = load_cluster("h100-sxm")
    assert h100.device.peak_flops("bf16") == 989e12
    assert h100.gpus_per_node == 8 and h100.intra_node.bw_bytes_per_s == 450e9 and h100.inter_node.bw_bytes_per_s == 50e9
    a100 = load_cluster("a100-40g")
    assert a100.device.peak_flops("bf16") == 312e12 and a100.inter_node.bw_bytes_per_s == 25e9
    assert load_cluster("h200").device.memory_bytes == 143771 * 2**20  # nvidia-smi's memory.total


def _write(tmp_path, text):
    path = tmp_path / "p.toml"
    path.write_text(text)
    return path


def _base_text():
    return dump_cluster_toml(load_cluster("a100-80g"))


def test_unknown_field_names_file_and_field(tmp_path):
    path = _write(tmp_path, _base_text().replace("[device]\n", "[device]\nwarp_drive = 1\n"))
    with pytest.raises(MeshplanError, match=r"p\.toml.*device\.warp_drive"):
        load_cluster(path)


def test_missing_and_negative_fields(tmp_path):
    text = "\n".join(line for line in _base_text().splitlines() if not line.startswith("memory_bytes"))
    with pytest.raises(MeshplanError, match="missing field device.memory_bytes"):
        load_cluster(_write(tmp_path, text))
    bad = _base_text().replace("memory_bw_bytes_per_s = ", "memory_bw_bytes_per_s = -")
    with pytest.raises(MeshplanError, match="memory_bw_bytes_per_s"):
        load_cluster(_write(tmp_path, bad))


def test_older_schema_version_loads_and_newer_is_refused(tmp_path):
    text = _base_text()
    assert load_cluster(_write(tmp_path, text)).schema_version == 1
    with pytest.raises(MeshplanError, match="schema_version 99"):
        load_cluster(_write(tmp_path, text.replace("schema_version = 1", "schema_version = 99")))


def test_unknown_builtin_lists_the_known_ones():
    with pytest.raises(MeshplanError, match="a100-80g"):
        load_cluster("tpu-v9")


def test_link_kind_efficiency_round_trips_and_bad_values_fail(tmp_path):
    from dataclasses import replace

    cpu = load_cluster("cpu")
    link = replace(cpu.intra_node, kind_efficiency={"all_gather": 0.25, "reduce_scatter": 0.125})
    cluster = replace(cpu, intra_node=link)
    path = _write(tmp_path, dump_cluster_toml(cluster))
    loaded = load_cluster(path)
    assert loaded == cluster and loaded.intra_node.bw_for("all_gather") == pytest.approx(
        0.25 * link.bw_bytes_per_s * link.efficiency) and loaded.intra_node.bw_for("all_reduce") == pytest.approx(
        link.bw_bytes_per_s * link.efficiency)
    for bad, message in (("all_gather = 0.25", "all_gather = 1.5"), ("all_gather = 0.25", "all_gathr = 0.25")):
        with pytest.raises(MeshplanError, match=r"topology\.intra_node\.kind_efficiency"):
            load_cluster(_write(tmp_path, path.read_text().replace(bad, message)))


def test_parts_from_published_specifications_are_marked_and_carry_their_own_numbers():
    """The H100 variants, Blackwell and MI300X load with their datasheet figures; those no
    measured run checked say `validated = false`, and the profile listing marks them."""
    from meshplan.planner.costing.hardware import profile_listing

    parts = {name: load_cluster(name) for name in ("h100-96g-500w", "h100-nvl", "b200", "gb200-nvl72", "mi300x")}
    assert all(not cluster.validated for cluster in parts.values())
    assert load_cluster("h100-sxm").validated and load_cluster("a100-80g").validated
    assert parts["h100-96g-500w"].device.memory_bw_bytes_per_s == 2.4e12      # not the SXM's 3.35 TB/s
    assert parts["h100-nvl"].device.peak_flops("bf16") == 835e12 and parts["h100-nvl"].device.memory_bytes == 94e9
    assert parts["b200"].device.peak_flops("bf16") == 2250e12 and parts["b200"].intra_node.bw_bytes_per_s == 900e9
    assert parts["gb200-nvl72"].gpus_per_node == 72 and parts["gb200-nvl72"].device.num_sms == 148
    assert parts["mi300x"].device.num_sms == 304 and parts["mi300x"].device.memory_bytes == 192e9
    assert "fp8" not in load_cluster("a100-80g").device.peak_flops_per_s
    listing = profile_listing()
    assert "b200 (not validated)" in listing and "mi300x (not validated)" in listing
    assert "h100-sxm," in listing and "h100-sxm (" not in listing


def test_validated_and_num_sms_are_checked(tmp_path):
    text = _base_text()
    with pytest.raises(MeshplanError, match="validated must be true or false"):
        load_cluster(_write(tmp_path, text.replace('validated = true', 'validated = "no"')))
    with pytest.raises(MeshplanError, match="num_sms must be an integer >= 0"):
        load_cluster(_write(tmp_path, text.replace("num_sms = 108", "num_sms = -4")))


@pytest.mark.parametrize("typed, meant", [("h100", "h100-96g-500w, h100-nvl or h100-sxm"), ("H100-SXM", "h100-sxm"),
                                          ("a100", "a100-40g or a100-80g")])
def test_a_mistyped_profile_name_is_answered_with_the_profiles_it_likely_means(typed, meant):
    with pytest.raises(MeshplanError, match=rf"unknown cluster profile '{typed}' \(did you mean {meant}\?\); "
                                            "built-in profiles: a100-40g"):
        load_cluster(typed)


def test_a_name_near_no_profile_gets_the_list_alone():
    with pytest.raises(MeshplanError, match=r"unknown cluster profile 'zzz'; built-in profiles: "):
        load_cluster("zzz")
