"""The run folder's one owner: run ids and slugs, config.yaml written once, the lock of a live run, the
state of a run that failed before its first record, schema-1 logs, and the local backend running
exactly the command the SLURM script runs."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import REPO

from gptpar.config import load_config
from gptpar.errors import GptparError
from gptpar.launch import slurm
from gptpar.launch.local import LocalBackend
from gptpar.launch.prepare import prepare_run, rank_command
from gptpar.launch.profiles import resolve
from gptpar.launch.render import render_script
from gptpar.run.folder import RunFolder, handed_fds, run_folder
from gptpar.run.logfile import RankLogger, encode, read_rank_log
from gptpar.run.names import check_run_id, job_run_id, point_name, slug
from gptpar.run.start import next_run_id, reserved_run_id
from gptpar.run.state import read_run

FIXTURE_V1 = REPO / "tests" / "fixtures" / "schema_v1"


@pytest.mark.parametrize("bad", ["..", ".", "../x", "/abs", "a/b", "", "a b", "x\ny"])
def test_an_explicit_run_id_is_one_safe_folder_name(bad: str, tmp_path: Path) -> None:
    with pytest.raises(GptparError, match="log.run_id"):
        run_folder(tmp_path, bad)


def test_an_explicit_run_id_is_used_as_given(tmp_path: Path) -> None:
    assert check_run_id("lr=3e-4,dp=2") == "lr=3e-4,dp=2"
    assert run_folder(tmp_path, "my-run").path == (tmp_path / "my-run").resolve()


def test_derived_ids_are_short_numbers_that_never_collide_and_follow_the_slurm_job(tmp_path: Path) -> None:
    """Outside SLURM a run is `<kind or log.name>.N`, one above the runs of that name (set-aside ones too); a process
    naming a run in the same moment as another gets the next number. Inside a job, the job's id."""
    runs = tmp_path / "runs"
    (runs / "dp.2.replaced-20260101-120000").mkdir(parents=True)
    (runs / "dp-7").mkdir()  # a plain sbatch script's run: another name
    assert next_run_id(runs, "dp", reserve=False) == "dp.3" and not (runs / "dp.3").exists()
    assert [next_run_id(runs, "dp") for _ in range(2)] == ["dp.3", "dp.4"] and (runs / "dp.4").is_dir()
    # Another process took 5 and 6 between this one's listing and its mkdir: this one gets 7.
    (runs / "dp.5").mkdir()
    (runs / "dp.6").mkdir()
    assert reserved_run_id(runs, "dp", 5) == "dp.7" and (runs / "dp.7").is_dir()
    job = {"SLURM_JOB_ID": "42"}
    assert job_run_id("dp test", env=job) == job_run_id("dp test", env=job) == "dp_test-436c779e-42"
    assert job_run_id("x", env={"SLURM_ARRAY_JOB_ID": "7", "SLURM_ARRAY_TASK_ID": "3", "SLURM_JOB_ID": "9"}) == "x-7_3"
    assert "/" not in job_run_id("../../etc", env={"SLURM_JOB_ID": "1"}) and job_run_id("x", env={}) is None


def test_a_submitted_run_is_named_after_its_kind_unless_log_name_is_set(tmp_path: Path) -> None:
    cfg = load_config(None, ["data.tokenizer=bytes"])
    assert prepare_run(cfg, "dp", tmp_path, write=False).folder.name == "dp.1"
    assert prepare_run(cfg, "pp", tmp_path).folder.name == "pp.1" and (tmp_path / "pp.1" / "config.yaml").is_file()
    assert prepare_run(cfg, "pp", tmp_path).folder.name == "pp.2"
    named = load_config(None, ["data.tokenizer=bytes", "log.name=lr-test"])
    assert prepare_run(named, "dp", tmp_path).folder.name == "lr-test.1"


