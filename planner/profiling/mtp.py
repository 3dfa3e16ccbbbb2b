"""Multi-token prediction (DeepSeek-V3's MTP, Megatron-Core's `--mtp-num-layers N`) added to a
profiled graph: what N prediction depths cost beside the model's own next-token prediction.

Megatron-Core (`megatron/core/transformer/multi_token_prediction.py`) builds each depth as a
`MultiTokenPredictionLayer`: two norms (`enorm` on the embedding of the tokens shifted by the
depth, `hnorm` on the hidden states the previous depth, or the decoder, hands on), `eh_proj`, a
column-parallel Linear from the two concatenated (2h) back to h, one transformer layer of the
decoder's own spec (a MoE layer for DeepSeek-V3) and a final norm; the depth's logits come from
the model's own output layer, and its loss is added (scaled by `--mtp-loss-scaling-factor`).
Without a custom pipeline layout every depth is built on the last pipeline stage
(`mtp_on_this_rank`), which also builds the word embedding to embed the shifted tokens
(`gpt_model.py`: the embedding where `pre_process or mtp_process`), a copy whose gradient is
reduced with the first stage's, as a tied output layer's is.

So the graph gains, per depth, a block `mtp.{i}` placed after the decoder's blocks: the decoder's
last block (its FLOPs, parameters, saved bytes, experts) plus eh_proj (4 s h^2 FLOPs forward,
2 h^2 parameters, its 2h-wide input saved) and the three norms (3h parameters, each norm's input
saved). The output layer computes and differentiates the logits 1 + N times (FLOPs and saved
bytes, not parameters), and records the embedding as parameters it uses that the embedding layer
owns (`LayerProfile.shared_params`: the copy and its gradient reduction where the two are on
different pipeline ranks). The MTP layers share the output layer's pipeline chunk
(`costing.uniform`). transformers' DeepSeek-V3 has no MTP module; the config names how many
depths the published model trained with (`num_nextn_predict_layers`).
"""
from __future__ import annotations

from dataclasses import replace

from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.contracts.graph import MTP_LAYER_PREFIX, LayerProfile, ModelGraph, is_mtp_layer


def with_mtp(graph: ModelGraph, num_layers: int) -> ModelGraph:
    """`graph` with `num_layers` multi-token-prediction depths (module docstring); 0: unchanged."""
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 0:
        raise MeshplanError(f"--mtp-num-layers must be a whole number >= 0, got {num_layers!r}")
    if num_layers == 0:
        return graph
    layers = list(graph.layers)
    kinds = [layer.kind for layer in layers]
    if any(map(is_mtp_layer, layers)):
        raise MeshplanError(f"{graph.spec}: the graph already has multi-token-prediction layers")
    if len(layers) < 3 or kinds[0] != "embedding" or kinds[-1] != "head" or "block" not in kinds \
            or not graph.info.hidden:
        raise MeshplanError(f"--mtp-num-layers {num_layers}: multi-token prediction needs a transformer with an "
                            f"embedding, blocks and an output layer of known width; {graph.spec} is not one")
    last_block = next(layer for layer in reversed(layers) if layer.kind == "block")
    depths = [_depth(last_block, index, graph.seq, graph.info.hidden, graph.dtype) for index in range(num_layers)]
    head = _head(layers[-1], layers[0], num_layers)
    info = replace(graph.info, mtp_num_layers=num_layers)
    return replace(graph, layers=tuple(layers[:-1] + depths + [head]), info=info)


def _depth(block: LayerProfile, index: int, seq: int, hidden: int, dtype: str) -> LayerProfile:
    """One MTP depth: the decoder's last block plus eh_proj and the three norms."""
    elem = 4 if dtype == "fp32" else 2
    proj_flops = 2 * seq * (2 * hidden) * hidden
    norm_params = 3 * hidden
    return replace(
        block, name=f"{MTP_LAYER_PREFIX}{index}", repeat_of=None if index == 0 else f"{MTP_LAYER_PREFIX}0",
        fwd_flops=block.fwd_flops + proj_flops, bwd_flops=block.bwd_flops + 2 * proj_flops,
        causal_fwd_flops=block.causal_fwd_flops + proj_flops if block.causal_fwd_flops else 0,
        num_params=block.num_params + 2 * hidden * hidden + norm_params,
        param_bytes=block.param_bytes + (2 * hidden * hidden + norm_params) * elem,
        # eh_proj's input (the 2h concatenation) is split with the block's Linears; the two input
        # norms keep their inputs beside it, outside the TP region
        act_tp_sharded_bytes=block.act_tp_sharded_bytes + seq * 2 * hidden * elem,
        act_tp_replicated_bytes=block.act_tp_replicated_bytes + seq * 2 * hidden * elem)


def _head(head: LayerProfile, embedding: LayerProfile, num_layers: int) -> LayerProfile:
    """The output layer computing 1 + N logits, and using the embedding the MTP depths embed with."""
    times = 1 + num_layers
    return replace(
        head, fwd_flops=head.fwd_flops * times, bwd_flops=head.bwd_flops * times,
        causal_fwd_flops=head.causal_fwd_flops * times, act_tp_sharded_bytes=head.act_tp_sharded_bytes * times,
        act_tp_replicated_bytes=head.act_tp_replicated_bytes * times,
        shared_params=max(head.shared_params, embedding.num_params))


def config_mtp_layers(spec: str | None) -> int:
    """The multi-token-prediction depths a Hugging Face config names (`num_nextn_predict_layers`,
    DeepSeek-V3's 1); 0 for other specs, and for a config no longer readable (whoever profiles it
    says what is wrong with the file)."""
    from meshplan.planner.models.hf_config import read_config
    from meshplan.planner.models.registry import hf_config_path

    path = hf_config_path(spec) if spec else None
    if path is None:
        return 0
    try:
        return int(read_config(path).get("num_nextn_predict_layers") or 0)
    except MeshplanError:
        return 0
