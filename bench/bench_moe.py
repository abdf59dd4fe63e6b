"""Mixture of experts: the router's load-balancing loss, and expert parallelism against replicated experts.

Load balance (and why):
- One process on this machine's device (CUDA when visible, else the CPU), one trainer per variant, each training
  through the trainer's own step (`Trainer.train_step`: the load-balancing loss over the routing statistics, AdamW,
  clipping) on the same text (data.source=stdlib, bytes), from the same initial weights and batches. Variants:
  model.moe_aux_loss_coef in 0 (the loss only logged), 0.01 (the default) and 0.1.
- Every step logs the load-balancing loss (top-k when balanced) and the busiest expert's tokens over the mean
  (1: balanced), over all layers; the table gives their mean over the last quarter of the steps, the LM loss there
  (the training loss less the weighted auxiliary term) and the tokens/s of the run after its first 5 steps.

Expert parallelism (issue 30):
- Two gloo ranks (spawn_local, one thread each on this 2-core machine), each training through `Trainer.train_step`
  on its half of the same global batches from the same initial weights, once with every block's experts replicated
  (parallel.dp=2, parallel.ep=1) and once split over the two ranks (parallel.ep=2, tokens to their experts' ranks by
  all-to-all). The two trainers step in turn (after `--ep-warmup` steps each), every step behind a barrier and
  timed on its slowest rank, so load on the machine falls on both alike; tokens/s is the global batch over the
  median step.
- Training-state memory per rank is the trainer's `memory` record (`gptpar.train.memory.state_bytes`, taken inside
  the first step, after the optimizer and before the gradients are reset), beside its closed form from the model
  shape: E/ep experts of (2I·d + d·I) parameters per block, 4 bytes each for parameters and for gradients, 8 for
  AdamW's two moments, everything else whole.
- The all-to-all bytes each rank sent per step (`comm_bytes`, gptpar.parallel.comm.read_sent after every step)
  beside the closed form for perfectly balanced routing: per block 2·T·k·d·(ep-1)/ep fp32 elements forward (the
  rows out to their experts' ranks and the results back) and as many backward, for T tokens per rank and top-k
  picks, plus the count exchange ((ep-1)·E/ep int64 per block, forward only). Routing is not balanced, so the
  counted bytes differ from it (the ratio column): a rank whose tokens pick the other rank's experts more often
  sends more.

Run: .venv/bin/python bench/bench_moe.py   (see --help; `make bench-moe`)
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
import torch.distributed as dist

from gptpar.config import ParallelConfig, load_config
from gptpar.parallel.comm import read_sent
from gptpar.parallel.dims import ParallelDims
from gptpar.parallel.grid import grid_sizes
from gptpar.parallel.process_group import RankInfo
from gptpar.parallel.spawn import spawn_local
from gptpar.presets import ModelShape
from gptpar.run.folder import run_folder
from gptpar.run.logfile import RankLogger
from gptpar.train.step_records import read_now
from gptpar.train.trainer import Trainer

COEFS = (0.0, 0.01, 0.1)
WARMUP_STEPS = 5  # left out of tokens/s
EP_WORLD = 2  # gloo ranks of the expert-parallel section: the cores of this machine
EP_SIZES = (1, 2)  # replicated experts, then split over the two ranks


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen2-moe-tiny", help="a mixture-of-experts model.preset")
    ap.add_argument("--steps", type=int, default=100, help="optimizer steps per variant (more than 5)")
    ap.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    ap.add_argument("--batch", type=int, default=16, help="sequences per step (the expert-parallel section: over "
                    "both ranks)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads on a CPU (one process)")
    ap.add_argument("--ep-steps", type=int, default=30, help="timed steps per layout of the expert-parallel section")
    ap.add_argument("--ep-warmup", type=int, default=3, help="untimed steps per layout before them")
    ap.add_argument("--skip-ep", action="store_true", help="only the load-balance section")
    ap.add_argument("--out", default="", help="also write the results as JSON here")
    return ap.parse_args(argv)


def make_trainer(args: argparse.Namespace, info: RankInfo, runs: Path, run_id: str, overrides: list[str]) -> Trainer:
    """A trainer of `args.preset` on the text every section shares; `overrides` add the variant's keys."""
    cfg = load_config(None, [
        f"model.preset={args.preset}", "data.tokenizer=bytes", f"data.seq_len={args.seq}",
        f"train.batch_size={args.batch}", "train.lr=0.003", "train.warmup_steps=10", f"log.runs_dir={runs}",
        f"log.run_id={run_id}", "log.progress=none", *overrides])
    folder = run_folder(cfg.log.runs_dir, cfg.log.run_id)
    folder.path.mkdir(parents=True, exist_ok=True)
    return Trainer(cfg, ParallelDims.build(info, grid_sizes(cfg)), folder, RankLogger(folder.path, info.rank))


