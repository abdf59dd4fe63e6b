"""Print the tested lock: every package gptpar and all its extras need, with the version installed here.

`make lock` writes it to requirements.lock after the test suite passed with those versions; torch and its
own dependencies are left to TORCH_SPEC (a CPU, CUDA or ROCm build). tests/e2e/test_packaging.py checks the
lock against pyproject.toml and against this environment.
"""

from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
SEPARATE = {"torch"}  # installed by TORCH_SPEC, with whatever its build needs


def declared() -> list[Requirement]:
    """The runtime dependencies and those of every extra."""
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    texts = [*project["dependencies"], *(r for extra in project["optional-dependencies"].values() for r in extra)]
    return [Requirement(text) for text in texts if not text.startswith("gptpar")]


def closure(roots: list[Requirement]) -> dict[str, str]:
    """{name: installed version} of the roots and everything they need on this platform, torch's tree aside."""
    found: dict[str, str] = {}
    todo = [(r, ()) for r in roots]
    while todo:
        req, extras = todo.pop()
        name = canonicalize_name(req.name)
        if name in SEPARATE or (req.marker and not any(req.marker.evaluate({"extra": e}) for e in extras or ("",))):
            continue
        if name in found and not req.extras:
            continue
        found[name] = metadata.version(req.name)
        todo += [(Requirement(text), tuple(req.extras)) for text in metadata.requires(req.name) or ()]
    return found


def main() -> None:
    lock = closure(declared())
    sys.stdout.write("# The tested lock (make lock): pip install -r requirements.lock; torch comes from TORCH_SPEC.\n")
    sys.stdout.writelines(f"{name}=={version}\n" for name, version in sorted(lock.items()))


if __name__ == "__main__":
    main()
