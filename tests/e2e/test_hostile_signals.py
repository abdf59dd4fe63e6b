"""The process-level cases of the reliability issue: signals, hangs, concurrency, dead runs.

Each case starts real `gptpar` processes, because only a process can be signalled, stopped, killed or
raced; the in-process cases of the same issue live in tests/e2e/test_hostile.py and
tests/e2e/test_hostile_runs.py. Runs are tiny; a test waits on log records with a deadline and sends its
signal once the run is mid-training (every run here has far more steps than it gets to train).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from gptpar.cli import main as gptpar_main
from gptpar.parallel.flight import SKIP_COLLECTIVE_ENV
from gptpar.run.folder import RunFolder
from gptpar.run.hang import size_text
from gptpar.run.logfile import CorruptLog, RankLog, read_rank_log
from gptpar.run.state import read_run

pytestmark = pytest.mark.slow  # every test here starts processes

TINY = ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "data.seq_len=16", "data.source=synthetic",
        "data.vocab_size=300", "data.synthetic_tokens=20000", "train.batch_size=8", "train.eval_every=0",
        "train.threads=1", "log.progress=none"]
STEPS = 200  # ~140 steps an epoch: a signal sent once the first step is logged lands well before the end
RESUMABLE = ["train.epochs=3", f"train.max_steps={STEPS}"]
ENDLESS = ["train.epochs=1000", "train.max_steps=1000000"]  # stopped by the test, never by itself
DEADLINE_S = 120.0  # a hang guard while waiting on records: never a timing claim


def _gptpar(runs: Path, *words: str, command: tuple[str, ...] = ("train",), env: dict[str, str] | None = None
            ) -> subprocess.Popen:
    """`gptpar` on TINY with `words`, which replace TINY's keys (the command line takes each key once), and `env`."""
    given = {word.partition("=")[0] for word in words}
    tiny = [word for word in TINY if word.partition("=")[0] not in given]
    return subprocess.Popen([sys.executable, "-m", "gptpar", *command, *tiny, f"log.runs_dir={runs}", *words],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def _finish(proc: subprocess.Popen, timeout: float = DEADLINE_S) -> tuple[int, list[str], str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out.splitlines(), err


def _log(run: Path, rank: int) -> RankLog | None:
    try:
        return read_rank_log(run / f"rank{rank}.jsonl") if (run / f"rank{rank}.jsonl").is_file() else None
    except CorruptLog:
        return None


def _wait_for_steps(proc: subprocess.Popen, run: Path, ranks: int = 1) -> None:
    """Until every rank has logged a step of its current segment (the process must keep running)."""
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        logs = [_log(run, rank) for rank in range(ranks)]
        if all(log is not None and log.final is None and log.steps for log in logs):
            return
        if proc.poll() is not None:
            pytest.fail(f"gptpar exited ({proc.returncode}) before training: {proc.communicate()}")
        time.sleep(0.02)
    pytest.fail(f"no step record in {run} within {DEADLINE_S:g} s")


def _rank_pids(launcher: int) -> dict[int, int]:
    """The local launcher's rank processes, by the RANK their environment gives them."""
    pids = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) != launcher:
                continue
            env = (stat.parent / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        rank = next((int(e[5:]) for e in env if e.startswith(b"RANK=")), None)
        if rank is not None:
            pids[rank] = int(stat.parent.name)
    return pids


def _losses(run: Path, key: str = "loss") -> dict[int, float]:
    log = _log(run, 0)
    assert log is not None
    return {step: record[key] for step, record in log.steps.items()}


def _resume(run: Path) -> str:
    return f"`gptpar train {run / 'config.yaml'}` resumes it from its checkpoint"


def _stopped_everywhere(run: Path, ranks: int, status: str, sig: str) -> int:
    """Every rank's last segment ends with a `status` final record at one shared step boundary."""
    finals = [_log(run, rank).final for rank in range(ranks)]
    assert [(f["status"], f["signal"]) for f in finals] == [(status, sig)] * ranks, finals
    step = finals[0]["step"]
    assert step > 0 and {f["step"] for f in finals} == {step}
    assert all(max(_log(run, rank).steps) == step for rank in range(ranks))  # nothing half-done after it
    assert (run / "checkpoint").is_dir()
    return step


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory):
    """One uninterrupted run (started at once, so it trains while the first test waits for its own)."""
    runs = tmp_path_factory.mktemp("reference")
    proc = _gptpar(runs, *RESUMABLE, "log.run_id=straight")

    def losses() -> dict[int, float]:
        code, _, err = _finish(proc)
        assert code == 0, err
        return _losses(runs / "straight")

    yield losses
    if proc.poll() is None:
        proc.kill()


def _resumes_with_the_same_losses(run: Path, step: int, reference, again: subprocess.Popen, dp: bool) -> None:
    """Started again, the run resumes right after the stop and reproduces the uninterrupted losses."""
    code, out, err = _finish(again)
    assert code == 0, err
    assert read_run(RunFolder(run)).state == "completed"
    for rank in range(2 if dp else 1):
        log = _log(run, rank)
        assert [h["restart"] for h in log.headers] == [0, 1]
        assert sorted(log.steps) == list(range(1, STEPS + 1))  # each step once, none lost
        records = [json.loads(line) for line in (run / f"rank{rank}.jsonl").read_text().splitlines()]
        second = records[max(i for i, r in enumerate(records) if r["kind"] == "header"):]
        assert next(r["step"] for r in second if r["kind"] == "step") == step + 1  # from the checkpoint on
    if dp:  # the mean loss over both replicas is the one-process loss (test_train_dp: the same model)
        assert _losses(run, "global_loss") == pytest.approx(reference(), rel=1e-5)
    else:
        assert _losses(run) == pytest.approx(reference(), rel=1e-6)


# 1. SIGTERM: a clean stop with a checkpoint and a final record on every rank; no requeue.

def test_sigterm_stops_a_run_at_a_step_boundary_and_running_it_again_resumes(tmp_path, reference):
    proc = _gptpar(tmp_path, *RESUMABLE, "log.run_id=termed")
    run = tmp_path / "termed"
    _wait_for_steps(proc, run)
    proc.send_signal(signal.SIGTERM)
    code, out, err = _finish(proc)
    step = _stopped_everywhere(run, 1, "stopped", "SIGTERM")
    assert step < STEPS and code == 1 and err == ""
    assert out == [f"gptpar: run {run} stopped at step {step} by SIGTERM; {_resume(run)}"]
    state = read_run(RunFolder(run))
    assert (state.state, state.detail) == ("stopped", f"stopped at step {step} by SIGTERM; {_resume(run)}")
    again = subprocess.Popen([sys.executable, "-m", "gptpar", "train", str(run / "config.yaml")],  # as the hint says
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _resumes_with_the_same_losses(run, step, reference, again, dp=False)


DP2 = ("parallel.dp=2", "parallel.dp_sync=bucketed")  # the default, whose .grad are views of its buckets


def test_sigterm_to_the_local_launcher_stops_every_rank_and_running_it_again_resumes(tmp_path, reference):
    proc = _gptpar(tmp_path, *RESUMABLE, "log.run_id=termed", *DP2)
    run = tmp_path / "termed"
    _wait_for_steps(proc, run, ranks=2)
    proc.send_signal(signal.SIGTERM)
    code, out, err = _finish(proc)
    step = _stopped_everywhere(run, 2, "stopped", "SIGTERM")
    assert step < STEPS and code == 1 and err == ""
    assert out[1:] == [f"gptpar: run stopped: stopped at step {step} by SIGTERM; {_resume(run)}"]
    again = _gptpar(tmp_path, *RESUMABLE, "log.run_id=termed", *DP2)  # the same command
    _resumes_with_the_same_losses(run, step, reference, again, dp=True)


def test_gptpar_cancel_stops_a_local_run_and_gptpar_logs_follows_it_to_its_end(tmp_path):
    """`gptpar logs -f` prints rank 0's records as lines while the run lives and returns when it ends; `gptpar
    cancel` interrupts it at a step boundary, and afterwards finds nothing to cancel."""
    proc = _gptpar(tmp_path, *ENDLESS, "log.run_id=cancelled", *DP2)
    run = tmp_path / "cancelled"
    _wait_for_steps(proc, run, ranks=2)
    follow = subprocess.Popen([sys.executable, "-m", "gptpar", "logs", str(run), "-f", "-n", "2"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def cancel() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "gptpar", "cancel", "cancelled", "--runs-dir", str(tmp_path)],
                              capture_output=True, text=True, timeout=DEADLINE_S)

    time.sleep(3)  # let the follower print a few live steps
    first = cancel()
    assert first.returncode == 0 and first.stderr == "", first.stderr
    assert first.stdout.startswith(f"{run}: interrupted pid ") and "stop at the next step boundary" in first.stdout
    assert _finish(proc)[0] == 1
    finals = [_log(run, rank).final for rank in (0, 1)]  # the signal went to rank 0, which holds the folder
    assert [(f["status"], f["signal"]) for f in finals] == [("stopped", "SIGINT"), ("stopped", None)]
    assert finals[0]["step"] == finals[1]["step"] == max(_log(run, 1).steps)  # one step boundary everywhere
    again = cancel()
    assert again.returncode == 0 and again.stdout == f"{run}: nothing to cancel: no process runs it\n"
    code, lines, err = _finish(follow)
    assert code == 0, err
    steps = [line for line in lines if line.startswith("step ")]
    assert len(steps) > 2 and all(" loss " in line and " tok/s " in line for line in steps)
    assert f"final: stopped at step {finals[0]['step']} (by SIGINT)" in lines
    assert lines[-1].startswith("state: stopped")


PP_STEPS = 60
PP2 = ("model.n_layer=2", "parallel.pp=2", "parallel.chunks=2", "parallel.pp_schedule=zb1p", "train.epochs=3",
       f"train.max_steps={PP_STEPS}")


def test_sigterm_to_a_pipeline_stops_every_stage_at_one_step_and_running_it_again_resumes(tmp_path):
    """The multi-process pipeline stops, checkpoints and resumes like any run: its stages hold different
    parameters, each saved by its own rank, and the resumed losses are the uninterrupted pipeline's."""
    straight = _gptpar(tmp_path, "log.run_id=straight", *PP2)
    proc = _gptpar(tmp_path, "log.run_id=termed", *PP2)
    run = tmp_path / "termed"
    _wait_for_steps(proc, run, ranks=2)
    proc.send_signal(signal.SIGTERM)
    code, out, err = _finish(proc)
    step = _stopped_everywhere(run, 2, "stopped", "SIGTERM")
    assert step < PP_STEPS and code == 1 and err == ""
    again = _gptpar(tmp_path, "log.run_id=termed", *PP2)
    code, _, err = _finish(again)
    assert code == 0, err
    assert _finish(straight)[0] == 0
    for rank in (0, 1):
        log = _log(run, rank)
        assert [h["restart"] for h in log.headers] == [0, 1] and sorted(log.steps) == list(range(1, PP_STEPS + 1))
    assert _losses(run, "global_loss") == _losses(tmp_path / "straight", "global_loss")  # bitwise: same ranks


# 2. Ctrl-C on the launcher of local ranks.

def test_ctrl_c_on_the_launcher_leaves_every_rank_s_final_record_and_one_line(tmp_path):
    proc = _gptpar(tmp_path, *ENDLESS, "log.run_id=interrupted", "parallel.dp=2")
    run = tmp_path / "interrupted"
    _wait_for_steps(proc, run, ranks=2)
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    code, out, err = _finish(proc)
    assert time.monotonic() - sent < 30  # a hang guard: in practice the next step boundary plus exit
    step = _stopped_everywhere(run, 2, "stopped", "SIGINT")
    assert code != 0 and err == ""
    assert out == [f"gptpar: 2 ranks as local processes on this machine: {run}",
                   f"gptpar: run stopped: stopped at step {step} by SIGINT; {_resume(run)}"]


def _opened(pid: int, path: Path) -> bool:
    """Whether process `pid` has `path` open."""
    with contextlib.suppress(OSError):
        return any(os.readlink(fd) == str(path) for fd in Path(f"/proc/{pid}/fd").iterdir())
    return False


def test_sigterm_while_the_data_is_prepared_stops_the_run_at_once(tmp_path):
    """It was recorded and left for the first step boundary, after minutes of hashing (or without end, for a pipe)."""
    huge, run = tmp_path / "huge.txt", tmp_path / "prep"
    with open(huge, "wb") as f:
        f.write(b"some text\n" * (1 << 20))  # 10 MiB of text: what the submit side checks of it is text
        f.truncate(1 << 40)  # then sparse, to 1 TiB: hashing it all would take the rank many minutes
    proc = _gptpar(tmp_path, f"data.source=text:{huge}", "data.max_chars=0", "data.tokenizer=bytes", "log.run_id=prep")
    try:
        deadline = time.monotonic() + DEADLINE_S
        # The folder is written after the submit side's check: an open file then is the rank hashing it.
        while not ((run / "config.yaml").is_file() and _opened(proc.pid, huge)):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        code, out, err = _finish(proc)  # a hang guard: stopping takes well under a second
    finally:
        proc.kill()
    final = _log(run, 0).final
    assert (final["status"], final["signal"], final["step"]) == ("stopped", "SIGTERM", 0)
    assert code == 1 and err == "" and out == [f"gptpar: run {run} stopped at step 0 by SIGTERM; {_resume(run)}"]
    assert read_run(RunFolder(run)).state == "stopped"


# 3. USR2 sent to the launcher of local ranks.

def test_usr2_to_the_launcher_reaches_every_rank_and_reads_as_stopped_outside_slurm(tmp_path):
    proc = _gptpar(tmp_path, *ENDLESS, "log.run_id=preempted", "parallel.dp=2")
    run = tmp_path / "preempted"
    _wait_for_steps(proc, run, ranks=2)
    proc.send_signal(signal.SIGUSR2)
    code, out, err = _finish(proc)
    step = _stopped_everywhere(run, 2, "requeued", "SIGUSR2")
    detail = (f"stopped at step {step} by SIGUSR2 (a requeue request, but no scheduler restarts a "
              f"run outside SLURM); {_resume(run)}")
    state = read_run(RunFolder(run))
    assert (state.state, state.detail) == ("stopped", detail)  # not "pending": nothing will restart it
    assert code != 0 and err == "" and out[1:] == [f"gptpar: run stopped: {detail}"]


# 4. A hung rank fails the whole job, and is the rank named with the collective it held up and its line (a killed
# one: see the submit test, 7).

# Time enough, after stuck_after_s, for `gptpar status` and `gptpar debug` to ask the live run on a loaded machine (at
# 20 s, with a load average of 25 on 2 cores, the timeout came first); the other tests of the module run meanwhile.
HANG_TIMEOUT_S = 40
STUCK_AFTER_S = 2


def _gptpar_output(*words: str) -> str:
    done = subprocess.run([sys.executable, "-m", "gptpar", *words], capture_output=True, text=True, timeout=DEADLINE_S,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    return done.stdout


def _until_stuck(proc: subprocess.Popen, run: Path) -> str:
    """The live run's detail once it shows stuck naming rank 1 (read as `gptpar status` reads it)."""
    deadline = time.monotonic() + DEADLINE_S
    while not re.match(r"stuck: .*rank 1 \(", detail := read_run(RunFolder(run)).detail):
        assert proc.poll() is None and time.monotonic() < deadline, f"never stuck: {detail}"
        time.sleep(0.1)
    return detail


def _stop_rank_one(runs: Path, run_id: str, *words: str, timeout_s: float = HANG_TIMEOUT_S,
                   while_stopped: Callable[[subprocess.Popen, dict], None] | None = None) -> dict:
    """A run on two ranks (`words`) whose rank 1 is stopped (SIGSTOP) once both ranks train, to its end: its folder,
    rank pids, exit code, output, and the seconds from the stop to the end; `while_stopped(proc, result)` looks at the
    live run first."""
    proc = _gptpar(runs, *ENDLESS, f"log.run_id={run_id}", f"parallel.timeout_s={timeout_s}", *words)
    result: dict = {"run": runs / run_id, "pids": {}}
    try:
        _wait_for_steps(proc, runs / run_id, ranks=2)
        result["pids"] = _rank_pids(proc.pid)
        sent = time.monotonic()
        os.kill(result["pids"][1], signal.SIGSTOP)
        if while_stopped is not None:
            while_stopped(proc, result)
        result["code"], result["out"], result["err"] = _finish(proc)
        result["waited_s"] = time.monotonic() - sent
    finally:
        for pid in [proc.pid, *result["pids"].values()]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    return result


def _read_live(proc: subprocess.Popen, result: dict) -> None:
    """The live run read while stuck (`gptpar status`) and its ranks asked for their dumps (`gptpar debug`)."""
    runs = result["run"].parent
    result["stuck"] = _until_stuck(proc, result["run"])
    result["status"] = _gptpar_output("status", str(runs))
    # a rank blocked in a collective answers after flight.CAPTURE_WAIT_S (1 s); the stopped one never
    result["debug"] = _gptpar_output("debug", result["run"].name, "--runs-dir", str(runs), "--wait", "5")
    result["running"] = proc.poll() is None  # the timeout came after both


@pytest.fixture(scope="module", autouse=True)
def hung_rank(tmp_path_factory: pytest.TempPathFactory):
    """A dp=2 run whose rank 1 is stopped (SIGSTOP) once both ranks train. It starts with the module and a
    thread watches it, so its parallel.timeout_s runs out while the other tests run. Before it does, the run is read
    while stuck (`gptpar status`) and its ranks are asked for their dumps (`gptpar debug`)."""
    result: dict = {}

    def watch() -> None:
        try:
            result.update(_stop_rank_one(tmp_path_factory.mktemp("hung"), "hung", "parallel.dp=2",
                                         f"parallel.stuck_after_s={STUCK_AFTER_S}", while_stopped=_read_live))
        except BaseException as exc:  # pytest.fail included: the test re-raises it
            result["error"] = exc

    thread = threading.Thread(target=watch, name="hung-rank", daemon=True)
    thread.start()

    def outcome() -> dict:
        thread.join(2 * DEADLINE_S)
        if "error" in result:
            raise result["error"]
        return result

    yield outcome


def _named_in_the_final_record(result: dict, collective: str, group: str) -> dict:
    """The failed run's final record (rank 0's) names stopped rank 1 (its pid and stack line), `collective` (a regex of
    the call it held up) over `group` (a regex) and rank 0 waiting; every rank dumped. Its `hang`."""
    assert result["waited_s"] < HANG_TIMEOUT_S + 30  # a hang guard: in practice the timeout plus a second
    state = read_run(RunFolder(result["run"]))
    assert state.state == "failed"
    pid = result["pids"][1]
    assert re.fullmatch(rf"hung: rank 1 \({socket.gethostname()}, pid {pid}\) (never (entered|posted) {collective}|was "
                        rf"stopped \(SIGSTOP\) inside {collective}|issued {collective} and was stopped \(SIGSTOP\) "
                        r"before waiting for it): it (was stopped in|is in) gptpar/[\w/]+\.py:\d+ \([\w<>]+\); rank 0 "
                        r"waited \d+ s in .+", state.detail), state.detail
    hang = _log(result["run"], 0).final["hang"]
    assert re.fullmatch(group, hang["group"]), hang
    assert hang["waiting"] == [0] and [(s["rank"], s["pid"], s["stopped"]) for s in hang["stuck"]] == [(1, pid, True)]
    assert hang["summary"] in state.detail and hang["stuck"][0]["where"] in state.detail
    job = RunFolder(result["run"])
    for rank in (0, 1):  # every rank's stack (all threads) and recorder
        assert "Thread 0x" in job.stack_path(rank).read_text()
        assert json.loads(job.flight_path(rank).read_text())["rank"] == rank
    assert "gloo" not in state.detail and "Timed out" not in state.detail  # not rank 0's raw timeout text
    assert result["code"] != 0 and result["out"][1:] == [f"gptpar: run failed: {state.detail}"]
    return hang


def _collective(group: str) -> str:
    """A regex of a collective's text in a diagnosis (gptpar.run.hang), over `group`."""
    return rf"\w+\({group}, [\d.]+ [KM]?i?B\) of step \d+ \(micro-step \d+\)"


def test_a_hung_rank_fails_the_job_soon_after_the_timeout_and_is_named(hung_rank):
    _named_in_the_final_record(hung_rank(), _collective("(dp|world)"), "(dp|world)")


DP_COLLECTIVE = _collective("(dp|world)")


def test_a_hung_rank_shows_stuck_in_status_before_the_timeout_naming_the_collective(hung_rank):
    """From the ranks' live states (gptpar.parallel.flight.live_state), while rank 0 waits and rank 1 is stopped."""
    result = hung_rank()
    assert result["running"]
    pid, host = result["pids"][1], socket.gethostname()
    assert json.loads(RunFolder(result["run"]).live_path(1).read_text())["pid"] == pid  # the records name its pid
    held = rf"rank 1 \({host}, pid {pid}\) (never entered it \(last seen at step \d+\)( and has not answered for " \
           r"\d+ s)?|(is in|entered) it and has not answered for \d+ s)"
    assert re.fullmatch(rf"stuck: rank 0 waited \d+ s in {DP_COLLECTIVE}; {held}", result["stuck"]), result["stuck"]
    lines = result["status"].splitlines()
    assert lines[1].split()[:2] == ["running", "hung"] and re.fullmatch(rf"    stuck: .*; {held}", lines[2]), lines


def test_gptpar_debug_asks_the_live_run_and_names_where_each_rank_is_without_continuing_a_stopped_one(hung_rank):
    result = hung_rank()
    pids, host = result["pids"], socket.gethostname()
    assert re.fullmatch(
        rf"{result['run']}: asked its 2 ranks for their dumps \(SIGQUIT\); 1 answered within 5 s\n"
        rf"hang: rank 1 left no dump \(it did not answer\) and held up {DP_COLLECTIVE}; rank 0 waited \d+ s in it\n"
        rf"rank 0 \({host}, pid {pids[0]}\): gptpar/[\w/]+\.py:\d+ \(\w+\), waiting in {DP_COLLECTIVE}\n"
        r"rank 1: no answer \(stopped, or its Python cannot run: faulthandler's stacks are in its job/rank<R>\.err\)\n"
        rf"every thread's stack: {result['run']}/job/rank<R>\.stack\n", result["debug"]), result["debug"]


SHORT_TIMEOUT_S = 8  # shorter than the dp run's (each case waits for it alone); long enough for a loaded start
P2P = r"(send to|recv from) rank 0 \(pp, [\d.]+ [KM]?i?B\) of step \d+ \(micro-step \d+, micro-batch \d+\)"
HUNG_RUNS = {  # a rank stopped under each other parallelism: the call it held up, its group
    # a send or receive, the loss's or the tied embedding's all-reduce, or (stopped between steps) the step boundary's
    "pp": (["parallel.pp=2", "model.n_layer=2", "parallel.chunks=2"],
           rf"(all_reduce\((pp|world|tied), [\d.]+ [KM]?i?B\) of step \d+ \(micro-step \d+\)|{P2P})",
           "(pp|world|tied)"),
    "fsdp": (["parallel.dp=2", "parallel.dp_sync=fsdp"], _collective("(dp|world)"), "(dp|world)"),
    "tp": (["parallel.tp=2"], _collective("(tp|world)"), "(tp|world)"),
}


@pytest.mark.parametrize("case", HUNG_RUNS)
def test_a_rank_stopped_under_pp_fsdp_or_tp_is_named_with_its_call_and_line(tmp_path, case):
    words, collective, group = HUNG_RUNS[case]
    hang = _named_in_the_final_record(_stop_rank_one(tmp_path, case, *words, timeout_s=SHORT_TIMEOUT_S), collective,
                                      group)
    if hang["collective"] in ("send", "recv"):  # the pipeline's: with the stage at the other end
        assert hang["peer"] == 1 and hang["stuck"][0]["rank"] == 1


def test_a_rank_that_skips_a_gradient_all_reduce_fails_the_run_and_the_mismatch_is_named(tmp_path):
    """Rank 1 skips its gradient all-reduce of step 3 (the test-only GPTPAR_TEST_SKIP_COLLECTIVE): its next collective
    meets rank 0's gradient all-reduce, gloo aborts rank 1 on the size mismatch before any timeout, and rank 0's
    diagnosis reads rank 1's ledger: the two calls under one number, and rank 1 ahead, having skipped the gradient's."""
    proc = _gptpar(tmp_path, *ENDLESS, "log.run_id=skip", "parallel.dp=2", f"parallel.timeout_s={SHORT_TIMEOUT_S}",
                   env={SKIP_COLLECTIVE_ENV: "1:3"})
    code, out, _ = _finish(proc)
    final = _log(tmp_path / "skip", 0).final
    hang = final["hang"]
    assert code != 0 and "Timed out" not in final["error"]  # it ended before parallel.timeout_s ran out
    assert (hang["mismatch"], hang["ahead"], hang["step"], hang["waiting"]) == (True, 1, 3, [0]), hang
    mine, theirs = hang["calls"]["0"], hang["calls"]["1"]
    assert (mine["op"], mine["step"]) == ("all_reduce", 3) and mine["bytes"] != theirs["bytes"]
    gradient = rf"all_reduce\((dp|world), {re.escape(size_text(mine['bytes']))}\)"
    assert re.fullmatch(rf"the ranks issued different collectives: rank 0 is in {gradient} of step 3 \(micro-step "
                        r"0\), #\d+ of \w+; rank 1 \(read from its ledger: it left no dump\) in .+ of step 3 .+; rank "
                        rf"1 is ahead: it skipped {gradient} of step 3; rank 0 waited \d+ s", hang["summary"]), \
        hang["summary"]
    assert out[1:] == [f"gptpar: run failed: hung: {hang['summary']}"]


# 5 and 6. Runs started together; a run killed with SIGKILL.

def test_runs_started_together_with_default_ids_get_one_folder_each(tmp_path):
    """The folder (and its id) is fixed when the run is planned, before torch loads: the runs are stopped
    there, once each has its folder, since what they would train next changes nothing about it."""
    procs = [_gptpar(tmp_path, *ENDLESS, "log.name=together") for _ in range(4)]
    deadline = time.monotonic() + DEADLINE_S
    try:
        while len(list(tmp_path.glob("together*/config.yaml"))) < 4 and time.monotonic() < deadline:
            assert all(p.poll() is None for p in procs), [_finish(p) for p in procs if p.poll() is not None]
            time.sleep(0.02)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    folders = sorted(tmp_path.glob("together*"))
    assert len(folders) == 4
    ids = [yaml.safe_load((folder / "config.yaml").read_text())["log"]["run_id"] for folder in folders]
    assert ids == [folder.name for folder in folders]


@pytest.fixture(scope="module")
def one_folder_race(tmp_path_factory: pytest.TempPathFactory):
    """Four runs into one explicit log.run_id, started together: the winner trains on; the others' ends."""
    runs = tmp_path_factory.mktemp("race")
    procs = [_gptpar(runs, *ENDLESS, "log.run_id=shared") for _ in range(4)]
    deadline = time.monotonic() + DEADLINE_S
    while sum(p.poll() is None for p in procs) > 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    losers = {p.pid: _finish(p) for p in procs if p.poll() is not None}
    (winner,) = [p for p in procs if p.poll() is None]
    _wait_for_steps(winner, runs / "shared")
    yield runs / "shared", winner, losers
    if winner.poll() is None:
        winner.kill()


def test_runs_started_together_into_one_folder_leave_it_to_exactly_one(one_folder_race):
    run, winner, losers = one_folder_race
    assert len(losers) == 3
    holder = f"host {socket.gethostname()} pid {winner.pid}"
    for code, out, err in losers.values():
        assert (code, out) == (2, [])
        assert err.splitlines() == [f"gptpar: error: run folder {run} is in use by {holder}; wait for it to end, "
                                    "or use another log.run_id"]
    assert {p.name for p in run.iterdir()} <= {"config.yaml", ".lock", "rank0.jsonl", "checkpoint"}
    assert len(_log(run, 0).headers) == 1  # the winner's segment only


def test_a_run_killed_with_sigkill_reads_as_failed_at_once(one_folder_race):
    run, winner, _ = one_folder_race
    assert read_run(RunFolder(run)).state == "running"
    winner.kill()
    winner.wait(30)
    state = read_run(RunFolder(run))  # no delay: the lock died with the process
    assert state.state == "failed"
    assert state.detail == "rank 0 died without a final record (last record 0 min ago)"


# 7. A failed local submit says which rank failed and why; 4. a rank killed with SIGKILL is the one named.

def test_a_failed_local_submit_names_the_rank_that_was_killed_and_why(tmp_path):
    proc = _gptpar(tmp_path, *ENDLESS, "log.run_id=killed", "launch.cluster=local",
                   command=("submit", "dp", "--gpus", "2"))
    run = tmp_path / "killed"
    _wait_for_steps(proc, run, ranks=2)
    rank1 = _rank_pids(proc.pid)[1]
    os.kill(rank1, signal.SIGKILL)
    code, out, err = _finish(proc)
    assert code == 1, err
    assert out[0] == f"dp run {run}: 2 rank(s) on local processes on this machine"
    assert re.fullmatch(rf"killed: failed \(job {re.escape(socket.gethostname())}:{proc.pid}\.1\): rank 1 stopped "
                        r"responding after step \d+: no final record, and rank 0 lost contact with it; rank1\.err: "
                        rf"gptpar: rank 1 \(pid {rank1}\) was killed by SIGKILL", out[-1]), out


# 8. The local launcher killed with SIGKILL (issue 26): it forwards nothing, so its ranks notice it is gone.

def _alive(pid: int) -> bool:
    """Still running: a zombie (dead, not yet reaped by whoever adopted it) counts as ended."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def test_ranks_of_a_local_launcher_killed_with_sigkill_stop_with_a_checkpoint(tmp_path):
    proc = _gptpar(tmp_path, *ENDLESS, "log.run_id=orphaned", "parallel.dp=2")
    run = tmp_path / "orphaned"
    _wait_for_steps(proc, run, ranks=2)
    ranks = _rank_pids(proc.pid)
    assert sorted(ranks) == [0, 1]
    try:
        proc.kill()
        proc.wait()
        killed = time.monotonic()
        while any(_alive(pid) for pid in ranks.values()) and time.monotonic() - killed < 60:
            time.sleep(0.1)
        assert time.monotonic() - killed < 30, "the ranks train on without their launcher"  # a hang guard
    finally:
        for pid in ranks.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    finals = [_log(run, rank).final for rank in (0, 1)]
    assert [f["status"] for f in finals] == ["stopped", "stopped"] and "SIGTERM" in {f["signal"] for f in finals}
    step = finals[0]["step"]
    assert 0 < step < 1_000_000 and finals[1]["step"] == step == max(_log(run, 1).steps)  # one step boundary
    assert (run / "checkpoint").is_dir()
    noticed = [rank for rank in (0, 1) if f"rank {rank}: its launcher (pid {proc.pid}) is gone; stopping at the next "
               "step boundary" in (run / "job" / f"rank{rank}.err").read_text()]
    assert noticed, "no rank said why it stopped"  # the first to notice may stop the other at the same step first
    # A rank's main thread reads as a zombie while its other threads still close the process's files (the run's lock
    # among them): the lock is free once the last is gone, within moments.
    released = time.monotonic() + DEADLINE_S
    while RunFolder(run).holder() is not None and time.monotonic() < released:
        time.sleep(0.1)
    state = read_run(RunFolder(run))
    assert (state.state, state.detail) == ("stopped", f"stopped at step {step} by SIGTERM; {_resume(run)}")
    proc.communicate(timeout=DEADLINE_S)  # rank 0 held the launcher's stdout until it ended


# 9. A straggler: a rank slowed by periodic SIGSTOP/SIGCONT is flagged by the report and status with its host.

STRAGGLER = ["model.n_layer=2", "model.n_embd=64", "data.seq_len=32", "train.batch_size=16", "train.max_steps=30"]
# Rank 1 stopped 150 ms in every 160: a step of its (some 20 ms of compute idle) holds a stop or more, so its compute is
# 0.17 s or more a step, where rank 0's stayed under 0.14 s at a load average of 60 on 2 cores. A stop that lands in
# one of rank 1's collectives counts as waiting, not compute: 3 of 18 slowed steps in a run of 20, so 30 steps keep
# the slow ones well above half.
STOP_S, RUN_S = 0.15, 0.01


def _slow_down(proc: subprocess.Popen, pid: int) -> None:
    """Stop and continue `pid` in turn until the run ends; continued at the end whatever happens."""
    try:
        while proc.poll() is None:
            os.kill(pid, signal.SIGSTOP)
            time.sleep(STOP_S)
            os.kill(pid, signal.SIGCONT)
            time.sleep(RUN_S)
    except ProcessLookupError:  # the rank ended between the poll and the signal
        pass
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def test_a_rank_slowed_by_periodic_stops_is_flagged_as_the_straggler_with_its_host(tmp_path, capsys):
    proc = _gptpar(tmp_path, "log.run_id=slow", "parallel.dp=2", *STRAGGLER)
    run = tmp_path / "slow"
    _wait_for_steps(proc, run)
    slowing = threading.Thread(target=_slow_down, args=(proc, _rank_pids(proc.pid)[1]), name="straggler")
    slowing.start()
    code, _, err = _finish(proc)
    slowing.join()
    assert code == 0, err
    computes = [r["rank_compute_s"] for r in _log(run, 0).steps.values()]  # rank 0's record: every rank's compute
    assert len(computes) == 30 and {len(c) for c in computes} == {2}
    flag = rf"rank 1 \({re.escape(socket.gethostname())}\) computed above 1.2x its peers' median on \d+ of 30 steps"
    assert gptpar_main(["report", str(run), "--out", str(tmp_path / "report")]) == 0
    printed = capsys.readouterr().out
    assert re.search(rf"^straggler: run slow: {flag}", printed, re.MULTILINE) and "rank 0 (" not in printed, printed
    summary = (tmp_path / "report" / "summary.md").read_text()
    assert re.search(rf"^- slow: {flag}", summary, re.MULTILINE) and "rank 0 (" not in summary
    assert gptpar_main(["status", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert re.search(rf"^    straggler: {flag}", printed, re.MULTILINE) and "rank 0 (" not in printed, printed
