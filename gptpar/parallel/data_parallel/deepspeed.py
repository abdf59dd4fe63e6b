"""DeepSpeed's engine as a third reference beside ours and torch's (parallel.dp_sync=deepspeed, the `deepspeed` extra).

`deepspeed.initialize` wraps the model with a config written from gptpar's own settings (`deepspeed_config`, saved in
the run folder as deepspeed_config.json): ZeRO at parallel.zero_stage over the data-parallel group, AdamW with the
same betas, eps and weight-decay groups (torch's, `torch_adam`), the same clipping, gradient accumulation and
autocast. The trainer's loop is unchanged: the engine is `module`, and the two things DeepSpeed owns go through the
sync's interface: `backward` (engine.backward, which reduces on the last micro-step) and `step` (engine.step, which
clips and steps; the trainer sets each step's learning rate on the engine's optimizer's groups as it does for its
own). The engine writes its own checkpoints (save_engine / load_engine), beside gptpar's, under the step's tag.

ZeRO++ (parallel.param_comm=int8: qwZ, grad_comm=int8: qgZ, hpz: hpZ) and offload (parallel.offload) are DeepSpeed's
own config keys. Its CPU backend implements neither quantised collective, so a CPU rank refuses ZeRO++ in one line.
`deepspeed` is imported here only: the config and strategy tables stay free of it.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer
from torch.profiler import record_function

from gptpar.config import ParallelConfig, TrainConfig
from gptpar.errors import GptparError, require_extra
from gptpar.hardware import resolved_precision
from gptpar.parallel.data_parallel.base import GradSync, SyncSetup
from gptpar.parallel.process_group import library_groups_take_the_worlds_timeout
from gptpar.strategies.collectives import ring_share
from gptpar.tensor_bytes import storage_bytes

CONFIG_FILE = "deepspeed_config.json"
CHECKPOINTS = "deepspeed_checkpoint"  # the engine's checkpoints, one folder per tag (step<N>), in the run folder
TAG = "step{}"
# deepspeed.comm's ops by the kind of collective gptpar counts (comm_bytes' kinds); its logger sizes an all-gather by
# the input shard, the others by the whole input
SENT_KINDS = {"all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce", "inference_all_reduce": "all_reduce",
              "reduce_scatter": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
              "reduce_scatter_fn": "reduce_scatter", "all_gather": "all_gather",
              "all_gather_into_tensor": "all_gather", "allgather_fn": "all_gather",
              "all_to_all_single": "all_to_all", "all_to_all": "all_to_all", "broadcast": "broadcast",
              "reduce": "reduce"}
ADAM_EPS = 1e-8  # torch.optim.AdamW's default, what gptpar's AdamW runs with


def zero_plus_plus(pcfg: ParallelConfig) -> list[str]:
    """The ZeRO++ settings asked for, as the keys that ask."""
    return [key for key, on in (("parallel.param_comm=int8", pcfg.param_comm == "int8"),
                                ("parallel.grad_comm=int8", pcfg.grad_comm == "int8"),
                                ("parallel.hpz=true", pcfg.hpz)) if on]


def deepspeed_config(pcfg: ParallelConfig, t: TrainConfig, dp: int, precision: str, hpz_size: int) -> dict[str, Any]:
    """DeepSpeed's config for what gptpar runs over `dp` replicas: one replica's micro-batch (DeepSpeed checks that its
    train_batch_size is the micro-batch times the accumulation times its ranks, which under parallel.cp hold each
    replica's rows once per cp rank, a shard of every row each), ZeRO at parallel.zero_stage with buckets of
    parallel.bucket_mb (every parameter sharded at stage 3: no persistence threshold, as the closed form assumes),
    AdamW and clipping as train.* says, bf16 as autocast over fp32 weights with gradients reduced in fp32 (no module
    is marked safe for bf16 communication), offload and ZeRO++ as parallel.* says."""
    bucket = max(2, int(pcfg.bucket_mb * 2**20 / 4) // 2 * 2)  # fp32 elements, even (DeepSpeed aligns to 2)
    zero: dict[str, Any] = {"stage": pcfg.zero_stage, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket,
                            "contiguous_gradients": True, "overlap_comm": False}
    if pcfg.zero_stage == 3:
        zero |= {"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": bucket}
    host = {"device": "cpu", "pin_memory": False}  # pinned pages need CUDA; on a CPU-only torch they cannot be had
    if pcfg.offload in ("optimizer", "params"):
        zero["offload_optimizer"] = host
    if pcfg.offload == "params":
        zero["offload_param"] = host
    zero |= {"zero_quantized_weights": pcfg.param_comm == "int8", "zero_quantized_gradients": pcfg.grad_comm == "int8",
             "zero_hpz_partition_size": hpz_size}
    config: dict[str, Any] = {
        "train_batch_size": t.batch_size * pcfg.cp, "gradient_accumulation_steps": t.grad_accum,
        "train_micro_batch_size_per_gpu": t.batch_size // (t.grad_accum * dp),
        "optimizer": {"type": "AdamW", "params": {"lr": t.lr, "betas": [t.beta1, t.beta2], "eps": ADAM_EPS,
                                                  "weight_decay": t.weight_decay, "torch_adam": True}},
        "gradient_clipping": max(0.0, t.grad_clip), "zero_optimization": zero,
        "zero_force_ds_cpu_optimizer": False,  # offload steps torch's AdamW on the host, not DeepSpeed's C++ Adam
        "steps_per_print": 2**31 - 1, "wall_clock_breakdown": False}
    if precision == "bf16":
        config["torch_autocast"] = {"enabled": True, "dtype": "bfloat16", "lower_precision_safe_modules": []}
    return config


def buildable_arch_list(arch_list: str) -> str:
    """TORCH_CUDA_ARCH_LIST with every entry in the form DeepSpeed's op builder parses (major.minor, +PTX): an
    architecture-specific entry such as 9.0a (an H200's image sets it) made it fail with "invalid literal for int()"
    before any op was built; the entry's family (9.0) builds the same ops."""
    entries = [entry for entry in re.split(r"[;\s]+", arch_list) if entry]
    fixed = [re.sub(r"^(\d+)\.(\d+)[a-z]+(\+PTX)?$", r"\1.\2\3", entry) for entry in entries]
    return ";".join(fixed) if fixed != entries else arch_list


def check_engine_setup(pcfg: ParallelConfig, t: TrainConfig, device: torch.device) -> str:
    """Refuse in one line what this rank's DeepSpeed cannot run (ZeRO++ off CUDA, its fp16 recipe, qwZ under bf16's
    autocast); returns the
    precision it runs (train.precision resolved on `device`)."""
    asked = zero_plus_plus(pcfg)
    if asked and device.type != "cuda":
        raise GptparError(f"{' and '.join(asked)} with parallel.dp_sync=deepspeed is ZeRO++, which DeepSpeed "
                          f"implements on CUDA GPUs only (its CPU backend has no quantised collectives), but this "
                          f"rank runs on {device.type}; use parallel.dp_sync=fsdp (ours), or fp32 and hpz=false")
    precision = resolved_precision(t.precision, device.type == "cuda",
                                   lambda: torch.cuda.is_bf16_supported(including_emulation=False))
    if precision == "fp16":
        raise GptparError("train.precision=fp16 is not built for parallel.dp_sync=deepspeed (DeepSpeed's fp16 "
                          "keeps fp16 weights, another recipe than gptpar's autocast over fp32 weights with its own "
                          "loss scaler); use train.precision=bf16 or fp32")
    if precision == "bf16" and pcfg.param_comm == "int8":  # seen on an H200: its engine asserts at initialize
        raise GptparError("parallel.param_comm=int8 (ZeRO++'s quantised weights) with train.precision=bf16 is refused "
                          "by DeepSpeed (it cannot quantise weights under the torch autocast gptpar's bf16 uses); use "
                          "train.precision=fp32 with it, or parallel.param_comm=fp32")
    return precision


class DeepSpeedSync(GradSync):
    name = "deepspeed"
    engine_state = True

    @classmethod
    def from_setup(cls, setup: SyncSetup) -> GradSync:
        if setup.train is None:
            raise GptparError("parallel.dp_sync=deepspeed builds its optimizer from train.*, which this caller "
                              "did not pass")
        hpz_size = dist.get_world_size(setup.node_group) if setup.node_group is not None else 1
        return cls(setup.model, setup.group, setup.pcfg, setup.train, setup.device, hpz_size)

    def __init__(self, model: nn.Module, group: dist.ProcessGroup | None, pcfg: ParallelConfig, t: TrainConfig,
                 device: torch.device, hpz_size: int = 1):
        """`group` None: one process (parallel.dp=1), which the engine runs in over a group of one made here."""
        super().__init__(model)
        deepspeed = require_extra("deepspeed", "parallel.dp_sync=deepspeed", "deepspeed")
        precision = check_engine_setup(pcfg, t, device)
        asked = os.environ.get("TORCH_CUDA_ARCH_LIST", "")
        if device.type == "cuda" and buildable_arch_list(asked) != asked:
            os.environ["TORCH_CUDA_ARCH_LIST"] = buildable_arch_list(asked)
            print(f"gptpar: TORCH_CUDA_ARCH_LIST={asked} read as {os.environ['TORCH_CUDA_ARCH_LIST']}, the form "
                  "DeepSpeed's op builder parses", file=sys.stderr)
        if group is None:  # this process is the whole job: its own launcher, as far as DeepSpeed asks
            os.environ.setdefault("LOCAL_RANK", "0")
        if group is None and not dist.is_initialized():
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                    world_size=1, device_id=device if device.type == "cuda" else None)
        self.stage, self.offload = pcfg.zero_stage, pcfg.offload
        self.group_size = dist.get_world_size(group)  # None: the world (of one)
        self.config = deepspeed_config(pcfg, t, self.group_size // pcfg.cp, precision, hpz_size)  # per replica
        groups = [{"params": [p for p in model.parameters() if p.requires_grad and (p.dim() >= 2) == decays],
                   "weight_decay": t.weight_decay if decays else 0.0} for decays in (True, False)]
        # DeepSpeed calls torch's all_gather_into_tensor, which torch warns of at every call: once is enough.
        warnings.filterwarnings("once", message=".*all_gather_into_tensor.* is deprecated", category=FutureWarning)
        # its banner and config dump on every rank; the groups it makes time out as the world does
        with contextlib.redirect_stdout(io.StringIO()), library_groups_take_the_worlds_timeout():
            self.engine, self.optimizer, _, _ = deepspeed.initialize(
                model=model, model_parameters=groups, config=self.config, dist_init_required=False)
        self.module = self.engine
        self.comm_wait_s = None  # the engine's reductions run inside backward and step
        self.boundary, self.grads_bytes = True, 0

    def own_optimizer(self) -> Optimizer:
        """The engine's ZeRO optimizer: the trainer sets each step's learning rate on its groups."""
        return self.optimizer

    def run_files(self) -> dict[str, str]:
        return {CONFIG_FILE: json.dumps(self.config, indent=2) + "\n"}

    @contextlib.contextmanager
    def accumulating(self, is_last_micro_step: bool) -> Iterator[None]:
        """The engine reduces at the boundary only: the last micro-step."""
        self.engine.set_gradient_accumulation_boundary(is_last_micro_step)
        self.boundary = is_last_micro_step
        yield

    def backward(self, loss: torch.Tensor) -> None:
        """The engine's backward: the trainer has already divided the loss over the micro-steps."""
        self.engine.backward(loss, scale_wrt_gas=False)
        if self.boundary:  # the step frees the gradient partitions: counted here, for the memory record
            self.grads_bytes = gradient_bytes(self.model, self.optimizer, self.stage)

    def step(self, optimizer: Optimizer, clip: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The engine clips (train.grad_clip is its gradient_clipping), steps, and zeroes the gradients; its norm
        is the one it clipped with."""
        with record_function("optimizer"):
            self.engine.step()
        return torch.tensor(float(self.engine.get_global_grad_norm()))

    def clip_targets(self) -> tuple[list[torch.Tensor], dist.ProcessGroup | None]:
        """None: the engine clips its own gradient partitions."""
        return [], None

    def zero_grad(self) -> None:
        """engine.step() has zeroed them."""

    @contextlib.contextmanager
    def whole_parameters(self) -> Iterator[None]:
        """Stage 3's parameters gathered whole (DeepSpeed's GatheredParameters); the other stages keep them whole."""
        if self.stage != 3:
            yield
            return
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(self.model.parameters())):
            yield

    def save_engine(self, run_dir: Path, step: int) -> None:
        """The engine's checkpoint under the step's tag; the folder keeps this one and the one before (the trainer's
        checkpoint, written next, names the newer; a save killed in between resumes from the older)."""
        folder = Path(run_dir) / CHECKPOINTS
        self.engine.save_checkpoint(str(folder), tag=TAG.format(step))
        if dist.get_rank() == 0:
            tags = sorted((p for p in folder.iterdir() if p.is_dir() and p.name.startswith("step")),
                          key=lambda p: int(p.name.removeprefix("step")))
            for old in tags[:-2]:
                shutil.rmtree(old, ignore_errors=True)
        dist.barrier()

    def load_engine(self, run_dir: Path, step: int) -> None:
        """The engine's checkpoint of `step` (the trainer's checkpoint names it): model, optimizer and its counters."""
        folder = Path(run_dir) / CHECKPOINTS
        if not (folder / TAG.format(step)).is_dir():
            raise GptparError(f"the checkpoint is of step {step}, but {folder} has no {TAG.format(step)}; delete the "
                              "run's checkpoint folders to start the run over")
        path, _ = self.engine.load_checkpoint(str(folder), tag=TAG.format(step))
        if path is None:
            raise GptparError(f"cannot load DeepSpeed's checkpoint {folder / TAG.format(step)}")

    def count_engine_sent(self) -> None:
        """Have deepspeed.comm log every collective's size from now on (what it logged before is dropped), for
        read_engine_sent. Off in training runs: its logger synchronises the device after each collective, which would
        cost a GPU run its overlap."""
        import deepspeed.comm

        deepspeed.comm.configure(enabled=True, prof_all=True, verbose=False)
        deepspeed.comm.comms_logger.comms_dict.clear()

    def read_engine_sent(self) -> dict[str, int]:
        """The bytes this rank sent since the last read, by collective, in comm_bytes' ring terms (what
        gptpar.parallel.comm.read_sent gives for gptpar's own syncs), from deepspeed.comm's logger (see
        count_engine_sent)."""
        from deepspeed.comm import comms_logger

        sent = engine_sent(comms_logger.comms_dict, self.group_size)
        comms_logger.comms_dict.clear()
        return sent

    def memory_fields(self) -> dict[str, int]:
        """The `memory` record from DeepSpeed's own buffers (see engine_state_bytes)."""
        fields = engine_state_bytes(self.model, self.optimizer, self.stage, self.offload)
        if "host_bytes" in fields:  # the gradient partitions go with the optimizer state to the host
            fields["host_bytes"] += self.grads_bytes
        return fields | {"grads_bytes": self.grads_bytes}


def engine_sent(logged: dict[str, dict[int, list]], size: int) -> dict[str, int]:
    """Bytes one rank sent by collective kind, in ring terms over `size` ranks, from deepspeed.comm's logger's
    {op: {message bytes: [count, ...]}}; an op gptpar cannot count that moved a tensor is refused, not dropped."""
    sent: dict[str, int] = {}
    for name, sizes in logged.items():
        kind, moved = SENT_KINDS.get(name), sum(msg * record[0] for msg, record in sizes.items())
        if kind is None and moved:  # a barrier or an object's exchange moves no tensor: nothing to count
            raise GptparError(f"deepspeed.comm ran {name}, which gptpar does not count in comm_bytes")
        if kind is not None:
            sent[kind] = sent.get(kind, 0) + ring_share(kind, moved * (size if kind == "all_gather" else 1), size)
    return sent


def master_partitions(optimizer: Any, stage: int) -> list[torch.Tensor]:
    """The fp32 master partitions the engine's optimizer steps (a copy DeepSpeed keeps even in fp32)."""
    return list(optimizer.fp32_partitioned_groups_flat if stage == 3 else optimizer.single_partition_of_fp32_groups)


def gradient_bytes(model: nn.Module, optimizer: Any, stage: int) -> int:
    """Bytes of the gradients a rank holds at the end of the step's backward, by storage: DeepSpeed's partitions of
    the averaged gradients (with offload, the master partitions' own .grad on the host), and whatever whole gradients
    the model's parameters still hold (stage 1's)."""
    partitions = [t for group in optimizer.averaged_gradients.values() if group is not None
                  for t in (group if isinstance(group, list) else [group]) if torch.is_tensor(t)]
    masters = [m.grad for m in master_partitions(optimizer, stage) if m.grad is not None]
    return storage_bytes([*partitions, *masters, *(p.grad for p in model.parameters() if p.grad is not None)])


def engine_state_bytes(model: nn.Module, optimizer: Any, stage: int, offload: str) -> dict[str, int]:
    """Training state of one rank, counted from DeepSpeed's buffers by storage after a step: the model's parameters
    (stages 1 and 2: whole, laid out in one flat buffer; stage 3: this rank's partitions) with the master partitions,
    and the optimizer's state; `host_bytes` what parallel.offload keeps on the host (optimizer: the master partitions
    and the optimizer's state; params: this rank's parameter partitions too; their gradients are added by the
    caller, see DeepSpeedSync.memory_fields)."""
    params, masters = list(model.parameters()), master_partitions(optimizer, stage)
    held = [p.ds_tensor for p in params] if stage == 3 else params
    state = [v for s in optimizer.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    moved = {"none": [], "optimizer": [*masters, *state], "params": [*masters, *state, *held]}[offload]
    return {"params": sum(p.ds_numel if stage == 3 else p.numel() for p in params),
            "params_bytes": storage_bytes([*held, *masters]), "optimizer_bytes": storage_bytes(state),
            **({"host_bytes": storage_bytes(moved)} if offload != "none" else {})}
