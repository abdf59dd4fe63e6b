"""The generic GPipe machinery: schedule, partitioning, Pipe correctness, errors and threads."""

from __future__ import annotations

import gc
import threading

import pytest
import torch
from torch import nn

from gptpar.errors import GptparError
from gptpar.pipeline import ModelParallel, Pipe, PipeError, WithDevice, _split_module, clock_cycles, split_module

META = torch.device("meta")


def pipe_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("gptpar-pipe-")]


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


@pytest.mark.parametrize(("m", "n"), [(1, 1), (1, 3), (4, 1), (3, 2), (2, 4), (5, 3), (8, 2)])
def test_clock_cycles_follow_gpipe_schedule(m: int, n: int) -> None:
    clocks = list(clock_cycles(m, n))
    assert len(clocks) == m + n - 1
    when = {}
    for k, clock in enumerate(clocks):
        assert sorted(clock) == [(i, k - i) for i in range(m) if 0 <= k - i < n]
        when.update({pair: k for pair in clock})
    assert sorted(when) == [(i, j) for i in range(m) for j in range(n)]  # every pair exactly once


def test_clock_cycles_small_case_spelled_out() -> None:
    got = [sorted(c) for c in clock_cycles(3, 2)]
    assert got == [[(0, 0)], [(0, 1), (1, 0)], [(1, 1), (2, 0)], [(2, 1)]]


def test_split_groups_consecutive_children_by_device() -> None:
    seq = nn.Sequential(nn.ReLU(), nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2, device=META),
                        WithDevice(nn.Tanh(), "cpu"), nn.Linear(2, 2), nn.Sigmoid())
    parts, devices = split_module(seq)
    assert devices == [torch.device("cpu"), META, torch.device("cpu")]
    assert [len(p) for p in parts] == [3, 1, 3]  # leading/trailing parameter-free modules join
    assert isinstance(parts[2][0], nn.Tanh)  # WithDevice is unwrapped
    assert parts[0][1] is seq[1]  # partitions hold the original modules
    assert _split_module is split_module


def test_with_device_opens_a_partition_for_a_parameter_free_module() -> None:
    parts, devices = split_module(nn.Sequential(nn.Linear(2, 2), WithDevice(nn.ReLU(), META)))
    assert devices == [torch.device("cpu"), META]
    assert [len(p) for p in parts] == [1, 1]


def test_module_on_two_devices_is_an_error() -> None:
    mixed = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device=META))
    with pytest.raises(GptparError, match="several devices"):
        split_module(nn.Sequential(nn.Linear(2, 2), mixed))


def test_balance_cuts_partitions_on_one_device_and_rejects_mixed_ones() -> None:
    parts, devices = split_module(mlp(), balance=[2, 2, 1])
    assert [len(p) for p in parts] == [2, 2, 1] and devices == [torch.device("cpu")] * 3
    with pytest.raises(GptparError, match="spans devices"):
        split_module(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device=META)), balance=[2])
    with pytest.raises(ValueError, match="sum to 5"):
        split_module(mlp(), balance=[2, 2])


