"""The package's shape, read from its imports with ``ast`` (docs/architecture.md).

Every import counts: module level and inside functions (where cycles hide); imports
under ``if TYPE_CHECKING:`` count for the layer rules but not for cycles (they never
run). A failure names each offending import as ``file:line``."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = "pyspark_txn"
ROOT = Path(__file__).resolve().parents[2] / PACKAGE


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the imported module (a submodule when ``from pkg import submodule``)
    where: str  # file:line
    typing_only: bool = False  # under ``if TYPE_CHECKING:``

    def __str__(self) -> str:
        return f"{self.where}: {self.source} imports {self.target}"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _imports(modules: dict[str, Path]) -> list[Import]:
    found = []
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        tree = ast.parse(path.read_text(), str(path))
        typing_only = {
            id(n)
            for block in ast.walk(tree)
            if isinstance(block, ast.If) and ast.unparse(block.test).endswith("TYPE_CHECKING")
            for stmt in block.body
            for n in ast.walk(stmt)
        }
        for node in ast.walk(tree):
            where = f"{path.relative_to(ROOT.parent)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                # ``from pkg import sub`` imports the module pkg.sub; other names: pkg
                targets = [
                    f"{module}.{a.name}" if f"{module}.{a.name}" in modules else module
                    for a in node.names
                ]
            else:
                continue
            found += [
                Import(name, t, where, id(node) in typing_only) for t in dict.fromkeys(targets)
            ]
    return found


MODULES = _modules()
IMPORTS = _imports(MODULES)
INTERNAL = [i for i in IMPORTS if i.target.split(".")[0] == PACKAGE]


def _in(module: str, *areas: str) -> bool:
    """Whether ``module`` is one of ``areas`` (``pyspark_txn.x`` names) or inside one."""
    return any(module == a or module.startswith(a + ".") for a in areas)


def _p(*names: str) -> tuple[str, ...]:
    return tuple(f"{PACKAGE}.{n}" if n else PACKAGE for n in names)


SOURCES, SINKS, OPERATIONS, CLI = _p("sources"), _p("sinks"), _p("operations"), _p("cli")
#: the public shims of moved operation modules count as the operations
OPERATIONS_ALL = OPERATIONS + _p("admin", "snapshots")
#: the pure protocol: ``state`` less its backends (and the package's re-exports)
STATE_CORE = [
    m
    for m in MODULES
    if _in(m, *_p("state")) and not _in(m, *_p("state.backends")) and m != f"{PACKAGE}.state"
]
#: the top: what only the public face (and the CLI and operations) may import
TOP = _p("", "session", "formats")


def _broken(rule, imports=INTERNAL) -> list[str]:
    return [str(i) for i in imports if rule(i)]


def test_the_import_reader_sees_the_package():
    # the test cannot pass vacuously: it reads every module and the known edges
    assert {*_p("state.core", "sinks.delta", "operations.handle", "cli")} <= set(MODULES)
    edges = {(i.source, i.target) for i in INTERNAL}
    assert (f"{PACKAGE}.sinks.delta", f"{PACKAGE}.sinks.hooks") in edges
    # a function-level import is read too
    assert any(i.source == f"{PACKAGE}.operations.snapshots.prepare" for i in INTERNAL)


def _cycles() -> list[list[Import]]:
    graph: dict[str, list[Import]] = {}
    for i in INTERNAL:
        if i.target != i.source and i.target in MODULES and not i.typing_only:
            graph.setdefault(i.source, []).append(i)
    # Tarjan's strongly connected components; each component of 2+ modules is a cycle
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[Import]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for e in graph.get(v, []):
            if e.target not in index:
                visit(e.target)
                low[v] = min(low[v], low[e.target])
            elif e.target in on:
                low[v] = min(low[v], index[e.target])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(
                    [e for s in sorted(comp) for e in graph.get(s, []) if e.target in comp]
                )

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    cycles = _cycles()
    assert not cycles, "import cycles (every import inside each cycle):\n" + "\n\n".join(
        "\n".join(str(e) for e in c) for c in cycles
    )


RULES = {
    "sources never import sinks": lambda i: _in(i.source, *SOURCES) and _in(i.target, *SINKS),
    "sinks never import sources": lambda i: _in(i.source, *SINKS) and _in(i.target, *SOURCES),
    "sinks never import the operations or the CLI": lambda i: (
        _in(i.source, *SINKS) and _in(i.target, *OPERATIONS_ALL, *CLI)
    ),
    "nothing but the CLI (and python -m) imports the CLI": lambda i: (
        _in(i.target, *CLI) and not _in(i.source, *CLI, *_p("__main__"))
    ),
    "the operations never import the CLI": lambda i: (
        _in(i.source, *OPERATIONS_ALL) and _in(i.target, *CLI)
    ),
    "the state core imports only itself and errors": lambda i: (
        i.source in STATE_CORE and not (i.target in STATE_CORE or i.target == f"{PACKAGE}.errors")
    ),
    "storage imports only itself and errors": lambda i: (
        _in(i.source, *_p("storage")) and not _in(i.target, *_p("storage", "errors"))
    ),
    "spark glue imports no connector, operation or CLI": lambda i: (
        _in(i.source, *_p("spark")) and _in(i.target, *SOURCES, *SINKS, *OPERATIONS_ALL, *CLI)
    ),
    "below the top nothing imports the public face (pyspark_txn, session, formats)": lambda i: (
        _in(i.source, *_p("state", "storage", "spark", "sources", "sinks")) and i.target in TOP
    ),
}


@pytest.mark.parametrize("rule", sorted(RULES))
def test_layer_rule(rule):
    broken = _broken(RULES[rule])
    assert not broken, f"{rule}; broken by:\n" + "\n".join(broken)


FORBIDDEN_IN_STATE_CORE = ("pyspark", "deltalake", "fsspec", "py4j")


def test_the_state_core_imports_no_spark_or_io_library():
    broken = _broken(
        lambda i: i.source in STATE_CORE and i.target.split(".")[0] in FORBIDDEN_IN_STATE_CORE,
        IMPORTS,
    )
    assert not broken, "state core importing Spark or IO libraries:\n" + "\n".join(broken)
