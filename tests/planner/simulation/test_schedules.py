"""Pipeline schedule orders: closed-form properties, and the order torch actually executes."""
from __future__ import annotations

import json
import multiprocessing
import socket

import pytest

from meshplan.planner.simulation.schedules import (Action, backwards_before_last_forward, held_boundary_bytes,
                                                   max_in_flight, rank_actions, schedule_actions)

# Small cases (p <= 4, m <= 8, v <= 2) that torch 2.13 runs in the recording test below.
SINGLE_CASES = [(2, 2), (2, 5), (3, 3), (3, 7), (4, 4), (4, 8)]
INTERLEAVED_CASES = [(2, 2), (2, 4), (3, 6), (4, 4), (4, 8)]
# Split-backward schedules (name, p, m, v), run by torch with V placement where it applies.
ZERO_BUBBLE_CASES = [("zb-interleaved", 2, 4, 2), ("zb-interleaved", 4, 8, 1), ("zbv", 2, 4, 2), ("zbv", 4, 5, 2),
                     ("dualpipev", 2, 4, 2), ("dualpipev", 4, 8, 2)]
WORLD_SIZE = 4


def _valid(actions_by_rank, num_stages, num_microbatches, virtual_stages):
    """Every (chunk, mb) forward and backward once per rank; forward before its backward."""
    for rank, actions in enumerate(actions_by_rank):
        chunks = [vs * num_stages + rank for vs in range(virtual_stages)]
        expected = {(kind, chunk, mb) for kind in "FB" for chunk in chunks for mb in range(num_microbatches)}
        assert set(actions) == {Action(*e) for e in expected}
        assert len(actions) == len(expected)
        seen_fwd = set()
        for action in actions:
            if action.kind == "F":
                seen_fwd.add((action.chunk, action.microbatch))
            else:
                assert (action.chunk, action.microbatch) in seen_fwd


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("num_stages,num_microbatches", SINGLE_CASES + [(8, 32)])
def test_single_stage_schedules_are_complete(schedule, num_stages, num_microbatches):
    _valid(schedule_actions(schedule, num_stages, num_microbatches), num_stages, num_microbatches, 1)


@pytest.mark.parametrize("num_stages,num_microbatches,virtual_stages",
                         [(2, 4, 2), (4, 8, 2), (4, 16, 4), (8, 64, 3), (3, 3, 2)])
def test_interleaved_is_complete(num_stages, num_microbatches, virtual_stages):
    _valid(schedule_actions("interleaved", num_stages, num_microbatches, virtual_stages),
           num_stages, num_microbatches, virtual_stages)


@pytest.mark.parametrize("num_stages,num_microbatches", [(4, 8), (4, 4), (8, 5), (16, 128)])
def test_1f1b_in_flight_is_min_m_p_minus_k(num_stages, num_microbatches):
    for rank in range(num_stages):
        if num_microbatches < num_stages:
            continue
        actions = rank_actions("1f1b", num_stages, num_microbatches, 1, rank)
        assert max_in_flight(actions) == min(num_microbatches, num_stages - rank)
    # GPipe holds every micro-batch on every rank.
    assert max_in_flight(rank_actions("gpipe", num_stages, num_microbatches, 1, 0)) == num_microbatches


def test_1f1b_order_by_hand():
    # p=3, m=4, rank 1: two warm-up forwards, then B/F pairs, then the drain.
    got = [str(a) for a in rank_actions("1f1b", 3, 4, 1, 1)]
    assert got == ["1F0", "1F1", "1B0", "1F2", "1B1", "1F3", "1B2", "1B3"]


