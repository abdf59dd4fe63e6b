"""Hostile and careless users, run-folder, sweep and path cases of the reliability issue (issue 17).

Items 4, 5, 8, 9 and 11 and the sweep and unwritable-runs-folder one-liners: sweep points that differ
only in characters a folder name replaces, a sweep re-run after its definition changed (`--rerun`,
sweep.json, `gptpar train --start-over`), SLURM that does not answer, run folders that would escape
the runs folder, hostile `launch.profile` paths, duplicated sweep axes, a `parallel.dp` the job shape
would replace, and a runs folder that cannot be created. In-process wherever possible: the trainer is
never run (a stand-in takes its place), and a job script is executed only to show it runs nothing.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import types
from pathlib import Path

import pytest
import yaml

from gptpar import api, cli
from gptpar.cluster import profiles as profiles_module
from gptpar.cluster.profiles import PROFILE_DIR, load_profile
from gptpar.config import config_digest, load_config
from gptpar.errors import GptparError
from gptpar.launch import local as local_module
from gptpar.launch import slurm
from gptpar.launch import sweep as sweep_module
from gptpar.launch.prepare import prepare_run
from gptpar.launch.profiles import resolve
from gptpar.launch.render import render_script
from gptpar.launch.sweep import build_points, expand, run_sweep
from gptpar.parallel.env import Layout
from gptpar.run.claim import claim_run_folder
from gptpar.run.folder import RunFolder
from gptpar.run.logfile import RankLogger
from gptpar.run.names import replaced
from gptpar.run.sweeps import SWEEP_RECORD, read_sweep_record, stale_runs

REPO = Path(__file__).resolve().parents[2]
FAKE_SINFO_ERROR = "sinfo: error: slurm_load_partitions: Unable to contact slurm controller (connect failure)"


def one_line(text: str) -> str:
    text = str(text)
    assert "\n" not in text.strip() and len(text) < 600, text
    return text.strip()


def complete(folder: RunFolder) -> None:
    """A finished rank log, as a completed run leaves it."""
    log = RankLogger(folder.path, 0)
    log.log("header", schema_version=2, run_id=folder.name, config={}, rank=0, world_size=1, coords={}, sizes={},
            restart=0, host="h", device="cpu", torch_version="2", transformers_version="5", git_commit="x",
            slurm={}, start_time=0.0)
    log.log("final", status="completed", step=2)
    log.close()


class Recorder:
    """A backend stand-in: records what it was asked to run; its jobs read as pending."""

    name, where = "recorder", "a test stand-in"

    def __init__(self) -> None:
        self.submitted: list[str] = []

    def submit(self, points, spec, name, output_dir):
        self.submitted += [p.folder.name for p in points]
        return [f"job-{p.folder.name}" for p in points]

    def check(self, spec):
        pass

    def state(self, job_id):
        return "pending"

    def cancel(self, job_id):
        pass


@pytest.fixture
def backend(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    recorder = Recorder()
    monkeypatch.setattr(sweep_module, "choose_backend", lambda launch: recorder)
    return recorder


@pytest.fixture
def no_trainer(monkeypatch: pytest.MonkeyPatch):
    """`gptpar train` in-process without torch: the rank entry module is a stand-in that records its calls,
    and the signal handlers the CLI installs are put back afterwards."""
    calls: list = []
    fake = types.ModuleType("gptpar.train.entry")
    fake.run_rank = lambda cfg, reshape=False: calls.append(cfg) or {"status": "completed"}
    monkeypatch.setitem(sys.modules, "gptpar.train.entry", fake)
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)}
    yield calls
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def write_sweep(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def run_cli(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def stub_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sinfo: str | None) -> Path:
    """PATH holding only a stand-in `sinfo` (or none at all)."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    if sinfo is not None:
        (bindir / "sinfo").write_text(sinfo)
        (bindir / "sinfo").chmod(0o755)
    monkeypatch.setenv("PATH", str(bindir))
    return bindir


# --- Item 4: sweep points differing only in characters a folder name replaces --------------------

def test_points_differing_only_in_replaced_characters_get_their_own_folders(tmp_path, backend):
    (tmp_path / "a b.txt").write_text("one corpus\n")
    (tmp_path / "a_b.txt").write_text("another corpus\n")
    sweep = write_sweep(tmp_path / "s.yaml", "name: chars\nbase: {data: {tokenizer: bytes}}\n"
                        f"grid: {{data.source: ['text:{tmp_path}/a b.txt', 'text:{tmp_path}/a_b.txt']}}\n")
    _, _, points = build_points(sweep, runs_dir=str(tmp_path / "runs"))
    first, second = points
    assert first.folder.path != second.folder.path
    assert first.folder.path.parent == second.folder.path.parent == (tmp_path / "runs" / "chars").resolve()
    # The first point ran; the second must start in a folder of its own, not resume the first's.
    prepare_run(first.cfg, None, first.folder.path.parent, first.folder.name)
    complete(first.folder)
    assert run_sweep(sweep, runs_dir=str(tmp_path / "runs")) == 0
    assert backend.submitted == [second.folder.name]
    assert not second.folder.rank_logs()
    assert second.folder.read_config()["data"]["source"].endswith("/a_b.txt")
    assert first.folder.read_config()["data"]["source"].endswith("/a b.txt")


