"""Mixed precision (`train.precision`): autocast for the forward, a dynamic loss scale for fp16, TF32 matmuls.

The model is never cast: parameters, gradients and the optimizer state stay fp32 (the master weights) and
autocast runs the matmuls of the forward in bf16 or fp16. bf16 has fp32's exponent range, so its gradients
need no scaling; fp16's small gradients would flush to zero, so the loss is multiplied by a scale before
backward and the gradients divided by it after the gradient sync. A scale too large overflows: an inf or nan
in any rank's gradients (whole, or the shards zero2/fsdp keep, or a pipeline stage's) skips the step on every
rank, agreed with one all-reduce of a flag over the whole job, and halves the scale.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from gptpar.config import TrainConfig
from gptpar.errors import GptparError
from gptpar.hardware import resolved_precision

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class DynamicLossScaler:
    """fp16's loss scale: halved on an overflow, doubled after `growth_interval` clean steps in a row, so it
    stays near the largest scale whose gradients fit in fp16."""

    def __init__(self, scale: float = 2.0**16, growth_interval: int = 2000) -> None:
        self.scale = scale
        self.growth_interval = growth_interval
        self.clean_steps = 0  # since the last overflow or growth

    def update(self, overflow: bool) -> None:
        """After a step: back off on an overflow (that step is skipped), grow after a run of clean steps."""
        if overflow:
            self.scale /= 2.0
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps == self.growth_interval:
            self.scale *= 2.0
            self.clean_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {"loss_scale": self.scale, "loss_scale_clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale, self.clean_steps = float(state["loss_scale"]), int(state["loss_scale_clean_steps"])


def resolve_precision(setting: str, device: torch.device) -> str:
    """`train.precision` as this rank runs it (`gptpar.hardware.resolved_precision`), native bf16 asked of the GPU."""

    def native_bf16() -> bool:
        with torch.cuda.device(device):
            return torch.cuda.is_bf16_supported(including_emulation=False)

    return resolved_precision(setting, device.type == "cuda", native_bf16)


def check_precision(precision: str, device: torch.device) -> None:
    """Refuse, in one line, a precision the rank's device cannot run."""
    key = f"train.precision={precision}"
    if precision in ("fp16", "tf32") and device.type != "cuda":
        why = ("fp16 autocast on a CPU is not supported; use train.precision=bf16" if precision == "fp16" else
               "TF32 matmuls need an NVIDIA GPU of compute capability 8.0 or newer; use train.precision=fp32")
        raise GptparError(f"{key} needs a CUDA GPU, but this rank runs on {device.type}: {why}")
    if device.type != "cuda" or precision not in ("bf16", "tf32"):
        return
    with torch.cuda.device(device):
        native_bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
    major, minor = torch.cuda.get_device_capability(device)
    gpu = f"{device} ({torch.cuda.get_device_name(device)}, compute capability {major}.{minor})"
    if precision == "bf16" and not native_bf16:
        raise GptparError(f"{key}: {gpu} has no bf16 support; use train.precision=fp16")
    if precision == "tf32" and major < 8:
        raise GptparError(f"{key} needs an Ampere or newer GPU (compute capability 8.0), but {gpu} is older; "
                          "use train.precision=fp32 or fp16")


def _local(grad: torch.Tensor) -> torch.Tensor:
    """This rank's part of a gradient (FSDP2's are DTensors; in-place ops on the local tensor change the DTensor)."""
    return grad.to_local() if isinstance(grad, DTensor) else grad


class Precision:
    """What the trainer needs of `train.precision` on one rank: `autocast()` around forwards and losses,
    `scale(loss)` before backward and `unscale(params)` between the gradient sync and clipping; `name` is the
    precision it runs (fp32, bf16, fp16 or tf32).
    `scaler` is the fp16 loss scaler (None otherwise); `skipped` and `step_scale` describe the last step."""

    def __init__(self, dtype: torch.dtype | None, device: torch.device,
                 scaler: DynamicLossScaler | None = None, tf32: bool = False, name: str = "") -> None:
        self.dtype, self.device, self.scaler, self.tf32 = dtype, device, scaler, tf32
        self.name = name or {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "tf32" if tf32 else "fp32")
        self.skipped = False
        self.step_scale: float | None = None  # the loss scale the last step ran with (None: no scaler)

    @classmethod
    def from_config(cls, t: TrainConfig, device: torch.device) -> Precision:
        """The rank's precision (`auto` resolved for its device), checked against its device."""
        name = resolve_precision(t.precision, device)
        check_precision(name, device)
        return cls(AUTOCAST_DTYPES.get(name), device, DynamicLossScaler() if name == "fp16" else None,
                   tf32=name == "tf32", name=name)

    def set_matmul_precision(self) -> None:
        """TF32 matmuls on under tf32 only, so fp32 means fp32. The flags belong to the process, so every step
        and evaluation sets its own: trainers of different precisions may share one process (bench-precision)."""
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = self.tf32

    def autocast(self) -> contextlib.AbstractContextManager:
        """The forward's autocast (none under fp32 and tf32); backward runs outside it, as torch advises."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    @property
    def loss_scale(self) -> float:
        """What the loss is multiplied by before backward (1 without a scaler)."""
        return self.scaler.scale if self.scaler else 1.0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scaler.scale if self.scaler else loss

    @torch.no_grad()
    def unscale(self, params: list[torch.Tensor]) -> bool:
        """Divide the (synced) gradients of `params` by the loss scale; False when the step must be skipped
        because some rank's gradients overflowed. Collective over the whole job under fp16; free otherwise."""
        self.step_scale = self.loss_scale if self.scaler else None
        if self.scaler is None:
            return True
        grads = [_local(p.grad) for p in params if p.grad is not None]
        flag = torch.zeros((), device=self.device)
        if grads:  # max |g| is inf or nan exactly when some element is
            peaks = torch.stack([n.to(self.device) for n in torch._foreach_norm(grads, math.inf)])
            flag = (~peaks.isfinite()).any().float()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.skipped = bool(flag.item())
        if not self.skipped:
            torch._foreach_mul_(grads, 1.0 / self.scaler.scale)
        self.scaler.update(self.skipped)
        return not self.skipped

    def state_dict(self) -> dict[str, Any]:
        """The loss scaler's state for checkpoints (empty without one, so other checkpoints are unchanged)."""
        return self.scaler.state_dict() if self.scaler else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler:
            self.scaler.load_state_dict(state)
