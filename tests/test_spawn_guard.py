"""The `slow` marker cannot go stale: a test not marked slow that starts a process fails, with a hint."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SPAWN_HINT

INNER_TESTS = '''
import subprocess
import sys

import pytest


def test_unmarked_spawn():
    try:  # the guard's failure is not an Exception: code that swallows errors does not hide it
        subprocess.run([sys.executable, "-c", "pass"], check=True)
    except Exception:
        pass


@pytest.mark.slow
def test_marked_spawn():
    subprocess.run([sys.executable, "-c", "pass"], check=True)
'''


def test_a_fast_test_cannot_start_a_subprocess() -> None:
    with pytest.raises(pytest.fail.Exception, match="mark it @pytest.mark.slow"):
        subprocess.run([sys.executable, "-c", "pass"], check=True)
    with pytest.raises(pytest.fail.Exception, match="mark it @pytest.mark.slow"):
        os.system("true")


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_a_fast_test_cannot_start_a_multiprocessing_process(method: str) -> None:
    process = multiprocessing.get_context(method).Process(target=print)
    with pytest.raises(pytest.fail.Exception, match="mark it @pytest.mark.slow"):
        process.start()
    assert process.pid is None


@pytest.mark.slow
def test_a_slow_test_starts_processes_and_an_unmarked_one_fails_in_a_real_session(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-c", "pass"], check=True)  # the guard is off for a slow test
    for helper in ("conftest.py", "gloo_pool.py"):  # the guard, and the pool its fixtures import
        (tmp_path / helper).write_text((Path(__file__).parent / helper).read_text())
    (tmp_path / "test_inner.py").write_text(INNER_TESTS)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: starts a process\n")
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                         capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "1 failed, 1 passed" in out.stdout, out.stdout
    assert "FAILED test_inner.py::test_unmarked_spawn" in out.stdout, out.stdout
    assert f"Failed: {SPAWN_HINT}" in out.stdout, out.stdout
