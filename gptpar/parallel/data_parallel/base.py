"""The gradient-sync interface every data-parallel strategy implements (see data_parallel.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.profiler import record_function

from gptpar.config import ParallelConfig, TrainConfig

# parallel.grad_comm: the type our reducers send gradients in (None: fp32, as they are; int8: blockwise quantised,
# quantized.py)
WIRE_DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16,
                                              "int8": torch.int8}

# (parameter name, shape) -> the parameter's whole initial value on CPU, the same on every rank: how fsdp
# materialises only its shards of a model built on the meta device.
InitialValue = Callable[[str, torch.Size], torch.Tensor]


@dataclass(frozen=True)
class SyncSetup:
    """Everything a strategy may be built from; each strategy's `from_setup` takes what it needs."""

    model: nn.Module
    group: dist.ProcessGroup | None  # None: one process (a row that runs `alone`)
    pcfg: ParallelConfig
    device: torch.device
    initial: InitialValue | None = None  # set when the model is on the meta device (a strategy that materialises)
    mesh: DeviceMesh | None = None  # the dp group's mesh within the job's grid (torch's DTensor parameters)
    # Parameters this rank holds alone among its replicas (parallel.ep's expert slices), by name: the strategy
    # neither broadcasts nor reduces them (gptpar.parallel.expert_parallel does); only those with `expert_parallel`.
    local: frozenset[str] = frozenset()
    # parallel.hpz: this rank's data-parallel ranks on its node, where fsdp keeps its secondary copy of the parameters.
    node_group: dist.ProcessGroup | None = None
    train: TrainConfig | None = None  # the optimizer's settings, for a strategy whose engine builds it (deepspeed)


def synced_parameters(model: nn.Module, local: frozenset[str] = frozenset()) -> list[nn.Parameter]:
    """The parameters a replicating strategy keeps equal over its group: all but the `local` ones (SyncSetup)."""
    return [p for name, p in model.named_parameters() if name not in local]


def local_parameters(model: nn.Module, local: frozenset[str]) -> list[tuple[str, nn.Parameter]]:
    """The `local` parameters (SyncSetup), by name: what a sharding strategy steps whole instead of sharding."""
    return [(name, p) for name, p in model.named_parameters() if name in local]


def broadcast_state(model: nn.Module, group: dist.ProcessGroup | None = None,
                    local: frozenset[str] = frozenset()) -> None:
    """Copy the group's first rank's parameters (but the `local` ones) and buffers to its other ranks, as DDP does
    when it wraps a model (replicas start identical even if their seeds did not make them so)."""
    src = dist.get_global_rank(group, 0) if group is not None else 0
    with torch.no_grad():
        for tensor in [*synced_parameters(model, local), *model.buffers()]:  # a DTensor (torch's TP): its piece
            dist.broadcast(tensor.to_local() if isinstance(tensor, DTensor) else tensor, src, group=group)


