"""Sharded data parallelism: ddp, zero1, zero2, fsdp, fsdp2 and DeepSpeed's ZeRO-2/3 side by side, speed and per-rank
memory, in one run.

Setup (and why):
- `--world` (2) gloo ranks, each its own process (spawn_local) with `torch.set_num_threads(1)`: on this
  2-core box every rank owns one core, as if it were its own device.
- Every strategy trains through the trainer's own step (`Trainer.train_step`, the code `gptpar train`
  runs: AdamW, gradient clipping, the sync's before/after-step hooks), on synthetic tokens, one trainer
  (and model) per strategy, all alive in the same processes for the speed measurement.
- One step = forward+backward of `--batch` sequences per rank, gradient sync and the optimizer step.
  Ranks meet at a barrier before each step; a step's time is the slower rank's.
- Strategies run round-robin each repetition (the order rotating) so background load hits all of them
  alike; warm-up repetitions are dropped (the first step creates AdamW's state and the sharded strategies'
  buffers); medians are reported with the min-max spread over the kept repetitions. fsdp (ours) is compared
  with fsdp2 (torch's fully_shard on the same units) on throughput and accounted memory.
- Memory is *accounted*: `gptpar.train.memory.state_bytes` (the trainer's `memory` record, taken after the
  first optimizer step, before gradients are reset) counts the storages of parameters, gradients and
  optimizer state this rank holds. It is compared with the closed forms for N parameters, world size W,
  AdamW in fp32: ddp 16N; zero1 4N + 4N + 8N/W; zero2 4N + (4N + 8N)/W; fsdp 16N/W with each unit (each
  GPT-2 block, and the root unit of embeddings + final norm + tied LM head) padded to a multiple of W;
  fsdp2 about 16N/W (each parameter padded to a multiple of W rows); DeepSpeed (parallel.dp_sync=deepspeed, the
  `deepspeed` extra; a failed row if it is missing) at stage 2 and 3 the same plus the fp32 master copy of its
  partition (4N/W) it keeps even in fp32. DeepSpeed's collectives are its own, so gptpar's communication bytes do not
  count them; its rows are in the speed and memory tables, not in the budget table. fsdp's in-flight buffers (gathered
  unit parameters and flat unit gradients, at most 2 root + 4 block units at once) are not in that total:
  its record reports them apart, as `gathered_peak_bytes`. The other transients (ddp's reducer buckets,
  zero2's full gradients before the reduce-scatter, fsdp2's gathered units) and activations are not
  accounted. On CPU there is no allocator peak to read: the speed run's measured figure is each process's
  max RSS over all strategies' trainers together.
- Budget table, accounted too: for each fixed model shape (BUDGET_MODELS, gpt2-mini up to the 12-block
  gpt2) and each strategy, the ranks build that strategy's trainer on the shape (1 sequence of
  BUDGET_SEQ tokens per rank, so the step is cheap; `model.init_device=meta` for fsdp, so no rank ever
  materialises the whole model), run one training step and take the `memory` record's total
  (params + grads + optimizer bytes), then free the trainer before the next. Cells within `--budget-mb`
  are marked and the largest shape each strategy trains under the budget is printed. Alongside, measured:
  the growth of each process's peak RSS over building the trainer and its step (the peak reset before
  each build via /proc/self/clear_refs), which does include construction transients and in-flight
  buffers.

Run: .venv/bin/python bench/bench_fsdp.py   (see --help; `make bench-fsdp`)
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import re
import resource
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import GPT2LMHeadModel

from gptpar.config import Config, ModelConfig, ParallelConfig, load_config
from gptpar.models.build import model_config
from gptpar.parallel.data_parallel.fsdp2 import transformer_blocks
from gptpar.parallel.dims import ParallelDims
from gptpar.parallel.grid import grid_sizes
from gptpar.parallel.process_group import RankInfo
from gptpar.parallel.spawn import spawn_local
from gptpar.run.folder import run_folder
from gptpar.run.logfile import RankLogger
from gptpar.train.trainer import Trainer

STRATEGIES = ("ddp", "zero1", "zero2", "deepspeed-2", "fsdp2", "fsdp", "deepspeed-3")
BUDGET_STRATEGIES = ("ddp", "zero1", "zero2", "fsdp2", "fsdp")  # the budget table's (DeepSpeed's rows: speed only)
# A row's settings where its name is not a parallel.dp_sync: DeepSpeed's engine at a ZeRO stage (the deepspeed extra).
SETTINGS = {f"deepspeed-{stage}": ["parallel.dp_sync=deepspeed", f"parallel.zero_stage={stage}"] for stage in (2, 3)}
LABELS = {"ddp": "ddp (torch DDP)", "zero1": "zero1 (ours)", "zero2": "zero2 (ours)",
          "deepspeed-2": "DeepSpeed ZeRO-2", "fsdp2": "fsdp2 (torch fully_shard)", "fsdp": "fsdp (ours, ZeRO-3)",
          "deepspeed-3": "DeepSpeed ZeRO-3"}
CLOSED_FORMS = {"ddp": "16N", "zero1": "4N+4N+8N/W", "zero2": "4N+(4N+8N)/W", "fsdp2": "~16N/W", "fsdp": "16N/W",
                "deepspeed-2": "4N+(4N+4N+8N)/W", "deepspeed-3": "(8N+4N+8N)/W"}
# Ours, torch's and DeepSpeed's of one ZeRO stage, compared side by side: (stage, [ours, the references]).
SAME_STAGE = ((2, ["zero2", "deepspeed-2"]), (3, ["fsdp", "fsdp2", "deepspeed-3"]))
# Shapes of the budget table, smallest first: (label, preset, n_layer override); width-768 ones step by a block
# (~7M parameters).
BUDGET_MODELS = (("gpt2-mini", "gpt2-mini", 0), ("gpt2 1 block", "gpt2", 1), ("gpt2 2 blocks", "gpt2", 2),
                 ("gpt2 3 blocks", "gpt2", 3), ("gpt2-wide (4 blocks)", "gpt2-wide", 0),
                 ("gpt2 (12 blocks)", "gpt2", 0))
BUDGET_SEQ = 16  # tokens per sequence of the budget table's one step (1 sequence per rank)
MB = 2**20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gpt2-mini")
    ap.add_argument("--vocab", type=int, default=4096, help="synthetic vocabulary (also of the budget table)")
    ap.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    ap.add_argument("--world", type=int, default=2, help="gloo ranks (one thread each)")
    ap.add_argument("--warmup", type=int, default=2, help="repetitions dropped before measuring")
    ap.add_argument("--bucket-mb", type=float, default=ParallelConfig.bucket_mb,
                    help="parallel.bucket_mb (ddp's and zero1's gradient buckets)")
    ap.add_argument("--reps", type=int, default=10, help="measured repetitions (round-robin over strategies)")
    ap.add_argument("--budget-mb", type=float, default=256.0,
                    help="per-rank accounted-bytes budget of the table (at W=2 the default lets ddp, zero1, zero2 "
                         "and fsdp/fsdp2 each fit a larger shape than the one before)")
    ap.add_argument("--out", default="", help="also write the results as JSON here")
    return ap.parse_args(argv)


def make_config(args: argparse.Namespace, strategy: str, runs: Path, run_id: str, model: list[str], seq: int,
                batch: int) -> Config:
    """A validated config, so the benchmark cannot run a shape `gptpar train` would refuse."""
    return load_config(None, [
        *model, "data.source=synthetic", f"data.vocab_size={args.vocab}", f"data.seq_len={seq}",
        f"train.batch_size={batch * args.world}", "train.warmup_steps=0", "train.threads=1",
        f"parallel.dp={args.world}", *SETTINGS.get(strategy, [f"parallel.dp_sync={strategy}"]), "parallel.backend=gloo",
        f"parallel.bucket_mb={args.bucket_mb}", f"log.runs_dir={runs}", f"log.run_id={run_id}",
        "log.progress=none"])


class Run:
    """One strategy's trainer, its batch stream and its kept step times."""

    def __init__(self, strategy: str, cfg: Config | None, info: RankInfo, error: str | None = None) -> None:
        self.strategy = strategy
        self.times: list[float] = []
        self.error = error
        self.trainer: Trainer | None = None
        if cfg is None:
            return
        try:
            grid = ParallelDims.build(info, grid_sizes(cfg))
            folder = run_folder(cfg.log.runs_dir, cfg.log.run_id)
            folder.path.mkdir(parents=True, exist_ok=True)
            self.trainer = Trainer(cfg, grid, folder, RankLogger(folder.path, info.rank))
            self.batches = self.trainer.batches(0, 0)
        except Exception as exc:  # reported as a failed row, not a crash
            self.error = one_line(exc)

    def step(self) -> None:
        assert self.trainer is not None
        self.trainer.train_step(next(self.batches))
        self.trainer.step += 1


