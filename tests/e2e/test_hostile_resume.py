"""A run is what its folder says (issue 26, items 1, 2 and 4): a resumed run runs the config its checkpoint was made
with, a run folder moved or copied elsewhere resumes where it now is, and a log of a newer schema is refused rather
than read as something it may not be.

The cases a user meets with a real run start one real run, stopped by SIGTERM at a step boundary with its checkpoint
(once per module), and give each test its own copy of it; the cases of older or newer logs write those logs with
the log's own writer (tests/logsets.py), in-process.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import pytest
import yaml
from logsets import Rank

from analysis.report import report
from gptpar.cli import main as gptpar_main
from gptpar.config import load_config
from gptpar.errors import GptparError
from gptpar.launch.prepare import prepare_run
from gptpar.parallel.env import Layout
from gptpar.run.claim import claim_run_folder
from gptpar.run.folder import RunFolder
from gptpar.run.logfile import CorruptLog, RankLogger, read_rank_log
from gptpar.run.state import read_run
from gptpar.user_defaults import resolve_config

TINY = ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "data.seq_len=16", "data.source=synthetic",
        "data.vocab_size=300", "data.synthetic_tokens=20000", "train.batch_size=8", "train.eval_every=0",
        "train.threads=1", "log.progress=none"]
STEPS = 200  # ~130 steps an epoch: a SIGTERM sent once the first step is logged lands well before the end
DEADLINE_S = 120.0  # a hang guard while waiting on records: never a timing claim
START_OVER = "pass --start-over to set the old folder aside and start over"
# What a resumed start may change: where the run is and how it logs, how its job is queued, when it evaluates,
# checkpoints and profiles, where its data is cached, how long a rank waits for a dead peer.
RESUMABLE = ("data.dir, data.hub_timeout_s, train.eval_every, train.checkpoint_every, train.profile_steps, "
             "train.dump_grads, parallel.timeout_s, launch.* (not gpus, nodes, repeat), log.*, report.*")
RANK0 = Layout("single", 0, 1, 0, 1, "127.0.0.1", 0)  # a run's one rank, started on its config file


def share(answer: list) -> None:
    """A one-rank group's broadcast: rank 0's answer is already everyone's."""