def test_distinct_points_whose_names_coincide_get_distinct_folders(tmp_path):
    """A value holding `,key=` could spell another point's name: such points get a hash each."""
    sweep = write_sweep(tmp_path / "s.yaml", "name: commas\nzip:\n  log.name: ['x,log.every=2', x]\n"
                        "  log.every: [3, '2,log.every=3']\n")
    names = [name for name, _ in expand(sweep)[2]]
    assert len(set(names)) == 2


def test_a_point_listed_twice_is_one_line(tmp_path):
    sweep = write_sweep(tmp_path / "s.yaml", "name: twice\ngrid: {train.lr: [0.001, 0.001]}\n")
    with pytest.raises(GptparError, match=r"point train.lr=0.001 appears twice") as exc:
        expand(sweep)
    one_line(exc.value)


# --- Item 5: a sweep re-run after its definition changed ----------------------------------------

SWEEP = "name: edits\nkind: dp\nbase:\n  data: {{tokenizer: bytes}}\n  train: {{max_steps: {steps}}}\n" \
        "grid: {{train.lr: [0.001, 0.002]}}\n"


def finished_sweep(tmp_path: Path, backend: Recorder) -> tuple[Path, Path, list]:
    sweep = write_sweep(tmp_path / "edits.yaml", SWEEP.format(steps=2))
    runs = tmp_path / "runs"
    assert run_sweep(sweep, runs_dir=str(runs)) == 0
    _, _, points = build_points(sweep, runs_dir=str(runs))
    for point in points:
        complete(point.folder)
    backend.submitted.clear()
    return sweep, runs, points


def test_an_edited_sweep_refuses_points_holding_old_results_in_one_line(tmp_path, backend):
    sweep, runs, points = finished_sweep(tmp_path, backend)
    assert run_sweep(sweep, runs_dir=str(runs)) == 0 and backend.submitted == []  # unchanged: skipped
    sweep.write_text(SWEEP.format(steps=3))
    with pytest.raises(GptparError) as exc:
        run_sweep(sweep, runs_dir=str(runs))
    message = one_line(exc.value)
    assert message == ("sweep edits: 2 point(s) hold results of a different config: train.lr=0.001, train.lr=0.002 "
                       "(train.max_steps: 2 -> 3); add --rerun to start them over (their folders are kept as "
                       "<point>.replaced-<time>)")
    assert backend.submitted == []
    assert all(p.folder.read_config()["train"]["max_steps"] == 2 and p.folder.rank_logs() for p in points)


def test_rerun_sets_the_old_folders_aside_and_starts_those_points_over(tmp_path, backend, capsys):
    sweep, runs, points = finished_sweep(tmp_path, backend)
    sweep.write_text(SWEEP.format(steps=3))
    assert cli.main(["sweep", str(sweep), "--runs-dir", str(runs), "--rerun"]) == 0
    assert backend.submitted == [p.folder.name for p in points]
    sweep_dir = points[0].folder.path.parent
    for point in points:
        assert point.folder.read_config()["train"]["max_steps"] == 3 and not point.folder.rank_logs()
        (aside,) = [p for p in sweep_dir.iterdir() if p.name.startswith(point.folder.name + ".replaced-")]
        assert replaced(aside.name) and RunFolder(aside).rank_logs()  # the old results are kept
        assert RunFolder(aside).read_config()["train"]["max_steps"] == 2
    assert "old results set aside as" in capsys.readouterr().out
    backend.submitted.clear()
    for point in points:
        complete(point.folder)
    assert run_sweep(sweep, runs_dir=str(runs)) == 0 and backend.submitted == []  # now they are current


