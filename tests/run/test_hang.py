"""Naming the rank that hung a job from the ranks' dumps (gptpar.run.hang): dumps written here as a rank writes them
(gptpar.parallel.flight), with known answers."""

from __future__ import annotations

import json
from typing import Any

import pytest
from logsets import T0, Rank, config

from gptpar.errors import GptparError
from gptpar.launch.debug import debug_run
from gptpar.parallel.flight_format import ledger_line
from gptpar.run.folder import RunFolder
from gptpar.run.hang import diagnose, read_dumps, read_ledgers, read_lives, stuck
from gptpar.run.state import read_run

START = 1_000.0  # the segment's start, in the dumps' clock
MIB = 1 << 20


def _entry(seq: int, state: str, start: float, end: float | None = None, group: str = "dp", step: int = 12,
           nbytes: int = 48 * MIB) -> dict[str, Any]:
    return {"seq": seq, "op": "all_reduce", "group": group, "bytes": nbytes, "step": step, "micro_step": 0,
            "start": start, "end": end, "state": state}


def _dump(rank: int, seqs: dict[str, int], entries: list[dict[str, Any]], frames: list[list[Any]],
          groups: dict[str, list[int]] | None = None, stopped: bool = False, at: float = START + 40) -> dict[str, Any]:
    """A rank's dump; `blocked` is its last entry when that is not completed (the recorder's oldest unfinished)."""
    blocked = entries[-1] if entries and entries[-1]["state"] != "completed" else None
    return {"rank": rank, "host": f"node{rank + 1}", "pid": 4700 + rank, "time": at, "reason": "test",
            "stopped": stopped, "world_size": 2, "groups": groups or {"dp": [0, 1]}, "step": 12, "micro_step": 0,
            "seqs": seqs, "entries": entries, "blocked": blocked, "frames": frames}


WAITED = _entry(5, "failed", START + 10, START + 40)  # rank 0 timed out in dp #5 after 30 s
READING = [["gptpar/train/trainer.py", 212, "_timed_step"], ["gptpar/data/blocks.py", 88, "read"],
           ["/usr/lib/python3.11/threading.py", 320, "wait"]]


def _written(tmp_path, *dumps: dict[str, Any]) -> RunFolder:
    folder = RunFolder(tmp_path)
    folder.job_dir.mkdir()
    for dump in dumps:
        folder.flight_path(dump["rank"]).write_text(json.dumps(dump))
    return folder


def test_the_rank_that_never_entered_the_collective_is_named_with_its_line(tmp_path):
    folder = _written(tmp_path, _dump(0, {"dp": 5}, [_entry(4, "completed", START, START + 1), WAITED], []),
                      _dump(1, {"dp": 4}, [_entry(4, "completed", START, START + 1)], READING, stopped=True))
    hang = diagnose(read_dumps(folder, 2, START), 2)
    assert hang["summary"] == ("rank 1 (node2, pid 4701) never entered all_reduce(dp, 48 MiB) of step 12 "
                               "(micro-step 0): it was stopped in gptpar/data/blocks.py:88 (read); rank 0 waited 30 s "
                               "in it")
    assert {k: hang[k] for k in ("collective", "group", "bytes", "step", "seq", "waiting", "waited_s")} == {
        "collective": "all_reduce", "group": "dp", "bytes": 48 * MIB, "step": 12, "seq": 5, "waiting": [0],
        "waited_s": 30.0}
    assert hang["stuck"] == [{"rank": 1, "host": "node2", "pid": 4701, "where": "gptpar/data/blocks.py:88",
                              "function": "read", "entered": False, "state": None, "stopped": True}]


def test_a_rank_stopped_inside_the_collective_is_named_though_it_entered_it(tmp_path):
    folder = _written(tmp_path, _dump(0, {"dp": 5}, [WAITED], []),
                      _dump(1, {"dp": 5}, [_entry(5, "waiting", START + 9)], READING[:2], stopped=True))
    assert diagnose(read_dumps(folder, 2, START), 2)["summary"] == (
        "rank 1 (node2, pid 4701) was stopped (SIGSTOP) inside all_reduce(dp, 48 MiB) of step 12 (micro-step 0): it "
        "is in gptpar/data/blocks.py:88 (read); rank 0 waited 30 s in it")