def _env(data_dir: Path) -> dict[str, str]:
    """The environment of a `gptpar` process: the session's data cache, no network, none of the tester's defaults."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "GPTPAR_DATA_DIR": str(data_dir), "HF_HUB_OFFLINE": "1",
            "GPTPAR_USER_CONFIG": str(data_dir / "no-user-defaults.yaml")}


def _gptpar(data_dir: Path, *words: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gptpar", *words], capture_output=True, text=True,
                          env=_env(data_dir), timeout=DEADLINE_S)


def _stepped(run: Path) -> bool:
    try:
        return bool(read_rank_log(run / "rank0.jsonl").steps)
    except (FileNotFoundError, CorruptLog):
        return False


@pytest.fixture(scope="module")
def stopped(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> Path:
    """A run stopped by SIGTERM at a step boundary, with its checkpoint: what a user edits, moves or copies."""
    runs = tmp_path_factory.mktemp("stopped")
    run = runs / "a"
    proc = subprocess.Popen([sys.executable, "-m", "gptpar", "train", *TINY, "train.epochs=3",
                             f"train.max_steps={STEPS}", f"log.runs_dir={runs}", "log.run_id=a"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(data_dir))
    deadline = time.monotonic() + DEADLINE_S
    while not _stepped(run) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=DEADLINE_S)
    assert read_run(RunFolder(run)).state == "stopped", (out, err)
    return run


def own_copy(stopped: Path, runs: Path) -> Path:
    """A copy of the stopped run as if it had been started in `runs` (its config.yaml names that runs folder)."""
    run = Path(shutil.copytree(stopped, runs / stopped.name))
    edit_config(run, log={"runs_dir": str(runs)})
    return run


def edit_config(run: Path, **sections: dict) -> None:
    """Change config.yaml's values as a user's editor would."""
    saved = yaml.safe_load((run / "config.yaml").read_text())
    for section, values in sections.items():
        saved[section].update(values)
    (run / "config.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))


def stop_step(run: Path) -> int:
    return read_rank_log(run / "rank0.jsonl").final["step"]


def resumed(run: Path, step: int) -> None:
    """The run trained on from its checkpoint in this folder: a second segment from step + 1 to the end."""
    log = read_rank_log(run / "rank0.jsonl")
    assert [h["restart"] for h in log.headers] == [0, 1] and log.final["status"] == "completed"
    assert sorted(log.steps) == list(range(1, STEPS + 1))
    assert min(s for s, r in log.steps.items() if r["time"] > log.headers[1]["time"]) == step + 1
    assert read_run(RunFolder(run)).state == "completed"


def one_line(text: str) -> str:
    assert "\n" not in text.strip() and len(text) < 600, text
    return text.strip()


RESHAPE = "pass --reshape to continue it on the new layout, "  # offered where only the layout changed


def refusal(folder: Path, what: str, diff: str, again: str = START_OVER, offer: str = "") -> str:
    return (f"run folder {folder} {what} ({diff}); a run resumes with the config it was trained with, changing only "
            f"{RESUMABLE}: undo the change, {offer}use another log.run_id, or {again}")


# --- Item 1: a resumed run runs the config its checkpoint was made with ---------------------------------------------

@pytest.mark.slow
def test_a_hand_edited_config_is_refused_naming_the_changed_key(stopped, tmp_path, data_dir):
    run = own_copy(stopped, tmp_path / "runs")
    edit_config(run, train={"lr": 0.001})
    before = (run / "rank0.jsonl").read_bytes()
    done = _gptpar(data_dir, "train", str(run / "config.yaml"))
    assert done.returncode == 2 and done.stdout == ""
    assert one_line(done.stderr) == "gptpar: error: " + refusal(run, "was trained with a different config",
                                                                "train.lr: 0.0006 -> 0.001")
    assert (run / "rank0.jsonl").read_bytes() == before  # nothing resumed with the new value


@pytest.mark.slow
def test_a_rank_started_on_the_edited_file_refuses_it_too(stopped, tmp_path):
    """srun and torchrun start ranks on config.yaml with no submit side in between: rank 0 checks it itself."""
    from gptpar.train.entry import run_rank

    run = own_copy(stopped, tmp_path / "runs")
    edit_config(run, train={"seed": 7})
    with pytest.raises(GptparError) as exc:
        run_rank(load_config(run / "config.yaml"))
    assert str(exc.value) == refusal(run, "was trained with a different config", "train.seed: 1337 -> 7",
                                     "move the old folder away to start over")
    assert read_run(RunFolder(run)).state == "stopped"


def trained(tmp_path: Path, *overrides: str) -> RunFolder:
    """A planned run that has started once: config.yaml, a header recording the config its ranks ran, and the
    checkpoint it stopped with (an empty folder standing for it: nothing here loads it)."""
    cfg = prepare_run(load_config(None, [f"log.runs_dir={tmp_path}", "log.run_id=r", "data.tokenizer=bytes",
                                      *overrides])).cfg
    Rank(tmp_path / "r", 0, cfg.to_dict()).header(schema_version=2).final("stopped", step=3)
    (tmp_path / "r" / "checkpoint").mkdir()
    return RunFolder(tmp_path / "r")


def test_only_keys_that_leave_the_run_as_it_was_may_change_on_resume(tmp_path):
    folder = trained(tmp_path)
    path = str(folder.config_path)
    prepare_run(resolve_config(path, ["train.eval_every=7", "launch.time=01:00:00", "log.every=1"])[0])
    assert folder.read_config()["train"]["eval_every"] == 7 and folder.read_config()["launch"]["time"] == "01:00:00"
    for key, old, new in [("train.max_steps", 0, 800), ("parallel.dp", 1, 2), ("model.n_layer", 0, 3)]:
        with pytest.raises(GptparError) as exc:
            prepare_run(resolve_config(path, [f"{key}={new}"])[0])
        offer = RESHAPE if key.startswith("parallel.") else ""
        assert str(exc.value) == refusal(folder.path, "holds a different config", f"{key}: {old} -> {new}", offer=offer)
    assert folder.read_config()["train"]["max_steps"] == 0  # a refused start leaves config.yaml as it was


def test_a_config_yaml_edited_to_agree_with_the_start_is_refused_by_the_log_header(tmp_path):
    """config.yaml hand-edited (train.lr) and resumed from that very file: config.yaml agrees with the start, so only
    the last log header (what the ranks ran) can refuse it; the fast kin of the two slow tests above."""
    folder = trained(tmp_path)
    edit_config(folder.path, train={"lr": 0.001})
    with pytest.raises(GptparError) as exc:
        prepare_run(resolve_config(str(folder.config_path), [])[0])
    assert str(exc.value) == refusal(folder.path, "was trained with a different config", "train.lr: 0.0006 -> 0.001")
    assert folder.read_config()["train"]["lr"] == 0.001  # the refused start wrote nothing


def test_reshape_continues_a_stopped_run_on_another_layout_and_nothing_else(tmp_path):
    """--reshape (issue 51): the submit side accepts a layout change and records it in config.yaml, where the rank's
    own check finds it against the last header (dp=2); a change of anything else stays refused."""
    folder = trained(tmp_path, "parallel.dp=2", "parallel.dp_sync=zero2")
    path = str(folder.config_path)
    layout = ["parallel.dp=1", "parallel.dp_sync=bucketed", "train.grad_accum=2"]
    with pytest.raises(GptparError) as exc:
        prepare_run(resolve_config(path, layout)[0])
    assert str(exc.value) == refusal(folder.path, "holds a different config", "parallel.dp: 2 -> 1; parallel.dp_sync: "
                                     "'zero2' -> 'bucketed'; train.grad_accum: 1 -> 2", offer=RESHAPE)
    with pytest.raises(GptparError) as exc:
        prepare_run(resolve_config(path, [*layout, "train.lr=0.1"])[0], reshape=True)
    assert str(exc.value) == refusal(folder.path, "holds a different config", "train.lr: 0.0006 -> 0.1")
    prepare_run(resolve_config(path, layout)[0], reshape=True)
    assert folder.read_config()["parallel"]["dp"] == 1 and folder.read_config()["train"]["grad_accum"] == 2
    with ExitStack() as stack:  # the rank, started on config.yaml, runs the layout the --reshape accepted
        cfg = load_config(folder.config_path)
        assert claim_run_folder(cfg, cfg, RANK0, share, stack)[0] == folder


def test_a_layout_edited_into_config_yaml_is_no_reshape(tmp_path):
    """Without --reshape, a layout hand-edited into config.yaml is refused by the header, on the submit side and by a
    rank started on that file."""
    folder = trained(tmp_path, "parallel.dp=2")
    edit_config(folder.path, parallel={"dp": 1})
    with pytest.raises(GptparError) as exc:
        prepare_run(resolve_config(str(folder.config_path), [])[0])
    assert str(exc.value) == refusal(folder.path, "was trained with a different config", "parallel.dp: 2 -> 1",
                                     offer=RESHAPE)
    with ExitStack() as stack, pytest.raises(GptparError) as exc:
        cfg = load_config(folder.config_path)
        claim_run_folder(cfg, cfg, RANK0, share, stack)
    assert str(exc.value) == refusal(folder.path, "was trained with a different config", "parallel.dp: 2 -> 1",
                                     "move the old folder away to start over", offer=RESHAPE)


def test_a_resubmission_on_fewer_gpus_takes_that_shape_and_without_reshape_is_refused(tmp_path, capsys):
    """`gptpar submit dp RUN/config.yaml --gpus 1` of a dp=2 run: the dp config.yaml recorded is the last shape's, so
    the new shape sets it again; without --reshape the change of layout is refused, offering --reshape."""
    folder = trained(tmp_path, "parallel.dp=2", "launch.gpus=2")
    path = str(folder.config_path)
    assert gptpar_main(["submit", "dp", path, "--gpus", "1", "--dry-run"]) == 0
    assert "#SBATCH --ntasks-per-node=1\n" in capsys.readouterr().out
    assert gptpar_main(["submit", "dp", path, "--gpus", "1", "launch.cluster=local"]) == 2
    assert capsys.readouterr().err == "gptpar: error: " + refusal(
        folder.path, "holds a different config", "launch.gpus: 2 -> 1; parallel.dp: 2 -> 1",
        "move the old folder away to start over", offer=RESHAPE) + "\n"


def test_the_ranks_of_a_job_given_reshape_take_its_layout(tmp_path):
    """`srun gptpar train RUN/config.yaml --reshape parallel.dp=1` (jobs/dp.sbatch with RESHAPE=1): no submitter
    plans the start, so rank 0 takes the layout and records it, and a requeue of the same job starts on it again."""
    folder = trained(tmp_path, "parallel.dp=2")
    cfg = resolve_config(str(folder.config_path), ["parallel.dp=1"], user=False)[0]
    with ExitStack() as stack, pytest.raises(GptparError) as exc:
        claim_run_folder(cfg, cfg, RANK0, share, stack)
    assert str(exc.value) == refusal(folder.path, "holds a different config", "parallel.dp: 2 -> 1",
                                     "move the old folder away to start over", offer=RESHAPE)
    with ExitStack() as stack:
        assert claim_run_folder(cfg, cfg, RANK0, share, stack, reshape=True)[0] == folder
    assert folder.read_config()["parallel"]["dp"] == 1 and folder.read_reshape() is not None
    with ExitStack() as stack:
        assert claim_run_folder(cfg, cfg, RANK0, share, stack)[0] == folder


def test_reshape_refuses_another_global_batch_and_says_how_to_start_from_the_weights(tmp_path):
    folder = trained(tmp_path, "parallel.dp=2")
    with pytest.raises(GptparError) as exc:
        prepare_run(resolve_config(str(folder.config_path), ["parallel.dp=1", "train.batch_size=32"])[0], reshape=True)
    assert one_line(str(exc.value)) == (
        f"run folder {folder.path}: --reshape keeps the global batch (train.batch_size: 16 -> 32); to train with "
        f"another, start a new run from its weights: `gptpar checkpoint export {folder.path}`, save that model with "
        "transformers' save_pretrained, then model.init=pretrained:PATH")


def test_status_and_report_note_a_run_continued_on_another_layout(tmp_path, capsys):
    """A reshaped run is no mixed run: status notes its layouts (to the current one), and the report times it on its
    current layout's steps alone."""
    cfg = load_config(None, ["data.tokenizer=bytes"]).to_dict()
    rank = Rank(tmp_path / "reshaped", 0, cfg).header().step(1).step(2)
    rank.cfg = {**cfg, "parallel": {**cfg["parallel"], "dp_sync": "ddp"}}
    rank.header(restart=1).step(3).step(4).final(step=4)
    note = ("it continued on another layout (restart 1: parallel.dp_sync: 'bucketed' -> 'ddp'); its "
            "throughput is the current layout's")
    assert gptpar_main(["status", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"    note: {note}\n" in out and "warning:" not in out
    result = report(tmp_path, tmp_path / "figures", warmup_steps=0)
    assert [r.run for r in result.shown] == ["reshaped"] and result.shown[0].basis == "steps 3-4 of 2"
    assert f"warning: run reshaped: {note}\n" in capsys.readouterr().err


def test_status_and_report_flag_a_run_whose_starts_ran_different_configs(tmp_path, capsys):
    """A log that a gptpar before this check wrote: the run resumed with another train.lr, then completed."""
    cfg = load_config(None, ["data.tokenizer=bytes"]).to_dict()
    rank = Rank(tmp_path / "mixed", 0, cfg).header().step(1).step(2)
    rank.cfg = {**cfg, "train": {**cfg["train"], "lr": 0.01}}
    rank.header(restart=1).step(3).step(4).final(step=4)
    Rank(tmp_path / "plain", 0, cfg).header().step(1).step(2).step(3).step(4).final(step=4)
    why = "its starts ran different configs (restart 1 of rank 0: train.lr: 0.0006 -> 0.01); its numbers mix them"
    assert gptpar_main(["status", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"    warning: {why}\n" in out and out.count("warning:") == 1
    result = report(tmp_path, tmp_path / "figures", warmup_steps=0)
    assert [r.run for r in result.shown] == ["plain"]
    assert f"warning: run mixed: {why}; left out of the table and figures" in capsys.readouterr().err
    assert f"| mixed | {why} |" in result.summary_md.read_text()


# --- Item 2: a run folder is where it is ----------------------------------------------------------------------------

@pytest.mark.slow
def test_a_moved_run_resumes_where_it_now_is(stopped, tmp_path, data_dir):
    runs = tmp_path / "runs"
    step = stop_step(own_copy(stopped, runs))
    moved = Path(shutil.move(runs / "a", tmp_path / "other" / "a"))
    done = _gptpar(data_dir, "train", str(moved / "config.yaml"))
    assert done.returncode == 0, done.stderr
    resumed(moved, step)
    assert not (runs / "a").exists()  # not started over at its old place
    assert RunFolder(moved).read_config()["log"]["runs_dir"] == str(tmp_path / "other")
    shutil.copy(moved / "config.yaml", tmp_path / "myexp.yaml")  # a config file elsewhere names the run it records
    assert resolve_config(tmp_path / "myexp.yaml", [])[0].log.runs_dir == str(tmp_path / "other")


@pytest.mark.slow
def test_gptpar_train_reshape_continues_a_stopped_run_on_two_ranks(stopped, tmp_path, data_dir):
    """The whole path of issue 51: refused without --reshape (offering it), then continued on dp=2 local ranks
    from the step after the stop, every step once; `gptpar status` notes the new layout and lists each layout's
    segment, and the report tabulates them."""
    run = own_copy(stopped, tmp_path / "runs")
    step = stop_step(run)
    refused = _gptpar(data_dir, "train", str(run / "config.yaml"), "parallel.dp=2")
    assert refused.returncode == 2 and "pass --reshape to continue it on the new layout" in one_line(refused.stderr)
    done = _gptpar(data_dir, "train", str(run / "config.yaml"), "parallel.dp=2", "--reshape")
    assert done.returncode == 0, done.stderr
    resumed(run, step)
    second = read_rank_log(run / "rank1.jsonl")
    assert [h["restart"] for h in second.headers] == [0] and min(second.steps) == step + 1
    status = _gptpar(data_dir, "status", str(run.parent))
    assert "note: it continued on another layout (restart 1: parallel.dp: 1 -> 2)" in status.stdout, status.stdout
    segments = [f"steps 1-{step} on 1 rank", f"steps {step + 1}-{STEPS} on dp=2 (bucketed)"]
    assert [line.split(": ")[1] for line in status.stdout.splitlines() if line.startswith("    segment: ")] == segments
    table = report(run.parent, tmp_path / "figures").summary_md.read_text().split("(segments)\n")[1]
    assert [" | ".join(row.split(" | ")[1:3]) for row in table.splitlines() if row.startswith("| a |")] == [
        f"1 rank | 1-{step}", f"dp=2 (bucketed) | {step + 1}-{STEPS}"]


@pytest.mark.slow
def test_gptpar_submit_reshape_continues_a_stopped_run_as_a_job_of_two_ranks(stopped, tmp_path, data_dir):
    """The submit side's path: the job's ranks, started on config.yaml, take the layout the --reshape recorded."""
    run = own_copy(stopped, tmp_path / "runs")
    step = stop_step(run)
    done = _gptpar(data_dir, "submit", "dp", str(run / "config.yaml"), "--gpus", "2", "--reshape",
                   "launch.cluster=local", "parallel.dp=2")
    assert done.returncode == 0, done.stderr
    resumed(run, step)
    assert min(read_rank_log(run / "rank1.jsonl").steps) == step + 1


@pytest.mark.slow
def test_a_copied_run_resumes_in_the_copy_and_leaves_the_original_alone(stopped, tmp_path, data_dir):
    original = own_copy(stopped, tmp_path / "runs")
    step, before = stop_step(original), (original / "rank0.jsonl").read_bytes()
    copy = Path(shutil.copytree(original, tmp_path / "other" / "a"))
    done = _gptpar(data_dir, "train", str(copy / "config.yaml"))
    assert done.returncode == 0, done.stderr
    resumed(copy, step)
    assert (original / "rank0.jsonl").read_bytes() == before
    assert read_run(RunFolder(original)).state == "stopped"


# --- Item 4: a log of a newer schema is refused, not read as completed ----------------------------------------------

def test_a_log_of_a_newer_schema_is_refused_in_one_line(tmp_path, capsys):
    folder = trained(tmp_path)
    Rank(tmp_path / "r", 0, folder.read_config()).header(restart=1, schema_version=3).final(step=5)
    why = (f"{folder.rank_log(0)}:3: schema_version 3 is newer than this gptpar reads (up to 2); upgrade gptpar "
           "(git pull, then make install) to read this run")
    run = read_run(folder)
    assert (run.state, run.detail) == ("corrupt", why)
    with pytest.raises(GptparError) as exc:  # nor resumed by a gptpar that cannot read it
        prepare_run(load_config(folder.config_path))
    assert one_line(str(exc.value)) == f"run folder {folder.path} cannot be resumed: {why}; {START_OVER}"
    assert gptpar_main(["status", str(tmp_path)]) == 0
    assert "corrupt  r" in capsys.readouterr().out
    result = report(tmp_path, tmp_path / "figures", include_incomplete=True)
    assert result.shown == [] and f"run r is corrupt and left out: {why}" in capsys.readouterr().err


# --- Issue 46 point 3: a torn last line, once resumed, never hides the run ------------------------------------------

TORN = b'{"kind":"step","step":7,"los'  # what a writer killed in the middle of a record leaves


def torn_line_message(log: Path) -> str:
    return (f"gptpar: {log} ended in a torn line ({len(TORN)} bytes, what a killed writer leaves); set it aside in "
            f"{log.name}.torn and resumed the log after its last whole record")


def test_a_torn_last_line_is_set_aside_when_the_log_resumes(tmp_path, capsys):
    folder = trained(tmp_path)
    log = folder.rank_log(0)
    whole = log.read_bytes()
    log.write_bytes(whole + TORN)
    resumed_log = Rank(folder.path, 0, folder.read_config())
    assert resumed_log.logger.torn == torn_line_message(log)
    resumed_log.header(restart=1, schema_version=2).step(4).final(step=4)
    assert log.read_bytes().startswith(whole) and (folder.path / "rank0.jsonl.torn").read_bytes() == TORN + b"\n"
    assert read_run(folder).state == "completed"
    assert gptpar_main(["status", str(tmp_path)]) == 0 and "completed  r" in capsys.readouterr().out
    assert gptpar_main(["logs", "r", "--runs-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "state: completed"
    assert [r.run for r in report(tmp_path, tmp_path / "figures", warmup_steps=0).shown] == ["r"]
    assert RankLogger(folder.path, 0).torn == ""  # a whole log is left alone


@pytest.mark.slow
def test_a_run_killed_mid_record_resumes_and_completes(stopped, tmp_path, data_dir):
    run = own_copy(stopped, tmp_path / "runs")
    step = stop_step(run)
    with open(run / "rank0.jsonl", "ab") as log:
        log.write(TORN)
    done = _gptpar(data_dir, "train", str(run / "config.yaml"))
    assert done.returncode == 0, done.stderr
    resumed(run, step)  # readable, and completed
    assert torn_line_message(run / "rank0.jsonl") in done.stderr.splitlines()


# --- Issue 46 point 5: a run whose checkpoint is gone is not retrained from step 0 without a word --------------------

def lost(folder: RunFolder, again: str = START_OVER) -> str:
    return (f"run folder {folder.path} cannot resume: its log says a checkpoint was saved at step 3, but "
            f"{folder.path / 'checkpoint'} is missing, so a start would train from step 0 again; put the checkpoint "
            f"back, or {again}")


def test_a_stopped_run_whose_checkpoint_is_gone_is_refused_until_started_over(tmp_path):
    folder = trained(tmp_path)
    (folder.path / "checkpoint").rmdir()
    before = folder.rank_log(0).read_bytes()
    with pytest.raises(GptparError) as exc:  # `gptpar train`, submit or a sweep: the submit side
        prepare_run(load_config(folder.config_path))
    assert one_line(str(exc.value)) == lost(folder)
    with pytest.raises(GptparError) as exc, ExitStack() as stack:  # srun or torchrun on config.yaml: rank 0's claim
        claim_run_folder(load_config(folder.config_path), load_config(folder.config_path), RANK0, share, stack)
    assert one_line(str(exc.value)) == lost(folder, "move the old folder away to start over")
    assert folder.rank_log(0).read_bytes() == before and folder.holder() is None
    prepare_run(load_config(folder.config_path), start_over=True)  # what the refusal offers
    (aside,) = tmp_path.glob("r.replaced-*")
    assert RunFolder(aside).rank_logs() and not folder.rank_logs()


def test_a_failed_run_past_a_checkpoint_every_step_is_refused_too(tmp_path):
    folder = trained(tmp_path, "train.checkpoint_every=2")
    Rank(folder.path, 0, folder.read_config()).header(restart=1, schema_version=2).step(4).step(5).final("failed", 5)
    (folder.path / "checkpoint").rmdir()
    with pytest.raises(GptparError, match=r"its log says a checkpoint was saved at step 4, but .* is missing"):
        prepare_run(load_config(folder.config_path))


def test_a_run_with_its_checkpoint_or_done_resumes_without_a_word(tmp_path):
    folder = trained(tmp_path, "train.checkpoint_every=2")
    shutil.move(folder.path / "checkpoint", folder.path / "checkpoint.old")  # a save killed between its renames
    prepare_run(load_config(folder.config_path))
    shutil.rmtree(folder.path / "checkpoint.old")
    Rank(folder.path, 0, folder.read_config()).header(restart=1, schema_version=2).step(4).step(5).final(step=5)
    prepare_run(load_config(folder.config_path))  # a completed run trains nothing: no checkpoint needed
    with ExitStack() as stack:
        assert claim_run_folder(load_config(folder.config_path), load_config(folder.config_path), RANK0, share,
                                stack)[1] == "completed"


@pytest.mark.slow
def test_a_stopped_run_whose_checkpoint_was_deleted_is_refused_in_one_line(stopped, tmp_path, data_dir):
    run = own_copy(stopped, tmp_path / "runs")
    shutil.rmtree(run / "checkpoint")
    before = (run / "rank0.jsonl").read_bytes()
    done = _gptpar(data_dir, "train", str(run / "config.yaml"))
    assert done.returncode == 2 and done.stdout == ""
    assert one_line(done.stderr) == (
        f"gptpar: error: run folder {run} cannot resume: its log says a checkpoint was saved at step "
        f"{stop_step(run)}, but {run / 'checkpoint'} is missing, so a start would train from step 0 again; put the "
        f"checkpoint back, or {START_OVER}")
    assert (run / "rank0.jsonl").read_bytes() == before
