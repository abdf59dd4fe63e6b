"""Pipeline parallelism vs model parallelism on two CPU stages, measured side by side in one run.

Setup (and why):
- Two stages on `cpu,cpu`; the process runs with `torch.set_num_threads(1)` so every op is
  single-threaded: each stage gets one core's worth of work, as if it were its own device. Model
  parallelism runs under the same per-op resources (the fair baseline), so on this 2-core box it
  keeps one core idle at any moment, exactly like one GPU idling while the other computes.
  For honesty a third reference row runs the plain model with 2 intra-op threads, i.e. the other
  way of spending both cores.
- `gpt2-wide` (4 blocks of width 768) with a 256-symbol vocabulary, so the blocks, not the LM head
  or Python overhead, dominate and the two stages are balanced (2 blocks each).
- "fwd" is the forward of a training step (autograd recording on), "fwd+bwd" adds lm_loss and
  backward (no optimizer step: it is identical in every mode). Pipe's backward is pipelined too:
  the calling thread runs the last stage's backward micro-batch by micro-batch and hands each
  boundary gradient to the first stage's worker, so the stages' backwards overlap like their
  forwards (model parallelism runs its whole backward in the calling thread).
- Modes are interleaved round-robin each repetition so background load hits all of them alike;
  warm-up repetitions are dropped and the median is reported.
- Bubble (forward only): idle share of each Pipe worker over the forward's span, from timestamps
  the workers take (`Pipe.stats`), averaged over workers; theory is (p-1)/(m+p-1). Ideal speedup
  over model parallelism is m*p/(m+p-1).
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable

import torch

from gptpar.config import ModelConfig, ParallelConfig
from gptpar.models.build import build_model
from gptpar.models.loss import lm_loss
from gptpar.parallel.pipeline.one_process.gpt2 import build_parallel_model

VOCAB = 256
STAGES = 2


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gpt2-wide")
    ap.add_argument("--batch", type=int, default=16, help="sequences per step")
    ap.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    ap.add_argument("--chunks", default="1,2,4,8", help="micro-batch counts to compare")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    return ap.parse_args()


class Variant:
    """One mode with its own copy of the model and its timings."""

    def __init__(self, label: str, mode: str, chunks: int, preset: str, threads: int) -> None:
        self.label, self.chunks, self.threads = label, chunks, threads
        model = build_model(ModelConfig(preset=preset), VOCAB, seed=0)
        devices = "cpu" if mode == "single" else ",".join(["cpu"] * STAGES)
        self.module = build_parallel_model(model, ParallelConfig(pp_mode=mode, devices=devices,
                                                                 chunks=chunks))
        self.times: dict[str, list[float]] = {"fwd": [], "fwd+bwd": []}
        self.bubbles: list[float] = []

    @property
    def pipe(self):
        return getattr(self.module, "runner", None) if self.module.mode == "pipeline_parallel" else None

    def run(self, kind: str, x: torch.Tensor, y: torch.Tensor, keep: bool) -> None:
        torch.set_num_threads(self.threads)
        step: Callable[[], object] = (lambda: self.module(x)) if kind == "fwd" else (
            lambda: lm_loss(self.module(x), y).backward())
        start = time.perf_counter()
        step()
        elapsed = time.perf_counter() - start
        self.module.zero_grad(set_to_none=True)
        if keep:
            self.times[kind].append(elapsed)
            if kind == "fwd" and self.pipe is not None:
                self.bubbles.append(statistics.fmean(self.pipe.stats.bubble))


def main() -> None:
    args = parse_args()
    chunk_counts = [int(c) for c in args.chunks.split(",")]
    print("command:", shlex.join([sys.executable, *sys.argv]))
    print(f"preset={args.preset} vocab={VOCAB} batch={args.batch} seq={args.seq} stages={STAGES} "
          f"warmup={args.warmup} reps={args.reps} (median)")
    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores "
          "(other processes share the cores the stages are meant to own)")
    variants = [Variant("model_parallel", "model_parallel", 1, args.preset, 1)]
    variants += [Variant("pipeline_parallel", "pipeline_parallel", m, args.preset, 1) for m in chunk_counts]
    variants.append(Variant("single (2 threads)", "single", 1, args.preset, 2))
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (args.batch, args.seq + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    for kind in ("fwd", "fwd+bwd"):
        for rep in range(args.warmup + args.reps):
            for v in variants:
                v.run(kind, x, y, keep=rep >= args.warmup)
    torch.set_num_threads(1)
    tokens_per_step = args.batch * args.seq
    for kind in ("fwd", "fwd+bwd"):
        base = tokens_per_step / statistics.median(variants[0].times[kind])
        print(f"\n[{kind}]")
        print(f"{'mode':<20}{'chunks':>7}{'tokens/s':>11}{'speedup':>9}{'ideal':>7}"
              f"{'bubble':>8}{'theory':>8}")
        for v in variants:
            rate = tokens_per_step / statistics.median(v.times[kind])
            m = v.chunks
            pipelined = v.pipe is not None
            ideal = f"{m * STAGES / (m + STAGES - 1):.2f}" if pipelined else "-"
            bubble = f"{statistics.median(v.bubbles):.2f}" if pipelined and kind == "fwd" else "-"
            theory = f"{(STAGES - 1) / (m + STAGES - 1):.2f}" if pipelined else "-"
            chunks = str(m) if pipelined else "-"
            print(f"{v.label:<20}{chunks:>7}{rate:>11.0f}{rate / base:>8.2f}x{ideal:>7}{bubble:>8}{theory:>8}")
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")
    for v in variants:
        if v.pipe is not None:
            v.pipe.close()


if __name__ == "__main__":
    main()
