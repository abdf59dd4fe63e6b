"""The per-rank JSONL log: its one writer and its one reader (its records are defined in gptpar.run.records).

One file per rank per run, appended and fsync-ed record by record: a killed job keeps every record
it wrote. A restarted job appends a new segment (a header first) to the same file; the reader
stitches segments, the latest record of a step winning, so every step counts exactly once.

Every line is valid JSON: a non-finite number (a diverged loss) is written as the string "NaN",
"Infinity" or "-Infinity" and read back as that float.

Schema versions: 1 (first release); 2 adds `coords`/`sizes` for every grid dimension (dp, pp, tp),
`stage_devices` and `config_digest` in the header, `global_loss` in step records, and non-finite
numbers as strings. Version 1 logs stay readable; a log of a newer version than SCHEMA_VERSION is not read at all
(its records may mean what this reader cannot know): CorruptLog names the version and the upgrade.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import operator
import os
import re
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Protocol

import orjson

from gptpar.atomic import atomic_write, write_error
from gptpar.run.records import EVAL_SCORES, LINE_SCORES, RECORDS, Record, StepRecord, names, validate_record

SCHEMA_VERSION = 2

NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
# Numeric fields that may hold a non-finite value (written as one of NON_FINITE's strings).
MAY_DIVERGE = tuple(dict.fromkeys(f.name for cls in RECORDS.values() for f in fields(cls)
                                  if f.metadata["may_diverge"]))
RANK_GLOB, RANK_FILE = "rank*.jsonl", re.compile(r"rank(\d+)\.jsonl")
TORN_SUFFIX = ".torn"  # rank<R>.jsonl.torn: torn last lines a resumed writer set aside (RankLogger)
RANK_ENTRY = re.compile(RANK_FILE.pattern + f"(?:{re.escape(TORN_SUFFIX)})?")  # a rank log or its torn lines
# The step fields the analysis reads; the hot path checks only these (the writer validated the rest).
STEP_FIELDS = operator.itemgetter(*names(StepRecord, "time", "step", "epoch", "loss", "tokens", "step_time_s",
                                         "tokens_per_s"))


def rank_log_path(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / f"rank{rank}.jsonl"


def rank_of(path: Path) -> int | None:
    match = RANK_FILE.fullmatch(path.name)
    return int(match.group(1)) if match else None


def _finite_or_text(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: _finite_or_text(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_text(v) for v in value]
    return value


def encode(record: dict[str, Any]) -> bytes:
    """One log line. orjson would write NaN as null, losing the number, so floats are checked first."""
    return orjson.dumps(_finite_or_text(record), default=str) + b"\n"


class Mirror(Protocol):
    """Where a copy of each record goes (TensorBoard, W&B); it must not raise."""

    def write(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class RankLogger:
    """Appends validated records to `rank<R>.jsonl`, flushing and fsync-ing each one.

    A record that cannot be written (a full disk) is cut back out of the file, so no partial line is
    left for later records to follow, and raises a one-line GptparError naming the file. A torn last line that
    a killed writer left is set aside first (`torn` says so), so that the next record starts a line of its own.
    A mirror (gptpar.run.sinks) gets each record once it is on disk and is closed with the log."""

    def __init__(self, run_dir: str | Path, rank: int):
        self.path = rank_log_path(run_dir, rank)
        self.mirror: Mirror | None = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.torn = set_aside_torn_line(self.path)
            self._file = open(self.path, "ab", buffering=0)  # unbuffered: each record is one os.write
        except OSError as exc:
            raise write_error(self.path, exc) from exc

    def write(self, record: Record) -> dict[str, Any]:
        """Append a typed record; returns it as written."""
        return self._append(record.fields())

    def log(self, kind: str, **fields: Any) -> dict[str, Any]:
        """Append a record from loose fields (a test's or a tool's partial or legacy record); `time` defaults to now."""
        return self._append({"kind": kind, "time": time.time(), **fields})

    def _append(self, record: dict[str, Any]) -> dict[str, Any]:
        validate_record(record)
        data = encode(record)
        fd = self._file.fileno()
        start = os.lseek(fd, 0, os.SEEK_END)
        try:
            written = 0
            while written < len(data):  # a write that reaches the disk's end is short, the next one fails
                written += os.write(fd, data[written:])
            os.fsync(fd)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, start)
            raise write_error(self.path, exc, "the log keeps every record before this one") from exc
        if self.mirror is not None:
            self.mirror.write(record)
        return record

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
        if self.mirror is not None:
            self.mirror.close()


def set_aside_torn_line(path: Path) -> str:
    """Move the bytes after the last newline of a log (a line a killed writer tore) to the end of `path`.torn, then
    cut them from the log: a record appended after them would be glued onto them, and the reader would find the whole
    run corrupt. Nothing is lost. Returns the one line that says so, or "" for a whole log (or none yet)."""
    try:
        log = open(path, "r+b", buffering=0)
    except FileNotFoundError:
        return ""
    with log:
        fd = log.fileno()
        end = os.lseek(fd, 0, os.SEEK_END)
        start = _after_last_newline(fd, end)
        if start == end:
            return ""
        torn = path.with_name(path.name + TORN_SUFFIX)
        with open(torn, "ab") as aside:
            aside.write(os.pread(fd, end - start, start) + b"\n")
            aside.flush()
            os.fsync(aside.fileno())
        os.ftruncate(fd, start)
        os.fsync(fd)
    return (f"gptpar: {path} ended in a torn line ({end - start} bytes, what a killed writer leaves); set it aside "
            f"in {torn.name} and resumed the log after its last whole record")


def _after_last_newline(fd: int, end: int) -> int:
    """The offset just past the last newline before `end` (0 when there is none), read backwards in chunks."""
    pos = end
    while pos > 0:
        size = min(pos, 1 << 16)
        chunk = os.pread(fd, size, pos - size)
        if (i := chunk.rfind(b"\n")) >= 0:
            return pos - size + i + 1
        pos -= size
    return 0


class CorruptLog(Exception):
    """A record before the last line is unreadable; the message is `path:line: reason`."""


def _not_json(path: Path, line: int, exc: orjson.JSONDecodeError) -> CorruptLog:
    return CorruptLog(f"{path}:{line}: not valid JSON ({exc.msg})")


@dataclass
class RankLog:
    """One rank's stitched records: the latest record per step (and per epoch, per evaluation)."""

    path: Path
    rank: int
    headers: list[dict[str, Any]] = field(default_factory=list)
    steps: dict[int, dict[str, Any]] = field(default_factory=dict)
    epochs: dict[int, dict[str, Any]] = field(default_factory=dict)
    evals: dict[int, dict[str, Any]] = field(default_factory=dict)
    final: dict[str, Any] | None = None  # the last segment's final record
    memory: dict[str, Any] | None = None  # the latest `memory` record (training state bytes)
    last_time: float = 0.0
    records: int = 0

    @property
    def header(self) -> dict[str, Any]:
        return self.headers[-1]


