"""Tensor parallelism: ours (gptpar) against PyTorch's (DTensor) on the same GPT-2, with DDP beside, in one run.

Setup (and why):
- `--world` (2) gloo ranks, each its own process (spawn_local) with `torch.set_num_threads(1)`: on this 2-core
  box every rank owns one core, as if it were its own device.
- One GPT-2 (`--preset` with `--n-layer`, `--n-embd`, `--n-head` overrides; `--vocab` 50257, GPT-2's own, its
  token table padded to 50,304 rows as model.pad_vocab pads it), built from the same seed on every rank and cut
  per row by the package's own entry points (gptpar.parallel.tensor_parallel: shard_model, loss_function,
  loss_context, tensor_parallel_forward), exactly as the trainer does for parallel.tp_impl=gptpar|torch.
- Rows: ours TP=W, ours TP=W +SP (sequence parallelism), torch TP=W, torch TP=W +SP, all with loss parallelism
  (`--gathered-loss` adds ours and torch without it: whole logits all-gathered), and DP=W (torch DDP, each rank the
  whole model). Every row trains on the same global batch of `--batch` sequences of `--seq` random tokens: a TP
  rank sees all of it, a DDP rank its 1/W.
- One step = forward + loss + backward + AdamW step (no clipping). Ranks meet at a barrier before each step; a
  step's time is the slower rank's. Rows run round-robin each repetition (order rotating), `--warmup` repetitions
  dropped, medians of `--reps` reported with the min-max range; ours/torch is the tokens/s ratio of matching rows
  ("inside the noise" when their min-max step times overlap).
- Memory per rank: params + grads + optimizer state of this rank's pieces (gptpar.train.memory.state_bytes,
  after the first optimizer step), the bytes autograd saves for backward in one forward + loss
  (gptpar.tensor_bytes.saved_activation_bytes) and, measured, the growth of the process's peak RSS over one step
  (the peak reset first via /proc/self/clear_refs; it includes the gradients, the logits and every temporary).
- Communication per step per rank, in elements on the wire (ring terms: all-reduce 2(W-1)/W of the payload,
  all-gather and reduce-scatter (W-1)/W of the whole tensor): counted by ours in comm.VOLUME (reset every step),
  and for every row, ours included, by `WireCounter`, torch's CommDebugMode with the same ring terms applied to
  each collective it sees (c10d and functional collectives alike). Beside them the closed forms (`closed_comm`)
  with b x s tokens, width h, L blocks: the blocks' part L*4*b*s*h*2(W-1)/W (two all-reduces of b*s*h in forward
  and two in backward per block, or the same bytes as all-gathers + reduce-scatters with SP), and what embedding,
  head and loss add. The blocks' part is also counted: one more step of a model with L+1 blocks, the difference
  times L.

Run: .venv/bin/python bench/bench_tp.py   (see --help; `make bench-tp`)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import sys
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode
from torch.nn.parallel import DistributedDataParallel
from torch.utils._pytree import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/'s shared helpers, also when imported elsewhere

from bench_fsdp import (  # noqa: E402
    agree_error,
    measured,
    one_line,
    ratio_vs,
    release_memory,
    shown,
    spawn_and_collect,
    spread,
    status_mb,
    timed,
)

from gptpar.config import ModelConfig, ParallelConfig  # noqa: E402
from gptpar.models.build import build_model  # noqa: E402
from gptpar.models.loss import lm_loss  # noqa: E402
from gptpar.parallel.dims import ParallelDims  # noqa: E402
from gptpar.parallel.process_group import RankInfo  # noqa: E402
from gptpar.parallel.tensor_parallel import (  # noqa: E402
    loss_context,
    loss_function,
    shard_model,
    tensor_parallel_forward,
)
from gptpar.parallel.tensor_parallel.comm import VOLUME  # noqa: E402
from gptpar.tensor_bytes import saved_activation_bytes  # noqa: E402
from gptpar.train.memory import state_bytes  # noqa: E402

MB = 2**20


@dataclass(frozen=True)
class Row:
    key: str
    impl: str  # gptpar | torch | ddp
    sp: bool = False
    lp: bool = True
    mate: str = ""  # ours' matching torch row

    def label(self, w: int) -> str:
        if self.impl == "ddp":
            return f"DP={w} (torch DDP)"
        return (f"{'ours' if self.impl == 'gptpar' else 'torch'} TP={w}{' +SP' if self.sp else ''}"
                f"{'' if self.lp else ', gathered loss'}")


ROWS = (Row("ours", "gptpar", mate="torch"), Row("ours_sp", "gptpar", sp=True, mate="torch_sp"),
        Row("torch", "torch"), Row("torch_sp", "torch", sp=True))
GATHERED = (Row("ours_gathered", "gptpar", lp=False, mate="torch_gathered"), Row("torch_gathered", "torch", lp=False))
DDP = Row("ddp", "ddp")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gpt2-mini", help="shape the overrides below start from")
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--n-head", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=50257, help="vocabulary (GPT-2's 50257 needs padding at W=2)")
    ap.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    ap.add_argument("--batch", type=int, default=8, help="sequences per step, global (the same for every row)")
    ap.add_argument("--world", type=int, default=2, help="gloo ranks (one thread each): TP degree and DP degree")
    ap.add_argument("--warmup", type=int, default=2, help="repetitions dropped before measuring")
    ap.add_argument("--reps", type=int, default=8, help="measured repetitions (round-robin over the rows)")
    ap.add_argument("--gathered-loss", action="store_true",
                    help="also the TP rows without loss parallelism (whole logits all-gathered)")
    ap.add_argument("--out", default="", help="also write the results as JSON here")
    return ap.parse_args(argv)


def rows_of(args: argparse.Namespace) -> list[Row]:
    return [*ROWS, *(GATHERED if args.gathered_loss else ()), DDP]


def model_config(args: argparse.Namespace, n_layer: int) -> ModelConfig:
    return ModelConfig(preset=args.preset, n_layer=n_layer, n_embd=args.n_embd, n_head=args.n_head)


# --- communication counted by torch's CommDebugMode ---------------------------------------------------


def collective_kind(name: str) -> str | None:
    name = name.replace("_", "")
    for kind in ("reducescatter", "allgather", "allreduce", "broadcast", "alltoall"):
        if kind in name:
            return {"reducescatter": "reduce_scatter", "allgather": "all_gather", "allreduce": "all_reduce"}.get(
                kind, kind)
    return None


def wire_elements(kind: str, tensors: int, world: int) -> int:
    """Elements one rank sends for a collective over `tensors` elements (the whole tensor of an all-gather or a
    reduce-scatter, the payload of an all-reduce), ring algorithms: comm.VOLUME's terms."""
    return round(tensors * (2 if kind == "all_reduce" else 1) * (world - 1) / world)


