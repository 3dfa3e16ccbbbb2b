"""Cluster profiles: hardware numbers as data (`profiles/*.toml`), loaded into frozen dataclasses.

A profile file looks like:

    schema_version = 1
    name = "h100-sxm"
    description = "DGX H100 nodes"
    source = "NVIDIA H100 datasheet; DGX H100 user guide"
    validated = true        # optional, default true; false: from published specifications only

    [device]
    name = "H100 SXM5 80GB"
    memory_bytes = 85899345920
    memory_bw_bytes_per_s = 3.35e12
    peak_flops_per_s = { bf16 = 989e12, fp16 = 989e12, fp32 = 67e12, tf32 = 494e12 }
    matmul_efficiency = 0.80            # achieved fraction of peak for large GEMMs
    matmul_half_efficiency_flops = 2e9  # GEMM size (FLOPs) at which efficiency is half of that
    memory_efficiency = 0.85            # achieved fraction of memory bandwidth
    kernel_overhead_s = 5e-6            # fixed cost per layer kernel sequence (dispatch/launch)
    reserved_memory_bytes = 3e9         # CUDA context, allocator fragmentation, NCCL buffers
    num_sms = 132                       # streaming multiprocessors (GEMM wave quantisation)
    elementwise_bytes_per_activation_byte = 3.0  # norm/GELU/softmax traffic per saved byte
    # optional fixed costs, 0 unless measured (`meshplan calibrate` measures them):
    optimizer_per_tensor_s = 0.0          # per parameter tensor per optimizer step (plain tensors)
    dtensor_optimizer_per_tensor_s = 0.0  # the same for DTensor parameters (TP, FSDP, replicate)
    tp_layer_overhead_s = 0.0             # per tensor-parallel layer per pass (DTensor dispatch)
    tp_overhead_s_per_stream_byte = 0.0   # the same per byte of its (mbs, seq, hidden) input
    sp_layer_overhead_s = 0.0             # per TP block pass, extra under sequence parallelism
    tp_loss_overhead_s = 0.0              # per micro-batch, the vocab-parallel loss (loss_parallel)
    pipeline_action_overhead_s = 0.0      # per forward/backward action of a pipeline stage
    dp_unit_overhead_s = 0.0              # per FSDP/replicate-wrapped layer per pass
    dp_overhead_s_per_byte = 0.0          # FSDP's host work per byte it gathers or reduces
    dtensor_redistribute_s = 0.0          # per small Partial -> Replicate DTensor redistribution

    [topology]
    gpus_per_node = 8
    max_nodes = 4096
    nics_per_node = 8       # network rails; optional, default 1 (every group shares one NIC)

    [topology.intra_node]   # NVLink/NVSwitch
    bw_bytes_per_s = 450e9  # per GPU, one direction
    latency_s = 5e-6
    efficiency = 0.8        # achieved fraction of bw for large collectives

    [topology.inter_node]   # one NIC (rail): InfiniBand / RoCE
    bw_bytes_per_s = 50e9   # per NIC, one direction
    ...

    [topology.nvls]         # optional: NVLink SHARP (reduction in the NVSwitch), default off
    enabled = true
    efficiency = 0.61       # achieved fraction of intra_node.bw_bytes_per_s in an NVLS all-reduce

    [topology.sharp]        # optional: in-network reduction in the IB switches, default off
    enabled = false

Every number should carry its source in a comment or a `source` field. Unknown keys, missing
fields, wrong types and non-positive values are errors naming the file and the field.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

# The collectives the cost model prices (`planner.costing.collectives`).
COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv")


SCHEMA_VERSION = 1
DTYPES = ("bf16", "fp16", "fp32", "tf32", "fp8")
ARCHITECTURES = ("", "ampere", "hopper", "blackwell", "cdna3")


def _check_positive(owner: str, name: str, value: float, allow_zero: bool = False) -> None:
    bound = ">= 0" if allow_zero else "> 0"
    # Type first: comparing a string or table with 0 would raise TypeError, not name the field.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not (value >= 0 if allow_zero else value > 0):
        raise ValueError(f"{owner}.{name} must be a finite number {bound}, got {value!r}")


@dataclass(frozen=True)
class LinkProfile:
    """One level of the network: a GPU's NVLink port inside a node, or one NIC (rail) of the
    inter-node fabric."""

    bw_bytes_per_s: float  # per GPU port (NVLink) or per NIC, one direction
    latency_s: float  # per message hop (alpha)
    efficiency: float = 1.0  # achieved fraction of bw for large collectives
    # Per collective kind (all_reduce, all_gather, reduce_scatter, all_to_all, broadcast,
    # send_recv), a further fraction of the bandwidth that kind's implementation achieves; a kind
    # not listed gets all of it. `calibrate` fits it where implementations differ (gloo's
    # all-gather and reduce-scatter copy through intermediate buffers, its all-reduce does not).
    kind_efficiency: dict[str, float] = field(default_factory=dict)
    source: str = ""

    def __post_init__(self):
        _check_positive("link", "bw_bytes_per_s", self.bw_bytes_per_s)
        _check_positive("link", "latency_s", self.latency_s, allow_zero=True)
        _check_positive("link", "efficiency", self.efficiency)
        if self.efficiency > 1:
            raise ValueError(f"link.efficiency is a fraction in (0, 1], got {self.efficiency}")
        for kind, value in self.kind_efficiency.items():
            if kind not in COLLECTIVE_KINDS:
                raise ValueError(f"link.kind_efficiency has unknown collective {kind!r}; known: "
                                 f"{', '.join(COLLECTIVE_KINDS)}")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
                raise ValueError(f"link.kind_efficiency.{kind} is a fraction in (0, 1], got {value!r}")

    @property
    def effective_bw_bytes_per_s(self) -> float:
        return self.bw_bytes_per_s * self.efficiency

    def bw_for(self, kind: str) -> float:
        """Bytes/s a collective of `kind` achieves on this link."""
        return self.bw_bytes_per_s * self.efficiency * self.kind_efficiency.get(kind, 1.0)


@dataclass(frozen=True)
class InNetworkReduction:
    """Reduction done by the switches instead of the GPUs: NVLink SHARP (NVLS) in a node's
    NVSwitch, or SHARP in the InfiniBand switches across nodes. Each rank then sends its data
    once and receives the sum once, instead of the ring's 2 (n-1)/n of it."""

    enabled: bool = False
    # Achieved fraction of the link's nominal bandwidth (intra_node for NVLS, one NIC for
    # SHARP) while the switch reduces; it also absorbs the switch's own limits.
    efficiency: float = 1.0
    source: str = ""

    def __post_init__(self):
        if not isinstance(self.enabled, bool):
            raise ValueError(f"reduction.enabled must be true or false, got {self.enabled!r}")
        _check_positive("reduction", "efficiency", self.efficiency)
        if self.efficiency > 1:
            raise ValueError(f"reduction.efficiency is a fraction in (0, 1], got {self.efficiency}")


