"""`gptpar plan calibrate`: time this device's compute and its backend's collectives, and write a calibration.

The only planner module that imports torch. Device and backend are chosen at run time as the trainer chooses them
(gptpar.parallel.process_group): CUDA with NCCL where GPUs are visible (timed with CUDA events, gptpar.clock), else
the CPU with gloo. Every rank measures compute at the same time, as the ranks of a job compute side by side; rank 0's
numbers are kept (on a CPU, whose ranks share the machine's cores, rank 0 also measures alone first: what a one-rank
layout gets). Each number is the median of several calls: the planner predicts the typical step. Collectives are
measured over all ranks (one GPU measures none: a cluster's links then come from its profile). The pieces timed are
the model's own (gptpar.models' embedding, block and head pieces), so a block costs here what it costs in training.
"""

from __future__ import annotations

import datetime
import itertools
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from gptpar.atomic import atomic_write_text
from gptpar.clock import DeviceClock
from gptpar.config import Config, ModelConfig, ParallelConfig, updated
from gptpar.models import architecture
from gptpar.models.build import build_model
from gptpar.parallel.comm import all_gather, reduce_scatter
from gptpar.parallel.context_parallel import IMPLS, ContextParallel
from gptpar.parallel.dims import ParallelDims
from gptpar.parallel.process_group import RankInfo, new_group
from gptpar.parallel.spawn import spawn_local
from gptpar.parallel.tensor_parallel import loss_function, shard_model
from gptpar.plan.calibration import RECOMPUTED, Calibration, cp_kind, local_device_name, tp_kind
from gptpar.plan.layout import block_flops, head_flops
from gptpar.presets import ModelShape
from gptpar.tensor_bytes import saved_activation_bytes
from gptpar.train.optim import clip_gradients
from gptpar.train.precision import AUTOCAST_DTYPES, Precision, resolve_precision
from gptpar.train.recompute import checkpoint_blocks, whole_logits_loss


@dataclass(frozen=True)
class Probes:
    """What to measure: (width, heads) shapes, micro-batch shapes as (sequences, seq_len), collective sizes."""

    widths: tuple[tuple[int, int], ...]
    batches: tuple[tuple[int, int], ...]
    comm_bytes: tuple[int, ...]
    optimizer_params: tuple[int, ...]
    vocab: int
    repeats: int
    comm_iters: int = 50  # most calls of a collective timed per size (about 200 MB moved, at least 3)


CPU_PROBES = Probes(((128, 4), (256, 8), (512, 8), (768, 12)), ((1, 64), (4, 64), (2, 256)),
                tuple(4 ** k * 1024 for k in range(0, 7)), (10**5, 10**6, 10**7), 4096, 5)
GPU_PROBES = Probes(((768, 12), (1600, 25), (2048, 16)), ((1, 1024), (4, 1024), (8, 1024)),
                tuple(4 ** k * 65536 for k in range(0, 7)), (10**6, 10**7, 10**8), 50304, 10)
TENSORS = 48  # tensors the optimizer's parameters come in: a few blocks' worth (GPT-2 has 12 a block)
QUICK_PROBES = Probes(((128, 4), (256, 8)), ((1, 64), (4, 64)), (4096, 65536, 1048576), (10**5, 10**6), 4096, 3)


def _timer(device: torch.device, repeats: int, synced: bool = False,
           now: Callable[[], float] = time.perf_counter) -> Callable[..., float]:
    """The median device seconds of `fn` over `repeats` calls after one warm-up, `setup` (untimed) before each and
    its result passed to `fn`. The median, not the fastest: a step is a sum of many pieces, and the sum of each
    piece's luckiest call is faster than any step; the report, too, compares a plan with the run's mean step.
    `synced` work (collectives between its computations) takes the mean instead: each of its collectives waits for
    the slowest rank's part before it, and in a step that wait is the typical one, not the luckiest
    (_collective_points). `now` is DeviceClock's clock off a GPU."""
    def timed(fn: Callable[..., object], setup: Callable[[], object] | None = None) -> float:
        samples = []
        for i in range(repeats + 1):
            args = (setup(),) if setup else ()
            clock = DeviceClock(device, now)
            fn(*args)
            clock.stop()
            if i:
                samples.append(clock.seconds())
        return statistics.mean(samples) if synced else statistics.median(samples)
    return timed


