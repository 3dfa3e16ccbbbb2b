"""The registry of parallel axes (`contracts.axes`) and what `ParallelConfig` and its consumers read of it."""
import argparse
from dataclasses import replace

import pytest

from meshplan.commands.common import add_axis_arguments, axis_arguments
from meshplan.planner.contracts.axes import AXES, AXIS_NAMES, MESH_AXIS_NAMES, Axis, axis, mesh_stride
from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.contracts.plan import mesh_json


def test_registry_names_every_degree_of_parallel_config_once():
    assert MESH_AXIS_NAMES == ("pp", "dp", "cp", "tp")  # tp innermost
    assert AXIS_NAMES == ("pp", "dp", "cp", "tp", "etp", "ep")
    assert [a.name for a in AXES if not a.multiplies_gpus] == ["etp", "ep"]
    assert (axis("etp").carved_from, axis("etp").follows, axis("ep").carved_from) == ("stage_ranks", "tp", "expert_ranks")
    assert all(a.flag == f"--{a.name}" for a in AXES)
    assert set(AXIS_NAMES) <= set(ParallelConfig.__dataclass_fields__)
    with pytest.raises(ValueError, match="unknown parallel axis 'xp'; the axes are pp, dp, cp, tp, etp, ep"):
        axis("xp")
    with pytest.raises(ValueError, match="axis 'zp': a mesh axis multiplies the GPUs"):
        Axis("zp", "--zp", "z", multiplies_gpus=True, optional=True, tie_break=9, help="", carved_from="data_ranks")


def test_config_strides_groups_and_labels_follow_the_mesh_order():
    config = ParallelConfig(gpus=96, global_batch=12, pp=3, dp=2, cp=2, tp=8, ep=4)
    assert [config.stride(name) for name in MESH_AXIS_NAMES] == [32, 16, 8, 1]
    assert mesh_stride(config, "dp") == 16
    with pytest.raises(ValueError, match="'ep' is not a mesh axis; the mesh is \\(pp, dp, cp, tp\\)"):
        config.stride("ep")
    assert (config.data_ranks, config.expert_data_ranks, config.expert_data_stride) == (4, 1, 32)
    assert config.shard_degree == 4 and config.rank_microbatch == 0.5
    assert tuple(config.enabled(axis) for axis in ("pp", "dp", "cp", "tp", "etp", "ep")) == (
        True, True, True, True, True, True)
    assert config.mesh_label() == "pp=3 dp=2 cp=2 tp=8 ep=4"
    assert config.label().startswith("pp=3 dp=2 cp=2 tp=8 ep=4, 1f1b, mbs 1, ZeRO-0")
    plain = ParallelConfig(gpus=4, global_batch=4, dp=4)
    assert plain.mesh_label() == "pp=1 dp=4 tp=1" and plain.rank_microbatch == 1
    assert not plain.enabled("cp") and plain.enabled("dp")


def test_plan_mesh_writes_optional_axes_only_when_on():
    assert mesh_json(ParallelConfig(gpus=4, global_batch=4, dp=4)) == {"pp": 1, "dp": 4, "tp": 1}
    assert list(mesh_json(ParallelConfig(gpus=8, global_batch=4, dp=4, cp=2, ep=2))) == ["pp", "dp", "tp", "cp", "ep"]


def test_sort_key_tie_breaks_pp_tp_cp_dp_then_switches_then_ep():
    config = ParallelConfig(gpus=16, global_batch=8, pp=2, dp=2, cp=2, tp=2, ep=2, zero=1, shard_group=2)
    # ep, then etp (= tp), then whether the CP method is other than the default
    assert config.sort_key == (2, 2, 2, 2, 1, 1, False, "1f1b", 1, -2, 2, 2, False)
    assert replace(config, cp_method="ulysses").sort_key[-1] is True


