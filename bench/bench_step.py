"""Training step speed: gptpar's step beside a bare PyTorch loop and a tuned reference loop, in one process and run.

Setup (and why):
- One process on this machine's device (CUDA when visible, else the CPU with `--threads` torch threads), the same
  model shape, batch, sequence length and precision for every row, synthetic tokens of GPT-2's vocabulary.
- Rows:
  - `bare`: the GPT2LMHeadModel of gptpar.models.build.build_model (vocabulary unpadded), torch.optim.AdamW with torch's
    defaults, clip_grad_norm_, nothing else;
  - `tuned`: the loop the fastest public PyTorch GPT-2 trainers write (nanoGPT, llm.c's train_gpt2.py): the
    vocabulary padded to a multiple of 64 (and trained, as they do), SDPA attention (transformers' sdpa path:
    flash or memory-efficient kernels on a GPU), fused AdamW (foreach where a device has no fused kernel), whole-model
    torch.compile with the loss inside the compiled graph, as nanoGPT computes it in the model's forward, where a
    compiler is usable (`--compile`, on by default only on CUDA: on a CPU compiling takes minutes), bf16
    autocast when the compared precision is bf16, and no host synchronisation in the step;
  - `gptpar`: a Trainer built from a config (the code `gptpar train` runs, not a copy), timed through
    `Trainer.train_step` with the loss and gradient norm read back every `log.sync_every` steps as its loop reads
    them; first with gptpar's defaults for this device, then one row per fast-path option switched from its default.
- Rows run round-robin (the order rotating each round) so background load hits all alike; the first `--warmup`
  rounds are dropped (compilation, allocator warm-up) and each row's median step time over the rest gives tokens/s.
- Step time: CUDA events around each step on a GPU (the host never waits inside a round), perf_counter on a CPU.
  MFU from analysis/mfu.py (model FLOPs of the real vocabulary over the device's dense peak; n/a on a CPU). Peak
  allocator memory over a row's steps on CUDA; n/a on a CPU.
- Defaults: on a CPU `gpt2-mini`, 8 x 128 tokens, fp32 (under 5 minutes on 2 cores); on a GPU `gpt2`, 1024 tokens,
  the largest micro-batch that fits (`--batch max`, probed downwards from 64 by the most memory-hungry rows) and 8,
  in the precision train.precision=auto picks there.
- The flight recorder's cost (gptpar.parallel.flight, on in every run): two gloo ranks of data parallelism on this
  machine's CPUs (`--recorder-preset`, gpt2-tiny by default, vocabulary 512: the shortest step per collective is the
  worst case), the same step with the recorder on and off (`Recorder.on`, its ledger included), alternating step by
  step, each rank's median; and the cost of one span timed alone times the spans a step records, over the step,
  which resolves what the step times' noise cannot.
The last line is `gptpar/tuned: X.XXx, gptpar/bare: Y.YYx` for gptpar's default step (of the first batch size).

Run: .venv/bin/python bench/bench_step.py   (see --help; `make bench-step`)
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import tempfile
import time
import timeit
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from analysis.mfu import FlopsShape, utilisation
from gptpar.config import Config, ModelConfig, load_config
from gptpar.models.build import build_model, padded_vocab
from gptpar.models.loss import lm_loss
from gptpar.parallel.comm import comm_span
from gptpar.parallel.dims import ParallelDims
from gptpar.parallel.flight import RECORDER, mirrored
from gptpar.parallel.grid import grid_sizes
from gptpar.parallel.process_group import RankInfo
from gptpar.parallel.spawn import spawn_local
from gptpar.presets import PRESETS
from gptpar.run.folder import run_folder
from gptpar.run.logfile import RankLogger
from gptpar.train.optim import optimizer_kind
from gptpar.train.precision import AUTOCAST_DTYPES, resolve_precision
from gptpar.train.recompute import check_compiler
from gptpar.train.step_records import sync_every
from gptpar.train.trainer import Trainer

MB = 2**20
GPU_BATCHES = (64, 48, 32, 24, 16, 12, 8)  # --batch max tries these, largest first
SEED = 0
RECORDER_VOCAB = 512  # the recorder's rows: a small vocabulary keeps the step short, the recorder's worst case


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="", help="model.preset (default: gpt2-mini on a CPU, gpt2 on a GPU)")
    ap.add_argument("--seq", type=int, default=0, help="tokens per sequence (default: 128 on a CPU, 1024 on a GPU)")
    ap.add_argument("--batch", default="", help="comma-separated sequences per step, `max` = the largest that fits "
                                                "(default: 8 on a CPU, max,8 on a GPU)")
    ap.add_argument("--vocab", type=int, default=50257, help="vocabulary (GPT-2's by default)")
    ap.add_argument("--precision", default="", help="compared precision (default: what train.precision=auto picks "
                                                    "on this device: fp32 on a CPU, bf16 or fp16 on a GPU)")
    ap.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                    help="torch.compile in the tuned loop and as a gptpar row (auto: on with CUDA only)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads on a CPU")
    ap.add_argument("--warmup", type=int, default=1, help="rounds dropped before measuring")
    ap.add_argument("--rounds", type=int, default=4, help="measured rounds (round-robin over the rows)")
    ap.add_argument("--steps", type=int, default=0, help="steps per row and round (default: 1 on a CPU, 10 on a GPU)")
    ap.add_argument("--rows", default="", help="comma-separated rows to run (default: all; e.g. bare,tuned,gptpar)")
    ap.add_argument("--out", default="", help="also write the results as JSON here")
    ap.add_argument("--recorder-preset", default="gpt2-tiny", help="model of the recorder's on/off rows (2 ranks, "
                                                                   "gloo; empty: skip them)")
    ap.add_argument("--recorder-steps", type=int, default=20, help="steps per recorder row and round")
    return ap.parse_args(argv)


# --- the loops ---------------------------------------------------------------------------------------------------


class Batches:
    """Endless (x, y) batches of random tokens on the host, as a data loader hands them over (`pin`: in pinned
    memory, as the tuned trainers keep them, so that a non-blocking copy to a GPU does not wait for it)."""

    def __init__(self, batch: int, seq: int, vocab: int, pin: bool = False) -> None:
        gen = torch.Generator().manual_seed(SEED)
        blocks = [torch.randint(0, vocab, (batch, seq + 1), generator=gen) for _ in range(4)]
        self.pairs = [(b[:, :-1].contiguous(), b[:, 1:].contiguous()) for b in blocks]
        if pin:
            self.pairs = [(x.pin_memory(), y.pin_memory()) for x, y in self.pairs]
        self.i = 0

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.i += 1
        return self.pairs[self.i % len(self.pairs)]


@dataclass
class Loop:
    """A hand-written training step: forward under the compared precision's autocast, backward, clipping, AdamW."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    forward_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # token ids and targets to the mean loss
    batches: Batches
    device: torch.device
    dtype: torch.dtype | None
    clip_foreach: bool | None = None

    def step(self) -> None:
        x, y = next(self.batches)
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        with torch.autocast(self.device.type, dtype=self.dtype) if self.dtype else contextlib.nullcontext():
            loss = self.forward_loss(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0, foreach=self.clip_foreach)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def bare_loop(args: argparse.Namespace, device: torch.device, batch: int) -> Loop:
    model = build_model(replace(ModelConfig(preset=args.preset), pad_vocab=1), args.vocab, SEED).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1)
    return Loop(model.train(), optimizer, lambda x, y: lm_loss(model(x).logits, y),
                Batches(batch, args.seq, args.vocab), device, AUTOCAST_DTYPES.get(args.precision))