def grads_of(loss: torch.Tensor, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """`.grad` after `loss.backward()`: the pipe's backward only completes through backward()."""
    for t in tensors:
        t.grad = None
    loss.backward()
    return [t.grad.clone() for t in tensors]


@pytest.mark.parametrize("batch", [1, 5, 8, 13])
@pytest.mark.parametrize("split", [1, 2, 3, 8, 20])
def test_pipe_output_and_gradients_equal_sequential(batch: int, split: int) -> None:
    seq = mlp()
    pipe = Pipe(seq, split, balance=[2, 2, 1])
    base = torch.randn(batch, 6, requires_grad=True)
    scale = torch.randn(6, requires_grad=True)
    leaves = [base, scale, *seq.parameters()]
    # The input comes from a graph shared by all micro-batches: it must be backpropagated once.
    want = grads_of(seq(base * scale).square().sum(), leaves)
    out = pipe(base * scale)
    torch.testing.assert_close(out, seq(base * scale), rtol=1e-5, atol=1e-6)
    got = grads_of(out.square().sum(), leaves)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    assert len(pipe.stats.busy_s) == 3 and all(0.0 <= b <= 1.0 for b in pipe.stats.bubble)
    pipe.close()


def test_parameter_shared_by_first_and_last_partition_gets_both_gradients() -> None:
    """Its two shares accumulate from different threads (two graph tasks), like GPT-2's tied head."""
    torch.manual_seed(0)
    first, last = nn.Linear(4, 4), nn.Linear(4, 4)
    last.weight = first.weight
    seq = nn.Sequential(first, nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), last)
    x = torch.randn(16, 4)
    want = grads_of(seq(x).square().sum(), list(seq.parameters()))
    pipe = Pipe(seq, 1, balance=[2, 2, 1])
    for _ in range(3):  # 16 micro-batches, repeated: a lost update would show up
        got = grads_of(pipe(x).square().sum(), list(seq.parameters()))
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    pipe.close()


def test_input_gradient_through_autograd_grad() -> None:
    seq = mlp()
    x = torch.randn(5, 6, requires_grad=True)
    (want,) = torch.autograd.grad(seq(x).sum(), [x])
    pipe = Pipe(seq, 2, balance=[3, 2])
    (got,) = torch.autograd.grad(pipe(x).sum(), [x])
    torch.testing.assert_close(got, want)
    pipe.close()


class Recorder(nn.Module):
    """Logs which thread ran it and which rows it saw."""

    def __init__(self, log: list) -> None:
        super().__init__()
        self.log = log

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.log.append((threading.current_thread().name, int(x[0, 0])))
        return x


def test_each_partition_runs_in_its_own_thread_in_micro_batch_order() -> None:
    logs: list[list] = [[], [], []]
    pipe = Pipe(nn.Sequential(*(Recorder(log) for log in logs)), 2, balance=[1, 1, 1])
    out = pipe(torch.arange(7.0)[:, None])
    assert out.flatten().tolist() == list(range(7))
    for j, log in enumerate(logs):
        assert log == [(f"gptpar-pipe-{j}", first) for first in (0, 2, 4, 6)]
    pipe.close()


class Handshake(nn.Module):
    """Partition 0 may not finish micro-batch 1 until partition 1 has started micro-batch 0."""

    def __init__(self, started: threading.Event, role: int) -> None:
        super().__init__()
        self.started, self.role = started, role

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.role == 1 and int(x[0, 0]) == 0:
            self.started.set()
        if self.role == 0 and int(x[0, 0]) == 1 and not self.started.wait(timeout=30):
            raise RuntimeError("partition 1 never ran while partition 0 was busy")
        return x


def test_partitions_on_the_same_device_overlap() -> None:
    started = threading.Event()
    pipe = Pipe(nn.Sequential(Handshake(started, 0), Handshake(started, 1)), 1, balance=[1, 1])
    assert pipe(torch.arange(3.0)[:, None]).flatten().tolist() == [0, 1, 2]
    pipe.close()


def test_no_grad_is_honoured_in_the_workers() -> None:
    pipe = Pipe(mlp(), 2, balance=[3, 2])
    with torch.no_grad():
        out = pipe(torch.randn(5, 6))
    assert out.grad_fn is None
    pipe.close()


class FailOn(nn.Module):
    def __init__(self, row: int) -> None:
        super().__init__()
        self.row = row

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x[:, 0] == self.row).any():
            raise ValueError(f"bad row {self.row}")
        return x


def test_exception_in_a_later_stage_reaches_the_caller_chained() -> None:
    pipe = Pipe(nn.Sequential(nn.Identity(), FailOn(3)), 2, balance=[1, 1])
    with pytest.raises(PipeError, match="partition 1 failed on micro-batch 1") as info:
        pipe(torch.arange(6.0)[:, None])
    assert isinstance(info.value.__cause__, ValueError)
    assert str(info.value.__cause__) == "bad row 3"
    assert pipe(torch.arange(3.0)[:, None] * 10).flatten().tolist() == [0, 10, 20]  # still usable
    pipe.close()