@pytest.mark.parametrize("how", ["lock", "scheduler"])
def test_rerun_never_touches_a_live_point(tmp_path, backend, monkeypatch, how):
    sweep, runs, points = finished_sweep(tmp_path, backend)
    sweep.write_text(SWEEP.format(steps=3))
    live = points[1].folder
    if how == "scheduler":
        live.write_job_record("slurm", "4242", "dp")
        monkeypatch.setattr(sweep_module, "scheduler_state", lambda f: "running" if f.path == live.path else None)
        with pytest.raises(GptparError, match=r"--rerun leaves live points alone: train.lr=0.002 \(running job 4242\)"):
            run_sweep(sweep, runs_dir=str(runs), rerun=True)
    else:
        with live.hold("77"), pytest.raises(GptparError, match=r"leaves live points alone: train.lr=0.002 \(held by"):
            run_sweep(sweep, runs_dir=str(runs), rerun=True)
    assert sorted(p.name for p in live.path.parent.iterdir() if p.is_dir()) == sorted(p.folder.name for p in points)
    assert backend.submitted == []


def test_the_sweep_record_lets_the_report_flag_points_of_another_definition(tmp_path, backend):
    """sweep.json holds each point's config digest; stale_runs (what the report calls) flags the points
    whose folders hold another config, an edited sweep file, and folders set aside."""
    sweep, runs, points = finished_sweep(tmp_path, backend)
    sweep_dir = points[0].folder.path.parent
    record = read_sweep_record(sweep_dir)
    assert (sweep_dir / SWEEP_RECORD).is_file()
    assert {p: entry["digest"] for p, entry in record["points"].items()} == {
        p.folder.name: config_digest(p.cfg) for p in points}
    assert list(record["files"]) == [str(sweep.resolve())]
    assert stale_runs(runs) == {}
    sweep.write_text(SWEEP.format(steps=3))  # edited, not yet submitted again
    assert set(stale_runs(runs).values()) == {
        f"{sweep.resolve()} was edited after sweep edits was submitted; submit the sweep again to check its points"}
    with pytest.raises(GptparError):
        run_sweep(sweep, runs_dir=str(runs))  # refused, but the current definition is recorded
    assert stale_runs(runs) == {
        p.folder.path: "config differs from sweep edits's current definition (train.max_steps: 2 -> 3)" for p in points}
    run_sweep(sweep, runs_dir=str(runs), rerun=True)
    flagged = stale_runs(runs)
    assert sorted(p.name.partition(".replaced-")[0] for p in flagged) == sorted(p.folder.name for p in points)
    assert all(replaced(p.name) and "set aside on" in why for p, why in flagged.items())


def test_train_into_a_folder_with_another_config_is_refused_with_a_short_diff(tmp_path, capsys, no_trainer):
    common = [f"log.runs_dir={tmp_path}", "log.run_id=r", "data.tokenizer=bytes"]
    first = prepare_run(load_config(None, common))
    complete(first.folder)
    code, _, err = run_cli(["train", *common, "train.lr=0.1"], capsys)
    assert code == 2 and no_trainer == []
    assert one_line(err) == (f"gptpar: error: run folder {first.folder.path} holds a different config (train.lr: "
                             "0.0006 -> 0.1); a run resumes with the config it was trained with, changing only "
                             "data.dir, data.hub_timeout_s, train.eval_every, train.checkpoint_every, "
                             "train.profile_steps, train.dump_grads, parallel.timeout_s, launch.* (not gpus, nodes, "
                             "repeat), log.*, report.*: undo the change, use another log.run_id, or pass "
                             "--start-over to set the old folder aside and start over")
    assert first.folder.read_config()["train"]["lr"] == 0.0006


def test_train_start_over_sets_the_old_folder_aside(tmp_path, capsys, no_trainer):
    common = [f"log.runs_dir={tmp_path}", "log.run_id=r", "data.tokenizer=bytes"]
    first = prepare_run(load_config(None, common))
    complete(first.folder)
    code, _, _ = run_cli(["train", *common, "train.lr=0.1", "--start-over"], capsys)
    assert code == 0 and len(no_trainer) == 1 and no_trainer[0].train.lr == 0.1
    assert first.folder.read_config()["train"]["lr"] == 0.1 and not first.folder.rank_logs()
    (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith("r.replaced-")]
    assert RunFolder(aside).rank_logs() and RunFolder(aside).read_config()["train"]["lr"] == 0.0006
    with first.folder.hold("9"):  # a live folder is never set aside
        code, _, err = run_cli(["train", *common, "train.lr=0.2", "--start-over"], capsys)
    assert code == 2 and "is in use by host" in one_line(err) and len(no_trainer) == 1


