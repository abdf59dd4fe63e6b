"""The course assignment's import path, and nothing more: its names for one-process pipelining (`WithDevice`,
`split_module`, `_split_module`, `clock_cycles`, `_clock_cycles`, `Pipe`, `GPT2LMHeadModelParallel` and its
`GPT2ModelParallel`) and GPT-2's model/pipeline modes, kept importable here (docs/assignment.md). The pipeline's code
has one home, gptpar/parallel/pipeline (this corner's is one_process/), and its torch-free schedules and cuts another,
gptpar/strategies/pipeline.py; gptpar itself imports neither through here."""

from gptpar.parallel.pipeline.one_process.gpt2 import (
    GPT2LMHeadModelParallel,
    GPT2ModelParallel,
    ParallelGPT2,
    build_parallel_model,
    input_device,
    output_device,
    resolve_devices,
)
from gptpar.parallel.pipeline.one_process.pipe import (
    ModelParallel,
    Pipe,
    PipeError,
    PipeStats,
    WithDevice,
    _clock_cycles,
    _split_module,
    clock_cycles,
    split_module,
)

__all__ = [
    "GPT2LMHeadModelParallel", "GPT2ModelParallel", "ModelParallel", "ParallelGPT2", "Pipe", "PipeError", "PipeStats",
    "WithDevice", "_clock_cycles", "_split_module", "build_parallel_model", "clock_cycles", "input_device",
    "output_device", "resolve_devices", "split_module",
]
