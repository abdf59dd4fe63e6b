"""Model FLOPs utilisation: training FLOPs per token from the model shape, over a known peak.

An MFU against a guessed peak is worse than none, so an unknown device (including a CPU)
gets an explicit "n/a" naming it.
"""

from __future__ import annotations

from typing import Any

from gptpar.presets import PRESETS

# Dense (no sparsity) peak FLOP/s per GPU, by a fragment of the device name (first match wins,
# so the more specific PCIe names come before their SXM siblings), then by precision.
PEAK_FLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("v100-pcie", {"fp32": 14e12, "fp16": 112e12}),
    ("v100", {"fp32": 15.7e12, "fp16": 125e12}),
    ("a100", {"fp32": 19.5e12, "tf32": 156e12, "fp16": 312e12, "bf16": 312e12}),
    ("h100 pcie", {"fp32": 51.2e12, "tf32": 378e12, "fp16": 756e12, "bf16": 756e12}),
    ("h100", {"fp32": 66.9e12, "tf32": 494.7e12, "fp16": 989.4e12, "bf16": 989.4e12}),
)
PRECISIONS = {"float32": "fp32", "float16": "fp16", "half": "fp16", "bfloat16": "bf16"}


def model_shape(params: dict[str, Any]) -> tuple[int, int, int, int]:
    """(layers, width, heads, seq_len) of a flattened resolved config: the preset with its overrides."""
    n_layer, n_embd, n_head, _ = PRESETS[params.get("model.preset", "gpt2-tiny")]
    return (params.get("model.n_layer") or n_layer, params.get("model.n_embd") or n_embd,
            params.get("model.n_head") or n_head, params.get("data.seq_len", 128))


def flops_per_token(n_layer: int, n_embd: int, n_head: int, seq_len: int) -> float:
    """6N + 12·L·H·Q·T, N the non-embedding parameters (blocks and the final layer norm)."""
    per_block = 12 * n_embd * n_embd + 13 * n_embd  # qkv, proj, 4x MLP, two layer norms
    n_params = n_layer * per_block + 2 * n_embd
    head_dim = n_embd // n_head
    return 6.0 * n_params + 12.0 * n_layer * n_head * head_dim * seq_len


def peak_flops(device_name: str, precision: str) -> float | None:
    name = device_name.lower().replace("_", " ")
    for fragment, peaks in PEAK_FLOPS:
        if fragment in name:
            return peaks.get(precision)
    return None


def device_label(header: dict[str, Any], params: dict[str, Any]) -> tuple[str, str]:
    """(device, precision): the logged device_name, else the requested launch.gpu_type of a CUDA
    run, else the device; the logged dtype or precision, else fp32 (the trainer has no AMP)."""
    device = str(header.get("device", "unknown"))
    gpu_type = params.get("launch.gpu_type")
    if header.get("device_name"):
        device = str(header["device_name"])
    elif device.startswith("cuda") and gpu_type:
        device = str(gpu_type)
    raw = str(header.get("dtype") or header.get("precision") or "fp32").removeprefix("torch.")
    return device, PRECISIONS.get(raw, raw)


def mfu(tokens_per_s: float | None, gpus: int, device: str, precision: str, params: dict[str, Any]
        ) -> tuple[float | None, str]:
    """(MFU, how it was computed or why it is n/a)."""
    peak = peak_flops(device, precision)
    if peak is None:
        return None, f"n/a (unknown peak for {device}{'' if precision == 'fp32' else ' ' + precision})"
    if not tokens_per_s:
        return None, "n/a (no throughput)"
    flops = flops_per_token(*model_shape(params))
    return tokens_per_s * flops / (gpus * peak), f"{device} {precision} peak {peak / 1e12:g} TFLOP/s"
