"""Every registered pipeline schedule's description (`contracts.schedule`) agrees with what the
simulator generates, with torch's classes, and with what ParallelConfig, the candidate generator
and the engines accept: the description is the one place a schedule's facts live."""
from __future__ import annotations

import itertools

import pytest

from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.contracts.schedule import SCHEDULE_SPECS, SCHEDULES, Schedule, schedule_spec
from meshplan.planner.search.bounds import step_factor_floor
from meshplan.planner.search.candidates import MAX_VIRTUAL_STAGES, Pins, _schedules
from meshplan.planner.simulation.factors import step_factor
from meshplan.planner.simulation.schedules import GENERATORS, rank_actions

SPECS = list(SCHEDULE_SPECS.values())
# (pp, m, v) small enough to generate every rank's order quickly, large enough to hit every rule:
# m below and above pp and 2 pp, m not a multiple of pp or of torch's rounds, v = 1, 2 (the V) and 3.
GRID = [(pp, m, v) for pp in range(1, 6) for m in range(1, 13) for v in range(1, 4)]
MANY_LAYERS = 1000


def test_registry_is_keyed_by_the_names_users_type():
    assert SCHEDULES == ("1f1b", "gpipe", "interleaved", "zb-interleaved", "zbv", "dualpipev")
    assert all(SCHEDULE_SPECS[name].name == name for name in SCHEDULES)
    assert all(spec.actions in GENERATORS for spec in SPECS)
    with pytest.raises(ValueError, match="unknown pipeline schedule 'zb'; known: 1f1b, gpipe"):
        schedule_spec("zb")


@pytest.mark.parametrize("spec", SPECS, ids=lambda spec: spec.name)
def test_accepted_configs_generate_complete_orders_and_rejected_ones_raise(spec):
    accepted = 0
    for pp, m, v in GRID:
        if not spec.accepts(pp, m, v):
            with pytest.raises(ValueError):
                rank_actions(spec.name, pp, m, v, 0)
            continue
        accepted += 1
        chunks = sorted(spec.chunk_index(pp, rank, local) for rank in range(pp) for local in range(v))
        assert chunks == list(range(pp * v)), (pp, v)
        for rank in range(pp):
            mine = [spec.chunk_index(pp, rank, local) for local in range(v)]
            assert all(spec.chunk_rank(pp, chunk) == rank for chunk in mine)
            actions = rank_actions(spec.name, pp, m, v, rank)
            kinds = {(a.kind, a.chunk, a.microbatch) for a in actions}
            forwards = {(c, mb) for kind, c, mb in kinds if kind == "F"}
            assert forwards == set(itertools.product(mine, range(m))), (spec.name, pp, m, v, rank)
            # every micro-batch's backward once: whole (B), or split into input (I) and weight (W)
            for chunk, mb in forwards:
                whole, split = ("B", chunk, mb) in kinds, {("I", chunk, mb), ("W", chunk, mb)} <= kinds
                assert whole != split, (spec.name, pp, m, v, rank, chunk, mb)
                assert not split or spec.split_backward
    assert accepted >= 10


@pytest.mark.parametrize("spec", SPECS, ids=lambda spec: spec.name)
def test_split_backward_schedules_split_some_backward(spec):
    kinds = {a.kind for pp, m, v in GRID if spec.accepts(pp, m, v) and pp > 1
             for rank in range(pp) for a in rank_actions(spec.name, pp, m, v, rank)}
    assert ("I" in kinds) == spec.split_backward


@pytest.mark.parametrize("spec", SPECS, ids=lambda spec: spec.name)
def test_torch_runs_the_described_class(spec):
    import torch.distributed.pipelining as pipelining
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, get_schedule_class

    cls = getattr(pipelining, spec.torch_class)
    assert get_schedule_class(spec.torchtitan_name) is cls  # torchtitan's name resolves to the same class
    assert issubclass(cls, PipelineScheduleMulti) == spec.multi_chunk


