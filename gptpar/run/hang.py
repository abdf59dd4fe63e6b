"""Naming the rank that hung a job, from every rank's dump (gptpar.parallel.flight writes them).

A rank that waits inside a collective has an unfinished entry in its recorder (its dump's `blocked`): the `seq`-th
collective of its group.
Every rank of that group issues the group's collectives in one order, so a member whose count for the group is below
`seq` never entered it: that rank held the others up, and its dumped frames say where it was instead. A member that
left no dump (it did not answer in time) is named too, without a place. Torch-free: the final record's writer and the
status table read the same dict.

While the ranks still wait, each one's live state (job/rank<R>.live.json, rewritten every second by a thread of the
rank: gptpar.parallel.flight.live_state) says which collective it is in and since when: `stuck` names the collective
the ranks have waited in longer than parallel.stuck_after_s, and the ranks of its group that never entered it or stopped
rewriting their state (a rank stopped or frozen), before parallel.timeout_s fails the job.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from gptpar.run.folder import RunFolder

DUMP_POLL_S = 0.1
LIVE_STALE_S = 3.0  # a live state not rewritten for this long (3 of its rank's seconds) says its rank does not run


def _read_states(path: Callable[[int], Path], since: Mapping[int, float]) -> dict[int, dict[str, Any]]:
    """The files `path(rank)` of the ranks in `since` written at or after each one's time there (one from an earlier
    start is stale)."""
    states = {}
    for rank, start in since.items():
        try:
            state = json.loads(path(rank).read_text())
        except (OSError, ValueError):
            continue
        if float(state.get("time", 0.0)) >= start:
            states[rank] = state
    return states


def read_dumps(folder: RunFolder, world: int, since: float) -> dict[int, dict[str, Any]]:
    """The dumps of ranks 0..world-1 written at or after `since` (a dump from an earlier start is stale)."""
    return _read_states(folder.flight_path, dict.fromkeys(range(world), since))


def read_lives(folder: RunFolder, since: Mapping[int, float]) -> dict[int, dict[str, Any]]:
    """The live states of the ranks in `since` written at or after each one's time there (its segment's start)."""
    return _read_states(folder.live_path, since)


def collect_dumps(folder: RunFolder, world: int, since: float, wait_s: float) -> dict[int, dict[str, Any]]:
    """`read_dumps`, waiting up to `wait_s` for every rank's."""
    deadline = time.monotonic() + wait_s
    while len(dumps := read_dumps(folder, world, since)) < world and time.monotonic() < deadline:
        time.sleep(DUMP_POLL_S)
    return dumps


def innermost(frames: list[list[Any]]) -> tuple[str, str]:
    """(file:line, function) of the innermost frame of gptpar's own code, else of the innermost frame."""
    ours = [f for f in frames if str(f[0]).startswith("gptpar/")] or frames
    return (f"{ours[-1][0]}:{ours[-1][1]}", str(ours[-1][2])) if ours else ("unknown", "")


def size_text(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes} B"


