"""The evidence runner's modules (benchmarks/evidence/): one job each, and no import cycle between them."""

from __future__ import annotations

import ast
from pathlib import Path

EVIDENCE = Path(__file__).resolve().parents[2] / "benchmarks" / "evidence"


def _sibling_imports(path: Path, siblings: set[str]) -> set[str]:
    """The sibling modules ``path`` imports anywhere (top level or inside a function)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in siblings}
        elif isinstance(node, ast.ImportFrom) and node.module in siblings:
            found.add(node.module)
    return found


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path, node, nxt]
            if nxt not in state and (found := visit(nxt, [*path, node])):
                return found
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node, [])):
            return found
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_the_runner_modules_import_each_other_without_a_cycle():
    siblings = {p.stem for p in EVIDENCE.glob("*.py")}
    graph = {name: _sibling_imports(EVIDENCE / f"{name}.py", siblings) for name in siblings}
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph))}"
    # Each job in its module: the command line imports the parts, no part imports the command line.
    assert {"planning", "running", "summaries", "admission"} <= graph["run"]
    assert not any("run" in imports for imports in graph.values())
