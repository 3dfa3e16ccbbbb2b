"""The gather heads of the stage-assignment ILP (`planner.search.ilp.formulation`'s chunk time):
each chunk's forward waits for its first layer's parameter gather and its backward for its last
layer's, which no layer before them in the chunk hides (`gathers.gather_exposure_s`). One
family per formulation, every row named (head_*, open_*, close_*, head_used_*); `constraints`
calls them while it builds a candidate's model.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from meshplan.planner.search.ilp.evaluation import leading_chunks

if TYPE_CHECKING:  # annotations only: the model class lives in planner.search.ilp.constraints
    from meshplan.planner.search.ilp.constraints import _Model


def _has_gathers(table) -> bool:
    return any(o.fwd_gather_s > 0 or o.bwd_gather_s > 0 for t in table.types for o in t.options)


def add_layer_head_terms(model: _Model, x) -> None:
    """Per-layer formulation: the gathers of each chunk pass beyond the layers' steady shares
    (`evaluation.pass_gather_s`). Layer l opens chunk c's forward iff it is in c and l - 1 is not:
    head_fwd_l_c >= sum_o h_o x_lco - max_o h_o X_{l-1,c} is that exactly, as the objective holds
    it down (the backward alike with l + 1), and the rows above it keep it from being more."""
    table, pulp = model.problem.table, model.pulp
    if not _has_gathers(table):
        return
    in_chunk: dict[tuple[int, int], list[tuple[int, object]]] = {}
    for (layer, c, o), var in x.items():
        in_chunk.setdefault((layer, c), []).append((o, var))
    for (layer, c), chosen in in_chunk.items():
        options = table.types[table.layer_type[layer]].options
        for name, neighbour, field in (("fwd", layer - 1, "fwd_head_s"), ("bwd", layer + 1, "bwd_head_s")):
            heads = [getattr(options[o], field) for o, _ in chosen]
            beside = in_chunk.get((neighbour, c), [])
            if max(heads) > 0:
                opened = pulp.lpSum(head * var for head, (_, var) in zip(heads, chosen))
                if not beside:  # nothing before it in this chunk: it opens the pass whenever it is here
                    model.add_head(c, name, opened)
                else:
                    # exact both ways: the rows below keep the reduction rows from reading a larger head
                    head = pulp.LpVariable(f"head_{name}_{layer}_{c}", lowBound=0)
                    model.lp += head >= opened - max(heads) * pulp.lpSum(var for _, var in beside), \
                        f"head_{name}_{layer}_{c}"
                    model.lp += head <= opened, f"head_{name}_{layer}_{c}_up"
                    model.lp += head <= max(heads) * (1 - pulp.lpSum(var for _, var in beside)), \
                        f"head_{name}_{layer}_{c}_beside"
                    model.add_head(c, name, head)


def _edges(model: _Model, c: int, used: list, reverse: bool) -> list:
    """edge_o = [o is the lowest (reverse: highest) used option of chunk c], exact: at least
    y_o - sum of the options before it, at most y_o and 1 - each of those."""
    pulp, kind = model.pulp, "close" if reverse else "open"
    order = list(range(len(used)))[::-1] if reverse else list(range(len(used)))
    edges = [None] * len(used)
    for position, o in enumerate(order):
        before = [used[q] for q in order[:position]]
        edge = edges[o] = pulp.LpVariable(f"{kind}_{c}_{o}", lowBound=0, upBound=1)
        model.lp += edge >= used[o] - pulp.lpSum(before), f"{kind}_lo_{c}_{o}"
        model.lp += edge <= used[o], f"{kind}_up_{c}_{o}"
        for q, var in enumerate(before):
            model.lp += edge <= 1 - var, f"{kind}_excl_{c}_{o}_{q}"
    return edges


def _alike_at_edges(options) -> bool:
    """The run's options have the same gather heads."""
    return len({(option.fwd_head_s, option.bwd_head_s) for option in options}) == 1


def add_run_head_terms(model: _Model, counts, options, count: int, first: int) -> None:
    """Compact formulation: the gathers of each chunk pass beyond the layers' steady shares
    (`evaluation.pass_gather_s`).

    Inside a chunk the run's layers are laid out in option order (`decode`), so its first run
    layer is its lowest used option (`_edges`, open) and its last the highest (close). Chunk 0's
    forward opens with the pinned first layer and the last chunk's backward with the pinned last
    layer (and the chunks of a few pinned layers before the run, `evaluation.leading_chunks`, open
    with the first of them); a chunk holding only pinned layers has their edge layer's other head too."""
    table, pulp, num_chunks = model.problem.table, model.pulp, model.num_chunks
    if not _has_gathers(table):
        return
    has_last = first + count < table.num_layers
    # the last chunk's backward opens with the model's last layer, its forward (when it holds no
    # run layer) with the first of the layers after the run (the head, or an MTP depth before it)
    last, after_run = table.num_layers - 1, first + count
    leading = leading_chunks(first, count, num_chunks)  # the chunks of the pinned layers before the run
    if _alike_at_edges(options):
        # which option opens or closes a chunk changes nothing: one indicator per chunk
        options, counts = options[:1], [[pulp.lpSum(row)] for row in counts]
    head_of = {"fwd": [o.fwd_head_s for o in options], "bwd": [o.bwd_head_s for o in options]}
    for c in range(num_chunks):
        used = [pulp.LpVariable(f"head_used_{c}_{o}", cat="Binary") for o in range(len(options))]
        for o, var in enumerate(used):
            model.lp += counts[c][o] <= count * var, f"head_used_up_{c}_{o}"
            model.lp += counts[c][o] >= var, f"head_used_down_{c}_{o}"
        opens, closes = _edges(model, c, used, False), _edges(model, c, used, True)
        pinned_first = c in leading
        pinned_last = has_last and c == num_chunks - 1
        # a chunk holding only its pinned layers before the run closes its backward with the last of them
        before = [layer for layer, chunk in enumerate(leading) if chunk == c]
        # (pass, its opening layer pinned?, that layer, the run's edge, the other pinned layer alone)
        for name, pinned, layer, edges, alone in (("fwd", pinned_first, before[0] if before else 0, opens,
                                                   after_run if pinned_last else None),
                                                  ("bwd", pinned_last, last, closes,
                                                   before[-1] if pinned_first else None)):
            field = f"{name}_head_s"
            if pinned:  # the pinned layer opens the pass
                model.add_head(c, name, pulp.lpSum(getattr(o, field) * pick for o, pick in model.pinned[layer]))
                continue
            for o, edge in enumerate(edges):
                if head_of[name][o] > 0:
                    model.add_head(c, name, head_of[name][o] * edge)
            if alone is not None:  # the chunk may hold only its pinned layer
                top = max(getattr(o, field) for o, _ in model.pinned[alone])
                if top > 0:
                    alone_s = pulp.lpSum(getattr(o, field) * pick for o, pick in model.pinned[alone])
                    edge = pulp.LpVariable(f"head_{name}_{c}_pinned", lowBound=0)
                    model.lp += edge >= alone_s - top * pulp.lpSum(used), f"head_{name}_{c}_pinned"
                    model.lp += edge <= alone_s, f"head_{name}_{c}_pinned_up"
                    for o, var in enumerate(used):  # exact: no head once a run layer is here
                        model.lp += edge <= top * (1 - var), f"head_{name}_{c}_pinned_run_{o}"
                    model.add_head(c, name, edge)
