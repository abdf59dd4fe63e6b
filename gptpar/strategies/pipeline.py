"""The pipeline (parallel.pp) as torch-free data, which gptpar/parallel/pipeline runs: how the model is cut into
stages, and the schedules as each rank's ordered list of actions, with a simulator that runs the lists.

Cuts: parallel.pp_split read as blocks per stage, or the balanced cut (`stage_sizes`). The pipeline keys' checks are
the config's (gptpar/config/parallel_checks.py).

Schedules: an action is a forward (F), an input-gradient backward (B), a weight-gradient backward (W), or the
send/receive of an activation (SEND_F/RECV_F) or a gradient (SEND_B/RECV_B), each for one micro-batch
and one stage. Schedules that do not split the backward use B for the whole backward (its cost is then
B + W). The multi-process engine executes these lists; the simulator executes them with given costs,
detects a deadlock, and measures each rank's idle share, which tests hold against the closed forms:
GPipe and 1F1B (P-1)/(m+P-1), interleaved 1F1B (P-1)/(V*m+P-1), ZB-H1 (P-1)/(3m+P-1), for unit costs
F = B = W = 1 (a whole backward costs 2).

Stages: with V virtual stages per rank, stage s lives on rank s % P (Megatron's interleaving: rank r
holds stages r, r + P, ...), so S = V * P stages in all.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

from gptpar.errors import ConfigError, GptparError

COMPUTE = ("F", "B", "W")


@dataclass(frozen=True)
class Action:
    kind: str  # F, B, W, SEND_F, RECV_F, SEND_B, RECV_B
    microbatch: int
    stage: int
    peer: int | None = None  # the other rank of a send or receive

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}@{self.stage}" + (f"->{self.peer}" if self.kind.startswith("SEND")
                                                             else f"<-{self.peer}" if self.peer is not None else "")


@dataclass(frozen=True)
class ScheduleShape:
    """A schedule's shape: P ranks, V virtual stages per rank, m micro-batches; split backward or not."""

    name: str
    ranks: int
    virtual: int
    microbatches: int
    split_backward: bool

    @property
    def stages(self) -> int:
        return self.ranks * self.virtual

    def rank_of(self, stage: int) -> int:
        return stage % self.ranks


def _gpipe(shape: ScheduleShape, rank: int) -> list[tuple[str, int, int]]:
    m = shape.microbatches
    return [("F", i, rank) for i in range(m)] + [("B", i, rank) for i in range(m)]


def _one_f_one_b(shape: ScheduleShape, rank: int) -> list[tuple[str, int, int]]:
    """Warm-up forwards, then one forward one backward, then the remaining backwards: rank r holds at
    most P - r micro-batches' activations."""
    m = shape.microbatches
    warmup = min(shape.ranks - 1 - rank, m)
    order = [("F", i, rank) for i in range(warmup)]
    for i in range(m - warmup):
        order += [("F", warmup + i, rank), ("B", i, rank)]
    return order + [("B", i, rank) for i in range(m - warmup, m)]