class WireCounter(CommDebugMode):
    """CommDebugMode (which sees DTensor's functional collectives and plain c10d ones, forward and backward) that
    also adds up the elements each collective puts on the wire per rank, by kind."""

    def __init__(self, world: int) -> None:
        super().__init__()
        self.world = world
        self.volume: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if out is NotImplemented or isinstance(func, torch._ops.HigherOrderOperator):
            return out
        kind = collective_kind(func._overloadpacket.__name__)
        if kind:
            # The largest argument (or output) is the whole tensor: an all-gather's output, a reduce-scatter's
            # input, an all-reduce's payload, in the functional and c10d signatures alike.
            sizes = [sum(t.numel() for t in tree_flatten(a)[0] if isinstance(t, torch.Tensor)) for a in (*args, out)]
            self.volume[kind] += wire_elements(kind, max(sizes), self.world)
        return out


# --- the rows --------------------------------------------------------------------------------------------


class Variant:
    """One row's model (this rank's pieces, or the whole replica under DDP), optimizer and batch."""

    def __init__(self, row: Row, args: argparse.Namespace, info: RankInfo, grid: ParallelDims, n_layer: int) -> None:
        self.row, self.times, self.error = row, [], None
        self.memory: dict[str, int] | None = None
        self.volumes: list[dict[str, int]] = []  # comm.VOLUME after each step (ours)
        try:
            self._build(row, args, info, grid, n_layer)
        except Exception as exc:  # reported as a failed row, not a crash
            self.error = one_line(exc)

    def _build(self, row: Row, args: argparse.Namespace, info: RankInfo, grid: ParallelDims, n_layer: int) -> None:
        whole = build_model(model_config(args, n_layer), args.vocab, seed=0, seq_len=args.seq, shards=args.world)
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(1))
        x, self.y = tokens[:, :-1], tokens[:, 1:]
        if row.impl == "ddp":
            x, self.y = x.chunk(info.world_size)[info.rank], self.y.chunk(info.world_size)[info.rank]
            self.module: torch.nn.Module = whole
            ddp = DistributedDataParallel(whole)
            self.forward: Callable[[], torch.Tensor] = lambda: ddp(input_ids=x).logits
            self.plain_forward = lambda: whole(input_ids=x).logits  # no reducer: a forward never run backward
            self.loss_fn, self.context = lm_loss, contextlib.nullcontext
        else:
            pcfg = ParallelConfig(tp=info.world_size, tp_impl=row.impl, sequence_parallel=row.sp,
                                  loss_parallel=row.lp)
            self.module = shard_model(whole, pcfg, grid, torch.device("cpu"))
            self.forward = self.plain_forward = lambda: tensor_parallel_forward(self.module, x)
            self.loss_fn, self.context = loss_function(pcfg, grid, args.vocab), loss_context(pcfg, grid)
        self.opt = torch.optim.AdamW(self.module.parameters(), lr=1e-4)

    def step(self) -> None:
        VOLUME.clear()
        with self.context():
            self.loss_fn(self.forward(), self.y).backward()
        self.opt.step()
        if self.memory is None:  # AdamW's state exists now, the gradients not yet reset
            self.memory = state_bytes(self.module, self.opt)
        self.opt.zero_grad()
        self.volumes.append(dict(VOLUME))

    def saved_bytes(self) -> int:
        def forward() -> None:
            with self.context():
                self.loss_fn(self.plain_forward(), self.y)
        return saved_activation_bytes(forward, self.module.parameters())


