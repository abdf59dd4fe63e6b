"""The import graph of gptpar/, analysis/ and bench/, read with `ast` (nothing is imported): every import counts,
at the top of a module, inside a function (deferred) or under `if TYPE_CHECKING:`, and so does a module loaded by
name (a `"module:Class"` string, `importlib.import_module("literal")`). A loop held open by a deferred or type-only
import is still a loop, and an import from a lower layer to a higher one is a design error even when it is lazy.

The layers, lowest first (derived from the tree and docs/architecture.md): a unit may import its own modules and any
unit of a lower layer, never one of its own layer's other units nor a higher layer. The rank side (strategies to
train) therefore never imports the login side (launch, plan, analysis) nor the user's defaults.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("gptpar", "analysis", "bench")
LAYERS = [
    # the floor: no parallelism, no config; what every layer may use, itself in three steps
    {"gptpar", "errors", "clock", "markdown", "tensor_bytes", "hardware", "hub", "architectures", "launchers"},
    {"atomic", "paths", "presets"},
    {"pretrained", "snapshot", "adapters"},  # adapters: what a LoRA model trains, counted from its shape
    {"flops"},
    {"strategies"},  # torch-free tables of each parallelism: what the config and the planner read
    {"config"},  # schema, load, validate
    {"models", "data"},  # the model home (architectures, the build from a config, the loss); tokenizers, corpora
    {"parallel"},  # everything about ranks
    {"run"},  # the only code that knows a run folder
    {"train"},  # the trainer and its components: the top of the rank side
    {"pipeline"},  # the course's one-process Pipe API, in its corner: the training path never goes through it
    {"cluster"},  # what a cluster is, as data: its profiles and a job's shape on it (launcher and planner read it)
    {"user_defaults"},  # the user's defaults file (profiles, run names), beneath every config a login command reads
    {"plan", "analysis"},  # the planner and the report: siblings, neither imports the other
    {"launch"},  # the launchers: a run's folder and plan.json prepared, its job submitted, its status read
    {"doctor"},  # the environment check
    {"cli", "api"},  # every subcommand and the Python API beside it
    {"__main__"},
    {"bench"},  # benchmarks drive any of it
]
LAYER = {unit: rank for rank, units in enumerate(LAYERS) for unit in units}
# A table that names code by "module:Class" string is not the one that imports it: the loader is, the one of its
# loaders whose package (a loader that is a module: the package it sits in) holds the named module (a name under none
# of them counts as the table's own import).
LOADERS = {"gptpar.strategies.data_parallel": ("gptpar.parallel.data_parallel",),
           "gptpar.architectures": ("gptpar.models", "gptpar.parallel.tensor_parallel"),
           "gptpar.launchers": ("gptpar.launch.backend",)}

# Nothing is left to excuse: every import points down its layers and none closes a circle.
KNOWN_UPWARD: set[tuple[str, str]] = set()
KNOWN_CYCLES: set[tuple[str, ...]] = set()


@functools.cache
def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in sorted((REPO / package).rglob("*.py"))}


def unit(module: str) -> str:
    """The layer unit of a module: gptpar's top-level module or package, or analysis, or bench."""
    parts = module.split(".")
    return parts[1] if parts[0] == "gptpar" and len(parts) > 1 else parts[0]


def imported_names(module: str, path: Path) -> Iterator[str]:
    """Every module name `module` imports or loads by name, wherever in the file."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(parsed(path)):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            yield base  # `from a import b` runs a; b is a submodule or a name in a
            yield from (f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Call) and _is_import_module(node.func) and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                yield arg.value


def _is_import_module(func: ast.expr) -> bool:
    return (isinstance(func, ast.Attribute) and func.attr == "import_module") or (
        isinstance(func, ast.Name) and func.id == "import_module")


def named_classes(path: Path) -> Iterator[str]:
    """The modules of the `"module:Class"` strings in a file."""
    for node in ast.walk(parsed(path)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.count(":") == 1:
            name, _, cls = node.value.partition(":")
            if name.split(".")[0] in PACKAGES and cls.isidentifier():
                yield name


def loader_of(table: str, named: str) -> str:
    """The module that loads `named`, a module a "module:Class" string of `table` names."""
    return next((loader for loader in LOADERS.get(table, ()) if f"{named}.".startswith(f"{package_of(loader)}.")),
                table)


def package_of(module: str) -> str:
    """The package a module's loads must sit in: the module itself where it is a package, else its parent."""
    return module if Path(REPO, *module.split(".")).is_dir() else module.rpartition(".")[0]


def import_graph(extra: dict[str, set[str]] | None = None) -> dict[str, set[str]]:
    """module -> the modules of this repository it imports (an imported name that is no module counts as its
    package's import); `extra` adds edges (a planted import)."""
    mods = modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for module, path in mods.items():
        graph[module] |= {r for r in map(resolve, imported_names(module, path)) if r and r != module}
        for named in filter(None, map(resolve, named_classes(path))):
            loader = loader_of(module, named)
            if named != loader:
                graph[loader].add(named)
    for module, targets in (extra or {}).items():
        graph[module] |= targets
    return graph


def upward(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """Imports into a higher layer or into another unit of the importer's own layer."""
    return {(a, b) for a, targets in graph.items() for b in targets
            if unit(a) != unit(b) and LAYER[unit(b)] >= LAYER[unit(a)]}


def cycles(graph: dict[str, set[str]]) -> set[tuple[str, ...]]:
    """The strongly connected components of more than one module (Tarjan), each as its sorted modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: set[tuple[str, ...]] = set()

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.add(tuple(sorted(component)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_unit_has_a_layer() -> None:
    assert {unit(m) for m in modules()} - LAYER.keys() == set()


def test_a_loader_of_named_classes_imports_by_name() -> None:
    for loader in (loader for loaders in LOADERS.values() for loader in loaders):
        calls = [n for n in ast.walk(parsed(modules()[loader]))
                 if isinstance(n, ast.Call) and _is_import_module(n.func)]
        assert calls, f"{loader} is said to load the table's classes but never calls import_module"


def test_no_import_points_up_but_the_known_ones() -> None:
    assert sorted(upward(import_graph())) == sorted(KNOWN_UPWARD)


def test_no_import_cycle_but_the_known_ones() -> None:
    assert sorted(cycles(import_graph())) == sorted(KNOWN_CYCLES)


def test_a_deferred_upward_import_is_caught(tmp_path: Path) -> None:
    """The check reads function bodies: a config module that imports the trainer inside a function is a violation
    (and a cycle, through the trainer's own import of the config)."""
    planted = tmp_path / "planted.py"
    planted.write_text("def f():\n    from gptpar.train.trainer import Trainer\n    return Trainer\n")
    names = set(imported_names("gptpar.config.checks", planted))
    graph = import_graph({"gptpar.config.checks": {n for n in names if n in modules()}})
    assert ("gptpar.config.checks", "gptpar.train.trainer") in upward(graph) - KNOWN_UPWARD
    assert cycles(graph) - KNOWN_CYCLES
