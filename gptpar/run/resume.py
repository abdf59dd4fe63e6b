"""A run resumes with the config its checkpoint was made with. Every start of a run folder is checked key by key
against the run's own config: config.yaml (as submitted) and the last log header (what its ranks ran). Only the
RESUMABLE keys may differ, and config.yaml then records their new values; any other change is refused in one line
naming the keys. With --reshape the run may also continue on another layout (RESHAPEABLE: how it is laid out over
its ranks, never what it trains); its checkpoint reshards on load, and its data order does not depend on the layout
(gptpar.data.partition). A run whose headers already disagree (a log written before this check) is flagged by `gptpar
status` and left out of the report (`mixed_configs`).
"""

from __future__ import annotations

import dataclasses
from itertools import pairwise
from typing import Any

from gptpar.config import Config, LogConfig, ParallelConfig, ReportConfig
from gptpar.errors import GptparError
from gptpar.run.folder import RunFolder, completed, config_changes, config_diff
from gptpar.run.logfile import CorruptLog, RankLog, read_rank_log

# The keys a run's starts may change: where its folder is and how it logs, how its job is queued, when it evaluates,
# checkpoints and profiles, where its data is cached, how long a rank waits for a dead peer. None changes what it
# trains: not train.max_steps or train.epochs (they set the cosine schedule's length), nor launch.gpus, launch.nodes
# (the job's shape) or launch.repeat (the run's place among a sweep point's repeats).
RESUMABLE = frozenset({
    *(f"log.{f.name}" for f in dataclasses.fields(LogConfig)),
    *(f"report.{f.name}" for f in dataclasses.fields(ReportConfig)),
    *(f"launch.{key}" for key in ("launcher", "profile", "cluster", "partition", "account", "qos", "constraint",
                                  "gpu_type", "cpus_per_task", "time", "signal_s", "max_concurrent", "venv")),
    "train.eval_every", "train.checkpoint_every", "train.profile_steps", "train.dump_grads",
    "data.dir", "data.hub_timeout_s", "parallel.timeout_s",
})


# The keys `--reshape` may change besides: the run's layout over its ranks (every parallel.* key, the micro-batches a
# step is cut into, the job's shape), never its model or its global batch (train.batch_size).
RESHAPEABLE = frozenset({*(f"parallel.{f.name}" for f in dataclasses.fields(ParallelConfig)),
                         "train.grad_accum", "launch.gpus", "launch.nodes"})
RESHAPE = "pass --reshape to continue it on the new layout"  # offered where only the layout changed


def resumable_keys() -> str:
    """RESUMABLE in a few words: a whole section as `log.*`, most of one as `launch.* (not ...)`."""
    parts = []
    for section, values in Config().to_dict().items():
        keys = list(values)
        kept = [key for key in keys if f"{section}.{key}" in RESUMABLE]
        if len(kept) == len(keys):
            parts.append(f"{section}.*")
        elif len(kept) > len(keys) / 2:
            parts.append(f"{section}.* (not " + ", ".join(key for key in keys if key not in kept) + ")")
        else:
            parts += [f"{section}.{key}" for key in kept]
    return ", ".join(parts)


def check_start(folder: RunFolder, cfg: Config, runs: Config | None = None,
                again: str = "pass --start-over to set the old folder aside and start over", reshape: bool = False
                ) -> None:
    """Refuse a start whose config changes a key that is not RESUMABLE (nor, with `reshape`, RESHAPEABLE): `cfg`
    against config.yaml, `runs` (the config the ranks run, by default `cfg`) against the last log header; `again` says
    how to start over. A start with `reshape` records the layout it accepted (RESHAPE_FILE), which its ranks, started
    on config.yaml with no `reshape` of their own, then take. Then write config.yaml: the first time, or with the keys
    that changed."""
    runs = cfg if runs is None else runs
    saved = folder.read_config()
    saved = None if saved is None else completed(saved)
    if saved is not None:
        _refuse_changes(folder, saved, cfg, "holds a different config", again, reshape)
    ran = last_config(folder, again)
    if ran is not None:
        layout = _layout(runs.to_dict())
        accepted = reshape or folder.read_reshape() == layout
        _refuse_changes(folder, ran, runs, "was trained with a different config", again, accepted)
        if reshape and layout != _layout(ran):
            folder.write_reshape(layout)
    if saved != cfg.to_dict():
        folder.write_config(cfg)


def _layout(config: dict[str, Any]) -> list[str]:
    """The config's RESHAPEABLE values, as `key: value` lines."""
    return [f"{section}.{key}: {value!r}" for section, values in config.items() if isinstance(values, dict)
            for key, value in values.items() if f"{section}.{key}" in RESHAPEABLE]


