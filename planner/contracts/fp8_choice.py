"""What an fp8 configuration chooses (re-exported by `contracts.config`): its scaling recipe and
which of a block's Linears it leaves in bf16. `planner.costing.fp8` prices both;
`planner.costing.fp8_filter` applies the filter to a block's shapes."""
from __future__ import annotations

# How fp8 scales each GEMM operand (`planner.costing.fp8.RECIPES` prices each): one scale per tensor
# from its current amax (tensorwise), one per row (rowwise), per tensor from an amax history
# (delayed, Transformer Engine's DelayedScaling), one per 32-value block (mxfp8, Blackwell only).
FP8_RECIPES = ("tensorwise", "rowwise", "delayed", "mxfp8")
# The recipe each engine runs when none is named: Megatron-LM's `--fp8-recipe` defaults to delayed
# (megatron/training/arguments.py, core 0.12 to 0.14); torchtitan 0.2's [float8] recipe_name unset is
# torchao's tensorwise (0.3's Float8LinearConverter runs rowwise only); DeepSpeed leaves FP8 to
# Transformer Engine in the model code, whose `fp8_autocast` recipe defaults to DelayedScaling, as
# does llm-foundry's (Composer's `fp8_autocast` with TE's default recipe); meshplan prices torchao's tensorwise.
DEFAULT_FP8_RECIPE = {"meshplan": "tensorwise", "megatron": "delayed", "torchtitan": "tensorwise",
                      "deepspeed": "delayed", "llm-foundry": "delayed", "generic": "tensorwise"}
# A transformer block's Linears, by role: attention's q, k, v and output projections, the MLP's
# gate, up and down projections (a GPT MLP has up and down only; a MoE block's, its shared experts').
FP8_LINEARS = ("q", "k", "v", "o", "gate", "up", "down")
# torchtitan's Float8 converter and its config table: 0.2's `quantize.linear.float8` (registered so in
# torchtitan/components/quantization/float8.py; its [quantize.linear.float8] table), and before 0.2
# `float8` (its [float8] table, which torchtitan's mid-2025 benchmarks ran), read alike; other
# converters are not priced (`engines.torchtitan`).
FLOAT8_CONVERTER = "quantize.linear.float8"
LEGACY_FLOAT8_CONVERTER = "float8"
# torchtitan's module names of the Llama block's Linears, by role (its `filter_fqns` match by substring).
TORCHTITAN_LINEAR_FQNS = {"q": "attention.wq", "k": "attention.wk", "v": "attention.wv", "o": "attention.wo",
                          "gate": "feed_forward.w1", "up": "feed_forward.w3", "down": "feed_forward.w2"}
# torchao's auto filter (`torchao.float8._auto_filter_for_recipe`, torchtitan's
# "auto_filter_small_kn"): leaves in bf16 the Linears whose weight shape its H100 benchmarks found
# too small for the recipe to pay (`costing.fp8_filter.AUTO_FILTER_RULES`).
FP8_AUTO_FILTER = "auto"
# `plan --fp8-filter fastest`: each candidate leaves in bf16 the Linears the cost model finds faster
# so on its shards, each filter on `costing.fp8_advice.filter_path` priced as a candidate of its own;
# its plan stores the Linears picked.
FP8_FASTEST_FILTER = "fastest"
FP8_AUTO_FILTER_RECIPES = ("tensorwise", "rowwise")
# Engines that convert Linears to fp8 one module at a time, so a filter can leave some in bf16:
# torchao's `convert_to_float8_training(module_filter_fn=...)`, torchtitan's [float8] filter_fqns
# (meshplan and generic price torchao's recipes). Transformer Engine quantises every Linear inside
# `fp8_autocast` (Megatron-LM, DeepSpeed and llm-foundry run it), with no per-Linear choice.
FP8_FILTER_ENGINES = ("meshplan", "generic", "torchtitan")


def stored_fp8_recipe(precision: str, engine: str, recipe: str | None) -> str | None:
    """The recipe a configuration stores: None unless fp8, else `recipe` or the engine's default."""
    if precision != "fp8":
        if recipe is not None:
            raise ValueError(f"fp8_recipe {recipe!r} needs precision fp8, got {precision!r}")
        return None
    if recipe is None and engine in DEFAULT_FP8_RECIPE:
        recipe = DEFAULT_FP8_RECIPE[engine]
    if recipe not in FP8_RECIPES:
        raise ValueError(f"fp8_recipe must be one of {', '.join(FP8_RECIPES)}, got {recipe!r}")
    return recipe


def stored_fp8_filter(precision: str, engine: str, recipe: str | None, names,
                      searched: bool = False) -> tuple[str, ...]:
    """The filter a configuration stores (`searched`: a search asks, "fastest" allowed), in
    `FP8_LINEARS` order after "auto"; ValueError where the precision, the engine or the recipe
    cannot take it."""
    if names == ():
        return ()
    if isinstance(names, str) or not all(isinstance(name, str) for name in names):
        raise ValueError(f"fp8_filter must be a sequence of names, got {names!r}")
    known = (FP8_AUTO_FILTER, *((FP8_FASTEST_FILTER,) if searched else ()), *FP8_LINEARS)
    unknown = [name for name in names if name not in known]
    if FP8_FASTEST_FILTER in unknown:
        raise ValueError("fp8_filter fastest asks plan to pick each candidate's Linears; a configuration names "
                         f"its own ({', '.join(FP8_LINEARS)}, or auto)")
    if unknown:
        raise ValueError(f"unknown fp8 filter name(s) {', '.join(unknown)}; known: {', '.join(known)}")
    if precision != "fp8":
        raise ValueError(f"fp8_filter ({','.join(names)}) leaves fp8 Linears in bf16: it needs precision fp8, "
                         f"got {precision!r}")
    if engine not in FP8_FILTER_ENGINES:
        raise ValueError(f"fp8_filter ({','.join(names)}): {engine} runs Transformer Engine, which quantises every "
                         f"Linear inside fp8_autocast; a per-Linear filter is torchao's (engines "
                         f"{', '.join(FP8_FILTER_ENGINES)})")
    if FP8_AUTO_FILTER in names and recipe not in FP8_AUTO_FILTER_RECIPES:
        raise ValueError(f"fp8_filter auto is torchao's auto filter, which has thresholds for "
                         f"{' and '.join(FP8_AUTO_FILTER_RECIPES)} only, got recipe {recipe!r}; name the Linears instead")
    return tuple(name for name in known if name in names)


def parse_fp8_filter(text: str) -> tuple[str, ...]:
    """The names of a `--fp8-filter` value: comma-separated roles (`FP8_LINEARS`), torchtitan's
    module names for them (attention.wk or wk), or auto; ValueError for any other name."""
    aliases = {fqn: role for role, fqn in TORCHTITAN_LINEAR_FQNS.items()}
    aliases.update({fqn.split(".")[-1]: role for role, fqn in TORCHTITAN_LINEAR_FQNS.items()})
    names = tuple(aliases.get(part.strip(), part.strip()) for part in text.split(",") if part.strip())
    known = (FP8_AUTO_FILTER, FP8_FASTEST_FILTER, *FP8_LINEARS)
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        raise ValueError(f"unknown fp8 filter name(s) {', '.join(unknown) or repr(text)}; use auto, fastest (plan) "
                         f"or Linears from "
                         f"{', '.join(FP8_LINEARS)} (torchtitan's attention.wq .. feed_forward.w2 also), "
                         "comma-separated")
    return names