def test_start_over_never_moves_a_run_whose_ranks_are_starting(tmp_path, capsys, monkeypatch, no_trainer):
    """Issue 46 point 4: from `gptpar train` planning a run to its rank 0 claiming the folder (seconds: torch's
    import, the group's rendez-vous) the run holds only config.yaml, yet it is live. Its launcher holds the run's lock
    from the planning on and rank 0 takes it over, so a start-over in another thread meanwhile, with another lr or the
    same config, is refused and moves nothing; the race is made deterministic by trying it from inside the rank."""
    common = [f"log.runs_dir={tmp_path}", "log.run_id=r", "data.tokenizer=bytes"]
    refusals: dict[str, str] = {}

    def start_over(when: str, lr: str) -> None:
        try:
            prepare_run(load_config(None, [*common, f"train.lr={lr}"]), start_over=True)
        except GptparError as exc:
            refusals[f"{when} {lr}"] = one_line(exc)

    def starting_rank(cfg, reshape: bool = False) -> dict:
        for lr in ("0.1", "0.0006"):  # another config, and the same one
            attempt(start_over, "starting", lr)
        with contextlib.ExitStack() as stack:  # rank 0 claims the folder: it takes over its launcher's lock
            claim_run_folder(cfg, cfg, Layout("single", 0, 1, 0, 1, "127.0.0.1", 0), lambda answer: None, stack)
            attempt(start_over, "training", "0.1")
        return {"status": "completed"}

    monkeypatch.setattr(sys.modules["gptpar.train.entry"], "run_rank", starting_rank)
    code, _, err = run_cli(["train", *common], capsys)
    assert code == 0, err
    folder = RunFolder(tmp_path / "r")
    live = f"run folder {folder.path} is in use by host {socket.gethostname()} pid {os.getpid()}"
    assert sorted(refusals) == ["starting 0.0006", "starting 0.1", "training 0.1"]
    assert all(why.startswith(live) for why in refusals.values()), refusals
    assert [p.name for p in tmp_path.iterdir()] == ["r"] and folder.read_config()["train"]["lr"] == 0.0006
    assert folder.holder() is None  # let go once the ranks ended


def attempt(action, *args) -> None:
    """Run `action` in a thread of its own, as a second command would, and wait for it."""
    thread = threading.Thread(target=action, args=args)
    thread.start()
    thread.join()


def test_start_over_refuses_a_folder_whose_job_is_queued(tmp_path):
    common = [f"log.runs_dir={tmp_path}", "log.run_id=q", "data.tokenizer=bytes"]
    folder = prepare_run(load_config(None, common)).folder
    folder.write_job_record("slurm", "77", "dp")
    with pytest.raises(GptparError, match=r"has a pending job \(77\); wait for it to end or cancel it") as exc:
        prepare_run(load_config(None, [*common, "train.lr=0.1"]), start_over=True, job_state=lambda f: "pending")
    one_line(exc.value)
    assert folder.read_config()["train"]["lr"] == 0.0006


# --- Item 8: SLURM that does not answer never turns into a run on the login node ----------------

FAILING_SINFO = f"#!/bin/sh\necho '{FAKE_SINFO_ERROR}' >&2\nexit 1\n"


@pytest.mark.parametrize("sinfo, profile, reason", [
    (FAILING_SINFO, "bridges2", FAKE_SINFO_ERROR),
    (FAILING_SINFO, "local", FAKE_SINFO_ERROR),
    (None, "bridges2", "no SLURM client (sinfo) on PATH"),
])
@pytest.mark.slow
def test_submit_fails_when_slurm_does_not_answer(tmp_path, monkeypatch, capsys, sinfo, profile, reason):
    stub_path(tmp_path, monkeypatch, sinfo)
    monkeypatch.setattr(local_module, "run_ranks", lambda *a: pytest.fail("trained on the login node"))
    runs = tmp_path / "runs"
    code, out, err = run_cli(["submit", "dp", f"launch.profile={profile}", f"log.runs_dir={runs}",
                              "data.tokenizer=bytes"], capsys)
    fix = "start it (make cluster-up)" if profile == "local" else "check the cluster's SLURM (sinfo)"
    assert code == 2 and out == ""
    assert one_line(err) == (f"gptpar: error: SLURM unreachable: {reason} (launch.cluster=auto, launch.profile="
                             f"{profile}); {fix}, or run here with launch.cluster=local")
    assert not runs.exists()  # nothing was written


@pytest.mark.slow
def test_a_sweep_fails_the_same_way_and_touches_no_folder(tmp_path, monkeypatch):
    stub_path(tmp_path, monkeypatch, FAILING_SINFO)
    sweep = write_sweep(tmp_path / "s.yaml", "name: away\ngrid: {train.lr: [0.001, 0.002]}\n"
                        "base: {data: {tokenizer: bytes}, launch: {profile: bridges2}}\n")
    with pytest.raises(GptparError, match=f"^SLURM unreachable: {re.escape(FAKE_SINFO_ERROR)}") as exc:
        run_sweep(sweep, runs_dir=str(tmp_path / "runs"))
    one_line(exc.value)
    assert not (tmp_path / "runs").exists()


