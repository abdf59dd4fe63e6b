"""A local sweep's points waiting their turn read `queued`, the one whose ranks are starting reads `starting`, and
neither reads `failed ... died before its first log record` (issue 48, point 1)."""

from __future__ import annotations

import json
import stat
import sys
import time
from pathlib import Path

import pytest
from logsets import Rank, config

from gptpar.launch.status import render_status
from gptpar.launch.sweep import submit_sweep
from gptpar.run.folder import RunFolder
from gptpar.run.queue import queued, starting
from gptpar.run.rows import row_of
from gptpar.run.state import read_run


def _planned(path: Path) -> RunFolder:
    folder = RunFolder(path)
    path.mkdir(parents=True)
    folder.config_path.write_text("{}\n")  # what a sweep writes before any point starts
    return folder


def test_points_in_a_launchers_queue_read_queued_then_starting_never_failed(tmp_path: Path) -> None:
    first, second = _planned(tmp_path / "a"), _planned(tmp_path / "b")
    with queued([first, second]):
        assert [read_run(f).state for f in (first, second)] == ["queued", "queued"]
        assert read_run(second).detail.startswith("waiting for its turn in the launcher (host ")
        with starting(first, "vm:42.1"):
            assert [read_run(f).state for f in (first, second)] == ["starting", "queued"]
            assert read_run(first).detail.startswith("job vm:42.1: its ranks are starting (host ")
            rows = [row_of(read_run(f), None, tmp_path, 0.0) for f in (first, second)]
            assert render_status(rows, 0).endswith("2 run(s): 1 queued, 1 starting")
            rank = Rank(first.path, 0, config())  # its rank starts and ends; the launcher has not seen it exit yet
            rank.clock = time.time()
            rank.header().step(1).final("completed", 1)
            assert read_run(first).state == "completed"  # the records decide from its first one on
        assert read_run(second).state == "queued"
    assert read_run(second).detail.startswith("died before its first log record")  # no launcher holds it now


@pytest.mark.slow
def test_a_local_sweep_holds_each_point_queued_until_its_ranks_start(tmp_path: Path) -> None:
    """Two points of a local sweep, run in turn: each rank (a stand-in `gptpar`) records the states of both
    points as it starts, which is what `gptpar status` shows then."""
    venv, seen = tmp_path / "venv", tmp_path / "seen.jsonl"
    (venv / "bin").mkdir(parents=True)
    fake = venv / "bin" / "gptpar"
    fake.write_text(f"#!{sys.executable}\nimport json, os\nfrom pathlib import Path\n"
                    "from gptpar.run.folder import RunFolder\nfrom gptpar.run.state import read_run\n"
                    "here = Path(os.getcwd())\n"
                    f"with open({str(seen)!r}, 'a') as out:\n"
                    "    states = {p.name: read_run(RunFolder(p)).state for p in here.parent.iterdir() if p.is_dir()}\n"
                    "    out.write(json.dumps(states, sort_keys=True) + '\\n')\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    sweep = tmp_path / "two.yaml"
    sweep.write_text("name: two\nkind: dp\ngrid:\n  train.lr: [0.1, 0.2]\n")
    overrides = [f"launch.venv={venv}", "launch.cluster=local", "data.tokenizer=bytes"]
    submit_sweep(sweep, str(tmp_path / "runs"), overrides)
    assert [json.loads(line) for line in seen.read_text().splitlines()] == [
        {"train.lr=0.1": "starting", "train.lr=0.2": "queued"},
        {"train.lr=0.1": "failed", "train.lr=0.2": "starting"}]  # the stand-in logs nothing: failed once it ends