def test_a_rank_stopped_between_issuing_the_collective_and_waiting_for_it_is_named_so(tmp_path):
    folder = _written(tmp_path, _dump(0, {"dp": 5}, [WAITED], []),
                      _dump(1, {"dp": 5}, [_entry(5, "issued", START + 9)], READING[:2], stopped=True))
    assert diagnose(read_dumps(folder, 2, START), 2)["summary"] == (
        "rank 1 (node2, pid 4701) issued all_reduce(dp, 48 MiB) of step 12 (micro-step 0) and was stopped (SIGSTOP) "
        "before waiting for it: it is in gptpar/data/blocks.py:88 (read); rank 0 waited 30 s in it")


def test_a_rank_without_a_dump_of_this_start_is_named_without_a_place(tmp_path):
    stale = _dump(1, {"dp": 9}, [], READING, at=START - 1)  # from an earlier start of the run: not read
    folder = _written(tmp_path, _dump(0, {"dp": 5}, [WAITED], []), stale)
    hang = diagnose(read_dumps(folder, 2, START), 2)
    assert hang["summary"] == ("rank 1 left no dump (it did not answer) and held up all_reduce(dp, 48 MiB) of step 12 "
                               "(micro-step 0); rank 0 waited 30 s in it")
    assert hang["stuck"][0]["where"] is None


def test_only_the_ranks_of_the_group_waited_in_are_suspects(tmp_path):
    """dp groups {0, 1} and {2, 3}: rank 2 waits in its group's #5 for rank 3; ranks 0 and 1, behind in their own
    group's count, are not in it."""
    pairs = {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}
    dumps = [_dump(r, {"dp": 3}, [], READING, groups={"dp": pairs[r]}) for r in (0, 1, 3)]
    dumps.append(_dump(2, {"dp": 5}, [WAITED], [], groups={"dp": [2, 3]}))
    hang = diagnose(read_dumps(_written(tmp_path, *dumps), 4, START), 4)
    assert [s["rank"] for s in hang["stuck"]] == [3] and hang["waiting"] == [2]


def test_no_rank_inside_a_collective_is_no_hang(tmp_path):
    folder = _written(tmp_path, _dump(0, {"dp": 4}, [_entry(4, "completed", START, START + 1)], READING))
    assert diagnose(read_dumps(folder, 2, START), 2) is None


def _hung_run(tmp_path, where: str | None) -> str:
    """The detail gptpar status shows for a dp=2 run whose rank 0 timed out with `where` its diagnosis's place of rank
    1 (None: rank 1 left no dump), and rank 1 has no final record."""
    cfg = config(dp=2)
    stuck = {"rank": 1, "host": "node2", "pid": 4701, "where": where, "function": "read", "entered": False,
             "state": None, "stopped": True}
    hang = {"summary": "rank 1 ... never entered all_reduce(dp, 48 MiB)", "stuck": [stuck]}
    Rank(tmp_path, 0, cfg).header().step(1).final("failed", 1, error="RuntimeError: [gloo] Timed out", hang=hang)
    Rank(tmp_path, 1, cfg).header().step(1)
    return read_run(RunFolder(tmp_path), now=T0 + 60).detail


def test_status_says_the_hang_where_the_stuck_rank_dumped_and_why_it_ended_where_it_did_not(tmp_path):
    assert _hung_run(tmp_path / "dumped", "gptpar/data/blocks.py:88") == \
        "hung: rank 1 ... never entered all_reduce(dp, 48 MiB)"
    assert _hung_run(tmp_path / "killed", None).startswith("rank 1 stopped responding after step 1: no final record, "
                                                           "and rank 0 lost contact with it")


# Live: a run whose ranks wait in one collective longer than parallel.stuck_after_s shows stuck (gptpar.run.hang.stuck),
# from the live states each rank's thread rewrites every second (gptpar.parallel.flight.live_state).