def _parse(path: Path, warnings: list[str]) -> tuple[list[Any], list[int] | None]:
    """Records of a file and their line numbers (None: record i is on line i+1).

    One orjson parse of the whole file is the fast path (JSON parsing is most of a report's time);
    only a file that fails it is parsed line by line, to skip a truncated last line or to name
    the corrupt one.
    """
    try:
        lines = path.read_bytes().splitlines()
    except IsADirectoryError:
        raise CorruptLog(f"{path}: is a folder, not a log file") from None
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
            raise _not_json(path, number, exc) from None
        numbers.append(number)
    return records, numbers


def _restore_numbers(record: dict[str, Any]) -> None:
    for key in MAY_DIVERGE:
        value = record.get(key)
        if type(value) is str and value in NON_FINITE:
            record[key] = NON_FINITE[value]


def read_rank_log(path: Path, warnings: list[str] | None = None) -> RankLog:
    """Stitch a rank file's segments; later segments override earlier records of the same step."""
    warnings = [] if warnings is None else warnings
    log = RankLog(path=path, rank=rank_of(path) or 0)
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
                    if str in (type(rec["loss"]), type(rec.get("global_loss")), type(rec.get("grad_norm"))):
                        _restore_numbers(rec)
                    continue
                except KeyError:
                    pass
            if kind == "header":
                _check_version(rec)
            validate_record(rec)
            _restore_numbers(rec)
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
            elif kind == "memory":
                log.memory = rec
        except (ValueError, TypeError) as exc:
            line = numbers[i] if numbers is not None else i + 1
            raise CorruptLog(f"{path}:{line}: {exc}") from None
    if records:
        log.last_time = float(records[-1]["time"])
    log.records = len(records)
    return log


def _check_version(header: dict[str, Any]) -> None:
    version = header.get("schema_version")
    if isinstance(version, int) and version > SCHEMA_VERSION:
        raise ValueError(f"schema_version {version} is newer than this gptpar reads (up to {SCHEMA_VERSION}); "
                         "upgrade gptpar (git pull, then make install) to read this run")


def segments(path: Path) -> int:
    """Segments (headers) already in a rank's log: a restarted run numbers its next one with this."""
    return len(read_rank_log(path).headers) if path.is_file() else 0


