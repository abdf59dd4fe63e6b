"""The record classes are the log's one schema: what the trainer writes parses into them with no key they do not
declare, and the readers (the analysis, the run state, `gptpar status` and `gptpar logs`) read no key they lack."""

from __future__ import annotations

import ast
from pathlib import Path

import orjson
import pytest
from conftest import REPO
from gloo_pool import GlooPools
from rank_training import train_as_gptpar_does

from gptpar.config import load_config
from gptpar.errors import GptparError
from gptpar.run.logfile import encode
from gptpar.run.records import (
    ABSENT,
    DECLARED,
    MOE_LOAD_KEYS,
    RECORDS,
    EpochRecord,
    FinalRecord,
    StepRecord,
    names,
    parse,
    validate_record,
)
from gptpar.train.entry import run_rank

READERS = sorted([*(REPO / "analysis").glob("*.py"), *(REPO / "gptpar" / "run").glob("*.py"),
                  REPO / "gptpar" / "launch" / "status.py"])
TINY = ["model.n_layer=2", "data.seq_len=32", "data.tokenizer=bytes", "data.source=synthetic", "train.max_steps=4",
        "train.eval_every=2", "log.progress=none"]

# String keys these files read from dicts that are not log records (config keys, with a dot, and SLURM's
# environment variables are told apart by their spelling).
GRID = {"dp", "pp", "cp", "tp"}  # inside a header's coords and sizes
MEMORY_PARTS = {"total", "grads", "optimizer"}  # analysis.aggregate.MemoryUse's breakdown
FIELD_METADATA = {"help", "choices", "may_diverge"}
OTHER_DICTS = {
    # a step's expert load, a collective kind of its comm_s
    "analysis/aggregate.py": GRID | MEMORY_PARTS | set(MOE_LOAD_KEYS) | {"all_to_all"},
    "analysis/figures.py": MEMORY_PARTS | {"F", "B", "W"},  # a timeline's action kinds
    "analysis/grouping.py": {"total"},  # a run's bytes sent per step, all collectives (analysis.aggregate)
    "analysis/report.py": {"fork"},  # a multiprocessing start method
    # a trace's per-rank totals; a plan.json's prediction (gptpar.plan.record): its memory's state and hpZ copy, layout
    "analysis/summary.py": MEMORY_PARTS | {"comm_s", "overlap_s", "memory", "state", "hpz", "layout"},
    # a Chrome trace's events and torch's distributedInfo in it (its world_size is a header field's name too)
    "analysis/trace.py": {"traceEvents", "name", "cat", "ts", "dur", "ph", "pid", "tid", "calls", "where", "self_s",
                          "nccl", "distributedInfo"},
    # the columns of Holistic Trace Analysis's temporal breakdown and overlap tables, and of its parsed trace (cat)
    "analysis/holistic.py": {"kernel_time(us)", "idle_time(us)", "compute_time(us)", "non_compute_time(us)",
                             "idle_time_pctg", "compute_time_pctg", "non_compute_time_pctg", "comp_comm_overlap_pctg",
                             "cat"},
    "gptpar/launch/status.py": {"pending"},  # a run state
    "gptpar/run/folder.py": {"job_id", "pid", "flock", "heartbeat"},  # the run lock's JSON
    "gptpar/run/logfile.py": MEMORY_PARTS | FIELD_METADATA,
    "gptpar/run/records.py": FIELD_METADATA,
    # a rank's dump of its flight recorder (gptpar.parallel.flight) and the final record's `hang` inside, its live
    # state, and the config's parallel.stuck_after_s and timeout_s
    "gptpar/run/hang.py": {"seqs", "blocked", "entries", "state", "start", "end", "group", "seq", "op", "bytes",
                           "groups", "stopped", "host", "pid", "frames", "where", "function", "entered", "micro_step",
                           "stuck_after_s", "timeout_s", "peer", "micro_batch"},  # and a send or receive's
    "gptpar/run/start.py": {"job_id"},  # the job record of a folder set aside
    # the job record's keys, the lock's pid (and a launcher's queue lock's since), error texts, the config's
    # train.checkpoint_every and parallel section (its stuck_after_s), and the hang field
    "gptpar/run/state.py": GRID | {"job_id", "backend", "pid", "since", "MemoryError", "out of memory", "oom-kill",
                                   "train", "checkpoint_every", "summary", "stuck", "where", "parallel"},
    "gptpar/run/stragglers.py": GRID | {"report", "straggler_ratio"},  # a header's coords, the config's key
    "gptpar/run/sweeps.py": {"name", "points", "digest", "files"},  # a sweep's record
    # the layout a header's config ran: its parallel and train sections' keys
    "gptpar/run/segments.py": GRID | {"ep", "parallel", "train", "grad_accum", "pp_schedule", "dp_sync"},
}


