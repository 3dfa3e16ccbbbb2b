"""The profiler: a model spec -> `ModelGraph` of per-layer FLOPs, parameters and saved bytes.

Presets and parametric `gpt:`/`llama:`/`moe:` specs get their graph in closed form
(`planner.profiling.analytic`, and `planner.profiling.analytic_moe` for mixtures of experts: no
torch, no trace, no cache, microseconds); tests hold it equal to the traced graph. `trace=True`
traces them like any other model; `hf:` configs (MoE ones included), the published-config presets
(`deepseek-v3`, `gpt-oss-*`: shipped `hf:` configs) and file models are traced.

Tracing runs on the meta device (no memory, no weights). The measurement itself is in
`planner.profiling.tracing`; this module decides what to measure and assembles the graph:

- zoo and HF models are built with their identical blocks collapsed to one (`build_for_profile`),
  measured once, and expanded back with `repeat_of` = the first block's name;
- file models (`path/model.py:fn`) are measured whole; their layers are the top-level children,
  refined into the children of any child that holds most of the forward FLOPs; identical layers
  (same structure hash, same measured figures) get `repeat_of`;
- parameters belong to the first layer (in execution order) that holds them; a later layer that
  uses the same parameter (tied head) records it as `shared_params`; parameters no layer holds
  (attributes of the root module) belong to the first layer, so per-layer counts sum to
  `sum(p.numel())`.

Graphs are cached on disk as JSON under `$MESHPLAN_CACHE_DIR` (default `~/.cache/meshplan`),
keyed by spec (with the file's content hash for file and HF specs), seq, dtype, attention, the
meshplan and torch versions (transformers' too for HF specs) and a hash of the model and profiling
source (`_code_hash`), so an edit of the zoo's block is never answered with its old graph. A file
spec's hash covers the named file only, not modules it imports. A cache hit does not import torch.
Each entry stores a sha256 of its graph; an entry that does not verify (hand-edited, corrupt) is
said so on stderr and profiled again.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

from meshplan.planner.contracts.atomicfile import write_text_atomic
from meshplan.planner.contracts.attention import ATTENTION_CHOICES, check_attention
from meshplan.planner.contracts.config import DEFAULT_MOE_DISPATCHER, MOE_DISPATCHERS
from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.contracts.graph import LayerProfile, ModelGraph, graph_from_json, graph_to_json

DTYPES = ("bf16", "fp16", "fp32")
ATTENTION_KINDS = ATTENTION_CHOICES  # every accepted kernel name (contracts.attention)
# A child holding more than this share of the forward FLOPs is split into its own children.
DOMINANT_FLOP_SHARE = 0.5
MAX_REFINE_DEPTH = 4
CACHE_FORMAT = 4  # 4: entries are {digest, graph}
# The code a cached graph depends on, relative to the planner package: the model builders (zoo
# blocks, presets, HF and file loaders, TP splits), the measurement, and the graph schema.
# Whole folders, so a module added to or moved into them is covered without editing this list.
_SOURCE_DIRS = ("models", "profiling")
_SOURCE_FILES = ("contracts/graph.py",)


def profile(spec: str, seq: int, batch: int = 1, dtype: str = "bf16", attention: str = "flash",
            cache: bool = True, trace: bool = False, moe_imbalance: float = 1.0,
            moe_capacity_factor: float | None = None, moe_pad_to_capacity: bool = False,
            moe_dispatcher: str = DEFAULT_MOE_DISPATCHER, mtp_num_layers: int = 0,
            engine: str = "meshplan") -> ModelGraph:
    """Profile `spec` at sequence length `seq`; every LayerProfile value is per sample.

    `batch` is validated only: scale with `LayerProfile.to_json(batch)` or by hand. File models
    take their shapes from their example inputs, so `seq` only labels their graph. Zoo specs
    (presets, `gpt:`, `llama:`, `moe:`) are computed in closed form unless `trace` is set, MoE
    ones as the tracer measures them under balanced routing; `hf:` configs (MoE ones included), the
    published-config presets (`registry.PUBLISHED_CONFIGS`) and file models are traced; `cache`
    only concerns traced graphs.
    `moe_imbalance` (>= 1, MoE models only) is recorded in `graph.info`: the busiest expert gets
    that many times the balanced tokens; the measured figures stay balanced. So are
    `moe_capacity_factor` (> 0: each expert takes at most that many times the balanced tokens,
    the rest dropped) and `moe_pad_to_capacity` (expert inputs padded to that capacity); the
    costs they imply are `planner.costing.expert_parallel.load_factor`'s. `moe_dispatcher` too
    (`contracts.config.MOE_DISPATCHERS`; its traffic is `planner.costing.moe_dispatch`'s).
    `mtp_num_layers` adds that many multi-token-prediction depths (`profiling.mtp.with_mtp`).
    `engine`: the engine the graph is priced under; an `hf:` config that engine builds as its own
    Llama-style model (`models.hf_engine`) is profiled as that model, in closed form, not traced.
    """
    if moe_dispatcher not in MOE_DISPATCHERS:
        raise MeshplanError(f"--moe-dispatcher must be one of {', '.join(MOE_DISPATCHERS)}, got {moe_dispatcher!r}")
    _check_args(seq, batch, dtype, attention)
    _check_imbalance(moe_imbalance)
    from meshplan.planner.models.config import check_capacity

    try:
        check_capacity(moe_capacity_factor, moe_pad_to_capacity)
    except ValueError as err:
        raise MeshplanError(str(err)) from None
    capacity = float(moe_capacity_factor or 0.0)
    config_path = _hf_config_path(spec)
    if config_path is not None:
        from meshplan.planner.models.hf_config import check_seq_limit

        check_seq_limit(config_path, seq)
    from meshplan.planner.profiling.mtp import with_mtp

    own = None if trace else _engine_graph(spec, seq, dtype, attention, engine)
    graph = with_mtp(own or _profile(spec, seq, dtype, attention, cache, trace), mtp_num_layers)
    if moe_imbalance == 1.0 and not capacity and moe_dispatcher == DEFAULT_MOE_DISPATCHER:
        return graph
    if not graph.info.is_moe:
        what = (f"--moe-imbalance {moe_imbalance}" if moe_imbalance != 1.0 else
                f"--moe-capacity-factor {capacity:g}" if capacity else f"--moe-dispatcher {moe_dispatcher}")
        raise MeshplanError(f"{what} needs a mixture-of-experts model; {spec!r} has no experts")
    return replace(graph, info=replace(graph.info, moe_imbalance=float(moe_imbalance), moe_capacity_factor=capacity,
                                       moe_pad_to_capacity=bool(moe_pad_to_capacity), moe_dispatcher=moe_dispatcher))


def profile_plan_model(model, engine: str = "meshplan") -> ModelGraph:
    """The graph a plan's `ModelRef` stands for, as the plan was costed (its capacity factor and
    its config's `engine` included)."""
    return profile(model.spec, model.seq, dtype=model.dtype, attention=model.attention,
                   moe_capacity_factor=model.moe_capacity_factor or None,
                   moe_pad_to_capacity=model.moe_pad_to_capacity, moe_dispatcher=model.moe_dispatcher,
                   mtp_num_layers=model.mtp_num_layers, engine=engine)


def carry_model_graph(plan):
    """`plan` carrying its model's layer graph when user code defines the model (`model_file`) or
    transformers' code does (the published-config presets), so commands that read the plan never
    run that code; other plans (closed-form graphs) are returned as they are."""
    from meshplan.planner.contracts.plan import model_file

    traced = model_file(plan.model.spec) is not None or _hf_config_path(plan.model.spec) is not None
    if plan.graph is not None or not traced:
        return plan
    graph = profile_plan_model(plan.model, plan.config.engine)  # a cache hit right after the search that traced it
    return replace(plan, graph=replace(graph, spec=plan.model.spec))


def _hf_config_path(spec: str) -> str | None:
    """The config file of a spec transformers' code builds (`hf:` and the published configs)."""
    from meshplan.planner.models.registry import hf_config_path

    return hf_config_path(spec)


def _check_imbalance(moe_imbalance) -> None:
    if isinstance(moe_imbalance, bool) or not isinstance(moe_imbalance, (int, float)) \
            or not 1.0 <= moe_imbalance < float("inf"):
        raise MeshplanError(f"moe imbalance must be a number >= 1.0 (1.0: balanced routing), got {moe_imbalance!r}")


def _profile(spec: str, seq: int, dtype: str, attention: str, cache: bool, trace: bool) -> ModelGraph:
    if not trace:
        graph = _closed_form(spec, seq, dtype, attention)
        if graph is not None:
            return graph
    path = _cache_path(spec, seq, dtype, attention) if cache else None
    if path is not None:
        cached = _load_cached(path)
        if cached is not None:
            return cached
    graph = _profile_uncached(spec, seq, dtype, attention)
    if path is not None:
        _store_cached(path, graph)
    return graph


def _engine_graph(spec: str, seq: int, dtype: str, attention: str, engine: str) -> ModelGraph | None:
    """The closed-form graph of the `llama` model `engine` builds for an `hf:` config
    (`hf_engine.engine_config`), labelled with the spec, the config's checks run and its notes
    kept; None when the engine trains transformers' modules (or the spec is no `hf:` config)."""
    config_path = _hf_config_path(spec)
    if config_path is None:
        return None
    from meshplan.planner.models.hf_engine import engine_config, engine_model_note

    cfg = engine_config(config_path, engine)
    if cfg is None:
        return None
    from meshplan.planner.models.hf import check_hf_config
    from meshplan.planner.profiling import analytic

    notes = check_hf_config(config_path) + (engine_model_note(config_path, engine),)
    graph = analytic.analytic_graph(spec, cfg, seq, dtype, attention)
    return replace(graph, info=replace(graph.info, notes=notes))


def _closed_form(spec: str, seq: int, dtype: str, attention: str) -> ModelGraph | None:
    """The graph of a preset or parametric spec without tracing (None: not a zoo spec)."""
    from meshplan.planner.models.registry import parse_spec

    cfg = parse_spec(spec, seq)
    if cfg is None:
        return None
    from meshplan.planner.profiling import analytic, analytic_moe

    if cfg.family in analytic.FAMILIES:
        return analytic.analytic_graph(spec, cfg, seq, dtype, attention)
    if cfg.family in analytic_moe.FAMILIES:
        return analytic_moe.moe_analytic_graph(spec, cfg, seq, dtype, attention)
    return None


def _check_args(seq, batch, dtype, attention) -> None:
    if not isinstance(seq, int) or isinstance(seq, bool) or seq <= 0:
        raise MeshplanError(f"sequence length must be a positive integer, got {seq!r}")
    if not isinstance(batch, int) or isinstance(batch, bool) or batch <= 0:
        raise MeshplanError(f"batch must be a positive integer, got {batch!r}")
    if dtype not in DTYPES:
        raise MeshplanError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    check_attention(attention)


def torch_dtype(name: str):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def _profile_uncached(spec: str, seq: int, dtype: str, attention: str) -> ModelGraph:
    from meshplan.planner.models.registry import build_for_profile
    from meshplan.planner.profiling.tracing import measure_layers

    notes: tuple[str, ...] = ()
    config_path = _hf_config_path(spec)
    if config_path is not None:  # misspelt keys, unknown model types: refused before anything is built
        from meshplan.planner.models.hf import check_hf_config

        notes = check_hf_config(config_path)
    target = build_for_profile(spec, seq, dtype=torch_dtype(dtype))
    built = target.built
    groups = built.layer_groups
    if built.info.family == "file":
        groups = choose_file_groups(built)
    measurements, order = measure_layers(built, groups, attention)
    measured = _measured_profiles(built, groups, measurements, order)
    if target.layout:
        by_name = {layer.name: layer for layer in measured}
        layers = tuple(replace(by_name[source], name=name, kind=kind, repeat_of=None if name == source else source)
                       for name, kind, source in target.layout)
    else:
        layers = _mark_repeats(measured, groups, measurements, order)
    info = built.info if built.info.notes or not notes else replace(built.info, notes=notes)
    return ModelGraph(spec=spec, seq=seq, dtype=dtype, attention=attention, layers=layers, info=info)


def _measured_profiles(built, groups, measurements, order) -> list[LayerProfile]:
    """One LayerProfile per group (in group order), parameters attributed by ownership."""
    params = _param_ownership(built.module, groups, order)
    profiles = []
    for group, meas, (num_params, param_bytes, shared) in zip(groups, measurements, params):
        expert_params = _expert_params(group)
        profiles.append(LayerProfile(
            name=group.name, kind=group.kind if group.kind in ("embedding", "block", "head") else "other",
            fwd_flops=meas.fwd_flops, bwd_flops=meas.bwd_flops, num_params=num_params, param_bytes=param_bytes,
            act_tp_sharded_bytes=meas.act_tp_sharded_bytes, act_tp_replicated_bytes=meas.act_tp_replicated_bytes,
            act_attn_score_bytes=meas.act_attn_score_bytes, input_bytes=meas.input_bytes,
            output_bytes=meas.output_bytes, tp_split=group.tp_split,
            causal_fwd_flops=meas.fwd_flops - meas.causal_saving_flops, shared_params=shared,
            expert_params=expert_params,
            active_expert_params=expert_params * built.info.top_k // built.info.num_experts if expert_params else 0,
            expert_fwd_flops=meas.expert_fwd_flops, expert_bwd_flops=meas.expert_bwd_flops,
            expert_act_bytes=meas.expert_act_bytes, dispatch_bytes=meas.dispatch_bytes,
            conv_fwd_flops=meas.conv_fwd_flops, conv_bwd_flops=meas.conv_bwd_flops,
            attn_fwd_flops=meas.attn_fwd_flops, act_rebuilt_bytes=meas.act_rebuilt_bytes))
    return profiles


def _expert_params(group) -> int:
    """Parameters of a group's routed experts (each expert holds 1 / num_experts of them)."""
    root = group.modules[0]
    return sum(p.numel() for name in group.expert_modules for p in root.get_submodule(name).parameters())


def _param_ownership(module, groups, order) -> list[tuple[int, int, int]]:
    """(num_params, param_bytes, shared_params) per group; the first group in execution order
    that holds a parameter owns it; parameters outside every group go to the first group."""
    ranked = list(order) + [i for i in range(len(groups)) if i not in order]
    owner: dict[int, int] = {}
    totals = [[0, 0, 0] for _ in groups]
    for index in ranked:
        seen: set[int] = set()
        for root in groups[index].modules:
            for param in root.parameters():
                if id(param) in seen:
                    continue
                seen.add(id(param))
                if id(param) in owner:
                    totals[index][2] += param.numel()
                else:
                    owner[id(param)] = index
                    totals[index][0] += param.numel()
                    totals[index][1] += param.numel() * param.element_size()
    seen_orphans: set[int] = set()
    for param in module.parameters():
        if id(param) not in owner and id(param) not in seen_orphans:
            seen_orphans.add(id(param))
            totals[ranked[0]][0] += param.numel()
            totals[ranked[0]][1] += param.numel() * param.element_size()
    return [tuple(t) for t in totals]


def choose_file_groups(built) -> tuple:
    """Top-level children as layers; a child the forward never calls (an nn.ModuleList it
    iterates over) is replaced by its children, and a child with most of the forward FLOPs is
    split into its children (up to MAX_REFINE_DEPTH levels), so a model whose body is one
    Sequential or ModuleList of blocks is profiled block by block. Groups come back in
    first-call order."""
    from meshplan.planner.models.registry import LayerGroup
    from meshplan.planner.profiling.tracing import measure_layers

    entries = list(built.module.named_children()) or [("model", built.module)]
    for _ in range(2 * MAX_REFINE_DEPTH + 1):
        groups = tuple(LayerGroup(name, "other", (mod,)) for name, mod in entries)
        measurements, order = measure_layers(built, groups, backward=False)
        # Containers the forward iterates over (nn.ModuleList) are never called themselves:
        # their children are the layers.
        containers = [i for i, m in enumerate(measurements) if not m.called and any(entries[i][1].children())]
        if containers:
            entries = [item for i, entry in enumerate(entries) for item in
                       (_children_of(entry) if i in containers else [entry])]
            continue
        total = sum(m.fwd_flops for m in measurements)
        top = max(range(len(groups)), key=lambda i: measurements[i].fwd_flops)
        if total == 0 or measurements[top].fwd_flops <= DOMINANT_FLOP_SHARE * total \
                or len(_children_of(entries[top])) < 2:
            break
        entries[top:top + 1] = _children_of(entries[top])
    ranked = list(order) + [i for i in range(len(groups)) if i not in order]
    return tuple(groups[i] for i in ranked)


def _children_of(entry: tuple[str, object]) -> list[tuple[str, object]]:
    name, module = entry
    return [(f"{name}.{child}", mod) for child, mod in module.named_children()]


def structure_key(group) -> str:
    """Hash of a layer's structure: module types and settings, parameter and buffer shapes."""
    parts = []
    for root in group.modules:
        for name, sub in root.named_modules():
            tensors = [(n, tuple(t.shape), str(t.dtype)) for n, t in sub.named_parameters(recurse=False)]
            tensors += [(n, tuple(t.shape), str(t.dtype)) for n, t in sub.named_buffers(recurse=False)]
            parts.append((name, type(sub).__qualname__, sub.extra_repr(), tuple(tensors)))
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def _mark_repeats(layers, groups, measurements, order) -> tuple[LayerProfile, ...]:
    """Layers in execution order; each identical to an earlier one (same structure and inputs,
    same measured figures) gets repeat_of = the first such layer's name."""
    ranked = list(order) + [i for i in range(len(groups)) if i not in order]
    first: dict[tuple, LayerProfile] = {}
    out = []
    for index in ranked:
        layer = layers[index]
        key = (structure_key(groups[index]), measurements[index].input_shapes)
        earlier = first.get(key)
        if earlier is not None and replace(earlier, name=layer.name) == layer:
            layer = replace(layer, repeat_of=earlier.name)
        else:
            first.setdefault(key, layer)
        out.append(layer)
    return tuple(out)


# ---------------------------------------------------------------------------------------------
# On-disk cache


def cache_dir() -> Path:
    return Path(os.environ.get("MESHPLAN_CACHE_DIR") or Path.home() / ".cache" / "meshplan")


def _cache_path(spec: str, seq: int, dtype: str, attention: str) -> Path | None:
    from importlib.metadata import PackageNotFoundError, version

    def _version(dist: str) -> str:
        try:
            return version(dist)
        except PackageNotFoundError:
            return "unknown"

    key = {"format": CACHE_FORMAT, "spec": spec, "source": _spec_source_hash(spec), "seq": seq, "dtype": dtype,
           "attention": attention, "meshplan": _version("meshplan"), "torch": _version("torch"),
           "code": _code_hash()}
    if _hf_config_path(spec) is not None:  # the block's code is transformers' (e.g. how it calls SDPA)
        key["transformers"] = _version("transformers")
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return cache_dir() / "profiles" / f"{digest}.json"


def _code_files(root: Path | None = None) -> list[Path]:
    """The source files `_code_hash` reads, in a fixed order (`root`: the planner package)."""
    root = Path(__file__).resolve().parent.parent if root is None else root
    files = [path for folder in _SOURCE_DIRS for path in sorted((root / folder).glob("*.py"))]
    return files + [root / name for name in _SOURCE_FILES]


def _code_hash(root: Path | None = None) -> str:
    """Hash of the profiling and model code (file names and contents): the meshplan version
    does not change with an edit of an installed-editable checkout, so without this a cached
    graph of a zoo model would outlive a change to its block."""
    root = Path(__file__).resolve().parent.parent if root is None else root
    code = hashlib.sha256()
    for path in _code_files(root):
        code.update(path.relative_to(root).as_posix().encode() + b"\0")
        try:
            code.update(path.read_bytes())
        except OSError:
            code.update(b"<missing>")  # a key like any other; tests check the list is current
        code.update(b"\0")
    return code.hexdigest()


def _spec_source_hash(spec: str) -> str:
    """Content hash of the file a file or HF spec names (so edits invalidate the cache)."""
    if _hf_config_path(spec) is not None:
        from meshplan.planner.models.hf_hub import config_file

        path = Path(config_file(_hf_config_path(spec)))
    elif spec.partition(":")[0].endswith(".py"):
        path = Path(spec.rpartition(":")[0] if ":" in spec else spec)
    else:
        return ""
    if not path.is_file():  # absent, or a device that would never end: the build reports it
        return "missing"
    try:
        return str(path.resolve()) + ":" + hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return "missing"  # the build reports it


def _load_cached(path: Path) -> ModelGraph | None:
    """The cached graph, or None when absent, unreadable or not verifying against the digest stored
    with it (an edited or corrupt entry is said so, re-traced and rewritten)."""
    try:
        entry = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return None
    graph = entry.get("graph") if isinstance(entry, dict) else None
    if not isinstance(entry, dict) or entry.get("digest") != _entry_digest(graph):
        print(f"meshplan: profile cache entry {path} does not match its digest (edited or corrupt); "
              "profiling the model again", file=sys.stderr)
        return None
    try:
        return graph_from_json(graph)
    except ValueError:
        return None


def _entry_digest(graph_json) -> str:
    """sha256 of a cache entry's graph, as canonical JSON."""
    return hashlib.sha256(json.dumps(graph_json, sort_keys=True).encode()).hexdigest()


def _store_cached(path: Path, graph: ModelGraph) -> None:
    """Write atomically, with the digest `_load_cached` verifies; an unwritable cache directory only costs
    the next run's time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        document = graph_to_json(graph)
        write_text_atomic(path, json.dumps({"digest": _entry_digest(document), "graph": document}), "profile cache")
    except (OSError, MeshplanError):
        pass