def _block_times(block: nn.Module, hidden: torch.Tensor, precision: Precision, timed: Callable[..., float]
                 ) -> tuple[float, float, float]:
    """Seconds of `block`'s F, B (input gradient only) and W (the rest of its backward) on `hidden`."""
    grad = torch.randn_like(hidden)

    def forward() -> tuple[torch.Tensor, torch.Tensor]:
        x = hidden.clone().requires_grad_(True)
        with precision.autocast():
            return x, block(x)

    def full(state: tuple[torch.Tensor, torch.Tensor]) -> None:
        state[1].backward(grad.to(state[1].dtype))

    def input_only(state: tuple[torch.Tensor, torch.Tensor]) -> None:
        torch.autograd.grad(state[1], [state[0]], grad.to(state[1].dtype))

    f_s, bw_s, b_s = timed(forward), timed(full, forward), timed(input_only, forward)
    block.zero_grad(set_to_none=True)
    return f_s, b_s, max(bw_s - b_s, 0.05 * bw_s)  # W is what the whole backward adds to the input gradient's


def _head_times(embed: nn.Module, head: nn.Module, loss_of: Callable[..., torch.Tensor], ids: torch.Tensor,
                targets: torch.Tensor, precision: Precision, timed: Callable[..., float]) -> tuple[float, float]:
    """Seconds of the embedding, head and loss forward, and of their backward, on token ids `ids`."""

    def head_forward() -> torch.Tensor:
        with precision.autocast():
            return loss_of(head(embed(ids)), targets)

    return timed(head_forward), timed(lambda loss: loss.backward(), head_forward)


