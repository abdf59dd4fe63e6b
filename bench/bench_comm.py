"""Compressed-communication benchmark: each parallel.grad_comm mode of each sync side by side, and fsdp's
parallel.param_comm and parallel.hpz, bytes and speed.

Everything is measured in one run on the same machine, the modes running round-robin so load drift hits each alike:
- per mode, the median step (its slowest rank), tokens/s and the bytes each rank sent per step, counted by the syncs
  themselves (the step record's `comm_bytes`, gptpar.parallel.comm.SENT), against fp32 of the same sync;
- a `local` row (the same ranks, no gradient sync): the compute floor, which says whether the model is
  communication-bound here (the fp32 rows' step well above it);
- ours against torch's same hook: bucketed in bf16 against ddp with torch's bf16_compress_hook (and fp32 against
  ddp's own reduction), with the spread of the rounds so a ratio inside the noise is called so;
- a simulated slow link: gloo over loopback moves bytes far faster than a cluster's network between nodes, so a
  second table adds to each mode's measured step the time its counted bytes take at `--link-gbps` (none of it
  hidden behind compute, as if no overlap survived: an upper bound for the syncs that overlap). hpZ's gathers within
  a node (`all_gather_intra`) are left out of it: they stay on the node's fast links. Its rows run one rank per
  "node" (parallel.hpz_node_size=1: each rank keeps a whole copy, and only the forward's gathers cross ranks),
  the layout a 2-rank job can show;
- DeepSpeed's ZeRO-2 and ZeRO-3 (parallel.dp_sync=deepspeed, the `deepspeed` extra) in fp32, their bytes counted by
  deepspeed.comm's own logger in the same ring terms: DeepSpeed's ZeRO++ (qwZ, qgZ, hpZ) runs on CUDA GPUs only, so
  on these gloo ranks its rows are ours alone;
- hpZ with real nodes: --node-world ranks (4) in "nodes" of --node-size (2), fsdp in fp32, with hpZ and as zero++,
  so that the gathers across nodes (`all_gather`) and within them (`all_gather_intra`) are both there. Bytes only:
  4 ranks on 2 cores time nothing a cluster would see.

Run: .venv/bin/python bench/bench_comm.py   (see --help; `make bench-comm`; --node-only: just the 4-rank bytes)
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

from gptpar.config import ModelConfig, ParallelConfig, TrainConfig
from gptpar.models.build import build_model, count_params
from gptpar.models.loss import lm_loss
from gptpar.parallel.comm import read_sent
from gptpar.parallel.data_parallel import GradSync, make_grad_sync
from gptpar.parallel.data_parallel.param_comm import INTRA
from gptpar.parallel.process_group import RankInfo
from gptpar.parallel.spawn import spawn_local

# (row name, parallel.dp_sync, its other parallel settings); `local` runs bucketed without its sync
HPZ = {"hpz": True, "hpz_node_size": 1}
MODES: tuple[tuple[str, str, dict], ...] = (
    ("local", "bucketed", {}),
    *((f"bucketed {w}", "bucketed", {"grad_comm": w}) for w in ("fp32", "bf16", "int8")),
    *((f"ddp {w}", "ddp", {"grad_comm": w}) for w in ("fp32", "bf16", "powersgd")),
    *((f"zero2 {w}", "zero2", {"grad_comm": w}) for w in ("fp32", "bf16", "int8")),
    *((f"fsdp {w}", "fsdp", {"grad_comm": w}) for w in ("fp32", "int8")),
    *((f"fsdp param {w}", "fsdp", {"param_comm": w}) for w in ("bf16", "int8")),
    ("fsdp hpz", "fsdp", HPZ),
    ("fsdp zero++", "fsdp", {"grad_comm": "int8", "param_comm": "int8", **HPZ}),  # qgZ, qwZ and hpZ together
    *((f"deepspeed-{stage} fp32", "deepspeed", {"zero_stage": stage}) for stage in (2, 3)))
SENT_KINDS = ("all_reduce", "reduce_scatter", "all_to_all", "all_gather", INTRA)  # comm_bytes' kinds, table order
ZERO_PP = {"grad_comm": "int8", "param_comm": "int8", "hpz": True}  # node_size from --node-size
NODE_MODES: tuple[tuple[str, str, dict], ...] = (("fsdp fp32", "fsdp", {}), ("fsdp hpz", "fsdp", {"hpz": True}),
                                                 ("fsdp zero++", "fsdp", ZERO_PP))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gpt2-mini")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1, help="sequences per rank per step (few: communication-bound)")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    ap.add_argument("--bucket-mb", type=float, default=4.0)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per mode and round")
    ap.add_argument("--rounds", type=int, default=5, help="modes run round-robin; the median is kept")
    ap.add_argument("--link-gbps", type=float, default=1.0,
                    help="the simulated link, in Gbit/s per rank: 1 against this CPU's compute is as slow as 100 "
                         "against a GPU's, which steps about 100 times faster")
    ap.add_argument("--node-world", type=int, default=4, help="ranks of the hpZ bytes table (0: none)")
    ap.add_argument("--node-size", type=int, default=2, help="ranks per simulated node there")
    ap.add_argument("--node-only", action="store_true", help="only the hpZ bytes table over --node-world ranks")
    ap.add_argument("--out", default="", help="also write the results as JSON here")
    return ap.parse_args(argv)


def build(args: argparse.Namespace, sync_name: str, settings: dict, world: int, nodes: dict[int, dist.ProcessGroup]
          ) -> tuple[GradSync, torch.optim.Optimizer]:
    model = build_model(ModelConfig(preset=args.preset), args.vocab, seed=0)
    pcfg = ParallelConfig(dp=world, dp_sync=sync_name, bucket_mb=args.bucket_mb, powersgd_rank=4, **settings)
    node = nodes[pcfg.hpz_node_size] if pcfg.hpz else None
    train = TrainConfig(batch_size=args.batch * world, lr=1e-4, weight_decay=0.01, grad_clip=0.0)  # AdamW's defaults
    sync = make_grad_sync(model, pcfg, dist.group.WORLD, torch.device("cpu"), node_group=node, train=train)
    sync.count_engine_sent()  # an engine whose collectives gptpar does not issue (DeepSpeed's)
    opt = sync.own_optimizer() or torch.optim.AdamW([p for p, _ in sync.optimizer_params()], lr=1e-4)
    return sync, opt


def baseline(name: str, sync: str, settings: dict) -> str:
    """The row a mode's bytes and speed are compared with: the same sync (DeepSpeed: at the same stage) in fp32."""
    if name == "local":
        return name
    return f"deepspeed-{settings['zero_stage']} fp32" if sync == "deepspeed" else f"{sync} fp32"