def tuned_loop(args: argparse.Namespace, device: torch.device, batch: int) -> Loop:
    """nanoGPT's step: a padded (trained) vocabulary, decayed matrices only, fused AdamW, the model and its loss
    compiled as one graph (nanoGPT computes the loss inside the compiled forward)."""
    model = build_model(replace(ModelConfig(preset=args.preset), pad_vocab=1), padded_vocab(args.vocab, 64), SEED)
    model = model.to(device).train()
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    kind = optimizer_kind(params, fused=True)
    optimizer = torch.optim.AdamW(groups, lr=6e-4, betas=(0.9, 0.95), **{kind: True})

    def forward_loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(x).logits.flatten(0, 1), y.flatten())

    return Loop(model, optimizer, torch.compile(forward_loss) if args.compile == "on" else forward_loss,
                Batches(batch, args.seq, args.vocab, pin=device.type == "cuda"), device,
                AUTOCAST_DTYPES.get(args.precision), clip_foreach=True)


@dataclass
class GptparStep:
    """gptpar's step: `Trainer.train_step` of a trainer built from a config; the loss and gradient norm are read
    back every log.sync_every steps, as the trainer's loop reads them for its records."""

    trainer: Trainer
    every: int
    batches: Iterator = field(init=False)

    def __post_init__(self) -> None:
        self.batches = self.trainer.batches(0, 0)

    def step(self) -> None:
        try:
            micro_batches = next(self.batches)
        except StopIteration:  # an epoch of synthetic tokens is done: the next one
            self.batches = self.trainer.batches(0, 0)
            micro_batches = next(self.batches)
        loss, grad_norm = self.trainer.train_step(micro_batches)
        self.trainer.step += 1
        if self.trainer.step % self.every == 0:
            torch.stack([loss.double(), grad_norm.to(loss.device, torch.float64)]).tolist()


