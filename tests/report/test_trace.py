"""Profiler traces and `gptpar trace`: the interval arithmetic, the CPU and GPU breakdowns on hand-written
traces with known answers, the step profiler's range across restarts, a real 2-rank bucketed job's traces,
and the one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gloo_pool import GlooPools
from rank_training import make_config, make_trainer

from analysis.report import report
from analysis.trace import analyse, analyse_run, difference, intersection, length, read_trace, union
from gptpar.cli import main
from gptpar.config import TrainConfig
from gptpar.parallel.process_group import RankInfo
from gptpar.run.folder import RunFolder
from gptpar.train.profiling import StepProfiler
from gptpar.train.provenance import header_fields


def x(name: str, start: float, end: float, cat: str = "user_annotation", tid: int = 1) -> dict:
    """A complete event, times in microseconds as torch writes them."""
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": start, "dur": end - start}


def write_trace(path: Path, events: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"traceEvents": [{"ph": "M", "name": "process_name", "pid": 1}, *events]}))
    return path


def microseconds(r) -> list[float]:
    return [round(t * 1e6, 6) for t in (r.wall_s, r.compute_s, r.comm_s, r.overlap_s, r.idle_s)]


def test_interval_arithmetic() -> None:
    assert union([(5, 7), (0, 2), (1, 3), (3, 4), (6, 6)]) == [(0, 4), (5, 7)]
    assert intersection([(0, 4), (5, 10)], [(2, 6), (8, 9), (12, 13)]) == [(2, 4), (5, 6), (8, 9)]
    assert difference([(0, 10), (12, 14)], [(2, 3), (5, 13)]) == [(0, 2), (3, 5), (13, 14)]
    assert difference([(0, 4)], []) == [(0, 4)] and difference([(1, 2)], [(0, 5)]) == []
    assert length([(0, 4), (2, 6), (10, 11)]) == 7


# Two profiled steps (windows [0, 100) and [200, 210)) with an evaluation's forward between them, outside the
# window. Step 2: forward, a backward that issues two bucket all-reduces, the waits for them, the optimizer, a
# blocking all-reduce (both spans, as comm_span writes one) and a synchronous all-gather without a wait.
CPU_TRACE = [
    x("ProfilerStep#2", 0, 100), x("forward", 0, 30), x("aten::mm", 5, 25, "cpu_op"), x("backward", 30, 70),
    x("comm:all_reduce", 40, 42), x("comm:all_reduce", 60, 62),
    x("comm_wait:all_reduce", 70, 80), x("comm_wait:all_reduce", 80, 85), x("optimizer", 85, 95),
    x("comm:all_reduce", 95, 98), x("comm_wait:all_reduce", 95, 98), x("comm:all_gather", 98, 99),
    x("forward", 120, 140),
    x("ProfilerStep#3", 200, 210), x("forward", 200, 205),
]


def test_cpu_breakdown_from_the_comm_spans(tmp_path: Path) -> None:
    r = analyse(0, read_trace(write_trace(tmp_path / "rank0.json", CPU_TRACE)).events, top=3)
    # window 110; compute [0,70) [85,95) [200,205) = 85; blocked [70,85) [95,99) = 19; idle [99,100) [205,210) = 6;
    # outstanding [40,85) [95,98) [98,99) = 49, of which [40,70) overlaps compute
    assert (r.mode, r.steps, microseconds(r)) == ("cpu", [2, 3], [110, 85, 49, 30, 6])
    assert r.overlap_share == pytest.approx(30 / 49)
    assert [(op["name"], op["where"], round(op["self_s"] * 1e6, 6), op["calls"]) for op in r.top_ops] == [
        ("backward", "cpu", 36, 1), ("aten::mm", "cpu", 20, 1), ("comm_wait:all_reduce", "cpu", 18, 3)]


def test_gpu_breakdown_from_the_kernels(tmp_path: Path) -> None:
    nccl = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
    events = [x("ProfilerStep#1", 0, 100), x("comm:all_reduce", 20, 21),  # CPU spans play no part on a GPU
              x("sgemm_128x64", 0, 40, "kernel", tid=7), x("elementwise", 50, 70, "kernel", tid=7),
              x(nccl, 30, 60, "kernel", tid=13), x(nccl, 90, 95, "kernel", tid=13),
              x("Memcpy HtoD", 70, 90, "gpu_memcpy", tid=7), x("sgemm_128x64", 150, 160, "kernel", tid=7)]
    r = analyse(0, read_trace(write_trace(tmp_path / "rank0.json", events)).events, top=2)
    # compute [0,40) [50,70) = 60; nccl [30,60) [90,95) = 35; both [30,40) [50,60) = 20; no kernel [70,90) [95,100)
    assert (r.mode, r.steps, microseconds(r)) == ("gpu", [1], [100, 60, 35, 20, 25])
    assert r.overlap_share == pytest.approx(20 / 35)
    assert [(op["name"], op["where"], round(op["self_s"] * 1e6, 6)) for op in r.top_ops] == [
        ("sgemm_128x64", "gpu", 40), (nccl, "gpu", 35)]


def _profiled_steps(path: Path, first: int, stop_after: int, steps: str = "2-3") -> None:
    """Steps first..stop_after of a run profiling `steps`, then the loop's end (its `close`)."""
    profiler = StepProfiler(TrainConfig(profile_steps=steps), torch.device("cpu"), path)
    m = torch.randn(16, 16)
    for step in range(first, stop_after + 1):
        profiler.begin(step)
        (m @ m).sum()
        profiler.end(step)
    profiler.close()


def _step_spans(path: Path) -> list[str]:
    return sorted(e.name for e in read_trace(path).events if e.name.startswith("ProfilerStep#"))