@pytest.mark.parametrize("spec", SPECS, ids=lambda spec: spec.name)
def test_parallel_config_accepts_exactly_what_the_description_does(spec):
    for pp, m, v in GRID:
        expected = spec.accepts(pp, m, v) and (pp == 1 or m >= pp)  # m >= pp: ParallelConfig's own rule
        try:
            config = ParallelConfig(gpus=pp, global_batch=m, pp=pp, schedule=spec.name, virtual_stages=v)
        except ValueError:
            assert not expected, (spec.name, pp, m, v)
            continue
        assert expected, (spec.name, pp, m, v)
        assert config.schedule_spec is spec
        assert [config.rank_of_chunk(c) for c in range(pp * v)] == [spec.chunk_rank(pp, c) for c in range(pp * v)]


@pytest.mark.parametrize("spec", SPECS, ids=lambda spec: spec.name)
def test_candidate_generator_offers_what_the_description_says(spec):
    for pp, m, v in GRID:
        if pp > 1 and m < pp:  # the generator's caller never asks
            continue
        accepts = spec.accepts(pp, m, v)
        pinned = _schedules(pp, m, MANY_LAYERS, Pins(schedule=spec.name, vpp=v))
        assert ((spec.name, v) in pinned) == accepts, (spec.name, pp, m, v)
        searched = _schedules(pp, m, MANY_LAYERS, Pins(vpp=v))
        assert ((spec.name, v) in searched) == (accepts and spec.searched_at(pp, m, v)), (spec.name, pp, m, v)
        # the chunks cut the layers: no more chunks than layers
        assert (spec.name, v) not in _schedules(pp, m, pp * v - 1, Pins(schedule=spec.name, vpp=v))
    pp, m = 4, 16
    unpinned = {vpp for name, vpp in _schedules(pp, m, MANY_LAYERS, Pins(schedule=spec.name)) if name == spec.name}
    assert unpinned == {v for v in spec.searched_chunks(MAX_VIRTUAL_STAGES) if spec.accepts(pp, m, v)}


def test_search_preferences():
    """GPipe only when pinned; interleaved from 2 chunks; ZB-V once m >= 2 pp - 1."""
    assert not SCHEDULE_SPECS["gpipe"].searched_at(4, 8, 1)
    assert not SCHEDULE_SPECS["interleaved"].searched_at(4, 8, 1) and SCHEDULE_SPECS["interleaved"].searched_at(4, 8, 2)
    zbv = SCHEDULE_SPECS["zbv"]
    assert zbv.accepts(4, 6, 2) and not zbv.searched_at(4, 6, 2) and zbv.searched_at(4, 7, 2)
    assert list(SCHEDULE_SPECS["zb-interleaved"].searched_chunks(MAX_VIRTUAL_STAGES)) == [1, 2, 3, 4]
    assert list(zbv.searched_chunks(MAX_VIRTUAL_STAGES)) == [2]


@pytest.mark.parametrize("spec", SPECS, ids=lambda spec: spec.name)
def test_textbook_factor_is_what_the_simulator_plays(spec):
    """The search's bounds take m + p - 1 for the textbook schedules without replay; for the
    others `bounds.step_factor_floor` stays below what the simulator plays."""
    for pp, m, v in GRID:
        if pp == 1 or m < pp or not spec.accepts(pp, m, v):
            continue
        played = step_factor(spec.name, pp, m, v)
        floor = step_factor_floor(spec.name, pp, m, v)
        if spec.textbook_factor:
            assert played == pytest.approx(m + pp - 1) and floor == m + pp - 1
        else:
            assert floor <= played + 1e-9, (spec.name, pp, m, v)


def test_engine_names_round_trip():
    from meshplan.planner.engines.torchtitan import _schedule

    for spec in SPECS:
        notes: list[str] = []
        assert _schedule(spec.torchtitan_name, 4, 2 if spec.multi_chunk else 1, notes) == spec.name
        assert notes == []
    assert [spec.name for spec in SPECS if spec.megatron] == ["1f1b", "interleaved"]
    assert [spec.name for spec in SPECS if spec.deepspeed] == ["1f1b"]


