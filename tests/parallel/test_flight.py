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
