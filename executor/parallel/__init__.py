"""Turn a meta-device model into this rank's share of a plan: one module per technique
(`stages`, `tensor`, `recompute`, `data`), one `apply_*` (or split/materialise) in each.

Order (torchtitan's): split into pipeline chunks -> tensor parallelism -> context and expert
parallelism (`context`, `expert`) -> materialise and initialise -> activation checkpointing ->
the experts' data parallelism -> data parallelism. TP comes first because FSDP and
`replicate` compose on top of TP's DTensors, not the other way round; weights are written while
they are still only TP-sharded (a 1-D slice of the full tensor computed locally), and FSDP then
shards the real tensors, so no strided-shard arithmetic is needed; checkpointing wraps a block's
forward before FSDP registers its hooks, so FSDP gathers parameters outside the recomputed region.
"""
