"""Figures a reader trusts: file names used once and counted truly, series by the keys that matter with short
legends outside the axes, axes from 0 that say what they count, error bars that say what they are, the speedup
figure with its ideals and without flagged results, loss against tokens and time, formats and dpi, and no
matplotlib warning reaching the user. Each figure is inspected as drawn (analysis.canvas.write is wrapped)."""

from __future__ import annotations

import csv
import re
import struct
import warnings
from pathlib import Path

import pytest
from logsets import T0, Rank, classify_run, config, dp_run, engine_run
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

import analysis.canvas as canvas
import analysis.figures as figures
from analysis.canvas import FigureSet
from analysis.report import analyse_runs, report, run_table
from gptpar.cli import main as gptpar_main
from gptpar.errors import GptparError

LATER = T0 + 3600.0


def legend_labels(fig: Figure) -> list[str]:
    return [text.get_text() for legend in fig.legends for text in legend.get_texts()]


def titles(fig: Figure) -> str:
    return " ".join([ax.get_title() for ax in fig.axes] + ([fig._suptitle.get_text()] if fig._suptitle else []))


def footer(fig: Figure) -> str:
    """The notes under a figure (error bars, what was left out), on one line."""
    return " ".join(fig._supxlabel.get_text().split()) if fig._supxlabel else ""