def _interleaved(shape: ScheduleShape, rank: int) -> list[tuple[str, int, int]]:
    """Megatron's interleaved 1F1B: micro-batches go through a rank's V model chunks in groups of P."""
    p, v, m = shape.ranks, shape.virtual, shape.microbatches
    total = m * v

    def chunk_item(k: int, forward: bool) -> tuple[int, int]:
        chunk = (k // p) % v
        microbatch = (k // (p * v)) * p + k % p
        return microbatch, (chunk if forward else v - 1 - chunk) * p + rank

    warmup = min((p - rank - 1) * 2 + (v - 1) * p, total)
    order = [("F", *chunk_item(k, True)) for k in range(warmup)]
    for k in range(total - warmup):
        order += [("F", *chunk_item(warmup + k, True)), ("B", *chunk_item(k, False))]
    return order + [("B", *chunk_item(k, False)) for k in range(total - warmup, total)]




def schedule_shape(name: str, ranks: int, microbatches: int, virtual: int = 1) -> ScheduleShape:
    """Check a schedule's shape against its row of SCHEDULES, with one line naming what does not fit."""
    row = SCHEDULES.get(name)
    if row is None:
        raise GptparError(f"parallel.pp_schedule={name!r} is not allowed; choose one of: {', '.join(SCHEDULES)}")
    if ranks < 1 or microbatches < 1 or virtual < 1:
        raise GptparError(f"a pipeline needs at least one rank, micro-batch and stage per rank (got P={ranks}, "
                          f"m={microbatches}, V={virtual})")
    if row.interleaved:
        if virtual < 2:
            raise GptparError(f"parallel.pp_schedule={name} needs parallel.pp_virtual >= 2")
        if microbatches % ranks:
            raise GptparError(f"parallel.chunks={microbatches} must be a multiple of parallel.pp={ranks} for "
                              f"{name}")
    elif virtual != 1:
        interleaved = " or ".join(n for n, r in SCHEDULES.items() if r.interleaved)
        raise GptparError(f"parallel.pp_virtual={virtual} needs parallel.pp_schedule={interleaved}")
    if row.fills_pipeline and microbatches < ranks:
        raise GptparError(f"parallel.chunks={microbatches} is below parallel.pp={ranks}: {name} needs at least one "
                          "micro-batch per stage to fill the pipeline")
    return ScheduleShape(name, ranks, virtual, microbatches, split_backward=row.split_backward)


def _with_communication(shape: ScheduleShape, rank: int, compute: list[tuple[str, int, int]]) -> list[Action]:
    """Insert each receive just before the action that needs it and each send just after the action that
    produced it, so that the lists of all ranks pair up in order."""
    last = shape.stages - 1
    actions: list[Action] = []
    for kind, mb, stage in compute:
        if kind == "F" and stage > 0:
            actions.append(Action("RECV_F", mb, stage, shape.rank_of(stage - 1)))
        if kind == "B" and stage < last:
            actions.append(Action("RECV_B", mb, stage, shape.rank_of(stage + 1)))
        actions.append(Action(kind, mb, stage))
        if kind == "F" and stage < last:
            actions.append(Action("SEND_F", mb, stage, shape.rank_of(stage + 1)))
        if kind == "B" and stage > 0:
            actions.append(Action("SEND_B", mb, stage, shape.rank_of(stage - 1)))
    return actions


def schedule(name: str, ranks: int, microbatches: int, virtual: int = 1) -> list[list[Action]]:
    """Each rank's ordered actions for one training step."""
    shape = schedule_shape(name, ranks, microbatches, virtual)
    return [_with_communication(shape, r, SCHEDULES[name].build(shape, r)) for r in range(ranks)]


def _zero_bubble_h1(shape: ScheduleShape, rank: int) -> list[tuple[str, int, int]]:
    """ZB-H1 (Qi et al., 2024): 1F1B's order of F and B (the input-gradient pass), with each weight-gradient
    pass W postponed by `rank` micro-batches, so W fills the time a rank would otherwise wait for a
    gradient. A rank holds at most P - r micro-batches between F and B, as in 1F1B, and at most P between
    F and W."""
    m = shape.microbatches
    warmup = min(shape.ranks - 1 - rank, m)
    order = [("F", i, rank) for i in range(warmup)]
    for i in range(m):
        if warmup + i < m:
            order.append(("F", warmup + i, rank))
        order.append(("B", i, rank))
        if i >= rank:
            order.append(("W", i - rank, rank))
    return order + [("W", i, rank) for i in range(max(0, m - rank), m)]


@dataclass
class Timeline:
    """What the simulator found: each action's (rank, start, end), the makespan, and each rank's idle share."""

    spans: list[tuple[int, Action, float, float]]
    makespan: float
    idle: list[float]

    @property
    def bubble(self) -> float:
        return sum(self.idle) / len(self.idle)


def simulate(ranks_actions: list[list[Action]], cost_f: float = 1.0, cost_b: float = 1.0, cost_w: float = 1.0,
             split_backward: bool | None = None, cost_of: Callable[[Action], float] | None = None) -> Timeline:
    """Run the lists: a rank runs its actions in order, a compute action once its inputs have arrived
    (sends and receives take no time and match in order). `cost_of`, where given, prices each compute action
    itself (the planner's stages differ: the head's, the embedding's); else every F, B and W costs the same. A
    schedule that can never finish raises a GptparError naming every rank's blocked action (a deadlock)."""
    has_w = any(a.kind == "W" for actions in ranks_actions for a in actions)
    split = has_w if split_backward is None else split_backward
    cost = {"F": cost_f, "B": cost_b if split else cost_b + cost_w, "W": cost_w}
    position, clock = [0] * len(ranks_actions), [0.0] * len(ranks_actions)
    sent: dict[tuple[str, int, int], float] = {}  # (kind, microbatch, stage) -> time the data left
    spans: list[tuple[int, Action, float, float]] = []
    busy = [0.0] * len(ranks_actions)
    while any(position[r] < len(a) for r, a in enumerate(ranks_actions)):
        progressed = False
        for r, actions in enumerate(ranks_actions):
            while position[r] < len(actions):
                action = actions[position[r]]
                if action.kind.startswith("RECV"):
                    key = ("SEND" + action.kind[4:], action.microbatch,
                           action.stage - 1 if action.kind == "RECV_F" else action.stage + 1)
                    if key not in sent:
                        break
                    clock[r] = max(clock[r], sent[key])
                elif action.kind.startswith("SEND"):
                    sent[(action.kind, action.microbatch, action.stage)] = clock[r]
                else:
                    seconds = cost_of(action) if cost_of is not None else cost[action.kind]
                    start, clock[r] = clock[r], clock[r] + seconds
                    busy[r] += seconds
                    spans.append((r, action, start, clock[r]))
                position[r] += 1
                progressed = True
        if not progressed:
            blocked = "; ".join(f"rank {r} waits at {actions[position[r]]}" for r, actions in enumerate(ranks_actions)
                                if position[r] < len(actions))
            raise GptparError(f"the schedule deadlocks: {blocked}")
    makespan = max(clock)
    return Timeline(spans, makespan, [1 - b / makespan for b in busy])


def closed_form_bubble(name: str, ranks: int, microbatches: int, virtual: int = 1) -> float:
    """The idle share of a rank in theory, for unit costs F = B = W = 1 (the schedule's row)."""
    return SCHEDULES[name].bubble(ranks, microbatches, virtual)


def peak_activations(actions: list[Action], weight: Callable[[Action], float] | None = None) -> float:
    """The most micro-batches whose activations a rank holds at once: from its forward until its backward
    is complete (after W where the backward is split). With `weight`, each forward's activations weigh what it says
    (the planner's bytes of that stage's blocks), and the peak is of the sum."""
    split = any(a.kind == "W" for a in actions)
    alive = peak = 0
    for a in actions:
        if a.kind == "F":
            alive += weight(a) if weight is not None else 1
            peak = max(peak, alive)
        elif a.kind == ("W" if split else "B"):
            alive -= weight(a) if weight is not None else 1
    return peak


def text_chart(timeline: Timeline, ranks: int) -> str:
    """One line per rank, one character per time unit: F, B, W (lower case for virtual stages > first)."""
    width = int(round(timeline.makespan))
    rows = [["."] * width for _ in range(ranks)]
    for r, action, start, end in timeline.spans:
        mark = action.kind if action.stage < ranks else action.kind.lower()
        for t in range(int(round(start)), int(round(end))):
            rows[r][t] = mark
    return "\n".join(f"rank {r}: {''.join(row)}" for r, row in enumerate(rows))


@dataclass(frozen=True)
class Schedule:
    """One row of the schedule table: how a rank's compute order is built and what the schedule is, so that
    the config, the engine, `gptpar schedule` and the analysis read one place. A new schedule is a builder
    function plus a row here."""

    build: Callable[[ScheduleShape, int], list[tuple[str, int, int]]]  # a rank's (kind, micro-batch, stage) order
    split_backward: bool  # B is the input-gradient pass and W the weight-gradient pass, run apart
    interleaved: bool  # V >= 2 model chunks per rank, micro-batches in groups of P
    fills_pipeline: bool  # needs at least P micro-batches (m >= P)
    bubble: Callable[[int, int, int], float]  # closed-form idle share for P, m, V at unit costs
    help: str


def _plain_bubble(p: int, m: int, v: int) -> float:
    return (p - 1) / (m + p - 1)


SCHEDULES: dict[str, Schedule] = {
    "gpipe": Schedule(_gpipe, False, False, False, _plain_bubble, "all forwards, then all backwards"),
    "1f1b": Schedule(_one_f_one_b, False, False, True, _plain_bubble,
                     "warm-up forwards, then one forward one backward (P - r activations held)"),
    "interleaved_1f1b": Schedule(_interleaved, False, True, True, lambda p, m, v: (p - 1) / (v * m + p - 1),
                                 "Megatron's 1F1B over V model chunks per rank"),
    "zb1p": Schedule(_zero_bubble_h1, True, False, True, lambda p, m, v: (p - 1) / (3 * m + p - 1),
                     "ZB-H1: 1F1B with the weight-gradient pass postponed into the bubble"),
}


def pp_split_counts(pp_split: str, stages: int) -> list[int] | None:
    """`parallel.pp_split` as blocks per stage (of parallel.pp * parallel.pp_virtual `stages`), or None when the split
    is balanced automatically."""
    if not pp_split.strip():
        return None
    try:
        counts = [int(word) for word in pp_split.split(",")]
    except ValueError:
        counts = []
    if len(counts) != stages or min(counts) < 1:
        raise ConfigError(f"parallel.pp_split={pp_split!r} must list {stages} positive block counts "
                          f"(parallel.pp * parallel.pp_virtual), e.g. {','.join(['1'] * stages)}")
    return counts


def stage_sizes(weights: list[int], n_stages: int, first: int = 0, last: int = 0) -> list[int]:
    """Contiguous blocks per stage (at least one each) minimising the heaviest stage's load.

    `first` and `last` are fixed loads of the first and last stage (embeddings, head).
    Among equally good cuts, earlier stages get more blocks: the last stage carries the LM head.
    """
    n_blocks = len(weights)
    prefix = [0, *itertools.accumulate(weights)]
    inf = float("inf")
    # best[s][k]: lowest possible heaviest load when the first s stages hold the first k blocks.
    best = [[inf] * (n_blocks + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n_blocks + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0
    for s in range(1, n_stages + 1):
        fixed = (first if s == 1 else 0) + (last if s == n_stages else 0)
        for k in range(s, n_blocks - (n_stages - s) + 1):
            for a in range(k - 1, s - 2, -1):
                load = max(best[s - 1][a], prefix[k] - prefix[a] + fixed)
                if load < best[s][k]:
                    best[s][k], cut[s][k] = load, a
    sizes, k = [], n_blocks
    for s in range(n_stages, 0, -1):
        sizes.append(k - cut[s][k])
        k = cut[s][k]
    return sizes[::-1]


def even_sizes(n_blocks: int, n_stages: int) -> list[int]:
    base, extra = divmod(n_blocks, n_stages)
    return [base + (i < extra) for i in range(n_stages)]
