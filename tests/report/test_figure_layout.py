"""Figure layout checked by the figures' own geometry (matplotlib's renderer): every title, axis label and legend
inside the figure, no title under another or under a legend, no two tick labels of an axis on each other; and what
the figures say about themselves (lines that coincide, the ideal's unit). Each figure is inspected as drawn."""

from __future__ import annotations

from itertools import combinations
from pathlib import Path

import pytest
from conftest import figures_kept
from logsets import T0, Rank, classify_run, config, dp_run, engine_run
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.transforms import Bbox

import analysis.canvas as canvas
from analysis.report import report
from gptpar.strategies.data_parallel import DP_STRATEGIES, STATE_BYTES

LATER = T0 + 3600.0
N = 1000  # parameters of the memory runs
STRATEGIES = ("naive", "bucketed", "ddp", "zero1", "zero2", "fsdp")  # six lines that all start at W=1


def memory_run(path: Path, strategy: str, w: int) -> None:
    """W ranks of `strategy` whose memory records match its closed form for N parameters."""
    sharded = DP_STRATEGIES[strategy].sharded if w > 1 else ()
    parts = [int(N * size / (w if part in sharded else 1)) for part, size in STATE_BYTES.items()]
    dp_run(path, [100.0] * w, memory=[(N, *parts)] * w, **{"parallel.dp_sync": strategy})


def long_run(path: Path, dp: int, steps: int = 200, tokens: int = 4096, **cfg: object) -> None:
    """A standalone run of dp ranks and many steps of `tokens` a rank: hundreds of thousands of tokens seen."""
    ranks = [Rank(path, r, config(name=path.name, dp=dp, **cfg)).header() for r in range(dp)]
    for step in range(1, steps + 1):
        for rank in ranks:
            rank.step(step, 1, step_time_s=0.7, tokens=tokens, loss=5.0 - step / steps)
    for rank in ranks:
        rank.epoch(1, 0.7 * steps, tokens / 0.7, steps=steps).final(step=steps)


def crowded_set(runs: Path) -> None:
    """A CPU session's runs: a data-parallel sweep with repeats (speedup), six strategies at W = 1, 2, 4 (memory), four
    long standalone runs (loss), an engine sweep (bubble) and sweeps/vit.yaml's six methods (their comparison)."""
    for i in range(2):
        for dp, rate in ((1, 100.0), (2, 90.0), (4, 80.0)):
            dp_run(runs / "dp" / f"dp{dp}-r{i}", [rate + i] * dp, **{"launch.repeat": i})
    # Sweep points are named by their keys (as make demo's are): long ids under bars and in titles.
    memory_run(runs / "mem" / "parallel.dp_sync=naive,launch.gpus=1,launch.repeat=0", "naive", 1)
    for strategy in STRATEGIES:
        for w in (2, 4):
            memory_run(runs / "mem" / f"parallel.dp_sync={strategy},launch.gpus={w},launch.repeat=0", strategy, w)
    # Ad-hoc runs that differ in much: named by those keys, their legend took most of the figure's width.
    for i, (lr, batch, sync, decay) in enumerate(((6e-4, 16, "naive", 0.0), (1e-3, 32, "bucketed", 0.1),
                                                  (2e-3, 8, "ddp", 0.2), (3e-4, 64, "zero1", 0.3))):
        long_run(runs / f"tr{i + 1}", 2, tokens=2048 * (i + 1), **{
            "train.lr": lr, "train.batch_size": batch, "model.n_layer": 2 * (i + 1), "data.seq_len": 64 * (i + 1),
            "parallel.dp_sync": sync, "train.warmup_steps": i, "train.weight_decay": decay})
    for chunks in (2, 8):  # make demo's engine sweep: four schedules, their closed forms in the legend beside
        for schedule, virtual in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb1p", 1)):
            engine_run(runs / "eng" / f"parallel.pp_schedule={schedule},parallel.pp_virtual={virtual},"
                                      f"parallel.chunks={chunks}", [0.4, 0.3], chunks=chunks, pp_schedule=schedule,
                       virtual=virtual)


    methods = (("bucketed", "fp32", False, "block"), ("ddp", "fp32", False, "none"), ("zero2", "fp32", False, "none"),
               ("fsdp", "fp32", False, "none"), ("fsdp2", "fp32", False, "none"), ("fsdp", "int8", True, "none"))
    for i, (dp_sync, wire, hpz, ckpt) in enumerate(methods):
        dp = 1 if i == 0 else 2  # sweep points named by the six keys they vary, as the sweep's are
        classify_run(runs / "vit" / f"m{i}", dp, 1.0 + i / 10, {12: (0.3, 0.6), 24: (0.4 + i / 20, 0.8)}, steps=24,
                     peaks=(10**9,) * dp, **{"parallel.dp_sync": dp_sync, "parallel.grad_comm": wire,
                                              "parallel.param_comm": wire, "parallel.hpz": hpz,
                                              "train.activation_checkpointing": ckpt})


def clash(a: Bbox, b: Bbox) -> bool:
    """Whether two boxes share more than a pixel each way (touching is not overlapping)."""
    return a.x0 < b.x1 - 1 and b.x0 < a.x1 - 1 and a.y0 < b.y1 - 1 and b.y0 < a.y1 - 1


