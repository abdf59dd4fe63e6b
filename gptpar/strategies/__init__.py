"""What each parallel strategy is, as torch-free tables that the config, the trainer, the analysis and the
planner all read: the data-parallel strategies (data_parallel.py), the pipeline schedules (schedules.py) and
the tensor-parallel implementations (tensor_parallel.py). This package sits below the config: it imports
nothing of gptpar but errors and presets, so the login side and the report can read it without torch."""

from gptpar.strategies import data_parallel, pipeline, tensor_parallel

# Each parallelism's check of its own keys, in the order the config calls them after its cross-key checks.
STRATEGY_CHECKS = (pipeline.check, data_parallel.check, tensor_parallel.check)
