"""Context parallelism (parallel.cp) on 2 and 4 gloo ranks against one process, ring beside all_to_all, in one run;
then the longest sequence a per-rank attention budget holds at cp = 1, 2 and 4.

Setup (and why):
- Every layout trains through the trainer's own step (`Trainer.train_step`: AdamW, clipping, the sync over the
  dp x cp replicas) on the same global batch of `--rows` sequences of `--seq` synthetic tokens: one process whole,
  and cp = 2 and cp = 4 (`parallel.cp=W` on W ranks, each holding seq / W of every row) with each implementation.
  Each world is one spawn (spawn_local) of processes with one thread each; its two implementations' trainers live
  side by side and run round-robin (the order rotating each repetition) so background load hits both alike. Ranks
  meet at a barrier before each step; a step's time is its slowest rank's; the median over `--reps` after
  `--warmup` is shown with the min-max spread. On a 2-core machine 4 ranks share 2 cores: cp = 4's times say what
  that costs, not what 4 devices would do.
- Bytes per step on one rank (the step record's `comm_bytes`: the ring's send_recv, the all-to-alls) and the
  memory record's `attention_bytes` (what attention kept for backward in the first micro-batch, counted by autograd's
  saved-tensor hooks) are shown beside their closed forms (gptpar.strategies.context_parallel).
- The budget table is the closed form `attention_bytes` solved for the sequence: the longest seq_len whose attention
  activations on one rank (`--rows` sequences, the model's layers, heads and head size, fp32) fit `--budget-mb`,
  a multiple of what each implementation splits it into (2 cp chunks for the ring, cp for all_to_all).

Run: .venv/bin/python bench/bench_cp.py   (see --help; `make bench-cp`)
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
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gptpar.config import Config, ParallelConfig, load_config
from gptpar.parallel.comm import new_step, read_sent
from gptpar.parallel.dims import ParallelDims
from gptpar.parallel.grid import grid_sizes
from gptpar.parallel.process_group import RankInfo
from gptpar.parallel.spawn import spawn_local
from gptpar.run.folder import run_folder
from gptpar.run.logfile import RankLogger
from gptpar.strategies.context_parallel import AttentionShape, attention_bytes, longest_sequence, sent_bytes
from gptpar.train.trainer import Trainer

IMPLS = ("ring", "all_to_all")
MB = 2**20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gpt2-tiny")
    ap.add_argument("--seq", type=int, default=256, help="tokens per sequence (a multiple of 8 for the ring at cp=4)")
    ap.add_argument("--rows", type=int, default=4, help="sequences per step (every cp rank reads all of them)")
    ap.add_argument("--vocab", type=int, default=4096, help="synthetic vocabulary")
    ap.add_argument("--worlds", default="2,4", help="cp sizes, each on that many gloo ranks")
    ap.add_argument("--warmup", type=int, default=2, help="repetitions dropped before measuring")
    ap.add_argument("--reps", type=int, default=8, help="measured repetitions")
    ap.add_argument("--budget-mb", type=float, default=64.0, help="per-rank attention activation budget (MiB)")
    ap.add_argument("--out", default="", help="also write the results as JSON here")
    return ap.parse_args(argv)


def make_config(args: argparse.Namespace, cp: int, impl: str, runs: Path) -> Config:
    """A validated config, so the benchmark cannot run a layout `gptpar train` would refuse."""
    return load_config(None, [
        f"model.preset={args.preset}", "data.source=synthetic", f"data.vocab_size={args.vocab}",
        f"data.seq_len={args.seq}", f"train.batch_size={args.rows}", "train.warmup_steps=0", "train.threads=1",
        f"parallel.cp={cp}", f"parallel.cp_impl={impl}", "parallel.backend=gloo", f"log.runs_dir={runs}",
        f"log.run_id=cp{cp}-{impl}", "log.progress=none"])


class Run:
    """One layout's trainer, its batch stream, its kept step times and its first step's bytes sent."""

    def __init__(self, cfg: Config, info: RankInfo) -> None:
        folder = run_folder(cfg.log.runs_dir, cfg.log.run_id)
        folder.path.mkdir(parents=True, exist_ok=True)
        self.trainer = Trainer(cfg, ParallelDims.build(info, grid_sizes(cfg)), folder,
                               RankLogger(folder.path, info.rank))
        self.batches = self.trainer.batches(0, 0)
        self.times: list[float] = []
        self.sent: dict[str, int] | None = None

    def timed(self) -> float:
        """Seconds of one step on the slowest rank (all start together after a barrier; one process has no group)."""
        grouped = dist.is_initialized()
        if grouped:
            dist.barrier()
        new_step()
        start = time.perf_counter()
        self.trainer.train_step(next(self.batches))
        self.trainer.step += 1
        elapsed = torch.tensor([time.perf_counter() - start])
        sent = read_sent()
        self.sent = self.sent if self.sent is not None else sent
        if grouped:
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return float(elapsed.item())


def rank_main(info: RankInfo, args: argparse.Namespace, impls: tuple[str, ...], out: Path) -> None:
    """This world's layouts, round-robin; rank 0 writes every rank's times, bytes and memory record."""
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        runs = [Run(make_config(args, info.world_size, impl, Path(tmp)), info) for impl in impls]
        for rep in range(args.warmup + args.reps):
            shift = rep % len(runs)
            for run in runs[shift:] + runs[:shift]:
                seconds = run.timed()
                if rep >= args.warmup:
                    run.times.append(seconds)
    mine = {impl: {"times": r.times, "sent": r.sent, "memory": r.trainer.memory} for impl, r in zip(impls, runs,
                                                                                                      strict=True)}
    everyone: list[Any] = [mine] * info.world_size
    if dist.is_initialized():
        dist.all_gather_object(everyone, mine)
    if info.rank == 0:
        out.write_text(json.dumps(everyone))


def measured(args: argparse.Namespace, world: int, impls: tuple[str, ...]) -> list[dict[str, Any]]:
    """Each rank's results of `world` ranks running `impls` (one spawn)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ranks.json"
        spawn_local(rank_main, world, args, impls, out,
                    pcfg=ParallelConfig(dp=world, backend="gloo", timeout_s=300))
        return json.loads(out.read_text())