def gptpar_config(args: argparse.Namespace, batch: int, runs: Path, name: str, overrides: list[str]) -> Config:
    steps = (args.warmup + args.rounds) * args.steps + 4
    return load_config(None, [
        f"model.preset={args.preset}", "data.source=synthetic", f"data.vocab_size={args.vocab}",
        f"data.seq_len={args.seq}", f"data.synthetic_tokens={max(1000, int(1.2 * (args.seq + 1) * batch * steps))}",
        f"train.batch_size={batch}", "train.warmup_steps=0", f"train.precision={args.precision}",
        f"train.threads={args.threads if args.device.type == 'cpu' else 0}", "log.progress=none",
        *(["train.compile=false"] if args.compile == "off" else []),
        f"log.runs_dir={runs}", f"log.run_id={name}", *overrides])


def gptpar_step(args: argparse.Namespace, info: RankInfo, batch: int, runs: Path, name: str,
                overrides: list[str]) -> GptparStep:
    cfg = gptpar_config(args, batch, runs, name, overrides)
    grid = ParallelDims.build(info, grid_sizes(cfg))
    folder = run_folder(cfg.log.runs_dir, cfg.log.run_id)
    folder.path.mkdir(parents=True, exist_ok=True)
    return GptparStep(Trainer(cfg, grid, folder, RankLogger(folder.path, 0)), sync_every(cfg.log.sync_every,
                                                                                          info.device))


def fast_path_rows(args: argparse.Namespace) -> dict[str, list[str]]:
    """gptpar's default step, then each fast-path option switched from its default on this device (train.precision
    is the compared precision, the same in every row)."""
    cuda = args.device.type == "cuda"
    switched = ["train.fused_optimizer=false", "model.pad_vocab=1",
                f"train.loss_kernel={'chunked' if cuda else 'plain'}", f"log.sync_every={1 if cuda else 10}"]
    if args.compile == "on":  # auto compiles the model on a GPU and nothing on a CPU
        switched += ["train.compile=false", "train.compile=blocks"] if cuda else ["train.compile=model"]
    return {"gptpar": [], **{f"gptpar {o}": [o] for o in switched}}