def test_a_restart_profiles_the_steps_left_in_the_range_and_nothing_past_it(tmp_path: Path) -> None:
    path = RunFolder(tmp_path).trace_path(0)
    _profiled_steps(path, 1, 2)  # stopped after step 2: what was recorded is written
    assert _step_spans(path) == ["ProfilerStep#2"]
    _profiled_steps(path, 3, 4)  # resumed inside the range: its remaining step replaces the file
    assert _step_spans(path) == ["ProfilerStep#3"]
    before = path.stat().st_mtime_ns
    _profiled_steps(path, 4, 5)  # resumed past it: nothing new
    assert path.stat().st_mtime_ns == before and list(path.parent.iterdir()) == [path]
    _profiled_steps(tmp_path / "none.json", 1, 3, steps="")
    assert not (tmp_path / "none.json").exists()


def _traced_worker(info: RankInfo, runs: Path) -> None:
    cfg = make_config(["parallel.dp=2", "parallel.dp_sync=bucketed", "parallel.bucket_mb=0.01", "train.max_steps=3",
                       "train.eval_every=0", "train.profile_steps=2-3", "log.progress=none"], runs, "traced")
    trainer = make_trainer(cfg, info)
    trainer.log.log("header", **header_fields(cfg, trainer.dims, 0), vocab_size=trainer.vocab_size)
    trainer.run()
    trainer.log.log("final", status="completed", step=trainer.step)


@pytest.fixture(scope="module")
def traced_run(tmp_path_factory: pytest.TempPathFactory, gloo_pool: GlooPools) -> Path:
    runs = tmp_path_factory.mktemp("trace")
    gloo_pool.run(2, _traced_worker, runs)
    return runs / "traced"


@pytest.mark.slow
def test_a_two_rank_bucketed_run_writes_traces_that_show_its_all_reduces(traced_run: Path) -> None:
    for rank in (0, 1):
        trace = json.loads(RunFolder(traced_run).trace_path(rank).read_text())
        names = {e.get("name") for e in trace["traceEvents"]}
        assert {"forward", "backward", "optimizer", "comm:all_reduce", "comm_wait:all_reduce",
                "ProfilerStep#2", "ProfilerStep#3"} <= names
        assert "ProfilerStep#1" not in names
    ranks, skipped = analyse_run(traced_run, top=5)
    assert skipped == [] and [r.rank for r in ranks] == [0, 1]
    for r in ranks:
        assert r.mode == "cpu" and r.steps == [2, 3] and r.comm_s > 0 and 0 <= r.overlap_share <= 1
        assert r.compute_s + r.idle_s <= r.wall_s and len(r.top_ops) == 5


@pytest.mark.slow
def test_gptpar_trace_prints_a_table_or_json_lines(traced_run: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["trace", str(traced_run), "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("rank  mode") and "rank 1: top 3 ops by self time" in out
    assert main(["trace", str(traced_run), "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [row["rank"] for row in rows] == [0, 1] and all(row["comm_s"] > 0 for row in rows)


def test_gptpar_trace_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["trace", str(tmp_path / "missing")]) == 2
    assert main(["trace", str(tmp_path)]) == 2  # a run folder without trace/
    errors = capsys.readouterr().err.splitlines()
    assert errors == [f"gptpar: error: run {str(tmp_path / 'missing')!r} not found (as a path or under runs)",
                      f"gptpar: error: no traces in {tmp_path / 'trace'} (train with train.profile_steps=A-B, "
                      "e.g. 3-5)"]
    write_trace(tmp_path / "trace" / "rank0.json", [x("ProfilerStep#1", 0, 10), x("forward", 0, 5)])
    (tmp_path / "trace" / "rank1.json").write_text('{"traceEvents": [{"ph": "X", "na')  # truncated
    assert main(["trace", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [f"skipped: {tmp_path / 'trace' / 'rank1.json'} is not a readable Chrome "
                                         "trace (truncated or corrupt: JSONDecodeError)",
                                         "Holistic Trace Analysis: not run: it reads GPU kernels only, and these are "
                                         "CPU traces"]
    assert captured.out.splitlines()[1].split()[:2] == ["0", "cpu"]


@pytest.mark.slow
def test_the_report_shows_each_traced_runs_overlap_as_the_mean_over_its_ranks(traced_run: Path) -> None:
    result = report(traced_run.parent, traced_run.parent / "figures")
    (m,) = [r for r in result.runs if r.run_id == "traced"]
    ranks, _ = analyse_run(traced_run, top=0)
    assert [t.to_dict() for t in m.traces] == [t.to_dict() for t in ranks]
    comm = sum(t.comm_s for t in ranks) / 2 * 1e3
    share = sum(t.overlap_s for t in ranks) / sum(t.comm_s for t in ranks)
    section = result.summary_md.read_text().partition("## Communication overlap (profiled steps)")[2]
    row = next(line for line in section.splitlines() if line.startswith("| traced | bucketed"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2:4] == ["2", "cpu"] and cells[6] == f"{comm:.1f}" and cells[9] == f"{share:.1%}"


def test_gloo_worker_spans_count_as_communication_for_torchs_own_collectives(tmp_path: Path) -> None:
    # DDP's all-reduce carries no gptpar span: gloo's worker thread records it, here [20,50) during backward [10,60).
    events = [x("ProfilerStep#1", 0, 100), x("forward", 0, 10), x("backward", 10, 60),
              x("gloo:all_reduce", 20, 50, tid=9), x("optimizer", 60, 80)]
    r = analyse(0, read_trace(write_trace(tmp_path / "rank0.json", events)).events, top=0)
    assert microseconds(r) == [100, 80, 30, 30, 20]
