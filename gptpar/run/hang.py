"""Naming the rank that hung a job, from every rank's dump (gptpar.parallel.flight writes them).

A rank that waits inside a collective has an unfinished entry in its recorder (its dump's `blocked`): the `seq`-th
collective of its group.
Every rank of that group issues the group's collectives in one order, so a member whose count for the group is below
`seq` never entered it: that rank held the others up, and its dumped frames say where it was instead. A member that
left no dump (it did not answer in time) is named too, without a place. A point-to-point call (a pipeline's send or
receive) is counted per `channel`: a rank's k-th send to a peer is that peer's k-th receive from it, so a peer whose
count of the matching receive is below k never posted it (`diagnose_p2p`). Ranks that each wait in a call the other
never entered issued different collectives (one skipped one, say): `diagnose_mismatch` names them and which is ahead,
reading a rank that died without a dump (gloo aborts on a mismatch) from its ledger, the recorder as it went
(gptpar.parallel.flight.Ledger). Torch-free: the final record's writer and the status table read the same dict.

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

from gptpar.parallel.flight_format import channel, read_ledger
from gptpar.run.folder import RunFolder

DUMP_POLL_S = 0.1
MATCHING = {"send": "recv", "recv": "send"}  # what the other end of a point-to-point call posts
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


def read_ledgers(folder: RunFolder, world: int, since: float) -> dict[int, list[dict[str, Any]]]:
    """Each rank's ledger entries entered at or after `since` (this start's), for the ranks that have any."""
    ledgers = {}
    for rank in range(world):
        if entries := [e for e in read_ledger(folder.ledger_path(rank)) if e["start"] >= since]:
            ledgers[rank] = entries
    return ledgers


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
    where, function = innermost(dump.get("frames", []))
    state = next((e["state"] for e in dump.get("entries", []) if (_key(e), e["seq"]) == (key, seq)), None)
    return {"rank": rank, "host": dump["host"], "pid": dump["pid"], "where": where, "function": function,
            "entered": entered, "state": state, "stopped": stopped}


def collective_text(entry: Mapping[str, Any]) -> str:
    """A recorder's entry as the diagnosis names it: all_reduce(dp, 48 MiB) of step 120 (micro-step 0), or a
    point-to-point call with its peer and micro-batch."""
    if "peer" in entry:
        return _p2p_long(entry)
    return f"{entry['op']}({entry['group']}, {size_text(int(entry['bytes']))}) of step {entry['step']} " \
           f"(micro-step {entry['micro_step']})"


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


def diagnose(dumps: dict[int, dict[str, Any]], world: int,
             ledgers: dict[int, list[dict[str, Any]]] | None = None) -> dict[str, Any] | None:
    """The `hang` field of a final record: the collective the waiting ranks were blocked in, the ranks of its group
    that held it up (never entered it, were stopped, or left no dump) and where each was, and a one-paragraph
    `summary`; None when no dumped rank was inside a collective. `ledgers`: the entries of ranks, for those that left
    no dump (read_ledgers)."""
    blocked = {rank: dump["blocked"] for rank, dump in dumps.items() if dump.get("blocked")}
    running = [rank for rank in blocked if not dumps[rank].get("stopped")] or list(blocked)
    if not running:
        return None
    first = min(running, key=lambda rank: (blocked[rank]["start"], rank))
    held = blocked[first]
    if "peer" in held:
        return diagnose_p2p(dumps, first)
    if mismatch := diagnose_mismatch(dumps, ledgers or {}, first, world):
        return mismatch
    group, seq = held["group"], held["seq"]
    members = dumps[first].get("groups", {}).get(group, list(range(world)))
    stuck = [s for rank in members if (s := _held_up_by(rank, dumps.get(rank), group, seq)) is not None]
    waiting = sorted(set(r for r in running if (_key(blocked[r]), blocked[r]["seq"]) == (group, seq))
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


def _behind(rank: int, live: dict[str, Any] | None, key: str, seq: int, now: float, waiting: bool) -> str | None:
    """What a member of the group waited in says for itself, if it may hold the call up: it never entered it (the
    `seq`-th of count `key`), or stopped rewriting its live state (stopped or frozen, `waiting` in it or not), or wrote
    none; None otherwise."""
    if live is None:
        return f"rank {rank} wrote no live state"
    entered, age = int(live.get("seqs", {}).get(key, 0)) >= seq, now - float(live["time"])
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
                     if live.get("blocked") and (_key(live["blocked"]), live["blocked"]["seq"]) == (_key(held), seq))
    if "peer" in held:  # a send or receive: its peer should have posted the matching call, counted on its channel
        key, members = _key(_matching(held, first)), [held["peer"]]
    else:
        key, members = group, lives[first].get("groups", {}).get(group, list(range(world)))
    behind = [text for rank in members if (text := _behind(rank, lives.get(rank), key, seq, now, rank in waiting))]
    waited = now - float(held["start"])
    summary = "; ".join([f"{_ranks_text(waiting)} waited {waited:.0f} s in {collective_text(held)}", *behind])
    return {"summary": summary, "collective": held["op"], "group": group, "bytes": int(held["bytes"]),
            "step": held["step"], "micro_step": held["micro_step"], "seq": seq, "waiting": waiting,
            "waited_s": round(waited, 3)}


def _matching(entry: dict[str, Any], rank: int) -> dict[str, Any]:
    """The call `rank`'s send or receive `entry` waits for its peer to post: the matching receive or send, to `rank`."""
    return {**entry, "op": MATCHING[entry["op"]], "peer": rank}


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
    mirrored = _matching(held, waiter)
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


