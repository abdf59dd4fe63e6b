"""What `gptpar plan predict` prints: one layout's prediction as lines, or as one JSON object."""

from __future__ import annotations

import json

from gptpar.cluster.shape import shaped
from gptpar.config import Config, updated
from gptpar.flops import peak_flops
from gptpar.hardware import resolved_precision
from gptpar.parallel.grid import ranks_per_replica
from gptpar.plan.calibration import CALIBRATION_FLAG
from gptpar.plan.layout import Layout, layout_of
from gptpar.plan.predict import Prediction, predict
from gptpar.plan.target import Target, target_of

MB = 1e6


def resolved_layout(cfg: Config, target: Target) -> Layout:
    """The layout of `cfg` with train.precision=auto resolved for the target's device, as its ranks would: native bf16
    where the device's datasheet peaks have it."""
    device = "cpu" if target.calibration.device == "cpu" else target.device
    precision = resolved_precision(cfg.train.precision, device != "cpu", lambda: bool(peak_flops(device, "bf16")))
    return layout_of(updated(cfg, {"train.precision": precision}) if precision != cfg.train.precision else cfg)


def predict_config(cfg: Config, calibration: str | None, key: str = CALIBRATION_FLAG
                   ) -> tuple[Layout, Target, Prediction]:
    """`cfg` as its job would run it: a job of launch.gpus x launch.nodes GPUs fills parallel.dp (left at 1) with
    replicas, as `gptpar submit dp` does. `key` names where the calibration was given, for its errors."""
    if cfg.parallel.dp == 1 and max(cfg.launch.gpus, 1) * cfg.launch.nodes > ranks_per_replica(cfg):
        cfg = shaped(cfg, "dp")
    target = target_of(cfg, calibration, key)
    layout = resolved_layout(cfg, target)
    return layout, target, predict(layout, target.calibration, target.network, target.device)


def describe(layout: Layout) -> str:
    """The layout in one line; at dp=1 its sync only where parallel.offload builds it (over a group of one)."""
    offloaded = layout.offload != "none"
    parts = [f"dp={layout.dp} ({layout.dp_sync})" if layout.dp > 1 or offloaded else "dp=1"]
    if offloaded:
        parts.append(f"offload={layout.offload}")
    if layout.cp > 1:
        parts.append(f"cp={layout.cp} ({layout.cp_impl})")
    if layout.tp > 1:
        parts.append(f"tp={layout.tp}" + (" +SP" if layout.sequence_parallel else ""))
    if layout.pp > 1:
        parts.append(f"pp={layout.pp} {layout.schedule} m={layout.chunks}" + (f" V={layout.virtual}"
                                                                            if layout.virtual > 1 else ""))
    if layout.grad_accum > 1:
        parts.append(f"grad_accum={layout.grad_accum}")
    if layout.checkpoint_every:
        parts.append(f"recompute every {layout.checkpoint_every}")
    return " ".join(parts) + f", micro-batch {layout.seqs}x{layout.seq_len}, {layout.precision}"


def cost(pred: Prediction, steps: int, target: Target) -> dict[str, float | str]:
    """Wall time and device-hours of `steps` steps; `unit` names the device-hours (a CPU's are not GPU-hours; the key
    stays gpu_hours for readers of --json)."""
    seconds = pred.step_time_s * steps
    unit = "CPU-hours" if target.calibration.device == "cpu" else "GPU-hours"
    return {"steps": steps, "seconds": seconds, "gpu_hours": seconds * pred.gpus / 3600, "unit": unit}


def as_json(layout: Layout, target: Target, pred: Prediction, steps: int) -> str:
    return json.dumps({**pred.to_dict(), "layout": describe(layout), "device": target.device,
                       "calibration": target.calibration_name, "cost": cost(pred, steps, target),
                       "memory_limit_bytes": target.memory_bytes})


def as_text(layout: Layout, target: Target, pred: Prediction, steps: int) -> str:
    comm = sum(pred.exposed_comm_s.values())
    kinds = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in sorted(pred.exposed_comm_s.items(), key=lambda kv: -kv[1]))
    m = pred.memory
    c = cost(pred, steps, target)
    limit = f" of {target.memory_bytes / MB:,.0f} MB" if target.memory_bytes else ""
    lines = [
        f"{describe(layout)}; {pred.gpus} rank(s) on {target.device} (calibration: {target.calibration_name})",
        f"step time    {pred.step_time_s * 1e3:,.1f} ms = compute {pred.compute_s * 1e3:,.1f} + bubble "
        f"{pred.bubble_s * 1e3:,.1f} + exposed communication {comm * 1e3:,.1f}" + (f" ({kinds})" if kinds else ""),
        f"tokens/s     {pred.tokens_per_s:,.0f} ({layout.step_tokens:,} tokens per step)",
        f"memory/rank  {pred.memory_bytes / MB:,.1f} MB{limit}: parameters {m['params'] / MB:,.1f}, gradients "
        f"{m['grads'] / MB:,.1f}, optimizer {m['optimizer'] / MB:,.1f}, activations {m['activations'] / MB:,.1f}"
        + (f", gathered {m['gathered'] / MB:,.1f}" if m["gathered"] else "")
        + (f", hpZ copy {m['hpz'] / MB:,.1f}" if m.get("hpz") else "")
        + (f"; on the host {m['host'] / MB:,.1f} (parallel.offload)" if m.get("host") else ""),
        "MFU          " + (f"{pred.mfu:.1%}" if pred.mfu is not None else "n/a (no datasheet peak for this device)"),
        f"cost         {c['steps']:,} steps: {c['seconds'] / 3600:,.2f} h wall, {c['gpu_hours']:,.2f} {c['unit']}",
    ]
    return "\n".join(lines + [f"note: {n}" for n in pred.notes])