def test_slugs_are_unique_per_text_and_safe() -> None:
    assert slug("parallel.dp=2") == "parallel.dp=2"  # a safe text stays readable
    texts = ["data.source=text:a b.txt", "data.source=text:a_b.txt", "..", "x" * 300, "x" * 301]
    slugs = [slug(t) for t in texts]
    assert len(set(slugs)) == len(texts)
    assert all(re.fullmatch(r"[A-Za-z0-9_.+=,-]+", s) and len(s) <= 100 and s not in (".", "..") for s in slugs)
    assert point_name(["data.source=text:a b.txt"]) != point_name(["data.source=text:a_b.txt"])
    assert point_name([]) == "base"


def test_config_yaml_is_written_once_and_a_different_config_is_refused(tmp_path: Path) -> None:
    cfg = load_config(None, [f"log.runs_dir={tmp_path}", "log.run_id=r", "data.tokenizer=bytes"])
    point = prepare_run(cfg)
    text = point.folder.config_path.read_text()
    assert prepare_run(cfg).folder == point.folder and point.folder.config_path.read_text() == text
    changed = load_config(None, [f"log.runs_dir={tmp_path}", "log.run_id=r", "data.tokenizer=bytes", "train.lr=0.1"])
    with pytest.raises(GptparError, match=r"holds a different config \(train.lr: 0.0006 -> 0.1\)"):
        prepare_run(changed)
    assert point.folder.config_path.read_text() == text


def test_a_folder_written_before_a_key_existed_holds_the_same_config_at_that_keys_default(tmp_path: Path) -> None:
    """A requeue or a re-run sweep after an upgrade that added a config key is not refused; a new value is."""
    cfg = load_config(None, [f"log.runs_dir={tmp_path}", "log.run_id=r", "data.tokenizer=bytes"])
    folder = prepare_run(cfg).folder
    older = yaml.safe_load(folder.config_path.read_text())
    del older["launch"]["repeat"], older["train"]["dump_grads"]
    folder.config_path.write_text(yaml.safe_dump(older))
    assert prepare_run(cfg).folder == folder
    with pytest.raises(GptparError, match=r"holds a different config \(launch.repeat: 0 -> 1\)"):
        prepare_run(load_config(None, [f"log.runs_dir={tmp_path}", "log.run_id=r", "data.tokenizer=bytes",
                                    "launch.repeat=1"]))


@pytest.mark.slow
def test_a_live_folder_is_refused_naming_its_holder(tmp_path: Path) -> None:
    cfg = load_config(None, [f"log.runs_dir={tmp_path}", "log.run_id=live", "data.tokenizer=bytes"])
    folder = prepare_run(cfg).folder
    with folder.hold("777"):
        holder = folder.holder()
        assert holder["pid"] == os.getpid() and holder["job_id"] == "777"
        with pytest.raises(GptparError, match=r"in use by host .* pid \d+ job 777"):
            prepare_run(cfg)
        # Another process (a second `gptpar train` into the same folder) is refused too.
        code = ("from pathlib import Path\nfrom gptpar.run.folder import RunFolder\n"
                f"with RunFolder(Path({str(folder.path)!r})).hold(): pass")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
        assert out.returncode != 0 and f"pid {os.getpid()} job 777" in out.stderr
    assert folder.holder() is None  # released with the context, and with the process


