"""Where a report's figures go and the style they share: format and dpi, file names used once, legends outside the
axes, titles of one line with notes (what error bars are, what was left out) under the figure, x axes that say what
they count, and flagged points marked alike."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from textwrap import fill
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.artist import Artist  # noqa: E402

from analysis.aggregate import RunMetrics  # noqa: E402
from analysis.grouping import Mark, order  # noqa: E402
from gptpar.atomic import write_error  # noqa: E402
from gptpar.errors import GptparError  # noqa: E402
from gptpar.run.names import short_hash, slug  # noqa: E402

FORMATS = ("png", "pdf", "svg")
# The canvas is bounded, so no option or data can ask for an image that exhausts memory (at 100000 dpi a figure
# is gigapixels): figures are at most MAX_INCHES on a side, drawn at DPI_RANGE dots per inch.
DPI_RANGE = (10, 600)
MAX_INCHES = 24.0
STYLE = {
    "figure.figsize": (8.0, 4.4), "figure.dpi": 110, "axes.grid": True, "grid.alpha": 0.3,
    "axes.spines.top": False, "axes.spines.right": False, "legend.fontsize": 8, "lines.markersize": 5,
    "figure.constrained_layout.use": True,  # makes room for legends outside the axes
}
NAME_MAX = 60  # characters a sweep, run or key takes in a file name; a longer one is cut and ends in a hash
LEGEND_ROWS = 24  # entries per legend column
FOOTNOTE_WIDTH = 110  # characters per line of a figure's footnote
LEGEND_WIDTH = 40  # characters per line of a legend entry: a longer one wraps, not pushes the legend out
OFF_MARK, OFF_COLOUR = "⚠", "tab:red"  # how figures mark a flagged result
# Ideals and closed forms: one style of their own, above the data (zorder), so a measured line on them hides nothing.
REFERENCE = {"color": "grey", "linestyle": "--", "linewidth": 1.2, "zorder": 3}


@dataclass
class FigureSet:
    """The figures of one report: their folder, format and dpi, how runs are grouped into lines (--x, --group-by),
    and the files written, each name once, so that the count of figures is the count of files."""

    out_dir: Path
    fmt: str = "png"
    dpi: int = 110
    x: str | None = None  # --x; None: the GPU count for data-parallel sweeps, micro-batches for pipelines
    group_by: tuple[str, ...] = ()
    written: list[Path] = field(default_factory=list)

    def __post_init__(self) -> None:
        """A format or dpi the figures cannot have is a user error, found before any run is read."""
        check_format(self.fmt, f"--format {self.fmt!r}")
        if not DPI_RANGE[0] <= self.dpi <= DPI_RANGE[1]:
            raise GptparError(f"--dpi {self.dpi}: figures are drawn at {DPI_RANGE[0]} to {DPI_RANGE[1]} dots per inch")

    def save(self, fig: plt.Figure, stem: str, identity: str = "") -> None:
        """Write and close a figure as <stem>.<format>; a stem already written this report gets a hash of the
        figure's identity (its sweep, run or key), then of the name taken, until the name is new."""
        path = self.out_dir / f"{stem}.{self.fmt}"
        while path in self.written:
            path = self.out_dir / f"{stem}-{short_hash(identity + path.name)}.{self.fmt}"
        write(fig, path, self.dpi)
        self.written.append(path)


def check_format(fmt: str, what: str) -> None:
    """A figure format must be one of FORMATS; `what` names the option that asked for it."""
    if fmt not in FORMATS:
        raise GptparError(f"{what}: figures are written as {', '.join(FORMATS)}")


def figure_size(width: float, height: float) -> tuple[float, float]:
    """A figure's size in inches, for a width and height that grow with the data (actions, ranks, bars), at most
    MAX_INCHES on a side."""
    return min(width, MAX_INCHES), min(height, MAX_INCHES)


def write(fig: plt.Figure, path: Path, dpi: int | None = None) -> None:
    """Save a figure (its format from the path's suffix) and close it; constrained layout keeps the legends outside
    the axes inside the figure, so one draw suffices (a tight bounding box would draw it twice)."""
    try:
        fig.savefig(path, dpi=dpi or "figure")
    except OSError as exc:  # a full disk: the writer's error does not name the file
        raise write_error(path, exc) from None
    finally:
        plt.close(fig)


def stem(prefix: str, text: str) -> str:
    """A file stem for a figure about `text` (a sweep, run or key): safe characters, cut to NAME_MAX with a hash."""
    return f"{prefix}_{slug(text, NAME_MAX)}"