def timed_steps(sync: GradSync, opt: torch.optim.Optimizer, args: argparse.Namespace, communicate: bool
                ) -> list[tuple[float, dict[str, int]]]:
    """(seconds, bytes sent by collective) of each of `args.steps` steps after one warm-up step; the ranks meet at a
    barrier before each, so every rank times the same step."""
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)
    x, y = tokens[:, :-1], tokens[:, 1:]
    samples = []
    for _ in range(args.steps + 1):
        dist.barrier()
        read_sent()
        sync.read_engine_sent()
        start = time.perf_counter()
        with sync.accumulating(is_last_micro_step=communicate):
            sync.backward(lm_loss(sync.module(x).logits, y))
        if communicate:
            sync.finish()
        sync.step(opt, lambda: torch.zeros(()))  # no clip: its norm's all-reduce is not the sync's traffic
        sync.zero_grad()
        samples.append((time.perf_counter() - start, read_sent() | sync.read_engine_sent()))
    return samples[1:]


def across(sent: dict[str, int]) -> float:
    """The bytes that cross nodes: all but hpZ's gathers within a node."""
    return float(sum(n for op, n in sent.items() if op != INTRA))


def rank_main(info: RankInfo, args: argparse.Namespace, out: Path) -> None:
    torch.set_num_threads(args.threads)
    sizes = {settings["hpz_node_size"] for _, _, settings in MODES if "hpz_node_size" in settings}
    nodes = {size: dist.new_subgroups(size)[0] for size in sorted(sizes)}  # every rank, in one order
    runs = {name: build(args, sync, settings, info.world_size, nodes) for name, sync, settings in MODES}
    steps: dict[str, list[float]] = {name: [] for name in runs}  # per round: the median step of its slowest rank
    sent: dict[str, float] = {}
    names = list(runs)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            samples = [(t, across(sent)) for t, sent in timed_steps(*runs[name], args, communicate=name != "local")]
            table = torch.tensor(samples, dtype=torch.float64)
            dist.all_reduce(table, op=dist.ReduceOp.MAX)  # a step ends when its last rank does
            steps[name].append(statistics.median(table[:, 0].tolist()))
            sent[name] = statistics.median(s for _, s in samples)  # the same every step but powersgd's first two
    if info.rank == 0:
        out.write_text(json.dumps({"steps": steps, "sent": sent}))


def node_rank_main(info: RankInfo, args: argparse.Namespace, out: Path) -> None:
    """One warm-up and one counted step of each NODE_MODES row over all ranks, nodes of --node-size; rank 0 writes
    the counts (every rank sends the same but for padding: the largest over the ranks is kept)."""
    torch.set_num_threads(args.threads)
    nodes = {args.node_size: dist.new_subgroups(args.node_size)[0]}
    counts = {}
    for name, sync_name, settings in NODE_MODES:
        hpz = {"hpz_node_size": args.node_size} if settings.get("hpz") else {}
        sync, opt = build(args, sync_name, {**settings, **hpz}, info.world_size, nodes)
        [(_, sent)] = timed_steps(sync, opt, argparse.Namespace(**{**vars(args), "steps": 1}), communicate=True)
        table = torch.tensor([sent.get(k, 0) for k in SENT_KINDS], dtype=torch.float64)
        dist.all_reduce(table, op=dist.ReduceOp.MAX)
        counts[name] = dict(zip(SENT_KINDS, map(int, table.tolist()), strict=True))
    if info.rank == 0:
        out.write_text(json.dumps(counts))


