"""`ParallelConfig`: the uniform choices of one plan (what `estimate` takes and `plan` searches).

The executable plan space (docs/architecture.md): one mesh (pp, dp, tp) for the whole model, one ZeRO stage
(optionally hybrid: sharded over `shard_group` data-parallel ranks, replicated across the rest),
one sequence-parallel switch, one precision recipe, one schedule; per-layer stage and
recomputation live in the Plan's layer assignments.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

SCHEDULES = ("1f1b", "gpipe", "interleaved")
RECOMPUTE = ("none", "selective", "full")
PRECISIONS = ("bf16-mixed", "fp32")
Schedule = Literal["1f1b", "gpipe", "interleaved"]
Recompute = Literal["none", "selective", "full"]


@dataclass(frozen=True)
class ParallelConfig:
    """Mesh, batch split and uniform switches. `gpus = pp * dp * tp`.

    global_batch = dp * microbatch_size * num_microbatches (samples per optimizer step).
    `recompute` is the default for every layer; a Plan may override it per layer.
    """

    gpus: int
    global_batch: int
    tp: int = 1
    pp: int = 1
    dp: int = 1
    microbatch_size: int = 1
    zero: int = 0
    recompute: Recompute = "none"
    sp: bool = False
    schedule: Schedule = "1f1b"
    virtual_stages: int = 1
    precision: str = "bf16-mixed"
    # HSDP: ZeRO shards over groups of `shard_group` consecutive data-parallel ranks and replicates
    # across the dp / shard_group groups; None shards over all dp ranks (plain ZeRO / FSDP).
    shard_group: int | None = None

    def __post_init__(self):
        for name in ("gpus", "global_batch", "tp", "pp", "dp", "microbatch_size", "virtual_stages"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.tp * self.pp * self.dp != self.gpus:
            raise ValueError(f"tp*pp*dp = {self.tp}*{self.pp}*{self.dp} = {self.tp * self.pp * self.dp} "
                             f"must equal the number of GPUs ({self.gpus})")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"zero must be 0, 1, 2 or 3, got {self.zero!r}")
        self._check_shard_group()
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {self.recompute!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.sp and self.tp == 1:
            raise ValueError("sequence parallelism (--sp) needs tensor parallelism: set --tp > 1")
        samples_per_replica, rest = divmod(self.global_batch, self.dp)
        if rest:
            raise ValueError(f"global batch {self.global_batch} is not divisible by dp={self.dp}; "
                             f"use a multiple of {self.dp}")
        if samples_per_replica % self.microbatch_size:
            raise ValueError(f"micro-batch size {self.microbatch_size} does not divide the {samples_per_replica} "
                             f"samples per data-parallel replica (global batch {self.global_batch} / dp {self.dp})")
        if self.schedule == "interleaved":
            if self.pp == 1:
                raise ValueError("the interleaved schedule needs pipeline parallelism: set --pp > 1")
        elif self.virtual_stages != 1:
            raise ValueError(f"virtual stages ({self.virtual_stages}) need --schedule interleaved")
        if self.pp > 1 and self.num_microbatches < self.pp:
            raise ValueError(f"{self.num_microbatches} micro-batches is fewer than the {self.pp} pipeline stages; "
                             f"lower --mbs or raise --gbs to at least {self.pp * self.dp * self.microbatch_size}")
        if self.schedule == "interleaved" and self.num_microbatches % self.pp:
            raise ValueError(f"the interleaved schedule needs the micro-batch count ({self.num_microbatches}) "
                             f"to be a multiple of pp ({self.pp})")

    def _check_shard_group(self) -> None:
        group = self.shard_group
        if group is None:
            return
        if isinstance(group, bool) or not isinstance(group, int) or group <= 0:
            raise ValueError(f"shard_group must be a positive integer, got {group!r}")
        if self.zero == 0:
            raise ValueError(f"shard_group {group} (HSDP) shards ZeRO state: it needs --zero 1, 2 or 3, got zero 0")
        if self.dp % group or group == 1:
            raise ValueError(f"shard_group {group} must divide dp={self.dp} and be > 1 (state is sharded over "
                             f"the group and replicated across the dp / {group} groups)")

    @property
    def shard_degree(self) -> int:
        """Data-parallel ranks that share one copy of the sharded states (dp without HSDP)."""
        return self.shard_group or self.dp

    @property
    def num_microbatches(self) -> int:
        return self.global_batch // (self.dp * self.microbatch_size)

    @property
    def num_model_chunks(self) -> int:
        """Pipeline chunks the layers are cut into (pp * virtual stages)."""
        return self.pp * self.virtual_stages

    @property
    def sort_key(self) -> tuple:
        """The search's tie-break order: smaller pipelines, then smaller TP, ... first."""
        return (self.pp, self.tp, self.dp, self.microbatch_size, self.zero, self.sp, self.schedule,
                self.virtual_stages, -(self.shard_group or self.dp))

    def label(self) -> str:
        sched = f"interleaved x{self.virtual_stages}" if self.schedule == "interleaved" else self.schedule
        return (f"pp={self.pp} dp={self.dp} tp={self.tp}{' +sp' if self.sp else ''}, {sched}, "
                f"mbs {self.microbatch_size}, ZeRO-{self.zero}"
                + (f" HSDP shard {self.shard_group}" if self.shard_group else ""))

    def to_json(self) -> dict:
        return asdict(self)