@pytest.mark.parametrize("num_stages,num_microbatches,virtual_stages", [(2, 8, 2), (2, 32, 2), (4, 16, 2), (4, 4, 3)])
def test_backwards_before_last_forward(num_stages, num_microbatches, virtual_stages):
    """Counted from the order itself: at the last forward, every chunk's micro-batches are either
    in flight or done, and the steady state leaves the warm-up's count in flight."""
    for rank in range(num_stages):
        actions = rank_actions("interleaved", num_stages, num_microbatches, virtual_stages, rank)
        last = max(i for i, a in enumerate(actions) if a.kind == "F")
        done = backwards_before_last_forward("interleaved", num_stages, num_microbatches, virtual_stages)[rank]
        for local in range(virtual_stages):
            forwards = sum(1 for a in actions[:last + 1] if a.kind == "F" and a.chunk // num_stages == local)
            frees = sum(1 for a in actions[:last] if a.frees_activations and a.chunk // num_stages == local)
            assert done[local] == frees <= forwards
        if num_microbatches <= num_stages:  # every forward before the first backward on rank 0
            assert rank > 0 or done == (0,) * virtual_stages


def test_held_boundary_bytes_by_hand():
    """pp 2, interleaved x2, 8 micro-batches, one byte per boundary: chunks 0, 2 on rank 0 and
    1, 3 on rank 1; three remote boundaries, so one receive buffer in transit on each side of
    each, and the gradient sends of every backward before the last forward (1F1B keeps none)."""
    rank_of = lambda c: c % 2  # noqa: E731
    done = backwards_before_last_forward("interleaved", 2, 8, 2)
    held = held_boundary_bytes("interleaved", 2, 8, 2, rank_of, [1.0, 1.0, 1.0])
    # kept: the input gradients sent back, by chunk 2 on rank 0 and chunks 1 and 3 on rank 1
    # (outputs sent on are freed once their gradient is back)
    assert held[0] == 3 + done[0][1]
    assert held[1] == 3 + done[1][0] + done[1][1]
    assert done[0][0] > 0 and done[1][1] > 0  # 8 micro-batches on 2 ranks: backwards ran by then
    assert held_boundary_bytes("1f1b", 2, 8, 1, rank_of, [1.0]) == [1.0, 1.0]


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        rank_actions("zb", 2, 4, 1, 0)
    with pytest.raises(ValueError, match="interleaved"):
        rank_actions("1f1b", 2, 4, 2, 0)
    with pytest.raises(ValueError, match="at least as many"):
        rank_actions("1f1b", 4, 2, 1, 0)
    with pytest.raises(ValueError, match="multiple"):
        rank_actions("interleaved", 2, 7, 2, 0)


# ---- what torch executes -------------------------------------------------------------------

def _record_worker(rank: int, port: int, out_path: str) -> None:
    """One gloo rank: run every case with tiny Linear stages, recording the stage calls in order."""
    import torch
    import torch.distributed as dist
    import torch.distributed.pipelining as pipelining
    from torch.distributed.pipelining import PipelineStage

    from meshplan.planner.contracts.schedule import schedule_spec

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    groups = {p: dist.new_group(ranks=list(range(p))) for p in (2, 3, 4)}
    cases = ([(name, p, m, 1) for name in ("gpipe", "1f1b") for p, m in SINGLE_CASES]
             + [("interleaved", p, m, 2) for p, m in INTERLEAVED_CASES] + ZERO_BUBBLE_CASES)
    recorded = {}
    for name, num_stages, num_mb, num_virtual in cases:
        if rank < num_stages:
            calls: list[str] = []
            stages = []
            spec = schedule_spec(name)
            for local in range(num_virtual):
                index = spec.chunk_index(num_stages, rank, local)
                stage = PipelineStage(torch.nn.Linear(4, 4), index, num_stages * num_virtual,
                                      torch.device("cpu"), group=groups[num_stages])
                _instrument(stage, index, calls)
                stages.append(stage)
            loss_fn = lambda output, target: ((output - target) ** 2).sum()  # noqa: E731
            schedule_class = getattr(pipelining, spec.torch_class)
            schedule = schedule_class(stages if spec.multi_chunk else stages[0], num_mb, loss_fn=loss_fn)
            inputs = torch.randn(num_mb, 4)
            holds_last = any(stage.stage_index == num_stages * num_virtual - 1 for stage in stages)  # V: rank 0
            kwargs = {"target": torch.zeros(num_mb, 4)} if holds_last else {}
            schedule.step(*((inputs,) if rank == 0 else ()), **kwargs)
            recorded[f"{name}/{num_stages}/{num_mb}/{num_virtual}"] = calls
        dist.barrier()
    with open(out_path, "w") as handle:
        json.dump(recorded, handle)
    dist.destroy_process_group()


def _instrument(stage, index: int, calls: list[str]) -> None:
    forward, backward, weight = stage.forward_one_chunk, stage.backward_one_chunk, stage.backward_weight_one_chunk

    def forward_one_chunk(mb, *args, **kwargs):
        calls.append(f"{index}F{mb}")
        return forward(mb, *args, **kwargs)

    def backward_one_chunk(mb, *args, **kwargs):
        calls.append(f"{index}{'B' if kwargs.get('full_backward', True) else 'I'}{mb}")
        return backward(mb, *args, **kwargs)

    def backward_weight_one_chunk(mb, *args, **kwargs):
        calls.append(f"{index}W{mb}")
        return weight(mb, *args, **kwargs)

    stage.forward_one_chunk, stage.backward_one_chunk = forward_one_chunk, backward_one_chunk
    stage.backward_weight_one_chunk = backward_weight_one_chunk


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.timeout(120)
def test_orders_match_what_torch_executes(tmp_path):
    """Run torch's GPipe, 1F1B, interleaved, zero-bubble and V-shaped schedules on 4 gloo ranks and
    compare each rank's recorded forward/backward calls with our generated order, exactly."""
    import torch.distributed.pipelining  # noqa: F401  imported once here, inherited by the forks

    context = multiprocessing.get_context("fork")
    port = _free_port()
    procs = [context.Process(target=_record_worker, args=(rank, port, str(tmp_path / f"r{rank}.json")))
             for rank in range(WORLD_SIZE)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(110)
    assert all(proc.exitcode == 0 for proc in procs), [proc.exitcode for proc in procs]
    compared = 0
    for rank in range(WORLD_SIZE):
        recorded = json.loads((tmp_path / f"r{rank}.json").read_text())
        for key, calls in recorded.items():
            name, num_stages, num_mb, num_virtual = key.split("/")
            ours = rank_actions(name, int(num_stages), int(num_mb), int(num_virtual), rank)
            assert [str(a) for a in ours] == calls, f"{key} rank {rank}"
            compared += 1
    assert compared == (sum(p for p, _ in SINGLE_CASES) * 2 + sum(p for p, _ in INTERLEAVED_CASES)
                        + sum(p for _, p, _, _ in ZERO_BUBBLE_CASES))


def test_warmup_live_is_each_orders_first_peak():
    """`warmup_live` (the search's memory bound reads it without generating an order) equals the
    forwards each generated order runs before its first backward, per virtual stage, and that
    vector is one of the rank's peaks the replay finds (no larger than a kept peak): every
    schedule over p <= 8, m <= 32, v <= 4."""
    from meshplan.planner.contracts.schedule import SCHEDULE_SPECS
    from meshplan.planner.search.ilp.evaluation import live_vectors
    from meshplan.planner.search.ilp.formulation import PipelineShape
    from meshplan.planner.simulation.schedules import warmup_live

    checked = 0
    for name, spec in SCHEDULE_SPECS.items():
        for p, m, v in ((p, m, v) for p in (1, 2, 3, 4, 5, 8) for m in (1, 2, 3, 4, 5, 7, 8, 9, 12, 16, 32)
                        for v in (1, 2, 3, 4)):
            try:
                spec.check(p, m, v)
            except ValueError:
                continue
            for rank, actions in enumerate(schedule_actions(name, p, m, v)):
                first = [0] * v
                for action in actions:
                    if action.kind != "F":
                        break
                    first[action.chunk // p] += 1
                assert warmup_live(name, p, m, v, rank) == tuple(first), (name, p, m, v, rank)
                peaks = live_vectors(PipelineShape(p, m, v, name), rank)
                assert any(all(a >= b for a, b in zip(peak, first)) for peak in peaks), (name, p, m, v, rank)
                if spec.textbook_factor:  # 1F1B's and GPipe's one peak: the bound reads it for the replay's
                    assert max(peaks, key=lambda vec: (min(vec), sum(vec))) == tuple(first), (name, p, m, v, rank)
                checked += 1
    assert checked > 1800
