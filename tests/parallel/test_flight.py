"""The flight recorder of gptpar's collectives (gptpar.parallel.flight): what it keeps, and the dump a rank writes on
the dump signal, in this process (a signal to itself; a hung job's processes: tests/e2e/test_hostile_signals.py)."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

import gptpar.parallel.comm as comm
import gptpar.parallel.flight as flight
from gptpar.parallel.comm import comm_span, new_step
from gptpar.parallel.flight import DUMP_SIGNAL, Peer, Recorder, dumps_on_signal, mirrored
from gptpar.parallel.flight_format import read_ledger

DEADLINE_S = 30.0  # a hang guard while waiting for the dump thread: never a timing claim


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    """A fresh recorder behind comm_span, so that the collectives of other tests in this process do not count."""
    fresh = Recorder(capacity=3)
    monkeypatch.setattr(comm, "RECORDER", fresh)
    monkeypatch.setattr(flight, "RECORDER", fresh)
    return fresh


def test_the_recorder_keeps_the_last_n_collectives_and_counts_every_one_per_group(recorder):
    new_step(7)
    for nbytes in (1, 2, 3, 4, 5):
        with comm_span("all_reduce", nbytes=nbytes):
            pass
    with comm_span("broadcast", nbytes=6):
        pass
    assert recorder.seqs == {"world": 6}  # past the ring's 3
    assert [(e["seq"], e["op"], e["group"], e["bytes"], e["step"], e["state"]) for e in recorder.entries] == [
        (4, "all_reduce", "world", 4, 7, "completed"), (5, "all_reduce", "world", 5, 7, "completed"),
        (6, "broadcast", "world", 6, 7, "completed")]
    assert all(e["start"] <= e["end"] for e in recorder.entries)
    assert not recorder.in_collective()


def test_an_issued_collective_and_its_wait_are_one_entry_unfinished_while_waited_for(recorder):
    with comm_span("all_reduce", phase="issue", nbytes=8):
        pass
    recorder.micro_step = 1
    assert [e["state"] for e in recorder.entries] == ["issued"] and not recorder.in_collective()
    with comm_span("all_reduce", phase="wait"):
        assert [(e["state"], e["bytes"], e["micro_step"]) for e in recorder.entries] == [("waiting", 8, 0)]
        assert recorder.in_collective()
    assert [e["state"] for e in recorder.entries] == ["completed"] and recorder.seqs == {"world": 1}


def test_a_collective_that_raises_stays_unfinished_as_failed(recorder):
    with pytest.raises(RuntimeError), comm_span("all_gather", nbytes=4):
        raise RuntimeError("Timed out waiting for a peer")
    assert [e["state"] for e in recorder.entries] == ["failed"] and recorder.blocked() is recorder.entries[0]


def test_the_dump_signal_writes_the_recorder_and_every_threads_stack_while_inside_a_collective(tmp_path, recorder):
    flight, stack = tmp_path / "rank3.flight.json", tmp_path / "rank3.stack"
    with dumps_on_signal(3, flight, stack), comm_span("all_reduce", nbytes=16):
        os.kill(os.getpid(), DUMP_SIGNAL)
        deadline = time.monotonic() + DEADLINE_S
        while not flight.exists():
            assert time.monotonic() < deadline, "no dump"
            time.sleep(0.01)
    dump = json.loads(flight.read_text())
    assert (dump["rank"], dump["pid"], dump["reason"], dump["stopped"]) == (3, os.getpid(), "on request (SIGQUIT)",
                                                                            False)
    assert [(e["op"], e["bytes"], e["state"]) for e in dump["entries"]] == [("all_reduce", 16, "started")]
    assert dump["frames"][-1][2] == "test_the_dump_signal_writes_the_recorder_and_every_threads_stack_while_inside_" \
                                    "a_collective"  # where the main thread was, not the handler
    text = stack.read_text()
    assert "Thread 0x" in text and text.count("in test_the_dump_signal_writes_the_recorder") >= 1
    assert signal.getsignal(DUMP_SIGNAL) is signal.SIG_DFL  # given back


def _until(condition, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _dump_time(path) -> float:
    try:
        return json.loads(path.read_text())["time"]
    except (OSError, ValueError):
        return 0.0


def test_each_request_dumps_anew_and_a_failure_has_the_last_word(tmp_path, recorder):
    """`gptpar debug` may ask a rank many times while it trains on, then its collective times out: each request
    dumps where the rank is then, the failure dumps over them, and no request after it overwrites it."""
    flight_path, stack = tmp_path / "rank0.flight.json", tmp_path / "rank0.stack"
    new_step(3)
    with dumps_on_signal(0, flight_path, stack):
        for op in ("all_reduce", "all_gather"):
            before = _dump_time(flight_path)
            with comm_span(op, nbytes=4):
                os.kill(os.getpid(), DUMP_SIGNAL)
                _until(lambda before=before: _dump_time(flight_path) > before, f"no dump in {op}")
            assert json.loads(flight_path.read_text())["blocked"]["op"] == op
        with pytest.raises(RuntimeError) as failure, comm_span("broadcast", nbytes=4):
            raise RuntimeError("Timed out")
        assert flight.dump_on_failure(failure.value)
        failed = json.loads(flight_path.read_text())
        assert (failed["reason"], failed["blocked"]["op"]) == ("failed inside a collective", "broadcast")
        flight._dumper.on_signal(False)  # a request after it, as the dump thread makes it
        assert json.loads(flight_path.read_text()) == failed
    assert stack.read_text().count("gptpar: rank 0 pid") == 3  # two requests, one failure


def test_a_rank_continued_by_the_request_keeps_its_dump_when_it_fails_later(tmp_path, recorder):
    """The dump signal then SIGCONT at once, as a stopped rank receives them (request_dumps): the dump says stopped,
    and neither the failure the continued rank runs into next nor another rank's request overwrites where it was
    stopped."""
    flight_path = tmp_path / "rank1.flight.json"
    with dumps_on_signal(1, flight_path, tmp_path / "rank1.stack"), comm_span("all_reduce", nbytes=4):
        os.kill(os.getpid(), DUMP_SIGNAL)
        os.kill(os.getpid(), signal.SIGCONT)
        _until(flight_path.exists, "no dump")
        continued = json.loads(flight_path.read_text())
        assert continued["stopped"] is True
        assert not flight.dump_on_failure(RuntimeError("Connection closed by peer"))
        flight._dumper.on_signal(False)  # another rank's request, as the dump thread answers it
        assert json.loads(flight_path.read_text()) == continued


def test_the_live_state_is_the_collective_waited_in_rewritten_by_a_thread(tmp_path, recorder):
    live = tmp_path / "rank2.live.json"
    new_step(9)
    with comm_span("all_reduce", nbytes=4), comm_span("reduce_scatter", nbytes=64):
        with flight.live_state(2, live, every_s=0.01):
            _until(live.exists, "no live state")
            first = json.loads(live.read_text())
            _until(lambda: _dump_time(live) > first["time"], "not rewritten")
    assert (first["rank"], first["pid"], first["step"], first["seqs"]) == (2, os.getpid(), 9, {"world": 2})
    assert (first["blocked"]["op"], first["blocked"]["seq"], first["blocked"]["state"]) == ("all_reduce", 1, "started")
    assert (first["last"]["op"], first["last"]["bytes"]) == ("reduce_scatter", 64)
    assert not list(tmp_path.glob(".*.tmp"))  # written by a rename


def test_sends_and_receives_count_per_peer_and_a_wait_for_one_is_where_the_rank_is_blocked(recorder):
    """A rank's k-th send to a peer is that peer's k-th receive from it (gptpar.run.hang compares them): counted per
    channel, apart from the group's collectives."""
    with comm_span("send", "recv", "send", phase="issue", group="pp", peers=[Peer(1, 8, 0), Peer(1, 8, 0),
                                                                             Peer(2, 4, 1)]):
        pass
    with comm_span("all_reduce", group="pp", nbytes=8):
        pass
    assert recorder.seqs == {"pp:send:1": 1, "pp:recv:1": 1, "pp:send:2": 1, "pp": 1}
    assert recorder.blocked() is None
    with comm_span("recv", phase="wait", group="pp"):
        assert recorder.in_collective()
        assert {k: recorder.blocked()[k] for k in ("op", "peer", "seq", "bytes", "micro_batch", "state")} == {
            "op": "recv", "peer": 1, "seq": 1, "bytes": 8, "micro_batch": 0, "state": "waiting"}