def counted_step(variant: Variant, world: int) -> dict[str, Any]:
    """One more (untimed) step under WireCounter: its wire elements by kind, collective calls and comm.VOLUME."""
    with warnings.catch_warnings(), WireCounter(world) as counter:
        warnings.simplefilter("ignore")  # its module tracker's backward hooks warn about GPT-2's output classes
        variant.step()
    return {"wire": dict(counter.volume), "calls": counter.get_total_counts(), "volume": variant.volumes[-1]}


def built(row: Row, args: argparse.Namespace, info: RankInfo, grid: ParallelDims, n_layer: int) -> Variant:
    """Built in the same order on every rank (construction communicates), every rank agreeing on any error."""
    variant = Variant(row, args, info, grid, n_layer)
    variant.error = agree_error(variant.error)
    return variant


def round_robin(variants: list[Variant], warmup: int, reps: int) -> None:
    """Every repetition steps each live row once, starting one row later each time, so background load on the
    shared cores hits all rows alike; the first `warmup` repetitions are not kept. A row failing on any rank
    drops out on all of them."""
    for rep in range(warmup + reps):
        turn = rep % len(variants)
        for v in [*variants[turn:], *variants[:turn]]:
            if v.error is None:
                seconds, failure = timed(v)
                v.error = agree_error(failure)
                v.times += [seconds] if rep >= warmup and v.error is None else []


def rank_main(info: RankInfo, args: argparse.Namespace, out: Path) -> None:
    torch.set_num_threads(1)
    grid = ParallelDims.build(info, {"tp": info.world_size})
    variants = [built(row, args, info, grid, args.n_layer) for row in rows_of(args)]
    round_robin(variants, args.warmup, args.reps)
    results: dict[str, Any] = {}
    for v in variants:
        res: dict[str, Any] = {"times": v.times, "error": v.error, "memory": v.memory}
        if not v.error:
            kept = v.volumes[args.warmup:]
            res["volume_steady"] = all(vol == kept[0] for vol in kept)
            res["saved_bytes"] = v.saved_bytes()
            reset = release_memory()
            before = status_mb("VmRSS")
            dist.barrier()
            v.step()
            res["rss_growth_mb"] = status_mb("VmHWM") - before if reset else None
            res["count"] = counted_step(v, info.world_size)
            res["n_local"] = sum(p.numel() for p in v.module.parameters())
        results[v.row.key] = res
    del variants
    for row in rows_of(args):  # the blocks' part: one more block, counted the same way
        if results[row.key]["error"]:
            continue
        deeper = built(row, args, info, grid, args.n_layer + 1)
        results[row.key]["count_deeper"] = None if deeper.error else counted_step(deeper, info.world_size)
        del deeper
    per_rank: list[Any] = [None] * info.world_size
    dist.all_gather_object(per_rank, results)
    if info.rank == 0:
        out.write_text(json.dumps({"ranks": per_rank}))


