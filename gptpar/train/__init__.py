"""Training: the loop and its components (optimizer, schedule, progress, provenance, preemption, checkpoints)."""
