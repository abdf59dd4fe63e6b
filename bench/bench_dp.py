"""Data-parallel benchmark: gradient-sync strategies side by side, all-reduce bandwidth, scaling.

Everything is measured in one run on the same machine so the printed ratios compare like with like:
- step time (each step's slowest rank), tokens/s and communication wait of naive, bucketed and ddp on `--world`
  gloo ranks, plus a `local` row (same ranks, no gradient sync) whose step time is the compute floor;
  "exposed comm" = strategy step time - local step time (the communication backward did not hide);
- all-reduce algorithm bandwidth (bytes / time) and bus bandwidth (algbw * 2(n-1)/n, as nccl-tests);
- scaling efficiency: tokens/s of W ranks / (W * tokens/s of 1 process) at the same per-rank batch; the one
  process runs on rank 0 while its peers wait, in the same round-robin as the modes.

Run: .venv/bin/python bench/bench_dp.py   (see --help; `make bench-dp`)
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from gptpar.config import ModelConfig, ParallelConfig
from gptpar.models.build import build_model, count_params
from gptpar.models.loss import lm_loss
from gptpar.parallel.data_parallel import GradSync, make_grad_sync
from gptpar.parallel.process_group import RankInfo
from gptpar.parallel.spawn import spawn_local

MODES = ("local", "naive", "bucketed", "ddp")
SINGLE = "one process"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gpt2-mini")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2, help="sequences per rank per step")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    ap.add_argument("--bucket-mb", type=float, default=4.0, help="bucket size of bucketed and ddp")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per mode and round")
    ap.add_argument("--rounds", type=int, default=8, help="modes run round-robin; the median is kept")
    ap.add_argument("--max-mb", type=int, default=64, help="largest all-reduce buffer")
    ap.add_argument("--out", default="", help="also write the results as JSON here")
    return ap.parse_args(argv)


def make_model(args: argparse.Namespace) -> torch.nn.Module:
    return build_model(ModelConfig(preset=args.preset), args.vocab, seed=0)


def timed_steps(sync: GradSync, opt: torch.optim.Optimizer, args: argparse.Namespace, n: int,
                communicate: bool, together: bool = True) -> list[tuple[float, float]]:
    """(seconds, finish() wait) of each of n training steps after one warm-up step.

    Ranks running `together` meet at a barrier before each step, so every rank times the same step and
    background load on this shared machine spoils single steps rather than whole runs.
    """
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)
    x, y = tokens[:, :-1], tokens[:, 1:]
    samples = []
    for _ in range(n + 1):
        if together:
            dist.barrier()
        start, wait0 = time.perf_counter(), sync.comm_wait_s or 0.0
        with sync.accumulating(is_last_micro_step=communicate):
            lm_loss(sync.module(x).logits, y).backward()
        if communicate:
            sync.finish()
        opt.step()
        sync.zero_grad()
        samples.append((time.perf_counter() - start, (sync.comm_wait_s or 0.0) - wait0))
    return samples[1:]


def allreduce_bandwidth(world: int, max_mb: int) -> list[dict[str, float]]:
    rows, size = [], 1024
    while size <= max_mb * 2**20:
        buf = torch.ones(size // 4)
        for _ in range(2):
            dist.all_reduce(buf)
        iters = max(3, min(200, int(2e8 // size)))  # ~200 MB moved per size keeps the sweep short
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(buf)
        seconds = (time.perf_counter() - start) / iters
        algbw = size / seconds / 1e9
        rows.append({"bytes": size, "time_us": seconds * 1e6, "algbw_GBps": algbw,
                     "busbw_GBps": algbw * 2 * (world - 1) / world})
        size *= 2
    return rows


def slowest_rank(samples: list[tuple[float, float]]) -> list[list[float]]:
    """Each step's (seconds, wait) on the rank that took longest: a step ends when its last rank does."""
    table = torch.tensor(samples, dtype=torch.float64)
    dist.all_reduce(table, op=dist.ReduceOp.MAX)
    return table.tolist()