# --- load balance (one process) -----------------------------------------------------------------------


def run_variant(args: argparse.Namespace, info: RankInfo, runs: Path, coef: float) -> dict[str, float]:
    trainer = make_trainer(args, info, runs, f"coef-{coef:g}", [
        f"model.moe_aux_loss_coef={coef}", f"train.max_steps={args.steps}", f"train.threads={args.threads}"])
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


def load_balance(args: argparse.Namespace) -> list[dict[str, float]]:
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
    return results


# --- expert parallelism (two gloo ranks) --------------------------------------------------------------


def ep_rank_main(info: RankInfo, args: argparse.Namespace, out: Path) -> None:
    """Both layouts side by side on this rank, stepping in turn (the first alternates), each step behind a barrier;
    rank 0 writes every rank's step times, all-to-all bytes, losses and memory record to `out`."""
    torch.set_num_threads(1)
    steps = args.ep_warmup + args.ep_steps
    with tempfile.TemporaryDirectory() as runs:
        trainers = {ep: make_trainer(args, info, Path(runs), f"ep-{ep}", [
            f"parallel.dp={EP_WORLD}", f"parallel.ep={ep}", "parallel.backend=gloo", "train.threads=1",
            f"train.max_steps={steps}"]) for ep in EP_SIZES}
        batches = {ep: t.batches(0, 0) for ep, t in trainers.items()}
        mine: dict[int, dict[str, Any]] = {ep: {"seconds": [], "sent": [], "loss": [], "busiest_over_mean": []}
                                           for ep in EP_SIZES}
        read_sent()  # nothing before the first step counts
        for step in range(steps):
            for ep in EP_SIZES[step % 2:] + EP_SIZES[:step % 2]:
                trainer, rec = trainers[ep], mine[ep]
                micro_batches = next(batches[ep])
                dist.barrier()
                start = time.perf_counter()
                loss, _ = trainer.train_step(micro_batches)
                seconds = time.perf_counter() - start
                trainer.step += 1
                sent = read_sent().get("all_to_all", 0)
                load = read_now(trainer.router_load.step_fields())["moe"]["tokens_per_expert"]
                rec["loss"].append(float(loss))
                if step >= args.ep_warmup:
                    rec["seconds"].append(seconds)
                    rec["sent"].append(sent)
                    rec["busiest_over_mean"].append(load["max"] / load["mean"])
        for ep, trainer in trainers.items():
            mine[ep]["memory"] = trainer.memory  # state_bytes inside the first step, before gradients were reset
            mine[ep]["tokens"] = sum(b[0].numel() for b in next(batches[ep]))
            mine[ep]["vocab_rows"] = trainer.model_config.vocab_size
            mine[ep]["device"] = str(info.device)
    per_rank: list[Any] = [None] * info.world_size
    dist.all_gather_object(per_rank, mine)
    if info.rank == 0:
        out.write_text(json.dumps({"ranks": per_rank}))


def ep_state_closed_form(shape: ModelShape, vocab_rows: int, ep: int) -> dict[str, int]:
    """Bytes per rank of fp32 parameters, gradients and AdamW's two moments when each block's experts are split over
    ep ranks and the rest is whole; `expert_params` is this rank's share of the experts."""
    d, width, experts = shape.n_embd, shape.mlp_width, shape.n_experts
    per_block = experts // ep * (2 * width * d + d * width)  # gate_up_proj (E/ep, 2I, d), down_proj (E/ep, d, I)
    expert_params = shape.n_layer * per_block
    n = shape.parameters(vocab_rows) - shape.n_layer * experts * 3 * d * width + expert_params
    return {"params_bytes": 4 * n, "grads_bytes": 4 * n, "optimizer_bytes": 8 * n, "expert_params": expert_params}


