"""Shared fixtures: an isolated data cache per test session, the shared corpus when present, the pool of gloo
ranks the equality tests run on; and the guard
that keeps `-m "not slow"` fast: a test not marked slow cannot start a process."""

from __future__ import annotations

import contextlib
import multiprocessing.process
import os
import subprocess
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from gloo_pool import GlooPools

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
SPAWN_HINT = "this test starts a process: mark it @pytest.mark.slow"
# Every way a test starts a process: subprocess (and the `gptpar` CLI, sys.executable -m ..., the local launcher),
# multiprocessing and torch.multiprocessing (spawn_local), and the os calls underneath neither.
SPAWN_ENTRIES = [(subprocess.Popen, "_execute_child"), (multiprocessing.process.BaseProcess, "start"),
                 *((os, name) for name in ("system", "fork", "forkpty", "posix_spawn", "posix_spawnp")
                   if hasattr(os, name))]


def _refuse_process(*args, **kwargs):
    pytest.fail(SPAWN_HINT)  # an outcome exception: `except Exception` in the code under test cannot swallow it


@contextlib.contextmanager
def processes_refused() -> Iterator[None]:
    """Within, starting a child process fails the test with SPAWN_HINT."""
    saved = [(owner, name, owner.__dict__[name]) for owner, name in SPAWN_ENTRIES]
    try:
        for owner, name, _ in saved:
            setattr(owner, name, _refuse_process)
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


@contextlib.contextmanager
def slurm_queue_unasked() -> Iterator[None]:
    """Within, `gptpar status` lists no pending job of the plain sbatch scripts instead of asking squeue (a process):
    a fast test's runs are the folders it wrote; tests/launch/test_slurm.py asks the real queue."""
    from gptpar.launch import status

    asked = status.plain_jobs
    status.plain_jobs = list
    try:
        yield
    finally:
        status.plain_jobs = asked


@contextlib.contextmanager
def local_gpu_unasked() -> Iterator[None]:
    """Within, the planner's local profile plans this machine's CPU instead of asking nvidia-smi (a process) for its
    GPU: a fast test's calibrations are of the CPU, on CI's machine and on a GPU machine alike."""
    from gptpar.plan import target

    asked = target.local_gpu_name
    target.local_gpu_name = lambda: None
    try:
        yield
    finally:
        target.local_gpu_name = asked


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """A test not marked slow runs (setup of fixtures of every scope included) with processes refused, and so
    without SLURM's queue or nvidia-smi."""
    if item.get_closest_marker("slow"):
        return (yield)
    with processes_refused(), slurm_queue_unasked(), local_gpu_unasked():
        return (yield)


# Files whose tests must not run beside each other, as units run in order on one worker each under pytest-xdist's
# `--dist loadfile` (make test's two parts): those that share the local SLURM cluster's two nodes (a job of one would
# queue behind another's), and those that stop, kill and time whole local runs. Every other file is a unit of its own,
# so that its module fixtures are built once. (pytest-xdist's own `loadgroup` marks do not reach its scheduler under
# pytest 9.)
SERIAL_UNITS = {"slurm": ("tests/launch/", "tests/e2e/test_readme.py"), "whole runs": ("tests/e2e/test_hostile_",)}


def scheduling_unit(nodeid: str) -> str:
    """The unit a test runs in: its SERIAL_UNITS name, or its file."""
    path = nodeid.split("::")[0]
    return next((unit for unit, prefixes in SERIAL_UNITS.items() if path.startswith(prefixes)), path)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: pytest without it runs the tests in one process
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadfile` by scheduling_unit; the units go out most tests first (the serial ones are among the first)."""
    from xdist.scheduler import LoadFileScheduling

    class SerialUnits(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scheduling_unit(nodeid)

    return SerialUnits(config, log) if config.getvalue("dist") == "loadfile" else None


@pytest.fixture(scope="session")
def gloo_pool() -> Iterator[GlooPools]:
    """The session's 2-, 4- and 8-rank gloo groups, each started on first use (see gloo_pool.py)."""
    pools = GlooPools()
    yield pools
    pools.close()


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache for the session, so the corpus is tokenized once across tests; beside it an empty user defaults
    file (GPTPAR_USER_CONFIG must name one that exists), there before any fixture starts a gptpar process."""
    path = tmp_path_factory.mktemp("gptpar-data")
    (path / "no-user-defaults.yaml").touch()
    return path


JOB_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "GPTPAR_PROFILE", "GPTPAR_ACCOUNT",
            "NERSC_HOST")


def isolated_environ(environ: Mapping[str, str], data_dir: Path) -> dict[str, str]:
    """`environ` kept off the network and off the user's caches and defaults, outside any surrounding job: what
    every test runs in (a fixture that starts processes for several tests builds it itself, see test_readme)."""
    env = {key: value for key, value in environ.items()
           if not key.startswith(("SLURM_", "SBATCH_")) and key not in JOB_VARS}
    return {**env, "GPTPAR_DATA_DIR": str(data_dir), "HF_HUB_OFFLINE": "1",
            "GPTPAR_USER_CONFIG": str(data_dir / "no-user-defaults.yaml")}  # not the tester's own


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch: pytest.MonkeyPatch, data_dir: Path) -> None:
    """Every test runs in isolated_environ."""
    env = isolated_environ(os.environ, data_dir)
    for key in set(os.environ) - set(env):
        monkeypatch.delenv(key)
    for key, value in env.items():
        if os.environ.get(key) != value:
            monkeypatch.setenv(key, value)


@pytest.fixture
def shakespeare_dir() -> Path:
    if not (SHARED_DATA / "tinyshakespeare.txt").is_file():
        pytest.skip("../shared/data/tinyshakespeare.txt is not present")
    return SHARED_DATA



def command_words(*groups: Iterable[str]) -> list[str]:
    """The words of `groups` in order, a later `section.key=value` replacing an earlier one of the same key (in the
    earlier's place): gptpar refuses a key given twice on one command line."""
    words: list[str] = []
    for word in (w for group in groups for w in group):
        key, eq, _ = word.partition("=")
        if eq and "." in key and not key.startswith("-"):
            words = [w for w in words if w.partition("=")[0] != key]
        words.append(word)
    return words


@contextlib.contextmanager
def figures_kept() -> Iterator[dict]:
    """Within, every figure the report writes is kept by file name (after it is written), for a test to inspect."""
    import analysis.canvas as canvas

    kept: dict = {}
    write = canvas.write

    def keep(fig, path: Path, dpi: int | None = None) -> None:  # noqa: ANN001 - a matplotlib Figure
        write(fig, path, dpi)
        kept[path.name] = fig

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(canvas, "write", keep)
        yield kept


@pytest.fixture
def drawn() -> Iterator[dict]:
    """Every figure the report writes in the test, by file name (figures_kept)."""
    with figures_kept() as kept:
        yield kept
