"""Tensor parallelism's implementations (`parallel.tp_impl`) as a table; the config checks parallel.tp against it,
the model's shape, the sequence, the pipeline and the data-parallel rows (gptpar/config/parallel_checks.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TensorParallelImpl:
    help: str
    with_pipeline: bool  # composes with the multi-process pipeline (parallel.pp > 1)


TP_IMPLS: dict[str, TensorParallelImpl] = {
    "gptpar": TensorParallelImpl("ours, Megatron-style (on GPT-2's Conv1D, the Llama family's Linear)",
                                 with_pipeline=True),
    "torch": TensorParallelImpl("torch.distributed.tensor.parallel on the same plan", with_pipeline=False),
}
