"""The analysis on synthetic log sets whose answers are worked out by hand."""

from __future__ import annotations

import csv
import math
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest
from logsets import T0, Rank, config, dp_run, engine_run

from analysis.aggregate import RunMetrics, closed_form_state_bytes
from analysis.figures import mean_costs, simulated_timeline
from analysis.report import analyse_runs, report
from gptpar.cli import main as gptpar_main
from gptpar.errors import GptparError
from gptpar.run.folder import RunFolder

LATER = T0 + 3600.0  # "now" an hour after the logs: a run without a final record has died


def metrics(runs_dir: Path, **kwargs) -> dict[str, RunMetrics]:
    return {m.run: m for m in analyse_runs(runs_dir, now=LATER, **kwargs)}


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


def test_epoch_time_is_averaged_and_throughput_summed_over_ranks_after_warmup(tmp_path: Path) -> None:
    ranks = [Rank(tmp_path / "r", r, config(dp=2)).header() for r in range(2)]
    # Epoch 1 (warm-up): slow and with odd numbers, so that counting it would show.
    for rank in ranks:
        rank.step(1, 1, step_time_s=30.0).step(2, 1, step_time_s=30.0).epoch(1, 60.0, 3.0, steps=2)
    for rank, (t, rate, dt) in zip(ranks, [(10.0, 100.0, 1.0), (12.0, 120.0, 2.0)], strict=True):
        rank.step(3, 2, step_time_s=dt).step(4, 2, step_time_s=dt).epoch(2, t, rate, steps=2).final(step=4)
    m = metrics(tmp_path)["r"]
    assert m.status == "completed" and m.basis == "epoch 2"
    assert m.epoch_time == (11.0, None)
    assert m.tokens_per_s == (220.0, None)
    # 2 ranks x 2 kept steps x 100 tokens over the slowest rank's 2 x 2 s.
    assert m.job_tokens_per_s == pytest.approx(400 / 4.0)
    assert m.step_time == (1.5, 0.0)
    # Without the warm-up rule epoch 1 counts: the mean of 60 and 11.
    assert metrics(tmp_path, warmup_epochs=0)["r"].epoch_time[0] == pytest.approx(35.5)


def test_mean_and_std_over_kept_epochs(tmp_path: Path) -> None:
    ranks = [Rank(tmp_path / "r", r, config(dp=2)).header() for r in range(2)]
    for e, times, rates in [(1, (99, 99), (1, 1)), (2, (10, 12), (100, 120)), (3, (12, 14), (80, 100))]:
        for rank, t, rate in zip(ranks, times, rates, strict=True):
            rank.step(e, e).epoch(e, t, rate)
    for rank in ranks:
        rank.final(step=3)
    m = metrics(tmp_path)["r"]
    assert m.basis == "epochs 2-3 of 3"
    assert m.epoch_time == pytest.approx((12.0, math.sqrt(2.0)))
    assert m.tokens_per_s == pytest.approx((200.0, math.sqrt(800.0)))


def test_single_epoch_run_drops_warmup_steps(tmp_path: Path) -> None:
    ranks = [Rank(tmp_path / "r", r, config(dp=2)).header() for r in range(2)]
    sums = [200, 200, 200, 220, 180]
    for step in range(1, 11):
        for rank in ranks:
            rate = 5.0 if step <= 5 else sums[step - 6] / 2
            rank.step(step, 1, step_time_s=9.0 if step <= 5 else 1.0, tokens_per_s=rate)
    for rank in ranks:
        rank.epoch(1, 50.0, 50.0, steps=10).final(step=10)
    m = metrics(tmp_path)["r"]
    assert m.basis == "steps 6-10 of 10"
    assert m.tokens_per_s == pytest.approx((200.0, math.sqrt(200.0)))
    assert m.job_tokens_per_s == pytest.approx(2 * 5 * 100 / 5.0)
    assert m.epoch_time == (50.0, None)
    kept_all = metrics(tmp_path, warmup_steps=0)["r"]
    assert kept_all.basis == "steps 1-10 of 10" and kept_all.tokens_per_s[0] == pytest.approx(105.0)