def attention_shape(args: argparse.Namespace, seq: int) -> AttentionShape:
    shape = load_config(None, [f"model.preset={args.preset}"]).model.shape()
    return AttentionShape(shape.n_layer, shape.n_head, shape.kv_heads, shape.head_dim, args.rows, seq)


def report_speed(args: argparse.Namespace, rows: dict[str, list[dict[str, Any]]]) -> None:
    one = statistics.median(rows["one process"][0]["ring"]["times"])
    a = attention_shape(args, args.seq)
    print(f"{'layout':<20}{'step ms':>9}{'(min-max)':>15}{'vs one':>8}{'tokens/s':>10}"
          f"{'sent MB/step':>14}{'closed form':>13}{'attention MB':>14}{'closed form':>13}")
    for label, ranks in rows.items():
        for impl in ranks[0]:
            times = ranks[0][impl]["times"]
            step = statistics.median(times)
            cp = len(ranks)
            name = label if cp == 1 else f"cp={cp} {impl}"
            sent = sum(max(r[impl]["sent"].get(op, 0) for r in ranks) for op in ("send_recv", "all_to_all"))
            saved = {r[impl]["memory"].get("attention_bytes") for r in ranks}
            shown = "n/a" if None in saved else "/".join(f"{s / MB:.2f}" for s in sorted(saved))
            print(f"{name:<20}{step * 1e3:>9.1f}{f'({min(times) * 1e3:.0f}-{max(times) * 1e3:.0f})':>15}"
                  f"{one / step:>7.2f}x{args.rows * args.seq / step:>10,.0f}{sent / MB:>14.2f}"
                  f"{sum(sent_bytes(impl, cp, a).values()) / MB:>13.2f}{shown:>14}"
                  f"{attention_bytes(impl, cp, a) / MB:>13.2f}")


def report_budget(args: argparse.Namespace) -> None:
    a = attention_shape(args, 0)
    print(f"\nlongest seq_len whose attention activations fit {args.budget_mb:g} MiB per rank ({args.preset}: "
          f"{a.layers} layers, {a.heads} heads of {a.head_dim}, {args.rows} rows, fp32; the closed form):")
    print(f"{'cp':>4}" + "".join(f"{impl:>14}" for impl in IMPLS))
    for cp in (1, 2, 4):
        print(f"{cp:>4}" + "".join(f"{longest_sequence(args.budget_mb * MB, impl, cp, a):>14,}" for impl in IMPLS))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print("command:", shlex.join([sys.executable, *sys.argv]), flush=True)
    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores", flush=True)
    started = time.perf_counter()
    rows = {"one process": measured(args, 1, ("ring",))}  # cp=1: plain attention, cp_impl unused
    for world in (int(w) for w in args.worlds.split(",")):
        rows[f"cp={world}"] = measured(args, world, IMPLS)
    print(f"\n{args.preset} vocab={args.vocab}, {args.rows}x{args.seq} tokens per step on every layout, gloo ranks x 1 "
          f"thread, trainer's own step (AdamW); median of {args.reps} reps after {args.warmup} warm-up; sent and "
          "attention bytes per rank (all ranks alike)")
    report_speed(args, rows)
    report_budget(args)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    print(f"\nload average after: {os.getloadavg()[0]:.2f}; total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