def test_submit_runs_locally_only_without_any_slurm_client_and_says_so_first(tmp_path, monkeypatch, capsys):
    stub_path(tmp_path, monkeypatch, None)
    seen: list[str] = []

    def fake_ranks(point, world):
        seen.append(capsys.readouterr().out)  # what was printed before the run started
        complete(point.folder)
        return 0

    monkeypatch.setattr(local_module, "run_ranks", fake_ranks)
    monkeypatch.setattr(local_module.socket, "gethostname", lambda: "vm")
    monkeypatch.setattr(local_module, "_STARTED", itertools.count(1))  # this process's first local job
    runs = tmp_path / "runs"
    code, out, _ = run_cli(["submit", "dp", f"log.runs_dir={runs}", "log.run_id=here", "data.tokenizer=bytes"], capsys)
    pid = os.getpid()
    assert code == 0 and len(seen) == 1
    assert seen[0] == (f"dp run {(runs / 'here').resolve()}: 1 rank(s) on local processes on this machine\n"
                       f"here: job vm:{pid}.1 starts, 1 rank(s) on this machine\n")
    assert out.startswith(f"here: completed (job vm:{pid}.1)")

    # A sweep's points: each a job of its own, announced by the keys the sweep varies before its ranks start.
    sweep = write_sweep(tmp_path / "s.yaml", "name: lrs\nrepeats: 2\ngrid: {train.lr: [0.001, 0.002]}\n"
                        "base: {data: {tokenizer: bytes}}\n")
    seen.clear()
    assert run_sweep(sweep, runs_dir=str(runs)) == 0
    starts = [line for text in seen for line in text.splitlines() if " starts, " in line]
    assert starts == [f"lr={lr}, repeat={r}: job vm:{pid}.{n} starts, 1 rank(s) on this machine"
                      for n, (r, lr) in enumerate(((0, 0.001), (0, 0.002), (1, 0.001), (1, 0.002)), 2)]
    code, out, _ = run_cli(["status", str(runs / "lrs")], capsys)
    assert code == 0 and all(f"vm:{pid}.{n}" in out for n in range(2, 6))


def test_two_local_submits_in_one_process_get_their_own_job_ids(tmp_path, monkeypatch):
    """Each api.submit makes its own backend: both were job host:pid.1 when the count was the backend's."""
    stub_path(tmp_path, monkeypatch, None)
    monkeypatch.setattr(local_module, "run_ranks", lambda point, world: complete(point.folder) or 0)
    jobs = [api.submit("dp", overrides=[f"log.runs_dir={tmp_path / 'runs'}", f"log.run_id=r{n}",
                                        "data.tokenizer=bytes"]) for n in (1, 2)]
    first, second = (job.job_id for job in jobs)
    assert first != second and second.endswith(f":{os.getpid()}.{int(first.rpartition('.')[2]) + 1}")


@pytest.mark.parametrize("overrides", [42, [1], {"train.lr"}])
def test_overrides_that_are_neither_a_mapping_nor_words_are_one_line(overrides):
    with pytest.raises(GptparError) as exc:  # 42 was a TypeError traceback: 'int' object is not iterable
        api.submit("dp", overrides=overrides)
    assert one_line(exc.value) == (f"overrides: {overrides!r} is not a mapping or a list of section.key=value "
                                   "strings; give e.g. {'train.lr': 1e-3} or ['train.lr=1e-3']")


# --- Item 9: every run folder resolves inside the runs folder -----------------------------------

@pytest.mark.parametrize("run_id", ["../x", "/abs", "/abs/x", ".", "..", "a/b", "a/../../x"])
def test_a_run_id_that_would_leave_the_runs_folder_is_refused(tmp_path, run_id):
    runs = tmp_path / "deep" / "runs"
    with pytest.raises(GptparError, match="log.run_id") as exc:
        prepare_run(load_config(None, [f"log.runs_dir={runs}", f"log.run_id={run_id}", "data.tokenizer=bytes"]))
    one_line(exc.value)
    assert not runs.exists() and sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_run_name_becomes_a_folder_inside_the_runs_folder(tmp_path):
    runs = tmp_path / "runs"
    for name in ("../x", "/abs", "..", "."):
        point = prepare_run(load_config(None, [f"log.runs_dir={runs}", f"log.name={name}", "data.tokenizer=bytes"]))
        assert point.folder.path.parent == runs.resolve() and point.folder.path.is_dir()
    assert [p.name for p in tmp_path.iterdir()] == ["runs"]