def test_truncated_last_line_is_skipped_with_a_warning(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    rank = Rank(tmp_path / "killed", 0, config()).header()
    for step in range(1, 8):
        rank.step(step, 1, loss=float(step))
    rank.logger.close()
    with open(rank.path, "a") as f:
        f.write('{"kind": "step", "time": 1.0, "st')
    dp_run(tmp_path / "ok", [100.0])
    result = report(tmp_path, tmp_path / "out", now=LATER)
    killed = {m.run: m for m in result.runs}["killed"]
    assert killed.status == "failed" and "without a final record" in killed.detail
    assert [s for s, _ in killed.loss_curve] == list(range(1, 8))
    assert f"{rank.path}:9: skipped a truncated last line" in capsys.readouterr().err
    assert [m.run for m in result.shown] == ["ok"]
    assert "| killed | failed |" in result.summary_md.read_text()


def test_corrupt_middle_line_marks_the_run_corrupt_and_names_file_and_line(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    ranks = dp_run(tmp_path / "bad", [100.0, 100.0])
    lines = ranks[1].path.read_text().splitlines()
    lines[3] = lines[3][:-1] + "@@"  # an unterminated object, followed by valid lines
    ranks[1].path.write_text("\n".join(lines) + "\n")
    dp_run(tmp_path / "good", [100.0])
    result = report(tmp_path, tmp_path / "out", now=LATER)
    bad = {m.run: m for m in result.runs}["bad"]
    assert bad.status == "corrupt" and bad.detail.startswith(f"{ranks[1].path}:4: not valid JSON")
    assert f"{ranks[1].path}:4:" in capsys.readouterr().err
    assert [m.run for m in result.shown] == ["good"]
    summary = result.summary_md.read_text()
    assert "| bad | corrupt |" in summary and "rank1.jsonl:4" in summary


@pytest.mark.parametrize("line, missing", [
    ('{"kind": "epoch", "time": 5.0, "epoch": 1}', "epoch record lacks field(s): training_time_s, "
                                                   "tokens_per_s, val_loss, steps"),
    ('{"kind": "step", "time": 5.0, "step": 2, "epoch": 1, "loss": 1.0, "tokens": 100, "tokens_per_s": 9.0}',
     "step record lacks field(s): lr, grad_norm, step_time_s, data_time_s, peak_mem_bytes"),
])
def test_record_missing_a_field_is_reported_with_its_line(tmp_path: Path, line: str, missing: str) -> None:
    rank = Rank(tmp_path / "r", 0, config()).header().step(1)
    rank.logger._file.write(line.encode() + b"\n")
    rank.step(3).final(step=3)
    m = metrics(tmp_path)["r"]
    assert m.status == "corrupt"
    assert m.detail == f"{rank.path}:3: {missing}"


def test_requeued_run_counts_a_relogged_step_once(tmp_path: Path) -> None:
    rank = Rank(tmp_path / "r", 0, config()).header()
    for step in (1, 2, 3):
        rank.step(step, 1, step_time_s=1.0, loss=10.0 - step)
    rank.step(4, 1, step_time_s=50.0, tokens=999, loss=99.0)  # after the checkpoint at step 3: re-run
    rank.final("requeued", 3)
    again = Rank(tmp_path / "r", 0, config())
    again.clock = rank.clock
    again.header(restart=1)
    for step in (4, 5, 6):
        again.step(step, 1, step_time_s=2.0, loss=10.0 - step)
    again.epoch(1, 12.0, 50.0, steps=6).final("completed", 6)
    m = metrics(tmp_path, warmup_steps=0)["r"]
    assert m.status == "completed"
    assert m.loss_curve == [(s, 10.0 - s) for s in range(1, 7)]
    assert m.job_tokens_per_s == pytest.approx(600 / (3 * 1.0 + 3 * 2.0))


def test_status_of_requeued_running_and_failed_runs(tmp_path: Path) -> None:
    Rank(tmp_path / "queued", 0, config()).header().step(1).final("requeued", 1)
    Rank(tmp_path / "live", 0, config()).header().step(1)
    Rank(tmp_path / "dead", 0, config()).header().step(1).final("failed", 1)
    status = {run: m.status for run, m in metrics(tmp_path).items()}
    assert status == {"queued": "requeued", "live": "failed", "dead": "failed"}  # no process holds "live"
    with RunFolder(tmp_path / "live").hold("123"):  # the run's process is alive: its lock says so
        assert {m.run: m.status for m in analyse_runs(tmp_path, now=LATER)}["live"] == "running"
        shown = report(tmp_path, tmp_path / "out", now=LATER, include_incomplete=True).shown
    assert sorted(m.run for m in shown) == ["dead", "live", "queued"]
    assert {m.run: m.status for m in analyse_runs(tmp_path, now=T0 + 10)}["queued"] == "pending"  # requeue grace


def test_two_stage_engine_counts_each_replica_once_and_takes_the_global_loss(tmp_path: Path) -> None:
    ranks = engine_run(tmp_path / "pp", [0.5, 0.25], dp=2, steps=10, losses=[2.0, 3.0])
    assert [r.rank for r in ranks] == [0, 1, 2, 3] and ranks[1].coords == {"pp": 0, "dp": 1, "tp": 0}
    assert ranks[0].logger.path.read_text().count('"loss":null') == 10  # the first stage has no loss
    m = metrics(tmp_path)["pp"]
    # Four ranks log 100 tokens/s each, but a replica's two stages carry the same tokens: 2 x 100.
    assert m.tokens_per_s == (200.0, 0.0)
    assert m.job_tokens_per_s == pytest.approx(2 * 5 * 100 / 5.0)
    assert (m.dp, m.devices, m.gpus, m.chunks) == (2, 2, 4, 4)
    # The replicas' last stages log 2.0 and 3.0; every rank logs their mean as global_loss.
    assert m.final_loss == 2.5 and m.loss_curve == [(s, 2.5) for s in range(1, 11)]


@pytest.mark.parametrize("schedule, stages, chunks, virtual, theory", [
    ("1f1b", 2, 4, 1, 1 / 5), ("gpipe", 3, 2, 1, 2 / 4), ("interleaved_1f1b", 2, 4, 2, 1 / 9),
    ("zb1p", 2, 4, 1, 1 / 13),
])
def test_engine_bubble_is_the_mean_over_every_stage_rank_and_theory_its_closed_form(
        tmp_path: Path, schedule: str, stages: int, chunks: int, virtual: int, theory: float) -> None:
    bubbles = [0.1 * (s + 1) for s in range(stages)]  # each stage rank idles its own share
    engine_run(tmp_path / "e", bubbles, chunks=chunks, pp_schedule=schedule, virtual=virtual)
    m = metrics(tmp_path, warmup_steps=0)["e"]
    assert m.engine and m.pp_schedule == schedule and m.chunks == chunks and m.devices == stages
    assert m.pp_mode == f"pp={stages} {schedule}" + (f" v={virtual}" if virtual > 1 else "")
    assert m.bubble_measured == pytest.approx(sum(bubbles) / stages) and m.bubble_std == pytest.approx(0.0)
    assert m.bubble_theory == pytest.approx(theory)
    assert not m.bubble_flagged and not m.warnings


def test_engine_bubble_std_is_over_steps_of_the_mean_over_ranks(tmp_path: Path) -> None:
    ranks = [Rank(tmp_path / "e", r, config(**{"parallel.pp": 2}), coords={"pp": r, "dp": 0, "tp": 0},
                  sizes={"pp": 2, "dp": 1, "tp": 1}, stage_devices=["cpu"]).header() for r in range(2)]
    for step, pair in enumerate([(0.1, 0.3), (0.3, 0.5)], 1):  # step means 0.2 and 0.4
        for rank, bubble in zip(ranks, pair, strict=True):
            rank.step(step, 1, bubble=bubble, loss=None if rank.rank == 0 else 3.0)
    for rank in ranks:
        rank.final(step=2)
    m = metrics(tmp_path, warmup_steps=0)["e"]
    assert (m.bubble_measured, m.bubble_std) == pytest.approx((0.3, math.sqrt(0.02)))
    assert m.pp_trace is None  # no step logged a pp_timeline


def test_a_context_parallel_run_counts_its_cp_ranks_as_devices(tmp_path: Path) -> None:
    """dp=2 x cp=2: four ranks, each a device, two replicas of two."""
    sizes = {"pp": 1, "dp": 2, "cp": 2, "tp": 1}
    ranks = [Rank(tmp_path / "c", r, config(**{"parallel.dp": 2, "parallel.cp": 2}), sizes=sizes,
                  coords={"pp": 0, "dp": r // 2, "cp": r % 2, "tp": 0}, stage_devices=["cpu"]).header()
             for r in range(4)]
    for rank in ranks:
        rank.step(1, 1, loss=3.0)
        rank.final(step=1)
    m = metrics(tmp_path, warmup_steps=0)["c"]
    assert (m.dp, m.devices, m.gpus, m.distinct_devices) == (2, 2, 4, 4)


def test_a_bubble_outside_0_1_is_flagged_and_left_out_of_the_figures(tmp_path: Path) -> None:
    engine_run(tmp_path / "runs" / "bad", [0.2, 1.3], steps=4)
    result = report(tmp_path / "runs", tmp_path / "out", now=LATER, warmup_steps=0)
    m = result.runs[0]
    assert m.bubble_flagged and m.bubble_measured == pytest.approx(0.75)
    assert any("bubble outside [0, 1]: 1.3 (rank 1, step 1)" in w and "and 1 more" in w for w in m.warnings)
    assert "| bad | pp=2 1f1b | 2 | 4 | 0.200 | 0.750 ± 0.000 ⚠ outside [0, 1] |" in result.summary_md.read_text()
    assert not list((tmp_path / "out").glob("pipeline_*.png"))
    assert any("pipeline_bubble.png skipped" in s for s in result.skipped)


def test_the_traced_step_is_the_last_that_every_rank_logged_and_simulates_to_the_closed_form(tmp_path: Path) -> None:
    for name, stages, virtual in [("1f1b", 3, 1), ("zb1p", 2, 1), ("interleaved_1f1b", 2, 2)]:
        engine_run(tmp_path / name, [0.1] * (stages - 1) + [0.4], chunks=4, pp_schedule=name, virtual=virtual)
    late = Rank(tmp_path / "1f1b", 2, config(), coords={"pp": 2, "dp": 0, "tp": 0})
    late.clock += 100.0
    late.logger.log("step", time=late.clock, step=4, epoch=1, loss=3.0, lr=0.0, grad_norm=1.0, tokens=100,
                    step_time_s=1.0, tokens_per_s=100.0, data_time_s=0.0, peak_mem_bytes=0, bubble=0.9,
                    pp_timeline=[["F", 0, 2, 0.0, 0.5]])  # only the last stage logged step 4
    late.logger.close()
    by = metrics(tmp_path, warmup_steps=0)
    assert by["1f1b"].pp_trace_step == 3
    for name, m in by.items():
        trace = m.pp_trace
        assert trace is not None and m.pp_trace_step == 3
        stages = m.devices
        assert trace.bubble == pytest.approx((0.1 * (stages - 1) + 0.4) / stages)  # the logged shares
        assert {row for row, *_ in trace.spans} == set(range(stages))
        # Logged at unit costs of 10 ms, the schedule simulates to its closed form on the same clock.
        assert mean_costs(trace) == pytest.approx({"F": 0.01, "B": 0.01 if name == "zb1p" else 0.02,
                                                   "W": 0.01 if name == "zb1p" else 0.0})
        simulated = simulated_timeline(m, trace)
        assert simulated.bubble == pytest.approx(m.bubble_theory) and simulated.makespan == pytest.approx(
            trace.makespan)


def test_gradient_accumulation_simulates_back_to_back_passes(tmp_path: Path) -> None:
    engine_run(tmp_path / "e", [0.1, 0.1], chunks=2, **{"train.grad_accum": 2})
    m = metrics(tmp_path, warmup_steps=0)["e"]
    assert m.pp_trace is not None
    simulated = simulated_timeline(m, m.pp_trace)
    assert len(simulated.spans) == 2 * len(m.pp_trace.spans)
    assert sorted({a.microbatch for _, a, *_ in simulated.spans}) == [0, 1, 2, 3]


def test_engine_figures_are_written_for_engine_runs_and_skipped_otherwise(tmp_path: Path) -> None:
    for chunks in (2, 4, 8):
        engine_run(tmp_path / "runs" / "sweep" / f"m{chunks}", [0.3, 0.2], chunks=chunks)
    engine_run(tmp_path / "runs" / "sweep" / "zb", [0.1, 0.1], chunks=4, pp_schedule="zb1p")
    result = report(tmp_path / "runs", tmp_path / "out", now=LATER, warmup_steps=0)
    names = sorted(p.name for p in result.figures if p.name.startswith("pipeline"))
    # One timeline per run, named by the keys the runs vary (a text value bare), no hash where names differ.
    assert names == ["pipeline_bubble.png", *(f"pipeline_timeline_{point}.png" for point in (
        "1f1b_chunks2", "1f1b_chunks4", "1f1b_chunks8", "zb1p_chunks4"))]
    for path in result.figures:
        width, height = png_size(path)
        assert width >= 400 and height >= 300
    summary = result.summary_md.read_text()
    assert "| sweep | pp_schedule=1f1b, chunks=4 | 1 | 1 | pp=2 1f1b | 4 | 2 |" in summary
    assert "| zb | pp=2 zb1p | 2 | 4 | 0.077 |" in summary

    engine_run(tmp_path / "one" / "e", [0.3, 0.2])
    one = report(tmp_path / "one", tmp_path / "out1", now=LATER, warmup_steps=0)
    assert {p.name for p in one.figures} >= {"pipeline_timeline.png", "pipeline_bubble.png"}

    dp_run(tmp_path / "none" / "r", [100.0])
    none = report(tmp_path / "none", tmp_path / "out", now=LATER)  # the same folder: old figures go
    assert not list((tmp_path / "out").glob("pipeline_*.png"))
    assert any("pipeline_timeline.png skipped" in s for s in none.skipped)
    assert any("pipeline_bubble.png skipped" in s for s in none.skipped)


def sweep_set(root: Path) -> None:
    for dp, rates in [(1, [100.0]), (2, [90.0, 90.0]), (4, [80.0] * 4)]:
        dp_run(root / "dpscale" / f"dp{dp}", rates, epoch_times=[40.0 / dp] * dp)
    dp_run(root / "dpscale" / "dp2-naive", [70.0, 70.0], **{"parallel.dp_sync": "naive"})
    dp_run(root / "pipes" / "mp", [100.0], pp_mode="model_parallel", devices="cpu,cpu")
    for chunks, rate in [(2, 130.0), (4, 150.0)]:
        dp_run(root / "pipes" / f"pp{chunks}", [rate], pp_mode="pipeline_parallel", chunks=chunks,
               devices="cpu,cpu", **{"train.batch_size": 16})


def test_sweep_speedup_and_efficiency(tmp_path: Path) -> None:
    sweep_set(tmp_path)
    result = report(tmp_path, tmp_path / "out", now=LATER)
    by = {m.run: m for m in result.runs}
    assert by["dpscale/dp1"].speedup == 1.0 and by["dpscale/dp1"].efficiency == 1.0
    assert (by["dpscale/dp2"].speedup, by["dpscale/dp2"].efficiency) == pytest.approx((1.8, 0.9))
    assert (by["dpscale/dp4"].speedup, by["dpscale/dp4"].efficiency) == pytest.approx((3.2, 0.8))
    assert by["dpscale/dp2-naive"].baseline == "dp1"
    # A pipeline run is compared with the model-parallel run on the same two devices: no efficiency (the GPU ratio
    # is 1), and the model-parallel run is its own baseline.
    assert by["pipes/pp4"].baseline == "mp" and by["pipes/pp4"].speedup == pytest.approx(1.5)
    assert by["pipes/pp4"].efficiency is None and by["pipes/pp4"].gpus == 2
    assert by["pipes/pp2"].bubble_theory == pytest.approx(1 / 3)
    assert (by["pipes/mp"].baseline, by["pipes/mp"].speedup, by["pipes/mp"].efficiency) == ("mp", 1.0, None)
    # The ideal a speedup is drawn against: the GPU ratio, or the bubble's bound p*m/(m+p-1) = 2*4/5.
    assert by["dpscale/dp4"].ideal_speedup == 4.0 and by["pipes/pp4"].ideal_speedup == pytest.approx(1.6)
    with open(result.summary_csv) as f:
        rows = {row["run"]: row for row in csv.DictReader(f)}
    assert float(rows["dpscale/dp4"]["tokens_per_s_mean"]) == 320.0 and rows["dpscale/dp4"]["gpus"] == "4"


def test_report_writes_summary_rows_and_valid_figures(tmp_path: Path) -> None:
    sweep_set(tmp_path / "runs")
    Rank(tmp_path / "runs" / "dpscale" / "dp8", 0, config(dp=8)).header().step(1)  # died
    code = gptpar_main(["report", str(tmp_path / "runs"), "--out", str(tmp_path / "figs")])
    assert code == 0
    summary = (tmp_path / "figs" / "summary.md").read_text()
    table = [line for line in summary.split("## ")[0].splitlines() if line.startswith(("| dpscale", "| pipes"))]
    # One row per sweep point, named by the keys its sweep varies.
    assert [line.split(" | ")[1] for line in table] == [
        "dp=1, dp_sync=bucketed", "dp=2, dp_sync=bucketed", "dp=2, dp_sync=naive", "dp=4, dp_sync=bucketed",
        "pp_mode=model_parallel, chunks=4", "pp_mode=pipeline_parallel, chunks=2",
        "pp_mode=pipeline_parallel, chunks=4"]
    dp2 = next(line for line in table if line.split(" | ")[1] == "dp=2, dp_sync=bucketed").split(" | ")
    assert dp2[2:7] == ["1", "2", "single", "–", "2"]
    assert dp2[7:9] == ["20.00", "180"] and dp2[10:12] == ["1.80× vs dp=1, dp_sync=bucketed", "90%"]
    assert dp2[15] == "n/a (unknown peak for cpu)"
    mp, pp4 = (next(line for line in table if line.split(" | ")[1] == f"pp_mode={mode}").split(" | ")
               for mode in ("model_parallel, chunks=4", "pipeline_parallel, chunks=4"))
    mp_name = "pp_mode=model_parallel, chunks=4"
    assert mp[10:12] == [f"1.00× vs {mp_name}", "–"] and pp4[10:12] == [f"1.50× vs {mp_name}", "–"]
    assert "| dpscale/dp8 | failed |" in summary
    names = sorted(p.name for p in (tmp_path / "figs").glob("*.png"))
    assert names == ["loss_dpscale.png", "loss_pipes.png", "pipeline_vs_model_parallel.png", "speedup_vs_gpus.png",
                     "throughput_vs_dp_sync.png", "throughput_vs_gpus.png", "time_vs_gpus.png"]
    for name in names:
        width, height = png_size(tmp_path / "figs" / name)
        assert width >= 400 and height >= 300


def test_figure_without_data_is_skipped_not_written(tmp_path: Path) -> None:
    dp_run(tmp_path / "runs" / "one", [100.0])
    result = report(tmp_path / "runs", tmp_path / "out", now=LATER)
    assert not (tmp_path / "out" / "pipeline_vs_model_parallel.png").exists()
    assert any("pipeline_vs_model_parallel.png skipped" in s for s in result.skipped)
    assert {p.name for p in result.figures} == {"loss_top-level.png"}  # one ad-hoc run: nothing to scale against


def test_runs_outside_a_sweep_get_no_baseline_nor_scaling_figure_unless_grouped(tmp_path: Path) -> None:
    """Two unrelated ad-hoc runs on 1 and 2 GPUs are listed, not compared: no speedup or efficiency, no *_vs_gpus
    figure. The same runs in one sweep folder, or under --group-by, are compared: 90+90 job tokens/s over 100."""
    dp_run(tmp_path / "adhoc" / "a1", [100.0], **{"model.preset": "gpt2-tiny"})
    dp_run(tmp_path / "adhoc" / "a2", [90.0, 90.0], **{"model.preset": "gpt2-tiny"})
    shutil.copytree(tmp_path / "adhoc", tmp_path / "swept" / "s")
    scaling = {"time_vs_gpus.png", "throughput_vs_gpus.png", "speedup_vs_gpus.png"}
    listed = report(tmp_path / "adhoc", tmp_path / "out", now=LATER)
    rows = {row["run"]: row for row in csv.DictReader(listed.summary_csv.open())}
    assert [(r, rows[r]["speedup"], rows[r]["efficiency"], rows[r]["baseline"]) for r in rows] == [
        ("a1", "", "", ""), ("a2", "", "", "")]
    assert float(rows["a2"]["job_tokens_per_s"]) == 180.0  # measured and listed all the same
    assert not scaling & {p.name for p in listed.figures}
    assert "figure time_vs_gpus.png skipped: no single-mode run of a sweep with an epoch time (runs outside a sweep " \
           "folder are compared only under --group-by)" in listed.skipped
    for runs_dir, group_by in ((tmp_path / "swept", ()), (tmp_path / "adhoc", ("model.preset",))):
        result = report(runs_dir, tmp_path / "out", now=LATER, group_by=group_by)
        by = {m.run.rpartition("/")[2]: m for m in result.runs}
        assert (by["a2"].baseline, by["a2"].speedup, by["a2"].efficiency) == ("a1", pytest.approx(1.8),
                                                                              pytest.approx(0.9))
        assert scaling <= {p.name for p in result.figures}


def test_top_level_runs_under_group_by_are_compared_within_their_config(tmp_path: Path) -> None:
    dp_run(tmp_path / "a1", [100.0], **{"model.preset": "gpt2-tiny"})
    dp_run(tmp_path / "a2", [90.0, 90.0], **{"model.preset": "gpt2-tiny"})
    dp_run(tmp_path / "b1", [50.0], **{"model.preset": "gpt2-mini"})
    dp_run(tmp_path / "b2", [50.0, 50.0], **{"model.preset": "gpt2-mini"})
    by = {m.run: m for m in report(tmp_path, tmp_path / "out", now=LATER, group_by=["sweep"]).runs}
    assert {m.sweep for m in by.values()} == {"top-level"}  # not top-level[preset=...] sweeps
    assert (by["a2"].baseline, by["b2"].baseline) == ("a1", "b1")  # the 1-GPU run of the same model
    assert by["a2"].speedup == pytest.approx(1.8) and by["b2"].speedup == pytest.approx(2.0)


@pytest.mark.slow
def test_worker_processes_give_the_serial_answer(tmp_path: Path) -> None:
    sweep_set(tmp_path)
    serial = analyse_runs(tmp_path, now=LATER, workers=1)
    parallel = analyse_runs(tmp_path, now=LATER, workers=2)
    assert [(m.run, m.tokens_per_s, m.job_tokens_per_s, m.loss_curve) for m in serial] == \
           [(m.run, m.tokens_per_s, m.job_tokens_per_s, m.loss_curve) for m in parallel]


def test_missing_or_empty_runs_dir_is_a_user_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(GptparError, match="does not exist"):
        report(tmp_path / "nope", tmp_path / "out")
    assert gptpar_main(["report", str(tmp_path)]) == 2
    assert "no run folders" in capsys.readouterr().err


def test_a_batch_zipped_with_the_gpu_count_is_not_a_sweep_axis() -> None:
    from analysis.aggregate import sweep_axes

    def run(gpus: int, batch: int, sync: str) -> RunMetrics:
        params = {"train.batch_size": batch, "parallel.dp_sync": sync}
        return RunMetrics(run=f"r{gpus}{sync}", run_id="x", sweep="s", status="completed", detail="",
                          params=params, gpus=gpus)

    weak = [run(1, 16, "ddp"), run(2, 32, "ddp"), run(4, 64, "ddp")]
    assert sweep_axes(weak) == []  # one weak-scaling series, not three batch sizes
    mixed = [*weak, run(2, 32, "naive")]
    assert sweep_axes(mixed) == ["parallel.dp_sync"]
    strong = [run(1, 64, "ddp"), run(2, 64, "ddp"), run(2, 32, "ddp")]
    assert sweep_axes(strong) == ["train.batch_size"]


def test_a_second_report_removes_figures_that_lost_their_data(tmp_path: Path) -> None:
    sweep_set(tmp_path / "runs")
    out = tmp_path / "figs"
    report(tmp_path / "runs", out, now=LATER)
    assert (out / "throughput_vs_dp_sync.png").is_file()
    (out / "notes.png").write_bytes(b"the user's own file")
    shutil.rmtree(tmp_path / "runs" / "dpscale" / "dp2-naive")
    report(tmp_path / "runs", out, now=LATER)
    assert not (out / "throughput_vs_dp_sync.png").exists()
    assert (out / "notes.png").read_bytes() == b"the user's own file"


@pytest.mark.parametrize("strategy, w, expected", [
    ("naive", 2, 16_000), ("bucketed", 2, 16_000), ("ddp", 4, 16_000), ("zero1", 2, 12_000), ("zero1", 4, 10_000),
    ("zero2", 2, 10_000), ("zero2", 4, 7_000), ("fsdp", 4, 4_000), ("fsdp", 2, 8_000), ("fsdp2", 4, 4_000),
    ("fsdp2", 1, 16_000),
])
def test_closed_form_state_bytes_per_rank_for_a_thousand_parameters(strategy: str, w: int, expected: int) -> None:
    assert closed_form_state_bytes(strategy, 1000, w) == pytest.approx(expected)


def test_a_strategy_without_a_closed_form_has_none() -> None:
    assert closed_form_state_bytes("tensor_parallel", 1000, 2) is None


def csv_rows(path: Path) -> dict[str, dict[str, str]]:
    with open(path) as f:
        return {row["run"]: row for row in csv.DictReader(f)}


def test_memory_of_a_bucketed_run_is_16_bytes_per_parameter_and_matches_its_closed_form(tmp_path: Path) -> None:
    dp_run(tmp_path / "runs" / "b", [100.0, 100.0], memory=[(1000, 4000, 4000, 8000)] * 2,
           **{"parallel.dp_sync": "bucketed"})
    result = report(tmp_path / "runs", tmp_path / "out", now=LATER)
    m = result.runs[0]
    mem = m.memory
    assert mem is not None and (mem.strategy, mem.ranks, mem.params) == ("bucketed", 2, 1000)
    assert mem.mean == mem.max == {"params": 4000, "grads": 4000, "optimizer": 8000, "total": 16000}
    assert mem.closed_form == 16000 and mem.ratio == 1.0 and not mem.mismatched and not m.warnings
    summary = result.summary_md.read_text()
    assert "| b | bucketed | 2 | 1,000 | 0.004 | 0.004 | 0.008 | 0.016 | 0.016 | 1.000 |" in summary
    assert "zero1: 4N + 4N + 8N/W" in summary
    row = csv_rows(result.summary_csv)["b"]
    assert (row["dp_sync"], row["mem_total_bytes_mean"], row["mem_closed_form_bytes"], row["mem_ratio"],
            row["mem_flagged"]) == ("bucketed", "16000", "16000", "1", "")


@pytest.mark.parametrize("strategy, record, closed", [
    ("zero1", (1000, 4000, 4000, 4008), 12_000),  # the optimizer's flat shard padded to a multiple of W
    ("zero2", (1000, 4000, 2004, 4008), 10_000),
    ("fsdp2", (1000, 2016, 2016, 4032), 8_000),  # each parameter's rows padded to a multiple of W
])
def test_padded_sharded_state_matches_its_closed_form(tmp_path: Path, strategy: str,
                                                      record: tuple[int, int, int, int], closed: int) -> None:
    dp_run(tmp_path / "r", [100.0, 100.0], memory=[record] * 2, **{"parallel.dp_sync": strategy})
    m = metrics(tmp_path)["r"]
    assert m.memory is not None and m.memory.closed_form == closed
    assert m.memory.ratio == pytest.approx(sum(record[1:]) / closed) and m.memory.ratio > 1
    assert not m.memory.mismatched and not m.warnings


def test_a_lora_runs_state_is_held_to_the_closed_form_of_its_trainable_parameters(tmp_path: Path) -> None:
    """train.lora_rank: 1000 parameters of which 100 train, under fsdp2 over 2 ranks: 4 * 1000 / 2 bytes of weights,
    (4 + 8) * 100 / 2 of gradients and moments; the closed form of all 1000 training would flag it."""
    dp_run(tmp_path / "r", [100.0, 100.0], memory=[(1000, 2000, 200, 400)] * 2, memory_fields={"trainable": 100},
           **{"parallel.dp_sync": "fsdp2"})
    m = metrics(tmp_path)["r"]
    assert m.memory is not None and m.memory.closed_form == 2600 and m.memory.ratio == 1.0
    assert not m.memory.mismatched and not m.warnings


@pytest.mark.parametrize("optimizer_bytes, flagged", [
    (4_000_000 + 124_000, False), (4_000_000 + 124_200, True), (4_000_000 - 124_000, False),
    (4_000_000 - 124_200, True),
])
def test_memory_matches_within_one_percent_and_4_kib(tmp_path: Path, optimizer_bytes: int, flagged: bool) -> None:
    # zero1, W=2, N=1e6: closed form 12e6 bytes, tolerance 1% of it + 4096 = 124096 bytes either way.
    dp_run(tmp_path / "r", [100.0, 100.0], memory=[(1_000_000, 4_000_000, 4_000_000, optimizer_bytes)] * 2,
           **{"parallel.dp_sync": "zero1"})
    m = metrics(tmp_path)["r"]
    assert m.memory is not None and m.memory.closed_form == 12_000_000
    assert (m.memory.mismatched == [0, 1]) is flagged and bool(m.warnings) is flagged


def test_memory_off_its_closed_form_is_flagged_on_the_run_and_marked_in_table_and_figure(tmp_path: Path) -> None:
    dp_run(tmp_path / "runs" / "twice", [100.0, 100.0], memory=[(1000, 4000, 4000, 8000), (1000, 8000, 8000, 16000)],
           **{"parallel.dp_sync": "bucketed"})
    result = report(tmp_path / "runs", tmp_path / "out", now=LATER)
    m = result.runs[0]
    mem = m.memory
    assert mem is not None and mem.mismatched == [1]
    assert mem.mean["total"] == 24000 and mem.max["total"] == 32000 and mem.ratio == pytest.approx(1.5)
    assert m.warnings == ["twice: rank 1 holds 0.032 MB of training state, 2x the closed form 0.016 MB for bucketed "
                          "with W=2; flagged (⚠) in the memory table and figure"]
    assert ("| twice | bucketed | 2 | 1,000 | 0.006 (0.008) | 0.006 (0.008) | 0.012 (0.016) | 0.024 (0.032) | 0.016 | "
            "1.500 ⚠ off the closed form (rank 1) |") in result.summary_md.read_text()
    assert csv_rows(result.summary_csv)["twice"]["mem_flagged"] == "yes"
    assert "memory_per_rank.png" in {p.name for p in result.figures}


def test_pipeline_stage_ranks_are_each_held_to_their_own_parameter_count(tmp_path: Path) -> None:
    # Stage 0 holds 600 parameters, stage 1 400: replicas' closed forms 16 x 600 and 16 x 400, not 16 x 1000.
    engine_run(tmp_path / "pp", [0.1, 0.1], memory=[(600, 2400, 2400, 4800), (400, 1600, 1600, 3200)],
               **{"parallel.dp_sync": "bucketed"})
    m = metrics(tmp_path, warmup_steps=0)["pp"]
    mem = m.memory
    assert mem is not None and (mem.ranks, mem.params, mem.closed_form) == (2, 500, 8000)
    assert mem.mean["total"] == 8000 and mem.max["total"] == 9600 and mem.max["params"] == 2400
    assert not mem.mismatched and not m.warnings


def test_a_memory_record_that_is_not_a_number_is_left_out_with_a_warning(tmp_path: Path) -> None:
    rank = Rank(tmp_path / "r", 0, config()).header().step(1)
    rank.memory(1000, "lots", 4000, 8000).final(step=1)  # type: ignore[arg-type]
    m = metrics(tmp_path)["r"]
    assert m.memory is None and any("rank 0's memory record has a field that is not a number" in w for w in m.warnings)


def test_memory_figure_is_written_with_memory_records_and_skipped_without(tmp_path: Path) -> None:
    for strategy, record in [("bucketed", (1000, 4000, 4000, 8000)), ("zero1", (1000, 4000, 4000, 4000)),
                             ("fsdp2", (1000, 2000, 2000, 4000))]:
        dp_run(tmp_path / "runs" / "sync" / strategy, [100.0, 100.0], memory=[record] * 2,
               **{"parallel.dp_sync": strategy})
    dp_run(tmp_path / "runs" / "sync" / "old", [100.0, 100.0])  # a log older than the memory record
    result = report(tmp_path / "runs", tmp_path / "out", now=LATER)
    assert result.figures[-1].name == "memory_per_rank.png"
    width, height = png_size(result.figures[-1])
    assert width >= 400 and height >= 300
    by = {m.run: m for m in result.runs}
    assert by["sync/old"].memory is None
    summary = result.summary_md.read_text()
    assert "## Memory per rank" in summary and "| old |" not in summary.split("## Memory per rank")[1]
    assert csv_rows(result.summary_csv)["sync/old"]["mem_total_bytes_mean"] == ""

    shutil.rmtree(tmp_path / "runs" / "sync")
    dp_run(tmp_path / "runs" / "old", [100.0])
    again = report(tmp_path / "runs", tmp_path / "out", now=LATER)  # the same folder: the old figure goes
    assert not (tmp_path / "out" / "memory_per_rank.png").exists()
    assert any("memory_per_rank.png skipped" in s for s in again.skipped)
    assert "Memory per rank" not in again.summary_md.read_text()


@pytest.mark.parametrize("optimizer_bytes, flagged", [(2_000_000, False), (2_400_000, True)])
def test_fsdp_shards_everything_and_a_run_ten_percent_off_16n_over_w_is_flagged(
        tmp_path: Path, optimizer_bytes: int, flagged: bool) -> None:
    # N=1e6, W=4: 16N/W = 4e6 bytes (zero2's 4N + 12N/W would be 7e6); 0.4e6 more is past 1% + 4 KiB.
    dp_run(tmp_path / "runs" / "f", [100.0] * 4, memory=[(1_000_000, 1_000_000, 1_000_000, optimizer_bytes)] * 4,
           **{"parallel.dp_sync": "fsdp"})
    result = report(tmp_path / "runs", tmp_path / "out", now=LATER)
    mem = result.runs[0].memory
    assert mem is not None and mem.closed_form == 4_000_000
    assert (mem.mismatched == [0, 1, 2, 3]) is flagged and bool(result.runs[0].warnings) is flagged
    assert "fsdp, fsdp2: 4N/W + 4N/W + 8N/W" in result.summary_md.read_text()


def sharded_run(run_dir: Path, strategy: str, records: list[dict[str, Any]],
                peaks: list[list[float | None]], **cfg: Any) -> None:
    """A completed run of len(records) data-parallel ranks, two steps an epoch: rank r logs peak_mem_bytes
    peaks[r][s - 1] in step s and, after step 1, the memory record records[r] (with its own optional fields); `cfg`
    holds further "section.key" settings."""
    for r, (record, rank_peaks) in enumerate(zip(records, peaks, strict=True)):
        rank = Rank(run_dir, r, config(name=run_dir.name, dp=len(records), **{"parallel.dp_sync": strategy, **cfg})
                    ).header()
        for step, peak in enumerate(rank_peaks, 1):
            rank._log("step", step=step, epoch=(step + 1) // 2, loss=3.0, lr=1e-3, grad_norm=1.0, tokens=100,
                      step_time_s=1.0, tokens_per_s=100.0, data_time_s=0.0, peak_mem_bytes=peak)
            if step == 1:
                rank._log("memory", step=1, **record)
            if step % 2 == 0:
                rank.epoch(step // 2, 2.0, 100.0, steps=2)
        rank.final(step=len(rank_peaks))


def test_in_flight_and_peak_memory_are_shown_over_the_ranks_that_logged_them(tmp_path: Path) -> None:
    # fsdp, N=1000, W=4: each rank holds its 16N/W = 4000 bytes. Ranks 0 and 1 log 3 and 5 MB in flight, rank 2
    # null, rank 3 nothing; rank 0's steps peak at 300 MB (its highest), rank 1's at 500 MB, ranks 2 and 3 null.
    state = {"params": 1000, "params_bytes": 1000, "grads_bytes": 1000, "optimizer_bytes": 2000}
    records = [{**state, "gathered_peak_bytes": 3_000_000}, {**state, "gathered_peak_bytes": 5_000_000},
               {**state, "gathered_peak_bytes": None}, state]
    peaks: list[list[float | None]] = [[1e8, 3e8, 2e8, 2e8], [5e8] * 4, [None] * 4, [None] * 4]
    sharded_run(tmp_path / "runs" / "gpu", "fsdp", records, peaks)
    sharded_run(tmp_path / "runs" / "cpu", "fsdp", [state] * 4, [[None] * 4] * 4)
    result = report(tmp_path / "runs", tmp_path / "out", now=LATER)
    by = {m.run: m for m in result.runs}
    gpu, cpu = by["gpu"], by["cpu"]
    assert gpu.memory is not None and gpu.memory.gathered_peak == (4_000_000, 5_000_000)
    assert gpu.peak_mem == (4e8, 5e8) and not gpu.memory.mismatched and not gpu.warnings
    assert cpu.memory is not None and cpu.memory.gathered_peak is None and cpu.peak_mem is None
    summary = result.summary_md.read_text()
    assert "| total MB | closed form MB | ratio | in flight MB | peak MB |" in summary
    assert "| gpu | fsdp | 4 | 1,000 | 0.001 | 0.001 | 0.002 | 0.004 | 0.004 | 1.000 | 4 (5) | 400 (500) |" in summary
    assert "| cpu | fsdp | 4 | 1,000 | 0.001 | 0.001 | 0.002 | 0.004 | 0.004 | 1.000 | – | – |" in summary
    rows = csv_rows(result.summary_csv)
    assert (rows["gpu"]["mem_gathered_peak_bytes_mean"], rows["gpu"]["mem_gathered_peak_bytes_max"],
            rows["gpu"]["peak_mem_bytes_mean"], rows["gpu"]["peak_mem_bytes_max"]) == (
        "4000000", "5000000", "400000000", "500000000")
    assert rows["cpu"]["mem_gathered_peak_bytes_mean"] == rows["cpu"]["peak_mem_bytes_mean"] == ""


# fsdp, N = 1e6, W = 4: the state is 16N/W = 4e6 bytes; hpZ's int8 copy at L = 2 is N (1 + 4/256) / 2 = 507,812.5.
HPZ_STATE = {"params": 1_000_000, "params_bytes": 1_000_000, "grads_bytes": 1_000_000, "optimizer_bytes": 2_000_000}
HPZ_RUN = {"parallel.hpz": True, "parallel.param_comm": "int8", "parallel.quant_block": 256}


@pytest.mark.parametrize("copy, flagged", [(508_000, False),  # its closed form and the shards' padding
                                           (2_000_000, True)])  # an fp32 copy (4N/2) where int8 was asked for
def test_hpz_copy_is_accounted_and_held_to_its_closed_form(tmp_path: Path, copy: int, flagged: bool) -> None:
    sharded_run(tmp_path / "runs" / "h", "fsdp", [{**HPZ_STATE, "hpz_bytes": copy, "hpz_node_size": 2}] * 4,
                [[None] * 2] * 4, **HPZ_RUN)
    result = report(tmp_path / "runs", tmp_path / "out", now=LATER)
    m = result.runs[0]
    mem = m.memory
    assert mem is not None and mem.hpz == (copy, copy)
    assert mem.mean["total"] == 4_000_000 + copy and mem.closed_form == 4_507_812.5
    assert (mem.mismatched == [0, 1, 2, 3]) is flagged
    assert any("MB of training state" in w for w in m.warnings) is flagged
    total = f"{(4_000_000 + copy) / 1e6:.4g} incl. hpZ {copy / 1e6:.4g}"
    assert f"| h | fsdp | 4 | 1,000,000 | 1 | 1 | 2 | {total} | 4.508 |" in result.summary_md.read_text()
    row = csv_rows(result.summary_csv)["h"]
    assert (row["mem_hpz_bytes_mean"], row["mem_total_bytes_mean"], row["mem_flagged"]) == (
        str(copy), str(4_000_000 + copy), "yes" if flagged else "")
    assert ("memory_per_rank.png" in {p.name for p in result.figures}) is flagged  # drawn where one is off


# zero2 with parallel.offload=optimizer, N = 1e6, W = 2: the device keeps 4N + 4N/2, the host 16N/2 (AdamW's state, the
# fp32 shard and its gradient).
OFFLOADED_STATE = {"params": 1_000_000, "params_bytes": 4_000_000, "grads_bytes": 2_000_000, "optimizer_bytes": 0}


@pytest.mark.parametrize("host, flagged", [(8_000_000, False),  # the closed form 16N/W
                                           (4_000_000, True)])  # the moments alone, without the step's copies
def test_offloaded_state_is_in_the_total_and_held_to_the_offloads_closed_form(tmp_path: Path, host: int,
                                                                               flagged: bool) -> None:
    sharded_run(tmp_path / "runs" / "o", "zero2", [{**OFFLOADED_STATE, "host_bytes": host}] * 2, [[None] * 2] * 2,
                **{"parallel.offload": "optimizer"})
    result = report(tmp_path / "runs", tmp_path / "out", now=LATER)
    mem = result.runs[0].memory
    assert mem is not None and mem.mean["host"] == host and mem.mean["total"] == 6_000_000 + host
    assert mem.closed_form == 14_000_000 and (mem.mismatched == [0, 1]) is flagged
    total = f"{(6_000_000 + host) / 1e6:.4g} incl. host {host / 1e6:.4g}"
    assert f"| o | zero2 | 2 | 1,000,000 | 4 | 2 | 0 | {total} | 14 |" in result.summary_md.read_text()


def test_hpz_node_size_comes_from_the_config_where_the_record_lacks_it_and_is_never_guessed(tmp_path: Path) -> None:
    record = {**HPZ_STATE, "hpz_bytes": 2_000_000}  # fp32: 4N/2
    sharded_run(tmp_path / "set" / "fp32", "fsdp", [record] * 4, [[None] * 2] * 4, **{"parallel.hpz": True,
                                                                                        "parallel.hpz_node_size": 2})
    sharded_run(tmp_path / "auto" / "fp32", "fsdp", [record] * 4, [[None] * 2] * 4, **{"parallel.hpz": True})
    set_size, auto = metrics(tmp_path / "set")["fp32"], metrics(tmp_path / "auto")["fp32"]
    assert set_size.memory is not None and set_size.memory.closed_form == 6_000_000
    assert not any("node size" in w or "training state" in w for w in set_size.warnings)
    assert auto.memory is not None and auto.memory.closed_form is None and auto.memory.mean["total"] == 6_000_000
    assert any("hpZ's copy but not its node size" in w for w in auto.warnings)


def test_an_in_flight_count_that_is_not_a_number_leaves_the_record_out(tmp_path: Path) -> None:
    state = {"params": 1000, "params_bytes": 1000, "grads_bytes": 1000, "optimizer_bytes": 2000}
    sharded_run(tmp_path / "r", "fsdp", [{**state, "gathered_peak_bytes": "lots"}], [[None] * 2])
    m = metrics(tmp_path)["r"]
    assert m.memory is None and any("rank 0's memory record has a field that is not a number" in w for w in m.warnings)


def fsdp_run(run_dir: Path, w: int, n: int = 1000, off: float = 1.0) -> None:
    """An fsdp run of W ranks, each holding 16N/W bytes (its optimizer state scaled by `off`)."""
    dp_run(run_dir, [100.0] * w, memory=[(n, 4 * n // w, 4 * n // w, round(8 * n // w * off))] * w,
           **{"parallel.dp_sync": "fsdp"})


def test_memory_vs_world_size_is_drawn_when_a_strategy_spans_two_sizes_and_skipped_otherwise(tmp_path: Path) -> None:
    out = tmp_path / "out"
    fsdp_run(tmp_path / "spans" / "w2", 2)
    fsdp_run(tmp_path / "spans" / "w4", 4, off=1.5)  # off its closed form: drawn, and marked
    dp_run(tmp_path / "spans" / "z1", [100.0] * 2, memory=[(1000, 4000, 4000, 4000)] * 2,
           **{"parallel.dp_sync": "zero1"})  # a strategy at one W only rides along
    drawn = report(tmp_path / "spans", out, now=LATER)
    assert "memory_vs_world_size.png" in {p.name for p in drawn.figures}
    assert not any("memory_vs_world_size.png" in s for s in drawn.skipped)
    width, height = png_size(out / "memory_vs_world_size.png")
    assert width >= 400 and height >= 300

    fsdp_run(tmp_path / "apart" / "fsdp-w2", 2)  # each strategy at one W
    dp_run(tmp_path / "apart" / "zero1-w4", [100.0] * 4, memory=[(1000, 4000, 4000, 2000)] * 4,
           **{"parallel.dp_sync": "zero1"})
    fsdp_run(tmp_path / "apart" / "big-w4", 4, n=2000)  # fsdp at W=4, but of another model: no line across W
    apart = report(tmp_path / "apart", out, now=LATER)  # the same folder: the old figure goes
    assert not (out / "memory_vs_world_size.png").exists()
    assert "memory_per_rank.png" in {p.name for p in apart.figures}
    assert any(s.startswith("figure memory_vs_world_size.png skipped: no strategy has memory records at two or more")
               for s in apart.skipped)
