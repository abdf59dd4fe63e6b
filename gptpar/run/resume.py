"""A run resumes with the config its checkpoint was made with. Every start of a run folder is checked key by key
against the run's own config: config.yaml (as submitted) and the last log header (what its ranks ran). Only the
RESUMABLE keys may differ, and config.yaml then records their new values; any other change is refused in one line
naming the keys. A run whose headers already disagree (a log written before this check) is flagged by `gptpar
status` and left out of the report (`mixed_configs`).
"""

from __future__ import annotations

import dataclasses
from itertools import pairwise
from typing import Any

from gptpar.config import Config, LogConfig, ReportConfig
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
                again: str = "pass --start-over to set the old folder aside and start over") -> None:
    """Refuse a start whose config changes a key that is not RESUMABLE: `cfg` against config.yaml, `runs` (the config
    the ranks run, by default `cfg`) against the last log header; `again` says how to start over. Then write
    config.yaml: the first time, or with the RESUMABLE keys that changed."""
    saved = folder.read_config()
    saved = None if saved is None else completed(saved)
    if saved is not None:
        _refuse_changes(folder, saved, cfg, "holds a different config", again)
    ran = last_config(folder, again)
    if ran is not None:
        _refuse_changes(folder, ran, cfg if runs is None else runs, "was trained with a different config", again)
    if saved != cfg.to_dict():
        folder.write_config(cfg)


def _refuse_changes(folder: RunFolder, old: dict[str, Any], cfg: Config, what: str, again: str) -> None:
    if config_changes(old, cfg.to_dict(), RESUMABLE):
        raise GptparError(f"run folder {folder.path} {what} ({config_diff(old, cfg.to_dict(), ignore=RESUMABLE)}); "
                          f"a run resumes with the config it was trained with, changing only {resumable_keys()}: "
                          f"undo the change, use another log.run_id, or {again}")


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
    """Why a run's starts ran different configs (a key that is not RESUMABLE, old -> new), in one line; "" when they
    ran one. Only a log written before gptpar checked a resumed start has them, and its numbers mix the configs."""
    for log in ranks:
        headers = [h for h in log.headers if _recorded(h)]
        for before, after in pairwise(headers):
            old, new = completed(before["config"]), completed(after["config"])
            if config_changes(old, new, RESUMABLE):
                return (f"its starts ran different configs (restart {after.get('restart', '?')} of rank {log.rank}: "
                        f"{config_diff(old, new, limit=2, ignore=RESUMABLE)}); its numbers mix them")
    return ""