def dashed(ax) -> list[tuple[list[float], list[float]]]:
    return [(list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines() if line.get_linestyle() == "--"]


def points(ax) -> list[tuple[list[float], list[float]]]:
    """The marker lines of an axes' error-bar series (marker o, drawn with a solid or no line)."""
    return [(list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()
            if line.get_marker() == "o" and line.get_linestyle() in ("-", "None") and line.get_markersize() < 10]


def png_width(path: Path) -> int:
    return struct.unpack(">I", path.read_bytes()[16:20])[0]


def pipeline_sweep(runs: Path) -> None:
    """Sweep pp: model parallel at 100 tokens/s against the pipeline at 1, 2, 4 chunks (150, 130, 150: chunks=1 at
    1.5x is flagged)."""
    pipe = {"devices": "cpu,cpu"}
    dp_run(runs / "pp" / "mp", [100.0], pp_mode="model_parallel", **pipe)
    for chunks, rate in ((1, 150.0), (2, 130.0), (4, 150.0)):
        dp_run(runs / "pp" / f"m{chunks}", [rate], pp_mode="pipeline_parallel", chunks=chunks, **pipe)


MOE_STEPS = [(2.4, 300.0), (2.2, 250.0), (2.1, 200.0)]  # (aux_loss, the busiest expert's tokens) of 100 on average


def moe_run(run_dir: Path, all_to_all_shares: tuple[float, ...] = ()) -> None:
    """Ranks of a mixture of experts whose steps log aux_loss and the expert load (MOE_STEPS): one, or with experts
    split (parallel.ep) one per share, whose steps of 2 s each spend that share in all-to-all."""
    overrides = {"model.preset": "qwen2-moe-tiny"}
    if all_to_all_shares:
        overrides |= {"parallel.dp": len(all_to_all_shares), "parallel.ep": len(all_to_all_shares)}
    for r, share in enumerate(all_to_all_shares or (None,)):
        rank = Rank(run_dir, r, config(name=run_dir.name, **overrides)).header()
        for step, (aux, busiest) in enumerate(MOE_STEPS, 1):
            rank.step(step, step_time_s=2.0, aux_loss=aux, **({} if share is None else {"comm_s": {
                "all_to_all": 2.0 * share}}),
                moe={"tokens_per_expert": {"min": 50.0, "max": busiest, "mean": 100.0}, "dropped": 0})
        rank.epoch(1, 10.0, 100.0, steps=len(MOE_STEPS)).final(step=len(MOE_STEPS))


def test_the_expert_load_figure_draws_the_logged_aux_loss_and_the_busiest_over_the_mean(
        tmp_path: Path, drawn: dict[str, Figure]) -> None:
    moe_run(tmp_path / "runs" / "moe" / "qwen-moe")
    report(tmp_path / "runs", tmp_path / "out", now=LATER)
    aux, load = drawn["expert_load_moe.png"].axes
    assert list(aux.get_lines()[0].get_ydata()) == [2.4, 2.2, 2.1]
    assert list(load.get_lines()[0].get_xdata()) == [1, 2, 3]
    assert list(load.get_lines()[0].get_ydata()) == [3.0, 2.5, 2.0]  # max / mean; the dotted line at 1 is balance


def test_expert_parallelism_adds_the_all_to_all_share_of_each_step_and_the_run(tmp_path: Path,
                                                                              drawn: dict[str, Figure]) -> None:
    """Two ranks spend 1/4 and 1/2 of every step in all-to-all: the figure draws rank 0's quarter per step, the
    summary the mean over ranks, 3/8; a run without expert parallelism has neither."""
    moe_run(tmp_path / "runs" / "moe" / "ep2", all_to_all_shares=(0.25, 0.5))
    moe_run(tmp_path / "runs" / "moe" / "ep1")
    report(tmp_path / "runs", tmp_path / "out", now=LATER)
    axes = drawn["expert_load_moe.png"].axes
    assert len(axes) == 3 and axes[2].get_ylabel() == "share of the step in all-to-all (rank 0)"
    shares = {tuple(line.get_ydata()) for line in axes[2].get_lines()}
    assert (0.25, 0.25, 0.25) in shares and all(all(v != v for v in ys) for ys in shares - {(0.25, 0.25, 0.25)})
    with (tmp_path / "out" / "summary.csv").open() as f:
        rows = {row["run"]: row["all_to_all_share"] for row in csv.DictReader(f)}
    assert float(rows["moe/ep2"]) == 0.375 and rows["moe/ep1"] == ""


def rich_set(runs: Path) -> None:
    """Runs that draw every figure but one (a swept key besides the GPU count): a DP sweep with
    repeats, BLEU and memory records, an sft run with answer accuracy, a mixture of experts' run, the pipeline sweep,
    an engine sweep and a classifier's sweep (accuracy: the methods side by side)."""
    for i, rate in enumerate((90.0, 95.0)):
        dp_run(runs / "dp" / f"dp1-r{i}", [100.0], bleu=[10.0, 15.0], memory=[(1000, 4000, 4000, 8000)],
               **{"launch.repeat": i})
        dp_run(runs / "dp" / f"dp2-r{i}", [rate, rate], bleu=[11.0, 17.0], memory=[(1000, 4000, 4000, 4000)] * 2,
               **{"launch.repeat": i, "parallel.dp_sync": "zero1"})
    dp_run(runs / "sft" / "qwen", [100.0], answer_accuracy=[0.25, 0.5], **{"data.task": "sft"})
    moe_run(runs / "moe" / "qwen-moe")
    pipeline_sweep(runs)
    for chunks in (2, 4):
        engine_run(runs / "eng" / f"m{chunks}", [0.3, 0.2], chunks=chunks)
    for dp in (1, 2):
        classify_run(runs / "vit" / f"dp{dp}", dp, 1.0, {4: (0.5, 0.9)}, peaks=(10**9,) * dp)


def test_figure_names_are_unique_and_their_count_is_the_files(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    long = "a-sweep-whose-name-runs-on-" * 5  # 135 characters shared by four sweeps
    for i in range(4):
        dp_run(tmp_path / "runs" / f"{long}{i}" / "dp1", [100.0])
    dp_run(tmp_path / "runs" / "adhoc", [100.0])
    assert gptpar_main(["report", str(tmp_path / "runs"), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    count, = re.findall(r"figures: (\d+) in", out)
    files = sorted(p.name for p in (tmp_path / "out").iterdir() if p.suffix == ".png")
    listed = sorted(line.strip() for line in out.split("figures:")[1].splitlines()[1:])
    assert int(count) == len(files) == len(listed) and listed == files
    losses = [name for name in files if name.startswith("loss_")]
    assert len(losses) == 5 and "loss_top-level.png" in losses
    assert max(len(name) for name in files) <= len("loss_") + canvas.NAME_MAX + len(".png")


def test_a_name_written_twice_in_one_report_gets_a_hash(tmp_path: Path) -> None:
    figs = FigureSet(tmp_path)
    for identity in ("one", "two"):
        with canvas.plt.rc_context(canvas.STYLE):
            figs.save(canvas.plt.figure(), "same", identity)
    assert figs.written[0].name == "same.png" and re.fullmatch(r"same-[0-9a-f]{8}\.png", figs.written[1].name)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in figs.written)


def test_runs_that_differ_only_in_length_or_evaluation_are_one_series(tmp_path: Path,
                                                                      drawn: dict[str, Figure]) -> None:
    dp_run(tmp_path / "s" / "dp1", [100.0])
    dp_run(tmp_path / "s" / "dp2", [90.0, 90.0], **{"train.max_steps": 40, "train.eval_every": 5})
    dp_run(tmp_path / "s" / "dp4", [80.0] * 4, **{"train.eval_batches": 2, "train.epochs": 3})
    report(tmp_path, tmp_path / "out", now=LATER)
    assert legend_labels(drawn["throughput_vs_gpus.png"]) == ["ideal: linear from a line's first point", "s"]
    assert points(drawn["throughput_vs_gpus.png"].axes[0]) == [([1, 2, 4], [100.0, 180.0, 320.0])]
    report(tmp_path, tmp_path / "out", now=LATER, group_by=["train.max_steps"])
    assert legend_labels(drawn["throughput_vs_gpus.png"])[1:] == ["max_steps=0", "max_steps=40"]


def test_x_and_group_by_name_the_axis_and_the_lines(tmp_path: Path, drawn: dict[str, Figure]) -> None:
    for dp in (1, 2):
        for bucket in (1.0, 25.0):
            dp_run(tmp_path / "runs" / "b" / f"dp{dp}-{bucket:g}", [100.0 - bucket] * dp,
                   **{"parallel.bucket_mb": bucket})
    argv = ["report", str(tmp_path / "runs"), "--out", str(tmp_path / "out"), "--x", "parallel.bucket_mb"]
    assert gptpar_main([*argv, "--group-by", "sweep,gpus"]) == 0
    fig = drawn["throughput_vs_bucket_mb.png"]
    assert legend_labels(fig) == ["ranks=1", "ranks=2"] and fig.axes[0].get_xlabel() == "parallel.bucket_mb"
    assert points(fig.axes[0]) == [([1.0, 25.0], [99.0, 75.0]), ([1.0, 25.0], [198.0, 150.0])]
    assert {"time_vs_bucket_mb.png", "speedup_vs_bucket_mb.png"} <= set(drawn)
    assert "throughput_vs_gpus.png" not in drawn


@pytest.mark.parametrize("option, message", [
    (["--group-by", "parallel.nope"], "gptpar: error: --group-by 'parallel.nope': not a config key of any run "
                                      "(section.key, such as parallel.dp_sync) nor one of gpus, sweep"),
    (["--x", "bucket_mb"], "gptpar: error: --x 'bucket_mb': not a config key of any run (section.key, such as "
                           "parallel.dp_sync) nor one of gpus, sweep"),
])
def test_an_unknown_key_is_one_line_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                       option: list[str], message: str) -> None:
    dp_run(tmp_path / "runs" / "r", [100.0])
    assert gptpar_main(["report", str(tmp_path / "runs"), "--out", str(tmp_path / "out"), *option]) == 2
    assert capsys.readouterr().err.strip() == message
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("option, message", [
    (["--format", "jpg"], "gptpar: error: --format 'jpg': figures are written as png, pdf, svg"),
    (["--dpi", "0"], "gptpar: error: --dpi 0: figures are drawn at 10 to 600 dots per inch"),
    (["--dpi", "-5"], "gptpar: error: --dpi -5: figures are drawn at 10 to 600 dots per inch"),
])
def test_a_bad_format_or_dpi_is_one_line_before_any_run_is_read(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                                option: list[str], message: str) -> None:
    # The runs folder does not exist: the option is refused before the runs are looked for.
    assert gptpar_main(["report", str(tmp_path / "nowhere"), "--out", str(tmp_path / "out"), *option]) == 2
    assert capsys.readouterr().err.strip() == message
    with pytest.raises(GptparError, match="--format 'gif'"):
        report(tmp_path / "nowhere", tmp_path / "out", fmt="gif")


def test_figures_in_each_format_and_dpi(tmp_path: Path) -> None:
    dp_run(tmp_path / "runs" / "s" / "dp1", [100.0])
    dp_run(tmp_path / "runs" / "s" / "dp2", [90.0, 90.0])
    out = tmp_path / "out"
    for fmt, magic in (("svg", b"<?xml"), ("pdf", b"%PDF")):
        result = report(tmp_path / "runs", out, now=LATER, fmt=fmt)
        assert result.figures and all(p.suffix == f".{fmt}" and p.read_bytes().startswith(magic)
                                      for p in result.figures)
    assert not list(out.glob("*.svg"))  # the pdf report removed the svg figures it replaced
    widths = {dpi: png_width(report(tmp_path / "runs", tmp_path / f"out{dpi}", now=LATER, dpi=dpi).figures[0])
              for dpi in (100, 200)}
    assert widths[200] / widths[100] == pytest.approx(2.0, rel=0.03)


def test_scaling_axes_start_at_zero_and_count_ranks_or_gpus(tmp_path: Path, drawn: dict[str, Figure]) -> None:
    for device, sweep in (("cpu", "cpus"), ("cuda:0", "gpus")):
        dp_run(tmp_path / sweep / "r" / "dp1", [100.0], device=device)
        dp_run(tmp_path / sweep / "r" / "dp2", [90.0, 90.0], device=device)
        report(tmp_path / sweep, tmp_path / f"out-{sweep}", now=LATER)
        counted, word = ("ranks (CPU processes)", "ranks") if device == "cpu" else ("GPUs", "GPUs")
        for name in ("time_vs_gpus.png", "throughput_vs_gpus.png"):
            ax = drawn[name].axes[0]
            assert ax.get_ylim()[0] == 0.0
            assert ax.get_xlabel() == f"{counted}: data-parallel ranks × devices per replica"
        assert titles(drawn["throughput_vs_gpus.png"]).startswith(f"Throughput vs {word} (grey dashed: ideal")
        ratio = "ideal: rank ratio" if device == "cpu" else "ideal: GPU ratio"  # a CPU figure names no GPU
        assert ratio in legend_labels(drawn["speedup_vs_gpus.png"])
        assert drawn["speedup_vs_gpus.png"].axes[1].get_ylabel() == f"efficiency (speedup / {ratio[7:]})"


def test_error_bars_say_what_they_are(tmp_path: Path, drawn: dict[str, Figure]) -> None:
    dp_run(tmp_path / "one" / "s" / "dp1", [100.0])
    report(tmp_path / "one", tmp_path / "out", now=LATER)
    assert "error bars: ± sample std over its kept epochs (or steps)" in footer(drawn["throughput_vs_gpus.png"])
    for i in range(3):
        dp_run(tmp_path / "rep" / "s" / f"dp1-r{i}", [100.0 + 10 * i], **{"launch.repeat": i})
    report(tmp_path / "rep", tmp_path / "out", now=LATER)
    fig = drawn["throughput_vs_gpus.png"]
    assert "error bars: min-max over the 3 runs at a point (its repeats), marker at their mean" in footer(fig)
    assert "error bars" not in titles(fig)
    caps = sorted(y for line in fig.axes[0].get_lines() if line.get_marker() == "_" for y in line.get_ydata())
    assert caps == [100.0, 120.0] and points(fig.axes[0]) == [([1], [110.0])]


def test_the_speedup_figure_has_its_ideals_and_leaves_flagged_results_out(tmp_path: Path,
                                                                        drawn: dict[str, Figure]) -> None:
    dp_run(tmp_path / "sup" / "dp1", [100.0])
    dp_run(tmp_path / "sup" / "dp2", [120.0, 120.0])  # 120% efficient: flagged
    dp_run(tmp_path / "sup" / "dp4", [90.0] * 4)
    report(tmp_path, tmp_path / "out", now=LATER)
    fig = drawn["speedup_vs_gpus.png"]
    speed, efficiency = fig.axes
    assert points(speed) == [([1, 4], [1.0, 3.6])] and dashed(speed) == [([1, 4], [1.0, 4.0])]
    assert points(efficiency) == [([1, 4], [1.0, 0.9])] and dashed(efficiency) == [([0, 1], [1.0, 1.0])]
    assert "⚠ flagged, not plotted: dp2 (see summary.md)" in footer(fig)
    # The ideals are in their own style, labelled, above the data so that a run on them hides nothing.
    ideal = next(line for line in speed.get_lines() if line.get_label() == "ideal: rank ratio")  # CPU ranks
    data = max(line.get_zorder() for line in speed.get_lines() if line.get_marker() == "o")
    assert (ideal.get_color(), ideal.get_linestyle(), ideal.get_zorder() > data) == ("grey", "--", True)
    assert "ideal: 100%" in [line.get_label() for line in efficiency.get_lines()]
    # Beside the throughput speedup, the time-to-target one (squares): every run reaches validation loss 2.0 at
    # step 2, dp4's steps take 100/90 s, so it gets there 0.9x as fast as dp1.
    squares = [(list(line.get_xdata()), list(line.get_ydata())) for line in speed.get_lines()
               if line.get_marker() == "s"]
    assert squares == [([1, 4], [1.0, pytest.approx(0.9)])]
    assert "time to target (squares, dotted)" in legend_labels(fig)
    # Where its throughput is drawn, the flagged point is ringed.
    rings = [line for line in drawn["throughput_vs_gpus.png"].axes[0].get_lines() if line.get_markersize() >= 10]
    assert [list(line.get_xdata()) for line in rings] == [[2]]


def test_the_pipeline_figure_compares_with_model_parallel_and_its_bound(tmp_path: Path,
                                                                        drawn: dict[str, Figure]) -> None:
    pipeline_sweep(tmp_path)
    report(tmp_path, tmp_path / "out", now=LATER)
    fig = drawn["pipeline_vs_model_parallel.png"]
    time_ax, rate_ax, speed_ax, bubble_ax = fig.axes
    assert all(ax.get_ylim()[0] == 0.0 for ax in (time_ax, rate_ax, speed_ax, bubble_ax))
    assert points(speed_ax) == [([2, 4], [1.3, 1.5])]  # m1 (1.5x at chunks=1) is flagged, not plotted
    assert "flagged, not plotted: m1" in footer(fig)
    bound, = dashed(speed_ax)
    assert bound == ([1, 2, 3, 4], pytest.approx([1.0, 4 / 3, 1.5, 1.6]))  # p*m/(m+p-1), p = 2
    closed, = dashed(bubble_ax)
    assert closed == ([1, 2, 3, 4], pytest.approx([1 / 2, 1 / 3, 1 / 4, 1 / 5]))  # (p-1)/(m+p-1)
    # Both in the reference style, not the series' colour, and named in the legend.
    assert {line.get_color() for ax in (speed_ax, bubble_ax) for line in ax.get_lines()
            if line.get_linestyle() == "--"} == {"grey"}
    assert {"bound: p·m/(m+p-1)", "closed form: (p-1)/(m+p-1)"} <= set(legend_labels(fig))
    assert [line.get_ydata()[0] for line in rate_ax.get_lines() if line.get_linestyle() == "--"] == [100.0]


def test_loss_is_drawn_against_steps_tokens_and_time(tmp_path: Path, drawn: dict[str, Figure]) -> None:
    dp_run(tmp_path / "s" / "dp2", [100.0, 50.0])  # 200 tokens a step; the slower rank's steps take 2 s
    report(tmp_path, tmp_path / "out", now=LATER)
    steps, tokens, seconds = drawn["loss_s.png"].axes
    assert [list(ax.get_lines()[0].get_xdata()) for ax in (steps, tokens, seconds)] == [
        [1, 2, 3, 4], [200, 400, 600, 800], [2.0, 4.0, 6.0, 8.0]]
    assert list(seconds.get_lines()[1].get_xdata()) == [4.0, 8.0]  # validation at the epochs' last steps
    assert all(float(tick).is_integer() for tick in steps.get_xticks())


def test_every_figure_draws_without_a_warning_and_with_its_legend_outside_the_axes(
        tmp_path: Path, drawn: dict[str, Figure], recwarn: pytest.WarningsRecorder) -> None:
    rich_set(tmp_path / "runs")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = report(tmp_path / "runs", tmp_path / "out", now=LATER)
    assert not recwarn.list and not any("matplotlib warned" in message for message in result.skipped)
    assert {p.name for p in result.figures} == set(drawn) and len(drawn) == 19
    assert {"answer_accuracy_sft.png", "loss_sft.png", "expert_load_moe.png", "loss_moe.png", "comparison_vit.png",
            "loss_vit.png"} <= set(drawn)
    assert [message.split(":")[0] for message in result.skipped] == ["figure communication_*.png skipped",
                                                                      "figure throughput_vs_<axis>.png skipped"]
    for name, fig in drawn.items():
        # Every title is one line: notes such as what the error bars are stand under the figure.
        assert not any("\n" in title for title in [*(ax.get_title() for ax in fig.axes), titles(fig)]), name
        renderer = FigureCanvasAgg(fig).get_renderer()  # a closed figure has lost its canvas
        fig.draw(renderer)
        right = max(ax.get_window_extent(renderer).x1 for ax in fig.axes)
        legends = [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend())]
        assert legends, name
        assert all(legend.get_window_extent(renderer).x0 >= right - 1 for legend in legends), name


def test_a_warning_matplotlib_raises_becomes_a_line_of_the_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   recwarn: pytest.WarningsRecorder) -> None:
    def noisy(runs, figs) -> bool:
        warnings.warn("Glyph 9888 missing from font(s) DejaVu Sans.", UserWarning, stacklevel=1)
        return True

    dp_run(tmp_path / "runs" / "r", [100.0])
    monkeypatch.setattr(figures, "_losses", noisy)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = report(tmp_path / "runs", tmp_path / "out", now=LATER)
    assert "figure loss_*.png: matplotlib warned: Glyph 9888 missing from font(s) DejaVu Sans." in result.skipped
    assert not recwarn.list


def test_closed_forms_that_coincide_are_drawn_once_with_both_names(tmp_path: Path, drawn: dict[str, Figure]) -> None:
    for schedule in ("1f1b", "gpipe"):  # both (P-1)/(m+P-1)
        for chunks in (2, 4):
            engine_run(tmp_path / "s" / f"{schedule}{chunks}", [0.3, 0.2], chunks=chunks, pp_schedule=schedule)
    report(tmp_path, tmp_path / "out", now=LATER, warmup_steps=0)
    ax, = drawn["pipeline_bubble.png"].axes
    forms = [line for line in ax.get_lines() if line.get_label().startswith("closed form")]
    assert [line.get_label() for line in forms] == ["closed form: 1f1b P=2, gpipe P=2"]
    assert list(forms[0].get_ydata()) == pytest.approx([1 / 3, 1 / 4, 1 / 5]) and forms[0].get_color() == "grey"


def test_repeats_with_identical_losses_are_one_line_that_says_how_many(tmp_path: Path,
                                                                      drawn: dict[str, Figure]) -> None:
    for i in range(3):  # bit-identical repeats: the same losses at the same steps and tokens
        dp_run(tmp_path / "s" / f"dp2-r{i}", [100.0, 100.0 - i], **{"launch.repeat": i})
    dp_run(tmp_path / "s" / "dp1", [100.0], **{"launch.repeat": 0})  # another point: its own line
    report(tmp_path, tmp_path / "out", now=LATER)
    fig = drawn["loss_s.png"]
    curves = [[line for line in ax.get_lines() if line.get_linestyle() == "-"] for ax in fig.axes]
    assert [len(lines) for lines in curves] == [2, 2, 4]  # against time each repeat keeps its line: times differ
    assert sorted(legend_labels(fig)) == ["ranks=1", "ranks=2 (3 runs: identical losses)"]


def test_memory_figures_name_no_strategy_for_one_replica_and_are_drawn_only_where_the_layout_varies(
        tmp_path: Path, drawn: dict[str, Figure]) -> None:
    whole = (1000, 4000, 4000, 8000)  # 16 bytes per parameter: the whole model's state
    for chunks in (2, 4):  # one-process pipelines, one replica: parallel.dp_sync (bucketed) wraps nothing
        dp_run(tmp_path / "pp" / "runs" / f"m{chunks}", [100.0], memory=[whole], pp_mode="pipeline_parallel",
               chunks=chunks, devices="cpu,cpu")
    result = report(tmp_path / "pp" / "runs", tmp_path / "pp" / "out", now=LATER)
    assert {"memory_per_rank.png", "memory_vs_world_size.png"}.isdisjoint(drawn)
    assert any(s.startswith("figure memory_per_rank.png skipped: no two runs") for s in result.skipped)
    assert "| m2 | none (one replica) | 1 |" in result.summary_md.read_text()

    dp_run(tmp_path / "dp" / "runs" / "dp1", [100.0], memory=[whole], **{"parallel.dp_sync": "zero1"})
    dp_run(tmp_path / "dp" / "runs" / "dp2", [100.0] * 2, memory=[(1000, 4000, 4000, 4000)] * 2,
           **{"parallel.dp_sync": "zero1"})
    report(tmp_path / "dp" / "runs", tmp_path / "dp" / "out", now=LATER)
    groups = [text.get_text() for text in drawn["memory_per_rank.png"].axes[0].texts]
    assert groups == ["none (one replica)\nW=1", "zero1\nW=2"]
    line, = [line for line in drawn["memory_vs_world_size.png"].axes[0].get_lines() if line.get_label() == "zero1"]
    assert list(line.get_xdata()) == [1, 2]  # one replica starts the line of the strategy: the whole model at W=1
    assert "bucketed" not in legend_labels(drawn["memory_vs_world_size.png"])


def test_an_offloaded_runs_bar_stacks_its_host_state_up_to_its_closed_form(tmp_path: Path,
                                                                           drawn: dict[str, Figure]) -> None:
    """zero2, N = 1000, W = 2, parallel.offload=optimizer: the device's 4N + 4N/2 and the host's 16N/2 together reach
    the closed form 14N (a bar without the host part would stop at 6 kB, under its black line)."""
    dp_run(tmp_path / "runs" / "plain", [100.0] * 2, memory=[(1000, 4000, 4000, 4000)] * 2,
           **{"parallel.dp_sync": "zero1"})  # another strategy: the figure compares ways of holding the state
    dp_run(tmp_path / "runs" / "moved", [100.0] * 2, memory=[(1000, 4000, 2000, 0)] * 2,
           memory_fields={"host_bytes": 8000}, **{"parallel.dp_sync": "zero2", "parallel.offload": "optimizer"})
    report(tmp_path / "runs", tmp_path / "out", now=LATER)
    ax = drawn["memory_per_rank.png"].axes[0]
    tops = {round(bar.get_x() + bar.get_width() / 2): bar.get_y() + bar.get_height() for bar in ax.patches}
    assert sorted(tops.values()) == pytest.approx([0.012, 0.014])  # MB: zero1's 12N; 6N + 8N of the offloaded run
    assert "on the host" in legend_labels(drawn["memory_per_rank.png"])


def test_the_report_of_one_run_folder_is_that_runs(tmp_path: Path) -> None:
    dp_run(tmp_path / "runs" / "tr1", [100.0])
    dp_run(tmp_path / "runs" / "other", [50.0])
    assert [(m.run, m.sweep) for m in analyse_runs(tmp_path / "runs" / "tr1", now=LATER)] == [("tr1", "top-level")]


def test_runs_outside_a_sweep_are_listed_not_compared(tmp_path: Path, drawn: dict[str, Figure]) -> None:
    """Two ad-hoc runs that differ in their tokenizer are no tokenizer axis, and two of one config are no repeats;
    --group-by asks for the comparison."""
    for name, tokenizer in (("a", "gpt2"), ("b", "bytes"), ("c", "bytes")):
        dp_run(tmp_path / "runs" / name, [100.0 if name != "c" else 80.0], **{"data.tokenizer": tokenizer})
    _, shown = run_table(tmp_path / "runs", now=LATER)
    (tmp_path / "out").mkdir()
    assert [(m.run, m.repeats) for m in shown] == [("a", 1), ("b", 1), ("c", 1)]
    assert not figures._axes(shown, FigureSet(tmp_path / "out"))
    assert figures._axes(shown, FigureSet(tmp_path / "out", group_by=("data.tokenizer",)))
    assert list(drawn) == ["throughput_vs_tokenizer.png"]


def test_the_bleu_legend_names_runs_and_test_bleu_is_drawn(tmp_path: Path, drawn: dict[str, Figure]) -> None:
    for name in ("a", "b"):  # runs that differ in their data files only
        dp_run(tmp_path / "runs" / "mt" / name, [100.0], bleu=[12.5, 20.0], test_bleu=[11.0, 18.5],
               **{"data.source": f"tsv:{tmp_path}/data/{name}.tsv"})
    _, shown = run_table(tmp_path / "runs", now=LATER)
    (tmp_path / "out").mkdir()
    with canvas.plt.rc_context(canvas.STYLE):
        assert figures._scores(shown, FigureSet(tmp_path / "out"), key="bleu", label="BLEU")
    fig = drawn["bleu_mt.png"]
    assert legend_labels(fig) == ["a", "a: test split", "b", "b: test split"]
    test_line = next(line for line in fig.axes[1].get_lines() if line.get_label() == "a: test split")
    assert list(test_line.get_ydata()) == [11.0, 18.5] and test_line.get_linestyle() == "--"
