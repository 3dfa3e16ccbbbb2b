"""Zero-bubble and V-shaped schedules: torch's own orders, and bubbles against published analysis."""
from __future__ import annotations

import logging
import types

import pytest

from meshplan.planner.contracts.config import ParallelConfig, chunk_index
from meshplan.planner.simulation.factors import step_factor
from meshplan.planner.simulation.schedules import max_in_flight, rank_actions

KINDS = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}


def _torch_orders(name: str, pp: int, m: int, v: int) -> dict[int, list[tuple]]:
    """torch's `pipeline_order` (stand-in stages: the order needs only their indices), with each
    "F;B" pair flattened into its forward (marked) and its full backward."""
    from torch.distributed.pipelining import schedules

    cls = {"zb-interleaved": schedules.ScheduleInterleavedZeroBubble, "zbv": schedules.ScheduleZBVZeroBubble,
           "dualpipev": schedules.ScheduleDualPipeV}[name]
    stages = [types.SimpleNamespace(group_size=pp, group_rank=0, num_stages=pp * v, submod=None,
                                    stage_index=chunk_index(name, pp, 0, local)) for local in range(v)]
    out = {}
    for rank, actions in cls(stages, m, loss_fn=lambda output, target: output).pipeline_order.items():
        flat = []
        for action in filter(None, actions):
            if action.sub_actions:
                forward, backward = action.sub_actions
                flat += [(forward.stage_index, "F", forward.microbatch_index, True),
                         (backward.stage_index, "B", backward.microbatch_index, False)]
            else:
                flat.append((action.stage_index, KINDS[action.computation_type.name], action.microbatch_index, False))
        out[rank] = flat
    return out


def _grid():
    for pp in (2, 3, 4, 5, 8):
        for m in range(pp, 4 * pp + 3):
            if m % max(1, m // pp) == 0:
                yield from (("zb-interleaved", pp, m, v) for v in (1, 2, 3))
            yield "zbv", pp, m, 2
            if m >= 2 * pp:
                yield "dualpipev", pp, m, 2


def test_orders_equal_torch_pipeline_order():
    pytest.importorskip("torch.distributed.pipelining")
    logging.getLogger("torch.distributed.pipelining.schedules").setLevel(logging.ERROR)
    compared = 0
    for name, pp, m, v in _grid():
        torch_orders = _torch_orders(name, pp, m, v)
        for rank in range(pp):
            ours = [(a.chunk, a.kind, a.microbatch, a.overlap) for a in rank_actions(name, pp, m, v, rank)]
            assert ours == torch_orders[rank], f"{name} pp={pp} m={m} v={v} rank {rank}"
            compared += 1
    assert compared > 1000


@pytest.mark.parametrize("name,pp,m,v", [("zb-interleaved", 4, 8, 2), ("zbv", 4, 8, 2), ("dualpipev", 4, 8, 2),
                                         ("zbv", 4, 5, 2)])
def test_every_action_once_and_in_dependency_order(name, pp, m, v):
    cfg = ParallelConfig(gpus=pp, global_batch=m, pp=pp, schedule=name, virtual_stages=v)
    for rank in range(pp):
        actions = rank_actions(name, pp, m, v, rank)
        expected = {(chunk, mb) for chunk in cfg.chunks_of_rank(rank) for mb in range(m)}
        forwards = [(a.chunk, a.microbatch) for a in actions if a.kind == "F"]
        grads = [(a.chunk, a.microbatch) for a in actions if a.kind in ("B", "I")]
        weights = [(a.chunk, a.microbatch) for a in actions if a.kind in ("B", "W")]
        assert sorted(forwards) == sorted(grads) == sorted(weights) == sorted(expected)
        for a in actions:  # a backward after its forward, W after its I
            before = actions[:actions.index(a)]
            if a.kind in ("B", "I"):
                assert ("F", a.chunk, a.microbatch) in [(b.kind, b.chunk, b.microbatch) for b in before]
            if a.kind == "W":
                assert ("I", a.chunk, a.microbatch) in [(b.kind, b.chunk, b.microbatch) for b in before]


def test_v_placement_mirrors_the_second_half():
    cfg = ParallelConfig(gpus=4, global_batch=8, pp=4, schedule="zbv", virtual_stages=2)
    assert [cfg.rank_of_chunk(c) for c in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert cfg.chunks_of_rank(1) == (1, 6)
    interleaved = ParallelConfig(gpus=4, global_batch=8, pp=4, schedule="zb-interleaved", virtual_stages=2)
    assert interleaved.chunks_of_rank(1) == (1, 5)


@pytest.mark.parametrize("name,message", [("zbv", "--vpp 2"), ("dualpipev", "2 x pp = 8")])
def test_config_states_torch_rules(name, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        ParallelConfig(gpus=4, global_batch=6, pp=4, schedule=name, virtual_stages=1 if name == "zbv" else 2)
    with pytest.raises(ValueError, match="multiple of its rounds"):
        ParallelConfig(gpus=4, global_batch=10 - 1, pp=4, schedule="zb-interleaved", virtual_stages=2)


# Published bubbles, F = I = W (B = 2F, the step factor's unit chunks) and no transfers, in units
# of one rank's per-micro-batch time T = 3F: step factor - m.
#   1F1B: (p - 1)                                 ZB1P (Qi et al. 2023): (p - 1)(F + I - W) = (p - 1)/3
#   zb-interleaved, v chunks: ZB1P's fill with 1/v-size chunks, (p - 1)/(3v)
#   ZB-V: one synchronous step keeps the fill of a half-size chunk, (p - 1) F/2 = (p - 1)/6, for m >= 2p - 1
#   DualPipeV (DeepSeek-AI 2024, Table 2): (p - 1)(F&B + B - 3W) in chunk times, F&B = F + B as
#   torch runs it: (p - 1)(2F + 2I - W)/2 = (p - 1)/3
# Tolerance 1e-9: the engine plays unit durations, so these are exact.
@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 16), (8, 16), (8, 32)])
def test_bubbles_match_published_analysis(pp, m):
    expected = {("1f1b", 1): pp - 1, ("zb-interleaved", 1): (pp - 1) / 3, ("zb-interleaved", 2): (pp - 1) / 6,
                ("zbv", 2): (pp - 1) / 6, ("dualpipev", 2): (pp - 1) / 3}
    for (name, v), bubble in expected.items():
        assert step_factor(name, pp, m, v) - m == pytest.approx(bubble, abs=1e-9), name
    for name, v in [("zb-interleaved", 1), ("zb-interleaved", 2), ("zbv", 2), ("dualpipev", 2)]:
        assert step_factor(name, pp, m, v) < step_factor("1f1b", pp, m, 1)


def test_zero_bubble_memory_is_1f1b_s():
    # ZB-H1 and ZB-V hold at most 1F1B's peak (its first rank's p micro-batches, Qi et al.) on
    # every rank, in units of a whole stage's activations: W, not I, frees them.
    pp, m = 4, 8
    peak_1f1b = max(max_in_flight(rank_actions("1f1b", pp, m, 1, rank)) for rank in range(pp))
    assert peak_1f1b == pp
    for rank in range(pp):
        assert max_in_flight(rank_actions("zb-interleaved", pp, m, 1, rank)) == pp
        assert max_in_flight(rank_actions("zbv", pp, m, 2, rank)) / 2 == pp  # chunks are half a stage
