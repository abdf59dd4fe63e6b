"""One tested lock; runtime, extras and dev tools apart; the core runs without any extra installed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from conftest import REPO, command_words
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

sys.path.insert(0, str(REPO / "tools"))
import lock  # noqa: E402

EXTRAS_ONLY = ("datasets", "sacrebleu", "tensorboard", "wandb", "pandas", "pytest", "ruff")


def _pins() -> dict[str, str]:
    lines = (REPO / "requirements.lock").read_text().splitlines()
    return dict(line.split("==") for line in lines if line and not line.startswith("#"))


def test_the_lock_is_what_this_venv_has_installed() -> None:
    """The lock records `make install`'s venv: elsewhere (a GPU image with its own packages) there is nothing to
    compare it with."""
    if Path(sys.prefix).resolve() != (REPO / ".venv").resolve():
        pytest.skip(f"{sys.prefix} is not this checkout's venv (make install): its packages are not the lock's")
    assert _pins() == lock.closure(lock.declared()), "run `make lock` after `make test` passes"


def test_every_pinned_version_is_one_pyproject_allows() -> None:
    for req in (r for r in lock.declared() if canonicalize_name(r.name) not in lock.SEPARATE):
        assert req.specifier.contains(_pins()[canonicalize_name(req.name)]), req


def test_heavy_parts_are_extras_and_the_runtime_needs_none_of_them() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    runtime = {canonicalize_name(Requirement(r).name) for r in project["dependencies"]}
    assert runtime.isdisjoint(EXTRAS_ONLY)
    extras = project["optional-dependencies"]
    assert {"hf", "translation", "tensorboard", "wandb", "all", "dev"} <= set(extras)
    dev = {canonicalize_name(Requirement(r).name) for r in extras["dev"]}
    assert dev == {"pytest", "pytest-timeout", "pytest-xdist", "ruff"}


@pytest.mark.slow
def test_training_and_the_report_run_without_the_extras_and_an_hf_source_names_its_extra(tmp_path) -> None:
    hide = f"import sys; sys.modules.update(dict.fromkeys({list(EXTRAS_ONLY)!r}, None)); from gptpar.cli import main"
    tiny = ["train", "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "data.source=stdlib",
            "data.max_chars=4000", "data.seq_len=16", "data.tokenizer=bytes", "train.batch_size=4",
            "train.max_steps=2", "train.eval_every=0", "log.progress=none", f"log.runs_dir={tmp_path}"]
    for argv in (tiny, ["report", str(tmp_path), "--out", str(tmp_path / "figures")]):
        out = subprocess.run([sys.executable, "-c", f"{hide}; sys.exit(main({argv!r}))"], capture_output=True,
                             text=True, cwd=REPO, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
    hf = command_words(tiny, ["data.source=hf:x/y"])
    out = subprocess.run([sys.executable, "-c", f"{hide}; sys.exit(main({hf!r}))"], capture_output=True, text=True,
                         cwd=REPO, timeout=300)
    assert out.returncode == 2
    assert out.stderr.strip() == ("gptpar: error: data.source=hf:x/y needs the hf extra: pip install 'gptpar[hf]' "
                                  "(or make install)")


@pytest.mark.slow
def test_make_install_says_what_it_does_before_each_long_step(tmp_path: Path) -> None:
    """`make install` runs for minutes: every step that can take long (the venv, each pip install, the import check)
    follows a line saying what it is, and pip says each package it collects (not -q) for the two big installs. `make -n`
    prints the recipe without running it."""
    recipe = subprocess.run(["make", "-n", "install", f"VENV={tmp_path / 'venv'}"], cwd=REPO, capture_output=True,
                            text=True, check=True, timeout=60).stdout.splitlines()
    long = [i for i, line in enumerate(recipe) if "-m venv" in line or "pip install" in line or '-c "import' in line]
    assert len(long) == 6 and all(recipe[i - 1].startswith("echo ") for i in long)
    # torch, the lock, Holistic Trace Analysis (no dependencies), gptpar itself
    assert [" -q " in recipe[i] for i in long if "pip install" in recipe[i]] == [False, False, False, True]
