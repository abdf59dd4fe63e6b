"""Everything about ranks and parallelism: where a rank sits (env, process_group, grid), how local
ranks are started for tests (spawn), and one folder per parallelism: data_parallel/ (naive,
bucketed, ddp, the sharded ones), pipeline/ (one_process/: GPipe `Pipe` and GPT-2's model/pipeline
modes in one process; engine/: the multi-process pipeline) and tensor_parallel/.

`gptpar.parallel.env` is importable without torch (the launch side uses it), so the names re-exported
here, `average_gradients` (the assignment's) and `make_grad_sync`, are imported when first used.
"""

from typing import Any

__all__ = ["average_gradients", "make_grad_sync"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from gptpar.parallel import data_parallel

        return getattr(data_parallel, name)
    raise AttributeError(f"module 'gptpar.parallel' has no attribute {name!r}")
