"""The analysis on synthetic log sets whose answers are worked out by hand."""

from __future__ import annotations

import csv
import math
import shutil
import struct
from pathlib import Path

import pytest
from logsets import T0, Rank, config, dp_run

from analysis.aggregate import RunMetrics
from analysis.mfu import flops_per_token
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


def test_two_stage_pipeline_counts_each_replica_once(tmp_path: Path) -> None:
    cfg = config(dp=2, pp_mode="pipeline_parallel", chunks=4)
    ranks = []
    for rank in range(4):  # dp-major: rank = dp * 2 + stage
        dp, stage = divmod(rank, 2)
        r = Rank(tmp_path / "pp", rank, cfg, coords={"dp": dp, "pp": stage}, sizes={"dp": 2, "pp": 2})
        ranks.append(r.header())
    for step in range(1, 11):
        for r in ranks:
            last = r.coords["pp"] == 1
            r.step(step, 1, step_time_s=1.0, tokens_per_s=100.0, loss=2.0 if last else None,
                   bubble=0.25 if last else 0.5)
    for r in ranks:
        r.final(step=10)
    m = metrics(tmp_path)["pp"]
    assert m.tokens_per_s == (200.0, 0.0)
    assert m.job_tokens_per_s == pytest.approx(2 * 5 * 100 / 5.0)
    assert (m.dp, m.devices, m.gpus) == (2, 2, 4)
    assert m.bubble_theory == pytest.approx(1 / 5) and m.bubble_measured == pytest.approx(0.25)
    assert m.final_loss == 2.0


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
    # A pipeline run is compared with the model-parallel run on the same two devices.
    assert by["pipes/pp4"].baseline == "mp" and by["pipes/pp4"].speedup == pytest.approx(1.5)
    assert by["pipes/pp4"].efficiency == pytest.approx(1.5) and by["pipes/pp4"].gpus == 2
    assert by["pipes/pp2"].bubble_theory == pytest.approx(1 / 3)
    assert by["pipes/mp"].baseline == ""  # no 1-GPU run in its sweep
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
    assert [line.split(" | ")[1] for line in table] == ["dp1", "dp2", "dp2-naive", "dp4", "mp", "pp2", "pp4"]
    dp2 = next(line for line in table if line.split(" | ")[1] == "dp2").split(" | ")
    assert dp2[2:6] == ["2", "single", "–", "2"]
    assert dp2[6] == "20.00" and dp2[7] == "180" and dp2[9] == "1.80× vs dp1" and dp2[10] == "90%"
    assert dp2[11] == "n/a (unknown peak for cpu)"
    assert "| dpscale/dp8 | failed |" in summary
    names = sorted(p.name for p in (tmp_path / "figs").glob("*.png"))
    assert names == ["loss_dpscale.png", "loss_pipes.png", "pipeline_vs_model_parallel.png",
                     "throughput_vs_dp_sync.png", "throughput_vs_gpus.png", "time_vs_gpus.png"]
    for name in names:
        width, height = png_size(tmp_path / "figs" / name)
        assert width >= 400 and height >= 300


def test_figure_without_data_is_skipped_not_written(tmp_path: Path) -> None:
    dp_run(tmp_path / "runs" / "one", [100.0])
    result = report(tmp_path / "runs", tmp_path / "out", now=LATER)
    assert not (tmp_path / "out" / "pipeline_vs_model_parallel.png").exists()
    assert any("pipeline_vs_model_parallel.png skipped" in s for s in result.skipped)
    assert {p.name for p in result.figures} == {"time_vs_gpus.png", "throughput_vs_gpus.png", "loss_top-level.png"}


def test_top_level_runs_group_into_sweeps_by_common_config(tmp_path: Path) -> None:
    dp_run(tmp_path / "a1", [100.0], **{"model.preset": "gpt2-tiny"})
    dp_run(tmp_path / "a2", [90.0, 90.0], **{"model.preset": "gpt2-tiny"})
    dp_run(tmp_path / "b1", [50.0], **{"model.preset": "gpt2-mini"})
    dp_run(tmp_path / "b2", [50.0, 50.0], **{"model.preset": "gpt2-mini"})
    by = {m.run: m for m in report(tmp_path, tmp_path / "out", now=LATER).runs}
    assert by["a1"].sweep == by["a2"].sweep != by["b1"].sweep == by["b2"].sweep
    assert by["a2"].speedup == pytest.approx(1.8) and by["b2"].speedup == pytest.approx(2.0)


def test_worker_processes_give_the_serial_answer(tmp_path: Path) -> None:
    sweep_set(tmp_path)
    serial = analyse_runs(tmp_path, now=LATER, workers=1)
    parallel = analyse_runs(tmp_path, now=LATER, workers=2)
    assert [(m.run, m.tokens_per_s, m.job_tokens_per_s, m.loss_curve) for m in serial] == \
           [(m.run, m.tokens_per_s, m.job_tokens_per_s, m.loss_curve) for m in parallel]


def test_mfu_for_a_known_gpu_and_na_for_an_unknown_one(tmp_path: Path) -> None:
    v100 = {"device_name": "Tesla V100-SXM2-32GB"}
    rank = Rank(tmp_path / "gpu", 0, config(), device="cuda:0", **v100).header()
    for step in range(1, 8):
        rank.step(step, 1, tokens_per_s=1e6)
    rank.final(step=7)
    Rank(tmp_path / "odd", 0, config(), device="cuda:0", device_name="Quantum X1").header().step(1).final(step=1)
    by = metrics(tmp_path)
    # gpt2-tiny, seq_len 128: N = 4*(12*128^2 + 13*128) + 2*128 = 793344; 12*L*H*Q*T = 786432.
    assert flops_per_token(4, 128, 4, 128) == 6 * 793344 + 786432
    assert by["gpu"].mfu == pytest.approx(1e6 * (6 * 793344 + 786432) / 15.7e12)
    assert by["odd"].mfu is None and by["odd"].mfu_note == "n/a (unknown peak for Quantum X1)"


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
