"""Days, GPU-hours and cost from tokens/s; the deadline sweep picks the cheapest size that meets it."""
from __future__ import annotations

import pytest

from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.engines.sizing import size_cluster, sweep_counts, training_cost


def test_training_cost_arithmetic():
    row = training_cost(gpus=512, tokens=1e12, tokens_per_s=1e6, step_time_s=2.0, usd_per_gpu_hour=2.0)
    assert row.days == pytest.approx(1e6 / 86400)
    assert row.gpu_hours == pytest.approx(1e6 / 3600 * 512)
    assert row.usd == pytest.approx(row.gpu_hours * 2.0)


def test_sweep_counts_are_node_multiples_up_to_the_largest():
    assert sweep_counts(8, 100) == [8, 16, 32, 64, 100]
    assert sweep_counts(8, 4) == [4]


def test_deadline_picks_the_cheapest_size_that_meets_it_and_stops_one_past():
    asked = []

    def cost_at(gpus):
        asked.append(gpus)
        if gpus == 8:
            raise MeshplanError("does not fit")
        efficiency = 1.0 - gpus / 1000  # scaling loss
        return training_cost(gpus, 1e12, 1e5 * gpus * efficiency, 1.0)

    sizing = size_cluster([8, 16, 32, 64, 128, 256], cost_at, deadline_days=5)
    assert sizing.chosen.gpus == 32 and sizing.chosen.days <= 5
    assert asked == [8, 16, 32, 64] and len(sizing.skipped) == 1
    assert [row.gpus for row in sizing.rows] == [16, 32, 64]


def test_no_size_meets_the_deadline():
    sizing = size_cluster([8], lambda g: training_cost(g, 1e12, 1.0, 1.0), deadline_days=1)
    assert sizing.chosen is None and sizing.to_json()["chosen_gpus"] is None


def test_sizes_whose_compute_ceiling_misses_the_deadline_are_not_planned():
    from meshplan.planner.engines.sizing import ceiling_tokens_per_s

    asked = []

    def cost_at(gpus):
        asked.append(gpus)
        return training_cost(gpus, 1e12, 0.5 * 1e5 * gpus, 1.0)  # half the ceiling's rate

    # 6e9 FLOPs per token at 6e14 FLOP/s per GPU: the ceiling is 1e5 tokens/s per GPU; 1e12 tokens
    # in 1 day need 1.16e7 tokens/s, so no count under 116 GPUs can make it, whatever the plan
    ceiling = lambda gpus: ceiling_tokens_per_s(gpus, 6e9, 6e14)  # noqa: E731
    assert ceiling(1) == 1e5
    sizing = size_cluster([8, 16, 32, 64, 128, 256, 512], cost_at, deadline_days=1, ceiling_at=ceiling,
                          tokens=1e12)
    # 128 GPUs' ceiling (1.28e7/s) could make it, so 128 is planned (and misses at half that rate)
    assert asked == [128, 256, 512]
    assert sizing.chosen.gpus == 256
    assert len(sizing.skipped) == 4 and all("cannot meet the deadline" in line for line in sizing.skipped)
