"""Run ids, sweep point names and slugs: one rule each, so folders never collide or escape.

An explicit `log.run_id` is used as given (after validation: one path segment of safe characters).
Only derived ids get a suffix: the SLURM job (and array task) id, which a requeued job keeps so it
resumes in its own folder, else a number one above the runs of that name in the runs folder (`dp.3`), whose
folder is made as it is chosen (gptpar.run.start.next_run_id), so runs named at the same moment never share one.

Also the name of a run folder set aside by `gptpar sweep --rerun` or `gptpar train --start-over`:
`<folder>.replaced-<time>` (gptpar.run.sweeps tells the report which folders are stale).
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from collections import Counter
from collections.abc import Mapping, Sequence

from gptpar.errors import GptparError

SAFE = "A-Za-z0-9_.+=,-"
RUN_ID = re.compile(f"[{SAFE}]+")
UNSAFE_RUN = re.compile(f"[^{SAFE}]+")
SLUG_MAX = 100


def short_hash(text: str, length: int = 8) -> str:
    return hashlib.sha256(text.encode("utf-8", errors="surrogatepass")).hexdigest()[:length]


def slug(text: str, max_len: int = SLUG_MAX) -> str:
    """A file-name-safe form of `text`. A lossy slug (characters replaced or text cut) ends in a hash
    of the original, so two different texts never share a slug."""
    plain = UNSAFE_RUN.sub("_", text).strip("_.") or "run"
    if plain == text and len(text) <= max_len:
        return text
    tag = short_hash(text)
    return f"{plain[:max_len - len(tag) - 1]}-{tag}"


def check_run_id(run_id: str, key: str = "log.run_id") -> str:
    """A run id must be one folder name inside the runs folder: no separators, no `.`/`..`."""
    if not RUN_ID.fullmatch(run_id) or set(run_id) == {"."}:
        raise GptparError(f"{key}: {run_id!r} must be one folder name of letters, digits and _ . + = , - "
                          "(not '.' or '..')")
    return run_id


def job_run_id(name: str, env: Mapping[str, str] | None = None) -> str | None:
    """`NAME-<job id>` inside a SLURM job (stable across requeues), else None."""
    env = os.environ if env is None else env
    job = env.get("SLURM_ARRAY_JOB_ID") or env.get("SLURM_JOB_ID")
    if not job:
        return None
    task = env.get("SLURM_ARRAY_TASK_ID")
    prefix = slug(name, 60)
    return check_run_id(f"{prefix}-{job}_{task}" if task else f"{prefix}-{job}")


def numbered(name: str) -> re.Pattern[str]:
    """The folders of the runs numbered after `name` (`NAME.N`, also set aside: `NAME.N.replaced-<time>`); the
    number is group 1."""
    return re.compile(re.escape(slug(name, 60)) + r"\.(\d+)(?:\.replaced-.*)?")


def numbered_run_id(name: str, number: int) -> str:
    """`NAME.N`: short, and never a plain sbatch script's `NAME-<job id>`, whose folder a pending job will make."""
    return check_run_id(f"{slug(name, 60)}.{number}")


def point_name(pairs: Sequence[str]) -> str:
    """The folder of a sweep point from its `key=value` pairs; distinct values give distinct folders."""
    return slug(",".join(pairs)) if pairs else "base"


def short_names(keys: Sequence[str]) -> dict[str, str]:
    """Each key's last segment, or the whole key where two keys share the segment."""
    last = Counter(k.rpartition(".")[2] for k in keys)
    return {k: k.rpartition(".")[2] if last[k.rpartition(".")[2]] == 1 else k for k in keys}


def point_label(pairs: Sequence[str]) -> str:
    """A sweep point as people read it, by the keys the sweep varies (`dp_sync=zero1, lr=0.001, repeat=1`, the
    report's names for them); "base" for a sweep without axes."""
    split = [pair.partition("=") for pair in pairs]
    names = short_names([key for key, _, _ in split])
    return ", ".join(f"{names[key]}={value}" for key, _, value in split) or "base"


REPLACED = re.compile(r"\.replaced-(\d{8}-\d{6})(?:\.\d+)?$")


def replaced_name(name: str, now: float | None = None) -> str:
    """The name a run folder is set aside under when it is started over (`gptpar sweep --rerun`,
    `gptpar train --start-over`): `<name>.replaced-<YYYYmmdd-HHMMSS>`."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(time.time() if now is None else now))
    return f"{name}.replaced-{stamp}"


def replaced(name: str) -> bool:
    """Whether a run folder's name says it was set aside: its results belong to an earlier config."""
    return REPLACED.search(name) is not None
