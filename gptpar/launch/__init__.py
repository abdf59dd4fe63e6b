"""SLURM launch layer: cluster profiles, rendered sbatch scripts, submission, status and sweeps."""
