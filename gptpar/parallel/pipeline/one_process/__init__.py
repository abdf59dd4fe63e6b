"""Pipeline and model parallelism inside one process: `Pipe` (GPipe, one worker thread per partition) and
`ModelParallel` over an nn.Sequential, and GPT-2's `single`, `model_parallel` and `pipeline_parallel` modes on
the devices of `parallel.devices`. Unlike the multi-process engine (../engine/) nothing crosses a process: one
autograd graph, one optimizer, no messages."""