@dataclass(frozen=True)
class DeviceProfile:
    """One accelerator (or, for the `cpu` profile, one local training process)."""

    name: str
    memory_bytes: float
    memory_bw_bytes_per_s: float
    peak_flops_per_s: dict[str, float]
    matmul_efficiency: float = 0.8
    matmul_half_efficiency_flops: float = 0.0
    memory_efficiency: float = 0.8
    kernel_overhead_s: float = 0.0
    reserved_memory_bytes: float = 0.0
    # Memory traffic of a layer's non-GEMM kernels (norms, activations, softmax, residual adds),
    # in bytes per byte the forward saves for backward; backward moves twice as much. 0: ignore.
    elementwise_bytes_per_activation_byte: float = 0.0
    # Fixed costs that dominate small layers (0: ignore). Per parameter tensor per optimizer
    # step: the executor's AdamW steps CPU tensors one at a time (about a dozen kernels each) and
    # its gradient clipping adds a norm per tensor; DTensor parameters (TP, FSDP, replicate) go
    # through DTensor dispatch on every one of those kernels.
    optimizer_per_tensor_s: float = 0.0
    dtensor_optimizer_per_tensor_s: float = 0.0
    # Per tensor-parallel layer per pass: DTensor redistribution and dispatch of its parallel
    # Linears (beyond the collectives, which the link's latency and bandwidth cost).
    tp_layer_overhead_s: float = 0.0
    # Per tensor-parallel layer per pass, per byte of the residual-stream activation it takes in
    # (micro-batch x seq x hidden x element size): DTensor's work that grows with the tensors
    # (redistributing inputs and gradients, copies around the parallel Linears), beyond the
    # collectives and the local shard's own compute. Measured on a block of a real model's shape.
    tp_overhead_s_per_stream_byte: float = 0.0
    # Per tensor-parallel block per pass under sequence parallelism, beyond the above: its norms
    # and the gathers around attention and MLP run as DTensor ops.
    sp_layer_overhead_s: float = 0.0
    # Per micro-batch under TP (forward + backward): the vocab-parallel cross entropy
    # (`loss_parallel`) beyond its local compute and its per-token all-reduces.
    tp_loss_overhead_s: float = 0.0
    # Per forward or backward action of a pipeline stage (torch pipelining's per-action work:
    # posting receives and sends, shape checks, stage bookkeeping).
    pipeline_action_overhead_s: float = 0.0
    # Per data-parallel unit (each FSDP/replicate-wrapped block) per pass: hooks, parameter
    # views and the collective calls' own dispatch (beyond the link's latency and bandwidth).
    dp_unit_overhead_s: float = 0.0
    # FSDP2's host work per byte of (unsharded, local) parameters each all-gather produces and of
    # gradients each reduction takes in: copies into and out of the flat collective buffers, the
    # gradient division, beyond the collectives themselves; it runs on the rank's compute path.
    # Measured on a block of a real model's shape (`calibrate`), 0 unless measured.
    dp_overhead_s_per_byte: float = 0.0
    # Per DTensor redistribution of a small partial gradient to a replicated one (beyond its
    # all-reduce): the executor does one per TP norm tensor per step.
    dtensor_redistribute_s: float = 0.0
    # Achieved fraction of the fp8 peak for large fp8 GEMMs under the `fp8` precision recipe
    # (planner.costing.fp8); 0: the profile gives none, and `--precision fp8` is refused.
    fp8_matmul_efficiency: float = 0.0
    # Convolutions' throughput as a fraction of a GEMM's of the same FLOPs (forward and backward
    # together): direct and Winograd kernels, not one GEMM. 1.0: costed like a GEMM.
    conv_efficiency: float = 1.0
    # Achieved fraction of peak of the flash-attention kernels (the attention core's FLOPs, forward
    # and backward), from the kernels' own published benchmarks. 0: attention on the GEMM curve.
    attention_efficiency: float = 0.0
    # Streaming multiprocessors (AMD: compute units): the GEMM tiles of one wave
    # (`planner.costing.gemm`). 0: not a GPU, no wave quantisation.
    num_sms: int = 0
    # GPU generation, which decides the kernels it runs (`planner.costing.attention_kernels`:
    # FlashAttention-3 needs "hopper"); "" for a device no kernel table describes.
    architecture: str = ""
    # Host memory for offloaded model states (`planner.costing.offload`): one GPU's link to its host,
    # bytes/s one direction (PCIe Gen4 x16 32e9, Gen5 x16 64e9; Grace's NVLink-C2C), and the host
    # DRAM bandwidth of a whole node, which its GPUs' CPU optimizer steps share, and the node's host
    # DRAM, which holds the offloaded states of all its GPUs (`costing.offload.host_state_bytes_per_node`).
    # 0: not described; without the bandwidths offloading is refused on the profile, without the
    # host memory (profiles written before it, as older plans embed them) it is not checked.
    host_link_bw_bytes_per_s: float = 0.0
    host_memory_bw_bytes_per_s: float = 0.0
    host_memory_bytes: float = 0.0
    # A per-width factor on the GEMM size curve (`planner.costing.gemm.width_factor`): {narrowest
    # dimension of the GEMM: factor}, interpolated in log2 of the width, clamped at the ends; fitted
    # by `meshplan calibrate` on CPU to a sweep of GEMM shapes. Empty: the size curve alone.
    matmul_width_efficiency: dict[str, float] = field(default_factory=dict)
    supports_bf16: bool = True
    source: str = ""

    def __post_init__(self):
        _check_positive("device", "memory_bytes", self.memory_bytes)
        for width, factor in self.matmul_width_efficiency.items():
            if not str(width).isdigit() or int(width) <= 0:
                raise ValueError(f"device.matmul_width_efficiency has width {width!r}; widths are positive integers")
            _check_positive("device.matmul_width_efficiency", str(width), factor)
        _check_positive("device", "memory_bw_bytes_per_s", self.memory_bw_bytes_per_s)
        if not self.peak_flops_per_s:
            raise ValueError("device.peak_flops_per_s needs at least one dtype, e.g. { fp32 = 1e12 }")
        for dtype, value in self.peak_flops_per_s.items():
            if dtype not in DTYPES:
                raise ValueError(f"device.peak_flops_per_s has unknown dtype {dtype!r}; known: {', '.join(DTYPES)}")
            _check_positive("device.peak_flops_per_s", dtype, value)
        for name in ("matmul_efficiency", "memory_efficiency", "conv_efficiency"):
            value = getattr(self, name)
            _check_positive("device", name, value)
            if value > 1:
                raise ValueError(f"device.{name} is a fraction in (0, 1], got {value}")
        _check_positive("device", "fp8_matmul_efficiency", self.fp8_matmul_efficiency, allow_zero=True)
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"device.architecture must be one of {', '.join(map(repr, ARCHITECTURES))}, "
                             f"got {self.architecture!r}")
        if isinstance(self.num_sms, bool) or not isinstance(self.num_sms, int) or self.num_sms < 0:
            raise ValueError(f"device.num_sms must be an integer >= 0 (0: no wave quantisation), got {self.num_sms!r}")
        _check_positive("device", "attention_efficiency", self.attention_efficiency, allow_zero=True)
        if self.attention_efficiency > 1:
            raise ValueError(f"device.attention_efficiency is a fraction in [0, 1], got {self.attention_efficiency}")
        if self.fp8_matmul_efficiency > 1:
            raise ValueError(f"device.fp8_matmul_efficiency is a fraction in [0, 1], got {self.fp8_matmul_efficiency}")
        for name in ("matmul_half_efficiency_flops", "kernel_overhead_s", "reserved_memory_bytes",
                     "elementwise_bytes_per_activation_byte", "optimizer_per_tensor_s",
                     "dtensor_optimizer_per_tensor_s", "tp_layer_overhead_s", "tp_overhead_s_per_stream_byte",
                     "sp_layer_overhead_s", "tp_loss_overhead_s", "pipeline_action_overhead_s",
                     "dp_unit_overhead_s", "dp_overhead_s_per_byte", "dtensor_redistribute_s",
                     "host_link_bw_bytes_per_s", "host_memory_bw_bytes_per_s", "host_memory_bytes"):
            _check_positive("device", name, getattr(self, name), allow_zero=True)
        if self.reserved_memory_bytes >= self.memory_bytes:
            raise ValueError(f"device.reserved_memory_bytes ({self.reserved_memory_bytes:.3g}) must be below "
                             f"memory_bytes ({self.memory_bytes:.3g})")

    def peak_flops(self, dtype: str) -> float:
        """Peak FLOP/s for a compute dtype, falling back to the closest one listed."""
        for candidate in (dtype, "bf16" if dtype == "fp16" else "fp16", "tf32" if dtype == "fp32" else "fp32", "fp32"):
            if candidate in self.peak_flops_per_s:
                return self.peak_flops_per_s[candidate]
        return max(self.peak_flops_per_s.values())

    @property
    def usable_memory_bytes(self) -> float:
        return self.memory_bytes - self.reserved_memory_bytes