def _eager_loss(device: torch.device) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The loss of whole logits the trainer runs where it does not compile (train.loss_kernel=auto), as every piece
    here is timed eager."""
    return whole_logits_loss(updated(Config(), {"train.compile": "false"}), device)


def _small_block_model(width: int, heads: int, seq: int, vocab: int) -> nn.Module:
    return build_model(ModelConfig(preset="gpt2-tiny", n_layer=1, n_embd=width, n_head=heads,
                                   n_positions=max(seq, 64)), vocab, seed=0)


def _block_points(shape: ModelShape, width: int, heads: int, batch: tuple[int, int], vocab: int,
                  device: torch.device, precision: Precision, repeats: int) -> dict[str, tuple[float, float]]:
    """One block's F, B (input gradient only) and W (the rest of its backward), and the embedding plus head and
    loss forward and backward, for a micro-batch of `batch` = (sequences, seq_len) tokens."""
    seqs, seq = batch
    model = _small_block_model(width, heads, seq, vocab).to(device)
    arch = architecture(model)
    embed, block, head = arch.embed_piece(model), arch.block_piece(model, 0), arch.head_piece(model)
    timed = _timer(device, repeats)
    tokens = seqs * seq
    ids = torch.randint(0, vocab, (seqs, seq), device=device)
    hidden = torch.randn(seqs, seq, width, device=device)
    f_s, b_s, w_s = _block_times(block, hidden, precision, timed)
    params = [p for p in block.parameters()]

    def counted_forward() -> int:  # as the pipeline engine runs a stage: counting what autograd saves
        with precision.autocast():
            return saved_activation_bytes(lambda: block(hidden.clone().requires_grad_(True)), params)

    saved = counted_forward()

    hf_s, hbw_s = _head_times(embed, head, _eager_loss(device), ids, torch.randint_like(ids, vocab), precision,
                              timed)
    f, b, w = block_flops(shape, tokens, seq)
    hf = head_flops(width, vocab, tokens)
    points = {"block_f": (f, f_s), "block_f_counted": (f, timed(counted_forward)), "block_b": (b, b_s),
              "block_w": (w, w_s), "head_f": (hf, hf_s), "head_bw": (2 * hf, hbw_s),
              "saved": (tokens * width, float(saved))}
    # The same block under the trainer's activation checkpointing: its forward keeps only the input (through
    # torch.utils.checkpoint's saved-tensor hooks), and backward runs that forward again before B.
    checkpoint_blocks(model, 1)
    for kind, flops, seconds in zip(RECOMPUTED, (f, b, w), _block_times(block, hidden, precision, timed), strict=True):
        points[kind] = (flops, seconds)
    return points


def _tp_block_points(dims: ParallelDims, shape: ModelShape, width: int, heads: int, batch: tuple[int, int],
                     vocab: int, precision: Precision, repeats: int) -> dict[str, tuple[float, float]]:
    """Our tensor-parallel block over all the ranks, with and without sequence parallelism: F, B and W with the
    collectives between its matmuls, the copies around them and the norms and residuals every rank repeats, which
    a whole block's per-FLOP rate scaled by 1/tp leaves out (bench-plan: tp=2 ran 35% slower than that sum); and the
    vocabulary-parallel embedding, head and loss, with and without loss parallelism."""
    tp, (seqs, seq) = dims.world_size, batch
    timed = _timer(dims.device, repeats, synced=True)
    ids, targets = torch.randint(0, vocab, (2, seqs, seq), device=dims.device)
    points = {}
    for sp, lp in itertools.product((False, True), (False, True)):
        pcfg = ParallelConfig(tp=tp, sequence_parallel=sp, loss_parallel=lp)
        model = shard_model(_small_block_model(width, heads, seq, vocab), pcfg, dims, dims.device)
        arch = architecture(model)
        if not lp:  # the blocks do not depend on the loss
            hidden = torch.randn(seqs, seq // tp if sp else seq, width, device=dims.device)
            times = _block_times(arch.block_piece(model, 0), hidden, precision, timed)
            for kind, f, s in zip(("block_f", "block_b", "block_w"), block_flops(shape, seqs * seq, seq, tp), times,
                                  strict=True):
                points[tp_kind(kind, tp, sp)] = (f, s)
        hf = head_flops(width, vocab, seqs * seq, tp)
        loss = loss_function(pcfg, dims, vocab, _eager_loss(dims.device))
        head_s = _head_times(arch.embed_piece(model), arch.head_piece(model), loss, ids, targets, precision, timed)
        for kind, f, s in zip(("head_f", "head_bw"), (hf, 2 * hf), head_s, strict=True):
            points[tp_kind(kind, tp, sp, lp)] = (f, s)
    return points


def _cp_block_points(dims: ParallelDims, shape: ModelShape, width: int, heads: int, batch: tuple[int, int],
                     vocab: int, precision: Precision, repeats: int) -> dict[str, tuple[float, float]]:
    """One block under context parallelism over all the ranks, for each parallel.cp_impl whose split the shape
    allows (all_to_all's needs heads % cp), built as the trainer builds it (a ContextParallel attached to the model,
    attention inside `sharded`): F, B and W on this rank's seq_len / cp tokens with the exchanges between, which the
    plain block's per-FLOP rate leaves out: the ring attends block by block as plain matmuls, Python between them, and
    all_to_all reorders and copies q, k, v and the output (bench-plan: cp=2 ran 47% and 40% slower than that sum)."""
    cp, (seqs, seq) = dims.world_size, batch
    timed = _timer(dims.device, repeats, synced=True)
    hidden = torch.randn(seqs, seq // cp, width, device=dims.device)
    flops = block_flops(shape, seqs * seq // cp, seq)
    points = {}
    for impl in (i for i in IMPLS if i == "ring" or heads % cp == 0):
        model = _small_block_model(width, heads, seq, vocab).to(dims.device)
        context = ContextParallel(dims.group("cp"), impl)
        context.attach(model)
        with context.sharded():
            times = _block_times(architecture(model).block_piece(model, 0), hidden, precision, timed)
        for kind, f, s in zip(("block_f", "block_b", "block_w"), flops, times, strict=True):
            points[cp_kind(kind, cp, impl)] = (f, s)
    return points


def _optimizer_point(n: int, device: torch.device, repeats: int, groups: list[dist.ProcessGroup] | None = None
                     ) -> tuple[float, float]:
    """AdamW (fused where the device has it, as the trainer picks) plus the trainer's clip of the gradient norm
    (gptpar.train.optim.clip_gradients) over n parameters in TENSORS tensors: torch's own without `groups`, else the
    per-tensor sum of squares that layouts with pipeline stages, shards or tensor-parallel pieces run."""
    params = [torch.nn.Parameter(torch.randn(n // TENSORS, device=device)) for _ in range(TENSORS)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)

    def step() -> None:
        clip_gradients(params, 1.0, groups or ())
        opt.step()

    return float(n), _timer(device, repeats)(step)


def _collective_points(op: str, sizes: tuple[int, ...], world: int, device: torch.device, most: int
                       ) -> list[list[float]]:
    """(bytes, seconds) of `op` over the whole group for each size: the tensor's whole bytes, as ring_share takes
    them (an all-reduce's payload, an all-gather's output, a reduce-scatter's or all-to-all's input)."""
    points = []
    for size in sizes:
        n = max(world, size // 4 // world * world)
        buf = torch.ones(n, device=device)
        out = torch.empty(n // world if op == "reduce_scatter" else n, device=device)
        shard = torch.ones(n // world, device=device)
        calls = {
            "all_reduce": lambda b=buf: dist.all_reduce(b),
            "reduce_scatter": lambda b=buf, o=out: reduce_scatter(o, b),
            "all_gather": lambda b=buf, s=shard: all_gather(b, s),
            "all_to_all": lambda b=buf, o=out: dist.all_to_all_single(o, b),
            "send_recv": lambda b=buf: (dist.send(b, 1) if dist.get_rank() == 0 else dist.recv(b, 0))
            if dist.get_rank() < 2 else None,
        }
        call = calls[op]
        for _ in range(2):
            call()
        iters = max(3, min(most, int(2e8 // max(size, 1))))
        dist.barrier()
        clocks = []
        for _ in range(iters):
            clocks.append(DeviceClock(device))
            call()
            clocks[-1].stop()
        table = torch.tensor([c.seconds() for c in clocks], dtype=torch.float64, device=device)
        dist.all_reduce(table, op=dist.ReduceOp.MAX)  # a call ends when its last rank's does
        # The mean call, not the fastest (as _timer's synced work): a step issues its collectives one at a time
        # between computations, and each pays the typical wake-up of the backend's threads. On a CPU the fastest
        # of a burst of back-to-back calls is several times faster than the mean (gloo: 0.3 against 1.1 ms for
        # 1 KB), and a step of many small all-reduces (one per parameter) took the mean's time.
        points.append([float(n * 4), float(table.mean().item())])
    return points


LOADED = 0.5  # a 1-minute load average above this share of the CPUs: other work shares the machine's cores


def load_warning(load: float, cpus: int) -> str | None:
    """One line where the machine is busy with other work (a login node): its timings would measure that work too."""
    if load <= LOADED * cpus:
        return None
    return (f"warning: this machine's load average is {load:.1f} on {cpus} CPU(s): other work shares it, so these "
            "timings measure that work too; calibrate on an idle node (inside an allocation, e.g. srun)")


def _progress(rank: int) -> Callable[[str], None]:
    """Rank 0's progress line per piece on stderr (a calibration takes minutes), with the seconds since it began."""
    began = time.monotonic()

    def say(piece: str) -> None:
        if rank == 0:
            print(f"calibrate: {piece} ({time.monotonic() - began:.0f} s)", file=sys.stderr, flush=True)
    return say