# --- measuring ---------------------------------------------------------------------------------------------------


@dataclass
class Row:
    name: str
    runner: Any = None
    error: str = ""
    times: list[float] = field(default_factory=list)
    peak: int | None = None


def timed_steps(runner: Any, n: int, device: torch.device) -> tuple[list[float], int | None]:
    """Seconds of n consecutive steps (CUDA events: the host queues them all before reading any) and, on CUDA,
    the allocator's peak over them."""
    if device.type != "cuda":
        times = []
        for _ in range(n):
            start = time.perf_counter()
            runner.step()
            times.append(time.perf_counter() - start)
        return times, None
    torch.cuda.reset_peak_memory_stats(device)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for begin, end in events:
        begin.record()
        runner.step()
        end.record()
    torch.cuda.synchronize(device)
    return [begin.elapsed_time(end) / 1000.0 for begin, end in events], torch.cuda.max_memory_allocated(device)


def one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:160]


def single_rank(device: torch.device) -> RankInfo:
    """Who-am-I of this one process, as `gptpar train` without a launcher sees itself."""
    return RankInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, master_addr="", master_port=0,
                    launcher="single", backend="gloo", device=device)


def build_rows(args: argparse.Namespace, batch: int, runs: Path) -> list[Row]:
    info = single_rank(args.device)
    makers: dict[str, Callable[[], Any]] = {"bare": lambda: bare_loop(args, args.device, batch),
                                            "tuned": lambda: tuned_loop(args, args.device, batch)}
    for name, overrides in fast_path_rows(args).items():
        makers[name] = lambda name=name, overrides=overrides: gptpar_step(
            args, info, batch, runs, f"b{batch}-{len(makers)}-{name.split()[-1].replace('=', '-')}", overrides)
    wanted = set(args.rows.split(",")) if args.rows else set(makers)
    if unknown := wanted - set(makers):
        raise SystemExit(f"bench_step: --rows {','.join(sorted(unknown))} is not a row here; rows: {', '.join(makers)}")
    rows = []
    for name, make in ((n, m) for n, m in makers.items() if n in wanted):
        row = Row(name)
        try:
            row.runner = make()
        except Exception as exc:  # a row that cannot be built (no compiler, ...) is reported, not fatal
            row.error = one_line(exc)
        rows.append(row)
    return rows


def measure(args: argparse.Namespace, batch: int) -> list[Row]:
    with tempfile.TemporaryDirectory() as tmp:
        rows = build_rows(args, batch, Path(tmp))
        live = [row for row in rows if not row.error]
        for rnd in range(args.warmup + args.rounds):
            for row in live[rnd % len(live):] + live[:rnd % len(live)]:
                if row.error:
                    continue
                try:
                    times, peak = timed_steps(row.runner, args.steps, args.device)
                except Exception as exc:  # out of memory, a compile failure: that row stops, the others go on
                    row.error, row.runner = one_line(exc), None
                    release(args.device)
                    continue
                if rnd >= args.warmup:
                    row.times += times
                    row.peak = max(row.peak or 0, peak) if peak is not None else None
        for row in rows:
            row.runner = None
        release(args.device)
    return rows


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def fits(args: argparse.Namespace, batch: int, rows: int) -> bool:
    """Whether the rows that hold the most train two steps at this batch beside what the other rows keep between
    their turns (parameters and optimizer state, measured after the step): the bare loop (fp32 copies of unpadded
    logits) and gptpar's step without compiling (compiled code holds no more)."""
    info = single_rank(args.device)
    capacity = torch.cuda.get_device_properties(args.device).total_memory
    with tempfile.TemporaryDirectory() as tmp:
        for make in (lambda: bare_loop(args, args.device, batch),
                     lambda: gptpar_step(args, info, batch, Path(tmp), "probe", ["train.compile=false"])):
            try:
                runner = make()
                _, peak = timed_steps(runner, 2, args.device)
                kept = torch.cuda.memory_allocated(args.device)
                del runner
                if peak + (rows - 1) * kept > 0.95 * capacity:
                    return False
            except torch.cuda.OutOfMemoryError:
                return False
            finally:
                release(args.device)
    return True