def test_submit_with_an_escaping_run_id_is_one_line(tmp_path, monkeypatch, capsys):
    stub_path(tmp_path, monkeypatch, None)
    monkeypatch.setattr(local_module, "run_ranks", lambda *a: pytest.fail("started"))
    for extra in ([], ["--dry-run"]):
        code, out, err = run_cli(["submit", "dp", "log.run_id=..", f"log.runs_dir={tmp_path / 'runs'}", *extra],
                                 capsys)
        assert code == 2 and out == ""
        assert one_line(err) == ("gptpar: error: log.run_id: '..' must be one folder name of letters, digits and "
                                 "_ . + = , - (not '.' or '..')")


@pytest.mark.parametrize("name", ["..", "../../x", ".", "/abs", "a/../.."])
def test_a_sweep_name_stays_one_folder_inside_the_runs_folder(tmp_path, name):
    sweep = write_sweep(tmp_path / "s.yaml", f"name: {json.dumps(name)}\nbase: {{data: {{tokenizer: bytes}}}}\n"
                        "grid: {train.lr: [0.001]}\n")
    runs = tmp_path / "runs"
    _, _, (point,) = build_points(sweep, runs_dir=str(runs), write=True)
    assert point.folder.path.parent.parent == runs.resolve() and point.folder.config_path.is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs", "s.yaml"]


def test_a_sweep_folder_that_is_a_link_out_of_the_runs_folder_is_refused(tmp_path):
    runs, elsewhere = tmp_path / "runs", tmp_path / "elsewhere"
    runs.mkdir()
    elsewhere.mkdir()
    (runs / "linked").symlink_to(elsewhere)
    sweep = write_sweep(tmp_path / "s.yaml", "name: linked\nbase: {data: {tokenizer: bytes}}\n")
    with pytest.raises(GptparError, match="outside the runs folder") as exc:
        build_points(sweep, runs_dir=str(runs))
    one_line(exc.value)


@pytest.mark.slow
def test_the_plain_dp_job_script_names_its_run_by_job_id_only(tmp_path):
    """jobs/dp.sbatch with a hostile job name: the folder is RUNS/dp-<job id>, nothing else."""
    script = (REPO / "jobs" / "dp.sbatch").read_text()
    assert "SLURM_JOB_NAME" not in script
    venv, record = tmp_path / ".venv", tmp_path / "argv.json"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "gptpar").write_text(f"#!{sys.executable}\nimport json, sys\n"
                                         f"json.dump(sys.argv[1:], open({str(record)!r}, 'w'))\n")
    (venv / "bin" / "gptpar").chmod(0o755)
    bindir = tmp_path / "stub-bin"
    bindir.mkdir()
    (bindir / "srun").write_text("#!/bin/bash\nwhile [[ $1 == --* ]]; do shift; done\nexec \"$@\"\n")
    (bindir / "srun").chmod(0o755)
    (tmp_path / "work").mkdir()
    env = {**slurm.clean_env(), "PATH": f"{bindir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242",
           "SLURM_JOB_NAME": "../../escape $(touch pwned)", "SLURM_SUBMIT_DIR": str(tmp_path), "SLURM_NTASKS": "1",
           "SLURM_JOB_NODELIST": "n1", "RUNS": str(tmp_path / "work" / "runs")}
    subprocess.run(["bash", str(REPO / "jobs" / "dp.sbatch")], env=env, check=True, cwd=tmp_path / "work",
                   timeout=60)
    assert [p.name for p in (tmp_path / "work" / "runs").iterdir()] == ["dp-4242"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".venv", "argv.json", "stub-bin", "work"]
    assert "log.run_id=dp-4242" in json.loads(record.read_text())


# --- Item 11: a launch.profile path never reaches the job script unquoted -----------------------

def hostile_profile(tmp_path: Path, name: str) -> Path:
    path = tmp_path / "profiles" / name
    path.parent.mkdir(exist_ok=True)
    shutil.copy(PROFILE_DIR / "local.yaml", path)
    return path


def test_a_newline_in_the_profile_path_is_refused_in_one_line(tmp_path):
    path = hostile_profile(tmp_path, "evil\ntouch pwned\n.yaml")
    cfg = load_config(None, [f"launch.profile={path}", "data.tokenizer=bytes"])
    with pytest.raises(GptparError, match=r"^launch.profile: .* holds a control character; rename the profile file$"
                       ) as exc:
        point = prepare_run(cfg, "dp", tmp_path / "runs", "r", write=False)
        render_script([point], resolve(point.cfg, "dp"), "r", point.folder.job_dir)
    one_line(exc.value)