def _live(rank: int, seqs: dict[str, int], blocked: dict[str, Any] | None, at: float, world: int = 3) -> dict[str, Any]:
    return {"rank": rank, "host": f"node{rank + 1}", "pid": 4700 + rank, "time": at,
            "groups": {"dp": list(range(world))}, "step": 12, "micro_step": 0, "seqs": seqs, "blocked": blocked,
            "last": blocked}


def _lives(folder: RunFolder, *lives: dict[str, Any]) -> RunFolder:
    folder.job_dir.mkdir(exist_ok=True)
    for live in lives:
        folder.live_path(live["rank"]).write_text(json.dumps(live))
    return folder


WAITING = _entry(5, "started", START + 10)  # dp #5, entered at START + 10


def test_ranks_waiting_longer_than_the_threshold_are_stuck_naming_the_collective_and_who_never_entered_it(tmp_path):
    """Ranks 0 and 1 wait in dp #5 (rank 1 a second less); rank 2 never entered it and stopped rewriting its state
    at START + 8 (stopped, say): at START + 40 they have waited 30 s."""
    folder = _lives(RunFolder(tmp_path), _live(0, {"dp": 5}, WAITING, START + 40),
                    _live(1, {"dp": 5}, dict(WAITING, start=START + 11), START + 40),
                    _live(2, {"dp": 4}, None, START + 8))
    lives = read_lives(folder, dict.fromkeys(range(3), START))
    assert stuck(lives, 3, START + 40, 29.0) == {
        "summary": "ranks 0, 1 waited 30 s in all_reduce(dp, 48 MiB) of step 12 (micro-step 0); rank 2 (node3, pid "
                   "4702) never entered it (last seen at step 12) and has not answered for 32 s",
        "collective": "all_reduce", "group": "dp", "bytes": 48 * MIB, "step": 12, "micro_step": 0, "seq": 5,
        "waiting": [0, 1], "waited_s": 30.0}
    assert stuck(lives, 3, START + 40, 30.0) is None  # not longer than the threshold yet


def test_a_member_that_issued_the_collective_and_answers_is_no_suspect_one_that_stopped_answering_is(tmp_path):
    """Ranks 1 and 2 issued dp #5 (asynchronous: not waiting in it yet); rank 2 has not rewritten its state for 20 s."""
    issued = dict(WAITING, state="issued")
    folder = _lives(RunFolder(tmp_path), _live(0, {"dp": 5}, WAITING, START + 40),
                    _live(1, {"dp": 5}, None, START + 39) | {"last": issued},
                    _live(2, {"dp": 5}, None, START + 20) | {"last": issued})
    assert stuck(read_lives(folder, dict.fromkeys(range(3), START)), 3, START + 40, 10.0)["summary"] == (
        "rank 0 waited 30 s in all_reduce(dp, 48 MiB) of step 12 (micro-step 0); rank 2 (node3, pid 4702) entered it "
        "and has not answered for 20 s")


def test_the_collective_of_a_rank_that_stopped_answering_is_not_taken_for_the_one_waited_in(tmp_path):
    """Rank 1 was stopped at START + 2 inside dp #4, which it finished long ago for all its frozen state knows."""
    folder = _lives(RunFolder(tmp_path), _live(0, {"dp": 5}, WAITING, START + 40, world=2),
                    _live(1, {"dp": 4}, _entry(4, "started", START + 1), START + 2, world=2))
    assert stuck(read_lives(folder, dict.fromkeys(range(2), START)), 2, START + 40, 10.0)["summary"] == (
        "rank 0 waited 30 s in all_reduce(dp, 48 MiB) of step 12 (micro-step 0); rank 1 (node2, pid 4701) never "
        "entered it (last seen at step 12) and has not answered for 38 s")


