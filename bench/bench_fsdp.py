"""Sharded data parallelism: ddp, zero1, zero2 and fsdp2 side by side, speed and per-rank memory, in one run.

Setup (and why):
- `--world` (2) gloo ranks, each its own process (spawn_local) with `torch.set_num_threads(1)`: on this
  2-core box every rank owns one core, as if it were its own device.
- Every strategy trains through the trainer's own step (`Trainer._train_step`, the code `gptpar train`
  runs: AdamW, gradient clipping, the sync's before/after-step hooks), on synthetic tokens, one trainer
  (and model) per strategy, all alive in the same processes for the whole run.
- One step = forward+backward of `--batch` sequences per rank, gradient sync and the optimizer step.
  Ranks meet at a barrier before each step; a step's time is the slower rank's.
- Strategies run round-robin each repetition (the order rotating) so background load hits all of them
  alike; warm-up repetitions are dropped (the first step creates AdamW's state and fsdp2's buffers);
  medians are reported with the min-max spread over the kept repetitions.
- Memory is *accounted*, not measured: `gptpar.train.memory.state_bytes` (the trainer's `memory` record,
  taken after the first optimizer step, before gradients are reset) counts the storages of parameters,
  gradients and optimizer state this rank holds. It is compared with the closed forms for N parameters,
  world size W, AdamW in fp32: ddp 16N; zero1 4N + 4N + 8N/W; zero2 4N + (4N + 8N)/W; fsdp2 about 16N/W
  (each parameter padded to a multiple of W rows). Transient buffers (ddp's reducer buckets, zero2's full
  gradients before the reduce-scatter, fsdp2's gathered unit) and activations are not in it; on CPU
  there is no allocator peak to read, so the only measured figure is each process's max RSS, which
  covers all strategies' trainers together.
- Budget table: for a few fixed model shapes (N counted from models built on the meta device, never
  trained), the closed-form bytes per rank of each strategy against `--budget-mb`, and the largest
  model each strategy can hold under it.
- Our own ZeRO-3 (`parallel.dp_sync=fsdp`) is run when the config accepts it, else listed as not built.

Run: .venv/bin/python bench/bench_fsdp.py   (see --help; `make bench-fsdp`)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import GPT2LMHeadModel

from gptpar.config import Config, ModelConfig, ParallelConfig, grid_sizes, load_config
from gptpar.model import gpt2_config
from gptpar.parallel.grid import RankGrid
from gptpar.parallel.process_group import RankInfo
from gptpar.parallel.spawn import spawn_local
from gptpar.run.folder import run_folder
from gptpar.run.logfile import RankLogger
from gptpar.train.trainer import Trainer

STRATEGIES = ("ddp", "zero1", "zero2", "fsdp2", "fsdp")
LABELS = {"ddp": "ddp (torch DDP)", "zero1": "zero1 (ours)", "zero2": "zero2 (ours)",
          "fsdp2": "fsdp2 (torch fully_shard)", "fsdp": "fsdp (ours, ZeRO-3)"}
CLOSED_FORMS = {"ddp": "16N", "zero1": "4N+4N+8N/W", "zero2": "4N+(4N+8N)/W", "fsdp2": "~16N/W", "fsdp": "16N/W"}
# Shapes of the budget table: (label, preset, n_layer override); width-768 ones step by a block (~7M parameters).
BUDGET_MODELS = (("gpt2-mini", "gpt2-mini", 0), ("gpt2 1 block", "gpt2", 1), ("gpt2 2 blocks", "gpt2", 2),
                 ("gpt2 3 blocks", "gpt2", 3), ("gpt2-wide (4 blocks)", "gpt2-wide", 0),
                 ("gpt2 (12 blocks)", "gpt2", 0))
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
    ap.add_argument("--budget-mb", type=float, default=300.0, help="per-rank accounted-bytes budget of the table")
    ap.add_argument("--out", default="", help="also write the results as JSON here")
    return ap.parse_args(argv)


def built_strategies() -> list[str]:
    """The strategies parallel.dp_sync accepts today (ours, fsdp, may not be built yet)."""
    field = next(f for f in dataclasses.fields(ParallelConfig) if f.name == "dp_sync")
    return [s for s in STRATEGIES if s in field.metadata["choices"]]


def strategy_config(args: argparse.Namespace, strategy: str, runs: Path) -> Config:
    """A validated config, so the benchmark cannot run a shape `gptpar train` would refuse."""
    return load_config(None, [
        f"model.preset={args.preset}", "data.source=synthetic", f"data.vocab_size={args.vocab}",
        f"data.seq_len={args.seq}", f"train.batch_size={args.batch * args.world}", "train.warmup_steps=0",
        "train.threads=1", f"parallel.dp={args.world}", f"parallel.dp_sync={strategy}", "parallel.backend=gloo",
        f"parallel.bucket_mb={args.bucket_mb}", f"log.runs_dir={runs}", f"log.run_id=bench-{strategy}",
        "log.progress=none"])


class Run:
    """One strategy's trainer, its batch stream and its kept step times."""

    def __init__(self, strategy: str, args: argparse.Namespace, info: RankInfo, runs: Path) -> None:
        self.strategy = strategy
        self.times: list[float] = []
        self.error: str | None = None
        try:
            cfg = strategy_config(args, strategy, runs)
            grid = RankGrid(grid_sizes(cfg), info.rank, info.world_size, info.device.type)
            folder = run_folder(cfg.log.runs_dir, cfg.log.run_id)
            folder.path.mkdir(parents=True, exist_ok=True)
            self.trainer = Trainer(cfg, info, grid, folder, RankLogger(folder.path, info.rank))
            self.batches = self.trainer._batches(0, 0)
        except Exception as exc:  # reported as a failed row, not a crash
            self.error = one_line(exc)

    def step(self) -> None:
        self.trainer._train_step(next(self.batches))
        self.trainer.step += 1


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:200]


