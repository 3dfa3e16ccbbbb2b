"""meshplan's own memory rule (the default executor recipe) against Korthikanti et al.'s Figure 1,
and selective recomputation never predicted above none (`costing.activation_memory`)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshplan.planner.simulation.estimator import estimate

GIB = 2**30

# Korthikanti et al. 2022 (arXiv:2205.05198), Table 3 and Figure 1: activation memory of the first
# pipeline stage with sequence parallelism and selective recomputation, sequence 2048, vocabulary
# 51200, tp 8. 175B and 530B run the interleaved schedule with 3 chunks per rank (the figure is
# 34 sbhL/t x (1 + (p - 1) / (3p)), 1T without interleaving (2 layers per stage).
# (name, layers, hidden, heads, pp, micro-batch, chunks per rank, published GiB)
FIGURE_1 = [("22B", 48, 6144, 64, 1, 4, 1, 9.6), ("175B", 96, 12288, 96, 8, 1, 3, 12.4),
            ("530B", 105, 20480, 128, 35, 1, 3, 23.1), ("1T", 128, 25600, 160, 64, 1, 1, 26.6)]


@pytest.mark.parametrize("name,layers,hidden,heads,pp,mbs,vpp,published_gib", FIGURE_1,
                         ids=[row[0] for row in FIGURE_1])
def test_first_stage_activations_match_korthikanti_figure_1(name, layers, hidden, heads, pp, mbs, vpp, published_gib):
    """Within 10% under the default recipe (meshplan's executor, flash attention, bf16-mixed).
    Measured -0.0% to -4.7%: the zoo's GPT has no dropout (Korthikanti's 34 sbh counts 2 sbh of
    masks), flash attention keeps its output and statistics instead (~2 sbh). (Math attention
    reads 13-18% above: torch's math kernel also saves its scaled q and the merged heads.)"""
    tp = 8
    # enough micro-batches for the schedule's steady state on the first stage
    global_batch = mbs * (2 * pp if vpp > 1 else pp)
    prediction = estimate(f"gpt:layers={layers},hidden={hidden},heads={heads},vocab=51200", "a100-80g", tp * pp,
                          global_batch, seq=2048, tp=tp, pp=pp, mbs=mbs, recompute="selective", sp=True,
                          schedule="interleaved" if vpp > 1 else "1f1b", vpp=vpp, precision="bf16-mixed")
    first_stage_gib = prediction.memory[0].activations / GIB
    assert first_stage_gib == pytest.approx(published_gib, rel=0.10)


SPECS = ["gpt:layers=8,hidden=512,heads=8,vocab=8192",
         "llama:layers=8,hidden=512,heads=8,kv_heads=4,ffn=1536,vocab=8192",
         "moe:layers=8,hidden=512,heads=8,kv_heads=4,experts=8,top_k=2,expert_ffn=512,vocab=8192"]


@settings(max_examples=60, deadline=None, derandomize=True)
@given(spec=st.sampled_from(SPECS), tp=st.sampled_from([1, 2, 4]), sp=st.booleans(), pp=st.sampled_from([1, 2, 4]),
       schedule=st.sampled_from(["1f1b", "gpipe", "interleaved", "zbv"]), mbs=st.sampled_from([1, 2]),
       zero=st.sampled_from([0, 1, 3]), attention=st.sampled_from(["flash", "math"]),
       precision=st.sampled_from(["bf16-mixed", "fp32"]), seq=st.sampled_from([512, 2048]))
def test_selective_recomputation_never_predicts_more_than_none(spec, tp, sp, pp, schedule, mbs, zero, attention,
                                                                precision, seq):
    """The same plan with every block under selective recomputation against none: on every
    pipeline rank, the simulator's peak is never higher."""
    if pp == 1:
        schedule = "1f1b"
    vpp = 2 if schedule in ("interleaved", "zbv") else 1
    if spec.startswith("moe"):  # MoE blocks take no TP
        tp = 1
    gpus = 16
    options = dict(seq=seq, tp=tp, pp=pp, mbs=mbs, zero=zero, sp=sp and tp > 1, schedule=schedule, vpp=vpp,
                   precision=precision, attention=attention)
    global_batch = mbs * gpus // (tp * pp) * 2 * pp
    none = estimate(spec, "a100-80g", gpus, global_batch, recompute="none", **options)
    selective = estimate(spec, "a100-80g", gpus, global_batch, recompute="selective", **options)
    for kept, rebuilt in zip(none.memory, selective.memory):
        assert rebuilt.total <= kept.total * (1 + 1e-12), (kept, rebuilt)
    assert selective.peak_memory_bytes <= none.peak_memory_bytes * (1 + 1e-12)
