"""Precision and activation checkpointing: tokens/s and memory of fp32 against bf16, without and with
recomputed blocks, side by side in one run.

Setup (and why):
- One process on this machine's device (CUDA when visible, else the CPU), one trainer per variant, each
  training through the trainer's own step (`Trainer.train_step`: autocast, the loss scale, AdamW, clipping),
  on synthetic tokens. Variants: train.precision in fp32 and bf16 (on a GPU also tf32 and fp16) times
  train.activation_checkpointing in none and block.
- Variants run round-robin each repetition (the order rotating) so background load hits all alike; the first
  `--warmup` repetitions are dropped; the median step time over the rest gives tokens/s, shown as a ratio to
  fp32 without checkpointing.
- Activation memory is measured where autograd keeps it, the same way on every device: the bytes of the
  distinct storages one training forward saves for backward (`gptpar.tensor_bytes.SavedBytes`, parameters
  left out). On CUDA the allocator's peak over a step (`torch.cuda.max_memory_allocated`) is shown too; a CPU
  has no allocator peak to read.

Run: .venv/bin/python bench/bench_precision.py   (see --help; `make bench-precision`)
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from gptpar.config import Config, load_config
from gptpar.models.loss import lm_loss
from gptpar.parallel.dims import ParallelDims
from gptpar.parallel.grid import grid_sizes
from gptpar.parallel.process_group import RankInfo
from gptpar.run.folder import run_folder
from gptpar.run.logfile import RankLogger
from gptpar.tensor_bytes import saved_activation_bytes
from gptpar.train.trainer import Trainer

MB = 2**20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="", help="model.preset (default: gpt2-mini on a CPU, gpt2 on a GPU)")
    ap.add_argument("--seq", type=int, default=0, help="tokens per sequence (default: 128 on a CPU, 1024 on a GPU)")
    ap.add_argument("--batch", type=int, default=8, help="sequences per step")
    ap.add_argument("--vocab", type=int, default=50257, help="synthetic vocabulary (GPT-2's by default)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads on a CPU")
    ap.add_argument("--warmup", type=int, default=2, help="repetitions dropped before measuring")
    ap.add_argument("--reps", type=int, default=6, help="measured repetitions (round-robin over variants)")
    ap.add_argument("--out", default="", help="also write the results as JSON here")
    return ap.parse_args(argv)


def variants(device: torch.device) -> list[tuple[str, str]]:
    precisions = ("fp32", "tf32", "bf16", "fp16") if device.type == "cuda" else ("fp32", "bf16")
    return [(p, c) for p in precisions for c in ("none", "block")]


def make_trainer(args: argparse.Namespace, info: RankInfo, runs: Path, precision: str, checkpointing: str) -> Trainer:
    cfg: Config = load_config(None, [
        f"model.preset={args.preset}", "data.source=synthetic", f"data.vocab_size={args.vocab}",
        f"data.seq_len={args.seq}", f"data.synthetic_tokens={args.seq * args.batch * 64}",
        f"train.batch_size={args.batch}", "train.warmup_steps=0", f"train.threads={args.threads}",
        f"train.precision={precision}", f"train.activation_checkpointing={checkpointing}",
        f"log.runs_dir={runs}", f"log.run_id={precision}-{checkpointing}", "log.progress=none"])
    grid = ParallelDims.build(info, grid_sizes(cfg))
    folder = run_folder(cfg.log.runs_dir, cfg.log.run_id)
    folder.path.mkdir(parents=True, exist_ok=True)
    return Trainer(cfg, grid, folder, RankLogger(folder.path, 0))


def forward_saved_bytes(trainer: Trainer) -> int:
    """Bytes one training forward (and its loss) saves for backward, under the variant's autocast."""
    x, y = next(trainer.batches(0, 0))[0]
    device = trainer.net.input_device

    def forward() -> torch.Tensor:
        with trainer.precision.autocast():
            return lm_loss(trainer.net(x.to(device)), y.to(device))

    return saved_activation_bytes(forward, trainer.net.parameters())


def timed_step(trainer: Trainer, batches, device: torch.device) -> tuple[float, int | None]:
    """(seconds, allocator peak bytes on CUDA) of one optimizer step."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    trainer.train_step(next(batches))
    trainer.step += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return time.perf_counter() - start, torch.cuda.max_memory_allocated(device)
    return time.perf_counter() - start, None


def measure(args: argparse.Namespace, device: torch.device) -> dict[str, dict[str, Any]]:
    info = RankInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, master_addr="", master_port=0,
                    launcher="single", backend="gloo", device=device)
    with tempfile.TemporaryDirectory() as tmp:
        runs = Path(tmp)
        trainers = {v: make_trainer(args, info, runs, *v) for v in variants(device)}
        rows = {v: {"saved_bytes": forward_saved_bytes(t), "times": [], "peaks": []} for v, t in trainers.items()}
        streams = {v: t.batches(0, 0) for v, t in trainers.items()}
        order = list(trainers)
        for rep in range(args.warmup + args.reps):
            for v in order[rep % len(order):] + order[:rep % len(order)]:
                seconds, peak = timed_step(trainers[v], streams[v], device)
                if rep >= args.warmup:
                    rows[v]["times"].append(seconds)
                    rows[v]["peaks"].append(peak)
    tokens = args.batch * args.seq
    return {f"{p}/{c}": {"precision": p, "checkpointing": c, "saved_bytes": r["saved_bytes"],
                         "tokens_per_s": tokens / statistics.median(r["times"]),
                         "peak_bytes": max(r["peaks"]) if r["peaks"][0] is not None else None}
            for (p, c), r in rows.items()}


def report(args: argparse.Namespace, device: torch.device, rows: dict[str, dict[str, Any]]) -> None:
    base = rows["fp32/none"]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu, {args.threads} threads"
    print(f"\n{args.preset}, {args.batch} x {args.seq} tokens per step, vocabulary {args.vocab}, on {name}; "
          f"median of {args.reps} steps after {args.warmup} warm-up")
    print("| precision | activation checkpointing | tokens/s | vs fp32 | saved activations (MB) | vs fp32 none "
          "| allocator peak (MB) |")
    print("|---|---|---|---|---|---|---|")
    for row in rows.values():
        peak = "n/a (CPU)" if row["peak_bytes"] is None else f"{row['peak_bytes'] / MB:,.0f}"
        print(f"| {row['precision']} | {row['checkpointing']} | {row['tokens_per_s']:,.0f} | "
              f"{row['tokens_per_s'] / base['tokens_per_s']:.2f}x | {row['saved_bytes'] / MB:,.1f} | "
              f"{row['saved_bytes'] / base['saved_bytes']:.2f}x | {peak} |")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    args.preset = args.preset or ("gpt2" if device.type == "cuda" else "gpt2-mini")
    args.seq = args.seq or (1024 if device.type == "cuda" else 128)
    rows = measure(args, device)
    report(args, device, rows)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
