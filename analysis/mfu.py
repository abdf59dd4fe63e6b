"""Model and hardware FLOPs utilisation: training FLOPs per token from the model shape, over a known peak.

MFU divides model FLOPs, HFU hardware FLOPs (model FLOPs plus the forward of every block activation checkpointing
recomputes), by the devices' dense peak. The FLOPs per token, their formula and the peaks are gptpar.flops' (the
planner's too); `FlopsShape`, `flops_per_token`, `hardware_flops_per_token` and `peak_flops` stay importable from here.

An MFU against a guessed peak is worse than none, so an unknown device (a CPU included) gets an
explicit "n/a" naming it unless the user gives its peak (`gptpar report --peak-flops`), and an MFU
above 100% is flagged as impossible instead of being reported.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from gptpar.adapters import lora_targets, lora_trainable
from gptpar.config import (
    SECTIONS,
    Config,
    ConfigError,
    apply_dict,
    checkpoint_interval,
    checkpointed_indices,
    example_width,
    nested,
)
from gptpar.flops import FlopsShape, flops_per_token, hardware_flops_per_token, peak_flops

PRECISIONS = {"float32": "fp32", "float16": "fp16", "half": "fp16", "bfloat16": "bf16"}


def model_shape(params: dict[str, Any], vocab_size: int) -> FlopsShape | None:
    """The shape of a flattened resolved config (a pretrained folder's, else the preset with its overrides), the
    positions of one of its examples (as its step records count tokens: data.seq_len, an image's patches and class
    token), its vocabulary (an image classifier's classes) and, under train.lora_rank, what trains; None when the run's
    pretrained folder can no longer be read, a logged value is no longer allowed or its LoRA targets are ones
    gptpar.adapters cannot count (no FLOPs rather than a guess)."""
    try:
        cfg = _logged_config(params)
        model, width = cfg.model.shape(), example_width(cfg)
    except ConfigError:
        return None
    t = cfg.train
    targets = lora_targets(model.arch, t.lora_targets)
    lora = lora_trainable(model, vocab_size, t.lora_rank, targets) if t.lora_rank else None
    if isinstance(lora, list):
        return None
    every = checkpoint_interval(t.activation_checkpointing)
    return FlopsShape(model, width, vocab_size, len(checkpointed_indices(model.n_layer, every)), lora)


def _logged_config(params: dict[str, Any]) -> Config:
    """The config a run logged, from its flattened keys; a key this version no longer has is left out (an old log),
    one it lacks keeps its default."""
    cfg = Config()
    known = {f"{name}.{f.name}" for name in SECTIONS for f in dataclasses.fields(getattr(cfg, name))}
    return apply_dict(cfg, nested({key: value for key, value in params.items() if key in known}))


def device_label(header: dict[str, Any], params: dict[str, Any]) -> tuple[str, str]:
    """(device, precision): the logged device_name, else the requested launch.gpu_type of a CUDA
    run, else the device; the logged precision (train.precision), else fp32 (logs from before it)."""
    device = str(header.get("device", "unknown"))
    gpu_type = params.get("launch.gpu_type")
    if header.get("device_name"):
        device = str(header["device_name"])
    elif device.startswith("cuda") and gpu_type:
        device = str(gpu_type)
    raw = str(header.get("precision") or "fp32").removeprefix("torch.")
    return device, PRECISIONS.get(raw, raw)


@dataclass(frozen=True)
class Utilisation:
    mfu: float | None
    hfu: float | None  # equals mfu when nothing is recomputed
    note: str  # how it was computed, or why it is n/a or flagged


def utilisation(tokens_per_s: float | None, devices: int, device: str, precision: str, shape: FlopsShape | None,
                user_peak: float | None = None) -> Utilisation:
    """MFU and HFU of a run; user_peak (FLOP/s per device) stands in for a device the table lacks."""
    peak, source = peak_flops(device, precision), "peak"
    if peak is None and user_peak:
        peak, source = user_peak, "user-given peak"
    if peak is None:
        named = device if precision == "fp32" else f"{device} {precision}"
        return Utilisation(None, None, f"n/a (unknown peak for {named})")
    if shape is None:
        return Utilisation(None, None, "n/a (the log does not give the model's FLOPs: no vocabulary size, a pretrained "
                                       "folder no longer readable, or LoRA targets gptpar/adapters.py cannot count)")
    if not tokens_per_s:
        return Utilisation(None, None, "n/a (no throughput)")
    mfu = tokens_per_s * flops_per_token(shape) / (devices * peak)
    hfu = tokens_per_s * hardware_flops_per_token(shape) / (devices * peak)
    basis = f"{device} {precision} {source} {peak / 1e12:g} TFLOP/s"
    if hfu > 1.0:
        return Utilisation(None, None, f"flagged: {hfu:.0%} of the {basis} is impossible (wrong device, peak or "
                                       "throughput)")
    return Utilisation(mfu, hfu, basis)