def measure_rank(info: RankInfo | None, probes: Probes, precision: str, threads: int, out: Path) -> None:
    """One rank's measurements; rank 0 writes them to `out` as JSON."""
    if threads:
        torch.set_num_threads(threads)
    device = info.device if info is not None else (torch.device("cuda") if torch.cuda.is_available()
                                                    else torch.device("cpu"))
    amp = Precision(AUTOCAST_DTYPES.get(precision), device, tf32=precision == "tf32", name=precision)
    amp.set_matmul_precision()  # the trainer's: TF32 matmuls under tf32 only
    rank, world = (info.rank, info.world_size) if info is not None else (0, 1)
    saved: list[float] = []
    say = _progress(rank)

    # A group of this rank alone, for the grouped clip's own all-reduce (every rank makes every rank's, in order).
    solo = None
    for r in range(world if world > 1 else 0):
        group = new_group([r])
        solo = group if r == rank else solo

    def all_compute(ranks: str) -> dict[str, list[list[float]]]:
        compute: dict[str, list[list[float]]] = {}
        saved.clear()
        for width, heads in probes.widths:
            shape = ModelShape("gpt2", 1, width, heads, 1024)
            for batch in probes.batches:
                say(f"a block of width {width}, micro-batch {batch[0]}x{batch[1]}, {ranks}")
                points = _block_points(shape, width, heads, batch, probes.vocab, device, amp, probes.repeats)
                per_token_width, saved_bytes = points.pop("saved")
                saved.append(saved_bytes / per_token_width)
                for kind, (flops, seconds) in points.items():
                    compute.setdefault(kind, []).append([flops, seconds])
        say(f"the optimizer step, {ranks}")
        compute["optimizer"] = [list(_optimizer_point(n, device, probes.repeats)) for n in probes.optimizer_params]
        if solo is not None:
            compute["optimizer_grouped"] = [list(_optimizer_point(n, device, probes.repeats, [solo]))
                                            for n in probes.optimizer_params]
        return compute

    def tp_compute(compute: dict[str, list[list[float]]]) -> None:
        dims = ParallelDims.build(info, {"tp": world})
        for width, heads in probes.widths:
            if heads % world:
                continue
            for batch in probes.batches:
                if batch[1] % world:
                    continue
                say(f"a tensor-parallel block of width {width}, micro-batch {batch[0]}x{batch[1]}, {world} ranks")
                points = _tp_block_points(dims, ModelShape("gpt2", 1, width, heads, 1024), width, heads, batch,
                                          probes.vocab, amp, probes.repeats)
                for kind, point in points.items():
                    compute.setdefault(kind, []).append(list(point))

    def cp_compute(compute: dict[str, list[list[float]]]) -> None:
        dims = ParallelDims.build(info, {"cp": world})
        for (width, heads), batch in itertools.product(probes.widths, probes.batches):
            if batch[1] % (2 * world) == 0:  # either implementation splits a row into 2 cp chunks
                say(f"a context-parallel block of width {width}, micro-batch {batch[0]}x{batch[1]}, {world} ranks")
                points = _cp_block_points(dims, ModelShape("gpt2", 1, width, heads, 1024), width, heads, batch,
                                          probes.vocab, amp, probes.repeats)
                for kind, point in points.items():
                    compute.setdefault(kind, []).append(list(point))

    alone: dict[str, list[list[float]]] = {}
    if device.type == "cpu" and world > 1:  # ranks share this machine's cores: one rank alone computes faster
        if rank == 0:
            alone = all_compute("rank 0 alone")
        dist.barrier()
    compute = all_compute(f"{world} rank(s) at once")
    if world > 1:
        tp_compute(compute)
        cp_compute(compute)
    collectives = {}
    if world > 1:
        for op in ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "send_recv"):
            say(f"{op} of {len(probes.comm_bytes)} sizes on {world} ranks")
            collectives[op] = _collective_points(op, probes.comm_bytes, world, device, probes.comm_iters)
    if rank == 0:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else local_device_name()
        calib = Calibration(
            device=device.type, device_name=name, backend=info.backend if info is not None else "none",
            precision=precision, torch_version=torch.__version__, threads=torch.get_num_threads(),
            date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            host=socket.gethostname(), world_size=world, compute=compute, compute_alone=alone,
            activation_bytes_per_token_width=statistics.median(saved), collectives=collectives,
            source=f"measured by gptpar plan calibrate on {socket.gethostname()} ({name})")
        atomic_write_text(out, calib.to_json())


