"""Multi-token prediction (`profiling.mtp`): the depths' FLOPs, parameters and saved bytes against
a hand derivation, DeepSeek-V3's published 685 B with its MTP module, the pipeline cut (the depths
with the output layer, as Megatron-Core builds them), the search placing them there, the
Megatron-LM round trip, and what the other engines and meshplan's executor refuse."""
from __future__ import annotations

import pytest

from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.profiling.mtp import with_mtp
from meshplan.planner.profiling.profiler import profile

SEQ, H = 128, 256
SPEC = f"moe:layers=4,hidden={H},heads=4,kv_heads=2,experts=8,top_k=2,expert_ffn=96,vocab=1000"


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHPLAN_CACHE_DIR", str(tmp_path / "cache"))


def test_a_depth_is_the_last_block_plus_its_projection_and_norms():
    base = profile(SPEC, SEQ)
    graph = profile(SPEC, SEQ, mtp_num_layers=2)
    names = [layer.name for layer in graph.layers]
    assert names == [layer.name for layer in base.layers[:-1]] + ["mtp.0", "mtp.1", "head"]
    assert graph.info.mtp_num_layers == 2 and base.info.mtp_num_layers == 0
    block, depth = base.layers[-2], graph.layer("mtp.0")
    proj = 2 * SEQ * (2 * H) * H  # eh_proj: 2h -> h on every token
    assert (depth.fwd_flops, depth.bwd_flops) == (block.fwd_flops + proj, block.bwd_flops + 2 * proj)
    assert depth.num_params == block.num_params + 2 * H * H + 3 * H  # eh_proj, enorm, hnorm, final norm
    assert (depth.expert_params, depth.expert_fwd_flops, depth.dispatch_bytes) == (
        block.expert_params, block.expert_fwd_flops, block.dispatch_bytes)
    assert graph.layer("mtp.1").repeat_of == "mtp.0"
    head, base_head = graph.layer("head"), base.layer("head")
    assert (head.fwd_flops, head.bwd_flops, head.num_params) == (3 * base_head.fwd_flops, 3 * base_head.bwd_flops,
                                                                 base_head.num_params)
    assert head.shared_params == base.layer("embed").num_params  # the last stage embeds the shifted tokens


def test_deepseek_v3_with_its_mtp_module_is_the_published_685_billion():
    """DeepSeek-V3's card: 685 B on Hugging Face, 671 B of the main model and 14 B of the MTP
    module, whose checkpoint stores its own copies of the embedding and the output head."""
    pytest.importorskip("transformers")
    base, graph = profile("deepseek-v3", 64), profile("deepseek-v3", 64, mtp_num_layers=1)
    depth = graph.total_params - base.total_params
    copies = base.layer("embed").num_params + base.layer("head").num_params
    assert base.total_params == 671_026_404_352
    assert (base.total_params + depth + copies) / 685e9 == pytest.approx(1, abs=0.001)


def test_bad_depths_and_models_without_an_output_layer_are_refused():
    with pytest.raises(MeshplanError, match="--mtp-num-layers must be a whole number >= 0, got -1"):
        profile(SPEC, SEQ, mtp_num_layers=-1)
    with pytest.raises(MeshplanError, match="already has multi-token-prediction layers"):
        with_mtp(profile(SPEC, SEQ, mtp_num_layers=1), 1)


def test_the_depths_share_the_output_layer_s_pipeline_chunk():
    from meshplan.planner.contracts.config import ParallelConfig
    from meshplan.planner.costing.hardware import load_cluster
    from meshplan.planner.costing.uniform import balanced_layer_chunks, engine_layer_chunks

    graph = profile(SPEC, SEQ, mtp_num_layers=1)
    cluster = load_cluster("h100-sxm")
    for engine in ("meshplan", "megatron"):
        config = ParallelConfig(gpus=4, global_batch=8, pp=4, dp=1, engine=engine)
        chunks = balanced_layer_chunks(graph, cluster, config)
        assert chunks[-2:] == (3, 3) and chunks[0] == 0, engine  # mtp.0 and the head on the last stage
    with pytest.raises(ValueError, match="7 pipeline chunks need at least that many layers besides the 1"):
        balanced_layer_chunks(graph, cluster, ParallelConfig(gpus=7, global_batch=7, pp=7, dp=1))
    # Megatron's even split counts the decoder's 4 blocks only: one a stage, the depth on the last
    kinds = [layer.kind for layer in graph.layers]
    assert engine_layer_chunks(kinds, "megatron", 4, num_mtp=1) == (0, 0, 1, 2, 3, 3, 3)