@pytest.mark.slow
def test_a_rank_process_takes_over_the_lock_its_launcher_handed_down(tmp_path: Path) -> None:
    """Issue 46 point 4: `gptpar train` holds the run's lock from planning on and its local ranks take it over through
    the inherited descriptor (launch/local.py passes it), so there is no moment when the run is not held."""
    cfg = load_config(None, [f"log.runs_dir={tmp_path}", "log.run_id=r", "data.tokenizer=bytes"])
    with contextlib.ExitStack() as launcher:
        folder = prepare_run(cfg, stack=launcher).folder
        code = ("from pathlib import Path\nfrom gptpar.run.folder import RunFolder\n"
                f"with RunFolder(Path({str(folder.path)!r})).hold('5', adopt=True): print('held')")
        rank = subprocess.run([sys.executable, "-c", code], pass_fds=handed_fds(), capture_output=True, text=True,
                              cwd=REPO)
        stranger = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
        assert (rank.returncode, rank.stdout) == (0, "held\n"), rank.stderr
        assert stranger.returncode != 0 and f"is in use by host {socket.gethostname()} pid {os.getpid()}" in \
            stranger.stderr  # without the descriptor, the launcher's lock refuses it
        assert folder.holder() is not None  # the launcher's still, after its rank ended
    assert folder.holder() is None


@pytest.mark.slow
def test_a_run_that_fails_before_its_first_record_is_failed_with_its_error(tmp_path: Path) -> None:
    from gptpar.train.entry import run_rank

    cfg = load_config(None, [f"log.runs_dir={tmp_path}", "log.run_id=nodata", "data.source=text:/no/such.txt",
                             "data.tokenizer=bytes", "log.progress=none"])
    with pytest.raises(GptparError, match="does not exist"):
        run_rank(cfg)
    run = read_run(RunFolder(tmp_path / "nodata"))
    assert run.state == "failed"
    assert run.detail.startswith("rank 0 failed at step 0: GptparError: data.source=text:")


def test_non_finite_numbers_are_valid_json_and_read_back() -> None:
    line = encode({"kind": "step", "loss": float("nan"), "grad_norm": float("inf"), "lr": 1e-3})
    assert json.loads(line) == {"kind": "step", "loss": "NaN", "grad_norm": "Infinity", "lr": 1e-3}


def test_a_diverged_run_is_shown_as_diverged_with_its_numbers(tmp_path: Path) -> None:
    log = RankLogger(tmp_path / "hot", 0)
    log.log("header", schema_version=2, run_id="hot", config={}, rank=0, world_size=1, coords={}, sizes={},
            restart=0, host="h", device="cpu", torch_version="2", transformers_version="5", git_commit="x",
            slurm={}, start_time=0.0)
    for step, loss in ((1, 5.0), (2, float("nan"))):
        log.log("step", step=step, epoch=0, loss=loss, lr=10.0, grad_norm=float("inf"), tokens=1, step_time_s=1.0,
                tokens_per_s=1.0, data_time_s=0.0, peak_mem_bytes=0)
    log.log("final", status="completed", step=2, loss=float("nan"))
    log.close()
    run = read_run(RunFolder(tmp_path / "hot"))
    assert run.state == "diverged"
    steps = read_rank_log(tmp_path / "hot" / "rank0.jsonl").steps
    assert steps[1]["loss"] == 5.0 and steps[2]["loss"] != steps[2]["loss"] and steps[2]["grad_norm"] == float("inf")


def test_schema_1_logs_stay_readable(tmp_path: Path) -> None:
    """A run written by the first release (dp=2, one epoch of 14 steps) reads as it did then."""
    from analysis.report import analyse_runs

    (metrics,) = analyse_runs(FIXTURE_V1)
    assert (metrics.status, metrics.dp, metrics.gpus, metrics.devices) == ("completed", 2, 2, 1)
    assert [s for s, _ in metrics.loss_curve] == list(range(1, 15))
    assert metrics.tokens_per_s[0] > 0 and metrics.val_loss is not None


