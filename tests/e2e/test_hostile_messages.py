"""Messages and tracebacks (issue 26, items 6, 7, 10 and 11): every case below once ended in a traceback, a
silently ignored setting or a message naming the wrong thing, and each test failed on the code before its fix.

The contract: one line, naming the key, option or file at fault and what is allowed or the fix. In-process through
the CLI's `main` wherever no process is needed; a full disk is a file-size limit (RLIMIT_FSIZE, SIGXFSZ ignored)
in a child process, so the error comes from torch's real writer.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO
from logsets import Rank, config

from gptpar.cli import build_parser, main
from gptpar.data import load_tokens
from gptpar.doctor import run_checks
from gptpar.errors import GptparError
from gptpar.user_defaults import resolve_config

TINY = ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "data.seq_len=16", "data.source=synthetic",
        "data.vocab_size=300", "train.batch_size=8", "train.max_steps=2", "train.eval_every=0", "train.threads=1",
        "log.progress=none"]


def error_line(capsys: pytest.CaptureFixture) -> str:
    """The one line a command wrote on stderr: gptpar's error format, no traceback."""
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gptpar: error: "), err
    return lines[0].removeprefix("gptpar: error: ")


def completed_run(run_dir: Path, steps: int = 2) -> Path:
    """A finished run's rank-0 log, one record a line: the header on line 1, step k on line k + 1."""
    rank = Rank(run_dir, 0, config()).header()
    for step in range(1, steps + 1):
        rank.step(step)
    rank.final(step=steps)
    return rank.path


def a_file(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("a regular file where a folder is expected\n")
    return path


# --- Item 6: a full disk under `gptpar checkpoint export` -------------------------------------------

def _small_disk() -> None:
    import resource

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


@pytest.mark.slow
def test_exporting_a_checkpoint_on_a_full_disk_says_so_and_keeps_the_checkpoint(tmp_path: Path) -> None:
    pytest.importorskip("resource")
    import torch

    from gptpar.train.checkpoint import export_checkpoint, save_checkpoint

    run = tmp_path / "run"
    save_checkpoint(run, {"w": torch.arange(100_000, dtype=torch.float32), "step": 3})  # 400 kB: over the limit
    out = tmp_path / "out" / "whole.pt"
    done = subprocess.run([sys.executable, "-m", "gptpar", "checkpoint", "export", str(run), "--out", str(out)],
                          capture_output=True, text=True, cwd=REPO, timeout=120, preexec_fn=_small_disk)
    assert (done.returncode, done.stderr) == (2, f"gptpar: error: disk full: cannot write {out} (File too large); "
                                                 f"the checkpoint {run / 'checkpoint'} is unchanged; free some space, "
                                                 "then run again\n")
    assert list(out.parent.iterdir()) == []  # no partial file, under its name or a temporary one
    state = torch.load(export_checkpoint(run, out), weights_only=False)  # space is back: the checkpoint is whole
    assert state["step"] == 3 and torch.equal(state["w"], torch.arange(100_000, dtype=torch.float32))


# --- Item 7: tracebacks of logs, status | head, report --dpi, schedule --out, run ids, data and export paths

def test_logs_on_a_corrupt_log_names_its_line_and_says_corrupt(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture) -> None:
    log = completed_run(tmp_path / "runs" / "r", steps=24)
    lines = log.read_text().splitlines(keepends=True)
    lines[19] = '{"kind": "step", garbage\n'  # line 20: the whole file before it is far past byte 0
    log.write_text("".join(lines))
    assert main(["logs", "r", "--runs-dir", str(tmp_path / "runs")]) == 0
    out, err = capsys.readouterr()
    bad = f"{log}:20: not valid JSON (unexpected character"
    assert err == "" and f"unreadable: {bad}" in out
    assert out.splitlines()[-1].startswith(f"state: corrupt ({bad}")
    main(["status", str(tmp_path / "runs")])  # status names the same line
    assert f"    {bad}" in capsys.readouterr().out


def test_status_into_a_pipe_whose_reader_went_away_ends_quietly(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture) -> None:
    """`gptpar status | head -3`: the reader closes the pipe, the next write fails with EPIPE."""
    completed_run(tmp_path / "runs" / "r")
    read_end, write_end = os.pipe()
    os.close(read_end)
    with open(write_end, "w") as stdout, contextlib.redirect_stdout(stdout):
        code = main(["status", str(tmp_path / "runs")])
    assert code == 128 + signal.SIGPIPE and capsys.readouterr().err == ""


def test_a_report_dpi_out_of_range_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["report", str(tmp_path / "runs"), "--out", str(tmp_path / "out"), "--dpi", "100000"]) == 2
    assert error_line(capsys) == "--dpi 100000: figures are drawn at 10 to 600 dots per inch"


def png_size(path: Path) -> tuple[int, int]:
    return struct.unpack(">II", path.read_bytes()[16:24])


