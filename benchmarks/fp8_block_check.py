"""One TP shard of a Llama 3 block's Linears under torchao's Float8 rowwise recipe, timed whole
(forward and backward) on one GPU beside meshplan's price of them: bf16, every Linear in fp8, and
wk, wv left in bf16 (what torchao's auto filter leaves), each eagerly and under torch.compile, for
the two models of torchtitan's async-TP table (Llama 3.1 70B and 8B at TP 8).

torchtitan's async-TP table measured the 70B job rowwise at BF16's speed with blocking TP (8B at
0.85x of it), and its auto-filter commit the 70B job about 10% faster with wk and wv in bf16;
meshplan prices that filter at about 1%, and every cast and GEMM it knows of at these shards. This
section tells whether the Linears (their GEMMs, casts and rescales, as torchao runs them) hold the
difference: it times the seven Linears of one rank's shard (wq, wk, wv, w1, w3 split on their
outputs, wo and w2 on their inputs) on the gathered input, with the glue a block puts between
them (k and v repeated onto q's heads in place of attention, SwiGLU), and no collective. The glue
runs alike in every variant, so the ratios between variants are the Linears' (diluted by the
glue's share). `gpu_check.py --sections fp8_block` runs it; it needs torchao (meshplan's engines
extra; on a machine without a network, its wheel carried in).
"""
from __future__ import annotations

from functools import lru_cache

SEQ, TP = 8192, 8
# (meshplan model, hidden, KV width, FFN width, sequences per micro-batch as the table ran them)
MODELS = {"llama3-70b": (8192, 1024, 28672, 16), "llama3-8b": (4096, 1024, 14336, 12)}
VARIANTS = (("bf16", None, ()), ("rowwise", "rowwise", ()), ("rowwise k,v bf16", "rowwise", ("wk", "wv")))


def shard_module(torch, device: str, hidden: int, kv: int, ffn: int, tp: int = TP):
    """The block's Linears on one TP rank (bf16), with a block's glue between them."""
    nn = torch.nn

    class ShardLinears(nn.Module):
        def __init__(self):
            super().__init__()
            linear = lambda i, o: nn.Linear(i, o, bias=False)  # noqa: E731
            self.wq, self.wk, self.wv = linear(hidden, hidden // tp), linear(hidden, kv // tp), linear(hidden, kv // tp)
            self.wo = linear(hidden // tp, hidden)
            self.w1, self.w3, self.w2 = linear(hidden, ffn // tp), linear(hidden, ffn // tp), linear(ffn // tp, hidden)

        def forward(self, x):
            q, k, v = self.wq(x), self.wk(x), self.wv(x)
            attention = q + (k + v).repeat(1, q.shape[-1] // k.shape[-1])
            h = self.wo(attention)
            return self.w2(nn.functional.silu(self.w1(h)) * self.w3(h))

    return ShardLinears().to(device=device, dtype=torch.bfloat16)


@lru_cache(maxsize=None)
def _graph(model: str):
    from meshplan.planner.profiling.profiler import profile

    return profile(model, SEQ)


def predicted_s(recipe: str | None, filtered: tuple[str, ...], compiled: bool, cluster, mbs: int,
                model: str = "llama3-70b") -> float:
    """meshplan's seconds for the shard's Linears, forward and backward, one micro-batch of `mbs`
    sequences under torchtitan at TP 8 with sequence parallelism: their GEMMs by shape and, in
    fp8, their casts and rescales (`fp8.gemm_times_s` with nothing else in the block)."""
    from meshplan.planner.contracts.config import ParallelConfig
    from meshplan.planner.costing import fp8, gemm

    graph = _graph(model)
    block = next(layer for layer in graph.layers if layer.kind == "block")
    roles = tuple({"wk": "k", "wv": "v"}[name] for name in filtered)
    config = ParallelConfig(gpus=TP, global_batch=mbs, tp=TP, sp=True, microbatch_size=mbs, engine="torchtitan",
                            precision="fp8" if recipe else "bf16-mixed", fp8_recipe=recipe, fp8_filter=roles,
                            torch_compile=compiled)
    if recipe is None:
        return sum(gemm.linear_times_s(gemm.block_linear_shapes(block, graph.info, SEQ), mbs * SEQ, TP, cluster, "bf16"))
    return sum(fp8.gemm_times_s(block, graph.info, cluster, config, 0.0, 0.0, TP, "bf16"))


def check_fp8_block(torch, clusters: dict, timed, device: str = "cuda", models=tuple(MODELS), modes=(False, True),
                    rows: int | None = None, dims: tuple[int, int, int] | None = None) -> dict:
    """Per model and mode (eager, compiled), each variant's measured and predicted seconds of the
    shard's forward and backward at the table's micro-batch, and the ratios `_ratios` prints.
    `rows` and `dims` (hidden, kv, ffn) shrink the shard for a dry run; the predictions stay the
    model's shard at its micro-batch."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        return {"skipped": "torchao is not installed: pip install 'meshplan[engines]' (or carry torchao's wheel)"}
    out = {"rows": []}
    for model in models:
        hidden, kv, ffn, mbs = MODELS[model]
        shape = dims or (hidden, kv, ffn)
        tokens = rows or mbs * SEQ
        for compiled in modes:
            for name, recipe, filtered in VARIANTS:
                module = shard_module(torch, device, *shape)
                if recipe:
                    convert_to_float8_training(module, config=Float8LinearConfig.from_recipe_name(recipe),
                                               module_filter_fn=lambda _, fqn, kept=filtered: fqn not in kept)
                run = torch.compile(module) if compiled else module
                x = torch.randn(tokens, shape[0], device=device, dtype=torch.bfloat16, requires_grad=True)
                grad = torch.randn(tokens, shape[0], device=device, dtype=torch.bfloat16)
                row = {"model": model, "variant": name, "compiled": compiled, "rows": tokens,
                       "measured_s": timed(lambda: run(x).backward(grad))}
                for cluster_name, cluster in clusters.items():
                    row[f"predicted_s[{cluster_name}]"] = predicted_s(recipe, filtered, compiled, cluster, mbs, model)
                out["rows"].append(row)
                del module, run, x, grad
            mode = {r["variant"]: r for r in out["rows"] if r["model"] == model and r["compiled"] == compiled}
            out[f"{model} {'compiled' if compiled else 'eager'}"] = _ratios(mode, clusters)
    return out


def _ratios(mode: dict, clusters: dict) -> dict:
    """Measured and predicted, how many times longer the shard takes: bf16 over rowwise (the
    Linears' FP8/BF16 speed-up) and rowwise over rowwise with wk, wv in bf16 (the filter's gain)."""
    out = {}
    for label, slow, fast in (("bf16 over rowwise", "bf16", "rowwise"),
                              ("rowwise over k,v bf16", "rowwise", "rowwise k,v bf16")):
        out[f"{label}, measured"] = mode[slow]["measured_s"] / mode[fast]["measured_s"]
        for c in clusters:
            out[f"{label}, predicted [{c}]"] = mode[slow][f"predicted_s[{c}]"] / mode[fast][f"predicted_s[{c}]"]
    return out
