"""`gptpar plan search`: every layout of N GPUs for a model, ranked by predicted tokens/s under the memory limit.

A candidate is a set of config overrides (dp x tp x pp, dp_sync, schedule and its stages per rank, micro-batches,
sequence parallelism, activation checkpointing; where none of those fits, dp x cp with either cp_impl; where none of
those fits either, a sync that keeps parallel.offload's parts on the host) resolved through the same config checks
`gptpar train` runs, so a layout that cannot exist is rejected with the checks' own message; one that exists but does
not fit a GPU (or its node's host memory) is rejected with its predicted bytes. The top layouts can be written as a
sweep file for `gptpar sweep`.
"""

from __future__ import annotations

import argparse
import itertools
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from gptpar.atomic import atomic_write_text
from gptpar.config import Config, ConfigError, ParallelConfig, overrides_tree, updated
from gptpar.errors import GptparError
from gptpar.plan.commands import MB, describe, resolved_layout
from gptpar.plan.layout import Layout
from gptpar.plan.predict import Prediction, predict
from gptpar.plan.record import SHIPPED
from gptpar.plan.target import Target, target_of
from gptpar.strategies.data_parallel import DP_STRATEGIES
from gptpar.strategies.pipeline import SCHEDULES

DEFAULTS = {"parallel.pp_schedule": "1f1b", "parallel.chunks": 4, "parallel.pp_virtual": 1, "train.grad_accum": 1,
            "parallel.sequence_parallel": False, "train.activation_checkpointing": "none", "parallel.tp_impl": "gptpar",
            "parallel.cp": 1, "parallel.cp_impl": "ring", "parallel.offload": "none"}
MICRO_STEPS = (1, 2, 4)  # grad_accum tried
CHUNKS_PER_STAGE = (1, 2, 4)  # pipeline micro-batches per stage rank tried


@dataclass(frozen=True)
class Ranked:
    overrides: dict[str, object]
    layout: Layout
    prediction: Prediction


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def priced_syncs() -> list[str]:
    """The data-parallel strategies the search tries: those the planner can price (their rows' `pricing`)."""
    return [name for name, row in DP_STRATEGIES.items() if row.pricing is not None]


