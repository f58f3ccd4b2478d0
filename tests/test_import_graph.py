"""The package's import graph (every import, at module top or inside a function, read from the source): no
cycle among modules or among packages, the layering of docs/ARCHITECTURE.md, imports inside functions that
say why, and docstrings whose cited pages exist."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "stratarl"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _owner(name: str) -> str:
    """The module that defines ``name`` (``a.b.c`` -> ``a.b`` when ``c`` is not a module)."""
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def imports_of(module: str) -> tuple[set[str], set[str]]:
    """(stratarl modules, top-level third-party / stdlib names) that ``module`` imports anywhere in its file."""
    path = MODULES[module]
    ours, others = set(), set()
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            names = [(base, alias.name) for alias in node.names]
        else:
            continue
        for base, attr in names:
            if base.split(".")[0] != "stratarl":
                others.add(base.split(".")[0])
                continue
            full = f"{base}.{attr}" if attr else base
            ours.add(full if full in MODULES else _owner(base))
    ours.discard(module)
    return ours, others


GRAPH = {module: imports_of(module)[0] for module in MODULES}


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Components with more than one node (Tarjan), each sorted: every import cycle lies inside one."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _package(module: str) -> str:
    return ".".join(module.split(".")[:2])


def test_the_graph_sees_imports_inside_functions():
    # stratarl.commands.train imports the trainer only inside its functions (start-up time of `stratarl --help`).
    assert "stratarl.trainer.config" in GRAPH["stratarl.commands.train"]
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert strongly_connected({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_among_modules():
    assert strongly_connected(GRAPH) == []


def test_no_import_cycle_among_packages():
    packages: dict[str, set[str]] = {}
    for module, targets in GRAPH.items():
        packages.setdefault(_package(module), set()).update(
            _package(t) for t in targets if _package(t) != _package(module)
        )
    assert strongly_connected(packages) == []


@pytest.mark.parametrize(
    "package, allowed",
    [("stratarl.algos", {"torch"}), ("stratarl.rewards", set()), ("stratarl.registry", set())],
)
def test_the_pure_packages_import_only_torch_and_the_standard_library(package, allowed):
    for module in (m for m in MODULES if m == package or m.startswith(package + ".")):
        ours, others = imports_of(module)
        assert {_package(m) for m in ours} <= {package, "stratarl.registry"}, module  # the registry: stdlib only
        assert others - {"__future__"} <= allowed | set(sys.stdlib_module_names), module


# The layers of docs/ARCHITECTURE.md, lowest first: a package imports only packages of lower layers.
LAYERS = [
    {"stratarl.registry"},
    {
        "stratarl",
        "stratarl.algos",
        "stratarl.rewards",
        "stratarl.publish",
        "stratarl.cache",
        "stratarl.config_errors",
        "stratarl.extensions",
    },
    {"stratarl.config_tree", "stratarl.models"},
    {"stratarl.infra"},
    {"stratarl.retrieval"},
    {"stratarl.rollout"},
    {"stratarl.data"},
    {"stratarl.evaluation", "stratarl.integrations"},
    {"stratarl.trainer"},
    {"stratarl.commands"},
    {"stratarl.cli"},
]
LAYER_OF = {package: i for i, layer in enumerate(LAYERS) for package in layer}


def test_every_package_has_a_layer():
    assert {_package(m) for m in MODULES} == set(LAYER_OF)


def test_packages_import_only_lower_layers():
    """The map of docs/ARCHITECTURE.md: e.g. nothing below the command line imports the trainer, the evaluation
    package and the veRL plugins never do, and the reusable training parts (infra) import no loop."""
    broken = sorted(
        (module, target)
        for module, targets in GRAPH.items()
        for target in targets
        if _package(target) != _package(module) and LAYER_OF[_package(target)] >= LAYER_OF[_package(module)]
    )
    assert broken == []


def test_only_the_command_line_imports_the_trainer_and_nothing_imports_the_command_line():
    for module, targets in GRAPH.items():
        layer = _package(module)
        for target in targets:
            if _package(target) == "stratarl.trainer":
                assert layer in ("stratarl.trainer", "stratarl.commands", "stratarl.cli"), (module, target)
            if _package(target) in ("stratarl.commands", "stratarl.cli"):
                assert layer in ("stratarl.commands", "stratarl.cli"), (module, target)


def _trainer_kind(module: str) -> str | None:
    """Which kind of the trainer a module is (docs/ARCHITECTURE.md): its config, its warm start, or the loop."""
    parts = module.split(".")
    if parts[:2] != ["stratarl", "trainer"]:
        return None
    return parts[2] if len(parts) > 2 and parts[2] in ("config", "warmstart") else "loop"


def test_the_trainers_config_imports_no_loop_and_the_loop_only_the_warm_starts_thoughts():
    crossing = sorted(
        (module, target)
        for module, targets in GRAPH.items()
        for target in targets
        if _trainer_kind(module) and _trainer_kind(target) not in (None, _trainer_kind(module))
    )
    assert not [(m, t) for m, t in crossing if _trainer_kind(m) == "config"]
    assert [(m, t) for m, t in crossing if _trainer_kind(t) == "warmstart"] == [
        ("stratarl.trainer.setup", "stratarl.trainer.warmstart.render")
    ]


def test_imports_inside_functions_say_why():
    """Outside the command line (kept lazy so `stratarl --help` is fast), an import inside a function, of any
    package (ours, the standard library, or a third party such as torch), carries a comment on its line
    saying why it is not at the module's top (an optional dependency, start-up cost), or on the line above it."""
    lazy = []
    for module, path in MODULES.items():
        if _package(module) in ("stratarl.commands", "stratarl.cli"):
            continue
        lines = path.read_text().splitlines()
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if not isinstance(node, (ast.Import, ast.ImportFrom)):
                    continue
                if "#" not in lines[node.lineno - 1] and not lines[node.lineno - 2].strip().startswith("#"):
                    lazy.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert lazy == []


def test_every_markdown_file_a_docstring_names_exists():
    """A docstring or comment that cites a page (``docs/*.md`` or an upper-case ``NAME.md``) points at a file of
    this repository: never at pages users do not have."""
    import re

    root = PACKAGE.parent
    cited = re.compile(r"(?<![\w/.-])(docs/[\w/.-]+\.md|[A-Z][A-Z_]+\.md)")
    missing = []
    for path in PACKAGE.rglob("*.py"):
        for name in cited.findall(path.read_text()):
            candidates = [root / name, root / "docs" / name, root / "benchmarks" / "evidence" / name]
            if not any(c.is_file() for c in candidates):
                missing.append(f"{path.relative_to(root)}: {name}")
    assert missing == []


def test_every_test_file_the_docs_and_the_code_name_exists():
    """A page, docstring or comment that names a test (``tests/.../test_x.py``) points at a file that exists: the
    tests mirror the package layout, and a move updates what cites them."""
    import re

    root = PACKAGE.parent
    cited = re.compile(r"(?<![\w/.-])(tests/[\w/.-]+\.py)")
    sources = [root / "README.md", *root.glob("docs/**/*.md"), *PACKAGE.rglob("*.py"), *root.glob("benchmarks/**/*.py")]
    missing = [
        f"{path.relative_to(root)}: {name}"
        for path in sources
        for name in cited.findall(path.read_text())
        if not (root / name).is_file()
    ]
    assert missing == []