def string_keys(tree: ast.AST) -> list[tuple[str, int]]:
    """(key, line) of every `x["key"]`, `x.get("key")`, `get("key")` and `"key" in x` of a module."""
    found = []
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Subscript):
            key = node.slice
        elif isinstance(node, ast.Call) and node.args and (
                isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                or isinstance(node.func, ast.Name) and node.func.id == "get"):
            key = node.args[0]
        elif isinstance(node, ast.Compare) and isinstance(node.ops[0], (ast.In, ast.NotIn)):
            key = node.left
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            found.append((key.value, node.lineno))
    return found


def test_readers_read_only_declared_fields() -> None:
    declared = set().union(*DECLARED.values()) | {"kind"}
    undeclared = []
    for path in READERS:
        name = path.relative_to(REPO).as_posix()
        allowed = declared | OTHER_DICTS.get(name, set())
        undeclared += [f"{name}:{line}: {key!r}" for key, line in string_keys(ast.parse(path.read_text()))
                       if key not in allowed and "." not in key and not key.isupper()]
    assert not undeclared, "keys no record class declares (add the field to gptpar/run/records.py):\n" + "\n".join(
        undeclared)


def test_a_key_list_cannot_name_an_undeclared_field() -> None:
    assert names(StepRecord, "loss", "bubble") == ("loss", "bubble")
    with pytest.raises(ValueError, match="StepRecord has no field"):
        names(StepRecord, "val_loss")


def test_a_record_is_written_as_before() -> None:
    """Keys in the order the trainer always wrote them, absent fields left out, null kept, non-finite as text."""
    record = FinalRecord(time=5.0, status="stopped", step=3, loss=float("nan"), signal=None)
    assert encode(record.fields()) == b'{"kind":"final","time":5.0,"status":"stopped","step":3,"loss":"NaN",' \
                                      b'"signal":null}\n'
    epoch = EpochRecord(time=1.0, epoch=0, training_time_s=2.0, tokens_per_s=3.0, val_loss=None, steps=4, bleu=None)
    assert list(epoch.fields()) == ["kind", "time", "epoch", "training_time_s", "tokens_per_s", "val_loss", "steps",
                                    "bleu"]
    assert epoch.test_bleu is ABSENT and parse(epoch.fields()) == epoch


def test_parse_names_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="final status 'paused'"):
        validate_record({"kind": "final", "time": 1.0, "status": "paused", "step": 0})
    with pytest.raises(ValueError, match="undeclared field"):
        parse({"kind": "final", "time": 1.0, "status": "failed", "step": 0, "eror": "x"}, strict=True)
    assert parse({"kind": "final", "time": 1.0, "status": "failed", "step": 0, "newer": 1}).step == 0


def written(run_dir: Path) -> list[dict]:
    return [orjson.loads(line) for path in sorted(run_dir.glob("rank*.jsonl"))
            for line in path.read_bytes().splitlines()]


def assert_declared(records: list[dict], kinds: set[str]) -> None:
    for record in records:
        assert list(parse(record, strict=True).fields()) == list(record), record["kind"]  # same keys, same order
    assert {r["kind"] for r in records} == kinds


@pytest.mark.slow
def test_every_record_a_single_rank_run_writes_is_declared(tmp_path: Path) -> None:
    result = run_rank(load_config(None, [*TINY, f"log.runs_dir={tmp_path}", "log.run_id=one"]))
    assert_declared(written(Path(result["run_dir"])), set(RECORDS))


@pytest.mark.slow
def test_the_records_of_a_failed_set_up_are_declared(tmp_path: Path) -> None:
    cfg = load_config(None, [*TINY, "data.source=text:/nonexistent.txt", f"log.runs_dir={tmp_path}",
                             "log.run_id=failed"])
    with pytest.raises(GptparError):
        run_rank(cfg)
    records = written(tmp_path / "failed")
    assert_declared(records, {"header", "final"})
    assert records[-1]["status"] == "failed" and "error" in records[-1]


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["parallel.pp=2", "parallel.chunks=2"],
                                    ["parallel.dp=2", "parallel.dp_sync=fsdp", "parallel.hpz=true"]],
                         ids=["pipeline", "fsdp"])
def test_every_record_a_two_rank_run_writes_is_declared(tmp_path: Path, layout: list[str],
                                                        gloo_pool: GlooPools) -> None:
    """The optional fields only some strategies write: the pipeline's pp_* step fields, fsdp's gathered peak and
    hpZ's copy (its node group the pool's two ranks, the launcher's LOCAL_WORLD_SIZE)."""
    gloo_pool.run(2, train_as_gptpar_does, [*layout, *TINY, f"log.runs_dir={tmp_path}", "log.run_id=two"])
    records = written(tmp_path / "two")
    assert_declared(records, set(RECORDS))
    optional = ["pp_timeline"] if "parallel.pp=2" in layout else ["gathered_peak_bytes", "hpz_bytes", "hpz_node_size"]
    assert all(any(field in r for r in records) for field in optional)
    if "parallel.hpz=true" in layout:  # backward's gathers within the node
        assert any("all_gather_intra" in r.get("comm_bytes", {}) for r in records)