class GradSync:
    """No communication: the world-size-1 case and the interface of the real strategies.

    `module` is what to call for the forward pass, `model` the unwrapped model (optimizer,
    checkpoints). `comm_wait_s` accumulates the seconds finish() spent waiting on communication
    (None when the strategy cannot tell, as for DDP whose waits happen inside backward).
    """

    name = "none"
    # True for a sync that shards the optimizer (zero.ShardedOptimizer): checkpoints then store what its
    # optimizer_state() names, the state of this rank's shards, and load it with load_optimizer_state().
    shards_optimizer = False
    # True for a sync that shards the parameters too (fsdp.FSDPSync): checkpoints then store parameter_state(), this
    # rank's pieces, and load them with load_parameter_state().
    shards_parameters = False
    # True for a sync whose engine checkpoints the model and optimizer itself (deepspeed): the trainer's checkpoint
    # then holds neither, and the trainer calls save_engine / load_engine beside it.
    engine_state = False

    def __init__(self, model: nn.Module):
        self.model = model
        self.module: nn.Module = model
        self.comm_wait_s: float | None = 0.0

    @classmethod
    def from_setup(cls, setup: SyncSetup) -> GradSync:
        """Build the strategy from what the trainer has (the table in gptpar/strategies/data_parallel.py names
        the class)."""
        return cls(setup.model)

    @contextlib.contextmanager
    def accumulating(self, is_last_micro_step: bool) -> Iterator[None]:
        """Wrap forward+backward of one micro-step; only the last one may communicate."""
        yield

    def backward(self, loss: torch.Tensor) -> None:
        """One micro-step's backward (an engine that owns it, deepspeed's, runs its own)."""
        loss.backward()

    def finish(self) -> None:
        """After the last micro-step's backward: make .grad the average over ranks."""

    def zero_grad(self) -> None:
        """Reset gradients after the optimizer step (use instead of optimizer.zero_grad())."""
        self.model.zero_grad(set_to_none=True)

    def optimizer_params(self) -> list[tuple[torch.Tensor, bool]]:
        """What the optimizer steps, each with whether weight decay applies (matrices: yes)."""
        return [(p, p.dim() >= 2) for p in self.model.parameters() if p.requires_grad]

    def clip_targets(self) -> tuple[list[torch.Tensor], dist.ProcessGroup | None]:
        """The tensors whose gradients make up the global norm, and the group over which their squares are
        summed (None: this rank holds every gradient whole)."""
        return [p for p in self.model.parameters() if p.grad is not None], None

    def owners(self) -> dict[int, nn.Parameter]:
        """The parameter each clip target (by id) is a piece of, where it is not the parameter itself."""
        return {}

    def before_step(self) -> None:
        """Just before optimizer.step(), after the clip (parallel.offload=optimizer copies the gradients to the
        host)."""

    def own_optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer the strategy's engine built (deepspeed's); None: the trainer builds AdamW over
        optimizer_params()."""
        return None

    def step(self, optimizer: torch.optim.Optimizer, clip: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Clip (`clip` returns the global norm), before_step, step the optimizer, then after_step; returns the norm.
        An engine that clips and steps itself (deepspeed's) overrides it."""
        norm = clip()
        with record_function("optimizer"):
            self.before_step()
            optimizer.step()
            self.after_step()
        return norm

    def after_step(self) -> None:
        """Just after optimizer.step() (a sharded optimizer gathers the updated parameters)."""

    def comm_state(self) -> dict[str, Any]:
        """State of the gradient communication that a resume must continue from (ddp's PowerSGD error feedback),
        keyed so that every rank saves its own; empty for a sync that keeps none (checkpoints then hold nothing)."""
        return {}

    def load_comm_state(self, state: dict[str, Any]) -> None:
        """Restore what comm_state() saved."""

    def host_tensors(self) -> list[torch.Tensor] | None:
        """parallel.offload: the tensors the optimizer steps that live on the host (their gradients and optimizer
        state live with them; the memory record counts them as host_bytes); None without offload."""
        return None

    def run_files(self) -> dict[str, str]:
        """Files the strategy keeps in the run folder, by name (deepspeed's config), written by the trainer's rank 0."""
        return {}

    def save_engine(self, run_dir: Path, step: int) -> None:
        """With engine_state: the engine's own checkpoint of `step`, before the trainer's (a collective)."""

    def load_engine(self, run_dir: Path, step: int) -> None:
        """With engine_state: load the engine's checkpoint of `step`, which the trainer's checkpoint names."""

    def count_engine_sent(self) -> None:
        """Start counting the bytes of the collectives an engine issues itself (DeepSpeed's), which
        gptpar.parallel.comm.read_sent does not see; gptpar's own syncs' bytes are always counted there."""

    def read_engine_sent(self) -> dict[str, int]:
        """The bytes the engine's own collectives sent since count_engine_sent or the last read, by collective, in
        read_sent's ring terms; empty for gptpar's syncs."""
        return {}

    def memory_fields(self) -> dict[str, int]:
        """Extra fields of the `memory` record: what only this strategy can count (fsdp: its in-flight peak)."""
        return {}

    @contextlib.contextmanager
    def whole_parameters(self) -> Iterator[None]:
        """Inside, model.parameters() hold the whole current values (a strategy that frees them gathers them)."""
        yield
