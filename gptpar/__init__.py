"""gptpar: data- and pipeline-parallel GPT-2 training as SLURM batch jobs."""

__version__ = "0.1.0"