def test_workers_stop_on_close_on_deletion_and_restart_on_demand() -> None:
    assert pipe_threads() == []
    pipe = Pipe(mlp(), 2, balance=[1, 2, 2])
    pipe(torch.randn(4, 6))
    assert len(pipe_threads()) == 3
    pipe.close()
    assert pipe_threads() == []
    pipe(torch.randn(4, 6))  # a closed pipe starts fresh workers
    assert len(pipe_threads()) == 3
    del pipe
    gc.collect()
    assert pipe_threads() == []


def test_workers_stop_when_an_output_outlives_the_pipe() -> None:
    pipe = Pipe(mlp(), 2, balance=[3, 2])
    out = pipe(torch.randn(4, 6, requires_grad=True))
    del pipe
    gc.collect()
    assert pipe_threads() == []
    out.sum().backward()  # the graph stays valid without the workers


def test_model_parallel_equals_sequential() -> None:
    seq = mlp()
    x = torch.randn(5, 6)
    torch.testing.assert_close(ModelParallel(seq, balance=[2, 3])(x), seq(x))


class _OnBackward(torch.autograd.Function):
    """Identity whose backward calls `action(first_row)` in whichever thread runs it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, action) -> torch.Tensor:
        ctx.row, ctx.action = int(x[0, 0]), action
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.action(ctx.row)
        return grad, None


class OnBackward(nn.Module):
    def __init__(self, action) -> None:
        super().__init__()
        self.action = action

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _OnBackward.apply(x, self.action)


def test_partition_backwards_overlap() -> None:
    """Partition 1's backward of micro-batch 0 and partition 0's of micro-batch 1 meet at a barrier:
    run one after the other, the first to arrive times out and the backward fails."""
    barrier = threading.Barrier(2, timeout=30)
    threads: dict[tuple[int, int], str] = {}

    def at(stage: int):
        def action(row: int) -> None:
            threads[(stage, row)] = threading.current_thread().name
            if (stage, row) in ((1, 0), (0, 1)):
                barrier.wait()
        return action

    pipe = Pipe(nn.Sequential(OnBackward(at(0)), OnBackward(at(1))), 1, balance=[1, 1])
    x = torch.arange(2.0)[:, None].requires_grad_()
    pipe(x).sum().backward()
    assert x.grad.flatten().tolist() == [1.0, 1.0]
    main = threading.current_thread().name
    assert threads == {(1, 0): main, (1, 1): main, (0, 0): "gptpar-pipe-0", (0, 1): "gptpar-pipe-0"}
    pipe.close()


def test_exception_in_a_worker_backward_reaches_the_callers_backward_chained() -> None:
    def fail(row: int) -> None:
        if row == 2:  # first row of micro-batch 1
            raise ValueError("bad gradient for row 2")

    seq = nn.Sequential(OnBackward(fail), nn.Linear(1, 1), nn.Linear(1, 1))
    pipe = Pipe(seq, 2, balance=[2, 1])
    out = pipe(torch.arange(6.0)[:, None].requires_grad_())
    with pytest.raises(PipeError, match="partition 0 failed in backward on micro-batch 1") as info:
        out.sum().backward()
    assert isinstance(info.value.__cause__, ValueError)
    assert str(info.value.__cause__) == "bad gradient for row 2"
    x = torch.arange(3.0)[:, None] * 10  # rows 0, 10, 20: nothing fails, the pipe is still usable
    want = grads_of(seq(x.requires_grad_()).sum(), [x, seq[1].weight])
    got = grads_of(pipe(x).sum(), [x, seq[1].weight])
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    pipe.close()


def test_second_backward_through_one_forward_is_refused() -> None:
    pipe = Pipe(mlp(), 2, balance=[3, 2])
    loss = pipe(torch.randn(4, 6)).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backpropagated once"):
        loss.backward()
    pipe.close()
