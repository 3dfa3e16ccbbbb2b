"""Training logs of the engines read into a `Measurement`, so that `report` sets a run made with
Megatron-LM, NeMo or torchtitan against meshplan's prediction as it does a `meshplan train` run.

What each engine prints, per logged step:
- Megatron-LM (`training_log`): `iteration N/ M | ... | elapsed time per iteration (ms): T |
  throughput per GPU (TFLOP/s/GPU): F | ... | global batch size: B | lm loss: L | ...`, the mean
  over the log interval; and once `[Rank r] (after N iterations) memory (MB) | allocated: ... |
  max allocated: X | ...`.
- NeMo (Megatron-Core through Lightning): `Training epoch E, iteration N/M | ... |
  global_batch_size: B | ... | reduced_train_loss: L | train_step_timing in s: T`.
- torchtitan (`MetricsProcessor.log`): `step: N  loss: L  ...  memory: XGiB(P%)  tps: K  tflops:
  F  mfu: U%`, where tps is tokens per second per GPU and memory the peak reserved; it prints no
  step time, so the step is the global batch's tokens over tps x GPUs.
- DeepSpeed: its pipeline engine `steps: N loss: L iter time (s): T samples/sec: S`; its engine's
  throughput timer `epoch=E/micro_step=M/global_step=N, RunningAvgSamplesPerSec=R,
  CurrSamplesPerSec=S, MemAllocated=AGB, MaxMemAllocated=XGB` (samples of the global batch per
  second: the step is the global batch over S).
Each line is taken once per step (every rank may print it); a logged step 1 is warm-up.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.contracts.measurement import Measurement

GIB = 2**30
MIB = 2**20


@dataclass(frozen=True)
class LoggedStep:
    """One step as an engine's log prints it (None: not printed)."""

    step: int
    step_time_s: float | None
    loss: float | None = None
    tokens_per_s_per_gpu: float | None = None
    global_batch: int | None = None
    samples_per_s: float | None = None  # of the whole job


@dataclass(frozen=True)
class RunFacts:
    """What a log does not print and the job's config (or the command line) gives."""

    gpus: int
    seq: int | None = None
    global_batch: int | None = None

    def __post_init__(self):
        if self.gpus <= 0 or (self.seq is not None and self.seq <= 0) or \
                (self.global_batch is not None and self.global_batch <= 0):
            raise ValueError(f"gpus, seq and global batch must be positive, got {self.gpus}, {self.seq}, "
                             f"{self.global_batch}")


_NUMBER = r"([0-9][0-9,]*\.?[0-9]*(?:[eE][+-]?[0-9]+)?)"
_MEGATRON = re.compile(r"iteration\s+(\d+)/\s*\d+\s*\|.*?elapsed time per iteration \(ms\):\s*" + _NUMBER)
_MEGATRON_MEMORY = re.compile(r"\[Rank (\d+)\] \(after \d+ iterations\) memory \(MB\).*?max allocated:\s*" + _NUMBER)
_NEMO = re.compile(r"Training epoch \d+, iteration (\d+)/\d+\s*\|.*?train_step_timing in s:\s*" + _NUMBER)
_TORCHTITAN = re.compile(r"step:\s*(\d+)\s+loss:\s*" + _NUMBER + r".*?memory:\s*" + _NUMBER + r"\s*GiB.*?tps:\s*"
                         + _NUMBER)
_DEEPSPEED = re.compile(r"steps:\s*(\d+)\s+loss:\s*" + _NUMBER + r"\s+iter time \(s\):\s*" + _NUMBER)
_DEEPSPEED_TIMER = re.compile(r"global_step=(\d+),.*?CurrSamplesPerSec=" + _NUMBER + r".*?MaxMemAllocated=" + _NUMBER
                              + r"\s*GB")


def _float(text: str) -> float:
    return float(text.replace(",", ""))


def _field(line: str, pattern: str) -> float | None:
    match = re.search(pattern + r"\s*" + _NUMBER, line)
    return _float(match.group(1)) if match else None


