"""The only code that knows a run folder: names, paths, the config written once, the lock of a live run,
making a folder and setting one aside (start.py), a rank's claim on it (claim.py), the per-rank JSONL
format (writer and reader), and a run's state.

Layout of a run folder, the same on every cluster:
    config.yaml        the resolved config, written once at submission (or at `gptpar train` start)
    rank<R>.jsonl      one log per rank; a restarted run appends a segment (header first)
    checkpoint/        the latest checkpoint (torch.distributed.checkpoint), swapped in atomically
    job/               job.json (backend and job id), the job script, the job's and ranks' stdout/stderr
    .lock              held by the live run (host, pid, job id, heartbeat)
"""