# --- closed forms -----------------------------------------------------------------------------------------


def closed_comm(row: Row, args: argparse.Namespace) -> dict[str, float]:
    """Elements one rank puts on the wire per step, by source, in ring terms (r = (W-1)/W, all-reduce 2r).

    TP: per block two all-reduces of b*s*h forward (after attention's and the MLP's row-parallel c_proj) and two
    backward (at the column-parallel inputs); with SP each is an all-gather + reduce-scatter, the same bytes.
    Embedding and head: the embedding's partial sum forward and the head's input gradient backward (b*s*h each;
    with SP likewise as reduce-scatter/all-gather). Loss: three all-reduces of b*s numbers (maximum, sum of
    exponentials, target logit) with loss parallelism, else the all-gather of the whole padded logits.
    SP also reduces the gradients of what stays replicated. Both implementations all-gather the gradient of this
    rank's position rows (s*h, ring (W-1)/W: ours `own_rows`, torch the position table's sequence-sharded
    output) and all-reduce ln_f's (2h) in backward; per block ours all-reduces the layer norms and the
    row-parallel biases (6h), torch the layer norms' Partial gradients once per backward (torch_plan's
    `_grad_like_param`, 4h).
    DDP: every gradient all-reduced once (the tied head once), the blocks' and the rest."""
    w, b, s, h, n_layer = args.world, args.batch, args.seq, args.n_embd, args.n_layer
    ar, r = 2 * (w - 1) / w, (w - 1) / w
    meta = build_model(model_config(args, n_layer), args.vocab, seed=0, init_device="meta", shards=w)
    if row.impl == "ddp":
        per_block = sum(p.numel() for p in meta.transformer.h[0].parameters())  # 12h^2 + 13h
        total = sum(p.numel() for p in meta.parameters())
        return {"blocks": n_layer * per_block * ar, "embed_head": (total - n_layer * per_block) * ar, "loss": 0.0}
    block_sp, embed_sp = 0.0, 0.0
    if row.sp:  # the position rows' gradient all-gathered, ln_f's all-reduced; per block 6h (ours) or 4h (torch)
        block_sp, embed_sp = (6 if row.impl == "gptpar" else 4) * h * ar, s * h * r + 2 * h * ar
    return {"blocks": n_layer * (4 * b * s * h * ar + block_sp),
            "embed_head": 2 * b * s * h * ar + embed_sp,
            "loss": 3 * b * s * ar if row.lp else b * s * meta.config.vocab_size * r}


# --- report ---------------------------------------------------------------------------------------------


def per_rank(values: list[float], fmt: str) -> str:
    """One number when every rank agrees, else each rank's."""
    shown_values = [format(v, fmt) for v in values]
    return shown_values[0] if len(set(shown_values)) == 1 else " / ".join(shown_values)


def layer_part(res: dict[str, Any], n_layer: int, source: str) -> float | None:
    deeper = res.get("count_deeper")
    if not deeper:
        return None
    return (sum(deeper[source].values()) - sum(res["count"][source].values())) * n_layer


