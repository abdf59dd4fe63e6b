"""The login side (launch/) and the report (analysis/) never import torch or the trainer, the log format has one
writer and one reader, and every subcommand answers --help. The layers and the import loops are
tests/test_structure.py's, which reads every import (deferred and type-only ones too)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

from gptpar.cli import build_parser

LIBRARY = sorted([*(REPO / "gptpar").rglob("*.py"), *(REPO / "analysis").glob("*.py")])
HEAVY = ("torch", "transformers", "gptpar.train", "gptpar.models", "gptpar.parallel.process_group",
         "gptpar.parallel.dims", "gptpar.parallel.data_parallel", "gptpar.parallel.pipeline", "gptpar.pipeline",
         "gptpar.parallel.tensor_parallel", "gptpar.tensor_bytes")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, top_level_only: bool) -> set[str]:
    """Modules a file imports (every import, or only those run when the module is imported)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


@pytest.mark.parametrize("path", [p for p in LIBRARY if p.parent.name in ("launch", "analysis")],
                         ids=lambda p: p.relative_to(REPO).as_posix())
def test_launch_and_analysis_never_import_torch_or_the_trainer(path: Path) -> None:
    """Not even inside a function: the login side must run where torch is slow or missing."""
    heavy = sorted(m for m in imports(path, top_level_only=False) if m.startswith(HEAVY))
    assert not heavy, f"{path.name} imports {heavy}"


@pytest.mark.slow
def test_the_login_side_loads_without_torch() -> None:
    modules = [module_name(p) for p in LIBRARY if p.parent.name in ("launch", "analysis")]
    code = ("import sys\n" + "".join(f"import {m}\n" for m in [*modules, "gptpar.cli", "gptpar.run.state"])
            + "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers'))\n"
            + "assert not loaded, loaded\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


@pytest.mark.parametrize("path", [p for p in LIBRARY if p.parent.name == "plan" and p.name != "measure.py"],
                         ids=lambda p: p.relative_to(REPO).as_posix())
def test_the_planner_imports_torch_only_where_it_calibrates(path: Path) -> None:
    """`gptpar plan predict` and `search` answer on a login node: only measure.py times the device."""
    heavy = sorted(m for m in imports(path, top_level_only=False) if m.startswith(HEAVY))
    assert not heavy, f"{path.name} imports {heavy}"


def test_the_log_format_has_one_writer_and_one_reader() -> None:
    """Only gptpar/run/logfile.py names rank log files, encodes records or parses them."""
    home = REPO / "gptpar" / "run" / "logfile.py"
    offenders = []
    for path in LIBRARY:
        if path == home:
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names_a_log = isinstance(node, ast.Constant) and isinstance(node.value, str) and (
                node.value.endswith(".jsonl") or node.value.startswith('{"kind"'))
            parses = isinstance(node, ast.Attribute) and node.attr in ("loads", "dumps") and isinstance(
                node.value, ast.Name) and node.value.id == "orjson"
            if names_a_log or parses:
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not offenders, offenders


def subcommands() -> list[str]:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return sorted(sub.choices)


def test_every_subcommand_is_known() -> None:
    assert subcommands() == ["cancel", "checkpoint", "config", "data", "debug", "doctor", "logs", "plan", "report",
                             "schedule", "status", "submit", "sweep", "trace", "train"]


@pytest.mark.parametrize("command", subcommands())
@pytest.mark.slow
def test_every_subcommand_answers_help_with_options_and_examples(command: str) -> None:
    out = subprocess.run([sys.executable, "-m", "gptpar", command, "--help"], capture_output=True, text=True,
                         cwd=REPO, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"usage: gptpar {command}")
    assert "options:" in out.stdout and f"examples:\n  gptpar {command}" in out.stdout


@pytest.mark.slow
def test_version_and_python_dash_m() -> None:
    from gptpar import __version__

    for argv in (["-m", "gptpar", "--version"], ["-m", "gptpar.cli", "--version"]):
        out = subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=REPO, timeout=60)
        assert (out.returncode, out.stdout.strip()) == (0, f"gptpar {__version__}")


@pytest.mark.slow
def test_bad_options_use_the_one_error_format() -> None:
    out = subprocess.run([sys.executable, "-m", "gptpar", "submit", "dp", "--gpus", "two"], capture_output=True,
                         text=True, cwd=REPO, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip() == ("gptpar: error: argument --gpus: expected a non-negative integer, got 'two' "
                                  "(see `gptpar submit --help`)")


def test_the_assignments_names_stay_importable_where_students_import_them() -> None:
    from gptpar.data import DataPartitioner, Partition, partition_dataset
    from gptpar.parallel import average_gradients
    from gptpar.pipeline import (
        GPT2LMHeadModelParallel,
        GPT2ModelParallel,
        Pipe,
        WithDevice,
        _clock_cycles,
        _split_module,
        clock_cycles,
        split_module,
    )

    assert all(callable(x) for x in (DataPartitioner, Partition, partition_dataset, average_gradients, Pipe,
                                     WithDevice, _split_module, clock_cycles, _clock_cycles, split_module,
                                     GPT2ModelParallel, GPT2LMHeadModelParallel))