def test_mesh_rules_raise_with_the_numbers():
    with pytest.raises(ValueError, match=r"pp\*dp\*cp\*tp = 2\*2\*1\*2 = 8 must equal the number of GPUs \(4\)"):
        ParallelConfig(gpus=4, global_batch=4, pp=2, dp=2, tp=2)
    with pytest.raises(ValueError, match=r"expert parallelism ep=4 must divide the expert ranks "
                                         r"dp\*cp\*tp/etp = 2\*1\*1/1 = 2"):
        ParallelConfig(gpus=2, global_batch=2, dp=2, ep=4)
    with pytest.raises(ValueError, match=r"expert tensor parallelism etp=3 must divide the stage ranks "
                                         r"dp\*cp\*tp = 2\*1\*2 = 4"):
        ParallelConfig(gpus=4, global_batch=2, dp=2, tp=2, etp=3)
    with pytest.raises(ValueError, match=r"ep=4 must divide the expert ranks dp\*cp\*tp/etp = 2\*1\*2/2 = 2"):
        ParallelConfig(gpus=4, global_batch=2, dp=2, tp=2, ep=4)  # etp follows tp: ep within dp * cp
    with pytest.raises(ValueError, match="cp must be a positive integer, got 0"):
        ParallelConfig(gpus=2, global_batch=2, dp=2, cp=0)
    with pytest.raises(ValueError, match="tp must be a positive integer, got True"):
        ParallelConfig(gpus=1, global_batch=1, tp=True)


def test_cli_flags_come_from_the_registry():
    parser = argparse.ArgumentParser()
    add_axis_arguments(parser, 1, skip=("dp",))
    args = parser.parse_args(["--tp", "2", "--cp", "4"])
    assert axis_arguments(args, skip=("dp",)) == {"pp": 1, "cp": 4, "tp": 2, "etp": None, "ep": 1}
    with pytest.raises(SystemExit):
        parser.parse_args(["--dp", "2"])


def test_folding_lays_the_experts_over_the_whole_stage():
    """Megatron-Core's MoE parallel folding: (edp, ep, etp) over the tp * cp * dp ranks of a stage."""
    qwen = ParallelConfig(gpus=256, global_batch=256, pp=8, dp=16, tp=2, ep=32, etp=1)  # ep > dp * cp
    assert (qwen.stage_ranks, qwen.expert_tp, qwen.expert_ranks, qwen.expert_data_ranks) == (32, 1, 32, 1)
    assert qwen.expert_data_stride == 32 and qwen.mesh_label() == "pp=8 dp=16 tp=2 etp=1 ep=32"
    assert mesh_json(qwen) == {"pp": 8, "dp": 16, "tp": 2, "etp": 1, "ep": 32}
    default = ParallelConfig(gpus=16, global_batch=8, dp=4, tp=4, ep=2)
    assert default.etp is None and default.expert_tp == 4 and default.expert_data_ranks == 2
    assert default.expert_data_stride == 8 and "etp" not in mesh_json(default)
    # etp equal to tp is the default layout: stored unset, so equal layouts compare equal
    assert ParallelConfig(gpus=16, global_batch=8, dp=4, tp=4, ep=2, etp=4) == default
    wider = ParallelConfig(gpus=16, global_batch=8, dp=4, tp=2, cp=2, etp=4, ep=2)
    assert (wider.expert_ranks, wider.expert_data_ranks, wider.expert_data_stride) == (4, 2, 8)
    assert not ParallelConfig(gpus=4, global_batch=4, dp=2, tp=2, etp=1).enabled("etp")


def test_the_accepted_mesh_memo_stays_bounded_and_never_accepts_a_bad_mesh(monkeypatch):
    """`ParallelConfig` remembers the meshes it accepted (the search builds tens of thousands of
    configurations over a few meshes); the memo empties at its bound, and a mesh it never accepted
    is still checked and refused."""
    from meshplan.planner.contracts import config

    monkeypatch.setattr(config, "_CHECKED_MESHES", set())
    monkeypatch.setattr(config, "_MAX_CHECKED_MESHES", 4)
    for gpus in (2, 4, 8, 16, 32, 64):
        ParallelConfig(gpus=gpus, global_batch=gpus, dp=gpus)
        assert len(config._CHECKED_MESHES) <= 4
    with pytest.raises(ValueError, match=r"1\*4\*1\*1 = 4 must equal the number of GPUs \(8\)"):
        ParallelConfig(gpus=8, global_batch=8, dp=4)