def _signature(entry: dict[str, Any]) -> tuple[Any, ...]:
    """What a call is, whichever rank issued it and whenever: the same calls of two steps have one signature."""
    return entry["op"], entry["group"], int(entry["bytes"]), entry.get("peer")


def _current(rank: int, dumps: dict[int, dict[str, Any]], ledgers: dict[int, list[dict[str, Any]]]
             ) -> tuple[dict[str, int], dict[str, Any], list[dict[str, Any]]] | None:
    """(counts per key, the call it is in, its entries) of a rank that was not stopped: from its dump, or where it left
    none from its ledger (its last entry: where it died); None when neither says it was in a call."""
    dump = dumps.get(rank)
    if dump is not None:
        if dump.get("stopped") or not dump.get("blocked"):
            return None
        return dump.get("seqs", {}), dump["blocked"], dump.get("entries", [])
    entries = ledgers.get(rank)
    if not entries:
        return None
    seqs: dict[str, int] = {}
    for entry in entries:
        seqs[_key(entry)] = max(seqs.get(_key(entry), 0), entry["seq"])
    return seqs, entries[-1], entries


def _position(call: dict[str, Any], entries: list[dict[str, Any]], pattern: list[tuple[Any, ...]]) -> int | None:
    """Where `call` stands in its step's order of calls (`pattern`, an earlier step's): the first place at or after as
    many calls as the rank made in this step before it where the pattern has its signature."""
    at = next((i for i, e in enumerate(entries) if (_key(e), e["seq"]) == (_key(call), call["seq"])), len(entries))
    before = sum(1 for e in entries[:at] if e["step"] == call["step"])
    return next((j for j in range(before, len(pattern)) if pattern[j] == _signature(call)), None)


def _ahead(waiter: tuple[int, dict[str, Any], list[dict[str, Any]]], other: tuple[int, dict[str, Any],
           list[dict[str, Any]]], pattern: list[tuple[Any, ...]]) -> tuple[int | None, list[tuple[Any, ...]]]:
    """Which of two ranks in mismatched calls is ahead (None: cannot tell), and the calls it passed over that the
    other is in: by step, else by place in the step's order of calls (`pattern`)."""
    (rank_a, call_a, entries_a), (rank_b, call_b, entries_b) = waiter, other
    if call_a["step"] != call_b["step"]:
        return (rank_a if call_a["step"] > call_b["step"] else rank_b), []
    at_a, at_b = _position(call_a, entries_a, pattern), _position(call_b, entries_b, pattern)
    if at_a is None or at_b is None or at_a == at_b:
        return None, []
    return (rank_a, pattern[at_b:at_a]) if at_a > at_b else (rank_b, pattern[at_a:at_b])


def diagnose_mismatch(dumps: dict[int, dict[str, Any]], ledgers: dict[int, list[dict[str, Any]]], waiter: int,
                      world: int) -> dict[str, Any] | None:
    """`diagnose` where the ranks issued different collectives: a member of the waiter's group (not stopped) entered
    the waiter's call under its number as another call (op, size or step differ), or never entered it while in a call
    the waiter never entered. Names both calls and which rank is ahead, by the order of calls an earlier step of the
    waiter's shows; None when no member is so."""
    dump = dumps[waiter]
    held = dump["blocked"]
    key, seq = _key(held), held["seq"]
    for rank in dump.get("groups", {}).get(held["group"], list(range(world))):
        other = _current(rank, dumps, ledgers) if rank != waiter else None
        if other is None:
            continue
        seqs, call, entries = other
        same = next((e for e in entries if (_key(e), e["seq"]) == (key, seq)), None)
        if same is not None and (_signature(same), same["step"]) != (_signature(held), held["step"]):
            return _mismatch(dump, rank, same, entries, rank in dumps)
        if int(seqs.get(key, 0)) < seq and int(dump.get("seqs", {}).get(_key(call), 0)) < call["seq"]:
            return _mismatch(dump, rank, call, entries, rank in dumps)
    return None


def _numbered(entry: dict[str, Any]) -> str:
    return f"{collective_text(entry)}, #{entry['seq']} of {_key(entry)}"


def _mismatch(dump: dict[str, Any], rank: int, call: dict[str, Any], entries: list[dict[str, Any]], dumped: bool
              ) -> dict[str, Any]:
    """The `hang` field of `diagnose_mismatch`: the waiter (`dump`) and `rank` are in calls that do not match."""
    waiter, held = dump["rank"], dump["blocked"]
    pattern = [_signature(e) for e in dump.get("entries", []) if e["step"] == held["step"] - 1]
    ahead, passed = _ahead((waiter, held, dump.get("entries", [])), (rank, call, entries), pattern)
    source = "" if dumped else " (read from its ledger: it left no dump)"
    lines = [f"the ranks issued different collectives: rank {waiter} is in {_numbered(held)}; rank {rank}{source} in "
             f"{_numbered(call)}"]
    if ahead is not None:
        skipped = ", ".join(f"{op}({group}, {size_text(nbytes)})" for op, group, nbytes, _ in passed)
        lines.append(f"rank {ahead} is ahead" + (f": it skipped {skipped} of step {held['step']}" if skipped else ""))
    waited = (held["end"] or dump["time"]) - held["start"]
    fields = ("op", "group", "bytes", "step", "micro_step", "seq")
    return {"summary": "; ".join(lines) + f"; rank {waiter} waited {waited:.0f} s", "mismatch": True,
            "collective": held["op"], "group": held["group"], "bytes": int(held["bytes"]), "step": held["step"],
            "micro_step": held["micro_step"], "seq": held["seq"], "waiting": [waiter], "waited_s": round(waited, 3),
            "stuck": [], "ahead": ahead, "calls": {str(r): {k: c[k] for k in fields}
                                                   for r, c in ((waiter, held), (rank, call))}}