def test_a_schedule_chart_has_a_bounded_canvas(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """80 micro-batches would ask for a 61-inch-wide figure (0.25 inch per cost unit)."""
    out = tmp_path / "long.png"
    assert main(["schedule", "show", "1f1b", "--pp", "2", "--chunks", "80", "--out", str(out)]) == 0
    width, height = png_size(out)
    assert width <= 24 * 110 and height <= 24 * 110, (width, height)


@pytest.mark.parametrize("name, message", [
    ("chart.xyz", "--out {out!r} (by its suffix): figures are written as png, pdf, svg"),
    ("afile/chart.png", "--out {out!r} lies under {blocker}, which is a file; name a file to write"),
])
def test_a_schedule_chart_that_cannot_be_written_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                              name: str, message: str) -> None:
    a_file(tmp_path / "afile")
    out = str(tmp_path / name)
    assert main(["schedule", "show", "1f1b", "--out", out]) == 2
    assert error_line(capsys) == message.format(out=out, blocker=tmp_path / "afile")


def test_a_run_id_too_long_for_a_file_name_is_one_line_naming_the_key(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture) -> None:
    runs = tmp_path / "runs"
    assert main(["train", *TINY, f"log.runs_dir={runs}", "log.run_id=" + "a" * 300]) == 2
    assert error_line(capsys) == "log.run_id: 300 characters is too long for a folder name; use at most 200"
    assert not runs.exists()
    resolve_config(None, ["log.run_id=" + "a" * 200])  # the longest allowed, with room for .replaced-<time>


@pytest.mark.parametrize("where, message", [
    ("GPTPAR_DATA_DIR", "GPTPAR_DATA_DIR {afile!r} is a file, not a folder; name a folder for data and its caches"),
    ("data.dir", "data.dir {under!r} lies under {afile}, which is a file; name a folder for data and its caches"),
    ("text:", "data.source=text: {folder!r} is a folder, not a file"),
])
def test_data_paths_of_the_wrong_kind_are_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   where: str, message: str) -> None:
    afile, folder = a_file(tmp_path / "afile"), tmp_path
    words = {"GPTPAR_DATA_DIR": [], "data.dir": [f"data.dir={afile / 'data'}"], "text:": [f"data.source=text:{folder}"]}
    if where == "GPTPAR_DATA_DIR":
        monkeypatch.setenv("GPTPAR_DATA_DIR", str(afile))
    cfg = resolve_config(None, ["data.source=stdlib", "data.tokenizer=bytes", *words[where]])[0]
    with pytest.raises(GptparError) as exc:
        load_tokens(cfg.data)
    assert str(exc.value) == message.format(afile=str(afile), under=str(afile / "data"), folder=str(folder))


@pytest.mark.parametrize("out, message", [
    ("afile/whole.pt", "--out {out!r} lies under {afile}, which is a file; name a file to write"),
    ("folder", "--out {out!r} is a folder, not a file; name a file to write"),
])
def test_export_to_a_path_of_the_wrong_kind_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                        out: str, message: str) -> None:
    import torch

    from gptpar.train.checkpoint import save_checkpoint

    save_checkpoint(tmp_path / "run", {"w": torch.ones(4)})
    a_file(tmp_path / "afile")
    (tmp_path / "folder").mkdir()
    assert main(["checkpoint", "export", str(tmp_path / "run"), "--out", str(tmp_path / out)]) == 2
    assert error_line(capsys) == message.format(out=str(tmp_path / out), afile=tmp_path / "afile")


# --- Item 10: silently ignored settings, misleading states and "does not exist" for the wrong kind ----

@pytest.mark.parametrize("setting, message", [
    ("missing.yaml", "GPTPAR_USER_CONFIG {path!r} does not exist; name a YAML file of config defaults, or unset it"),
    ("folder", "GPTPAR_USER_CONFIG {path!r} is a folder, not a file; name a YAML file of config defaults, or "
               "unset it"),
])
def test_a_user_config_that_names_no_file_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture, setting: str,
                                                      message: str) -> None:
    (tmp_path / "folder").mkdir()
    monkeypatch.setenv("GPTPAR_USER_CONFIG", str(tmp_path / setting))
    assert main(["config", "show"]) == 2
    assert error_line(capsys) == message.format(path=str(tmp_path / setting))


def test_a_folder_at_the_default_user_config_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture) -> None:
    monkeypatch.delenv("GPTPAR_USER_CONFIG")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    assert main(["config", "show"]) == 0  # no user file at all is fine
    capsys.readouterr()
    (tmp_path / "gptpar" / "config.yaml").mkdir(parents=True)
    assert main(["config", "show"]) == 2
    assert error_line(capsys) == (f"user file {str(tmp_path / 'gptpar' / 'config.yaml')!r} is a folder, not a file; "
                                  "make it a YAML file of config defaults")