def legend(fig: plt.Figure, handles: Sequence[Artist] = (), labels: Sequence[str] = ()) -> None:
    """One legend for the whole figure, outside its axes on the right: the given entries, else every axes' labelled
    artists, each label once, wrapped at LEGEND_WIDTH (constrained layout cannot make room for an entry wider than
    the figure: it spilled over the title and off the left edge)."""
    entries = dict(zip(labels, handles, strict=True))
    if not entries:
        for ax in fig.axes:
            for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
                entries.setdefault(label, handle)
    if entries:
        fig.legend(list(entries.values()), [fill(label, LEGEND_WIDTH) for label in entries], loc="outside right upper",
                   frameon=False, ncols=1 + (len(entries) - 1) // LEGEND_ROWS)


def footnote(fig: plt.Figure, *notes: str) -> None:
    """Notes under the figure (what its error bars are, what was left out), so that every title stays one line;
    constrained layout makes room for them as it does for an x label."""
    text = "\n".join(fill(note, FOOTNOTE_WIDTH) for note in notes if note)
    if text:
        fig.supxlabel(text, x=0.01, ha="left", fontsize=8)


def error_note(points: Sequence[Mark], one_run: str) -> str:
    """What a figure's error bars are: min-max over the runs of a point where it has several (repeats), and
    `one_run` (what a point of one run shows) where it has one."""
    counts = sorted({len(m.runs) for m in points if m.repeated})
    if not counts:
        return f"error bars: {one_run}"
    n = str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    note = f"error bars: min-max over the {n} runs at a point (its repeats), marker at their mean"
    return note + (f"; a point of one run: {one_run}" if any(not m.repeated for m in points) else "")


def x_name(runs: list[RunMetrics], x: str) -> str:
    """What the x axis counts, in a title: the key, or GPUs or ranks (CPU processes) for the GPU count."""
    if x != "gpus":
        return x
    on_gpu = {r.on_gpu for r in runs}
    return "GPUs" if on_gpu == {True} else "ranks" if on_gpu == {False} else "GPUs or CPU ranks"


def x_label(runs: list[RunMetrics], x: str) -> str:
    """The x axis of a figure: the key, or for the GPU count what it counts on these runs' devices."""
    if x != "gpus":
        return x
    devices = x_name(runs, x)
    return f"{'ranks (CPU processes)' if devices == 'ranks' else devices}: data-parallel ranks × devices per replica"


def categorical(values: Sequence[Any]) -> bool:
    """Whether an axis of these values has categories (text), drawn as bars, not a line between numbers."""
    return any(order(v)[0] for v in values)


def x_positions(ax: plt.Axes, values: list[Any], rank: Callable[[Any], Any] = order) -> Callable[[Any], float]:
    """Ticks at every x value; numbers stand at their value, categories at 0, 1, 2... in the order `rank` gives
    (grouping.category_order: fp32 first for a wire type)."""
    values = sorted(set(values), key=rank)
    if not categorical(values):
        ax.set_xticks(values)
        return float
    ax.set_xticks(range(len(values)), [str(v) for v in values])
    return values.index


def bar_x(position: float, slot: tuple[int, int]) -> float:
    """The centre of series slot[0]'s bar, of slot[1] series sharing a category's width of 0.8 at `position`."""
    index, count = slot
    return position - 0.4 + 0.8 / count * (index + 0.5)


def draw_bars(ax: plt.Axes, points: list[Mark], at: Callable[[Any], float], slot: tuple[int, int] = (0, 1),
              **style: Any) -> str:
    """A series' points as bars at their categories (slot: this series' index among the series, which share each
    category's width), with their error bars; the bars' colour."""
    xs = [bar_x(at(m.x), slot) for m in points]
    bars = ax.bar(xs, [m.y for m in points], 0.8 / slot[1], yerr=[[m.y - m.low for m in points],
                                                           [m.high - m.y for m in points]], capsize=3, **style)
    return bars.patches[0].get_facecolor() if bars.patches else "black"


def draw_marks(ax: plt.Axes, points: list[Mark], at: Callable[[Any], float], ring: bool = False,
               **style: Any) -> str:
    """A series' points with their error bars, with `ring` the points of flagged results ringed; the line's
    colour."""
    xs = [at(m.x) for m in points]
    ys = [m.y for m in points]
    errors = [[m.y - m.low for m in points], [m.high - m.y for m in points]]
    colour = ax.errorbar(xs, ys, yerr=errors, capsize=3, **{"marker": "o", **style})[0].get_color()
    flagged = [(x, m.y) for x, m in zip(xs, points, strict=True) if any(r.flag for r in m.runs)]
    if ring and flagged:
        ax.plot(*zip(*flagged, strict=True), marker="o", markersize=12, markerfacecolor="none", linestyle="none",
                markeredgecolor=OFF_COLOUR, label=f"{OFF_MARK} breaks a physical bound (see summary.md)")
    return colour