def _megatron_plan(pp: int = 2):
    """DeepSeek-style MTP on the small MoE under engine megatron, cut as `estimate` cuts it."""
    from meshplan.planner.contracts.config import ParallelConfig
    from meshplan.planner.contracts.plan import LayerAssignment, ModelRef, Plan
    from meshplan.planner.costing.hardware import load_cluster
    from meshplan.planner.costing.uniform import balanced_layer_chunks

    graph, cluster = profile(SPEC, SEQ, mtp_num_layers=1), load_cluster("h100-sxm")
    config = ParallelConfig(gpus=8, global_batch=16, pp=pp, dp=8 // pp, ep=2, engine="megatron", zero=1)
    chunks = balanced_layer_chunks(graph, cluster, config)
    layers = tuple(LayerAssignment(name=layer.name, stage=config.rank_of_chunk(chunk), virtual_stage=chunk // pp,
                                   tp=1, dp=config.dp, recompute="none") for layer, chunk in zip(graph.layers, chunks))
    return Plan(model=ModelRef(spec=SPEC, seq=SEQ, mtp_num_layers=1), cluster=cluster, config=config, layers=layers)


def test_megatron_round_trip_and_the_other_engines_refuse():
    from meshplan.planner.engines.bridge import export_plan, predict_job, read_engine_text
    from meshplan.planner.simulation.simulator import simulate

    plan = _megatron_plan()
    exported = export_plan(plan, "megatron")
    assert "--mtp-num-layers 1" in exported.text
    job = read_engine_text(exported.text, "megatron")
    assert job.mtp_num_layers == 1
    estimate = predict_job(job, SPEC, plan.cluster, seq=SEQ, gpus=8)
    assert estimate.chunk_of_layer == tuple(plan.chunk_of(layer) for layer in plan.layers)
    assert estimate.prediction.step_time_s == pytest.approx(simulate(plan, timeline=False).step_time_s, rel=0.01)
    with pytest.raises(MeshplanError, match="torchtitan has no module for"):
        export_plan(plan, "torchtitan")


def test_the_search_places_the_depths_with_the_head_and_megatron_runs_its_plan():
    """`plan --mtp-num-layers`: the winner and every alternative keep the depths in the output
    layer's chunk on the last stage (the ILP pins them there, `CostTable.last_chunk_layers`, and
    the local search does not move them); the plan's prediction is the simulator's of its layout,
    and it exports to Megatron-LM with --mtp-num-layers. meshplan's executor plans it but says it
    does not train it; engines without an MTP module are refused in one line."""
    from meshplan.planner.costing.executable import mtp_problem
    from meshplan.planner.engines.bridge import export_plan
    from meshplan.planner.search.driver import search_plan
    from meshplan.planner.simulation.simulator import simulate

    assert mtp_problem(0) is None
    assert mtp_problem(1).startswith("multi-token prediction (1 depth) is planned, not executed")
    plan = search_plan(SPEC, "h100-sxm", 8, 16, SEQ, engine="megatron", mtp_num_layers=1, pp=2, top_k=3)
    last_chunk = plan.config.num_model_chunks - 1
    assert plan.model.mtp_num_layers == 1 and [layer.name for layer in plan.layers][-2:] == ["mtp.0", "head"]
    assert plan.chunk_of(plan.layers[-2]) == plan.chunk_of(plan.layers[-1]) == last_chunk
    assert simulate(plan, timeline=False).step_time_s == pytest.approx(plan.prediction["step_time_s"], rel=1e-9)
    assert "--mtp-num-layers 1" in export_plan(plan, "megatron").text
    own = search_plan(SPEC, "h100-sxm", 8, 16, SEQ, mtp_num_layers=1, pp=2)
    assert own.not_executable_reason.startswith("multi-token prediction (1 depth) is planned, not executed")
    with pytest.raises(MeshplanError, match="with --engine torchtitan: only Megatron-LM builds") as refusal:
        search_plan(SPEC, "h100-sxm", 8, 16, SEQ, engine="torchtitan", mtp_num_layers=1)
    assert "\n" not in str(refusal.value)


def test_estimate_and_plan_note_the_config_s_mtp_depths():
    """DeepSeek-V3's config names one MTP depth (num_nextn_predict_layers): estimate and plan say
    it is priced or planned without it and how to add it; asked for, no note."""
    from meshplan.commands.common import model_notes

    assert any("--mtp-num-layers 1 adds them" in note for note in model_notes("deepseek-v3", 4096))
    assert any("planned without them; --mtp-num-layers 1 adds them" in note
               for note in model_notes("deepseek-v3", 4096, searched=True))
    assert not any("multi-token" in note for note in model_notes("deepseek-v3", 4096, mtp_num_layers=1))
    assert not any("multi-token" in note for note in model_notes("llama3-8b", 4096))