def test_doctor_finds_folders_under_a_regular_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    afile = a_file(tmp_path / "afile")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))  # no sinfo to ask
    monkeypatch.setenv("GPTPAR_DATA_DIR", str(afile / "data"))
    cfg, origins = resolve_config(None, [f"log.runs_dir={afile / 'runs'}"])
    checks = {c.name: c for c in run_checks(cfg, origins)}
    assert (checks["space: runs"].status, checks["space: runs"].detail) == (
        "finding", f"log.runs_dir {str(afile / 'runs')!r} lies under {afile}, which is a file; name a folder for "
                   "the runs")
    assert (checks["space: data cache"].status, checks["space: data cache"].detail) == (
        "finding", f"GPTPAR_DATA_DIR {str(afile / 'data')!r} lies under {afile}, which is a file; name a folder "
                   "for data and its caches")
    assert not afile.with_name("data").exists()


@pytest.mark.slow  # training in-process still asks git for the header's commit
def test_a_run_whose_checkpoint_cannot_load_shows_the_load_error(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture) -> None:
    runs = tmp_path / "runs"
    (runs / "r" / "checkpoint").mkdir(parents=True)
    (runs / "r" / "checkpoint" / ".metadata").write_text("garbage\n")
    assert main(["train", *TINY, f"log.runs_dir={runs}", "log.run_id=r"]) == 2
    error = error_line(capsys)
    assert error.startswith(f"checkpoint file {runs / 'r' / 'checkpoint' / '.metadata'} is corrupt")
    main(["status", str(runs)])
    out = capsys.readouterr().out
    assert re.search(r"^failed +r ", out, re.M) and f"rank 0 failed at step 0: GptparError: {error}" in out


def test_logs_on_a_sweep_folder_names_one_of_its_runs(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    sweep = tmp_path / "runs" / "sw"
    for point in ("a", "b"):
        completed_run(sweep / point)
    assert main(["logs", "sw", "--runs-dir", str(tmp_path / "runs")]) == 2
    assert error_line(capsys) == (f"{str(sweep)!r} is a folder of 2 runs, not one run; name one of them (e.g. "
                                  f"{sweep / 'a'}), or see them all with `gptpar status {sweep}`")


@pytest.mark.parametrize("argv, message", [
    (["status", "{file}"], "runs folder {file!r} is a file, not a folder"),
    (["report", "{file}", "--out", "{folder}/out"], "runs directory {file!r} is a file, not a folder"),
    (["logs", "{file}"], "run {file!r} is a file, not a folder; name a run folder"),
    (["config", "show", "{folder}"], "config file {folder!r} is a folder, not a file"),
])
def test_a_path_of_the_wrong_kind_is_named_as_such_not_as_missing(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                                  argv: list[str], message: str) -> None:
    names = {"file": str(a_file(tmp_path / "afile")), "folder": str(tmp_path)}
    assert main([word.format(**names) for word in argv]) == 2
    assert error_line(capsys) == message.format(**names)


# --- Item 11: gptpar submit -------------------------------------------------------------------------

def test_submit_takes_runs_dir_as_sweep_does(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["submit", "dp", "--dry-run", "--runs-dir", str(tmp_path / "mine"), "data.tokenizer=bytes"]) == 0
    assert f"#SBATCH --output={tmp_path / 'mine'}/" in capsys.readouterr().out


def test_an_unknown_option_is_blamed_alone_not_the_config_words_beside_it(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["submit", "dp", "--bogus", "3", "train.lr=1e-3", "--dry-run"])
    assert exc.value.code == 2
    assert capsys.readouterr().err == "gptpar: error: unrecognized arguments: --bogus (see `gptpar submit --help`)\n"


def test_every_submit_help_example_passes_its_profiles_limits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture) -> None:
    submit = next(a for a in build_parser()._actions if a.dest == "command").choices["submit"]
    examples = [line.split()[1:] for line in submit.epilog.splitlines() if line.strip().startswith("gptpar submit")]
    assert len(examples) == 3
    monkeypatch.chdir(tmp_path)  # an example's relative --runs-dir lands here
    for words in examples:
        assert main([*words, "--dry-run", "data.tokenizer=bytes"]) == 0, (words, capsys.readouterr().err)
    assert "#SBATCH --nodes=2" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["train", "RUNS", "train.lr=1", "train.lr=2"],
                                  ["config", "show", "CONFIG", "train.lr=1", "train.lr=2"]])
def test_a_key_given_twice_on_the_command_line_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                            argv: list[str]) -> None:
    """It silently took the last value, where a YAML file with a key twice is refused (issue 46, item 12)."""
    config = tmp_path / "cfg.yaml"
    config.write_text("train: {lr: 0.5}\n")
    words = {"CONFIG": str(config), "RUNS": f"log.runs_dir={tmp_path / 'runs'}"}
    assert main([words.get(word, word) for word in argv]) == 2
    assert error_line(capsys) == "train.lr is given twice on the command line (train.lr=1 and train.lr=2); keep one"
