"""The format of what the flight recorder (gptpar.parallel.flight) writes, importable without torch: the count key
of a point-to-point channel and the ledger's lines, which gptpar.run.hang reads back (where torch may be absent: the
status table)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

LEDGER_LINE = 128  # bytes of one entry in a rank's ledger, the newline included
LEDGER_FIELDS = ("n", "seq", "op", "group", "bytes", "step", "micro_step", "peer", "micro_batch", "start")
NO_PEER = -1  # a collective's `peer` in the ledger


def channel(group: str, op: str, peer: int) -> str:
    """The recorder's count key of point-to-point `op`s over `group` with global rank `peer` (e.g. pp:send:1)."""
    return f"{group}:{op}:{peer}"


def ledger_line(n: int, entry: dict[str, Any]) -> bytes:
    """The `n`-th recorder entry as a ledger line: LEDGER_FIELDS separated by spaces, padded to LEDGER_LINE."""
    text = f"{n} {entry['seq']} {entry['op']} {entry['group']} {entry['bytes']} {entry['step']} " \
           f"{entry['micro_step']} {entry.get('peer', NO_PEER)} {entry.get('micro_batch', 0)} {entry['start']:.3f}"
    return text[:LEDGER_LINE - 1].ljust(LEDGER_LINE - 1).encode() + b"\n"


def read_ledger(path: Path) -> list[dict[str, Any]]:
    """A ledger's entries, oldest first, as the recorder held them (state "entered": the ledger does not say more)."""
    try:
        lines = path.read_bytes().split(b"\n")
    except OSError:
        return []
    entries = []
    for line in lines:
        fields = line.decode(errors="replace").split()
        if len(fields) != len(LEDGER_FIELDS):
            continue  # a slot never written (zeros), or torn
        entry: dict[str, Any] = dict(zip(LEDGER_FIELDS, fields, strict=True))
        for name in ("n", "seq", "bytes", "step", "micro_step", "peer", "micro_batch"):
            entry[name] = int(entry[name])
        entry.update(start=float(entry["start"]), end=None, state="entered")
        if entry["peer"] == NO_PEER:
            del entry["peer"], entry["micro_batch"]
        entries.append(entry)
    return sorted(entries, key=lambda e: e["n"])
