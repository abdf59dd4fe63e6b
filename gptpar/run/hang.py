"""Naming the rank that hung a job, from every rank's dump (gptpar.parallel.flight writes them).

A rank that waits inside a collective has an unfinished entry in its recorder (its dump's `blocked`): the `seq`-th
collective of its group.
Every rank of that group issues the group's collectives in one order, so a member whose count for the group is below
`seq` never entered it: that rank held the others up, and its dumped frames say where it was instead. A member that
left no dump (it did not answer in time) is named too, without a place. A point-to-point call (a pipeline's send or
receive) is counted per `channel`: a rank's k-th send to a peer is that peer's k-th receive from it, so a peer whose
count of the matching receive is below k never posted it (`diagnose_p2p`). Torch-free: the final record's writer and
the status table read the same dict.
"""

from __future__ import annotations

import json
import time
from typing import Any

from gptpar.run.folder import RunFolder

DUMP_POLL_S = 0.1
MATCHING = {"send": "recv", "recv": "send"}  # what the other end of a point-to-point call posts


def channel(group: str, op: str, peer: int) -> str:
    """The recorder's count key of point-to-point `op`s over `group` with global rank `peer` (e.g. pp:send:1)."""
    return f"{group}:{op}:{peer}"


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


def _key(entry: dict[str, Any]) -> str:
    """The recorder's count key of an entry: its group, or a point-to-point call's `channel`."""
    return channel(entry["group"], entry["op"], entry["peer"]) if "peer" in entry else entry["group"]


def _held_up_by(rank: int, dump: dict[str, Any] | None, key: str, seq: int) -> dict[str, Any] | None:
    """The `stuck` entry of a member of the group waited in, if it held the collective up: it left no dump, never
    entered the collective (the `seq`-th of count `key`), or had been stopped (SIGSTOP) until the dump signal; None
    otherwise."""
    if dump is None:
        return {"rank": rank, "host": None, "pid": None, "where": None, "function": None, "entered": False,
                "state": None, "stopped": None}
    entered, stopped = int(dump.get("seqs", {}).get(key, 0)) >= seq, bool(dump.get("stopped"))
    if entered and not stopped:
        return None
    where, function = _where(dump.get("frames", []))
    state = next((e["state"] for e in dump.get("entries", []) if (_key(e), e["seq"]) == (key, seq)), None)
    return {"rank": rank, "host": dump["host"], "pid": dump["pid"], "where": where, "function": function,
            "entered": entered, "state": state, "stopped": stopped}


def _sentence(stuck: dict[str, Any], collective: str, entered: str = "entered") -> str:
    rank = f"rank {stuck['rank']}"
    if stuck["where"] is None:
        return f"{rank} left no dump (it did not answer) and held up {collective}"
    who = f"{rank} ({stuck['host']}, pid {stuck['pid']})"
    did = f"never {entered} {collective}" if not stuck["entered"] else \
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
    if "peer" in held:
        return diagnose_p2p(dumps, first)
    group, seq = held["group"], held["seq"]
    members = dumps[first].get("groups", {}).get(group, list(range(world)))
    stuck = [s for rank in members if (s := _held_up_by(rank, dumps.get(rank), group, seq)) is not None]
    waiting = sorted(set(r for r in running if (_key(blocked[r]), blocked[r]["seq"]) == (group, seq))
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


def _p2p_text(entry: dict[str, Any]) -> str:
    """A point-to-point call as a sentence names it: `send to rank 1` (short) or with its group, size and step."""
    return f"{entry['op']} {'to' if entry['op'] == 'send' else 'from'} rank {entry['peer']}"


def _p2p_long(entry: dict[str, Any]) -> str:
    return f"{_p2p_text(entry)} ({entry['group']}, {size_text(int(entry['bytes']))}) of step {entry['step']} " \
           f"(micro-step {entry['micro_step']}, micro-batch {entry['micro_batch']})"


def diagnose_p2p(dumps: dict[int, dict[str, Any]], waiter: int) -> dict[str, Any]:
    """`diagnose` where the rank held up first waits in a send or receive: its peer held it up if it never posted the
    matching receive or send (its count on the mirrored channel is below this call's), was stopped, or left no dump.
    The `hang` field adds the `peer`."""
    held = dumps[waiter]["blocked"]
    mirrored = {**held, "op": MATCHING[held["op"]], "peer": waiter}  # the call the peer should have posted
    peer, seq = held["peer"], held["seq"]
    stuck = _held_up_by(peer, dumps.get(peer), _key(mirrored), seq)
    waited = (held["end"] or dumps[waiter]["time"]) - held["start"]
    line = _sentence(stuck, _p2p_long(mirrored), entered="posted") if stuck else \
        f"rank {waiter}'s {_p2p_long(held)} and rank {peer}'s matching {MATCHING[held['op']]} were both posted and " \
        "neither finished"
    return {"summary": f"{line}; rank {waiter} waited {waited:.0f} s in {_p2p_text(held)}", "collective": held["op"],
            "group": held["group"], "peer": peer, "bytes": int(held["bytes"]), "step": held["step"],
            "micro_step": held["micro_step"], "micro_batch": held["micro_batch"], "seq": seq, "waiting": [waiter],
            "waited_s": round(waited, 3), "stuck": [stuck] if stuck else []}