def _ranks_text(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _held_up_by(rank: int, dump: dict[str, Any] | None, group: str, seq: int) -> dict[str, Any] | None:
    """The `stuck` entry of a member of the group waited in, if it held the collective up: it left no dump, never
    entered the collective, or had been stopped (SIGSTOP) until the dump signal; None otherwise."""
    if dump is None:
        return {"rank": rank, "host": None, "pid": None, "where": None, "function": None, "entered": False,
                "state": None, "stopped": None}
    entered, stopped = int(dump.get("seqs", {}).get(group, 0)) >= seq, bool(dump.get("stopped"))
    if entered and not stopped:
        return None
    where, function = innermost(dump.get("frames", []))
    state = next((e["state"] for e in dump.get("entries", []) if (e["group"], e["seq"]) == (group, seq)), None)
    return {"rank": rank, "host": dump["host"], "pid": dump["pid"], "where": where, "function": function,
            "entered": entered, "state": state, "stopped": stopped}


def collective_text(entry: Mapping[str, Any]) -> str:
    """A recorder's entry as the diagnosis names it: all_reduce(dp, 48 MiB) of step 120 (micro-step 0)."""
    return f"{entry['op']}({entry['group']}, {size_text(int(entry['bytes']))}) of step {entry['step']} " \
           f"(micro-step {entry['micro_step']})"


def _sentence(stuck: dict[str, Any], collective: str) -> str:
    rank = f"rank {stuck['rank']}"
    if stuck["where"] is None:
        return f"{rank} left no dump (it did not answer) and held up {collective}"
    who = f"{rank} ({stuck['host']}, pid {stuck['pid']})"
    did = f"never entered {collective}" if not stuck["entered"] else \
        f"issued {collective} and was stopped (SIGSTOP) before waiting for it" if stuck["state"] == "issued" else \
        f"was stopped (SIGSTOP) inside {collective}"
    was = "it was stopped in" if stuck["stopped"] and not stuck["entered"] else "it is in"
    return f"{who} {did}: {was} {stuck['where']} ({stuck['function']})"


def diagnose(dumps: dict[int, dict[str, Any]], world: int) -> dict[str, Any] | None:
    """The `hang` field of a final record: the collective the waiting ranks were blocked in, the ranks of its group
    that held it up (never entered it, were stopped, or left no dump) and where each was, and a one-paragraph
    `summary`; None when no dumped rank was inside a collective."""
    blocked = {rank: dump["blocked"] for rank, dump in dumps.items() if dump.get("blocked")}
    running = [rank for rank in blocked if not dumps[rank].get("stopped")] or list(blocked)
    if not running:
        return None
    first = min(running, key=lambda rank: (blocked[rank]["start"], rank))
    held = blocked[first]
    group, seq = held["group"], held["seq"]
    members = dumps[first].get("groups", {}).get(group, list(range(world)))
    stuck = [s for rank in members if (s := _held_up_by(rank, dumps.get(rank), group, seq)) is not None]
    waiting = sorted(set(r for r in running if (blocked[r]["group"], blocked[r]["seq"]) == (group, seq))
                     - {s["rank"] for s in stuck})
    waited = max((blocked[r]["end"] or dumps[r]["time"]) - blocked[r]["start"] for r in waiting or [first])
    collective = collective_text(held)
    lines = [_sentence(s, collective) for s in stuck] or \
        [f"every rank of {group} entered {collective}, #{seq} of its group, and none finished it"]
    summary = "; ".join(lines) + f"; {_ranks_text(waiting or [first])} waited {waited:.0f} s in it"
    return {"summary": summary, "collective": held["op"], "group": group, "bytes": int(held["bytes"]),
            "step": held["step"], "micro_step": held["micro_step"], "seq": seq, "waiting": waiting,
            "waited_s": round(waited, 3), "stuck": stuck}


def stuck_after(parallel: Mapping[str, Any]) -> float:
    """parallel.stuck_after_s as a config (a run's header's) sets it: 0 is half of parallel.timeout_s."""
    return float(parallel.get("stuck_after_s") or 0.0) or float(parallel.get("timeout_s", 120.0)) / 2


def _behind(rank: int, live: dict[str, Any] | None, group: str, seq: int, now: float, waiting: bool) -> str | None:
    """What a member of the group waited in says for itself, if it may hold the collective up: it never entered it,
    or stopped rewriting its live state (stopped or frozen, `waiting` in it or not), or wrote none; None otherwise."""
    if live is None:
        return f"rank {rank} wrote no live state"
    entered, age = int(live.get("seqs", {}).get(group, 0)) >= seq, now - float(live["time"])
    where = f"rank {rank} ({live['host']}, pid {live['pid']})"
    silent = f"has not answered for {age:.0f} s" if age > LIVE_STALE_S else ""
    if not entered:
        return f"{where} never entered it (last seen at step {live['step']})" + (f" and {silent}" if silent else "")
    return f"{where} {'is in' if waiting else 'entered'} it and {silent}" if silent else None


def stuck(lives: dict[int, dict[str, Any]], world: int, now: float, after_s: float) -> dict[str, Any] | None:
    """The collective the ranks have waited in for longer than `after_s` by their live states (the longest waited; by
    a rank that still answers: a stale state's collective may be long done), the ranks waiting in it, how long, and
    `summary`, what `gptpar status` shows: who of its group held it up; None while no rank has waited that long."""
    waits = {rank: live["blocked"] for rank, live in lives.items() if live.get("blocked")
             and now - float(live["blocked"]["start"]) > after_s and now - float(live["time"]) <= LIVE_STALE_S}
    if not waits:
        return None
    first = min(waits, key=lambda rank: (waits[rank]["start"], rank))
    held = waits[first]
    group, seq = held["group"], held["seq"]
    waiting = sorted(rank for rank, live in lives.items()
                     if live.get("blocked") and (live["blocked"]["group"], live["blocked"]["seq"]) == (group, seq))
    members = lives[first].get("groups", {}).get(group, list(range(world)))
    behind = [text for rank in members if (text := _behind(rank, lives.get(rank), group, seq, now, rank in waiting))]
    waited = now - float(held["start"])
    summary = "; ".join([f"{_ranks_text(waiting)} waited {waited:.0f} s in {collective_text(held)}", *behind])
    return {"summary": summary, "collective": held["op"], "group": group, "bytes": int(held["bytes"]),
            "step": held["step"], "micro_step": held["micro_step"], "seq": seq, "waiting": waiting,
            "waited_s": round(waited, 3)}