@pytest.mark.slow
def test_a_profile_path_with_shell_syntax_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"
    path = hostile_profile(tmp_path, "$(touch pwned);`touch pwned` && touch pwned '\".yaml")
    venv, record = tmp_path / "venv", tmp_path / "argv.json"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "gptpar").write_text(f"#!{sys.executable}\nimport json, sys\n"
                                         f"json.dump(sys.argv[1:], open({str(record)!r}, 'w'))\n")
    (venv / "bin" / "gptpar").chmod(0o755)
    cfg = load_config(None, [f"launch.profile={path}", f"launch.venv={venv}", "data.tokenizer=bytes"])
    point = prepare_run(cfg, "dp", tmp_path / "runs", "r", write=False)
    point.folder.path.mkdir(parents=True)
    text = render_script([point], resolve(point.cfg, "dp"), "r", tmp_path / "runs" / "out")
    assert "touch" not in text.replace("touch_pwned", "")  # the profile is named by a safe slug only
    bindir = tmp_path / "stub-bin"
    bindir.mkdir()
    (bindir / "srun").write_text("#!/bin/bash\nwhile [[ $1 == --* ]]; do shift; done\nexec \"$@\"\n")
    (bindir / "srun").chmod(0o755)
    env = {**slurm.clean_env(), "PATH": f"{bindir}:{os.environ['PATH']}"}
    subprocess.run(["bash", "-c", text], env=env, check=True, cwd=tmp_path, timeout=60)
    assert not marker.exists()
    assert json.loads(record.read_text()) == ["train", "config.yaml"]


# --- Sweeps: nothing resolved silently ----------------------------------------------------------

def test_an_axis_listed_twice_in_one_mapping_is_one_line_naming_file_line_and_key(tmp_path):
    sweep = write_sweep(tmp_path / "s.yaml", "name: dup\ngrid:\n  train.lr: [0.001, 0.002]\n  train.lr: [0.003]\n")
    with pytest.raises(GptparError) as exc:
        expand(sweep)
    assert one_line(exc.value) == f"{sweep}:4: key 'train.lr' appears twice in one mapping (first on line 3); keep one"


