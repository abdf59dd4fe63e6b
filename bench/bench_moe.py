"""Mixture of experts: how the router's load-balancing loss keeps the experts' load even, side by side in one run.

Setup (and why):
- One process on this machine's device (CUDA when visible, else the CPU), one trainer per variant, each training
  through the trainer's own step (`Trainer.train_step`: the load-balancing loss over the routing statistics, AdamW,
  clipping) on the same text (data.source=stdlib, bytes), from the same initial weights and batches. Variants:
  model.moe_aux_loss_coef in 0 (the loss only logged), 0.01 (the default) and 0.1.
- Every step logs the load-balancing loss (top-k when balanced) and the busiest expert's tokens over the mean
  (1: balanced), over all layers; the table gives their mean over the last quarter of the steps, the LM loss there
  (the training loss less the weighted auxiliary term) and the tokens/s of the run after its first 5 steps.
- Not measured here: expert parallelism (parallel.ep, issue 30's all-to-all), which gptpar does not build yet.

Run: .venv/bin/python bench/bench_moe.py   (see --help; `make bench-moe`)
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from gptpar.config import load_config
from gptpar.parallel.dims import ParallelDims
from gptpar.parallel.grid import grid_sizes
from gptpar.parallel.process_group import RankInfo
from gptpar.run.folder import run_folder
from gptpar.run.logfile import RankLogger
from gptpar.train.step_records import read_now
from gptpar.train.trainer import Trainer

COEFS = (0.0, 0.01, 0.1)
WARMUP_STEPS = 5  # left out of tokens/s


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen2-moe-tiny", help="a mixture-of-experts model.preset")
    ap.add_argument("--steps", type=int, default=100, help="optimizer steps per variant (more than 5)")
    ap.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    ap.add_argument("--batch", type=int, default=16, help="sequences per step")
    ap.add_argument("--threads", type=int, default=2, help="torch threads on a CPU")
    ap.add_argument("--out", default="", help="also write the results as JSON here")
    return ap.parse_args(argv)


def make_trainer(args: argparse.Namespace, info: RankInfo, runs: Path, coef: float) -> Trainer:
    cfg = load_config(None, [
        f"model.preset={args.preset}", f"model.moe_aux_loss_coef={coef}", "data.tokenizer=bytes",
        f"data.seq_len={args.seq}", f"train.batch_size={args.batch}", f"train.max_steps={args.steps}",
        "train.lr=0.003", "train.warmup_steps=10", f"train.threads={args.threads}", f"log.runs_dir={runs}",
        f"log.run_id=coef-{coef:g}", "log.progress=none"])
    folder = run_folder(cfg.log.runs_dir, cfg.log.run_id)
    folder.path.mkdir(parents=True, exist_ok=True)
    return Trainer(cfg, ParallelDims.build(info, grid_sizes(cfg)), folder, RankLogger(folder.path, 0))


def run_variant(args: argparse.Namespace, info: RankInfo, runs: Path, coef: float) -> dict[str, float]:
    trainer = make_trainer(args, info, runs, coef)
    batches, tail = trainer.batches(0, 0), max(1, args.steps // 4)
    points, tokens, elapsed = [], 0, 0.0
    for step in range(args.steps):
        start = time.perf_counter()
        micro_batches = next(batches)
        loss, _ = trainer.train_step(micro_batches)
        trainer.step += 1
        fields = read_now(trainer.router_load.step_fields())
        if step >= WARMUP_STEPS:  # the first steps pay for allocations and thread start-up
            elapsed += time.perf_counter() - start
            tokens += sum(batch[0].numel() for batch in micro_batches)
        load = fields["moe"]["tokens_per_expert"]
        points.append((float(loss) - coef * fields["aux_loss"], fields["aux_loss"], load["max"] / load["mean"]))
    last = points[-tail:]
    return {"coef": coef, "lm_loss": statistics.fmean(p[0] for p in last),
            "aux_loss": statistics.fmean(p[1] for p in last), "busiest_over_mean": statistics.fmean(p[2] for p in last),
            "first_busiest_over_mean": points[0][2], "tokens_per_s": tokens / elapsed}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    info = RankInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, master_addr="", master_port=0,
                    launcher="single", backend="gloo", device=device)
    with tempfile.TemporaryDirectory() as runs:
        results = [run_variant(args, info, Path(runs), coef) for coef in COEFS]
    top_k = load_config(None, [f"model.preset={args.preset}"]).model.shape().top_k
    print(f"{args.preset} on {device.type}, {args.steps} steps of {args.batch} x {args.seq} tokens; means over the "
          f"last {max(1, args.steps // 4)} steps (load-balancing loss: {top_k} when balanced; busiest/mean: 1)")
    print(f"{'aux coef':>9} {'LM loss':>8} {'aux loss':>9} {'busiest/mean':>13} {'at step 1':>10} {'tokens/s':>9}")
    for r in results:
        print(f"{r['coef']:>9g} {r['lm_loss']:>8.4f} {r['aux_loss']:>9.4f} {r['busiest_over_mean']:>13.3f} "
              f"{r['first_busiest_over_mean']:>10.3f} {r['tokens_per_s']:>9,.0f}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
