"""Multi-process pipeline: our engine's schedules vs torch.distributed.pipelining, measured in one run.

Setup (and why):
- P=2 stages, each its own process (spawn_local, gloo), each with `torch.set_num_threads(1)`: on this
  2-core box every stage owns one core's worth of compute, as if it were its own device.
- `gpt2-wide` (4 blocks of width 768) with a 256-symbol vocabulary, so the blocks, not the LM head or
  Python overhead, dominate; the split is our engine's (`parallel.balance=layers`: 2+2 blocks, and
  1+1+1+1 for the interleaved schedules with 2 stages per rank), and torch's stages are built from the
  very same `pipeline_stages` modules, so both sides run identical work per micro-batch.
- One step = forward+backward of one batch in `--chunks` micro-batches, no optimizer step (identical
  everywhere), gradients zeroed (set to None) after every step. Ranks meet at a barrier before each
  step; a step's time is the slower rank's.
- "no pipelining" is our engine with chunks=1 fed the same micro-batches as a list: each runs through a
  1-micro-batch schedule strictly after the previous one, so one stage always waits for the other.
- Gradient scale: our engine multiplies each micro-batch's loss by 1/m; torch's schedules keep the
  per-micro-batch mean loss and divide the gradients by m afterwards (`scale_grads=True`, one extra
  pass over the gradients). Both give the batch-mean gradient; only the timing matters here.
- torch has no single-stage ZB-H1 schedule: `ScheduleInterleavedZeroBubble` (2 stages per rank) is the
  closest, and it is NOT the same schedule as our zb1p (V=1); its ratio is shown for reference only.
- Every torch schedule gets its own process group (with a short timeout), so one that fails or hangs
  is reported as failed without stalling the others.
- Variants run round-robin each repetition (the order rotating) so background load hits all of them
  alike; warm-up repetitions are dropped (torch infers shapes in its first step); medians are reported
  with the min-max spread over the kept repetitions.
- Bubble: our engine's measured idle share of each rank's step window (`engine.stats.bubble`), the
  simulator's idle share of that rank's list with that rank's mean F/B/W durations, and the closed
  form for unit costs (F = B = W = 1).

Run: .venv/bin/python bench/bench_pp_dist.py   (see --help; `make bench-pp-dist`)
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import pipelining

from gptpar.config import Config, ParallelConfig, load_config
from gptpar.models.build import build_model
from gptpar.models.loss import lm_loss
from gptpar.parallel.dims import ParallelDims
from gptpar.parallel.grid import grid_sizes
from gptpar.parallel.pipeline.engine.executor import PipelineEngine
from gptpar.parallel.pipeline.engine.stages import pipeline_stages
from gptpar.parallel.process_group import RankInfo
from gptpar.parallel.spawn import spawn_local
from gptpar.strategies.pipeline import closed_form_bubble, peak_activations, schedule, simulate

VOCAB = 256
RANKS = 2
NO_PIPE = "no pipelining"
# (our schedule, V) and (torch schedule class, our schedule it implements or None, stages per rank)
OURS = (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb1p", 1))
TORCH = (("ScheduleGPipe", "gpipe", 1), ("Schedule1F1B", "1f1b", 1),
         ("ScheduleInterleaved1F1B", "interleaved_1f1b", 2), ("ScheduleInterleavedZeroBubble", None, 2))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gpt2-wide")
    ap.add_argument("--batch", type=int, default=16, help="sequences per step")
    ap.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    ap.add_argument("--chunks", type=int, default=8, help="micro-batches per step")
    ap.add_argument("--warmup", type=int, default=1, help="repetitions dropped before measuring")
    ap.add_argument("--reps", type=int, default=5, help="measured repetitions (round-robin over variants)")
    ap.add_argument("--torch-timeout", type=float, default=60.0,
                    help="seconds before a hung torch schedule is reported as failed")
    return ap.parse_args(argv)


def batch_tensors(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    """The same batch on every rank (a fixed generator seed), as the engine requires."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (args.batch, args.seq + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def engine_config(args: argparse.Namespace, name: str, virtual: int, chunks: int, batch: int) -> Config:
    """A validated config, so the benchmark cannot run a pipeline shape `gptpar train` would refuse."""
    return load_config(None, [f"model.preset={args.preset}", f"parallel.pp={RANKS}", f"parallel.chunks={chunks}",
                              f"parallel.pp_schedule={name}", f"parallel.pp_virtual={virtual}",
                              f"train.batch_size={batch}", f"data.seq_len={args.seq}", "parallel.backend=gloo"])


