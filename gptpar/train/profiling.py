"""torch.profiler over the optimizer steps `train.profile_steps` names, on every rank, as a Chrome trace
(`runs/<id>/trace/rank<R>.json`, viewable in Perfetto; `gptpar trace` analyses it).

The profiler starts before the first profiled step this start runs and is written when the last one
finishes, or when the run stops earlier (what was recorded so far). Each profiled step is one span,
`ProfilerStep#<step>` (torch's own name for a step), which is the window `gptpar trace` measures. A
restart inside the range profiles its remaining steps and replaces the file atomically; one past the
range writes nothing. With the option empty every hook returns at once.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from gptpar.atomic import atomic_write, write_error
from gptpar.config import TrainConfig, profiled_steps


class StepProfiler:
    """`begin(step)` before an optimizer step (1-based) and `end(step)` after it; `close()` when the loop
    ends, however it ends."""

    def __init__(self, train: TrainConfig, device: torch.device, path: Path):
        self.steps = profiled_steps(train)
        self.device, self.path = device, path
        self.profiler: profile | None = None
        self.step_span: record_function | None = None

    def begin(self, step: int) -> None:
        if self.steps is None or not self.steps[0] <= step <= self.steps[1]:
            return
        if self.profiler is None:
            cuda = [ProfilerActivity.CUDA] if self.device.type == "cuda" else []
            self.profiler = profile(activities=[ProfilerActivity.CPU, *cuda], record_shapes=False, with_stack=False)
            self.profiler.start()
        self.step_span = record_function(f"ProfilerStep#{step}")
        self.step_span.__enter__()

    def end(self, step: int) -> None:
        self._close_span()
        if self.steps is not None and step == self.steps[1]:
            self.close()

    def _close_span(self) -> None:
        if self.step_span is not None:
            self.step_span.__exit__(None, None, None)
            self.step_span = None

    def close(self) -> None:
        """Stop and write the trace, if one is being recorded."""
        if self.profiler is None:
            return
        self._close_span()  # a step cut short by an error closes its span
        profiler, self.profiler = self.profiler, None
        profiler.stop()
        with tempfile.TemporaryDirectory() as scratch:  # torch writes only to a path: atomic_write copies it
            raw = Path(scratch) / "trace.json"
            try:
                profiler.export_chrome_trace(str(raw))
            except OSError as exc:
                raise write_error(self.path, exc) from exc
            atomic_write(self.path, lambda f: f.write(raw.read_bytes()))