def read_new_records(path: Path, offset: int) -> tuple[list[dict[str, Any]], int]:
    """The records on the complete lines of `path` after byte `offset`, and the offset after them; a line still
    being written is left for the next call (following a live log). An unreadable line is a CorruptLog naming its
    line number, as read_rank_log names it."""
    try:
        with open(path, "rb") as file:
            file.seek(offset)
            data = file.read()
    except FileNotFoundError:
        return [], offset
    end = data.rfind(b"\n") + 1
    lines = data[:end].split(b"\n")
    records = []
    for i, line in enumerate(lines):
        if line.strip():
            try:
                records.append(orjson.loads(line))
            except orjson.JSONDecodeError as exc:
                with open(path, "rb") as file:  # only now: the lines before `offset`, to number this one
                    before = file.read(offset).count(b"\n")
                raise _not_json(path, before + i + 1, exc) from None
            _restore_numbers(records[-1])
    return records, offset + end


def _number(value: Any, spec: str) -> str:
    return "-" if not isinstance(value, (int, float)) else format(value, spec)


def format_record(record: dict[str, Any]) -> str:
    """One record as a line a person reads (`gptpar logs`), not JSON."""
    kind, get = record.get("kind"), record.get
    if kind == "step":
        loss = get("global_loss") if get("global_loss") is not None else get("loss")
        return (f"step {get('step'):>7}  loss {_number(loss, '.4f')}  lr {_number(get('lr'), '.2e')}  "
                f"grad_norm {_number(get('grad_norm'), '.3f')}  {_number(get('tokens_per_s'), ',.0f')} tok/s  "
                f"{_number(get('step_time_s'), '.3f')} s/step")
    if kind == "eval":
        return (f"eval at step {get('step')}: val_loss {_number(get('val_loss'), '.4f')}"
                + "".join(f", {key} {_number(get(key), '.2f')}" for key in EVAL_SCORES if key in record))
    if kind == "epoch":
        return (f"epoch {get('epoch')}: {get('steps')} steps in {_number(get('training_time_s'), '.1f')} s, "
                f"{_number(get('tokens_per_s'), ',.0f')} tok/s, val_loss {_number(get('val_loss'), '.4f')}"
                + "".join(f", {key} {_number(get(key), '.2f')}" for key in LINE_SCORES
                          if key in record))
    if kind == "header":
        return (f"start (restart {get('restart')}): rank {get('rank')} of {get('world_size')} on {get('host')}, "
                f"{get('device')}, {get('total_steps', '?')} steps in all")
    if kind == "memory":
        mb = {part: _number((get(f"{part}_bytes") or 0) / 2**20, ".1f") for part in ("params", "grads", "optimizer")}
        return (f"memory: {get('params'):,} parameters; MB params {mb['params']}, grads {mb['grads']}, "
                f"optimizer {mb['optimizer']}")
    if kind == "final":
        why = get("error") or (f"by {get('signal')}" if get("signal") else "")
        return f"final: {get('status')} at step {get('step')}" + (f" ({why})" if why else "")
    return " ".join(f"{key}={value}" for key, value in record.items() if key != "time")


# Each epoch's decoded answers of data.task=sft, `answers/epoch<N>.jsonl`: one `Answer` per line, so a 0%
# answer_accuracy can be told apart from a formatting problem by reading them. A file is written whole and atomically
# once its epoch is scored; a start that resumes before an epoch's end and scores it again finds the file there and
# keeps it: a completed epoch's answers are never overwritten, the folder only gains the epochs that follow.
ANSWERS_DIR = "answers"


@dataclass(frozen=True)
class Answer:
    """One scored validation sample: the prompt as the model saw it, its greedy response, the reference, and whether
    their final answers matched."""

    prompt: str
    response: str
    reference: str
    correct: bool


def answers_path(run_dir: str | Path, epoch: int) -> Path:
    return Path(run_dir) / ANSWERS_DIR / f"epoch{epoch}.jsonl"


def write_answers(run_dir: str | Path, epoch: int, answers: list[Answer]) -> bool:
    """Write epoch `epoch`'s answers unless its file exists; returns whether it wrote."""
    path = answers_path(run_dir, epoch)
    if path.exists():
        return False
    atomic_write(path, lambda f: f.write(b"".join(encode(dataclasses.asdict(answer)) for answer in answers)))
    return True


def read_answers(run_dir: str | Path) -> dict[int, list[Answer]]:
    """Every epoch's answers in the run folder, by epoch ({} when there are none); a line that is not an answer
    (edited by hand: the writer writes whole files) is left out."""
    folder = Path(run_dir) / ANSWERS_DIR
    epochs = {}
    for path in folder.glob("epoch*.jsonl") if folder.is_dir() else []:
        number = path.stem.removeprefix("epoch")
        if number.isdigit():
            epochs[int(number)] = [answer for line in path.read_bytes().splitlines() if (answer := _answer(line))]
    return dict(sorted(epochs.items()))


def _answer(line: bytes) -> Answer | None:
    try:
        row = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None
    names = [f.name for f in fields(Answer)]
    return Answer(**{name: row[name] for name in names}) if isinstance(row, dict) and set(names) <= set(row) else None