def candidates(gpus: int, per_node: int) -> list[dict[str, object]]:
    """Every combination the search tries, as parallel.* and train.* overrides (most of them valid), over
    `priced_syncs`."""
    priced = priced_syncs()
    out = []
    for tp in [d for d in divisors(gpus) if not per_node or d <= per_node]:
        for pp in divisors(gpus // tp):
            dp = gpus // (tp * pp)
            for sync, sp, ckpt in itertools.product(priced, (False, True), ("none", "block")):
                if (sp and tp == 1) or (dp == 1 and sync != ParallelConfig.dp_sync):  # one replica: the default
                    continue
                base = {"parallel.dp": dp, "parallel.tp": tp, "parallel.pp": pp, "parallel.dp_sync": sync,
                        "parallel.sequence_parallel": sp, "train.activation_checkpointing": ckpt,
                        "parallel.tp_impl": DP_STRATEGIES[sync].tensor_parallel[0] if tp > 1 else "gptpar"}  # its first
                if pp == 1:
                    out += [{**base, "train.grad_accum": ga} for ga in MICRO_STEPS]
                    continue
                for name, row in SCHEDULES.items():
                    for per in CHUNKS_PER_STAGE:
                        out.append({**base, "parallel.pp_schedule": name, "parallel.chunks": per * pp,
                                    "parallel.pp_virtual": 2 if row.interleaved else 1})
    return out


def context_candidates(gpus: int) -> list[dict[str, object]]:
    """Layouts that split each sequence over cp ranks (parallel.cp, either implementation) with data parallelism over
    the rest, for when no layout of whole sequences fits: the sequence's activations fall as 1 / cp."""
    priced = priced_syncs()
    out = []
    for cp in divisors(gpus)[1:]:
        dp = gpus // cp
        for sync, impl, ckpt, ga in itertools.product(priced, ("ring", "all_to_all"), ("none", "block"), MICRO_STEPS):
            if dp == 1 and sync != ParallelConfig.dp_sync:
                continue
            out.append({"parallel.dp": dp, "parallel.tp": 1, "parallel.pp": 1, "parallel.cp": cp,
                        "parallel.cp_impl": impl, "parallel.dp_sync": sync, "train.activation_checkpointing": ckpt,
                        "train.grad_accum": ga})
    return out


def offload_candidates(gpus: int) -> list[dict[str, object]]:
    """Layouts whose sync keeps what parallel.offload moves on the host, for when nothing fits the devices otherwise:
    each of `priced_syncs` with each offload its row lists, data parallelism over every GPU (offload is built without
    tp, ep and the multi-process pipeline). A row that offloads runs at dp=1 too (`group_of_one`, or `alone`): a
    student's one GPU."""
    out = []
    for sync, ckpt, ga in itertools.product(priced_syncs(), ("none", "block"), MICRO_STEPS):
        out += [{"parallel.dp": gpus, "parallel.tp": 1, "parallel.pp": 1, "parallel.dp_sync": sync,
                 "parallel.offload": offload, "train.activation_checkpointing": ckpt, "train.grad_accum": ga}
                for offload in DP_STRATEGIES[sync].offloads]
    return out


def evaluate(cfg: Config, overrides: dict[str, object], target: Target) -> Ranked | str:
    """A candidate's prediction, or the reason it is rejected (the config check's message, or its memory: the device's
    against a GPU, parallel.offload's host bytes of the node's ranks against its host memory)."""
    try:
        layout_cfg = updated(cfg, overrides)
        layout = resolved_layout(layout_cfg, target)
        pred = predict(layout, target.calibration, target.network, target.device)
    except (ConfigError, GptparError) as exc:
        return str(exc)
    limit = target.memory_bytes
    if limit is not None and pred.memory_bytes > limit:
        return f"needs {pred.memory_bytes / 1e9:.1f} GB per GPU, over the {limit / 1e9:.0f} GB a GPU holds"
    host, node = pred.memory["host"], target.host_memory_bytes
    ranks = min(layout.world, target.gpus_per_node or layout.world)  # the ranks that share one node's host
    if node is not None and host * ranks > node:
        return (f"needs {host * ranks / 1e9:.1f} GB of host memory per node ({ranks} rank(s) x {host / 1e9:.1f} GB, "
                f"parallel.offload), over the {node / 1e9:.0f} GB a node holds")
    return Ranked(overrides, layout, pred)


def search(cfg: Config, gpus: int, calibration: str | None) -> tuple[list[Ranked], Counter[str], dict[str, str]]:
    """Valid layouts best first, and the rejected ones' reasons with a count and an example layout each; where no
    layout of whole sequences fits, those that split the sequence (`context_candidates`) are tried too, and where none
    of those fits either, those that offload to the host (`offload_candidates`): a layout that fits without either is
    always preferred."""
    target = target_of(cfg, calibration)
    ranked: list[Ranked] = []
    reasons: Counter[str] = Counter()
    example: dict[str, str] = {}
    for tried in (candidates(gpus, target.gpus_per_node), context_candidates(gpus), offload_candidates(gpus)):
        if ranked:
            break
        for overrides in tried:
            result = evaluate(cfg, overrides, target)
            if isinstance(result, str):
                reasons[result] += 1
                example.setdefault(result, ", ".join(f"{k.split('.')[1]}={v}" for k, v in overrides.items()))
            else:
                ranked.append(result)
    ranked.sort(key=lambda r: -r.prediction.tokens_per_s)
    return ranked, reasons, example


def sweep_text(base: dict[str, object], top: list[Ranked], gpus: int, per_node: int) -> str:
    """The top layouts as a sweep over `base` (the search's config words, report.plan_calibration among them, so
    each run is planned and its report sets the prediction beside the measurement): `kind: dp` sets parallel.dp from
    the job's shape, so it is left out of the axes; every other key that differs between them is a zip axis."""
    nodes = gpus // per_node if per_node and gpus > per_node else 1
    keys = sorted({k for r in top for k in r.overrides if k != "parallel.dp"})
    zipped = {k: [r.overrides.get(k, DEFAULTS.get(k)) for r in top] for k in keys}
    always = ("parallel.tp", "parallel.pp")
    zipped = {k: v for k, v in zipped.items() if len({str(x) for x in v}) > 1 or str(v[0]) != str(DEFAULTS.get(k))
              or k in always}
    launch = {**dict(base.get("launch") or {}), "gpus": gpus // nodes, "nodes": nodes}  # type: ignore[arg-type]
    data = {"name": "plan_top", "kind": "dp", "base": {**base, "launch": launch}, "zip": zipped}
    return ("# The top layouts of `gptpar plan search`, best predicted tokens/s first.\n"
            + yaml.safe_dump(data, sort_keys=False))


def render(ranked: list[Ranked], reasons: Counter[str], example: dict[str, str], top: int) -> str:
    """The ranking as a table (memory MB: a GPU's; host MB: what parallel.offload keeps on a rank's host), then the
    rejected layouts' reasons."""
    lines = [f"{'#':>3} {'tokens/s':>12} {'step ms':>10} {'memory MB':>10} {'host MB':>8} {'MFU':>6} "
             f"{'bubble ms':>10} {'comm ms':>9}  layout"]
    for i, r in enumerate(ranked[:top], 1):
        p = r.prediction
        mfu = f"{p.mfu:.0%}" if p.mfu is not None else "n/a"
        lines.append(f"{i:>3} {p.tokens_per_s:>12,.0f} {p.step_time_s * 1e3:>10,.1f} {p.memory_bytes / MB:>10,.0f} "
                     f"{p.memory['host'] / MB:>8,.0f} {mfu:>6} {p.bubble_s * 1e3:>10,.1f} "
                     f"{sum(p.exposed_comm_s.values()) * 1e3:>9,.1f}  "
                     f"{describe(r.layout)}")
    rejected = sum(reasons.values())
    lines.append(f"{len(ranked)} valid layout(s); " + (f"{rejected} rejected:" if rejected else "none rejected"))
    lines += [f"  {n} x {reason} (e.g. {example[reason]})" for reason, n in reasons.most_common()]
    return "\n".join(lines)


def search_command(args: argparse.Namespace, resolve: Callable[[list[str]], Config]) -> int:
    """`gptpar plan search`: --model and --profile are config words after the user's (a flag wins; they resolve
    together, so data.task=classify takes the image preset --model names), --gpus the GPUs; prints the ranking."""
    if not args.gpus:
        raise GptparError("gptpar plan search needs --gpus N (the GPUs in all)")
    words = [*args.words, *([f"model.preset={args.model}"] if args.model else []),
             *([f"launch.profile={args.profile}"] if args.profile else [])]
    cfg = resolve(words)
    changes: dict[str, object] = {}
    if not any(w.startswith("train.batch_size=") for w in words):
        changes["train.batch_size"] = max(cfg.train.batch_size, 8 * args.gpus)
    cfg = updated(cfg, changes) if changes else cfg
    ranked, reasons, example = search(cfg, args.gpus, args.calibration)
    print(render(ranked, reasons, example, args.top))
    if args.sweep:
        if not ranked:
            raise GptparError("no valid layout to write as a sweep; see the reasons above")
        per_node = target_of(cfg, args.calibration).gpus_per_node
        out = Path(args.sweep)
        planned = str(Path(args.calibration).resolve()) if args.calibration else SHIPPED  # each run's plan.json
        base = overrides_tree([*words, *(f"{k}={v}" for k, v in changes.items()),
                               f"report.plan_calibration={planned}"])
        atomic_write_text(out, sweep_text(base, ranked[:args.top], args.gpus, per_node))
        print(f"wrote {out}: the top {min(args.top, len(ranked))} as a sweep (gptpar sweep {out})")
    return 0
