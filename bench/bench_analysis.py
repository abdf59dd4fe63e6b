"""Time `gptpar report` on 1,000 runs x 8 ranks x 1,000 steps (8M step records) in a temp dir.

The logs are written with string formatting (not RankLogger, whose fsync per record would make
generation take longer than the thing measured). Reading happens from the page cache, so this
measures parsing and aggregation, not the disk. Usage: python bench/bench_analysis.py [--runs N]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from analysis.report import report  # noqa: E402
from gptpar.config import Config  # noqa: E402

STEP = ('{{"kind": "step", "time": {t:.6f}, "step": {s}, "epoch": {e}, "loss": {loss:.6f}, "lr": 0.0006, '
        '"grad_norm": 0.987654, "tokens": 4096, "step_time_s": {dt:.6f}, "tokens_per_s": {rate:.4f}, '
        '"data_time_s": 0.001234, "peak_mem_bytes": 123456789}}\n')
EPOCH = ('{{"kind": "epoch", "time": {t:.6f}, "epoch": {e}, "training_time_s": {tt:.6f}, '
         '"tokens_per_s": {rate:.4f}, "val_loss": {loss:.6f}, "steps": {n}}}\n')


def write_run(run_dir: Path, index: int, ranks: int, steps: int, epochs: int) -> None:
    cfg = Config().to_dict()
    cfg["parallel"].update(dp=ranks, bucket_mb=[1.0, 5.0, 25.0, 100.0][index % 4])
    cfg["log"]["name"] = run_dir.name
    run_dir.mkdir(parents=True)
    per_epoch = steps // epochs
    for rank in range(ranks):
        header = {"kind": "header", "time": 1.7e9, "schema_version": 1, "run_id": run_dir.name, "config": cfg,
                  "rank": rank, "world_size": ranks, "coords": {"dp": rank, "pp": 0},
                  "sizes": {"dp": ranks, "pp": 1}, "restart": 0, "host": "node", "device": "cuda:0",
                  "device_name": "Tesla V100-SXM2-32GB", "torch_version": "2", "transformers_version": "5",
                  "git_commit": "abc", "slurm": {}, "start_time": 1.7e9}
        parts = [json.dumps(header) + "\n"]
        t = 1.7e9
        for s in range(1, steps + 1):
            dt = 0.1 + 0.001 * ((s * 7 + rank) % 13)
            t += dt
            e = (s - 1) // per_epoch + 1
            parts.append(STEP.format(t=t, s=s, e=e, loss=10.0 / (1 + 0.01 * s), dt=dt, rate=4096 / dt))
            if s % per_epoch == 0:
                parts.append(EPOCH.format(t=t, e=e, tt=per_epoch * 0.106, rate=4096 / 0.106, loss=3.0, n=per_epoch))
        parts.append(f'{{"kind": "final", "time": {t + 1:.6f}, "status": "completed", "step": {steps}}}\n')
        (run_dir / f"rank{rank}.jsonl").write_text("".join(parts))


def _cpu() -> float:
    """User + system CPU seconds of this process and its reaped workers: on a shared machine the
    wall time depends on the neighbours, the CPU time much less."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gptpar-bench-") as tmp:
        runs_dir = Path(tmp) / "runs"
        start = time.perf_counter()
        for i in range(args.runs):
            write_run(runs_dir / f"sweep{i % 10}" / f"run{i:04d}", i, args.ranks, args.steps, args.epochs)
        generated = time.perf_counter() - start
        size = sum(p.stat().st_size for p in runs_dir.rglob("*.jsonl"))
        records = args.runs * args.ranks * args.steps
        print(f"generated {args.runs} runs x {args.ranks} ranks x {args.steps} steps = {records:,} step records, "
              f"{size / 1e9:.2f} GB, in {generated:.1f} s")
        cpu0, start = _cpu(), time.perf_counter()
        result = report(runs_dir, Path(tmp) / "figures")
        elapsed, cpu = time.perf_counter() - start, _cpu() - cpu0
        assert sum(r.status == "completed" for r in result.runs) == args.runs
        cores = os.cpu_count() or 1
        print(f"report (read + aggregate + summary + {len(result.figures)} figures): {elapsed:.1f} s wall, "
              f"{cpu:.1f} s CPU over {cores} core(s) ({cpu / records * 1e6:.2f} us CPU per step record); "
              f"load average {os.getloadavg()[0]:.1f} (on an idle machine wall is about CPU / {cores})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