def torch_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """torch's loss_fn: a micro-batch's mean loss (torch then divides the gradients by m itself)."""
    return lm_loss(logits, target)


class Ours:
    """One of our engine's schedules (or the no-pipelining baseline) with its own model and per-rep stats."""

    def __init__(self, label: str, name: str, virtual: int, args: argparse.Namespace, grid: ParallelDims,
                 x: torch.Tensor, y: torch.Tensor) -> None:
        self.label, self.name, self.virtual = label, name, virtual
        sequential = label == NO_PIPE
        self.chunks = 1 if sequential else args.chunks
        cfg = engine_config(args, name, virtual, self.chunks, args.batch // args.chunks if sequential else args.batch)
        self.engine = PipelineEngine(build_model(cfg.model, VOCAB, seed=0), cfg, grid, torch.device("cpu"), lm_loss)
        self.batches = list(zip(x.chunk(args.chunks), y.chunk(args.chunks), strict=True)) if sequential else [(x, y)]
        self.error: str | None = None
        self.times: list[float] = []
        self.bubbles: list[float] = []
        self.kind_sum = {"F": 0.0, "B": 0.0, "W": 0.0}
        self.kind_n = {"F": 0, "B": 0, "W": 0}
        self.peak_bytes = 0

    def step(self) -> None:
        self.engine.train_step(self.batches)
        self.engine.zero_grad(set_to_none=True)

    def record(self) -> None:
        s = self.engine.stats
        self.bubbles.append(s.bubble if s.bubble is not None else float("nan"))
        for kind, _, _, start, end in s.spans:
            self.kind_sum[kind] += end - start
            self.kind_n[kind] += 1
        self.peak_bytes = max(self.peak_bytes, s.peak_activation_bytes)

    def rank_stats(self) -> dict[str, Any]:
        means = {k: self.kind_sum[k] / self.kind_n[k] if self.kind_n[k] else 0.0 for k in self.kind_sum}
        return {"bubble": statistics.median(self.bubbles) if self.bubbles else None, "mean_s": means,
                "peak_bytes": self.peak_bytes, "split": self.engine.blocks_per_stage}


class Torch:
    """One torch.distributed.pipelining schedule on the same split, in its own process group."""

    def __init__(self, label: str, virtual: int, sizes: list[int], args: argparse.Namespace,
                 x: torch.Tensor, y: torch.Tensor) -> None:
        self.label, self.x, self.y = label, x, y
        self.error: str | None = None
        self.times: list[float] = []
        rank = dist.get_rank()
        # Created on every rank in the same order, even when the schedule then fails to build.
        group = dist.new_group([0, 1], timeout=timedelta(seconds=args.torch_timeout))
        try:
            model = build_model(load_config(None, [f"model.preset={args.preset}"]).model, VOCAB, seed=0)
            ids = [rank + k * RANKS for k in range(virtual)]
            self.modules = pipeline_stages(model, ids, sizes)
            stages = [pipelining.PipelineStage(m.train(), s, len(sizes), torch.device("cpu"), group=group)
                      for m, s in zip(self.modules, ids, strict=True)]
            cls = getattr(pipelining, label)
            self.schedule = cls(stages[0] if virtual == 1 else stages, args.chunks, loss_fn=torch_loss)
            self.first = any(m.is_first for m in self.modules)
            self.last = any(m.is_last for m in self.modules)
        except Exception as exc:  # reported as a failed row, not a crash
            self.error = one_line(exc)

    def step(self) -> None:
        inputs = (self.x,) if self.first else ()
        self.schedule.step(*inputs, target=self.y if self.last else None, return_outputs=False)
        for m in self.modules:
            m.zero_grad(set_to_none=True)


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:200]


