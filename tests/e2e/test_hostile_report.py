"""The report, disk and numbers cases of the reliability issue (issue 17): epochs split by a restart,
diverged runs, a report folder that is a file, a rank log that is a folder, a full disk under the log,
the checkpoint and the token cache, the global loss of data-parallel runs, and sweep points whose
config changed. Each test failed on the code before its fix.

A full disk is simulated with RLIMIT_FSIZE in a subprocess (a write past the limit fails with EFBIG,
SIGXFSZ ignored), and where `mount` works also with a small tmpfs (ENOSPC).
"""

from __future__ import annotations

import csv
import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
from conftest import REPO
from gloo_pool import GlooPools
from logsets import T0, Rank, config
from rank_training import train_as_gptpar_does

from analysis.report import analyse_runs, report
from gptpar.cli import main as gptpar_main
from gptpar.config import config_digest, load_config
from gptpar.run.folder import RunFolder
from gptpar.run.logfile import read_rank_log
from gptpar.run.sweeps import read_sweep_record, write_sweep_record

LATER = T0 + 3600.0
TINY = ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "data.seq_len=16", "data.source=synthetic",
        "data.vocab_size=300", "train.batch_size=8", "train.max_steps=3", "train.eval_every=0", "train.threads=1",
        "log.progress=none"]


def metrics(runs_dir: Path, **kwargs):
    return {m.run: m for m in analyse_runs(runs_dir, now=LATER, **kwargs)}


