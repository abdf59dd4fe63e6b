"""Naming the rank that hung a job, from every rank's dump (gptpar.parallel.flight writes them).

A rank that waits inside a collective has an unfinished entry in its recorder (its dump's `blocked`): the `seq`-th
collective of its group.
Every rank of that group issues the group's collectives in one order, so a member whose count for the group is below
`seq` never entered it: that rank held the others up, and its dumped frames say where it was instead. A member that
left no dump (it did not answer in time) is named too, without a place. Torch-free: the final record's writer and the
status table read the same dict.
"""

from __future__ import annotations

import json
import time
from typing import Any

from gptpar.run.folder import RunFolder

DUMP_POLL_S = 0.1


def read_dumps(folder: RunFolder, world: int, since: float) -> dict[int, dict[str, Any]]:
    """The dumps of ranks 0..world-1 written at or after `since` (a dump from an earlier start is stale)."""
    dumps = {}
    for rank in range(world):
        try:
            dump = json.loads(folder.flight_path(rank).read_text())
        except (OSError, ValueError):
            continue
        if float(dump.get("time", 0.0)) >= since:
            dumps[rank] = dump
    return dumps


def collect_dumps(folder: RunFolder, world: int, since: float, wait_s: float) -> dict[int, dict[str, Any]]:
    """`read_dumps`, waiting up to `wait_s` for every rank's."""
    deadline = time.monotonic() + wait_s
    while len(dumps := read_dumps(folder, world, since)) < world and time.monotonic() < deadline:
        time.sleep(DUMP_POLL_S)
    return dumps


def _where(frames: list[list[Any]]) -> tuple[str, str]:
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
    where, function = _where(dump.get("frames", []))
    state = next((e["state"] for e in dump.get("entries", []) if (e["group"], e["seq"]) == (group, seq)), None)
    return {"rank": rank, "host": dump["host"], "pid": dump["pid"], "where": where, "function": function,
            "entered": entered, "state": state, "stopped": stopped}


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
    collective = f"{held['op']}({group}, {size_text(int(held['bytes']))}) of step {held['step']} " \
                 f"(micro-step {held['micro_step']})"
    lines = [_sentence(s, collective) for s in stuck] or \
        [f"every rank of {group} entered {collective}, #{seq} of its group, and none finished it"]
    summary = "; ".join(lines) + f"; {_ranks_text(waiting or [first])} waited {waited:.0f} s in it"
    return {"summary": summary, "collective": held["op"], "group": group, "bytes": int(held["bytes"]),
            "step": held["step"], "micro_step": held["micro_step"], "seq": seq, "waiting": waiting,
            "waited_s": round(waited, 3), "stuck": stuck}
