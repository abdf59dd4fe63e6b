"""GPipe in one process: an nn.Sequential cut into partitions, one worker thread per partition.

Each partition owns a thread, so partitions overlap even when they share a device (CPU included):
torch releases the GIL inside its ops. Micro-batch i reaches partition j through a future, so the
GPipe clock schedule (`clock_cycles`) fixes the order in which tasks are queued while no clock waits
for a global barrier.

Backward overlaps too. With autograd recording, the graph is cut at every partition boundary: the
caller's `backward()` runs only the last partition (in the caller's thread), and reaching a
boundary hands the gradient to the worker of the partition before it, which runs that partition's
backward as its own graph task (torch runs backward calls from different threads concurrently).
So partition j-1's backward of micro-batch i runs while partition j handles micro-batch i-1.
An `_Anchor` node in the caller's graph, reached only after every last-partition micro-batch,
waits for all worker backwards, re-raises their first failure and passes the input's gradient on,
so `backward()` returns with every `.grad` complete.

Limits of the cut graph: `torch.autograd.grad` reaches only the last partition's parameters and the
input (earlier partitions still accumulate into `.grad`), a pipelined forward can be backpropagated
once, and a parameter used by two partitions (a tied embedding on one device) accumulates once per
graph task, so its `register_post_accumulate_grad_hook` fires more than once per backward.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass

import torch
from torch import nn

from gptpar.errors import GptparError


class PipeError(RuntimeError):
    """A partition failed; `__cause__` is the exception raised inside the worker."""


class WithDevice(nn.Module):
    """Pins a module without parameters (or with parameters already there) to a device.

    Keeps them as `_module` and `_device` (read through `module` and `device`) as the assignment's does,
    so code and state_dict keys (`_module.*`) written for that class work with this one."""

    def __init__(self, module: nn.Module, device: torch.device | str) -> None:
        super().__init__()
        self._module = module
        self._device = torch.device(device)

    @property
    def module(self) -> nn.Module:
        return self._module

    @property
    def device(self) -> torch.device:
        return self._device

    def forward(self, *args, **kwargs):
        return self._module(*args, **kwargs)


def _tensor_devices(module: nn.Module) -> set[torch.device]:
    return {t.device for t in (*module.parameters(), *module.buffers())}


def _device_of(index: int, module: nn.Module) -> torch.device | None:
    """The device a child runs on, or None when it has no tensors and no WithDevice."""
    devices = _tensor_devices(module)
    if isinstance(module, WithDevice):
        if devices - {module.device}:
            raise GptparError(f"child {index} is WithDevice({module.device}) but holds tensors on "
                              f"{', '.join(sorted(map(str, devices)))}")
        return module.device
    if len(devices) > 1:
        raise GptparError(f"child {index} ({type(module).__name__}) has parameters on several devices "
                          f"({', '.join(sorted(map(str, devices)))}); move it to one device")
    return next(iter(devices), None)


def _layers(module: nn.Module) -> list[nn.Module]:
    """What a child puts into its partition: WithDevice unwrapped, an nn.Sequential's own children (one level,
    as the assignment's `_assemble_partition` flattens them), so a partition is a flat list of layers."""
    module = module.module if isinstance(module, WithDevice) else module
    return list(module.children()) if isinstance(module, nn.Sequential) else [module]


def split_module(seq: nn.Sequential, balance: list[int] | None = None
                 ) -> tuple[list[nn.Sequential], list[torch.device]]:
    """Partitions of consecutive children and their devices.

    Without `balance`, a new partition starts wherever the device changes; a child without tensors
    or WithDevice joins the current partition. With `balance` (children per partition, as in
    torchgpipe), partitions may share a device: that is how two CPU stages are made. A child that
    is an nn.Sequential counts as one child here and is flattened into its partition.
    """
    children = list(seq.children())
    if not children:
        raise ValueError("cannot split an empty nn.Sequential")
    devices = [_device_of(i, child) for i, child in enumerate(children)]
    if balance is None:
        groups: list[list[int]] = []
        current: torch.device | None = None
        for i, dev in enumerate(devices):
            if groups and (dev is None or dev == current or current is None):
                groups[-1].append(i)
            else:
                groups.append([i])
            current = dev if dev is not None else current
    else:
        if any(b < 1 for b in balance) or sum(balance) != len(children):
            raise ValueError(f"balance {balance} must be positive and sum to {len(children)} children")
        bounds = [0, *itertools.accumulate(balance)]
        groups = [list(range(a, b)) for a, b in itertools.pairwise(bounds)]
    partitions, part_devices = [], []
    for group in groups:
        found = {devices[i] for i in group} - {None}
        if len(found) > 1:
            raise GptparError(f"partition of children {group[0]}..{group[-1]} spans devices "
                              f"{', '.join(sorted(map(str, found)))}; one partition runs on one device")
        dev = found.pop() if found else (part_devices[-1] if part_devices else torch.device("cpu"))
        partitions.append(nn.Sequential(*(layer for i in group for layer in _layers(children[i]))))
        part_devices.append(dev)
    return partitions, part_devices