def built(info: RankInfo, args: argparse.Namespace, strategy: str, runs: Path, run_id: str, model: list[str],
          seq: int, batch: int) -> Run:
    """The strategy's Run on that shape, every rank agreeing on any error, so that all drop a failed one together."""
    try:
        cfg, error = make_config(args, strategy, runs, run_id, model, seq, batch), None
    except Exception as exc:
        cfg, error = None, one_line(exc)
    run = Run(strategy, cfg, info, error)
    run.error = agree_error(run.error)
    return run


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:200]


def agree_error(error: str | None) -> str | None:
    """The first rank's error as every rank sees it."""
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return next((f"rank {r}: {e}" for r, e in enumerate(errors) if e), None)


def timed(run: Run) -> tuple[float, str | None]:
    """Seconds of one step on the slower rank (both start together after a barrier), and any error."""
    dist.barrier()
    start, error = time.perf_counter(), None
    try:
        run.step()
    except Exception as exc:
        error = one_line(exc)
    elapsed = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item()), error


def max_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def status_mb(key: str) -> float:
    """A size from /proc/self/status: VmRSS (resident now) or VmHWM (peak resident since the last reset)."""
    found = re.search(rf"^{key}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    return int(found.group(1)) / 1024 if found else float("nan")


def release_memory() -> bool:
    """Free the last trainer's objects, give freed heap back to the OS and restart the peak RSS from now;
    False when the peak cannot be reset (then there is no per-trainer peak to report)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: RSS may keep some freed memory, growth then reads low
        pass
    try:
        Path("/proc/self/clear_refs").write_text("5")  # Linux: resets VmHWM to the current RSS
    except OSError:
        return False
    return True


def speed(info: RankInfo, args: argparse.Namespace, runs: Path) -> dict[str, Any]:
    """Every strategy lives side by side, so each repetition can visit all of them."""
    variants = [built(info, args, s, runs, f"bench-{s}", [f"model.preset={args.preset}"], args.seq, args.batch)
                for s in STRATEGIES]  # built in the same order on every rank: construction broadcasts the weights
    for rep in range(args.warmup + args.reps):
        shift = rep % len(variants)
        for run in variants[shift:] + variants[:shift]:
            if run.error:
                continue
            seconds, error = timed(run)
            run.error = agree_error(error)
            if not run.error and rep >= args.warmup:
                run.times.append(seconds)
    return {r.strategy: {"times": r.times, "error": r.error,
                         "memory": r.trainer.memory if r.trainer and not r.error else None} for r in variants}


def budget(info: RankInfo, args: argparse.Namespace, runs: Path) -> list[dict[str, Any]]:
    """Each shape x strategy: one trainer at a time, one step, its `memory` record and the peak RSS growth."""
    rows = []
    for label, preset, n_layer in BUDGET_MODELS:
        model = [f"model.preset={preset}", f"model.n_layer={n_layer}"]
        cells: dict[str, Any] = {}
        for s in BUDGET_STRATEGIES:
            init = ["model.init_device=meta"] if s == "fsdp" else []
            reset = release_memory()
            rss_before = status_mb("VmRSS")
            start = time.perf_counter()
            run = built(info, args, s, runs, f"budget-{preset}-{n_layer}-{s}", model + init, BUDGET_SEQ, 1)
            if not run.error:
                run.error = agree_error(timed(run)[1])
            memory = None if run.error or run.trainer is None else run.trainer.memory
            seconds = time.perf_counter() - start
            growth = status_mb("VmHWM") - rss_before if reset else None
            cells[s] = {"memory": memory, "error": run.error, "rss_growth_mb": growth, "seconds": seconds}
            del run  # the trainer (and its model) goes before the next is built
        rows.append({"label": label, "cells": cells})
    release_memory()
    return rows


def rank_main(info: RankInfo, args: argparse.Namespace, out: Path) -> None:
    torch.set_num_threads(1)
    rss_start = max_rss_mb()
    with tempfile.TemporaryDirectory() as tmp:
        rows = speed(info, args, Path(tmp))
        rss_speed = max_rss_mb()
        budget_started = time.perf_counter()
        table = budget(info, args, Path(tmp))
        mine = {"speed": rows, "budget": table, "rss_start_mb": rss_start, "rss_max_mb": rss_speed,
                "budget_s": time.perf_counter() - budget_started}
        per_rank: list[Any] = [None] * info.world_size
        dist.all_gather_object(per_rank, mine)
    if info.rank == 0:
        out.write_text(json.dumps({"ranks": per_rank}))


# --- closed forms -------------------------------------------------------------------------------------


def closed_form(strategy: str, n: int, w: int) -> tuple[float, float, float]:
    """Bytes per rank of (parameters, gradients, AdamW state) for N fp32 parameters over W ranks."""
    if strategy == "ddp":
        return 4 * n, 4 * n, 8 * n
    if strategy == "zero1":
        return 4 * n, 4 * n, 8 * n / w
    if strategy == "zero2":
        return 4 * n, 4 * n / w, 8 * n / w
    if strategy == "deepspeed-2":  # its fp32 master partition (4N/W) beside the whole parameters
        return 4 * n + 4 * n / w, 4 * n / w, 8 * n / w
    if strategy == "deepspeed-3":
        return 8 * n / w, 4 * n / w, 8 * n / w
    return 4 * n / w, 4 * n / w, 8 * n / w  # fsdp and fsdp2, padding aside


def bytes_per_param(strategy: str, w: int) -> float:
    return sum(closed_form(strategy, 1, w))


def unit_params(preset: str, n_layer: int, vocab: int) -> tuple[int, int]:
    """Parameters of fsdp's root unit (embeddings, final norm, tied head once) and of one block, counted on a
    model built on the meta device (no memory)."""
    with torch.device("meta"):
        model = GPT2LMHeadModel(model_config(ModelConfig(preset=preset, n_layer=n_layer), vocab))
    blocks = transformer_blocks(model)
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    root = sum(p.numel() for p in model.parameters() if id(p) not in in_blocks)
    return root, sum(p.numel() for p in blocks[0].parameters())


def padded(n: int, w: int) -> int:
    return -(-n // w) * w


# --- report -------------------------------------------------------------------------------------------


def spread(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def total_bytes(m: dict[str, int]) -> int:
    return m["params_bytes"] + m["grads_bytes"] + m["optimizer_bytes"]


def ratio_vs(rows: dict[str, Any], s: str, ref: str) -> tuple[float, bool]:
    """Throughput of s over ref (ref's median step time over s's), and whether the min-max ranges overlap."""
    med, lo, hi = spread(rows[s]["times"])
    r_med, r_lo, r_hi = spread(rows[ref]["times"])
    return r_med / med, lo <= r_hi and r_lo <= hi


def shown(ratio: tuple[float, bool]) -> str:
    return f"{ratio[0]:.2f}x{' (inside the noise)' if ratio[1] else ''}"


def measured(row: dict[str, Any]) -> bool:
    return bool(row and not row["error"] and row["times"])


def report_speed(args: argparse.Namespace, rows: dict[str, Any]) -> None:
    tokens = args.batch * args.seq * args.world
    print(f"\n{'strategy':<28}{'step ms':>9}{'min-max':>13}{'tokens/s':>10}{'min-max':>13}  vs ddp (tokens/s)")
    for s in STRATEGIES:
        row = rows[s]
        if not measured(row):
            print(f"{LABELS[s]:<28}{'FAILED':>9}  {row['error'] or 'no measured repetition'}")
            continue
        med, lo, hi = spread(row["times"])
        r_med, r_lo, r_hi = spread([tokens / t for t in row["times"]])
        vs = shown(ratio_vs(rows, s, "ddp")) if s != "ddp" and measured(rows["ddp"]) else "-"
        print(f"{LABELS[s]:<28}{med * 1e3:>9.1f}{f'{lo * 1e3:.0f}-{hi * 1e3:.0f}':>13}{r_med:>10.0f}"
              f"{f'{r_lo:.0f}-{r_hi:.0f}':>13}  {vs}")


def report_fsdp_vs_fsdp2(rows: dict[str, Any], ranks: list[dict[str, Any]]) -> None:
    if not (measured(rows["fsdp"]) and measured(rows["fsdp2"])):
        print("\nfsdp vs fsdp2: not compared (a strategy failed)")
        return
    ratio, noisy = ratio_vs(rows, "fsdp", "fsdp2")
    totals = {s: max(total_bytes(r["speed"][s]["memory"]) for r in ranks) for s in ("fsdp", "fsdp2")}
    mem_ratio = totals["fsdp"] / totals["fsdp2"]
    speed_verdict = ("met" if ratio >= 1.0 else "below 1.0x but inside the noise" if noisy else "NOT met")
    print(f"\nfsdp vs fsdp2: throughput fsdp/fsdp2 {shown((ratio, noisy))}; accounted total per rank fsdp/fsdp2 "
          f"{mem_ratio:.4f}x ({totals['fsdp'] / MB:.1f} vs {totals['fsdp2'] / MB:.1f} MB, the larger rank's)")
    print(f"  targets: throughput >= 1.0x of fsdp2: {speed_verdict}; accounted memory <= fsdp2's: "
          f"{'met' if mem_ratio <= 1.0 else 'NOT met'}")


def report_same_stage(rows: dict[str, Any], ranks: list[dict[str, Any]]) -> None:
    """Ours against torch's and DeepSpeed's at one ZeRO stage: throughput ratio and accounted bytes per rank (the
    larger rank's). DeepSpeed's collectives are its own: their bytes are not in gptpar's comm_bytes."""
    print("\nsame ZeRO stage, ours against the references (throughput ours/theirs; accounted MB per rank):")
    for stage, (ours, *refs) in SAME_STAGE:
        for ref in refs:
            if not (measured(rows[ours]) and measured(rows[ref])):
                print(f"  stage {stage}: {ours} vs {ref}: not compared ({rows[ref]['error'] or rows[ours]['error']})")
                continue
            mb = {s: max(total_bytes(r["speed"][s]["memory"]) for r in ranks) / MB for s in (ours, ref)}
            print(f"  stage {stage}: {ours} vs {ref}: {shown(ratio_vs(rows, ours, ref))}; "
                  f"{mb[ours]:.1f} vs {mb[ref]:.1f} MB")


def report_memory(args: argparse.Namespace, ranks: list[dict[str, Any]]) -> None:
    w = args.world
    print(f"\naccounted training state per rank, MB (after the first optimizer step; W={w}, AdamW fp32):")
    print(f"{'strategy':<28}{'rank':>5}{'params':>9}{'grads':>9}{'optim':>9}{'total':>9}   {'closed form':<15}"
          f"{'MB':>8}{'acct/closed':>12}{'vs ddp':>8}")
    ddp = ranks[0]["speed"]["ddp"]["memory"]
    for s in STRATEGIES:
        for r, rank in enumerate(ranks):
            m = rank["speed"][s]["memory"]
            if not m:
                print(f"{LABELS[s]:<28}{r:>5}{'FAILED':>9}")
                continue
            parts = (m["params_bytes"], m["grads_bytes"], m["optimizer_bytes"])
            closed = sum(closed_form(s, m["params"], w))
            vs = f"{sum(parts) / total_bytes(ddp):.2f}x" if ddp else "-"
            print(f"{LABELS[s]:<28}{r:>5}" + "".join(f"{b / MB:>9.1f}" for b in parts) + f"{sum(parts) / MB:>9.1f}   "
                  f"{CLOSED_FORMS[s]:<15}{closed / MB:>8.1f}{sum(parts) / closed:>12.4f}{vs:>8}")
    n = next((m["params"] for r in ranks for row in r["speed"].values() if (m := row["memory"])), None)
    if n:
        print(f"(N = {n:,} parameters, the tied LM head counted once; acct/closed above 1 is padding: zero1/zero2 "
              "pad the flat buffer to a multiple of W, fsdp each unit, fsdp2 each parameter to a multiple of W rows)")
    peaks = [r["speed"]["fsdp"]["memory"] for r in ranks]
    if all(peaks):
        root, block = unit_params(args.preset, 0, args.vocab)
        bound = 4 * (2 * padded(root, w) + 4 * padded(block, w))
        print("fsdp in flight, not in its total (gathered_peak_bytes: gathered unit parameters + flat unit gradients "
              "held at once): " + ", ".join(f"rank {r}: {m['gathered_peak_bytes'] / MB:.1f} MB"
                                            for r, m in enumerate(peaks))
              + f"; at most 2 root + 4 block units = {bound / MB:.1f} MB (root {4 * padded(root, w) / MB:.1f} MB, "
              f"block {4 * padded(block, w) / MB:.1f} MB)")
    print("(not accounted: ddp's reducer buckets, another 4N as gradient_as_bucket_view is off; zero2's full "
          "gradients until the reduce-scatter; fsdp2's gathered units in flight; activations)")
    rss = ", ".join(f"rank {r}: {x['rss_max_mb']:.0f} MB (at start {x['rss_start_mb']:.0f})"
                    for r, x in enumerate(ranks))
    print(f"measured: whole-process max RSS, every strategy's trainer together plus torch itself, not per strategy: "
          f"{rss}")


def report_budget(args: argparse.Namespace, ranks: list[dict[str, Any]]) -> None:
    w, limit = args.world, args.budget_mb * MB
    print(f"\nbudget {args.budget_mb:g} MB per rank, W={w}, vocab {args.vocab}: ACCOUNTED training state per rank "
          f"(the `memory` record after one step of 1x{BUDGET_SEQ} tokens per rank; the larger rank), MB, "
          "* = within the budget")
    print(f"{'model':<24}{'N':>12}" + "".join(f"{s:>10}" for s in BUDGET_STRATEGIES) + f"{'fsdp in flight':>16}")
    fits: dict[str, list[str]] = {s: [] for s in BUDGET_STRATEGIES}
    ratios: dict[str, list[float]] = {s: [] for s in BUDGET_STRATEGIES}
    for i, row in enumerate(ranks[0]["budget"]):
        label, cells, n = row["label"], [], None
        for s in BUDGET_STRATEGIES:
            mems = [r["budget"][i]["cells"][s]["memory"] for r in ranks]
            if not all(mems):
                cells.append("FAILED")
                continue
            n = mems[0]["params"]
            total = max(total_bytes(m) for m in mems)
            ratios[s].append(total / sum(closed_form(s, n, w)))
            if total <= limit:
                fits[s].append(label)
            cells.append(f"{total / MB:.1f}{'*' if total <= limit else ' '}")
        fsdp = [r["budget"][i]["cells"]["fsdp"]["memory"] for r in ranks]
        flight = f"{max(m['gathered_peak_bytes'] for m in fsdp) / MB:.1f}" if all(fsdp) else "-"
        print(f"{label:<24}{f'{n:,}' if n else '?':>12}" + "".join(f"{c:>10}" for c in cells) + f"{flight:>16}")
    print("measured: peak RSS growth per rank over building the trainer and its one step (construction included), "
          "MB, the larger rank:")
    for i, row in enumerate(ranks[0]["budget"]):
        growth = [[r["budget"][i]["cells"][s]["rss_growth_mb"] for r in ranks] for s in BUDGET_STRATEGIES]
        print(f"{row['label']:<24}{'':>12}" + "".join(f"{max(g):>10.0f}" if None not in g else f"{'-':>10}"
                                                        for g in growth))
    print("largest model trained under the budget (accounted), and the closed form's limit on N:")
    for s in BUDGET_STRATEGIES:
        span = f"{min(ratios[s]):.4f}-{max(ratios[s]):.4f}" if ratios[s] else "-"
        print(f"  {s:<6} {fits[s][-1] if fits[s] else 'none':<22} {CLOSED_FORMS[s]:<14} "
              f"{bytes_per_param(s, w):>5.1f} B/param -> N <= {limit / bytes_per_param(s, w) / 1e6:6.1f}M; "
              f"accounted/closed over the shapes {span}")
    seconds = max(r["budget_s"] for r in ranks)
    print(f"(fsdp builds on the meta device and materialises only its shards; fsdp2 and the others build the "
          f"whole model first; 'fsdp in flight' is its gathered_peak_bytes, not in the total; table built in "
          f"{seconds:.0f} s)")


def spawn_and_collect(rank_main: Callable[[RankInfo, argparse.Namespace, Path], None],
                      args: argparse.Namespace) -> list[Any]:
    """Runs `rank_main(info, args, out)` on `args.world` local gloo ranks (spawn_local) and returns the per-rank
    results rank 0 wrote to `out` as JSON (`{"ranks": [...]}`); shared with bench_tp."""
    pcfg = ParallelConfig(dp=args.world, backend="gloo", timeout_s=300)
    with tempfile.TemporaryDirectory() as tmp:
        result_file = Path(tmp) / "rank0.json"
        spawn_local(rank_main, args.world, args, result_file, pcfg=pcfg)
        return json.loads(result_file.read_text())["ranks"]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print("command:", shlex.join([sys.executable, *sys.argv]), flush=True)
    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores "
          "(other processes share the cores the ranks are meant to own)", flush=True)
    started = time.perf_counter()
    ranks = spawn_and_collect(rank_main, args)
    rows = ranks[0]["speed"]
    print(f"\n{args.preset} vocab={args.vocab}, {args.world} gloo ranks x 1 thread, {args.batch}x{args.seq} tokens "
          f"per rank per step, bucket {args.bucket_mb:g} MB, trainer's own step (AdamW, clip 1.0); "
          f"median of {args.reps} reps after {args.warmup} warm-up, strategies round-robin")
    report_speed(args, rows)
    report_fsdp_vs_fsdp2(rows, ranks)
    report_same_stage(rows, ranks)
    report_memory(args, ranks)
    report_budget(args, ranks)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "ranks": ranks}, indent=1))
    print(f"\nload average after: {os.getloadavg()[0]:.2f}; total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
