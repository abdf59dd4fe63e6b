"""What is wrong with a path a user named, in the same words wherever a folder or a file is checked: it "does not
exist", "is a file, not a folder", "is a folder, not a file", or "lies under F, which is a file". A path of the
wrong kind is never reported as missing, and a file where a folder would have to be made is found before a write
fails with a misleading "File exists"."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from gptpar.errors import GptparError

Kind = Literal["file", "folder"]


def path_problem(path: str | Path, kind: Kind, must_exist: bool = True) -> str | None:
    """Why `path` cannot serve as a `kind`, or None when it can. With `must_exist=False` (a file or folder about
    to be written) a path that does not exist yet is fine, unless a file stands where one of its folders would be."""
    path = Path(path)
    if path.is_dir():
        return None if kind == "folder" else "is a folder, not a file"
    if path.exists():
        return None if kind == "file" else "is a file, not a folder"
    blocker = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        return f"lies under {blocker}, which is a file"
    return "does not exist" if must_exist else None


def check_path(path: str | Path, kind: Kind, what: str, fix: str = "", must_exist: bool = True) -> Path:
    """`path` as a Path, or a one-line GptparError: `what` (the setting or option that named it), the path,
    what is wrong with it and `fix`."""
    problem = path_problem(path, kind, must_exist)
    if problem is not None:
        raise GptparError(f"{what} {str(path)!r} {problem}" + (f"; {fix}" if fix else ""))
    return Path(path)
