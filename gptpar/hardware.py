"""What each GPU can compute: its dense peak FLOP/s by precision, from the vendor's datasheet.

One table for three readers: the MFU of the report and of the planner (gptpar.flops), the planner's reading of
train.precision=auto (`resolved_precision`, which the trainer calls too), and the submit side, which refuses a precision
the profile's GPU type lacks (bf16 on a V100) before the job waits in the queue only to fail at its first step.
"""

from __future__ import annotations

from collections.abc import Callable

# Dense peak FLOP/s per GPU from NVIDIA's datasheets (Tensor Core peaks without sparsity; fp32 is the
# non-Tensor-Core peak), by a fragment of the lower-cased device name (first match wins, so the
# PCIe/NVL/S variants come before their SXM siblings), then by precision. A precision a GPU lacks
# (bf16 and tf32 on a V100) is absent, so its MFU is n/a rather than measured against another peak.
PEAK_FLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("v100-pcie", {"fp32": 14e12, "fp16": 112e12}),
    ("v100", {"fp32": 15.7e12, "fp16": 125e12}),
    ("a100", {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12}),
    ("a10", {"fp32": 31.2e12, "tf32": 62.5e12, "bf16": 125e12, "fp16": 125e12}),
    ("a40", {"fp32": 37.4e12, "tf32": 74.8e12, "bf16": 149.7e12, "fp16": 149.7e12}),
    ("l40s", {"fp32": 91.6e12, "tf32": 183e12, "bf16": 362.05e12, "fp16": 362.05e12}),
    ("l40", {"fp32": 90.5e12, "tf32": 90.5e12, "bf16": 181e12, "fp16": 181e12}),
    ("l4", {"fp32": 30.3e12, "tf32": 60e12, "bf16": 121e12, "fp16": 121e12}),
    ("h100 pcie", {"fp32": 51.2e12, "tf32": 378e12, "bf16": 756e12, "fp16": 756e12}),
    ("h100 nvl", {"fp32": 60e12, "tf32": 417.5e12, "bf16": 835e12, "fp16": 835e12}),
    ("h100", {"fp32": 66.9e12, "tf32": 494.7e12, "bf16": 989.4e12, "fp16": 989.4e12}),  # SXM
    ("gh200", {"fp32": 67e12, "tf32": 494e12, "bf16": 990e12, "fp16": 990e12}),
    ("h200", {"fp32": 66.9e12, "tf32": 494.7e12, "bf16": 989.4e12, "fp16": 989.4e12}),  # SXM
)


def peaks_of(device_name: str) -> dict[str, float] | None:
    """The peaks of a device by its name (a logged CUDA name, or a SLURM GPU type such as v100-32); None when
    unknown (a CPU, a GPU the table lacks)."""
    name = device_name.lower().replace("_", " ")
    return next((peaks for fragment, peaks in PEAK_FLOPS if fragment in name), None)


def resolved_precision(setting: str, gpu: bool, native_bf16: Callable[[], bool]) -> str:
    """`train.precision` as a rank runs it, the one rule the trainer and the planner both apply: `auto` is bf16 on a GPU
    with native bf16 (compute capability 8.0 and newer; asked only then), fp16 with the loss scale on older GPUs, fp32
    on CPUs (bf16 matmuls are slower than fp32 there)."""
    if setting != "auto":
        return setting
    if not gpu:
        return "fp32"
    return "bf16" if native_bf16() else "fp16"