def agree_error(error: str | None) -> str | None:
    """Every rank's error, agreed on by all (so that all drop a failed variant together). When one rank
    fails, its peer then times out waiting for it: the error that is not a timeout is the one worth naming."""
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    named = [f"rank {r}: {e}" for r, e in enumerate(errors) if e]
    first_hand = [e for e in named if not any(w in e.lower() for w in ("timed out", "connection closed"))]
    return (first_hand or named or [None])[0]


def timed(step: Callable[[], None]) -> tuple[float, str | None]:
    """Seconds of one step on the slower rank (both start together after a barrier), and any error."""
    dist.barrier()
    start, error = time.perf_counter(), None
    try:
        step()
    except Exception as exc:
        error = one_line(exc)
    elapsed = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item()), error


def rank_main(info: RankInfo, args: argparse.Namespace, out: Path) -> None:
    """Every variant lives side by side for the whole run, so each repetition can visit all of them."""
    torch.set_num_threads(1)
    x, y = batch_tensors(args)
    grid = ParallelDims.build(info, grid_sizes(engine_config(args, "1f1b", 1, args.chunks, args.batch)))
    ours = [Ours(NO_PIPE, "gpipe", 1, args, grid, x, y)]
    ours += [Ours(name, name, v, args, grid, x, y) for name, v in OURS]
    split = {o.virtual: o.engine.blocks_per_stage for o in ours}
    theirs = [Torch(label, v, split[v], args, x, y) for label, _, v in TORCH]
    variants: list[Ours | Torch] = [*ours, *theirs]
    for t in theirs:
        t.error = agree_error(t.error)
    for rep in range(args.warmup + args.reps):
        shift = rep % len(variants)
        for v in variants[shift:] + variants[:shift]:
            if v.error:
                continue
            seconds, error = timed(v.step)
            v.error = agree_error(error)
            if v.error:
                continue
            if rep >= args.warmup:
                v.times.append(seconds)
                if isinstance(v, Ours):
                    v.record()
    per_rank = [None] * info.world_size
    dist.all_gather_object(per_rank, {o.label: o.rank_stats() for o in ours})
    if info.rank == 0:
        rows = {v.label: {"times": v.times, "error": v.error} for v in variants}
        out.write_text(json.dumps({"rows": rows, "ranks": per_rank}))


# --- report -------------------------------------------------------------------------------------------


def spread(rates: list[float]) -> tuple[float, float, float]:
    return statistics.median(rates), min(rates), max(rates)


def ratio(a: list[float], b: list[float]) -> str:
    """median(a) / median(b), marked when the min-max spreads overlap (the difference is within noise)."""
    (ma, lo_a, hi_a), (mb, lo_b, hi_b) = spread(a), spread(b)
    noise = " (inside the noise)" if lo_a <= hi_b and lo_b <= hi_a else ""
    return f"{ma / mb:.2f}x{noise}"


def simulated_idle(name: str, virtual: int, chunks: int, rank: int, mean_s: dict[str, float]) -> float:
    """The simulator's idle share of this rank with this rank's measured mean durations."""
    plan = schedule(name, RANKS, chunks, virtual)
    if name == "zb1p":
        return simulate(plan, mean_s["F"], mean_s["B"], mean_s["W"]).idle[rank]
    return simulate(plan, mean_s["F"], mean_s["B"], 0.0).idle[rank]


