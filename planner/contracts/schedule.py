"""`Schedule`: one pipeline schedule's facts, and the registry of the schedules meshplan plans and runs.

A schedule is named by the string users type (`--schedule`, plan.json's `schedule.name`,
`ParallelConfig.schedule`); `schedule_spec(name)` returns its description, which every layer asks
instead of testing names: the validity rules (`check`, torch 2.13's and meshplan's), the chunk
placement, the split backward, what the search enumerates, the facts its bounds use, the torch
class the executor runs and the engines' names for it. The per-rank action order lives in
`planner.simulation.schedules` (this package is a leaf): `actions` names its generator.

Notation: pp = pipeline ranks, m = micro-batches per step, v = virtual stages (model chunks per rank).
"""
from __future__ import annotations

from dataclasses import dataclass

PLACEMENTS = ("loop", "v")
# Megatron-LM's schedules, as the meshplan schedule each is (`Schedule.megatron`).
MEGATRON_SCHEDULES = ("1f1b", "interleaved")


def default_microbatch_group(pp: int, num_microbatches: int) -> int:
    """Micro-batches per round of interleaved 1F1B unless a plan sets its group size: torch's
    `ScheduleInterleaved1F1B` rounds, m // max(1, m // pp), which is Megatron-Core's default, pp,
    whenever m is a multiple of pp."""
    return num_microbatches // max(1, num_microbatches // pp)