_split_module = split_module  # the assignment's name


def clock_cycles(num_batches: int, num_partitions: int) -> Iterator[list[tuple[int, int]]]:
    """GPipe forward schedule: clock k runs micro-batch i on partition k - i, for every valid pair."""
    for k in range(num_batches + num_partitions - 1):
        yield [(i, k - i) for i in range(max(0, k - num_partitions + 1), min(k + 1, num_batches))]


_clock_cycles = clock_cycles  # the assignment's name


@dataclass(frozen=True)
class PipeStats:
    """Timing of the last forward, taken inside the workers (host clock; on CUDA it shows launch
    time, not kernel time)."""

    busy_s: tuple[float, ...]  # seconds each worker spent running its partition
    span_s: float  # first task start to last task end

    @property
    def bubble(self) -> tuple[float, ...]:
        """Idle share of each worker over the span."""
        return tuple(1.0 - b / self.span_s if self.span_s > 0 else 0.0 for b in self.busy_s)


def _serve(tasks: queue.SimpleQueue) -> None:
    """Worker loop; holds no reference to the Pipe so the Pipe can be collected."""
    while True:
        item = tasks.get()
        if item is None:
            return
        fn, future = item
        try:
            future.set_result(fn())
        except BaseException as exc:  # noqa: B036 - handed to the caller, which re-raises it
            future.set_exception(exc)
        del fn, future, item


def _stop(workers: list[tuple[threading.Thread, queue.SimpleQueue]]) -> None:
    for _, tasks in workers:
        tasks.put(None)
    for thread, _ in workers:
        if thread is not threading.current_thread():
            thread.join()
    workers.clear()


def _caller_autocast(device_type: str) -> Callable[[], contextlib.AbstractContextManager]:
    """The calling thread's autocast for a device type, to enter again in a worker: autocast state is
    thread-local, so a worker would otherwise run the partition in full precision. A new context per call
    (an autocast context keeps the state it replaced and cannot be entered twice at once)."""
    enabled, dtype = torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
    cache = torch.is_autocast_cache_enabled()
    return lambda: torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache)


def _stream_context(stream) -> contextlib.AbstractContextManager:
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _receive(x: torch.Tensor, ready, device: torch.device, stream) -> torch.Tensor:
    """Move a micro-batch to a partition's device; on CUDA, order it after its producer's event."""
    if stream is None:
        return x.to(device)
    if ready is not None:
        stream.wait_event(ready)
    if x.is_cuda:
        # Keep the source alive until the copy (src's current stream) and the consumer are done.
        x.record_stream(torch.cuda.current_stream(x.device))
    moved = x.to(device, non_blocking=True)
    if moved.is_cuda:
        moved.record_stream(stream)
    return moved


def _record(stream):
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event