def layout_faults(fig: Figure) -> list[str]:
    """Every title, axis label and legend outside the figure or on another of them, a panel's title wider than its
    panel, every two tick labels of one axis on each other."""
    renderer = FigureCanvasAgg(fig).get_renderer()  # a closed figure has lost its canvas
    fig.draw(renderer)
    whole = fig.bbox
    titles = [(f"axes {i} title", ax.title) for i, ax in enumerate(fig.axes) if ax.get_title()]
    titles += [("figure title", fig._suptitle)] if fig._suptitle else []
    labels = [(f"axes {i} {which} label", label) for i, ax in enumerate(fig.axes)
              for which, label in (("x", ax.xaxis.label), ("y", ax.yaxis.label)) if label.get_text()]
    legends = [(f"legend {i}", legend) for i, legend in enumerate(fig.legends)]
    boxes = {name: artist.get_window_extent(renderer) for name, artist in [*titles, *labels, *legends]}
    faults = [f"{name} outside the figure" for name, box in boxes.items()
              if box.x0 < whole.x0 - 1 or box.x1 > whole.x1 + 1 or box.y0 < whole.y0 - 1 or box.y1 > whole.y1 + 1]
    faults += [f"{a} on {b}" for (a, _), (b, _) in combinations([*titles, *labels, *legends], 2)
               if clash(boxes[a], boxes[b])]
    for i, ax in enumerate(fig.axes):
        title, panel = boxes.get(f"axes {i} title"), ax.get_window_extent(renderer)
        if len(fig.axes) > 1 and title is not None and (title.x0 < panel.x0 - 1 or title.x1 > panel.x1 + 1):
            faults.append(f"axes {i} title wider than its panel")  # it runs into its neighbours and the figure title
        for axis, labels in (("x", ax.get_xticklabels()), ("y", ax.get_yticklabels())):
            ticks = [label.get_window_extent(renderer) for label in labels if label.get_visible() and label.get_text()]
            faults += [f"axes {i}: {axis} tick labels on each other" for a, b in combinations(ticks, 2)
                       if clash(a, b)][:1]
    return faults


@pytest.fixture(scope="module")
def crowded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Figure]:
    """The figures of crowded_set's report, drawn once for the tests that read them."""
    root = tmp_path_factory.mktemp("crowded")
    crowded_set(root / "runs")
    with figures_kept() as kept:
        report(root / "runs", root / "out", now=LATER, workers=1)  # 25 runs: in this process, not a pool
    return kept


def test_no_title_label_legend_or_tick_label_is_clipped_or_covered(crowded: dict[str, Figure]) -> None:
    drawn = crowded
    assert {"speedup_vs_gpus.png", "memory_vs_world_size.png", "loss_top-level.png", "pipeline_bubble.png",
            "memory_per_rank.png", "comparison_vit.png"} <= set(drawn)
    assert any(name.startswith("pipeline_timeline") for name in drawn)
    assert {name: faults for name, fig in drawn.items() if (faults := layout_faults(fig))} == {}


def test_lines_that_coincide_say_so(crowded: dict[str, Figure]) -> None:
    drawn = crowded
    fig = drawn["memory_vs_world_size.png"]
    entries = [text.get_text() for legend in fig.legends for text in legend.get_texts()]
    # naive, bucketed and ddp hold the same state at every W: one line, named for all three.
    assert entries == ["naive = bucketed = ddp (identical)", "zero1", "zero2", "fsdp"]
    assert "W=1: one run of one replica, which holds the whole state under any strategy, starts 4 of the lines" in (
        " ".join(fig._supxlabel.get_text().split()))
    # Standalone runs are named by their run ids.
    assert [text.get_text() for text in drawn["loss_top-level.png"].legends[0].get_texts()] == [
        "tr1", "tr2", "tr3", "tr4"]


def test_a_pipeline_short_of_its_closed_form_says_why(tmp_path: Path, drawn: dict[str, Figure]) -> None:
    runs = tmp_path / "runs"
    dp_run(runs / "pp" / "mp", [100.0], pp_mode="model_parallel", devices="cpu,cpu")
    dp_run(runs / "pp" / "m4", [90.0], pp_mode="pipeline_parallel", chunks=4, devices="cpu,cpu")  # slower than mp
    for chunks in (2, 8):  # both stages idle 0.35 of a step: 1/3 is the closed form at m=2, 1/9 at m=8
        engine_run(runs / "eng" / f"e{chunks}", [0.4, 0.3], chunks=chunks)
    summary = report(runs, tmp_path / "out", now=LATER).summary_md.read_text()
    why = next(line for line in summary.splitlines() if line.startswith("**Why short of the closed form**"))
    assert why.startswith("**Why short of the closed form** (e8 (bubble 0.350 against 0.111 closed form), m4 (0.90× "
                          "model parallel's job tokens/s)): the closed form counts compute alone;")
    assert "per-micro-batch overhead" in why and "point-to-point send" in why
    for name, runs_named in (("pipeline_vs_model_parallel.png", "(m4)"), ("pipeline_bubble.png", "(e8)")):
        note = " ".join(drawn[name]._supxlabel.get_text().split())
        assert f"Short of the closed form {runs_named}: the closed form counts compute alone" in note, name


def test_a_legend_of_long_names_stays_inside_its_figure() -> None:
    """`make demo`'s memory figure named three pipeline lines in one entry 200 characters long: the legend ran over
    the title and off the figure's left edge. Entries wrap instead."""
    import matplotlib.pyplot as plt

    with plt.rc_context(canvas.STYLE):  # the report's style: constrained layout, its size and fonts
        fig, ax = plt.subplots()
    name = "none (one replica) pp=2 gpipe, N=6,698,496"
    ax.plot([1, 2], [1, 2], label=" = ".join([name] * 4) + " (identical)")
    ax.plot([1, 2], [2, 1], label="zero1")
    ax.set_title("Memory per rank vs W (dashed, ×: closed form)")
    canvas.legend(fig)
    try:
        assert layout_faults(fig) == []
    finally:
        plt.close(fig)