def contention(ranks: list[dict[str, Any]]) -> float | None:
    """Mean F+B of a micro-batch under 1f1b over the same without pipelining (same micro-batch, same stage)."""
    def fb(label: str) -> float:
        return statistics.fmean(r[label]["mean_s"]["F"] + r[label]["mean_s"]["B"] for r in ranks)

    try:
        ours, alone = fb("1f1b"), fb(NO_PIPE)
    except KeyError:
        return None
    return ours / alone if ours > 0 and alone > 0 else None


def row_name(label: str, chunks: int) -> str:
    if label == NO_PIPE:
        return f"{NO_PIPE} (ours, {chunks} x 1-micro-batch)"
    if label in dict(OURS):
        return f"ours {label}"
    return f"torch {label}" + (" (V=2, NOT zb1p)" if label == "ScheduleInterleavedZeroBubble" else "")


def report(args: argparse.Namespace, res: dict[str, Any]) -> None:
    tokens = args.batch * args.seq
    rows, ranks = res["rows"], res["ranks"]
    rates = {label: [tokens / t for t in row["times"]] for label, row in rows.items() if row["times"]}
    base = rates.get(NO_PIPE)
    print(f"\n{args.preset} vocab={VOCAB}, {RANKS} stages = {RANKS} gloo processes x 1 thread, batch {args.batch}x"
          f"{args.seq} tokens in {args.chunks} micro-batches; split {ranks[0]['1f1b']['split']} (V=1), "
          f"{ranks[0]['interleaved_1f1b']['split']} (V=2); median of {args.reps} reps after {args.warmup} warm-up")
    print(f"\n{'row':<54}{'tokens/s':>10}{'min-max':>14}  vs no pipelining")
    labels = [NO_PIPE, *(n for n, _ in OURS), *(t for t, _, _ in TORCH)]
    for label in labels:
        shown = row_name(label, args.chunks)
        if rows[label]["error"] or label not in rates:
            print(f"{shown:<54}{'FAILED':>10}  {rows[label]['error'] or 'no measured repetition'}")
            continue
        med, lo, hi = spread(rates[label])
        vs = ratio(rates[label], base) if base and label != NO_PIPE else "-"
        print(f"{shown:<54}{med:>10.0f}{f'{lo:.0f}-{hi:.0f}':>14}  {vs}")

    print("\nours / torch, same schedule:")
    same: dict[str, str] = {}
    for t_label, ours_name, _ in TORCH:
        name = ours_name or "zb1p"
        if name not in rates or t_label not in rates:
            same[name] = f"n/a ({t_label} failed)" if name in rates else "n/a (ours failed)"
        else:
            same[name] = ratio(rates[name], rates[t_label])
        note = "" if ours_name else "   <- NOT the same schedule: torch has no V=1 ZB-H1; for reference only"
        print(f"  {name:<18} vs {t_label:<31} {same[name]}{note}")

    print("\nbubble per rank: measured (median) | simulated with the rank's mean F/B/W | closed form (unit costs)")
    print(f"{'schedule':<34}{'rank':>5}{'measured':>10}{'simulated':>11}{'closed':>8}{'F ms':>8}{'B ms':>8}"
          f"{'W ms':>8}")
    bubble: dict[str, float] = {}
    for label, name, virtual, chunks in [(NO_PIPE, "gpipe", 1, 1), *((n, n, v, args.chunks) for n, v in OURS)]:
        if label not in rates:
            continue
        measured = []
        for r in range(RANKS):
            st = ranks[r][label]
            m = st["mean_s"]
            shown = f"{NO_PIPE} ({args.chunks} x m=1)" if label == NO_PIPE else f"{name} V={virtual}"
            print(f"{shown:<34}{r:>5}{st['bubble']:>10.3f}{simulated_idle(name, virtual, chunks, r, m):>11.3f}"
                  f"{closed_form_bubble(name, RANKS, chunks, virtual):>8.3f}{m['F'] * 1e3:>8.1f}{m['B'] * 1e3:>8.1f}"
                  f"{m['W'] * 1e3:>8.1f}")
            measured.append(st["bubble"])
        bubble[label] = statistics.fmean(measured)
    print("(B is the whole backward except for zb1p, which splits it into B (input grads) and W (weight grads))")
    slowdown = contention(ranks)
    if slowdown is not None:
        print(f"contention: a micro-batch's F+B takes {slowdown:.2f}x as long under 1f1b (both stages computing at "
              "once) as without pipelining (one at a time); above ~1.1 the stages do not each get a free core, "
              "which caps any pipeline's speedup")

    print("\npeak activation memory per stage rank, MB (micro-batches held at once, from the schedule's lists)")
    peak: dict[str, list[float]] = {}
    for name, virtual in OURS:
        if name not in rates:
            continue
        lists = schedule(name, RANKS, args.chunks, virtual)
        peak[name] = [ranks[r][name]["peak_bytes"] / 2**20 for r in range(RANKS)]
        cells = "".join(f"   rank {r}: {peak[name][r]:7.1f} ({peak_activations(lists[r])} mb)" for r in range(RANKS))
        print(f"  {name:<18}{cells}")

    print("\ntargets:")
    for name, _ in OURS:
        if name == "zb1p":
            print(f"  zb1p >= 1.0x torch's same schedule: n/a, torch has no single-stage ZB-H1 "
                  f"(vs ScheduleInterleavedZeroBubble, a different schedule: {same['zb1p']})")
            continue
        t_label = next(t for t, n, _ in TORCH if n == name)
        if name in rates and t_label in rates:
            r = statistics.median(rates[name]) / statistics.median(rates[t_label])
            verdict = "holds" if r >= 1.0 else "NOT met"
            print(f"  {name} >= 1.0x {t_label}: {same[name]} -> {verdict}")
        else:
            print(f"  {name} >= 1.0x {t_label}: cannot tell ({same[name]})")
    if "1f1b" in rates and base:
        r = statistics.median(rates["1f1b"]) / statistics.median(base)
        print(f"  1f1b >= 1.5x no pipelining at m={args.chunks}: {ratio(rates['1f1b'], base)} -> "
              f"{'holds' if r >= 1.5 else 'NOT met'}")
    if "1f1b" in peak and "gpipe" in peak:
        below = all(a < b for a, b in zip(peak["1f1b"], peak["gpipe"], strict=True))
        pairs = ", ".join(f"rank {r} {a:.1f} vs {b:.1f} MB" for r, (a, b) in enumerate(zip(peak["1f1b"], peak["gpipe"],
                                                                                          strict=True)))
        print(f"  1f1b peak activation memory below gpipe's on every rank: {pairs} -> "
              f"{'holds' if below else 'NOT met'}")
    if "zb1p" in bubble and "1f1b" in bubble:
        print(f"  zb1p measured bubble below 1f1b's (mean over ranks): {bubble['zb1p']:.3f} vs {bubble['1f1b']:.3f} "
              f"-> {'holds' if bubble['zb1p'] < bubble['1f1b'] else 'NOT met'}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print("command:", shlex.join([sys.executable, *sys.argv]), flush=True)
    if args.batch % args.chunks or args.chunks % RANKS:
        sys.exit(f"--batch={args.batch} must divide by --chunks={args.chunks}, which must divide by {RANKS}")
    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores "
          "(other processes share the cores the stages are meant to own)", flush=True)
    started = time.perf_counter()
    pcfg = ParallelConfig(dp=RANKS, backend="gloo", timeout_s=300)
    with tempfile.TemporaryDirectory() as tmp:
        result_file = Path(tmp) / "rank0.json"
        spawn_local(rank_main, RANKS, args, result_file, pcfg=pcfg)
        res = json.loads(result_file.read_text())
    report(args, res)
    print(f"\nload average after: {os.getloadavg()[0]:.2f}; total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
