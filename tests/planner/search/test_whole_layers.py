"""The memory bound's whole-layer figures (`search.whole_layers`) against brute force: the least
time of n whole layers within a byte budget, with and without a cap on the layers of a chunk whose
live micro-batches differ; and both never below the fractional mix nor above any whole mix."""
import itertools
import math
import random

import pytest

from meshplan.planner.search.whole_layers import least_chunked_s, least_whole_s, undominated


def _options(rng):
    """(static, activation, seconds) of 2-4 options: faster ones keep more activations."""
    out, act, seconds = [], rng.uniform(2, 6), rng.uniform(1, 2)
    for _ in range(rng.randint(2, 4)):
        out.append((rng.uniform(1, 3), act, seconds))
        act, seconds = act * rng.uniform(0.1, 0.9), seconds * rng.uniform(1.05, 1.6)
    return out


def _brute(run, live, budget, layers, cap):
    """Every split of `layers` over the chunks (at most `cap` each) and every option per layer."""
    best = math.inf
    for split in itertools.product(range(cap + 1), repeat=len(live)):
        if sum(split) != layers:
            continue
        per_chunk = [itertools.combinations_with_replacement(range(len(run)), count) for count in split]
        for picks in itertools.product(*per_chunk):
            size = sum(run[o][0] + held * run[o][1] for held, chosen in zip(live, picks) for o in chosen)
            if size <= budget:
                best = min(best, sum(run[o][2] for chosen in picks for o in chosen))
    return best


@pytest.mark.parametrize("seed", range(40))
def test_whole_layers_match_brute_force(seed):
    rng = random.Random(seed)
    run = _options(rng)
    live = tuple(sorted(rng.randint(1, 5) for _ in range(rng.randint(1, 3))))
    layers, cap = rng.randint(1, 5), rng.randint(1, 4)
    budget = rng.uniform(0.3, 1.0) * layers * (3 + max(live) * 6)
    assert least_chunked_s(run, live, budget, layers, cap) == pytest.approx(_brute(run, live, budget, layers, cap))
    # one chunk at the least live count and no cap: the uncapped search
    at_least = undominated((static + live[0] * act, seconds) for static, act, seconds in run)
    assert least_whole_s(at_least, budget, layers) == pytest.approx(_brute(run, live[:1], budget, layers, layers))
    # the cap and the chunks' larger live counts only remove mixes: never faster
    assert least_chunked_s(run, live, budget, layers, cap) >= least_whole_s(at_least, budget, layers) - 1e-12


def test_an_empty_rank_takes_no_time_and_an_impossible_one_is_infinite():
    run = [(1.0, 2.0, 1.0), (1.0, 0.5, 1.5)]
    assert least_whole_s(undominated([(3.0, 1.0), (1.5, 1.5)]), 1.0, 0) == 0.0
    assert least_chunked_s(run, (1, 2), 10.0, 5, 2) == math.inf  # 2 chunks of at most 2 layers
    assert least_whole_s(undominated([(3.0, 1.0), (1.5, 1.5)]), 2.0, 2) == math.inf  # 2 x 1.5 bytes > 2