def interleaved_warmup(num_stages: int, num_microbatches: int, virtual_stages: int, rank: int, per_round: int,
                       hops: int = 2) -> int:
    """Warm-up forwards of pipeline rank `rank` under interleaved 1F1B with `per_round`
    micro-batches a round: (v - 1) r + 2 (p - 1 - k), at most m v; the zero-bubble flavour
    (`ScheduleInterleavedZeroBubble`) waits one hop each way less (`hops` = 1)."""
    return min((virtual_stages - 1) * per_round + hops * (num_stages - 1 - rank), num_microbatches * virtual_stages)


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """The facts of one pipeline schedule (see the module docstring)."""

    name: str  # what users type and plan.json stores
    actions: str  # the generator of its per-rank order in `planner.simulation.schedules`
    torch_class: str  # its class in `torch.distributed.pipelining` (resolved by the executor)
    # Several model chunks per rank (torch's PipelineScheduleMulti: its runtime keeps every send's
    # work until the step ends, `costing.boundary_buffers.kept_send_bytes`); needs pp > 1.
    multi_chunk: bool = False
    least_chunks: int = 1  # virtual stages per rank it runs: least_chunks .. most_chunks
    most_chunks: int | None = 1  # None: no upper limit
    # "loop": chunk c on rank c mod pp (Megatron-LM's and torch's interleaving); "v": chunk c < pp
    # on rank c and chunk c >= pp mirrored onto rank 2 pp - 1 - c (torch's style "v", two chunks).
    placement: str = "loop"
    split_backward: bool = False  # backwards split into input (I) and weight (W) gradients
    # Micro-batch rules: m a multiple of pp; m a multiple of torch's rounds max(1, m // pp);
    # m >= least_microbatches_per_rank * pp.
    microbatches_multiple_of_pp: bool = False
    microbatches_multiple_of_rounds: bool = False
    least_microbatches_per_rank: int = 0
    # The search: enumerated unpinned (else only when --schedule names it), from how many chunks
    # per rank, and only once m fills all its chunks but one (m >= v pp - 1: for fewer, torch
    # builds the order of v pp - 1 micro-batches and drops the extra ones' actions, which only idles).
    searched: bool = True
    least_searched_chunks: int = 1
    searched_when_filled: bool = False
    # Its balanced step factor is the textbook m + p - 1 (one chunk per rank, whole backwards), so
    # the search's bounds take it as is and replay its order cheaply instead of bounding it.
    textbook_factor: bool = False
    transfer_cycle: bool = False  # its steady state waits for boundary transfers (1F1B's F/B pairs)
    megatron: str | None = None  # the Megatron-LM schedule it is (MEGATRON_SCHEDULES); None: none
    deepspeed: bool = False  # DeepSpeed's pipeline engine runs it (its engine runs 1F1B only)

    def __post_init__(self):
        if not self.name or not self.actions or not self.torch_class:
            raise ValueError(f"a schedule needs a name, an action generator and a torch class, got "
                             f"{self.name!r}, {self.actions!r}, {self.torch_class!r}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"schedule {self.name}: placement must be one of {', '.join(PLACEMENTS)}, "
                             f"got {self.placement!r}")
        most = self.most_chunks
        if self.least_chunks < 1 or (most is not None and most < self.least_chunks):
            raise ValueError(f"schedule {self.name}: chunks per rank {self.least_chunks}..{most} is not a range")
        if not self.multi_chunk and (self.least_chunks, most) != (1, 1):
            raise ValueError(f"schedule {self.name} runs one chunk per rank, not {self.least_chunks}..{most}")
        if self.placement == "v" and (self.least_chunks, most) != (2, 2):
            raise ValueError(f"schedule {self.name}: a V mirrors exactly 2 chunks per rank, not "
                             f"{self.least_chunks}..{most}")
        if not self.least_chunks <= self.least_searched_chunks <= (most or self.least_searched_chunks):
            raise ValueError(f"schedule {self.name}: least searched chunks {self.least_searched_chunks} is "
                             f"outside {self.least_chunks}..{most}")
        if self.textbook_factor and (self.multi_chunk or self.split_backward):
            raise ValueError(f"schedule {self.name}: the textbook factor m + p - 1 needs one chunk per rank "
                             "and whole backwards")
        if self.least_microbatches_per_rank < 0:
            raise ValueError(f"schedule {self.name}: least micro-batches per rank must be >= 0, "
                             f"got {self.least_microbatches_per_rank}")
        if self.megatron not in (None, *MEGATRON_SCHEDULES):
            raise ValueError(f"schedule {self.name}: megatron must be None or one of "
                             f"{', '.join(MEGATRON_SCHEDULES)}, got {self.megatron!r}")

    @property
    def free_chunks(self) -> bool:
        """--vpp chooses its chunks per rank (more than one count allowed)."""
        return self.most_chunks != self.least_chunks

    def runs_under(self, engine: str) -> bool:
        """Whether `engine` runs this schedule: Megatron-LM its 1F1B and interleaved 1F1B
        (`megatron`), DeepSpeed's pipeline engine 1F1B (`deepspeed`); torchtitan every torch
        pipelining schedule meshplan has, and so does meshplan's own executor."""
        if engine == "megatron":
            return self.megatron is not None
        if engine == "deepspeed":
            return self.deepspeed
        return True

    @property
    def torchtitan_name(self) -> str:
        """torchtitan's `pipeline_parallel_schedule` value (torch's `get_schedule_class` key)."""
        return self.torch_class.removeprefix("Schedule")

    def check(self, pp: int, num_microbatches: int, virtual_stages: int) -> None:
        """Raise ValueError, with the numbers and the fix, unless it runs pp ranks, m micro-batches, v chunks."""
        name, m, v = self.name, num_microbatches, virtual_stages
        if not self.multi_chunk and v != 1:
            free = " or ".join(spec.name for spec in SCHEDULE_SPECS.values() if spec.free_chunks)
            raise ValueError(f"virtual stages ({v}) need --schedule {free}; {name} runs one model chunk per rank")
        if self.multi_chunk and pp == 1:
            raise ValueError(f"the {name} schedule needs pipeline parallelism: set --pp > 1")
        if v < self.least_chunks or (self.most_chunks is not None and v > self.most_chunks):
            shape = "is V-shaped: exactly" if self.placement == "v" else "runs"
            allowed = (f"{self.least_chunks} model chunks per rank (--vpp {self.least_chunks})" if not self.free_chunks
                       else f"{self.least_chunks} to {self.most_chunks or 'any number of'} model chunks per rank")
            raise ValueError(f"the {name} schedule {shape} {allowed}, got {v}")
        if self.microbatches_multiple_of_pp and m % pp:
            raise ValueError(f"the {name} schedule needs the micro-batch count ({m}) to be a multiple of pp ({pp})")
        rounds = max(1, m // pp)
        if self.microbatches_multiple_of_rounds and m % rounds:
            raise ValueError(f"the {name} schedule needs the micro-batch count ({m}) to be a multiple of its "
                             f"rounds (m // pp = {rounds}); use a multiple of pp ({pp})")
        least = self.least_microbatches_per_rank
        if m < least * pp:
            of = f"stages (pp = {pp})" if least == 1 else f"model chunks ({least} x pp = {least * pp})"
            raise ValueError(f"the {name} schedule needs at least as many micro-batches ({m}) as {of}; "
                             "raise --gbs or lower --mbs")

    def accepts(self, pp: int, num_microbatches: int, virtual_stages: int) -> bool:
        """Whether `check` passes."""
        try:
            self.check(pp, num_microbatches, virtual_stages)
        except ValueError:
            return False
        return True

    def searched_chunks(self, most: int) -> range:
        """The chunk counts per rank the search tries when --vpp is not pinned (at most `most`,
        unless the schedule fixes more)."""
        top = most if self.most_chunks is None else min(self.most_chunks, most)
        return range(self.least_searched_chunks, max(self.least_searched_chunks, top) + 1)

    def searched_at(self, pp: int, num_microbatches: int, virtual_stages: int) -> bool:
        """Whether the search offers it unpinned at (pp, m, v), beside `accepts` (its preferences)."""
        return (self.searched and virtual_stages >= self.least_searched_chunks
                and (not self.searched_when_filled or num_microbatches >= virtual_stages * pp - 1))

    def chunk_rank(self, pp: int, chunk: int) -> int:
        """Pipeline rank of model chunk `chunk` (see `placement`: the V's first and last chunks share rank 0)."""
        if self.placement == "v" and chunk >= pp:
            return 2 * pp - 1 - chunk
        return chunk % pp

    def chunk_index(self, pp: int, stage: int, virtual_stage: int) -> int:
        """Inverse of `chunk_rank`: the chunk rank `stage` runs as its virtual stage (chunk // pp)."""
        if self.placement == "v" and virtual_stage == 1:
            return 2 * pp - 1 - stage
        return virtual_stage * pp + stage


_REGISTERED = (
    Schedule(name="1f1b", actions="1f1b", torch_class="Schedule1F1B", least_microbatches_per_rank=1,
             textbook_factor=True, transfer_cycle=True, megatron="1f1b", deepspeed=True),
    # GPipe: all forwards, then all backwards; with the same cut never faster than 1F1B and holds
    # every micro-batch's activations, so the search offers it only when pinned.
    Schedule(name="gpipe", actions="gpipe", torch_class="ScheduleGPipe", searched=False, textbook_factor=True),
    # Interleaved 1F1B (Narayanan et al. 2021); one chunk per rank is 1F1B with a longer warm-up.
    Schedule(name="interleaved", actions="interleaved", torch_class="ScheduleInterleaved1F1B", multi_chunk=True,
             most_chunks=None, microbatches_multiple_of_pp=True, microbatches_multiple_of_rounds=True,
             least_searched_chunks=2, megatron="interleaved"),
    # Zero-bubble (Qi et al. 2023), interleaved over v chunks.
    Schedule(name="zb-interleaved", actions="zb-interleaved", torch_class="ScheduleInterleavedZeroBubble",
             multi_chunk=True, most_chunks=None, split_backward=True, microbatches_multiple_of_rounds=True),
    Schedule(name="zbv", actions="zbv", torch_class="ScheduleZBVZeroBubble", multi_chunk=True, least_chunks=2,
             most_chunks=2, placement="v", split_backward=True, least_searched_chunks=2, searched_when_filled=True),
    # DualPipeV (DeepSeek-AI 2024): torch runs its overlapped F&B pairs one after the other.
    Schedule(name="dualpipev", actions="dualpipev", torch_class="ScheduleDualPipeV", multi_chunk=True, least_chunks=2,
             most_chunks=2, placement="v", split_backward=True, least_microbatches_per_rank=2,
             least_searched_chunks=2),
)
# name -> description, in the order the CLI lists them.
SCHEDULE_SPECS: dict[str, Schedule] = {spec.name: spec for spec in _REGISTERED}
SCHEDULES = tuple(SCHEDULE_SPECS)


def schedule_spec(name: str) -> Schedule:
    """The description of the schedule users call `name`; ValueError names the known ones."""
    spec = SCHEDULE_SPECS.get(name)
    if spec is None:
        raise ValueError(f"unknown pipeline schedule {name!r}; known: {', '.join(SCHEDULES)}")
    return spec