def report(args: argparse.Namespace, ranks: list[dict[str, Any]]) -> None:
    w, rows = args.world, ranks[0]
    tokens = args.batch * args.seq
    print(f"\n{args.preset} with n_layer={args.n_layer}, n_embd={args.n_embd}, n_head={args.n_head}, "
          f"vocab={args.vocab}; global batch {args.batch}x{args.seq} tokens per step for every row; {w} gloo ranks "
          f"x 1 thread; forward+backward+AdamW; median of {args.reps} reps after {args.warmup} warm-up, rows "
          "round-robin. Memory and communication per rank (both ranks' numbers when they differ).\n")
    print("| row | step ms (min-max) | tokens/s (min-max) | ours/torch | params+grads+optim MB | saved act. MB "
          "| peak RSS growth MB | comm Melem/step counted | comm Melem/step closed form |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows_of(args):
        res = rows[row.key]
        if not measured(res):
            print(f"| {row.label(w)} | {res['error'] or 'no measured repetition'} |  |  |  |  |  |  |  |")
            continue
        med, lo, hi = spread(res["times"])
        t_med, t_lo, t_hi = spread([tokens / t for t in res["times"]])
        mate = rows.get(row.mate) if row.mate else None
        ratio = shown(ratio_vs(rows, row.key, row.mate)) if mate and measured(mate) else "-"
        state = per_rank([sum(r[row.key]["memory"][k] for k in ("params_bytes", "grads_bytes", "optimizer_bytes"))
                          / MB for r in ranks], ".1f")
        saved = per_rank([r[row.key]["saved_bytes"] / MB for r in ranks], ".1f")
        growth = per_rank([r[row.key]["rss_growth_mb"] or float("nan") for r in ranks], ".0f")
        counted = per_rank([sum(r[row.key]["count"]["wire"].values()) / 1e6 for r in ranks], ".3f")
        closed = sum(closed_comm(row, args).values()) / 1e6
        print(f"| {row.label(w)} | {med * 1e3:.0f} ({lo * 1e3:.0f}-{hi * 1e3:.0f}) | {t_med:.0f} ({t_lo:.0f}-"
              f"{t_hi:.0f}) | {ratio} | {state} | {saved} | {growth} | {counted} | {closed:.3f} |")
    report_comm(args, ranks)


def report_comm(args: argparse.Namespace, ranks: list[dict[str, Any]]) -> None:
    w, rows = args.world, ranks[0]
    print(f"\nCommunication per step per rank, M elements on the wire (x4 = MB in fp32); ring terms, W={w}. "
          f"Blocks' closed form L*4*b*s*h*2(W-1)/W = {args.n_layer}*4*{args.batch}*{args.seq}*{args.n_embd}*"
          f"{2 * (w - 1)}/{w} (+ with SP the replicated parameters' gradients, see below); counted blocks' part = "
          "(count with L+1 blocks - count with L) * L.\n")
    print("| row | blocks closed | blocks counted | embed+head closed | loss closed | total closed "
          "| total counted: comm.VOLUME | total counted: CommDebugMode | by kind (CommDebugMode) | collectives "
          "| steady over steps |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows_of(args):
        res = rows[row.key]
        if res["error"]:
            print(f"| {row.label(w)} | {res['error']} |  |  |  |  |  |  |  |  |  |")
            continue
        closed = closed_comm(row, args)
        blocks = layer_part(res, args.n_layer, "wire")
        volume = (f"{sum(res['count']['volume'].values()) / 1e6:.3f}" if row.impl == "gptpar" else "-")
        kinds = ", ".join(f"{k} {v / 1e6:.3f}" for k, v in sorted(res["count"]["wire"].items()))
        print(f"| {row.label(w)} | {closed['blocks'] / 1e6:.3f} | "
              f"{'-' if blocks is None else f'{blocks / 1e6:.3f}'} | {closed['embed_head'] / 1e6:.3f} | "
              f"{closed['loss'] / 1e6:.3f} | {sum(closed.values()) / 1e6:.3f} | {volume} | "
              f"{sum(res['count']['wire'].values()) / 1e6:.3f} | {kinds} | {res['count']['calls']} | "
              f"{('yes' if res['volume_steady'] else 'no') if row.impl == 'gptpar' else '-'} |")
    print("\n(embed+head closed: the embedding's partial sum forward and the head's input gradient backward, "
          "b*s*h each; with SP + the replicated parameters' gradients in backward: both all-gather the gradient "
          "of this rank's position rows (s*h*(W-1)/W; ours via own_rows) and all-reduce ln_f's (2h); per block "
          "ours all-reduces the layer norms and row-parallel biases (6h), torch the layer norms' Partial "
          "gradients once per backward (4h); loss "
          "closed: loss parallelism 3*b*s, gathered loss the whole padded logits b*s*V_pad*(W-1)/W; DDP: every "
          "gradient once, 2(W-1)/W*N, blocks vs the rest; 'steady': ours' comm.VOLUME equal on every timed step; "
          "params+grads+optim: gptpar.train.memory.state_bytes after the first step; saved act.: bytes autograd "
          "keeps for backward after forward+loss; peak RSS growth: measured over one step after a reset)")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    command = shlex.join([sys.executable, *sys.argv])
    print("command:", command, flush=True)
    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores", flush=True)
    started = time.perf_counter()
    ranks = spawn_and_collect(rank_main, args)
    report(args, ranks)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "ranks": ranks}, indent=1))
    print(f"\nload average after: {os.getloadavg()[0]:.2f}; total {time.perf_counter() - started:.0f} s")
    print("command:", command)


if __name__ == "__main__":
    main()