def ep_a2a_closed_form(shape: ModelShape, tokens: int, ep: int) -> float:
    """Bytes one rank sends per step by all-to-all when routing is balanced: per block the rows of its tokens' picks
    for other ranks' experts out and their results back (2·T·k·d·(ep-1)/ep fp32 elements), the same backward, and
    the count exchange ((ep-1)·E/ep int64, forward only)."""
    rows = 2 * 2 * tokens * shape.top_k * shape.n_embd * (ep - 1) / ep * 4
    counts = (ep - 1) * (shape.n_experts // ep) * 8
    return shape.n_layer * (rows + counts)


def expert_parallel(args: argparse.Namespace) -> dict[str, Any]:
    pcfg = ParallelConfig(dp=EP_WORLD, backend="gloo", timeout_s=300)
    with tempfile.TemporaryDirectory() as tmp:
        result_file = Path(tmp) / "rank0.json"
        spawn_local(ep_rank_main, EP_WORLD, args, result_file, pcfg=pcfg)
        ranks = [{int(ep): rec for ep, rec in r.items()} for r in json.loads(result_file.read_text())["ranks"]]
    shape = load_config(None, [f"model.preset={args.preset}"]).model.shape()
    mib = 2**20
    first = ranks[0][EP_SIZES[0]]
    tokens, global_tokens = first["tokens"], args.batch * args.seq
    print(f"\n{args.preset}, {EP_WORLD} gloo ranks x 1 thread ({first['device']}), {args.batch} x {args.seq} tokens "
          f"per step ({tokens} per rank), trainer's own step (AdamW, clip 1.0); median step (its slowest rank) of "
          f"{args.ep_steps} after {args.ep_warmup} warm-up, the two layouts stepping in turn")
    print("training state per rank in MiB, counted (closed form: fp32, 4 + 4 + 8 bytes per parameter)")
    print(f"{'layout':<20}{'step ms':>8}{'tokens/s':>9}{'experts/rank':>13}{'params':>16}{'grads':>16}"
          f"{'AdamW':>16}{'total':>16}{'loss at end':>12}")
    results: dict[str, Any] = {"layouts": []}
    for ep in EP_SIZES:
        step_s = statistics.median(max(times) for times in zip(*(r[ep]["seconds"] for r in ranks), strict=True))
        memory = [r[ep]["memory"] for r in ranks]
        closed = ep_state_closed_form(shape, first["vocab_rows"], ep)
        cells = []
        for key in ("params_bytes", "grads_bytes", "optimizer_bytes"):
            counted = max(m[key] for m in memory)
            cells.append((counted, closed[key]))
        cells.append((sum(c for c, _ in cells), sum(f for _, f in cells)))
        label = "replicated (ep=1)" if ep == 1 else f"split (ep={ep})"
        losses = [r[ep]["loss"][-1] for r in ranks]
        print(f"{label:<20}{step_s * 1e3:>8.0f}{global_tokens / step_s:>9,.0f}"
              f"{f'{shape.n_experts // ep} x {shape.n_layer}':>13}"
              + "".join(f"{f'{c / mib:.2f} ({f / mib:.2f})':>16}" for c, f in cells)
              + f"{statistics.fmean(losses):>12.4f}")
        results["layouts"].append({"ep": ep, "step_s": step_s, "tokens_per_s": global_tokens / step_s,
                                   "memory": memory, "closed_form": closed, "final_loss": losses})
    saved = [lay["closed_form"]["expert_params"] for lay in results["layouts"]]
    total = [sum(lay["memory"][0][k] for k in ("params_bytes", "grads_bytes", "optimizer_bytes"))
             for lay in results["layouts"]]
    print(f"experts' state per rank: {saved[0] * 16 / mib:.2f} MiB replicated, {saved[1] * 16 / mib:.2f} split "
          f"(closed form); counted total fell by {(total[0] - total[1]) / mib:.2f} MiB")
    gap = max(abs(a - b) for r in ranks for a, b in zip(r[1]["loss"], r[2]["loss"], strict=True))
    print(f"the two layouts' losses differ by at most {gap:.1e} over all {args.ep_warmup + args.ep_steps} steps")
    ep = EP_SIZES[-1]
    closed = ep_a2a_closed_form(shape, tokens, ep)
    print(f"\nall-to-all bytes sent per step and rank under ep={ep} (comm_bytes; ep=1 sent "
          f"{sum(sum(r[1]['sent']) for r in ranks)}); closed form for balanced routing: {shape.n_layer} blocks x "
          f"(2 x 2 x {tokens} tokens x top-{shape.top_k} x d={shape.n_embd} x (ep-1)/ep x 4 B + counts)")
    print(f"{'rank':<6}{'counted KiB':>12}{'min':>9}{'max':>9}{'closed form KiB':>16}{'ratio':>7}{'busiest/mean':>13}")
    results["all_to_all"] = []
    for rank, r in enumerate(ranks):
        sent = r[ep]["sent"]
        mean = statistics.fmean(sent)
        print(f"{rank:<6}{mean / 1024:>12.1f}{min(sent) / 1024:>9.1f}{max(sent) / 1024:>9.1f}{closed / 1024:>16.1f}"
              f"{mean / closed:>7.3f}{statistics.fmean(r[ep]['busiest_over_mean']):>13.2f}")
        results["all_to_all"].append({"rank": rank, "mean_bytes": mean, "closed_form_bytes": closed,
                                      "ratio": mean / closed})
    print("(ratio 1 only for balanced routing: a rank sends more when its tokens pick the other rank's experts more "
          "often, and gets more back to return, so with two ranks both send the same; busiest/mean: the busiest "
          "expert of any layer over the mean load)")
    return results


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    results: dict[str, Any] = {"load_balance": load_balance(args)}
    if not args.skip_ep:
        results["expert_parallel"] = expert_parallel(args)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