class _Backward:
    """The worker half of one pipelined forward's backward: runs partition backwards where their
    forwards ran, counts them, and keeps the first failure and the input's gradient for `_Anchor`.

    Holds the Pipe's worker list, not the Pipe, so a graph outliving its Pipe keeps no threads
    alive; once the workers are stopped the partition backwards run in the thread that reaches them.
    """

    def __init__(self, workers: list[tuple[threading.Thread, queue.SimpleQueue]], streams: list,
                 micro: tuple[torch.Tensor, ...]) -> None:
        self.workers, self.streams, self.micro = workers, streams, micro
        self.inputs: list[torch.Tensor | None] = [None] * len(micro)  # partition 0's cut inputs
        self.done: list = []  # CUDA events marking finished partition backwards
        self.failure: tuple[int, int, BaseException] | None = None
        self.pending = 0
        self.idle = threading.Condition()

    def cut(self, i: int, j: int, inp: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        """Partition j's input for micro-batch i, detached from the graph that produced it."""
        if j == 0:
            leaf = inp.detach().requires_grad_(inp.requires_grad)
            self.inputs[i] = leaf
            return leaf
        if not inp.requires_grad:
            return inp
        return _Gate.apply(inp.detach(), token, (self, i, j - 1, inp))

    def hand_over(self, i: int, j: int, out: torch.Tensor, grad: torch.Tensor) -> None:
        """Queue partition j's backward of micro-batch i on its worker."""
        ready = None
        if grad.is_cuda:  # grad comes from the stream of the node that reached the boundary
            ready = _record(torch.cuda.current_stream(grad.device))
            grad.record_stream(self.streams[j])
        with self.idle:
            self.pending += 1
        future: Future = Future()
        future.add_done_callback(lambda f: self._finished(i, j, f))
        if self.workers:
            self.workers[j][1].put((lambda: self._run(j, out, grad, ready), future))
            return
        try:
            future.set_result(self._run(j, out, grad, ready))
        except BaseException as exc:  # noqa: B036 - reported through _finished like a worker's
            future.set_exception(exc)

    def _run(self, j: int, out: torch.Tensor, grad: torch.Tensor, ready) -> None:
        stream = self.streams[j]
        with _stream_context(stream):
            if ready is not None:
                stream.wait_event(ready)
            torch.autograd.backward(out, grad)  # reaching partition j's boundary hands over j-1
            event = _record(stream)
        if event is not None:
            with self.idle:
                self.done.append(event)

    def _finished(self, i: int, j: int, future: Future) -> None:
        with self.idle:
            exc = future.exception()
            if exc is not None and self.failure is None:
                self.failure = (i, j, exc)
            self.pending -= 1
            self.idle.notify_all()

    def wait(self) -> torch.Tensor | None:
        """Block until every partition backward is done; the input's gradient, if it needs one."""
        with self.idle:
            self.idle.wait_for(lambda: self.pending == 0)
        if self.failure is not None:
            i, j, exc = self.failure
            raise PipeError(f"pipeline partition {j} failed in backward on micro-batch {i}: "
                            f"{type(exc).__name__}: {exc}") from exc
        for event in self.done:
            torch.cuda.current_stream(event.device).wait_event(event)
        if not self.micro[0].requires_grad:
            return None
        grads = [leaf.grad if leaf is not None and leaf.grad is not None else torch.zeros_like(mb)
                 for leaf, mb in zip(self.inputs, self.micro, strict=True)]
        return torch.cat(grads)


class _Gate(torch.autograd.Function):
    """Identity at a partition boundary whose backward hands the gradient to the partition before."""

    @staticmethod
    def forward(ctx, inp: torch.Tensor, token: torch.Tensor, link: tuple) -> torch.Tensor:
        ctx.link, ctx.token_device = link, token.device
        return inp

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.link is None:
            raise RuntimeError("a pipelined forward can be backpropagated once; run the forward again")
        (state, i, j, out), ctx.link = ctx.link, None
        state.hand_over(i, j, out, grad)
        return None, torch.zeros(0, device=ctx.token_device), None


class _Anchor(torch.autograd.Function):
    """Feeds the token of the last partition's gates; its backward runs after all of them."""

    @staticmethod
    def forward(ctx, source: torch.Tensor, state: _Backward) -> torch.Tensor:
        ctx.state = state
        return source.new_empty(0)

    @staticmethod
    def backward(ctx, _grad: torch.Tensor):
        return ctx.state.wait(), None


class Pipe(nn.Module):
    """GPipe over `module`'s partitions: the batch is cut into micro-batches of `split_size` rows.

    Partitions come from `split_module(module, balance)`. The output is concatenated in input
    order on the last partition's device. `stats` holds the timing of the last forward. With
    autograd recording, `backward()` through the output is pipelined across the partitions too
    (see the module docstring for how, and for its limits). The caller's autocast, if any, applies in the
    workers too (captured at each forward); backwards run outside it.
    """

    def __init__(self, module: nn.Sequential, split_size: int = 1, balance: list[int] | None = None) -> None:
        super().__init__()
        if split_size < 1:
            raise ValueError(f"split_size must be >= 1, got {split_size}")
        self.split_size = split_size
        partitions, self.devices = split_module(module, balance)
        self.partitions = nn.ModuleList(partitions)
        self.stats: PipeStats | None = None
        self._workers: list[tuple[threading.Thread, queue.SimpleQueue]] = []
        self._streams: list = []
        self._finalizer: weakref.finalize | None = None

    def _start(self) -> None:
        if self._workers:
            return
        use_cuda = torch.cuda.is_available()
        self._streams = [torch.cuda.Stream(device=d) if use_cuda and d.type == "cuda" else None
                         for d in self.devices]
        for j in range(len(self.partitions)):
            tasks: queue.SimpleQueue = queue.SimpleQueue()
            thread = threading.Thread(target=_serve, args=(tasks,), name=f"gptpar-pipe-{j}", daemon=True)
            thread.start()
            self._workers.append((thread, tasks))
        # Runs on close(), on garbage collection and at interpreter exit, whichever comes first.
        self._finalizer = weakref.finalize(self, _stop, self._workers)

    def close(self) -> None:
        """Stop the worker threads; a later forward starts new ones."""
        finalizer = self.__dict__.get("_finalizer")
        if finalizer is not None:
            finalizer()  # idempotent; empties self._workers in place

    def __del__(self) -> None:
        self.close()

    def _submit(self, j: int, fn: Callable) -> Future:
        future: Future = Future()
        self._workers[j][1].put((fn, future))
        return future

    def forward(self, x: torch.Tensor, split_size: int | None = None) -> torch.Tensor:
        self._start()
        micro = x.split(split_size or self.split_size)
        m, n = len(micro), len(self.partitions)
        grad_enabled = torch.is_grad_enabled()
        autocast = [_caller_autocast(d.type) for d in self.devices]
        times: list[list[tuple[float, float]]] = [[] for _ in range(n)]
        # On CUDA the first partition must see the caller's pending work on the input.
        first_ready = None
        if x.is_cuda and self._streams[0] is not None:
            first_ready = _record(torch.cuda.current_stream(x.device))

        backward = tokens = None
        if grad_enabled and n > 1:
            backward = _Backward(self._workers, self._streams, micro)
            inner = torch.empty(0, requires_grad=True)  # gates of inner partitions need a token too
            anchor = _Anchor.apply(x if x.requires_grad else torch.empty(0, requires_grad=True), backward)
            tokens = [inner] * (n - 1) + [anchor]

        def stage(i: int, j: int, upstream: Future | None) -> tuple[torch.Tensor, object]:
            inp, ready = upstream.result() if upstream is not None else (micro[i], first_ready)
            start = time.perf_counter()
            stream = self._streams[j]
            with torch.set_grad_enabled(grad_enabled), _stream_context(stream), autocast[j]():
                if backward is not None:
                    inp = backward.cut(i, j, inp, tokens[j])
                out = self.partitions[j](_receive(inp, ready, self.devices[j], stream))
                done = _record(stream)
            times[j].append((start, time.perf_counter()))
            return out, done

        futures: list[list[Future]] = [[None] * n for _ in range(m)]  # type: ignore[list-item]
        for clock in clock_cycles(m, n):
            for i, j in clock:
                upstream = futures[i][j - 1] if j else None
                futures[i][j] = self._submit(j, lambda i=i, j=j, up=upstream: stage(i, j, up))
        self._raise_first_failure(futures)
        outputs = [f.result() for f in (row[-1] for row in futures)]
        spans = [t for ts in times for t in ts]
        self.stats = PipeStats(tuple(sum(b - a for a, b in ts) for ts in times),
                               max(b for _, b in spans) - min(a for a, _ in spans))
        if self._streams[-1] is not None:
            caller = torch.cuda.current_stream(self.devices[-1])
            for out, done in outputs:
                caller.wait_event(done)
                out.record_stream(caller)
        return torch.cat([out for out, _ in outputs])

    @staticmethod
    def _raise_first_failure(futures: list[list[Future]]) -> None:
        """Wait for every task, then re-raise the earliest failure in schedule order.

        A failed task's downstream tasks re-raise the same exception object, so the first one
        found in clock order is where it happened.
        """
        failures = {(i, j): f.exception() for i, row in enumerate(futures) for j, f in enumerate(row)}
        m, n = len(futures), len(futures[0])
        for clock in clock_cycles(m, n):
            for i, j in clock:
                exc = failures[(i, j)]
                if exc is not None:
                    raise PipeError(f"pipeline partition {j} failed on micro-batch {i}: "
                                    f"{type(exc).__name__}: {exc}") from exc


class ModelParallel(nn.Module):
    """The same partitions as Pipe, but the whole batch visits them one after another."""

    def __init__(self, module: nn.Sequential, balance: list[int] | None = None) -> None:
        super().__init__()
        partitions, self.devices = split_module(module, balance)
        self.partitions = nn.ModuleList(partitions)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for part, device in zip(self.partitions, self.devices, strict=True):
            x = part(x.to(device, non_blocking=True))
        return x


def micro_batch_size(batch: int, chunks: int) -> int:
    """Rows per micro-batch so that a batch makes at most `chunks` micro-batches."""
    return max(1, math.ceil(batch / chunks))
