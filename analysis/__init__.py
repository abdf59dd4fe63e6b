"""Turn the per-rank JSONL logs under runs/ into a summary table and scaling figures.

`analysis.load_runs(runs_dir)` gives the run table to a notebook (analysis/load.py); it is imported on first use,
so that `gptpar trace` and the other light users of this package do not load the report and matplotlib.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "load_runs":
        from analysis.load import load_runs

        return load_runs
    raise AttributeError(f"module 'analysis' has no attribute {name!r}")