def agree_error(error: str | None) -> str | None:
    """The first rank's error as every rank sees it, so that all drop a failed strategy together."""
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


def rank_main(info: RankInfo, args: argparse.Namespace, strategies: list[str], out: Path) -> None:
    """Every strategy lives side by side for the whole run, so each repetition can visit all of them."""
    torch.set_num_threads(1)
    rss_start = max_rss_mb()
    with tempfile.TemporaryDirectory() as runs:
        variants = []
        for s in strategies:  # built in the same order on every rank: construction broadcasts the weights
            run = Run(s, args, info, Path(runs))
            run.error = agree_error(run.error)
            variants.append(run)
        for rep in range(args.warmup + args.reps):
            shift = rep % len(variants)
            for run in variants[shift:] + variants[:shift]:
                if run.error:
                    continue
                seconds, error = timed(run)
                run.error = agree_error(error)
                if not run.error and rep >= args.warmup:
                    run.times.append(seconds)
        mine = {"memory": {r.strategy: None if r.error else r.trainer.memory for r in variants},
                "rss_start_mb": rss_start, "rss_max_mb": max_rss_mb()}
        per_rank: list[Any] = [None] * info.world_size
        dist.all_gather_object(per_rank, mine)
    if info.rank == 0:
        rows = {r.strategy: {"times": r.times, "error": r.error} for r in variants}
        out.write_text(json.dumps({"rows": rows, "ranks": per_rank}))


# --- closed forms and the budget table ----------------------------------------------------------------


def closed_form(strategy: str, n: int, w: int) -> tuple[float, float, float]:
    """Bytes per rank of (parameters, gradients, AdamW state) for N fp32 parameters over W ranks."""
    if strategy == "ddp":
        return 4 * n, 4 * n, 8 * n
    if strategy == "zero1":
        return 4 * n, 4 * n, 8 * n / w
    if strategy == "zero2":
        return 4 * n, 4 * n / w, 8 * n / w
    return 4 * n / w, 4 * n / w, 8 * n / w  # fsdp2 (padding aside) and ZeRO-3


def bytes_per_param(strategy: str, w: int) -> float:
    return sum(closed_form(strategy, 1, w))


def meta_params(preset: str, n_layer: int, vocab: int) -> int:
    """N of a shape without allocating it: the model built on the meta device (tied matrix counted once)."""
    with torch.device("meta"):
        model = GPT2LMHeadModel(gpt2_config(ModelConfig(preset=preset, n_layer=n_layer), vocab))
    return sum(p.numel() for p in model.parameters())


# --- report -------------------------------------------------------------------------------------------