def rank_main(info: RankInfo, args: argparse.Namespace, out: Path) -> None:
    """All strategies and the one-process baseline live side by side; rounds rotate their order so load drift
    hits each alike. The baseline runs on rank 0 alone while its peers wait at a barrier."""
    torch.set_num_threads(args.threads)
    runs = {}
    for mode in MODES:
        model = make_model(args)
        pcfg = ParallelConfig(dp=info.world_size, dp_sync="bucketed" if mode == "local" else mode,
                              bucket_mb=args.bucket_mb)
        runs[mode] = (make_grad_sync(model, pcfg, dist.group.WORLD), torch.optim.AdamW(model.parameters(), lr=1e-4))
    single = make_model(args)
    runs[SINGLE] = (GradSync(single), torch.optim.AdamW(single.parameters(), lr=1e-4))
    samples: dict[str, list[tuple[float, float]]] = {m: [] for m in runs}
    order = [*MODES, SINGLE]
    for r in range(args.rounds):
        for mode in order[r % len(order):] + order[:r % len(order)]:
            if mode == SINGLE:
                if info.rank == 0:
                    samples[mode] += timed_steps(*runs[mode], args, args.steps, communicate=True, together=False)
                dist.barrier()
            else:
                samples[mode] += timed_steps(*runs[mode], args, args.steps, communicate=mode != "local")
    slowest = {m: slowest_rank(samples[m]) for m in MODES}
    bandwidth = allreduce_bandwidth(info.world_size, args.max_mb)
    if info.rank == 0:
        medians = {m: [statistics.median(column) for column in zip(*slowest[m], strict=True)] for m in MODES}
        single_s = statistics.median(step for step, _ in samples[SINGLE])
        out.write_text(json.dumps({"modes": medians, "bandwidth": bandwidth, "single_step_s": single_s}))


def report(args: argparse.Namespace, res: dict, n_params: int) -> dict:
    single_s = res["single_step_s"]
    tokens = args.batch * args.seq
    modes = res["modes"]
    local = modes["local"][0]
    print(f"\n{args.preset}: {n_params / 1e6:.1f}M params ({n_params * 4 / 2**20:.0f} MB of fp32 "
          f"gradients), {args.world} gloo ranks x {args.threads} thread, {args.batch}x{args.seq} tokens "
          f"per rank, bucket {args.bucket_mb:g} MB, median step of {args.rounds} rounds x {args.steps} steps")
    print(f"{'mode':<10}{'step ms':>10}{'tok/s':>10}{'finish wait ms':>16}{'exposed comm ms':>17}"
          f"{'vs ddp':>8}{'vs naive':>10}")
    for mode in MODES:
        step, wait = modes[mode]
        shown_wait = "n/a" if mode == "ddp" else f"{wait * 1e3:.1f}"
        print(f"{mode:<10}{step * 1e3:>10.1f}{args.world * tokens / step:>10.0f}{shown_wait:>16}"
              f"{(step - local) * 1e3:>17.1f}{modes['ddp'][0] / step:>8.2f}x{modes['naive'][0] / step:>9.2f}x")
    print("(vs X = X's step time / this step time: above 1 means faster than X)")
    print(f"\nall-reduce, {args.world} ranks (gloo, float32):")
    print(f"{'bytes':>12}{'time us':>12}{'algbw GB/s':>12}{'busbw GB/s':>12}")
    for row in res["bandwidth"]:
        print(f"{row['bytes']:>12}{row['time_us']:>12.1f}{row['algbw_GBps']:>12.3f}{row['busbw_GBps']:>12.3f}")
    single_tps = tokens / single_s
    print(f"\nscaling: 1 process {single_s * 1e3:.1f} ms/step = {single_tps:.0f} tok/s")
    scaling = {}
    for mode in ("local", "naive", "bucketed", "ddp"):
        tps = args.world * tokens / modes[mode][0]
        scaling[mode] = tps / (args.world * single_tps)
        print(f"  {mode:<9} {args.world} ranks: {tps:>7.0f} tok/s, efficiency {scaling[mode]:.2f}")
    return {"scaling_efficiency": scaling, **res}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print("command:", shlex.join([sys.executable, *sys.argv]), flush=True)
    started = time.perf_counter()
    pcfg = ParallelConfig(dp=args.world, backend="gloo", timeout_s=300)
    with tempfile.TemporaryDirectory() as tmp:
        result_file = Path(tmp) / "rank0.json"
        spawn_local(rank_main, args.world, args, result_file, pcfg=pcfg)
        res = json.loads(result_file.read_text())
    full = report(args, res, count_params(make_model(args)))
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), **full}, indent=1))
    print(f"\ntotal {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