def test_a_duplicate_key_in_a_config_file_is_one_line_too(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train: {lr: 0.1, lr: 0.2}\n")
    with pytest.raises(GptparError, match=r"c.yaml:1: key 'lr' appears twice in one mapping"):
        load_config(path)


def test_an_axis_in_both_grid_and_zip_is_one_line(tmp_path):
    sweep = write_sweep(tmp_path / "s.yaml", "name: dup\ngrid: {train.lr: [0.001]}\n"
                        "zip: {train.lr: [0.002, 0.003], train.seed: [1, 2]}\n")
    with pytest.raises(GptparError) as exc:
        expand(sweep)
    assert one_line(exc.value) == f"{sweep}: axis 'train.lr' appears in both zip and grid; keep one"


@pytest.mark.parametrize("where", ["base: {parallel: {dp: 4}, data: {tokenizer: bytes}}\n",
                                   "base: {parallel: {dp: 1}, data: {tokenizer: bytes}, launch: {gpus: 2}}\n",
                                   "base: {data: {tokenizer: bytes}}\ngrid: {parallel.dp: [4]}\n",
                                   "config: base.yaml\nbase: {data: {tokenizer: bytes}}\n"])
def test_a_parallel_dp_the_job_shape_would_replace_is_one_line(tmp_path, where):
    (tmp_path / "base.yaml").write_text("parallel: {dp: 2}\n")
    sweep = write_sweep(tmp_path / "s.yaml", f"name: shape\nkind: dp\n{where}")
    with pytest.raises(GptparError, match=r"parallel.dp=\d is set, but kind dp sets it from the job's shape \(launch"
                       ) as exc:
        build_points(sweep, runs_dir=str(tmp_path / "runs"))
    assert one_line(exc.value).startswith(f"{sweep}: point ")


def test_a_parallel_dp_that_agrees_with_the_job_shape_is_fine(tmp_path):
    sweep = write_sweep(tmp_path / "s.yaml", "name: shape\nkind: dp\nbase: {parallel: {dp: 2}, launch: {gpus: 2}, "
                        "data: {tokenizer: bytes}}\n")
    (point,) = build_points(sweep, runs_dir=str(tmp_path / "runs"))[2]
    assert point.cfg.parallel.dp == 2


def test_submit_refuses_a_parallel_dp_its_shape_would_replace():
    for kind, message in (("dp", "kind dp sets it from the job's shape"), ("pp", "kind pp runs one process")):
        with pytest.raises(GptparError, match=message):
            prepare_run(load_config(None, ["parallel.dp=4", "train.batch_size=16"]), kind, write=False)


# --- An unwritable runs folder is one line naming it --------------------------------------------

def test_an_unwritable_runs_folder_is_one_line_at_train_and_submit(tmp_path, monkeypatch, capsys, no_trainer):
    (tmp_path / "afile").write_text("a regular file where a folder should be\n")
    runs = tmp_path / "afile" / "runs"
    stub_path(tmp_path, monkeypatch, None)
    monkeypatch.setattr(local_module, "run_ranks", lambda *a: pytest.fail("started"))
    for argv in (["train"], ["submit", "dp"]):
        code, _, err = run_cli([*argv, f"log.runs_dir={runs}", "log.run_id=r", "data.tokenizer=bytes"], capsys)
        assert code == 2 and no_trainer == []
        assert one_line(err) == (f"gptpar: error: cannot create run folder {runs}/r: Not a directory; check "
                                 "log.runs_dir (or --runs-dir)")


def test_an_unwritable_runs_folder_is_one_line_for_a_sweep(tmp_path, backend):
    (tmp_path / "afile").write_text("")
    sweep = write_sweep(tmp_path / "s.yaml", "name: nowhere\nbase: {data: {tokenizer: bytes}}\n")
    with pytest.raises(GptparError) as exc:
        run_sweep(sweep, runs_dir=str(tmp_path / "afile" / "runs"))
    assert one_line(exc.value).startswith(f"cannot create run folder {tmp_path}/afile/runs/nowhere: Not a directory")


def test_the_shipped_sweeps_and_profiles_have_no_duplicate_keys():
    for path in (REPO / "sweeps").glob("*.yaml"):
        expand(path)
    for path in PROFILE_DIR.glob("*.yaml"):
        load_profile(path.stem)


def test_tokenizer_auto_is_decided_once_at_submission_and_recorded(tmp_path: Path) -> None:
    """item 6: the concrete tokenizer is in the run's config.yaml (and so in every rank's token-cache key),
    never the literal `auto` that a later probe could answer differently."""
    point = prepare_run(load_config(None, [f"log.runs_dir={tmp_path}", "log.run_id=tok", "data.tokenizer=auto"]))
    assert point.cfg.data.tokenizer in ("gpt2", "bpe")
    assert yaml.safe_load(point.folder.config_path.read_text())["data"]["tokenizer"] == point.cfg.data.tokenizer
    offline = prepare_run(load_config(None, [f"log.runs_dir={tmp_path}", "log.run_id=syn", "data.source=synthetic"]))
    assert offline.cfg.data.tokenizer == "auto"  # synthetic tokens need no tokenizer


def test_a_device_that_is_not_there_is_an_error_not_a_cpu_run() -> None:
    """The first GPU past those visible (cuda:0 on CI's machine, cuda:1 on a machine with one)."""
    import torch

    from gptpar.config import ParallelConfig
    from gptpar.models.build import build_model
    from gptpar.parallel.pipeline.one_process.gpt2 import build_parallel_model

    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    cfg = load_config(None, [f"parallel.devices=cuda:{visible}"])
    model = build_model(cfg.model, 300, 0)
    with pytest.raises(GptparError, match=rf"parallel.devices='cuda:{visible}': cuda:{visible} is not visible "
                                          rf"\({visible} GPUs? visible\)"):
        build_parallel_model(model, cfg.parallel)
    with pytest.raises(GptparError, match="is not a device"):
        build_parallel_model(model, ParallelConfig(devices="gpu7"))


def test_a_large_sweep_reads_each_profile_once_and_its_dry_run_counts_the_points_past_twenty(tmp_path, capsys,
                                                                                           monkeypatch):
    """160,000 points printed nothing for minutes: every point read all five profiles (detecting the cluster) and
    its own again, and the dry run listed every point's name."""
    sweep = write_sweep(tmp_path / "s.yaml", "name: big\ngrid: {train.lr: [0.001, 0.002, 0.003, 0.004, 0.005, 0.006], "
                        "train.seed: [1, 2, 3, 4, 5]}\nbase: {data: {tokenizer: bytes}}\n")
    reads: list[str] = []
    real_read = profiles_module.read_yaml
    monkeypatch.setattr(profiles_module, "read_yaml", lambda path: reads.append(str(path)) or real_read(path))
    profiles_module._read_profile.cache_clear()
    defaults, real_defaults = [], sweep_module.user_layers
    monkeypatch.setattr(sweep_module, "user_layers", lambda: defaults.append(1) or real_defaults())
    assert run_sweep(sweep, dry_run=True, runs_dir=str(tmp_path / "runs")) == 0
    assert len(reads) == len(set(reads))  # each profile file parsed once, for all 30 points
    assert len(defaults) == 1  # the user's defaults (the cluster detected from every profile) resolved once
    (points,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("# points: ")]
    names = [name for name, _ in expand(sweep)[2]]
    assert points == f"# points: {', '.join(names[:20])} and 10 more"
