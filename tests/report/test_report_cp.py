"""Context parallelism in the report, on written logs whose answers are worked out by hand: each token counted once
over the job (a replica's cp ranks log the same tokens), the memory closed form at W = dp * cp, and the layout
(`dp2 cp2 ring`) in the summary's table and point names, the names the comparison figure shows."""

from __future__ import annotations

from pathlib import Path

import pytest
from logsets import T0, Rank, config

from analysis.figures import _memory_lines
from analysis.grouping import point_keys, point_name
from analysis.report import run_table
from analysis.summary import markdown, row
from gptpar.run.folder import RunFolder
from gptpar.run.rows import run_result

LATER = T0 + 3600.0
N = 1000  # parameters of the written runs' model
RUNS = {"dp2": (2, 1, ""), "dp1-cp2": (1, 2, "ring"), "dp2-cp2": (2, 2, "all_to_all")}  # name: dp, cp, cp_impl


def _cp_run(folder: Path, dp: int, cp: int, cp_impl: str, steps: int = 3) -> None:
    """dp replicas of cp ranks under zero2 (rank d * cp + c: replica d, cp rank c): every rank logs its replica's 100
    tokens a step in 1 s, and after step 1 the zero2 state of N parameters sharded over W = dp * cp ranks."""
    w = dp * cp
    cfg = config(name=folder.name, dp=dp, **{"parallel.cp": cp, "parallel.cp_impl": cp_impl or "ring",
                                              "parallel.dp_sync": "zero2"})
    sizes = {"pp": 1, "dp": dp, "cp": cp, "tp": 1}
    ranks = [Rank(folder, r, cfg, coords={"pp": 0, "dp": r // cp, "cp": r % cp, "tp": 0}, sizes=sizes,
                  stage_devices=["cpu"]).header() for r in range(w)]
    for step in range(1, steps + 1):
        for rank in ranks:
            rank.step(step, 1, step_time_s=1.0, tokens=100, loss=3.0, global_loss=3.0)
            if step == 1:
                rank.memory(N, 4 * N, 4 * N // w, 8 * N // w)
    for rank in ranks:
        rank.final(step=steps)


@pytest.fixture
def runs(tmp_path: Path) -> Path:
    for name, shape in RUNS.items():
        _cp_run(tmp_path / "cp" / name, *shape)
    return tmp_path


def test_each_token_is_counted_once_over_dp_x_cp(runs: Path) -> None:
    """dp=2 x cp=2: four ranks log 100 tokens a step each, but two replicas ran 200 tokens a step: 200 tokens/s (not
    400), in the report (tokens/s, job tokens/s, tokens seen) and in `gptpar status`'s row."""
    by = {r.run: r for r in run_table(runs, warmup_steps=0, now=LATER)[0]}
    for name, (dp, _, _) in RUNS.items():
        m = by[f"cp/{name}"]
        assert (m.tokens_per_s[0], m.job_tokens_per_s) == (100.0 * dp, 100.0 * dp), name
        assert m.progress[3][0] == 300.0 * dp, name
        assert run_result(RunFolder(runs / "cp" / name))["tokens_per_s"] == 100.0 * dp, name


def test_the_memory_closed_form_shards_over_dp_x_cp(runs: Path) -> None:
    """zero2 of N parameters over W = dp * cp: 4N + 12N / W per rank (dp=1 x cp=2 is sharded too, over its 2 cp
    ranks: no run of one replica), each rank's record on it."""
    by = {r.run: r for r in run_table(runs, warmup_steps=0, now=LATER)[0]}
    for name, (dp, cp, _) in RUNS.items():
        memory = by[f"cp/{name}"].memory
        assert memory is not None
        assert (memory.strategy, memory.closed_form, memory.mismatched) == ("zero2", 4 * N + 12 * N / (dp * cp), [])
    summary = markdown(*run_table(runs, warmup_steps=0, now=LATER), runs, "none")
    assert "| dp2-cp2 | zero2 | 4 | 1,000 | 0.004 | 0.001 | 0.002 | 0.007 | 0.007 | 1.000 |" in summary
    # memory_vs_world_size: one zero2 line of this model, at W = 2 (dp2, dp1 x cp2) and 4 (dp2 x cp2)
    lines = _memory_lines(list(by.values()))
    assert {w: len(at) for w, at in lines["zero2", "", N].items()} == {2: 2, 4: 1}


def test_the_summary_names_each_point_by_its_layout(runs: Path) -> None:
    """The layout column in dp's place, the point names (the comparison figure's rows: dp, then cp with its
    implementation, the keys the layout names, parallel.cp and cp_impl, not again) and the fastest point's layout
    (every run reaches the target, the sweep's one loss, in its first 1 s step: the first point is the fastest)."""
    runs_, shown = run_table(runs, warmup_steps=0, now=LATER)
    summary = markdown(runs_, shown, runs, "none")
    table = [line.split(" | ") for line in summary.splitlines() if line.startswith(("| sweep |", "| cp |"))]
    assert [row[1:4] for row in table] == [["point", "runs", "layout"], ["dp1 cp2 ring", "1", "dp1 cp2 ring"],
                                          ["dp2", "1", "dp2"], ["dp2 cp2 all_to_all", "1", "dp2 cp2 all_to_all"]]
    assert "Fastest to the target in cp: dp1 cp2 ring (2 ranks, dp1 cp2 ring), after 1.0 s" in summary  # all reach
    assert [(row(r)["cp"], row(r)["layout"]) for r in shown] == [(2, "dp1 cp2 ring"), (1, "dp2"),
                                                                  (2, "dp2 cp2 all_to_all")]  # summary.csv's
    keys = point_keys(shown)
    assert [point_name(r, keys, file=True) for r in shown] == ["dp1_cp2_ring", "dp2", "dp2_cp2_all_to_all"]