def largest_batch(args: argparse.Namespace) -> int:
    rows = len(args.rows.split(",")) if args.rows else 2 + len(fast_path_rows(args))
    for batch in GPU_BATCHES:
        if fits(args, batch, rows):
            return batch
    raise SystemExit(f"bench_step: not even a batch of {GPU_BATCHES[-1]} x {args.seq} tokens fits on {args.device}")


# --- report ------------------------------------------------------------------------------------------------------


def summarise(args: argparse.Namespace, batch: int, rows: list[Row]) -> list[dict[str, Any]]:
    shape = FlopsShape(PRESETS[args.preset], args.seq, args.vocab)
    tokens = batch * args.seq
    out = []
    for row in rows:
        entry: dict[str, Any] = {"row": row.name, "batch": batch, "error": row.error or None}
        if row.times:
            seconds = statistics.median(row.times)
            rate = tokens / seconds
            u = utilisation(rate, 1, args.device_name, args.precision, shape)
            entry |= {"step_s": seconds, "tokens_per_s": rate, "mfu": u.mfu, "mfu_note": u.note, "peak_bytes": row.peak}
        out.append(entry)
    tuned = next((e["tokens_per_s"] for e in out if e["row"] == "tuned" and "tokens_per_s" in e), None)
    for entry in out:
        entry["vs_tuned"] = entry["tokens_per_s"] / tuned if tuned and "tokens_per_s" in entry else None
    return out


def report(args: argparse.Namespace, batch: int, entries: list[dict[str, Any]]) -> None:
    compiled = {"on": "compiled (torch.compile of the whole model)",
                "off": "not compiled (--compile on to compile; minutes on a CPU)"}[args.compile]
    print(f"\n{args.preset}, {batch} x {args.seq} tokens per step, vocabulary {args.vocab}, {args.precision}, on "
          f"{args.device_name}; tuned loop {compiled}; median of {args.rounds * args.steps} steps per row after "
          f"{args.warmup} warm-up round(s)")
    print("| row | tokens/s | step (ms) | MFU | allocator peak (MB) | vs tuned |")
    print("|---|---|---|---|---|---|")
    for e in entries:
        if "tokens_per_s" not in e:
            print(f"| {e['row']} | failed: {e['error']} | | | | |")
            continue
        mfu = f"{e['mfu']:.1%}" if e["mfu"] is not None else e["mfu_note"]
        peak = f"{e['peak_bytes'] / MB:,.0f}" if e["peak_bytes"] is not None else "n/a"
        ratio = f"{e['vs_tuned']:.2f}x" if e["vs_tuned"] else "n/a"
        print(f"| {e['row']} | {e['tokens_per_s']:,.0f} | {e['step_s'] * 1e3:,.1f} | {mfu} | {peak} | {ratio} |")


def ratio_line(entries: list[dict[str, Any]]) -> str:
    rate = {e["row"]: e.get("tokens_per_s") for e in entries}
    ours, tuned, bare = rate.get("gptpar"), rate.get("tuned"), rate.get("bare")
    show = lambda a, b: f"{a / b:.2f}x" if a and b else "n/a"  # noqa: E731
    return f"gptpar/tuned: {show(ours, tuned)}, gptpar/bare: {show(ours, bare)}"


# --- the flight recorder's cost -------------------------------------------------------------------------------------


def span_seconds(on: bool, n: int = 20_000) -> float:
    """One labelled collective's span around nothing (the recorder's whole cost), with the recorder on or off."""
    RECORDER.on = on

    def span() -> None:
        with comm_span("all_reduce", nbytes=8):
            pass
    return min(timeit.repeat(span, number=n, repeat=5)) / n


