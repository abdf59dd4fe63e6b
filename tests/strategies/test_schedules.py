"""Pipeline schedules are data: every rank's action list is checked for order, pairing and memory, and the
simulator's bubble for unit costs equals each schedule's closed form."""

from __future__ import annotations

from collections import Counter

import pytest

from gptpar.errors import GptparError
from gptpar.strategies.pipeline import (
    Action,
    closed_form_bubble,
    peak_activations,
    schedule,
    simulate,
    text_chart,
)

CASES = [("gpipe", p, m, 1) for p in (2, 4) for m in (1, 2, 4, 8)] + \
        [("1f1b", p, m, 1) for p in (2, 3, 4) for m in (p, 8, 13)] + \
        [("interleaved_1f1b", p, m, 2) for p in (2, 4) for m in (p, 2 * p, 8)] + \
        [("interleaved_1f1b", 2, 4, 3)] + \
        [("zb1p", p, m, 1) for p in (2, 3, 4) for m in (p, 8, 13)]


@pytest.mark.parametrize("name, p, m, v", CASES)
def test_every_stage_runs_each_micro_batch_once_forward_before_backward(name: str, p: int, m: int, v: int) -> None:
    ranks = schedule(name, p, m, v)
    for rank, actions in enumerate(ranks):
        seen: dict[tuple[int, int], list[str]] = {}
        for a in actions:
            if a.kind in ("F", "B", "W"):
                assert a.stage % p == rank  # stage s lives on rank s % P
                seen.setdefault((a.microbatch, a.stage), []).append(a.kind)
        split = name == "zb1p"
        assert len(seen) == m * v
        assert all(kinds == (["F", "B", "W"] if split else ["F", "B"]) for kinds in seen.values())


@pytest.mark.parametrize("name, p, m, v", CASES)
def test_sends_match_receives(name: str, p: int, m: int, v: int) -> None:
    ranks = schedule(name, p, m, v)
    sends, receives = Counter(), Counter()
    for rank, actions in enumerate(ranks):
        for a in actions:
            if a.kind.startswith("SEND"):
                to = a.stage + 1 if a.kind == "SEND_F" else a.stage - 1
                sends[(a.kind[5:], a.microbatch, to, rank, a.peer)] += 1
            elif a.kind.startswith("RECV"):
                receives[(a.kind[5:], a.microbatch, a.stage, a.peer, rank)] += 1
    assert sends == receives and set(sends.values()) == {1}
    assert sum(sends.values()) == 2 * m * (p * v - 1)


@pytest.mark.parametrize("name, p, m, v", CASES)
def test_each_pair_of_ranks_sends_and_receives_in_the_same_order(name: str, p: int, m: int, v: int) -> None:
    """NCCL matches the messages of a pair of ranks by order, not by tag: the engine relies on this."""
    ranks = schedule(name, p, m, v)
    for src in range(p):
        for dst in range(p):
            sent = [(a.kind[5:], a.microbatch, a.stage + (1 if a.kind == "SEND_F" else -1))
                    for a in ranks[src] if a.kind.startswith("SEND") and a.peer == dst]
            received = [(a.kind[5:], a.microbatch, a.stage) for a in ranks[dst]
                        if a.kind.startswith("RECV") and a.peer == src]
            assert sent == received, f"rank {src} -> {dst}"


@pytest.mark.parametrize("name, p, m, v", CASES)
def test_the_simulated_bubble_for_unit_costs_is_the_closed_form(name: str, p: int, m: int, v: int) -> None:
    timeline = simulate(schedule(name, p, m, v))
    assert timeline.bubble == pytest.approx(closed_form_bubble(name, p, m, v))
    busy = [sum(end - start for r, _, start, end in timeline.spans if r == rank) for rank in range(p)]
    assert all(b == pytest.approx(3 * m * v) for b in busy)  # F + B + W (or a whole backward, 2) per stage


@pytest.mark.parametrize("p, m", [(2, 8), (4, 4), (4, 8), (4, 16)])
def test_1f1b_holds_at_most_p_activations_and_gpipe_all_of_them(p: int, m: int) -> None:
    one_f_one_b = [peak_activations(actions) for actions in schedule("1f1b", p, m)]
    assert one_f_one_b == [p - r for r in range(p)]
    assert [peak_activations(actions) for actions in schedule("gpipe", p, m)] == [m] * p
    assert max(peak_activations(actions) for actions in schedule("zb1p", p, m)) == p  # ZB-H1: 1F1B's peak


