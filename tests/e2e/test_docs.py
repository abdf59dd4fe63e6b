"""The pages under docs/ hold what they say: every test a page names as holding a claim exists."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from conftest import REPO

NAMED_TEST = re.compile(r"`(tests/[\w/]+\.py)(?:::(\w+))?`")


def _functions(path: Path) -> set[str]:
    return {node.name for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.FunctionDef)}


@pytest.mark.parametrize("page", sorted((REPO / "docs").glob("*.md")), ids=lambda p: p.name)
def test_every_test_a_page_names_exists(page: Path) -> None:
    named = NAMED_TEST.findall(page.read_text())
    missing = [f"{file}::{name}" if name else file for file, name in named
               if not (REPO / file).is_file() or (name and name not in _functions(REPO / file))]
    assert not missing, f"{page.name} names tests that do not exist: {missing}"


def test_the_gpu_page_names_its_tests() -> None:
    assert len(NAMED_TEST.findall((REPO / "docs" / "gpu.md").read_text())) >= 10