def test_status_shows_a_running_run_stuck_once_its_ranks_waited_half_its_timeout(tmp_path):
    """parallel.stuck_after_s=0 is half of parallel.timeout_s (20 s here); a live state of an earlier start is
    stale."""
    cfg = config(dp=2, **{"parallel.timeout_s": 20.0})
    first, second = Rank(tmp_path, 0, cfg).header().step(1), Rank(tmp_path, 1, cfg).header().step(1)
    begun = max(first.clock, second.clock)
    folder = _lives(RunFolder(tmp_path), _live(0, {"dp": 5}, _entry(5, "started", begun + 5), begun + 20, world=2),
                    _live(1, {"dp": 4}, None, begun + 6, world=2))
    detail = read_run(folder, scheduler="running", now=begun + 16).detail
    assert detail == ("stuck: rank 0 waited 11 s in all_reduce(dp, 48 MiB) of step 12 (micro-step 0); rank 1 (node2, "
                      "pid 4701) never entered it (last seen at step 12) and has not answered for 10 s")
    assert read_run(folder, scheduler="running", now=begun + 14).detail == "running (the scheduler says so)"
    first.clock = begun + 30
    first.header()  # a new start: the live states above are an earlier start's
    assert read_run(folder, scheduler="running", now=begun + 16).detail == "running (the scheduler says so)"


def test_gptpar_debug_refuses_in_one_line_a_run_with_no_rank_to_ask(tmp_path):
    for rank in (0, 1):
        Rank(tmp_path, rank, config(dp=2)).header().step(1).final("completed", 1)
    with pytest.raises(GptparError, match=rf"^run {tmp_path} is completed, not running: no rank to ask \(its last "
                       rf"dumps, if any, are in {tmp_path}/job/rank<R>\.stack\)$"):
        debug_run(RunFolder(tmp_path))


def _p2p(op: str, peer: int, seq: int, state: str, start: float, end: float | None = None) -> dict[str, Any]:
    """A pipeline's send or receive entry of step 2, micro-batch 3 (gptpar.parallel.flight.Peer)."""
    return {**_entry(seq, state, start, end, group="pp", step=2, nbytes=8 * 1024), "op": op, "peer": peer,
            "micro_batch": 3}


def test_a_stage_that_never_posted_the_receive_a_send_waits_for_is_named_with_its_line(tmp_path):
    """Rank 0 waits in its 4th send to rank 1; rank 1 posted 3 receives from rank 0 and is elsewhere: it holds rank 0
    up, though its count of receives from rank 2 (another channel) is past 4."""
    sender = _dump(0, {"pp:send:1": 4, "pp": 1}, [_p2p("send", 1, 4, "failed", START + 30, START + 40)], [],
                   groups={"pp": [0, 1]})
    receiver = _dump(1, {"pp:recv:0": 3, "pp:recv:2": 9, "pp": 1}, [_p2p("recv", 0, 3, "completed", START, START + 1)],
                     READING, groups={"pp": [0, 1]})
    hang = diagnose(read_dumps(_written(tmp_path, sender, receiver), 2, START), 2)
    assert hang["summary"] == ("rank 1 (node2, pid 4701) never posted recv from rank 0 (pp, 8 KiB) of step 2 "
                               "(micro-step 0, micro-batch 3): it is in gptpar/data/blocks.py:88 (read); rank 0 waited "
                               "10 s in send to rank 1")
    assert {k: hang[k] for k in ("collective", "group", "peer", "bytes", "step", "micro_batch", "seq", "waiting")} == {
        "collective": "send", "group": "pp", "peer": 1, "bytes": 8192, "step": 2, "micro_batch": 3, "seq": 4,
        "waiting": [0]}
    assert [(s["rank"], s["entered"], s["where"]) for s in hang["stuck"]] == [(1, False, "gptpar/data/blocks.py:88")]