def read_megatron_log(text: str) -> tuple[list[LoggedStep], float | None]:
    """Megatron-LM's or NeMo's logged steps, and the largest `max allocated` (bytes) it printed."""
    steps, peak = [], None
    for line in text.splitlines():
        match = _MEGATRON.search(line)
        if match:
            batch = _field(line, r"global batch size:")
            steps.append(LoggedStep(int(match.group(1)), _float(match.group(2)) / 1e3, _field(line, r"lm loss:"),
                                    global_batch=int(batch) if batch else None))
            continue
        match = _NEMO.search(line)
        if match:
            batch = _field(line, r"global_batch_size:")
            steps.append(LoggedStep(int(match.group(1)), _float(match.group(2)),
                                    _field(line, r"reduced_train_loss:"), global_batch=int(batch) if batch else None))
            continue
        match = _MEGATRON_MEMORY.search(line)
        if match:
            peak = max(peak or 0.0, _float(match.group(2)) * MIB)
    return steps, peak


def read_torchtitan_log(text: str) -> tuple[list[LoggedStep], float | None]:
    steps, peak = [], None
    for line in text.splitlines():
        match = _TORCHTITAN.search(line)
        if match:
            steps.append(LoggedStep(int(match.group(1)), None, _float(match.group(2)),
                                    tokens_per_s_per_gpu=_float(match.group(4))))
            peak = max(peak or 0.0, _float(match.group(3)) * GIB)
    return steps, peak


def read_deepspeed_log(text: str) -> tuple[list[LoggedStep], float | None]:
    steps, peak = [], None
    for line in text.splitlines():
        match = _DEEPSPEED.search(line)
        if match:
            steps.append(LoggedStep(int(match.group(1)), _float(match.group(3)), _float(match.group(2))))
            continue
        match = _DEEPSPEED_TIMER.search(line)
        if match:
            steps.append(LoggedStep(int(match.group(1)), None, samples_per_s=_float(match.group(2))))
            peak = max(peak or 0.0, _float(match.group(3)) * GIB)
    return steps, peak


READERS = {"megatron": read_megatron_log, "torchtitan": read_torchtitan_log, "deepspeed": read_deepspeed_log}


def measurement_from_log(text: str, engine: str, facts: RunFacts, source: str = "") -> Measurement:
    """A Measurement of the run an engine's log describes (see the module docstring)."""
    if engine not in READERS:
        raise MeshplanError(f"unknown engine {engine!r}; choose one of {', '.join(READERS)}")
    logged, peak = READERS[engine](text)
    unique = list({step.step: step for step in reversed(logged)}.values())[::-1]  # each step once, first line
    if not unique:
        raise MeshplanError(f"{source or 'the log'}: no {engine} training step lines found; give the log of the "
                            "training run (rank 0's output), or the right --engine")
    tokens_per_step = _tokens_per_step(unique, facts)
    times = [_step_time_s(step, tokens_per_step, facts, engine) for step in unique]
    warmup = 1 if unique[0].step <= 1 and len(times) > 1 else 0  # step 1 pays the start-up; later lines do not
    timed = times[warmup:]
    losses = [step.loss for step in unique]
    memory = (peak,) + (0.0,) * (facts.gpus - 1) if peak else ()  # rank 0's: the others are not logged
    return Measurement(
        world_size=facts.gpus, plan_digest="", step_times_s=tuple(times), warmup_steps=warmup,
        peak_memory_bytes_per_rank=memory, losses=tuple(losses) if None not in losses else (),
        tokens_per_s=tokens_per_step / (sum(timed) / len(timed)) if tokens_per_step else 0.0,
        tokens_per_step=tokens_per_step or 0,
        memory_source=f"{engine} log: one rank's peak ({'max reserved' if engine == 'torchtitan' else 'max allocated'})"
        if peak else "", backend=f"{engine} log", source=source)


def _tokens_per_step(steps: list[LoggedStep], facts: RunFacts) -> int | None:
    batch = facts.global_batch or next((step.global_batch for step in steps if step.global_batch), None)
    return batch * facts.seq if batch and facts.seq else None


def _step_time_s(step: LoggedStep, tokens_per_step: int | None, facts: RunFacts, engine: str) -> float:
    if step.step_time_s is not None:
        return step.step_time_s
    if step.samples_per_s is not None and facts.global_batch:
        return facts.global_batch / step.samples_per_s
    if not tokens_per_step or step.tokens_per_s_per_gpu is None:
        raise MeshplanError(f"the {engine} log prints throughput, not step times: give the global batch and the "
                            "sequence length (--config FILE, or --gbs and --seq)")
    return tokens_per_step / (step.tokens_per_s_per_gpu * facts.gpus)
