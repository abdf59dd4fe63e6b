"""Atomic writes: a reader on a shared filesystem sees the old file or the new one, never half of one.

A write that fails (a full disk above all) leaves the old file in place and raises a one-line
GptparError naming the file; `write_error` builds that line for every writer of the project (log
records, checkpoints, token caches, run folder files).
"""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO

from gptpar.errors import GptparError

# "No space left on device", "Disk quota exceeded", and "File too large" (a file-size limit: a full
# disk as far as this process can tell, e.g. under `ulimit -f`).
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def is_disk_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS


def os_error(exc: BaseException) -> OSError | None:
    """The OSError under `exc`, if any: torch's file writer reports a full disk as a RuntimeError raised while
    handling the OSError of the write (`[enforce fail at inline_container.cc:672] . unexpected pos ...`)."""
    seen: set[int] = set()
    inner: BaseException | None = exc
    while inner is not None and id(inner) not in seen:
        if isinstance(inner, OSError):
            return inner
        seen.add(id(inner))
        inner = inner.__cause__ or inner.__context__
    return None


def write_error(path: str | Path, exc: OSError, kept: str = "") -> GptparError:
    """The one line for a failed write of `path`; `kept` says what survived (e.g. the last good checkpoint)."""
    reason = exc.strerror or str(exc) or type(exc).__name__
    kept = f"; {kept}" if kept else ""
    if is_disk_full(exc):
        return GptparError(f"disk full: cannot write {path} ({reason}){kept}; free some space, then run again")
    return GptparError(f"cannot write {path} ({reason}){kept}")


PROBE_BYTES = 1 << 20  # past any slack in a file's last block, and past a small file-size limit


def _write_probe(path: str | Path, mode: str) -> OSError | None:
    try:
        with open(path, mode, buffering=0) as f:
            for _ in range(PROBE_BYTES // 65536):
                f.write(b"\0" * 65536)
            os.fsync(f.fileno())
    except OSError as exc:
        return exc if exc.errno is not None else None
    return None


def probe_space(directory: str | Path) -> OSError | None:
    """Whether writing in `directory` fails now, and why: the error of writing up to 1 MiB into a scratch
    file (ENOSPC or EFBIG on a full disk), or None when that works. For writers whose own error lost
    the reason (torch's file writer, or an error gathered from another rank)."""
    try:
        fd, scratch = tempfile.mkstemp(dir=directory, prefix=".space-probe.", suffix=".tmp")
    except OSError as exc:
        return exc if exc.errno is not None else None
    os.close(fd)
    try:
        return _write_probe(scratch, "ab")
    finally:
        Path(scratch).unlink(missing_ok=True)


def _diagnosed(exc: OSError, tmp: str) -> OSError:
    """Some writers report a short write as an OSError without an errno (numpy's `tofile`: "N requested
    and M written"); writing on where they stopped tells why (a full disk answers ENOSPC or EFBIG)."""
    if exc.errno is not None:
        return exc
    return _write_probe(tmp, "ab") or exc


def atomic_write(path: str | Path, write: Callable[[IO[bytes]], object], kept: str = "") -> None:
    """Write through `write(file)` into a temporary file beside `path`, fsync, then rename over it.

    An OSError (a full disk, a parent that is a file), also one under the writer's own error (torch.save's),
    becomes a one-line GptparError naming `path` and saying `kept` (what survived, see write_error);
    the old file, if any, is untouched and no temporary file is left behind."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        raise write_error(path, exc, kept) from exc
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except Exception as exc:
        cause = os_error(exc)
        if cause is not None:
            cause = _diagnosed(cause, tmp)  # writes on where the writer stopped: before the temporary file goes
        Path(tmp).unlink(missing_ok=True)
        if cause is None:
            raise
        raise write_error(path, cause, kept) from exc
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write(path, lambda f: f.write(text.encode("utf-8")))