@dataclass(frozen=True)
class CalibrationConditions:
    """How `meshplan calibrate` measured a profile (its `[calibration]` table): the processes and
    threads it ran, the dtype, the clock of each part, the host's load and how much its repeated
    rounds spread, so that a run can be judged against a calibration made under its own conditions
    (`calibration.host.calibration_problems`)."""

    processes: int  # measuring at once, as many as the training world size it prices
    threads_per_process: int  # torch's intra-op threads in each (OMP_NUM_THREADS)
    dtype: str  # of the compute timings
    rounds: int  # repeats of the compute and of the collectives, combined by their median
    compute_clock: str  # what timed the compute ("cpu-time": the process's CPU seconds per thread)
    link_clock: str  # what timed the collectives ("wall")
    compute_spread: float = 0.0  # median over shapes of (max - min) / median across rounds
    link_spread: float = 0.0  # the same over the collectives' sizes and kinds
    load_avg_1m: float = 0.0  # the host's 1-minute load average, the higher of before and after
    num_cpus: int = 0

    def __post_init__(self):
        for name in ("processes", "threads_per_process", "rounds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"calibration.{name} must be a positive integer, got {value!r}")
        for name in ("compute_spread", "link_spread", "load_avg_1m"):
            _check_positive("calibration", name, getattr(self, name), allow_zero=True)
        if isinstance(self.num_cpus, bool) or not isinstance(self.num_cpus, int) or self.num_cpus < 0:
            raise ValueError(f"calibration.num_cpus must be an integer >= 0, got {self.num_cpus!r}")


@dataclass(frozen=True)
class FittedRuns:
    """The runs `meshplan calibrate --from-runs` fitted a profile to (`[fitted_runs]`): how many, their
    regimes (`costing.error_bands.REGIMES`, space-separated) and the band of their leave-one-out
    step errors (`error_bands.error_range`), which predictions on the profile carry."""

    num_runs: int
    error_low: float
    error_high: float
    regimes: str = ""

    def __post_init__(self):
        if isinstance(self.num_runs, bool) or not isinstance(self.num_runs, int) or self.num_runs <= 0:
            raise ValueError(f"fitted_runs.num_runs must be a positive integer, got {self.num_runs!r}")
        if not -1 < self.error_low <= self.error_high:
            raise ValueError(f"fitted_runs: errors {self.error_low!r}..{self.error_high!r} are no range above -100%")


@dataclass(frozen=True)
class ClusterProfile:
    """A homogeneous cluster: one device type, nodes of `gpus_per_node`, two network levels.

    `intra_node` is one GPU's NVLink/NVSwitch port; `inter_node` is one NIC (a rail), and each
    node has `nics_per_node` of them, so a group with several ranks per node can spread its
    inter-node traffic over several rails (`planner.costing.collectives`). `nvls` and `sharp`
    say whether the switches can reduce (inside a node, across nodes).
    """

    name: str
    device: DeviceProfile
    gpus_per_node: int
    intra_node: LinkProfile
    inter_node: LinkProfile
    max_nodes: int = 1_000_000
    # Default 1: every group's inter-node traffic leaves a node through one NIC, the model of
    # profiles written before rails were described.
    nics_per_node: int = 1
    nvls: InNetworkReduction = field(default_factory=InNetworkReduction)
    sharp: InNetworkReduction = field(default_factory=InNetworkReduction)
    description: str = ""
    source: str = ""
    schema_version: int = SCHEMA_VERSION
    # False for a part described from published specifications only: no measured run has checked
    # its numbers (B200, GB200 NVL72, MI300X, the power-capped H100); the profile listing says so.
    validated: bool = True
    # Per-step costs of one optimizer step: AdamW reads/writes ~ this many bytes per parameter
    # it owns (fp32 master, two moments, grad, param) through memory bandwidth.
    optimizer_bytes_per_param: float = 28.0  # fused AdamW: read master, grad, 2 moments; write 3 (fp32)
    calibration: CalibrationConditions | None = None  # measured by `meshplan calibrate`: how
    fitted_runs: FittedRuns | None = None  # fitted by `meshplan calibrate --from-runs`: to what

    def __post_init__(self):
        if isinstance(self.gpus_per_node, bool) or not isinstance(self.gpus_per_node, int) or self.gpus_per_node <= 0:
            raise ValueError(f"topology.gpus_per_node must be a positive integer, got {self.gpus_per_node!r}")
        if isinstance(self.max_nodes, bool) or not isinstance(self.max_nodes, int) or self.max_nodes <= 0:
            raise ValueError(f"topology.max_nodes must be a positive integer, got {self.max_nodes!r}")
        if isinstance(self.nics_per_node, bool) or not isinstance(self.nics_per_node, int) or self.nics_per_node <= 0:
            raise ValueError(f"topology.nics_per_node must be a positive integer, got {self.nics_per_node!r}")
        for name in ("nvls", "sharp"):
            if not isinstance(getattr(self, name), InNetworkReduction):
                raise ValueError(f"topology.{name} must be a table such as {{ enabled = true, efficiency = 0.6 }}, "
                                 f"got {getattr(self, name)!r}")
        if not isinstance(self.validated, bool):
            raise ValueError(f"validated must be true or false, got {self.validated!r}")
        for name in ("name", "description", "source"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a string, got {getattr(self, name)!r}")
        if isinstance(self.schema_version, bool) or not isinstance(self.schema_version, int) \
                or not 1 <= self.schema_version <= SCHEMA_VERSION:
            raise ValueError(f"schema_version {self.schema_version!r} is not supported (this meshplan reads the "
                             f"integer versions 1..{SCHEMA_VERSION})")
        _check_positive("cluster", "optimizer_bytes_per_param", self.optimizer_bytes_per_param)

    def link_for_group(self, group_size: int, stride: int = 1) -> LinkProfile:
        """The slowest link a collective over `group_size` ranks spaced `stride` apart crosses."""
        span = (group_size - 1) * stride + 1
        return self.intra_node if span <= self.gpus_per_node else self.inter_node

    def to_dict(self) -> dict[str, Any]:
        """The TOML-shaped dict (round-trips through `cluster_from_dict`)."""
        return {
            "schema_version": self.schema_version, "name": self.name, "description": self.description,
            "source": self.source, "validated": self.validated,
            "optimizer_bytes_per_param": self.optimizer_bytes_per_param,
            "device": asdict(self.device),
            "topology": {"gpus_per_node": self.gpus_per_node, "max_nodes": self.max_nodes,
                         "nics_per_node": self.nics_per_node,
                         "intra_node": asdict(self.intra_node), "inter_node": asdict(self.inter_node),
                         "nvls": asdict(self.nvls), "sharp": asdict(self.sharp)},
            **({"calibration": asdict(self.calibration)} if self.calibration is not None else {}),
            **({"fitted_runs": asdict(self.fitted_runs)} if self.fitted_runs is not None else {}),
        }


def _build(cls, data: dict[str, Any], where: str):
    if not isinstance(data, dict):
        raise ValueError(f"[{where}] must be a table, got {type(data).__name__}")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(f"unknown field {where}.{unknown[0]}; known fields: {', '.join(sorted(known))}")
    required = [f.name for f in fields(cls) if f.default is f.default_factory is __import__("dataclasses").MISSING]
    missing = [name for name in required if name not in data]
    if missing:
        raise ValueError(f"missing field {where}.{missing[0]}")
    for name, value in data.items():
        expected = known[name].type
        if str(expected) == "float" and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ValueError(f"{where}.{name} must be a number, got {value!r}")
        if str(expected) == "str" and not isinstance(value, str):
            raise ValueError(f"{where}.{name} must be a string, got {value!r}")
        if str(expected).startswith("dict") and not isinstance(value, dict):
            raise ValueError(f"{where}.{name} must be a table such as {{ bf16 = 1e12 }}, got {value!r}")
        if str(expected) == "bool" and not isinstance(value, bool):
            raise ValueError(f"{where}.{name} must be true or false, got {value!r}")
    try:
        return cls(**data)
    except ValueError as exc:
        # The dataclasses name fields as `device.x` / `link.x`; say where in the file instead.
        owner, dot, rest = str(exc).partition(".")
        if dot and owner in ("device", "link", "reduction"):
            raise ValueError(f"{where}.{rest}") from None
        raise ValueError(f"{where}: {exc}") from None


def cluster_from_dict(data: dict[str, Any]) -> ClusterProfile:
    """Validate and build a ClusterProfile from the TOML-shaped dict."""
    data = dict(data)
    topology = data.pop("topology", None) or {}
    if not isinstance(topology, dict):
        raise ValueError(f"[topology] must be a table, got {type(topology).__name__}")
    topology = dict(topology)
    if "device" not in data:
        raise ValueError("missing table [device]")
    if not topology:
        raise ValueError("missing table [topology]")
    device = _build(DeviceProfile, data.pop("device"), "device")
    links = {}
    for level in ("intra_node", "inter_node"):
        if level not in topology:
            raise ValueError(f"missing table [topology.{level}]")
        links[level] = _build(LinkProfile, topology.pop(level), f"topology.{level}")
    for level in ("nvls", "sharp"):  # optional: older profiles have no in-network reduction
        if level in topology:
            links[level] = _build(InNetworkReduction, topology.pop(level), f"topology.{level}")
    scalars = ("gpus_per_node", "max_nodes", "nics_per_node")
    unknown = sorted(set(topology) - set(scalars))
    if unknown:
        raise ValueError(f"unknown field topology.{unknown[0]}; known: {', '.join(scalars)}, intra_node, inter_node, "
                         "nvls, sharp")
    if "gpus_per_node" not in topology:
        raise ValueError("missing field topology.gpus_per_node")
    if "calibration" in data:
        data["calibration"] = _build(CalibrationConditions, data["calibration"], "calibration")
    if "fitted_runs" in data:
        data["fitted_runs"] = _build(FittedRuns, data["fitted_runs"], "fitted_runs")
    top_known = {"schema_version", "name", "description", "source", "validated", "optimizer_bytes_per_param",
                 "calibration", "fitted_runs"}
    unknown = sorted(set(data) - top_known)
    if unknown:
        raise ValueError(f"unknown top-level field {unknown[0]}; known: {', '.join(sorted(top_known))}, [device], [topology]")
    if "name" not in data:
        raise ValueError("missing field name")
    try:
        return ClusterProfile(device=device, gpus_per_node=topology["gpus_per_node"],
                              max_nodes=topology.get("max_nodes", 1_000_000),
                              nics_per_node=topology.get("nics_per_node", 1), **links, **data)
    except TypeError as exc:
        raise ValueError(str(exc)) from None


def dump_cluster_toml(cluster: ClusterProfile) -> str:
    """Serialise a profile to TOML text (the subset of TOML the profiles use)."""
    data = cluster.to_dict()
    lines: list[str] = []
    _emit_table(lines, [], data)
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


def _emit_table(lines: list[str], prefix: list[str], data: dict[str, Any]) -> None:
    tables = {k: v for k, v in data.items() if isinstance(v, dict) and k != "peak_flops_per_s"}
    for key, value in data.items():
        if key not in tables:
            lines.append(f"{key} = {_toml_value(value)}")
    for key, value in tables.items():
        lines.append("")
        lines.append(f"[{'.'.join(prefix + [key])}]")
        _emit_table(lines, prefix + [key], value)