def test_with_the_recorder_off_a_span_records_nothing(recorder):
    recorder.on = False
    with comm_span("all_reduce", nbytes=4):
        assert not recorder.in_collective()
    assert not recorder.entries and not recorder.seqs


def test_the_ledger_keeps_what_the_rank_entered_in_a_file_as_it_goes(tmp_path, recorder):
    """What a rank that dies without a dump leaves (gptpar.run.hang reads it): the ring's entries, oldest first, in a
    file written at each entry (a shared mapping: the kernel keeps it when the process dies)."""
    path = tmp_path / "rank1.ledger"
    new_step(4)
    with mirrored(path):
        for nbytes in (8, 16, 24, 32):  # one past the ring's 3
            with comm_span("all_reduce", group="dp", nbytes=nbytes):
                pass
        with comm_span("send", phase="issue", group="pp", peers=[Peer(2, 40, 1)]):
            pass
        assert [(e["seq"], e["op"], e["group"], e["bytes"], e["step"], e.get("peer")) for e in read_ledger(path)] == [
            (3, "all_reduce", "dp", 24, 4, None), (4, "all_reduce", "dp", 32, 4, None), (1, "send", "pp", 40, 4, 2)]
    assert recorder.ledger is None


def test_a_rank_is_taken_for_stopped_only_where_its_live_thread_did_not_run(monkeypatch):
    """Two scancels close together on a loaded node deliver the dump signal and SIGCONT at once to a running rank too:
    its live thread's rewrites, a second apart, say it ran; a stopped rank's show the gap (just rewritten on waking, or
    not since)."""
    now = time.monotonic()
    for ticks, ended_at, paused in (([now - 1.5, now - 0.5], None, False), ([now - 12, now - 0.01], None, True),
                                    ([now - 9, now - 8], None, True),
                                    ([], None, True),  # no live thread: the signals' timing decides alone
                                    ([now - 10, now - 9], now - 8.5, False),  # winding down since it ended
                                    ([now - 30], now - 0.01, True)):  # ended on waking: its training failed
        monkeypatch.setattr(flight, "_TICKS", flight._LiveTicks(ticks, ended_at))
        assert flight._paused() is paused, (ticks, ended_at)


def test_a_rank_winding_down_after_its_training_is_not_taken_for_stopped(tmp_path, recorder):
    """A rank whose collective timed out writes its own dump after its live thread ended with the training, while the
    other ranks' requests reach it as the dump signal and SIGCONT at once (scancel's two signals): it ran, so its dump
    must not say stopped (CI named a rank that timed out as the one stopped, "in flight.py (on_failure)"). The rewrites
    before the live thread ended say so, however long the wind-down takes."""
    flight_path = tmp_path / "rank1.flight.json"
    with dumps_on_signal(1, flight_path, tmp_path / "rank1.stack"):
        with flight.live_state(1, tmp_path / "rank1.live.json", every_s=0.01):
            _until((tmp_path / "rank1.live.json").exists, "no live state")
        time.sleep(flight.PAUSED_AFTER_S + 0.5)  # its own dump and diagnosis may take longer than a pause
        with comm_span("all_reduce", nbytes=4):
            os.kill(os.getpid(), DUMP_SIGNAL)
            os.kill(os.getpid(), signal.SIGCONT)
            _until(flight_path.exists, "no dump")
    assert json.loads(flight_path.read_text())["stopped"] is False
