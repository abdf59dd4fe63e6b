"""Step records without a host synchronisation inside the step (`log.sync_every`).

A GPU runs ahead of the Python that queues its work; reading a number back (`loss.item()`) makes the host wait
until the queue has drained, and the next step's kernels start only after the host has queued them again. So a
step keeps its loss, global loss and gradient norm on the device, its time as two CUDA events (the time between
them on the GPU's own clock, waits for the host included), and the records of `sync_every` steps are fetched
together: one transfer, one wait. On a CPU every operation has finished when it returns: the step is timed with
perf_counter and nothing is gained by waiting (the default there is 1). The JSONL still gets every step's record.

A step's own compute (`compute_s`: its time less the spans the rank was blocked in gptpar's communication,
gptpar.parallel.comm.WAITING) is read with the rest, and the fetched steps' are gathered on rank 0 in one small gather
(`rank_compute_s`, by rank): a slow rank shows there, where every rank's step time is the slowest one's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from gptpar.clock import DeviceClock
from gptpar.run.records import StepRecord

GPU_SYNC_EVERY = 10  # log.sync_every=0 on a GPU


def sync_every(setting: int, device: torch.device) -> int:
    """`log.sync_every` for this rank's device: 0 is 1 on a CPU, GPU_SYNC_EVERY on a GPU."""
    return setting or (GPU_SYNC_EVERY if device.type == "cuda" else 1)


@dataclass(frozen=True)
class OnDevice:
    """A record field the step computes on the device (a mixture's expert load), read with the step's other numbers
    at the fetch: `numbers` (1-D float64, on the step's device) become the field's value through `value`."""

    numbers: torch.Tensor
    value: Callable[[list[float]], Any]


@dataclass(frozen=True)
class Spans:
    """A record field of device time spans by kind (gptpar.parallel.comm.timed), summed at the fetch."""

    clocks: dict[str, list[DeviceClock]]

    def value(self) -> dict[str, float]:
        return {kind: math.fsum(c.seconds() for c in clocks) for kind, clocks in self.clocks.items()}


def read_now(fields: dict[str, Any]) -> dict[str, Any]:
    """`fields` with every OnDevice value read at once (a wait for the device): for code outside the loop's fetch."""
    return {name: f.value(f.numbers.tolist()) if isinstance(f, OnDevice) else f.value() if isinstance(f, Spans)
            else f for name, f in fields.items()}


@dataclass
class PendingStep:
    """A step whose numbers are not yet on the host: `values` (loss, global_loss, grad_norm) on the device, `clock`,
    and the record's other fields, known on the host already or OnDevice. `has_loss`: False on a pipeline stage that
    does not compute the loss (its record says null)."""

    values: torch.Tensor
    clock: DeviceClock
    fields: dict[str, Any]
    has_loss: bool = True
    waited: list[DeviceClock] = field(default_factory=list)  # the spans blocked in communication, for `compute_s`


Gather = Callable[[list[float]], list[list[float]] | None]  # every rank's floats on rank 0 by rank, else None


class PendingSteps:
    """The steps taken since the last fetch; `gather` collects their compute times from every rank (every rank
    fetches at the same steps: gptpar.parallel.comm.gather_to_first)."""

    def __init__(self, gather: Gather = lambda values: [values]) -> None:
        self.steps: list[PendingStep] = []
        self.gather = gather

    def add(self, step: PendingStep) -> None:
        self.steps.append(step)

    def fetch(self) -> list[StepRecord]:
        """Every pending step's record, their device numbers read in one transfer."""
        if not self.steps:
            return []
        deferred = [[(name, f) for name, f in step.fields.items() if isinstance(f, OnDevice)] for step in self.steps]
        numbers = torch.cat([torch.cat([step.values, *(f.numbers.to(step.values) for _, f in fields)])
                             for step, fields in zip(self.steps, deferred, strict=True)]).tolist()
        seconds = [step.clock.seconds() for step in self.steps]
        compute = [time - math.fsum(c.seconds() for c in step.waited) for step, time in zip(self.steps, seconds,
                                                                                               strict=True)]
        by_rank = self.gather(compute)
        records, at = [], 0
        for i, (step, fields) in enumerate(zip(self.steps, deferred, strict=True)):
            (loss, global_loss, grad_norm), at = numbers[at:at + 3], at + 3
            read = {}
            for name, numbered in fields:
                read[name], at = numbered.value(numbers[at:at + len(numbered.numbers)]), at + len(numbered.numbers)
            read |= {name: spans.value() for name, spans in step.fields.items() if isinstance(spans, Spans)}
            if by_rank is not None:
                read["rank_compute_s"] = [values[i] for values in by_rank]
            records.append(StepRecord(loss=loss if step.has_loss else None, global_loss=global_loss,
                                      grad_norm=grad_norm, step_time_s=seconds[i], compute_s=compute[i],
                                      tokens_per_s=step.fields["tokens"] / seconds[i], **(step.fields | read)))
        self.steps = []
        return records
