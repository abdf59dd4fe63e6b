"""The report's look at sft's decoded answers: a few of each run's last scored epoch (gptpar.run.logfile), so a
low answer_accuracy shows whether the model answered wrongly or answered in another format."""

from __future__ import annotations

from pathlib import Path

from gptpar.run.logfile import read_answers

SHOWN = 3  # answers per run
WIDTH = 80  # characters of a prompt or response in the table


def answers_section(runs: list[tuple[str, Path]], shown: int = SHOWN) -> list[str]:
    """Markdown lines: the first `shown` answers of the last epoch each (run id, run folder) kept; [] when none."""
    rows = []
    for run_id, folder in runs:
        epochs = read_answers(folder)
        if epochs:
            epoch, answers = next(reversed(epochs.items()))
            rows += [f"| {run_id} | {epoch} | {_cell(a.prompt)} | {_cell(a.response)} | {_cell(a.reference)} "
                     f"| {'yes' if a.correct else 'no'} |" for a in answers[:shown]]
    if not rows:
        return []
    return ["", "## Decoded answers (data.task=sft)", "",
            f"The first {shown} scored validation prompts of each run's last epoch (all of them in "
            f"`answers/epoch<N>.jsonl`), each text on one line, cut to {WIDTH} characters.", "",
            "| run | epoch | prompt | response | reference | correct |", "|---|---|---|---|---|---|", *rows]


def _cell(text: str) -> str:
    """`text` on one line of a table cell, at most WIDTH characters; an empty one (an untrained model's answer)
    says so."""
    flat = " ".join(str(text).split()).replace("|", "/")
    return (flat if len(flat) <= WIDTH else flat[:WIDTH - 1] + "…") or "(empty)"
