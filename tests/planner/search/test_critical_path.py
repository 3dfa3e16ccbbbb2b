"""The critical-path program plays a schedule exactly as the event engine does: on random
pipelines of every schedule (unequal chunks, transfers, split backwards, blocking reductions) the
per-rank compute ends agree to 1e-9, and the path it reports is a real path of that length."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from meshplan.planner.contracts.config import chunk_rank
from meshplan.planner.search.ilp.critical_path import ChunkTimes, critical_path
from meshplan.planner.simulation.event_engine import _play
from meshplan.planner.simulation.step_costs import Chunk

# (schedule, virtual stages, smallest micro-batch count as a multiple of p)
SCHEDULES = (("gpipe", 1, 1), ("1f1b", 1, 1), ("interleaved", 2, 1), ("interleaved", 3, 1),
             ("zb-interleaved", 2, 1), ("zbv", 2, 1), ("dualpipev", 2, 2))


def _random_pipeline(rng: random.Random, schedule: str, v: int, low: int):
    p = rng.choice((1, 2, 3, 4, 8) if v == 1 else (2, 3, 4, 8) if schedule != "dualpipev" else (2, 4))
    m = p * rng.choice(range(low, low + 4))
    chunks = p * v
    fwd = [rng.uniform(0.5, 2.0) for _ in range(chunks)]
    bwd = [f * rng.uniform(1.5, 3.0) for f in fwd]
    weight = [b * rng.uniform(0.2, 0.6) for b in bwd]
    reduce = [rng.uniform(0.0, 3.0) for _ in range(chunks)]
    p2p = rng.choice((0.0, rng.uniform(0.01, 0.5)))
    return p, m, ChunkTimes(tuple(fwd), tuple(bwd), tuple(weight), tuple(reduce)), p2p


def _engine_ends(schedule, p, m, v, times: ChunkTimes, p2p_s: float, blocking: bool) -> list[float]:
    chunks = [Chunk(rank=chunk_rank(schedule, p, c), fwd_compute_s=f, fwd_tp_s=0.0, fwd_zero_s=0.0,
                     bwd_compute_s=b, recompute_s=0.0, bwd_tp_s=0.0, bwd_zero_s=0.0, activation_bytes=0.0,
                     grad_reduce_s=r, bwd_weight_s=w)
              for c, (f, b, w, r) in enumerate(zip(times.fwd_s, times.bwd_s, times.weight_s, times.reduce_s))]
    config = SimpleNamespace(num_microbatches=m, num_model_chunks=p * v, pp=p, schedule=schedule, virtual_stages=v,
                             microbatch_group_size=None)
    costs = SimpleNamespace(config=config, p2p_time_s=(p2p_s,) * (p * v - 1),
                            grad_sync="after_chunk" if blocking else "overlap")
    played = _play(costs, chunks, record=False)
    return [runs[-1].end_s for runs in played.runs], [i[-1][1] if i else 0.0 for i in played.dp_intervals]


@pytest.mark.parametrize("schedule,v,low", SCHEDULES)
def test_the_longest_path_is_the_engines_play(schedule, v, low):
    rng = random.Random(hash((schedule, v)) % 1000)
    for trial in range(30):
        p, m, times, p2p = _random_pipeline(rng, schedule, v, low)
        blocking = trial % 3 == 0
        path = critical_path(schedule, p, m, v, times, p2p, blocking)
        ends, reductions = _engine_ends(schedule, p, m, v, times, p2p, blocking)
        assert path.compute_end_s == pytest.approx(ends, rel=1e-9, abs=1e-9), (p, m, trial)
        if blocking:
            assert path.reduce_end_s == pytest.approx(reductions, rel=1e-9, abs=1e-9), (p, m, trial)
        # the reported path is a chain of whole actions and transfers ending when the rank does
        # (blocking reductions excepted: their waits are not actions)
        if not blocking:
            length = p2p * path.transfers_on_path
            for c, (f, b, i, w) in enumerate(path.on_path):
                parts = (times.fwd_s[c], times.bwd_s[c], times.bwd_s[c] - times.weight_s[c], times.weight_s[c])
                length += sum(n * t for n, t in zip((f, b, i, w), parts))
            assert length == pytest.approx(path.compute_end_s[path.critical_rank], rel=1e-9)


def test_a_longer_chunk_on_the_path_lengthens_the_step_by_its_count():
    """Along a fixed critical path the step is linear in the chunk times: growing one chunk's
    forward by a hair grows the step by that hair times its forwards on the path."""
    times = ChunkTimes((1.0, 1.3, 0.9, 1.1, 1.0, 1.2, 0.8, 1.0), (2.0, 2.6, 1.8, 2.2, 2.0, 2.4, 1.6, 2.0),
                       (0.0,) * 8, (0.0,) * 8)
    base = critical_path("interleaved", 4, 8, 2, times, 0.05)
    step = max(base.compute_end_s)
    hair = 1e-6
    grown = ChunkTimes(times.fwd_s[:1] + (times.fwd_s[1] + hair,) + times.fwd_s[2:], times.bwd_s, times.weight_s,
                       times.reduce_s)
    after = max(critical_path("interleaved", 4, 8, 2, grown, 0.05).compute_end_s)
    assert base.on_path[1][0] > 0
    assert after - step == pytest.approx(hair * base.on_path[1][0], rel=1e-3)


def test_chunk_times_are_checked():
    with pytest.raises(ValueError, match="one time per chunk"):
        ChunkTimes((1.0,), (2.0, 2.0), (0.0, 0.0), (0.0, 0.0))
    with pytest.raises(ValueError, match="W part 3.0 s outside"):
        ChunkTimes((1.0,), (2.0,), (3.0,), (0.0,))