def test_a_stage_stopped_inside_the_matching_send_is_named_so_and_one_that_posted_it_is_not_a_suspect(tmp_path):
    receiver = _dump(0, {"pp:recv:1": 2}, [_p2p("recv", 1, 2, "failed", START + 30, START + 40)], [])
    stopped = _dump(1, {"pp:send:0": 2}, [_p2p("send", 0, 2, "waiting", START + 31)], READING[:2], stopped=True)
    assert diagnose(read_dumps(_written(tmp_path, receiver, stopped), 2, START), 2)["summary"] == (
        "rank 1 (node2, pid 4701) was stopped (SIGSTOP) inside send to rank 0 (pp, 8 KiB) of step 2 (micro-step 0, "
        "micro-batch 3): it is in gptpar/data/blocks.py:88 (read); rank 0 waited 10 s in recv from rank 1")
    running = _dump(1, {"pp:send:0": 2}, [_p2p("send", 0, 2, "waiting", START + 31)], READING[:2])
    (tmp_path / "both").mkdir()
    hang = diagnose(read_dumps(_written(tmp_path / "both", receiver, running), 2, START), 2)
    assert hang["stuck"] == [] and hang["summary"] == (
        "rank 0's recv from rank 1 (pp, 8 KiB) of step 2 (micro-step 0, micro-batch 3) and rank 1's matching send "
        "were both posted and neither finished; rank 0 waited 10 s in recv from rank 1")


STEP_2 = [_entry(3, "completed", START, START + 1, step=2), _entry(4, "completed", START + 1, START + 2, step=2,
                                                                     nbytes=8)]  # the gradient's, then the loss's


def test_a_rank_that_skipped_a_collective_is_named_ahead_from_its_ledger_where_it_left_no_dump(tmp_path):
    """Rank 1 skipped step 3's gradient all-reduce: its dp #5 is the loss's (8 B) while rank 0's is the gradient's; it
    died (gloo aborts on the mismatch) and left only its ledger. Step 2's order of calls says which is ahead."""
    mine = _dump(0, {"dp": 5}, [*STEP_2, _entry(5, "failed", START + 10, START + 10.4, step=3)], [])
    folder = _written(tmp_path, mine)
    ledger = [*STEP_2, _entry(5, "waiting", START + 10, step=3, nbytes=8)]
    folder.ledger_path(1).write_bytes(b"".join(ledger_line(n, e) for n, e in enumerate(ledger)))
    hang = diagnose(read_dumps(folder, 2, START), 2, read_ledgers(folder, 2, START))
    assert hang["summary"] == (
        "the ranks issued different collectives: rank 0 is in all_reduce(dp, 48 MiB) of step 3 (micro-step 0), #5 of "
        "dp; rank 1 (read from its ledger: it left no dump) in all_reduce(dp, 8 B) of step 3 (micro-step 0), #5 of dp; "
        "rank 1 is ahead: it skipped all_reduce(dp, 48 MiB) of step 3; rank 0 waited 0 s")
    assert (hang["mismatch"], hang["ahead"], hang["calls"]["1"]["bytes"]) == (True, 1, 8)


def test_ranks_each_in_a_collective_the_other_never_entered_are_a_mismatch_and_a_stopped_rank_is_not(tmp_path):
    """Rank 1 is in world #3, which rank 0 never entered, and never entered rank 0's dp #5: not a hang of rank 1 but
    calls in different orders. Stopped (SIGSTOP) in the same place, rank 1 is the hang's stuck rank as before."""
    waiting = _dump(0, {"dp": 5, "world": 2}, [*STEP_2, _entry(5, "failed", START + 10, START + 40, step=3)], [])
    other = _dump(1, {"dp": 4, "world": 3}, [*STEP_2, _entry(3, "failed", START + 11, START + 41, group="world",
                                                             step=4, nbytes=4)], READING)
    hang = diagnose(read_dumps(_written(tmp_path, waiting, other), 2, START), 2)
    assert hang["summary"].endswith("rank 1 in all_reduce(world, 4 B) of step 4 (micro-step 0), #3 of world; rank 1 "
                                    "is ahead; rank 0 waited 30 s")
    (tmp_path / "stopped").mkdir()
    stopped = _dump(1, other["seqs"], other["entries"], READING, stopped=True)
    hang = diagnose(read_dumps(_written(tmp_path / "stopped", waiting, stopped), 2, START), 2)
    assert "mismatch" not in hang and hang["stuck"][0]["rank"] == 1
