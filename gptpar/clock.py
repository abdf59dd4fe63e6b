"""A span of device time that never makes the host wait: CUDA events on a GPU (recording one never waits; reading
one does, so it is read where the step's numbers are fetched anyway), perf_counter elsewhere, where every call the
span covers has finished when the host leaves it (the CPU's collectives block)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


class DeviceClock:
    """Started when made; `stop` ends the span, `seconds` reads it. Off a GPU the span is read from `now` (seconds
    since any fixed point): perf_counter, or a clock a test moves by exact amounts."""

    def __init__(self, device: torch.device, now: Callable[[], float] = time.perf_counter) -> None:
        self.events = device.type == "cuda"
        if self.events:
            self.begin, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.begin.record()
        else:
            self.now = now
            self.start, self.elapsed = now(), 0.0

    def stop(self) -> None:
        if self.events:
            self.end.record()
        else:
            self.elapsed = self.now() - self.start

    def seconds(self) -> float:
        """The span's seconds (on a GPU, waits for its end event: call it when fetching)."""
        if not self.events:
            return self.elapsed
        self.end.synchronize()
        return self.begin.elapsed_time(self.end) / 1000.0