def _recording_venv(tmp_path: Path) -> tuple[Path, Path]:
    """A venv whose `gptpar` records its argv, working folder and rank variables, one file per call."""
    venv, records = tmp_path / "venv", tmp_path / "records"
    (venv / "bin").mkdir(parents=True)
    records.mkdir()
    fake = venv / "bin" / "gptpar"
    fake.write_text(f"#!{sys.executable}\nimport json, os, sys, uuid\n"
                    f"json.dump({{'argv': sys.argv, 'cwd': os.getcwd(), 'rank': os.environ.get('RANK') or "
                    f"os.environ.get('SLURM_PROCID')}}, open(os.path.join({str(records)!r}, uuid.uuid4().hex), 'w'))\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    return venv, records


@pytest.mark.slow
def test_the_local_backend_runs_the_command_of_the_slurm_script(tmp_path: Path) -> None:
    venv, records = _recording_venv(tmp_path)
    cfg = load_config(None, [f"launch.venv={venv}", "launch.gpus=2", "data.tokenizer=bytes", "train.batch_size=8"])
    point = prepare_run(cfg, "dp", tmp_path / "runs", "same")
    spec = resolve(point.cfg, "dp")
    script = render_script([point], spec, "same", point.folder.job_dir)
    srun = re.search(r"^srun .*\\\n\s+(.*)$", script, flags=re.M).group(1)
    assert shlex.split(srun) == rank_command(point.cfg) == [str(venv / "bin" / "gptpar"), "train", "config.yaml"]

    LocalBackend().submit([point], spec, "same", point.folder.job_dir)
    local = sorted((json.loads(p.read_text()) for p in records.iterdir()), key=lambda r: r["rank"])
    for p in records.iterdir():
        p.unlink()
    bindir = tmp_path / "stub-bin"  # srun stand-in: starts the command once per task, as srun would
    bindir.mkdir()
    (bindir / "srun").write_text('#!/bin/bash\nwhile [[ $1 == --* ]]; do shift; done\n'
                                 'for r in 0 1; do SLURM_PROCID=$r "$@"; done\n')
    (bindir / "srun").chmod(0o755)
    env = {**slurm.clean_env(), "PATH": f"{bindir}:{os.environ['PATH']}"}
    subprocess.run(["bash", "-c", script], env=env, check=True, cwd=tmp_path)
    scheduled = sorted((json.loads(p.read_text()) for p in records.iterdir()), key=lambda r: r["rank"])
    assert [r["rank"] for r in local] == [r["rank"] for r in scheduled] == ["0", "1"]
    assert [(r["argv"], r["cwd"]) for r in local] == [(r["argv"], r["cwd"]) for r in scheduled]
    assert local[0]["argv"][1:] == ["train", "config.yaml"] and local[0]["cwd"] == str(point.folder.path)


def test_a_fresh_heartbeat_holds_the_folder_where_flock_cannot_tell(tmp_path: Path) -> None:
    """A run on another node of a filesystem whose flock is node-local (or absent, as on some Lustre
    mounts) is seen through the heartbeat in its lock file; a stale heartbeat is a dead run's leftover."""
    folder = RunFolder(tmp_path / "r")
    folder.path.mkdir()
    lock = folder.path / ".lock"
    record = {"host": "othernode", "pid": 4242, "job_id": "99", "flock": False}
    lock.write_text(json.dumps({**record, "heartbeat": time.time()}))
    assert folder.holder()["host"] == "othernode"
    with pytest.raises(GptparError, match="in use by host othernode pid 4242 job 99"), folder.hold():
        pass
    lock.write_text(json.dumps({**record, "heartbeat": time.time() - 3600}))
    assert folder.holder() is None
    with folder.hold("1"):
        assert folder.holder()["job_id"] == "1"


def test_a_refusal_names_a_holder_that_wrote_its_record_after_taking_the_flock(tmp_path: Path) -> None:
    """Runs started together: the winner's flock comes an instant before its record; the loser waits for the record
    (CI once read "in use by host ? pid ?")."""
    import fcntl
    import threading

    folder = RunFolder(tmp_path / "r")
    folder.path.mkdir()
    lock = folder.path / ".lock"
    with lock.open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        late = threading.Timer(1.5, lambda: lock.write_text(json.dumps(
            {"host": "winner", "pid": 7, "job_id": "", "flock": True, "heartbeat": time.time()})))
        late.start()
        with pytest.raises(GptparError, match="in use by host winner pid 7;"), folder.hold():
            pass
        late.join()


def test_status_is_a_table_of_each_runs_job_progress_and_speed(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Known answers: 2 data-parallel ranks on two hosts, restarted once, 4 of 10 steps, tokens/s summed over the
    replicas; a folder set aside by --rerun is counted, not listed."""
    from gptpar.cli import main

    started = time.time() - 3725
    for name, ranks in (("a", 2), ("a.replaced-20250101-120000", 1)):
        for rank in range(ranks):
            log = RankLogger(tmp_path / name, rank)
            for restart in (0, 1):
                log.log("header", schema_version=2, run_id=name, config={}, rank=rank, world_size=ranks,
                        coords={"pp": 0, "dp": rank, "tp": 0}, sizes={"pp": 1, "dp": ranks, "tp": 1},
                        restart=restart, host=f"n{rank + 1}", device="cpu", torch_version="2",
                        transformers_version="5", git_commit="x", slurm={}, start_time=started + restart,
                        total_steps=10)
                for step in (2 * restart + 1, 2 * restart + 2):
                    log.log("step", step=step, epoch=0, loss=3.0, global_loss=2.5, lr=0.1, grad_norm=1.0,
                            tokens=64, step_time_s=0.5, tokens_per_s=100.0 + 50 * rank, data_time_s=0.0,
                            peak_mem_bytes=0, bubble=None)
            log.log("final", status="completed", step=4)
            log.close()
    assert main(["status", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["STATE", "RUN", "JOB", "ELAPSED", "STEP", "ETA", "LOSS", "TOK/S", "NODES", "RESTARTS"]
    state, run, job, elapsed, step, eta, loss, rate, nodes, restarts = out[1].split()
    assert (state, run, job, step, eta, loss, rate, nodes, restarts) == (
        "completed", "a", "-", "4/10", "-", "2.5000", "250", "n1,n2", "1")
    assert elapsed.startswith("1:02:0")  # 3724 s since the latest start, and the second or two this test took
    assert out[-1] == "1 run(s): 1 completed; 1 folder(s) set aside by --rerun or --start-over not listed"


def test_status_filters_by_state_and_gives_elapsed_since_the_jobs_start_and_an_eta(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A running run restarted a minute ago after two hours: ELAPSED counts from the job's (latest) start, and the
    ETA comes from this start's step rate (1 step per 10 s, 80 of 100 steps to go), not the first start's."""
    from gptpar.cli import main
    from gptpar.launch.status import render_status, status_rows

    now = time.time()
    folder = RunFolder(tmp_path / "live")
    log = RankLogger(folder.path, 0)
    for restart, start, step_s, steps in ((0, now - 7200, 1.0, range(1, 11)), (1, now - 200, 10.0, range(11, 21))):
        log.log("header", schema_version=2, run_id="live", config={}, rank=0, world_size=1, coords={}, sizes={},
                restart=restart, host="h", device="cpu", torch_version="2", transformers_version="5", git_commit="x",
                slurm={}, start_time=start, total_steps=100)
        for i, step in enumerate(steps):
            log.log("step", time=start + step_s * (i + 1), step=step, epoch=0, loss=3.0, lr=0.1, grad_norm=1.0,
                    tokens=64, step_time_s=step_s, tokens_per_s=6.4, data_time_s=0.0, peak_mem_bytes=0)
    log.close()
    done = RankLogger(tmp_path / "done", 0)
    done.log("header", schema_version=2, run_id="done", config={}, rank=0, world_size=1, coords={}, sizes={},
             restart=0, host="h", device="cpu", torch_version="2", transformers_version="5", git_commit="x", slurm={},
             start_time=now - 10)
    done.log("final", status="completed", step=0)
    done.close()
    with folder.hold():
        rows, _ = status_rows(tmp_path, now=now, states=("running", "pending"))
        assert [(r.run, r.state, r.cells()[3], r.cells()[5]) for r in rows] == [
            ("live", "running", "0:03:20", "0:13:20")]
        assert render_status(rows, 0).endswith("1 run(s): 1 running")
        assert main(["status", str(tmp_path), "--state", "completed"]) == 0
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()[1:-1]] == ["completed"]
    assert main(["status", str(tmp_path), "--state", "runing"]) == 2
    assert capsys.readouterr().err == ("gptpar: error: --state 'runing': 'runing' is not a state; choose from "
                                       "queued, pending, starting, running, completed, diverged, requeued, stopped, "
                                       "cancelled, failed, timeout, oom, corrupt (comma-separated)\n")


@pytest.mark.slow
def test_a_run_starts_with_a_banner_and_ends_with_a_summary_line(tmp_path: Path) -> None:
    """What a user reads first and last: where and how it trains, then status, steps, losses, throughput, folder."""
    out = subprocess.run([sys.executable, "-m", "gptpar", "train", "model.n_layer=1", "model.n_embd=32",
                          "model.n_head=2", "data.max_chars=4000", "data.seq_len=16", "data.tokenizer=bytes",
                          "train.batch_size=4", "train.max_steps=3", "train.eval_every=2", "log.progress=lines",
                          "log.every=1", "log.run_id=r", f"log.runs_dir={tmp_path}"],
                         capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    folder = tmp_path / "r"
    # 1 block of width 32 (12·32² + 13·32), ln_f, and token (256 bytes + specials, padded to a multiple of
    # model.pad_vocab=64) and position tables of width 32.
    vocab = json.loads(Path(folder / "rank0.jsonl").read_text().splitlines()[0])["vocab_size"]
    rows = -(-vocab // 64) * 64
    parameters = 12 * 32 * 32 + 13 * 32 + 2 * 32 + (rows + 256) * 32
    table = f", token table of {rows} rows" if rows > vocab else ""
    assert lines[0] == f"gptpar: training in this process: {folder}"
    assert re.fullmatch(rf"gptpar: 1 rank\(s\) \(pp=1 x dp=1 x cp=1 x tp=1\) on cpu \(gloo\); GPT-2 of {parameters:,} "
                        rf"parameters \(1 layers, width 32, 2 heads\); tokenizer bytes \(vocab {vocab}{table}\); fp32; "
                        r"steps 1-3", lines[1]), lines[1]
    records = [json.loads(line) for line in (folder / "rank0.jsonl").read_text().splitlines()]
    last_step = [r for r in records if r["kind"] == "step"][-1]
    val = [r["val_loss"] for r in records if "val_loss" in r][-1]
    assert re.fullmatch(rf"gptpar: run completed: 3/3 steps, loss {last_step['loss']:.4f}, val_loss {val:.4f}, "
                        rf"[\d,]+ tok/s, \d:\d\d:\d\d in {re.escape(str(folder))}", lines[-1]), lines[-1]


def test_the_planned_config_names_files_absolutely_for_ranks_that_run_elsewhere(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "a.txt").write_text("hello")
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "b.txt").write_text("world")  # the submit side reads both, as the ranks will
    cfg = load_config(None, ["data.source=text:a.txt, ~/b.txt", "data.dir=cache", "train.dump_grads=grads",
                             "data.tokenizer=bytes", "log.run_id=r"])
    planned = prepare_run(cfg, "dp").cfg
    assert planned.data.source == f"text:{tmp_path}/a.txt,{Path.home()}/b.txt"
    assert (planned.data.dir, planned.train.dump_grads) == (f"{tmp_path}/cache", f"{tmp_path}/grads")
    assert prepare_run(load_config(None, ["data.source=stdlib", "data.tokenizer=bytes", "log.run_id=s"]),
                    "dp").cfg.data.source == "stdlib"
