"""Model and pipeline parallelism of GPT-2 inside one process (GPipe over threads)."""

from gptpar.pipeline.gpt2 import (
    ParallelGPT2,
    build_parallel_model,
    input_device,
    output_device,
    resolve_devices,
)
from gptpar.pipeline.pipe import (
    ModelParallel,
    Pipe,
    PipeError,
    PipeStats,
    WithDevice,
    _split_module,
    clock_cycles,
    split_module,
)

__all__ = [
    "ModelParallel", "ParallelGPT2", "Pipe", "PipeError", "PipeStats", "WithDevice", "_split_module",
    "build_parallel_model", "clock_cycles", "input_device", "output_device", "resolve_devices",
    "split_module",
]
