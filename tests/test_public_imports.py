"""Every advertised import works: each name in a package's ``__all__``, each entry of a module's lazy
``__getattr__`` table, and each ``from stratarl... import ...`` line written in a package or module docstring."""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "stratarl"

# Names that need veRL (not installed in the main environment, see docs/verl.md) are not imported when veRL is
# missing; the test still checks that their module file exists and defines the name.
NEEDS_VERL = ("stratarl.integrations.verl.",)


def _installed(distribution: str) -> bool:
    # The distribution, not `find_spec("verl")`: under pytest, tests/verl/ is importable as a namespace package.
    try:
        importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


HAVE_VERL = _installed("verl")

# `from stratarl.x import a, b` anywhere in a docstring: on its own line, after `>>>`, or quoted in a sentence.
DOCSTRING_IMPORT = re.compile(r"(from[ \t]+stratarl[\w.]*[ \t]+import[ \t]+\w+(?:[ \t]*,[ \t]*\w+)*)")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


TREES = {_module_name(path): (path, ast.parse(path.read_text(), str(path))) for path in sorted(PACKAGE.rglob("*.py"))}


def _needs_verl(module: str) -> bool:
    return not HAVE_VERL and (module + ".").startswith(NEEDS_VERL)


def _literal_names(tree: ast.Module, target: str) -> list[str]:
    """The strings in the top-level assignment ``target = [...]`` / ``sorted(...)`` / ``list(...)``."""
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == target for t in targets) and node.value is not None:
                return [
                    n.value for n in ast.walk(node.value) if isinstance(n, ast.Constant) and isinstance(n.value, str)
                ]
    return []


def _dict_tables(tree: ast.Module) -> dict[str, dict]:
    """Top-level dict literals a module ``__getattr__`` reads: name -> {key: value as a python literal}."""
    getattr_fn = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "__getattr__"), None)
    if getattr_fn is None:
        return {}
    used = {n.id for n in ast.walk(getattr_fn) if isinstance(n, ast.Name)}
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            for t in node.targets:
                if isinstance(t, ast.Name) and t.id in used:
                    out[t.id] = ast.literal_eval(node.value)
    return out


def _defines(module: str, name: str) -> bool:
    """Whether the source of ``module`` (a file under stratarl/) binds ``name`` at top level, or is a package
    with a submodule ``name``."""
    if module not in TREES:
        return False
    path, tree = TREES[module]
    if path.name == "__init__.py" and f"{module}.{name}" in TREES:
        return True
    for node in tree.body:
        nodes = node.body + node.orelse if isinstance(node, (ast.If, ast.Try)) else [node]
        for n in nodes:
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == name:
                return True
            if isinstance(n, (ast.Import, ast.ImportFrom)) and any((a.asname or a.name) == name for a in n.names):
                return True
            if isinstance(n, (ast.Assign, ast.AnnAssign)):
                targets = n.targets if isinstance(n, ast.Assign) else [n.target]
                if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                    return True
    return False


def _check(module: str, name: str) -> None:
    if _needs_verl(module):
        assert _defines(module, name), f"{module} (needs veRL, not imported here) does not define {name}"
        return
    assert hasattr(importlib.import_module(module), name), f"`from {module} import {name}` fails"


def _all(module: str, tree: ast.Module) -> list[str]:
    if _needs_verl(module):
        return _literal_names(tree, "__all__")
    return (
        list(getattr(importlib.import_module(module), "__all__", []))
        if _literal_names(tree, "__all__")
        or any(
            isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets)
            for n in tree.body
        )
        else []
    )


ALL_NAMES = [(module, name) for module, (_, tree) in TREES.items() for name in _all(module, tree)]
LAZY_ENTRIES = []
for _module, (_, _tree) in TREES.items():
    for _table, _entries in _dict_tables(_tree).items():
        for _key, _value in _entries.items():
            LAZY_ENTRIES.append((_module, _table, _key, _value))
DOCSTRING_IMPORTS = sorted(
    {
        (module, line)
        for module, (_, tree) in TREES.items()
        for line in DOCSTRING_IMPORT.findall(ast.get_docstring(tree) or "")
    }
)


def test_the_tables_were_found():
    assert len(ALL_NAMES) > 50
    assert {module for module, *_ in LAZY_ENTRIES} >= {"stratarl.trainer", "stratarl.rollout", "stratarl.retrieval"}
    assert any(module == "stratarl.trainer" for module, _ in DOCSTRING_IMPORTS)


@pytest.mark.parametrize("module,name", ALL_NAMES, ids=[f"{m}:{n}" for m, n in ALL_NAMES])
def test_every_name_in_all_imports(module, name):
    _check(module, name)


@pytest.mark.parametrize("module,table,key,value", LAZY_ENTRIES, ids=[f"{m}.{t}[{k}]" for m, t, k, _ in LAZY_ENTRIES])
def test_every_lazy_table_entry_resolves(module, table, key, value):
    # The tables map a name to (module, attribute), to a module, or to a submodule of the package.
    if isinstance(value, tuple):
        source, attr = value
    else:
        source, attr = (value if value.startswith("stratarl.") else f"{module}.{value}"), key
    _check(source, attr)
    if not _needs_verl(module):
        assert getattr(importlib.import_module(module), key) is getattr(importlib.import_module(source), attr)


@pytest.mark.parametrize("module,line", DOCSTRING_IMPORTS, ids=[f"{m}:{line}" for m, line in DOCSTRING_IMPORTS])
def test_every_import_in_a_docstring_works(module, line):
    source, names = re.match(r"from\s+(\S+)\s+import\s+(.+)", line, re.DOTALL).groups()
    if _needs_verl(source):
        for name in re.split(r"[\s,]+", names.strip()):
            assert _defines(source, name), f"{module}'s docstring: {line!r}: {source} does not define {name}"
        return
    exec(line, {})