def calibrate(out: str | Path, quick: bool = False, world: int = 0, precision: str = "auto", threads: int = 0,
              probes: Probes | None = None, load: tuple[float, int] | None = None) -> Calibration:
    """Measure this machine (`world` ranks: by default 2 on a CPU, every visible GPU up to 8 on CUDA) and write the
    calibration to `out`, warning first where the machine is loaded (`load`: its 1-minute load average and CPU count,
    by default this machine's)."""
    from gptpar.plan.calibration import load as load_calibration

    if (warning := load_warning(*(load or (os.getloadavg()[0], os.cpu_count() or 1)))) is not None:
        print(warning, file=sys.stderr, flush=True)

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    precision = resolve_precision(precision, torch.device("cuda" if gpus else "cpu"))  # as the trainer resolves it
    probes = probes or (QUICK_PROBES if quick else GPU_PROBES if gpus else CPU_PROBES)
    world = world or (min(gpus, 8) if gpus else 2)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if world == 1:
        measure_rank(None, probes, precision, threads, out)
    else:
        os.environ.setdefault("OMP_NUM_THREADS", str(threads or 1))
        with tempfile.TemporaryDirectory():
            spawn_local(measure_rank, world, probes, precision, threads, out,
                        pcfg=ParallelConfig(dp=world, backend="auto", timeout_s=1800))
    return load_calibration(out)


def dump(calib: Calibration) -> str:
    """A calibration's header as one line for the command's output."""
    return json.dumps({k: getattr(calib, k) for k in ("device_name", "backend", "precision", "torch_version",
                                                       "threads", "world_size", "date")})
