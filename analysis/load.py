"""The run table for notebooks: the rows of the report's summary.csv as Python values, with each run's config.

    from analysis import load_runs
    runs = load_runs("runs/demo")               # a pandas DataFrame where pandas is installed
    rows = load_runs("runs/demo", frame=False)  # a list of dicts, one per run, either way

A row holds summary.csv's columns (None where a run has no value, flags as booleans, stitched epochs as a list),
`shown` (whether the report's table and figures include the run), and every config key by its dotted name
(`parallel.dp_sync`, `launch.repeat`, ...), so that runs can be grouped by any of them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from analysis.grouping import fp32_ratios
from analysis.report import print_warnings, run_table
from analysis.summary import row
from gptpar.errors import GptparError


def load_runs(runs_dir: str | Path = "runs", frame: bool | None = None, warmup_epochs: int = 1,
              warmup_steps: int = 5, include_incomplete: bool = False, peak_flops: float | None = None,
              target_loss: float | None = None) -> Any:
    """Every run under runs_dir as a row (the report's definitions and options); a DataFrame when `frame` is True,
    a list of dicts when False, and by default a DataFrame if pandas can be imported, else the list."""
    runs, shown = run_table(runs_dir, warmup_epochs, warmup_steps, include_incomplete, peak_flops=peak_flops,
                            target_loss=target_loss)
    print_warnings(runs)
    ratios = fp32_ratios(runs)
    rows = [{**row(r, ratios), "shown": r in shown, **r.params} for r in runs]
    if frame is False:
        return rows
    try:
        import pandas
    except ImportError:
        if frame:
            raise GptparError("load_runs(frame=True) needs pandas (pip install pandas); frame=False gives a list "
                              "of dicts") from None
        return rows
    return pandas.DataFrame(rows)