def csv_rows(path: Path) -> dict[str, dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as f:
        return {row["run"]: row for row in csv.DictReader(f)}


def one_line_error(capsys: pytest.CaptureFixture) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gptpar: error: "), err
    return lines[0]


# --- Epochs split by a restart (item 7) -------------------------------------------------------------

def restarted(run_dir: Path, rank: int, dp: int, slow: float = 1.0) -> Rank:
    """Epoch 1: steps 1-4, 1 s each, one segment. Epoch 2: steps 5-6 (2 s, 50 tokens/s), then step 7
    (9 s) after the checkpoint at step 6, then a requeue; the restart re-runs step 7 and runs step 8
    (3 s, 100 tokens/s) and writes epoch 2's record over its own two steps only."""
    first = Rank(run_dir, rank, config(dp=dp)).header()
    for step in (1, 2, 3, 4):
        first.step(step, 1, step_time_s=1.0 * slow)
    first.epoch(1, 4.5 * slow, 90.0 / slow, steps=4)  # not the steps' sums: a whole epoch keeps its record
    first.step(5, 2, step_time_s=2.0 * slow).step(6, 2, step_time_s=2.0 * slow).step(7, 2, step_time_s=9.0 * slow)
    first.final("requeued", 6)
    again = Rank(run_dir, rank, config(dp=dp))
    again.clock = first.clock
    again.header(restart=1)
    again.step(7, 2, step_time_s=3.0 * slow, tokens=300).step(8, 2, step_time_s=3.0 * slow, tokens=300)
    again.epoch(2, 6.0 * slow, 100.0 / slow, steps=2).final("completed", 8)
    return again


def test_an_epoch_split_by_a_restart_counts_all_its_steps(tmp_path: Path) -> None:
    restarted(tmp_path / "runs" / "r", 0, 1)
    m = metrics(tmp_path / "runs")["r"]
    assert m.status == "completed"
    # Steps 5, 6 (2 s each), 7 and 8 (3 s each, the restart's): 10 s, not the record's 6 s; the
    # abandoned 9 s step 7 of the first segment does not count.
    assert m.epoch_time == (10.0, None)
    assert m.tokens_per_s == (75.0, None)  # the mean of 50, 50, 100, 100 tokens/s, not the record's 100
    assert m.stitched == [2] and m.basis == "epoch 2 (stitched across restarts: epoch 2)"
    # Epoch 1 was never split: its record stands (4.5 s), beside epoch 2's 10 s.
    assert metrics(tmp_path / "runs", warmup_epochs=0)["r"].epoch_time[0] == pytest.approx((4.5 + 10.0) / 2)


def test_a_split_epoch_is_stitched_per_rank_then_averaged_and_summed(tmp_path: Path) -> None:
    for rank, slow in ((0, 1.0), (1, 2.0)):  # rank 1 twice as slow
        restarted(tmp_path / "runs" / "r", rank, 2, slow)
    m = metrics(tmp_path / "runs")["r"]
    assert m.epoch_time[0] == pytest.approx((10.0 + 20.0) / 2)
    assert m.tokens_per_s[0] == pytest.approx(75.0 + 37.5)  # summed over the two replicas


def test_a_single_epoch_split_by_a_restart_is_stitched(tmp_path: Path) -> None:
    first = Rank(tmp_path / "runs" / "r", 0, config()).header()
    for step in range(1, 7):
        first.step(step, 1, step_time_s=1.0)
    first.final("requeued", 6)
    again = Rank(tmp_path / "runs" / "r", 0, config())
    again.clock = first.clock
    again.header(restart=1)
    for step in range(7, 11):
        again.step(step, 1, step_time_s=2.0)
    again.epoch(1, 8.0, 50.0, steps=4).final("completed", 10)
    result = report(tmp_path / "runs", tmp_path / "out", now=LATER)
    m = result.runs[0]
    assert m.epoch_time == (14.0, None)  # 6 x 1 s + 4 x 2 s, not the record's 8 s
    assert csv_rows(result.summary_csv)["r"]["stitched_epochs"] == "1"
    assert "| 14.00 |" in result.summary_md.read_text()


# --- Diverged runs (item 3) -------------------------------------------------------------------------

def diverged_run(run_dir: Path) -> None:
    """A dp=2 run: replica 1's loss turns NaN at step 4 (replica 0's own loss stays finite); the
    global loss and the validation loss go non-finite with it."""
    ranks = [Rank(run_dir, r, config(dp=2)).header() for r in range(2)]
    for step in range(1, 7):
        bad = step >= 4
        for r, rank in enumerate(ranks):
            loss = math.nan if bad and r == 1 else 4.0 - 0.1 * step
            rank.step(step, 1, loss=loss, global_loss=math.nan if bad else 4.0 - 0.1 * step)
        if step in (3, 6):
            for rank in ranks:
                rank.eval(step, math.nan if bad else 3.5)
    for rank in ranks:
        rank.epoch(1, 6.0, 100.0, steps=6, val_loss=math.nan).final("completed", 6)


def test_a_diverged_run_is_reported_as_diverged_with_its_numbers(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    diverged_run(tmp_path / "runs" / "div")
    Rank(tmp_path / "runs" / "ok", 0, config(dp=1)).header().step(1, 1).epoch(1, 1.0, 100.0).final(step=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib must not warn about the non-finite values either
        result = report(tmp_path / "runs", tmp_path / "out", now=LATER, warmup_steps=0)
    err = capsys.readouterr().err
    assert "corrupt" not in err
    m = {r.run: r for r in result.runs}["div"]
    assert m.status == "diverged" and m in result.shown
    assert m.epoch_time == (6.0, None) and m.tokens_per_s[0] == 200.0  # 2 replicas x 100 tokens in 1 s steps
    assert m.loss_curve == [(1, pytest.approx(3.9)), (2, pytest.approx(3.8)), (3, pytest.approx(3.7))]
    assert math.isnan(m.final_loss) and m.diverged_at == 4
    assert m.val_curve == [(3, 3.5)] and math.isnan(m.val_loss)
    row = csv_rows(result.summary_csv)["div"]
    assert (row["status"], row["final_loss"], row["diverged_at_step"]) == ("diverged", "nan", "4")
    assert row["tokens_per_s_mean"] == "200"
    table = next(line for line in result.summary_md.read_text().splitlines() if line.startswith("| top-level | div"))
    assert "div (diverged)" in table and table.endswith("| NaN (diverged at step 4) |")  # a standalone run: its id
    assert (tmp_path / "out" / "loss_top-level.png").is_file()


# --- The report's folders (one line instead of a traceback) -----------------------------------------

def test_report_out_pointing_at_a_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    Rank(tmp_path / "runs" / "r", 0, config()).header().step(1).final(step=1)
    (tmp_path / "taken").write_text("not a folder\n")
    assert gptpar_main(["report", str(tmp_path / "runs"), "--out", str(tmp_path / "taken")]) == 2
    assert one_line_error(capsys) == (f"gptpar: error: --out {str(tmp_path / 'taken')!r} is a file, not a folder; "
                                      "name a folder for the report")
    assert gptpar_main(["report", str(tmp_path / "runs"), "--out", str(tmp_path / "taken" / "figs")]) == 2
    assert f"lies under {tmp_path / 'taken'}, which is a file" in one_line_error(capsys)
    assert (tmp_path / "taken").read_text() == "not a folder\n"


def test_a_rank_log_that_is_a_folder_makes_its_run_corrupt_and_the_report_goes_on(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    Rank(tmp_path / "runs" / "good", 0, config()).header().step(1).epoch(1, 1.0, 100.0).final(step=1)
    bad = tmp_path / "runs" / "bad"
    Rank(bad, 0, config(dp=2)).header().step(1).final(step=1)
    (bad / "rank1.jsonl").mkdir()
    (bad / "rank1.jsonl" / "x").write_text("{}\n")
    assert gptpar_main(["report", str(tmp_path / "runs"), "--out", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    assert f"warning: run bad is corrupt and left out: {bad / 'rank1.jsonl'}: is a folder, not a log file\n" in err
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert f"| bad | corrupt | {bad / 'rank1.jsonl'}: is a folder, not a log file |" in summary
    assert "| top-level | good |" in summary


# --- A full disk ------------------------------------------------------------------------------------

LIMITED = textwrap.dedent("""
    import json, resource, signal, sys
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
    HARD = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    def limit(nbytes):
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, HARD))
    def unlimit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (HARD, HARD))
    def say(**fields):
        print(json.dumps(fields), flush=True)
    """)


def run_limited(code: str, tmp_path: Path, timeout: float = 120) -> dict:
    """Run code (after LIMITED) in a fresh interpreter; every say(...) it makes, merged."""
    pytest.importorskip("resource")
    out = subprocess.run([sys.executable, "-c", LIMITED + textwrap.dedent(code)], capture_output=True, text=True,
                         cwd=REPO, timeout=timeout, env={**os.environ, "GPTPAR_DATA_DIR": str(tmp_path / "data")})
    assert out.returncode == 0, out.stderr[-3000:]
    said: dict = {}
    for line in out.stdout.splitlines():
        if line.startswith("{"):
            said.update(json.loads(line))
    return said


@pytest.mark.slow
def test_a_log_record_on_a_full_disk_is_one_line_and_leaves_no_torn_line(tmp_path: Path) -> None:
    said = run_limited(f"""
        import os
        from gptpar.errors import GptparError
        from gptpar.run.logfile import RankLogger
        log = RankLogger({str(tmp_path / "run")!r}, 0)
        log.log("header", schema_version=2, run_id="run", config={{}}, rank=0, world_size=1, coords={{}},
                sizes={{}}, restart=0, host="h", device="cpu", torch_version="2", transformers_version="5",
                git_commit="x", slurm={{}}, start_time=0.0)
        limit(os.path.getsize(log.path) + 100)  # room for part of the next record only
        try:
            log.log("step", step=1, epoch=0, loss=3.0, lr=0.1, grad_norm=1.0, tokens=10, step_time_s=1.0,
                    tokens_per_s=10.0, data_time_s=0.0, peak_mem_bytes=0, padding="x" * 500)
        except GptparError as exc:
            say(error=str(exc))
        unlimit()  # space is freed: the run can go on writing
        log.log("final", status="failed", step=0, error="disk full")
        log.close()
    """, tmp_path)
    path = tmp_path / "run" / "rank0.jsonl"
    assert said["error"] == (f"disk full: cannot write {path} (File too large); the log keeps every record before "
                             "this one; free some space, then run again")
    log = read_rank_log(path)  # no torn step line left between the header and the final record
    assert log.records == 2 and not log.steps and log.final["status"] == "failed"


@pytest.mark.slow
def test_a_checkpoint_on_a_full_disk_is_one_line_and_keeps_the_last_good_one(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    said = run_limited(f"""
        import torch
        from gptpar.errors import GptparError
        from gptpar.train.checkpoint import load_checkpoint, save_checkpoint
        run = {str(tmp_path / "run")!r}
        save_checkpoint(run, {{"w": torch.ones(16), "step": 1}})
        limit(8192)
        try:
            save_checkpoint(run, {{"w": torch.full((100_000,), 2.0), "step": 2}})
        except GptparError as exc:
            say(error=str(exc))
        unlimit()
        state = {{"w": torch.zeros(16), "step": 0}}
        say(loaded=load_checkpoint(run, state), w=state["w"].tolist(), step=state["step"])
    """, tmp_path)
    ckpt = tmp_path / "run" / "checkpoint"
    assert said["error"] == (f"disk full: cannot write {ckpt}.tmp (File too large); the last good checkpoint {ckpt} "
                             "is kept; free some space, then run again")
    assert said["loaded"] and said["w"] == [1.0] * 16 and said["step"] == 1
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["checkpoint"]  # no half-written checkpoint.tmp


@pytest.mark.slow
def test_a_token_cache_on_a_full_disk_is_one_line_and_is_built_once_space_is_back(tmp_path: Path) -> None:
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\n" * 2000)
    said = run_limited(f"""
        from gptpar.config import config_digest, load_config
        from gptpar.data import load_tokens
        from gptpar.errors import GptparError
        cfg = load_config(None, ["data.source=text:{text}", "data.tokenizer=bytes",
                                 "data.dir={tmp_path / 'data'}"]).data
        limit(20_000)
        try:
            load_tokens(cfg)
        except GptparError as exc:
            say(error=str(exc))
        unlimit()
        say(tokens=len(load_tokens(cfg).train))
    """, tmp_path)
    assert said["error"].startswith("disk full: cannot write ") and "train.npy (File too large)" in said["error"]
    assert said["error"].endswith("; free some space, then run again") and "\n" not in said["error"]
    assert said["tokens"] > 50_000


@pytest.mark.slow
def test_a_report_on_a_full_disk_is_one_line(tmp_path: Path) -> None:
    Rank(tmp_path / "runs" / "r", 0, config()).header().step(1).epoch(1, 1.0, 100.0).final(step=1)
    said = run_limited(f"""
        import contextlib, io
        from gptpar.cli import main
        err = io.StringIO()
        limit(20_000)  # the summaries fit, a figure does not
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = main(["report", {str(tmp_path / "runs")!r}, "--out", {str(tmp_path / "out")!r}])
        say(code=code, err=err.getvalue())
    """, tmp_path)
    errors = [line for line in said["err"].splitlines() if not line.startswith("warning: ")]
    assert said["code"] == 2 and len(errors) == 1, said["err"]
    assert errors[0] == (f"gptpar: error: disk full: cannot write {tmp_path / 'out' / 'loss_top-level.png'} "
                         "(File too large); free some space, then run again")


@pytest.mark.parametrize("dp", [1, 2])
@pytest.mark.slow
def test_training_on_a_full_disk_stops_with_one_line(tmp_path: Path, dp: int) -> None:
    """dp=2: DCP gathers the ranks' errors without their causes, so each rank finds out by itself."""
    pytest.importorskip("resource")
    import resource
    import signal

    def small_disk() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    out = subprocess.run([sys.executable, "-m", "gptpar", "train", f"parallel.dp={dp}", *TINY,
                          f"log.runs_dir={tmp_path / 'runs'}", "log.run_id=full"], capture_output=True, text=True,
                         cwd=REPO, timeout=300, preexec_fn=small_disk)
    run = tmp_path / "runs" / "full"
    message = (f"disk full: cannot write {run / 'checkpoint'}.tmp (File too large); no earlier checkpoint exists; "
               "free some space, then run again")
    if dp == 1:
        assert (out.returncode, out.stderr) == (2, f"gptpar: error: {message}\n"), out.stderr[-3000:]
    else:
        assert out.returncode == 1 and f"failed at step 3: GptparError: {message}\n" in out.stdout, out.stderr[-3000:]
    for rank in range(dp):
        log = read_rank_log(run / f"rank{rank}.jsonl")
        assert log.final["status"] == "failed" and log.final["error"] == f"GptparError: {message}"
    assert not (run / "checkpoint.tmp").exists()


@pytest.mark.slow
def test_a_log_record_on_a_full_tmpfs_says_no_space_left(tmp_path: Path) -> None:
    mount = tmp_path / "small"
    mount.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command: the full-disk cases use RLIMIT_FSIZE only")
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({made.stderr.strip() or made.returncode}); RLIMIT_FSIZE covers it")
    try:
        from gptpar.errors import GptparError
        from gptpar.run.logfile import RankLogger

        log = RankLogger(mount / "run", 0)
        try:
            with open(mount / "filler", "wb", buffering=0) as f:  # fill the disk to its last block
                try:
                    while f.write(b"\0" * 4096):
                        pass
                except OSError:
                    pass
            with pytest.raises(GptparError) as exc:
                for step in range(10_000):
                    log.log("eval", step=step, epoch=0, val_loss=1.0)
        finally:
            log.close()
        assert str(exc.value) == (f"disk full: cannot write {log.path} (No space left on device); the log keeps "
                                  "every record before this one; free some space, then run again")
        written = log.path.read_bytes()
        assert written.endswith(b"\n") or not written  # whole records only, no torn line
    finally:
        subprocess.run(["umount", str(mount)], check=False)


# --- The global loss of data-parallel runs (item 10) ------------------------------------------------

@pytest.mark.slow
def test_a_real_two_rank_run_logs_one_global_loss_the_mean_of_both(tmp_path: Path, gloo_pool: GlooPools) -> None:
    gloo_pool.run(2, train_as_gptpar_does, ["parallel.dp=2", *TINY, f"log.runs_dir={tmp_path / 'runs'}",
                                            "log.run_id=dp2"])
    logs = [read_rank_log(tmp_path / "runs" / "dp2" / f"rank{r}.jsonl") for r in range(2)]
    assert sorted(logs[0].steps) == sorted(logs[1].steps) == [1, 2, 3]
    for step in (1, 2, 3):
        a, b = logs[0].steps[step], logs[1].steps[step]
        assert a["global_loss"] == b["global_loss"]
        assert a["global_loss"] == pytest.approx((a["loss"] + b["loss"]) / 2, rel=1e-6)
        assert a["loss"] != b["loss"]  # two shards: the local losses differ
    m = metrics(tmp_path / "runs")["dp2"]
    assert m.loss_curve == [(s, logs[0].steps[s]["global_loss"]) for s in (1, 2, 3)]


def test_loss_curves_use_the_global_loss_and_fall_back_to_the_replicas_mean(tmp_path: Path) -> None:
    ranks = [Rank(tmp_path / "runs" / "dp2", r, config(dp=2)).header() for r in range(2)]
    for step in (1, 2):
        for r, rank in enumerate(ranks):
            # 4.5 is not the mean of 3 and 5: the logged global loss is what the curve shows.
            rank.step(step, 1, loss=3.0 + 2 * r, global_loss=4.5)
    for rank in ranks:
        rank.final(step=2)
    fixture = tmp_path / "runs" / "v1run"
    shutil.copytree(REPO / "tests" / "fixtures" / "schema_v1" / "v1run", fixture)
    by = metrics(tmp_path / "runs")
    assert by["dp2"].loss_curve == [(1, 4.5), (2, 4.5)] and by["dp2"].final_loss == 4.5
    v1 = [read_rank_log(fixture / f"rank{r}.jsonl") for r in range(2)]
    assert "global_loss" not in v1[0].steps[1]
    assert by["v1run"].loss_curve == [(s, pytest.approx((v1[0].steps[s]["loss"] + v1[1].steps[s]["loss"]) / 2))
                                      for s in sorted(v1[0].steps)]


# --- Sweep points whose config changed (item 5) -----------------------------------------------------

def point(sweep: Path, name: str, cfg, **header) -> None:
    """A completed one-step run in sweep/name; cfg (a Config) is written as its config.yaml, or when
    None the run has only its logs (whose header may carry a config_digest)."""
    if cfg is not None:
        RunFolder(sweep / name).write_config(cfg)
    cfg = config() if cfg is None else cfg.to_dict()
    Rank(sweep / name, 0, cfg, **header).header().step(1).epoch(1, 1.0, 100.0).final(step=1)


def test_the_sweep_record_round_trips(tmp_path: Path) -> None:
    cfg = load_config(None, ["train.lr=6e-5"])
    (tmp_path / "s.yaml").write_text("name: sw\n")
    write_sweep_record(tmp_path, "sw", "dp", [tmp_path / "s.yaml"], ["train.lr=6e-5"], {"p": cfg})
    record = read_sweep_record(tmp_path)
    assert record["points"]["p"]["digest"] == config_digest(cfg) and record["overrides"] == ["train.lr=6e-5"]
    assert read_sweep_record(tmp_path / "nowhere") is None


def test_sweep_points_whose_config_differs_from_the_sweep_are_flagged(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    sweep = tmp_path / "runs" / "sw"
    now = {lr: load_config(None, [f"train.lr={lr}", "train.epochs=2"]) for lr in (0.1, 0.2)}
    point(sweep, "lr=0.1", now[0.1])
    point(sweep, "lr=0.2", load_config(None, ["train.lr=0.2", "train.epochs=1"]))  # ran before the edit
    point(sweep, "lr=0.3", None, config_digest="abcd")  # no config.yaml: its header's digest counts
    point(sweep, "lr=0.1.replaced-20250101-120000", load_config(None, ["train.lr=0.1"]))  # set aside by --rerun
    write_sweep_record(sweep, "sw", "dp", [], [], {"lr=0.1": now[0.1], "lr=0.2": now[0.2], "lr=0.3": now[0.2]})
    result = report(tmp_path / "runs", tmp_path / "out", now=LATER)
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if "is stale" in line] == [
        "warning: run sw/lr=0.1.replaced-20250101-120000 is stale: set aside on 20250101-120000 by --rerun or "
        "--start-over: results of an earlier config; left out of the table and figures",
        "warning: run sw/lr=0.2 is stale: config differs from sweep sw's current definition "
        "(train.epochs: 1 -> 2)",
    ]
    assert sorted(r.run for r in result.shown) == ["sw/lr=0.1", "sw/lr=0.2", "sw/lr=0.3"]
    summary = result.summary_md.read_text()
    assert "| sw | epochs=1, lr=0.2 ⚠ stale config |" in summary and "| sw | epochs=2, lr=0.1 |" in summary
    assert "| sw/lr=0.2 | config differs from sweep sw's current definition" in summary
    rows = csv_rows(result.summary_csv)
    assert [rows[f"sw/lr=0.{i}"]["stale"] == "" for i in (1, 2, 3)] == [True, False, True]

    (sweep / "sweep.json").write_text("{not json")
    report(tmp_path / "runs", tmp_path / "out", now=LATER)
    assert f"is stale: {sweep / 'sweep.json'} is unreadable; run `gptpar sweep` again" in capsys.readouterr().err