def spread(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def report_speed(args: argparse.Namespace, rows: dict[str, Any]) -> None:
    tokens = args.batch * args.seq * args.world
    ddp = rows.get("ddp", {}).get("times")
    print(f"\n{'strategy':<28}{'step ms':>9}{'min-max':>13}{'tokens/s':>10}{'min-max':>13}  vs ddp (tokens/s)")
    for s in STRATEGIES:
        if s not in rows:
            print(f"{LABELS[s]:<28}{'not built':>9}  (parallel.dp_sync={s} is not a choice yet)")
            continue
        row = rows[s]
        if row["error"] or not row["times"]:
            print(f"{LABELS[s]:<28}{'FAILED':>9}  {row['error'] or 'no measured repetition'}")
            continue
        med, lo, hi = spread(row["times"])
        rate = [tokens / t for t in row["times"]]
        r_med, r_lo, r_hi = spread(rate)
        vs = "-"
        if ddp and s != "ddp":
            d_med, d_lo, d_hi = spread(ddp)
            noise = " (inside the noise)" if lo <= d_hi and d_lo <= hi else ""
            vs = f"{d_med / med:.2f}x{noise}"
        print(f"{LABELS[s]:<28}{med * 1e3:>9.1f}{f'{lo * 1e3:.0f}-{hi * 1e3:.0f}':>13}{r_med:>10.0f}"
              f"{f'{r_lo:.0f}-{r_hi:.0f}':>13}  {vs}")


def report_memory(args: argparse.Namespace, rows: dict[str, Any], ranks: list[dict[str, Any]]) -> None:
    w = args.world
    print(f"\naccounted training state per rank, MB (after the first optimizer step; W={w}, AdamW fp32):")
    print(f"{'strategy':<28}{'rank':>5}{'params':>9}{'grads':>9}{'optim':>9}{'total':>9}   {'closed form':<15}"
          f"{'MB':>8}{'acct/closed':>12}{'vs ddp':>8}")
    ddp_total = None
    for s in STRATEGIES:
        if s not in rows:
            n_any = next((m["params"] for r in ranks for m in r["memory"].values() if m), None)
            closed = f"{sum(closed_form(s, n_any, w)) / MB:.1f}" if n_any else "?"
            print(f"{LABELS[s]:<28}{'':>5}{'not built':>9}{'':>27}   {CLOSED_FORMS[s]:<15}{closed:>8}")
            continue
        for r, rank in enumerate(ranks):
            m = rank["memory"].get(s)
            if not m:
                print(f"{LABELS[s]:<28}{r:>5}{'FAILED':>9}")
                continue
            parts = (m["params_bytes"], m["grads_bytes"], m["optimizer_bytes"])
            total = sum(parts)
            closed = sum(closed_form(s, m["params"], w))
            if s == "ddp" and r == 0:
                ddp_total = total
            vs = f"{total / ddp_total:.2f}x" if ddp_total else "-"
            print(f"{LABELS[s]:<28}{r:>5}" + "".join(f"{b / MB:>9.1f}" for b in parts) + f"{total / MB:>9.1f}   "
                  f"{CLOSED_FORMS[s]:<15}{closed / MB:>8.1f}{total / closed:>12.4f}{vs:>8}")
    n = next((m["params"] for r in ranks for m in r["memory"].values() if m), None)
    if n:
        print(f"(N = {n:,} parameters, the tied LM head counted once; acct/closed above 1 is padding: zero1/zero2 "
              "pad the flat buffer to a multiple of W, fsdp2 each parameter to a multiple of W rows)")
    print("(not accounted: ddp's reducer buckets, another 4N as gradient_as_bucket_view is off; zero2's full "
          "gradients until the reduce-scatter; fsdp2's gathered block in flight; activations)")
    rss = ", ".join(f"rank {r}: {x['rss_max_mb']:.0f} MB (at start {x['rss_start_mb']:.0f})"
                    for r, x in enumerate(ranks))
    print(f"measured: whole-process max RSS, every strategy's trainer together plus torch itself, not per strategy: "
          f"{rss}")


def report_budget(args: argparse.Namespace, strategies: list[str]) -> None:
    w, budget = args.world, args.budget_mb * MB
    shown = [s for s in STRATEGIES if s in strategies or s == "fsdp"]
    print(f"\nbudget {args.budget_mb:g} MB per rank, W={w}, vocab {args.vocab}: CLOSED-FORM bytes per rank "
          "(not measured; padding ignored), MB, * = fits")
    print(f"{'model':<24}{'N':>12}" + "".join(f"{s:>12}" for s in shown))
    models = [(label, meta_params(preset, layers, args.vocab)) for label, preset, layers in BUDGET_MODELS]
    for label, n in models:
        cells = []
        for s in shown:
            b = sum(closed_form(s, n, w))
            cells.append(f"{b / MB:.0f}{'*' if b <= budget else ' '}")
        print(f"{label:<24}{n:>12,}" + "".join(f"{c:>12}" for c in cells))
    print("largest listed model that fits, and the largest N the closed form allows:")
    for s in shown:
        fits = [label for label, n in models if sum(closed_form(s, n, w)) <= budget]
        largest = fits[-1] if fits else "none"
        note = "  (not built yet: what ZeRO-3 would hold)" if s not in strategies else ""
        print(f"  {s:<8} {CLOSED_FORMS[s]:<14} {bytes_per_param(s, w):>5.1f} B/param -> N <= "
              f"{budget / bytes_per_param(s, w) / 1e6:6.1f}M, largest listed: {largest}{note}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print("command:", shlex.join([sys.executable, *sys.argv]), flush=True)
    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores "
          "(other processes share the cores the ranks are meant to own)", flush=True)
    started = time.perf_counter()
    strategies = built_strategies()
    pcfg = ParallelConfig(dp=args.world, backend="gloo", timeout_s=120)
    with tempfile.TemporaryDirectory() as tmp:
        result_file = Path(tmp) / "rank0.json"
        spawn_local(rank_main, args.world, args, strategies, result_file, pcfg=pcfg)
        res = json.loads(result_file.read_text())
    print(f"\n{args.preset} vocab={args.vocab}, {args.world} gloo ranks x 1 thread, {args.batch}x{args.seq} tokens "
          f"per rank per step, bucket {args.bucket_mb:g} MB, trainer's own step (AdamW, clip 1.0); "
          f"median of {args.reps} reps after {args.warmup} warm-up, strategies round-robin")
    report_speed(args, res["rows"])
    report_memory(args, res["rows"], res["ranks"])
    report_budget(args, strategies)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), **res}, indent=1))
    print(f"\nload average after: {os.getloadavg()[0]:.2f}; total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