def test_inconsistent_descriptions_are_rejected():
    base = dict(name="x", actions="1f1b", torch_class="Schedule1F1B")
    with pytest.raises(ValueError, match="runs one chunk per rank, not 1..3"):
        Schedule(**base, most_chunks=3)
    with pytest.raises(ValueError, match="a V mirrors exactly 2 chunks per rank, not 1..4"):
        Schedule(**base, multi_chunk=True, most_chunks=4, placement="v")
    with pytest.raises(ValueError, match="textbook factor"):
        Schedule(**base, split_backward=True, textbook_factor=True)
    with pytest.raises(ValueError, match="placement must be one of loop, v, got 'zigzag'"):
        Schedule(**base, placement="zigzag")
    with pytest.raises(ValueError, match="least searched chunks 1 is outside 2..2"):
        Schedule(**base, multi_chunk=True, least_chunks=2, most_chunks=2)


def test_messages_show_the_numbers():
    with pytest.raises(ValueError, match=r"virtual stages \(2\) need --schedule interleaved or zb-interleaved"):
        SCHEDULE_SPECS["1f1b"].check(4, 8, 2)
    with pytest.raises(ValueError, match=r"is V-shaped: exactly 2 model chunks per rank \(--vpp 2\), got 3"):
        SCHEDULE_SPECS["zbv"].check(4, 8, 3)
    with pytest.raises(ValueError, match=r"micro-batch count \(6\) to be a multiple of pp \(4\)"):
        SCHEDULE_SPECS["interleaved"].check(4, 6, 2)
    with pytest.raises(ValueError, match=r"at least as many micro-batches \(7\) as model chunks \(2 x pp = 8\)"):
        SCHEDULE_SPECS["dualpipev"].check(4, 7, 2)
    with pytest.raises(ValueError, match="needs pipeline parallelism"):
        SCHEDULE_SPECS["zb-interleaved"].check(1, 8, 1)


@pytest.mark.parametrize("spec", SPECS, ids=lambda spec: spec.name)
def test_engine_exports_follow_the_description(spec):
    """torchtitan gets torch's name (and reads it back with the plan's chunks), Megatron-LM its
    virtual-stage flag or a note, DeepSpeed a note unless it runs the schedule."""
    import tomllib

    from meshplan.executor.plans import uniform_plan
    from meshplan.planner.costing.hardware import load_cluster
    from meshplan.planner.engines.bridge import export_plan, job_pins, read_engine_text

    vpp = spec.least_chunks if not spec.free_chunks else 2
    plan = uniform_plan("gpt:layers=6,hidden=64,heads=4,vocab=256", 32, 8, load_cluster("a100-80g"), pp=2,
                        schedule=spec.name, virtual_stages=vpp, precision="bf16-mixed")
    titan = export_plan(plan, "torchtitan")
    assert tomllib.loads(titan.text)["parallelism"]["pipeline_parallel_schedule"] == spec.torchtitan_name
    job = read_engine_text(titan.text, "torchtitan")
    assert (job.schedule, job.vpp) == (spec.name, vpp)
    assert job_pins(job)["schedule"] == spec.name and job_pins(job).get("vpp") == (vpp if vpp > 1 else None)
    from meshplan.planner.contracts.errors import MeshplanError

    if spec.megatron is None:  # an engine refuses, in one line, a schedule it does not run
        with pytest.raises(MeshplanError, match=f"Megatron-LM has no {spec.name} pipeline schedule"):
            export_plan(plan, "megatron")
    else:
        megatron = export_plan(plan, "megatron")
        assert ("--num-virtual-stages-per-pipeline-rank 2" in megatron.text) == (spec.megatron == "interleaved")
    if not spec.deepspeed:
        with pytest.raises(MeshplanError, match=f"runs 1f1b only, not {spec.name}"):
            export_plan(plan, "deepspeed")