def test_weighted_peaks_and_priced_actions() -> None:
    """The planner's uses: stages of unequal activations (interleaving puts stages 0 and 2 on rank 0), and actions
    priced one by one."""
    rank0 = schedule("interleaved_1f1b", 2, 4, 2)[0]
    weights = {0: 10.0, 2: 1.0}  # bytes of a micro-batch in stage 0 and in stage 2
    peak = peak_activations(rank0, lambda a: weights[a.stage])
    counts = peak_activations(rank0)
    assert 4 * 1.0 < peak < counts * 10.0  # between all light and all heavy
    # warm-up: F0@0, F1@0, F0@2, F1@2 (22), then F2@0 (32), B0@2 (31), F3@0: four micro-batches of stage 0 and one of 2
    assert peak == 41.0
    twice = simulate(schedule("1f1b", 2, 4), cost_of=lambda a: 2.0 if a.kind == "F" else 4.0)
    assert twice.makespan == 2 * simulate(schedule("1f1b", 2, 4)).makespan
    # one micro-batch, stage 1 twice as slow: F0 [0, 1], F1 [1, 3], B1 [3, 5], B0 [5, 6]; rank 0 idles 4 of 6,
    # rank 1 2 of 6, and the bubble is their mean
    uneven = simulate(schedule("gpipe", 2, 1), cost_of=lambda a: 2.0 if a.stage == 1 else 1.0)
    assert uneven.makespan == 6.0 and uneven.idle == pytest.approx([4 / 6, 2 / 6])  # exact but for 1 - b / 6's rounding
    assert uneven.bubble == pytest.approx(0.5)


def test_zero_bubble_beats_1f1b_which_beats_gpipe_on_memory_only() -> None:
    p, m = 4, 8
    bubbles = {name: simulate(schedule(name, p, m)).bubble for name in ("gpipe", "1f1b", "zb1p")}
    assert bubbles["zb1p"] < bubbles["1f1b"] == pytest.approx(bubbles["gpipe"])
    assert simulate(schedule("interleaved_1f1b", p, m, 2)).bubble < bubbles["1f1b"]


def test_a_schedule_that_cannot_finish_is_reported_as_a_deadlock() -> None:
    ranks = schedule("1f1b", 2, 2)
    bad = [list(ranks[0]), [a for a in ranks[1] if a.kind != "SEND_B"]]  # rank 1 never sends a gradient back
    with pytest.raises(GptparError, match=r"the schedule deadlocks: rank 0 waits at RECV_B0@0<-1"):
        simulate(bad)
    crossed = [[Action("RECV_B", 0, 0, 1), *ranks[0]], ranks[1]]  # rank 0 waits for a gradient before any forward
    with pytest.raises(GptparError, match="deadlocks"):
        simulate(crossed)


@pytest.mark.parametrize("args, message", [
    (("pipedream", 2, 4), "pp_schedule='pipedream' is not allowed"),
    (("1f1b", 4, 2), r"parallel.chunks=2 is below parallel.pp=4"),
    (("interleaved_1f1b", 2, 4, 1), "needs parallel.pp_virtual >= 2"),
    (("interleaved_1f1b", 4, 6, 2), "must be a multiple of parallel.pp=4"),
    (("1f1b", 2, 4, 2), "needs parallel.pp_schedule=interleaved_1f1b"),
])
def test_shapes_that_do_not_fit_are_one_line(args: tuple, message: str) -> None:
    with pytest.raises(GptparError, match=message) as info:
        schedule(*args)
    assert "\n" not in str(info.value)


def test_text_chart_shows_the_timeline() -> None:
    chart = text_chart(simulate(schedule("1f1b", 2, 2)), 2)
    assert chart.splitlines() == ["rank 0: FF..BB.BB", "rank 1: .FBBFBB.."]  # a whole backward takes 2


def test_gptpar_schedule_show_prints_the_timeline_and_draws_a_gantt_chart(tmp_path, capsys) -> None:
    from gptpar.cli import main

    out = tmp_path / "zb.png"
    assert main(["schedule", "show", "zb1p", "--pp", "4", "--chunks", "8", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "rank 3: ...FBFBFBFBWFBWFBWFBWFBWWWW" in text
    assert "idle share per rank: 0.111 0.111 0.111 0.111; mean 0.111" in text
    assert "closed form for unit costs: 0.111" in text
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000
    assert main(["schedule", "show", "1f1b", "--pp", "4", "--chunks", "2"]) == 2
    assert "parallel.chunks=2 is below parallel.pp=4" in capsys.readouterr().err
