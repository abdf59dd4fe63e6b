"""What each parallel strategy is, as torch-free tables that the config, the trainer, the analysis and the
planner all read: the data-parallel strategies (data_parallel.py), the pipeline's cuts and schedules (pipeline.py) and
the tensor-parallel implementations (tensor_parallel.py). This package sits below the config: it imports
nothing of gptpar but errors and presets, so the login side and the report can read it without torch, and the config
checks its keys by calling it with plain values (gptpar/config/parallel_checks.py)."""
