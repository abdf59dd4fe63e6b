"""Model and pipeline parallelism of GPT-2 inside one process (GPipe over threads)."""