def _refuse_changes(folder: RunFolder, old: dict[str, Any], cfg: Config, what: str, again: str, reshape: bool
                    ) -> None:
    new = cfg.to_dict()
    ignored = RESUMABLE | RESHAPEABLE if reshape else RESUMABLE
    if not config_changes(old, new, ignored):
        return
    if reshape and (batch := [c for c in config_changes(old, new) if c.startswith("train.batch_size:")]):
        raise GptparError(f"run folder {folder.path}: --reshape keeps the global batch ({batch[0]}); to train with "
                          f"another, start a new run from its weights: `gptpar checkpoint export {folder.path}`, save "
                          "that model with transformers' save_pretrained, then model.init=pretrained:PATH")
    layout_only = not config_changes(old, new, RESUMABLE | RESHAPEABLE)
    offer = f"{RESHAPE}, " if layout_only else ""
    raise GptparError(f"run folder {folder.path} {what} ({config_diff(old, new, ignore=ignored)}); "
                      f"a run resumes with the config it was trained with, changing only {resumable_keys()}: "
                      f"undo the change, {offer}use another log.run_id, or {again}")


def last_config(folder: RunFolder, again: str) -> dict[str, Any] | None:
    """The config of the run's latest start, as its log headers recorded it (None before the first start): the
    first rank log by rank that has one, since every rank of a start runs one config. An unreadable log (damaged,
    or written by a newer gptpar) is refused in one line: nothing can resume it."""
    for path in folder.rank_logs():
        try:
            configs = [h["config"] for h in read_rank_log(path).headers if _recorded(h)]
        except CorruptLog as exc:
            raise GptparError(f"run folder {folder.path} cannot be resumed: {exc}; {again}") from None
        if configs:
            return completed(configs[-1])
    return None


def _recorded(header: dict[str, Any]) -> bool:
    return isinstance(header.get("config"), dict) and bool(header["config"])


def mixed_configs(ranks: list[RankLog]) -> str:
    """Why a run's starts ran different configs (a key neither RESUMABLE nor RESHAPEABLE, old -> new), in one line; ""
    when they ran one. Only a log written before gptpar checked a resumed start has them, and its numbers mix the
    configs."""
    for log in ranks:
        for after, old, new in _changes(log):
            if config_changes(old, new, RESUMABLE | RESHAPEABLE):
                return (f"its starts ran different configs (restart {after.get('restart', '?')} of rank {log.rank}: "
                        f"{config_diff(old, new, limit=2, ignore=RESUMABLE | RESHAPEABLE)}); its numbers mix them")
    return ""


def layout_changes(ranks: list[RankLog]) -> str:
    """How a run continued on other layouts (--reshape), in one line: each start's changed layout keys, in rank 0's
    log (every start has a rank 0); "" when it kept one."""
    changes = [f"restart {after.get('restart', '?')}: {config_diff(old, new, limit=3, ignore=RESUMABLE)}"
               for after, old, new in layout_starts(ranks)]
    return ("it continued on another layout (" + "; ".join(changes) + "); its throughput is the current layout's") \
        if changes else ""


def current_layout(ranks: list[RankLog]) -> list[RankLog]:
    """The logs of the ranks that run the current layout (current_ranks), cut to the steps logged since it began
    (without epoch records, which may count steps of the layout before): what a reshaped run's throughput is measured
    on, never an average over layouts. The logs as they are for a run that kept one layout."""
    starts = layout_starts(ranks)
    if not starts:
        return ranks
    since = float(starts[-1][0].get("time", 0.0))
    return [dataclasses.replace(log, steps={s: r for s, r in log.steps.items() if float(r["time"]) >= since},
                                epochs={})
            for log in current_ranks(ranks)]


def current_ranks(ranks: list[RankLog]) -> list[RankLog]:
    """The started logs of the ranks of rank 0's latest start: those below its world size. A rank of a larger layout
    before a --reshape keeps its log, whose last start is an older one (its header's time tells nothing: the ranks of
    one start write theirs in any order). All started logs where rank 0 has none."""
    started = [log for log in ranks if log.headers]
    zero = next((log for log in started if log.rank == 0), None)
    return started if zero is None else [log for log in started if log.rank < int(zero.header["world_size"])]


def layout_starts(ranks: list[RankLog]) -> list[tuple[dict[str, Any], dict[str, Any], dict[str, Any]]]:
    """Rank 0's starts that changed the layout (every start has a rank 0): (header, config before, config)."""
    log = next((log for log in ranks if log.rank == 0), None)
    return [change for change in (_changes(log) if log is not None else [])
            if config_changes(change[1], change[2], RESUMABLE)]


def _changes(log: RankLog) -> list[tuple[dict[str, Any], dict[str, Any], dict[str, Any]]]:
    """Each start of a rank log after its first: (its header, the config before it, its config)."""
    headers = [h for h in log.headers if _recorded(h)]
    return [(after, completed(before["config"]), completed(after["config"])) for before, after in pairwise(headers)]
