"""Find run folders and read their per-rank JSONL logs into stitched, de-duplicated records.

A requeued job appends a new segment (header first) to the same rank file and may re-log the
steps it re-ran after its last checkpoint; keeping the latest record per step number (and per
epoch number) is what makes every step count exactly once.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import yaml

from gptpar.logs import validate_record

RECENT_S = 600.0  # a run without a final record is "running" if it logged within this window
RANK_FILE = re.compile(r"rank(\d+)\.jsonl")
# The step fields the analysis reads; the hot path checks only these (RankLogger validated the rest).
STEP_FIELDS = operator.itemgetter("time", "step", "epoch", "loss", "tokens", "step_time_s", "tokens_per_s")
# Worst first: the run's status is the worst of its ranks' statuses.
STATUS_ORDER = ("corrupt", "failed", "running", "requeued", "completed")


class CorruptLog(Exception):
    """A record before the last line is unreadable; the message is `path:line: reason`."""


@dataclass
class RankLog:
    path: Path
    rank: int
    headers: list[dict[str, Any]] = field(default_factory=list)
    steps: dict[int, dict[str, Any]] = field(default_factory=dict)
    epochs: dict[int, dict[str, Any]] = field(default_factory=dict)
    evals: dict[int, dict[str, Any]] = field(default_factory=dict)
    final: dict[str, Any] | None = None  # the last segment's final record
    last_time: float = 0.0

    @property
    def header(self) -> dict[str, Any]:
        return self.headers[-1]


@dataclass
class RunLog:
    path: Path
    run_id: str
    sweep: str  # the folder between runs_dir and the run folder; "" for a top-level run
    config: dict[str, Any]
    ranks: list[RankLog]
    status: str  # one of STATUS_ORDER
    detail: str = ""  # why the run is not completed
    warnings: list[str] = field(default_factory=list)


def find_runs(runs_dir: str | Path) -> list[Path]:
    """Every folder holding rank*.jsonl, at any depth (sweeps nest runs one level deeper)."""
    return sorted({p.parent for p in Path(runs_dir).rglob("rank*.jsonl") if RANK_FILE.fullmatch(p.name)})


def _parse(path: Path, warnings: list[str]) -> tuple[list[Any], list[int] | None]:
    """Records of a file and their line numbers (None: record i is on line i+1).

    One orjson parse of the whole file is the fast path (JSON parsing is most of a report's time);
    only a file that fails it is parsed line by line, to skip a truncated last line or to name
    the corrupt one.
    """
    lines = path.read_bytes().splitlines()
    try:
        return orjson.loads(b"[" + b",".join(line for line in lines if line.strip()) + b"]"), None
    except orjson.JSONDecodeError:
        pass
    numbered = [(i + 1, line) for i, line in enumerate(lines) if line.strip()]
    records, numbers = [], []
    for k, (number, line) in enumerate(numbered):
        try:
            records.append(orjson.loads(line))
        except orjson.JSONDecodeError as exc:
            if k == len(numbered) - 1:
                warnings.append(f"{path}:{number}: skipped a truncated last line ({exc.msg})")
                break
            raise CorruptLog(f"{path}:{number}: not valid JSON ({exc.msg})") from None
        numbers.append(number)
    return records, numbers


def read_rank(path: Path, warnings: list[str]) -> RankLog:
    """Stitch a rank file's segments; later segments override earlier records of the same step."""
    log = RankLog(path=path, rank=int(RANK_FILE.fullmatch(path.name).group(1)))
    records, numbers = _parse(path, warnings)
    steps, epochs, evals, headers = log.steps, log.epochs, log.evals, log.headers
    for i, rec in enumerate(records):
        try:
            if type(rec) is not dict:
                raise ValueError(f"expected a JSON object, got {type(rec).__name__}")
            kind = rec.get("kind")
            if kind == "step" and headers:  # hot path: a cheap check of the fields used
                try:
                    steps[STEP_FIELDS(rec)[1]] = rec
                    continue
                except KeyError:
                    pass
            validate_record(rec)
            if kind == "header":
                headers.append(rec)
                log.final = None
            elif not headers:
                raise ValueError(f"{kind} record before the first header")
            elif kind == "step":
                steps[rec["step"]] = rec
            elif kind == "epoch":
                epochs[rec["epoch"]] = rec
            elif kind == "eval":
                evals[rec["step"]] = rec
            elif kind == "final":
                log.final = rec
        except (ValueError, TypeError) as exc:
            line = numbers[i] if numbers is not None else i + 1
            raise CorruptLog(f"{path}:{line}: {exc}") from None
    if records:
        log.last_time = float(records[-1]["time"])
    return log


def _rank_status(log: RankLog, now: float) -> tuple[str, str]:
    if not log.headers:
        return "failed", f"{log.path.name}: no records"
    if log.final is not None:
        status, step = log.final["status"], log.final["step"]
        return status, "" if status == "completed" else f"{log.path.name}: {status} at step {step}"
    age = now - log.last_time
    if age < RECENT_S:
        return "running", f"{log.path.name}: running (last record {age:.0f} s ago)"
    return "failed", f"{log.path.name}: died without a final record (last record {age / 60:.0f} min ago)"


def _config(run_dir: Path, ranks: list[RankLog]) -> dict[str, Any]:
    """The resolved config from the lowest rank's last header, else the run's config.yaml."""
    for log in ranks:
        if log.headers:
            return log.header["config"]
    saved = run_dir / "config.yaml"
    return (yaml.safe_load(saved.read_text()) or {}) if saved.is_file() else {}


def read_run(run_dir: Path, runs_dir: Path, now: float) -> RunLog:
    """Read one run; a corrupt file makes the whole run "corrupt" instead of failing the report."""
    rel = run_dir.relative_to(runs_dir)
    sweep = rel.parent.as_posix() if rel.parent != Path(".") else ""
    warnings: list[str] = []
    paths = sorted((p for p in run_dir.glob("rank*.jsonl") if RANK_FILE.fullmatch(p.name)),
                   key=lambda p: int(RANK_FILE.fullmatch(p.name).group(1)))
    try:
        ranks = [read_rank(p, warnings) for p in paths]
    except CorruptLog as exc:
        return RunLog(run_dir, run_dir.name, sweep, _config(run_dir, []), [], "corrupt", str(exc), warnings)
    statuses = [_rank_status(log, now) for log in ranks]
    status = min((s for s, _ in statuses), key=STATUS_ORDER.index)
    detail = "; ".join(d for s, d in statuses if s == status and d)
    live = [log for log in ranks if log.headers]
    if live:
        world = live[0].header["world_size"]
        if len(ranks) < world:
            warnings.append(f"{run_dir}: {len(ranks)} rank file(s) for world_size {world}")
    return RunLog(run_dir, run_dir.name, sweep, _config(run_dir, ranks), live, status, detail, warnings)
