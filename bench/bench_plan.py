"""The planner against real runs: calibrate this machine, predict each layout, train it, compare.

One run, one machine: `gptpar plan calibrate`'s measurement (2 gloo ranks x 1 thread, shapes around the model's),
then for each layout its prediction (gptpar.plan, through the config resolver `gptpar train` uses) and a short real
`gptpar train` of it (local ranks, synthetic data). Measured step time: each step's slowest rank, the median over
the steps after the warm-up (the typical step, which the planner predicts from the typical call of each piece; the
fastest step is shown beside it). The load column is the machine's 1-minute load average after each run (this machine is
shared: a load above its core count slows every step, the calibration's too, and not alike). Measured memory: the
`memory` record's training-state bytes (parameters, gradients, optimizer state) of the fullest rank, against the
strategy table's closed form the planner predicts; and, under the pipeline, the bytes autograd held at once
(`pp_peak_activation_bytes`) against the predicted activations. The last line is `step time error: median X%, worst
Y% over N layouts`.

Run: .venv/bin/python bench/bench_plan.py   (see --help; `make bench-plan`)
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gptpar.plan.commands import predict_config
from gptpar.plan.measure import Probes, calibrate
from gptpar.run.logfile import read_rank_log
from gptpar.user_defaults import resolve_config

BASE = ["model.preset=gpt2-mini", "data.source=synthetic", "data.vocab_size=4096", "data.seq_len=64",
        "train.batch_size=8", "train.eval_every=0", "train.threads=1", "train.warmup_steps=2", "log.progress=none",
        "launch.profile=local", "launch.cluster=local", "train.checkpoint_every=0"]
DP, PP = ["parallel.dp=2"], ["parallel.pp=2", "parallel.chunks=4"]
LAYOUTS: dict[str, list[str]] = {
    "single": [],
    "naive": [*DP, "parallel.dp_sync=naive"],
    "bucketed": [*DP, "parallel.dp_sync=bucketed", "parallel.bucket_mb=4"],
    "ddp": [*DP, "parallel.dp_sync=ddp", "parallel.bucket_mb=4"],
    "zero1": [*DP, "parallel.dp_sync=zero1", "parallel.bucket_mb=4"],
    "zero2": [*DP, "parallel.dp_sync=zero2", "parallel.bucket_mb=4"],
    "fsdp": [*DP, "parallel.dp_sync=fsdp"],
    "tp2": ["parallel.tp=2"],
    "tp2 SP": ["parallel.tp=2", "parallel.sequence_parallel=true"],
    "pp2 gpipe": [*PP, "parallel.pp_schedule=gpipe"],
    "pp2 1f1b": [*PP, "parallel.pp_schedule=1f1b"],
    "pp2 zb1p": [*PP, "parallel.pp_schedule=zb1p"],
    "pp2 interleaved": [*PP, "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual=2"],
    "dp2 zero2 accum2 ckpt": [*DP, "parallel.dp_sync=zero2", "train.grad_accum=2",
                              "train.activation_checkpointing=block"],
    "cp2 ring": ["parallel.cp=2"],
    "cp2 all_to_all": ["parallel.cp=2", "parallel.cp_impl=all_to_all"],
}
BENCH_PROBES = Probes(((128, 4), (256, 8)), ((1, 64), (2, 64), (4, 64), (8, 64)),
                  tuple(4 ** k * 1024 for k in range(1, 8)), (10**5, 10**6, 10**7), 4096, 21)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20, help="steps per run (the first --warmup are dropped)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--only", default="", help="comma-separated layout names (default: all)")
    ap.add_argument("--calibration", default="", help="reuse this calibration instead of measuring one")
    ap.add_argument("--out", default="", help="also write the results as JSON here")
    return ap.parse_args(argv)


def measured(run: Path, warmup: int) -> dict[str, float]:
    """The median and the fastest of the kept steps (each its slowest rank's time); the fullest rank's state and
    activation bytes."""
    logs = [read_rank_log(p) for p in sorted(run.glob("rank*.jsonl"))]
    steps = sorted(set.intersection(*(set(log.steps) for log in logs)))[warmup:]
    times = [max(log.steps[s]["step_time_s"] for log in logs) for s in steps]
    state = max(sum(log.memory[k] for k in ("params_bytes", "grads_bytes", "optimizer_bytes")) for log in logs
                if log.memory)
    peaks = [log.steps[s].get("pp_peak_activation_bytes") for log in logs for s in steps]
    return {"step_time_s": statistics.median(times), "fastest_step_s": min(times), "state_bytes": state,
            "activation_bytes": max(p for p in peaks if p is not None) if any(p is not None for p in peaks) else 0}


def train(words: list[str], root: Path, name: str) -> Path:
    cmd = [str(Path(sys.executable).with_name("gptpar")), "train", *words, f"log.runs_dir={root}",
           f"log.run_id={name}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise SystemExit(f"{name}: gptpar train failed: {done.stderr.strip().splitlines()[-1:]}")
    return root / name


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print("command:", shlex.join([sys.executable, *sys.argv]), flush=True)
    started = time.perf_counter()
    names = [n for n in LAYOUTS if not args.only or n in args.only.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        calib = args.calibration or str(Path(tmp) / "calibration.json")
        if not args.calibration:
            calibrate(calib, threads=1, probes=BENCH_PROBES)
            print(f"calibrated in {time.perf_counter() - started:.0f} s (load average {os.getloadavg()[0]:.1f} on "
                  f"{os.cpu_count()} cores)", flush=True)
        print(f"{'layout':<24}{'pred ms':>9}{'meas ms':>9}{'err':>8}{'fastest ms':>11}{'pred state MB':>15}"
              f"{'meas state MB':>15}{'err':>8}{'load':>6}{'pred act MB':>13}{'meas act MB':>13}", flush=True)
        for i, name in enumerate(names):
            words = [*BASE, *LAYOUTS[name], f"train.max_steps={args.steps}"]
            cfg = resolve_config(None, words, user=False)[0]
            _, _, pred = predict_config(cfg, calib)
            meas = measured(train(words, Path(tmp) / "runs", f"r{i}"), args.warmup)
            err = pred.step_time_s / meas["step_time_s"] - 1
            state = max(m["state"] for m in pred.memory_ranks)  # the fullest rank's, as measured
            activations = max(m["activations"] for m in pred.memory_ranks)
            mem_err = state / meas["state_bytes"] - 1
            act = meas["activation_bytes"]
            rows.append({"layout": name, "predicted": pred.to_dict(), "measured": meas, "step_error": err,
                         "state_error": mem_err})
            print(f"{name:<24}{pred.step_time_s * 1e3:>9.1f}{meas['step_time_s'] * 1e3:>9.1f}{err:>+8.1%}"
                  f"{meas['fastest_step_s'] * 1e3:>11.1f}"
                  f"{state / 1e6:>15.3f}{meas['state_bytes'] / 1e6:>15.3f}{mem_err:>+8.2%}"
                  f"{os.getloadavg()[0]:>6.1f}"
                  + (f"{activations / 1e6:>13.2f}{act / 1e6:>13.2f}" if act else ""), flush=True)
    errors = [abs(r["step_error"]) for r in rows]
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    print(f"\ntotal {time.perf_counter() - started:.0f} s")
    print(f"step time error: median {statistics.median(errors):.0%}, worst {max(errors):.0%} over {len(errors)} "
          "layouts")


if __name__ == "__main__":
    main()
