"""The launchers' registry (gptpar/launchers.py) is the one place a launcher is known: every row's backends and
--dry-run text load, no other library module names a launcher or its variables, and a new launcher is one backend
(here, this file) plus one row: the config offers it, launch/backend.py picks it and prints its dry run, and its
ranks find their place and leave the requeue to it, with no library file edited."""

from __future__ import annotations

import ast
import importlib
from collections.abc import Sequence
from pathlib import Path

import pytest

from gptpar.cli import main
from gptpar.config import ConfigError, load_config, reference_markdown
from gptpar.errors import GptparError
from gptpar.launch.backend import backend_named, choose_backend
from gptpar.launch.prepare import Point, prepare_run
from gptpar.launch.profiles import JobSpec, resolve
from gptpar.launchers import CLUSTERS, LAUNCHERS, LauncherRow, TaskVars
from gptpar.parallel.env import Layout, layout_from_env, slurm_port
from gptpar.train import preemption

GPTPAR = Path(__file__).resolve().parents[2] / "gptpar"


class TinyBackend:
    """The example launcher's backend, not shipped: it only says what it would run."""

    name = "tiny"
    where = "the tests' tiny launcher"
    scheduler = ""

    def submit(self, points: Sequence[Point], spec: JobSpec, name: str, output_dir: Path) -> list[str]:
        return [f"tiny:{point.folder.name}" for point in points]

    def check(self, spec: JobSpec) -> None:
        """Takes any shape."""

    def state(self, job_id: str) -> str | None:
        return None

    def cancel(self, job_id: str) -> None:
        """Nothing runs."""


def tiny_text(points: Sequence[Point], spec: JobSpec, name: str, output_dir: Path) -> str:
    return f"# tiny: {name} on {spec.nodes * spec.tasks_per_node} rank(s) in {output_dir}\n"


TINY = LauncherRow("tiny", "the tests' example", dict.fromkeys(CLUSTERS, f"{__name__}:TinyBackend"),
                   f"{__name__}:tiny_text", whole_minutes=True, marker="TINY_TASK",
                   local_tasks=TaskVars("TINY_JOB", "TINY_TASKS", "TINY_NODES", "TINY_RANK", "TINY_LOCAL_RANK"))


def _loaded(ref: str) -> object:
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


def test_every_row_names_a_backend_for_each_cluster_and_a_dry_run() -> None:
    names = []
    for launcher, row in LAUNCHERS.items():
        assert row.name == launcher and set(row.backends) == set(CLUSTERS), launcher
        for ref in row.backends.values():
            backend = _loaded(ref)()
            assert all(callable(getattr(backend, m)) for m in ("submit", "check", "state", "cancel")), ref
            assert isinstance(backend.where, str) and isinstance(backend.scheduler, str), ref
            assert backend_named(backend.name).__class__ is backend.__class__, ref  # a job record makes it again
            names.append(backend.name)
        assert callable(_loaded(row.dry_run)), launcher
    assert len(names) == len(set(names))  # each job record names one backend


def _strings(path: Path) -> set[str]:
    return {node.value for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)}


def test_no_library_module_but_the_registry_and_the_backends_names_a_launcher() -> None:
    """A branch on launch.launcher's value, or a read of a launcher's own variables, outside the registry and the
    modules its rows name, is a file a new launcher would have to touch."""
    rows = LAUNCHERS.values()
    refs = {ref for row in rows for ref in (*row.backends.values(), row.dry_run)}
    named = {"gptpar/launchers.py"} | {ref.partition(":")[0].replace(".", "/") + ".py" for ref in refs}
    words = {row.name for row in rows} | {row.marker for row in rows if row.marker} | {
        var for row in rows if row.local_tasks for var in vars(row.local_tasks).values()}
    found = {}
    for path in sorted(GPTPAR.rglob("*.py")):
        relative = str(path.relative_to(GPTPAR.parent))
        if relative not in named and (hits := _strings(path) & words):
            found[relative] = sorted(hits)
    assert found == {}


def test_a_new_launcher_is_one_backend_and_one_row(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(ConfigError, match="launch.launcher: 'tiny' is not allowed"):
        load_config(None, ["launch.launcher=tiny"])
    monkeypatch.setitem(LAUNCHERS, "tiny", TINY)
    launch = load_config(None, ["launch.launcher=tiny", "launch.cluster=local"]).launch
    assert isinstance(choose_backend(launch), TinyBackend) and isinstance(backend_named("tiny"), TinyBackend)
    assert f"One of: {', '.join(LAUNCHERS)}." in reference_markdown()
    assert main(["submit", "dp", "--gpus", "2", "--dry-run", "launch.launcher=tiny", f"log.runs_dir={tmp_path}",
                 "log.run_id=x"]) == 0
    assert capsys.readouterr().out == f"# tiny: x on 2 rank(s) in {tmp_path / 'x' / 'job'}\n"
    cfg = prepare_run(load_config(None, ["launch.launcher=tiny", "launch.time=00:00:30"]), "dp", str(tmp_path), "x",
                      write=False).cfg
    with pytest.raises(GptparError, match=r"^launch.time=00:00:30: launch.launcher=tiny takes whole minutes"):
        resolve(cfg, "dp")


def test_a_new_launchers_ranks_read_its_variables_and_leave_it_the_requeue(monkeypatch: pytest.MonkeyPatch) -> None:
    own = {"TINY_TASK": "local", "TINY_JOB": "77", "TINY_TASKS": "4", "TINY_NODES": "1", "TINY_RANK": "3",
           "TINY_LOCAL_RANK": "3"}
    srun = {"TINY_TASK": "slurm", "SLURM_PROCID": "1", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2",
            "SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_ID": "9"}
    assert layout_from_env(own).launcher == "single" and layout_from_env(srun).launcher == "slurm"
    assert not preemption.can_requeue({"TINY_TASK": "local"})
    monkeypatch.setitem(LAUNCHERS, "tiny", TINY)
    assert layout_from_env(own) == Layout("tiny", 3, 4, 3, 4, "127.0.0.1", slurm_port("77"))
    assert layout_from_env(srun) == Layout("tiny", 1, 2, 1, 2, "n1", slurm_port("9"))
    assert preemption.can_requeue({"TINY_TASK": "local"})
    for name, value in {**srun, "SLURM_PROCID": "0"}.items():
        monkeypatch.setenv(name, value)
    assert preemption.requeue_current_job() is False  # its own task requeues: no scontrol