def node_report(args: argparse.Namespace, counts: dict[str, dict[str, int]]) -> None:
    print(f"\nhpZ over {args.node_world} gloo ranks in nodes of {args.node_size} (parallel.hpz_node_size="
          f"{args.node_size}), {args.batch}x{args.seq} tokens per rank: bytes one rank sends in a step, by collective "
          "(ring terms); across = everything but all_gather_intra")
    kinds = [k for k in SENT_KINDS if any(c.get(k) for c in counts.values())]
    print(f"{'mode':<14}" + "".join(f"{k + ' KiB':>22}" for k in kinds) + f"{'across KiB':>13}{'vs fp32':>9}")
    fp32 = across(counts["fsdp fp32"])
    for name, c in counts.items():
        print(f"{name:<14}" + "".join(f"{c.get(k, 0) / 1024:>22,.0f}" for k in kinds)
              + f"{across(c) / 1024:>13,.0f}{across(c) / fp32:>9.3f}")


def report(args: argparse.Namespace, res: dict, n_params: int) -> dict:
    tokens = args.world * args.batch * args.seq
    step = {name: statistics.median(v) for name, v in res["steps"].items()}
    spread = {name: (min(v), max(v)) for name, v in res["steps"].items()}
    sent = res["sent"]
    link = args.link_gbps * 1e9 / 8  # bytes/s
    print(f"\n{args.preset}: {n_params / 1e6:.1f}M params ({n_params * 4 / 2**20:.1f} MiB of fp32 gradients), "
          f"{args.world} gloo ranks x {args.threads} thread, {args.batch}x{args.seq} tokens per rank, bucket "
          f"{args.bucket_mb:g} MB, median over {args.rounds} rounds of each round's median of {args.steps} steps")
    print(f"{'mode':<16}{'step ms':>9}{'(range)':>16}{'tok/s':>9}{'sent KiB':>11}{'vs fp32 bytes':>15}"
          f"{'vs fp32 speed':>15}{f'at {args.link_gbps:g} Gb/s ms':>18}{'speedup there':>15}")
    rows = {}
    for name, sync, settings in MODES:
        base = baseline(name, sync, settings)
        slow = step[name] + sent[name] / link
        slow_base = step[base] + sent[base] / link
        rows[name] = {"step_s": step[name], "tokens_per_s": tokens / step[name], "sent_bytes": sent[name],
                      "slow_link_step_s": slow}
        lo, hi = spread[name]
        ratio = sent[name] / sent[base] if sent[base] else float("nan")
        print(f"{name:<16}{step[name] * 1e3:>9.1f}{f'({lo * 1e3:.1f}-{hi * 1e3:.1f})':>16}"
              f"{tokens / step[name]:>9.0f}{sent[name] / 1024:>11.0f}{ratio:>15.3f}{step[base] / step[name]:>14.2f}x"
              f"{slow * 1e3:>18.1f}{slow_base / slow:>14.2f}x")
    print("(vs fp32: the same sync in fp32; speedup above 1 is faster. The slow-link column adds the counted bytes at "
          "the link's rate to the measured step, none of it hidden: what a cross-node job would see at most. "
          "DeepSpeed's rows: its bytes counted by deepspeed.comm's logger; its ZeRO++ runs on CUDA only.)")
    print("\nours against torch's same reduction (bucketed vs ddp, step time ratio; above 1: ours faster):")
    checks = {}
    for wire in ("fp32", "bf16"):
        ours, torch_row = f"bucketed {wire}", f"ddp {wire}"
        ratio = step[torch_row] / step[ours]
        overlap = spread[ours][0] <= spread[torch_row][1] and spread[torch_row][0] <= spread[ours][1]
        checks[wire] = ratio
        print(f"  {wire}: {ratio:.2f}x{'  (inside the noise: the rounds overlap)' if overlap else ''}"
              f"{'' if ratio >= 0.95 else '  BELOW 0.95x'}")
    return {"rows": rows, "ours_vs_torch": checks, **res}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print("command:", shlex.join([sys.executable, *sys.argv]), flush=True)
    started = time.perf_counter()
    full: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        result_file = Path(tmp) / "rank0.json"
        if not args.node_only:
            spawn_local(rank_main, args.world, args, result_file,
                        pcfg=ParallelConfig(dp=args.world, backend="gloo", timeout_s=600))
            res = json.loads(result_file.read_text())
            full = report(args, res, count_params(build_model(ModelConfig(preset=args.preset), args.vocab, seed=0)))
        if args.node_world:
            spawn_local(node_rank_main, args.node_world, args, result_file,
                        pcfg=ParallelConfig(dp=args.node_world, backend="gloo", timeout_s=600))
            full["nodes"] = json.loads(result_file.read_text())
            node_report(args, full["nodes"])
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), **full}, indent=1))
    print(f"\ntotal {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
