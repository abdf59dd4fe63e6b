"""What rank 0 shows while training: a tqdm bar on a terminal, periodic plain lines otherwise (batch
logs); and the step's peak memory, which the step record logs."""

from __future__ import annotations

import resource
import sys

import torch

from gptpar.config import LogConfig


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class Progress:
    """Shows the job's numbers (the loss averaged over replicas, the job's tokens/s), on rank 0 only."""

    def __init__(self, log: LogConfig, rank: int, ranks: int, total: int, start: int):
        mode = log.progress
        if mode == "auto":
            mode = "bar" if sys.stderr.isatty() else "lines"
        self.mode = mode if rank == 0 else "none"
        self.every, self.total, self.ranks = log.every, total, ranks
        self.bar = None
        if self.mode == "bar":
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)

    def update(self, step: int, loss: float, job_tokens_per_s: float) -> None:
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{job_tokens_per_s:,.0f}", ranks=self.ranks)
        elif self.mode == "lines" and (step % self.every == 0 or step == self.total):
            print(f"step {step}/{self.total} loss {loss:.4f} {job_tokens_per_s:,.0f} tok/s "
                  f"({self.ranks} rank{'s' if self.ranks > 1 else ''})", flush=True)

    def message(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text)
        elif self.mode != "none":
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
