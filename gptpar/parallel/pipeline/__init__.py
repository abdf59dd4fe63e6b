"""Pipeline and model parallelism of GPT-2, two ways.

- one_process/: one process drives every stage, each on a device of its own (GPipe over worker threads,
  or the whole batch visiting the stages in turn); the assignment's `Pipe` and `GPT2LMHeadModelParallel`.
- engine/: one process per stage (parallel.pp > 1), activations sent between ranks, running the schedules
  of gptpar.strategies.pipeline (GPipe, 1F1B, interleaved 1F1B, ZB-H1).

Both cut a model the same way (the architecture's pieces, gptpar/models; cuts: how many blocks each stage gets)
and map their parameter names back to the model's the same way (names).
"""