def recorder_rank(info: RankInfo, args: argparse.Namespace, out: str) -> None:
    """One of two data-parallel ranks: gptpar's step with the recorder on and off, round-robin; each rank writes its
    medians, the spans one step records, and one span's cost on and off."""
    small = argparse.Namespace(**{**vars(args), "preset": args.recorder_preset, "steps": args.recorder_steps,
                                  "vocab": RECORDER_VOCAB, "threads": 1})  # a thread per rank: two ranks share
    with tempfile.TemporaryDirectory() as tmp, mirrored(Path(tmp, "ledger")):  # on, as in a run: with its ledger
        runner = gptpar_step(small, info, 8, Path(tmp), f"recorder-{info.rank}", ["parallel.dp=2"])
        times: dict[bool, list[float]] = {True: [], False: []}
        for i in range(2 * (args.warmup + args.rounds) * small.steps):  # on and off step by step: drift hits both
            RECORDER.on = i % 2 == 0
            measured, _ = timed_steps(runner, 1, args.device)
            if i >= 2 * args.warmup * small.steps:
                times[RECORDER.on] += measured
        RECORDER.on = True
        before = sum(RECORDER.seqs.values())
        runner.step()
        spans = sum(RECORDER.seqs.values()) - before
        span_on, span_off = span_seconds(True), span_seconds(False)
    Path(out, f"rank{info.rank}.json").write_text(json.dumps({
        "on_s": statistics.median(times[True]), "off_s": statistics.median(times[False]), "spans": spans,
        "span_on_s": span_on, "span_off_s": span_off}))
    RECORDER.on = True


def report_recorder(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as out:
        spawn_local(recorder_rank, 2, args, out)
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(2)]
    print(f"\nThe flight recorder, {args.recorder_preset}, 8 x {args.seq} tokens per step, vocabulary "
          f"{RECORDER_VOCAB}, dp=2 on gloo (2 local processes); median of {args.rounds * args.recorder_steps} steps "
          "per row and rank")
    print("| rank | recorder on (ms) | off (ms) | on/off | spans a step | one span on/off (us) | share of a step |")
    print("|---|---|---|---|---|---|---|")
    for rank, r in enumerate(ranks):
        share = r["spans"] * (r["span_on_s"] - r["span_off_s"]) / r["off_s"]
        print(f"| {rank} | {r['on_s'] * 1e3:,.2f} | {r['off_s'] * 1e3:,.2f} | {r['on_s'] / r['off_s']:.3f} | "
              f"{r['spans']} | {r['span_on_s'] * 1e6:.2f} / {r['span_off_s'] * 1e6:.2f} | {share:.4%} |")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    args.device = torch.device("cuda:0" if cuda else "cpu")
    args.device_name = torch.cuda.get_device_name(args.device) if cuda else "cpu"
    if not cuda:
        torch.set_num_threads(args.threads)
    args.preset = args.preset or ("gpt2" if cuda else "gpt2-mini")
    args.seq = args.seq or (1024 if cuda else 128)
    args.steps = args.steps or (10 if cuda else 1)
    args.precision = args.precision or resolve_precision("auto", args.device)
    if args.compile == "auto":
        args.compile = "on" if cuda else "off"
    if args.compile == "on":
        try:
            check_compiler(args.device)  # the trainer's own check that inductor works here
        except Exception as exc:
            print(f"bench_step: compiling is off ({one_line(exc)})")
            args.compile = "off"
    batches = [largest_batch(args) if b == "max" else int(b) for b in (args.batch or ("max,8" if cuda else "8"))
               .split(",")]
    results = []
    for batch in dict.fromkeys(batches):
        entries = summarise(args, batch, measure(args, batch))
        report(args, batch, entries)
        results.append(entries)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    if args.recorder_preset:
        report_recorder(args)
    print(ratio_line(results[0]))


if __name__ == "__main__":
    main()
