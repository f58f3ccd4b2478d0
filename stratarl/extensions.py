"""Users' own parts: modules that register estimators, losses, normalisers, retrievers or dataset formats,
loaded before the config.

A module named on the command line (``stratarl train cfg.yaml --import my_parts.py algo.advantage=rloo``;
``--import`` may appear anywhere on the line and be repeated) or in the ``STRATARL_IMPORT`` environment
variable (entries separated by ``os.pathsep``, as veRL's ``VERL_USE_EXTERNAL_MODULES``) is imported before
the config is read, so whatever it registers with ``stratarl.algos.register_advantage`` /
``register_policy_loss`` / ``register_grad_normalizer`` is a valid name in ``algo.*``, a retriever kind
registered with ``stratarl.retrieval.register_retriever`` a valid ``retrieval.spec``, and a format registered
with ``stratarl.data.register_dataset_format`` reads the question files it matches. An entry is a path to
a ``.py`` file or a dotted module name on ``sys.path``. Each file is loaded once per process. A module that
fails while loading (a syntax error, an exception, a name it registers that is taken) is one `ExtensionError`
line naming the module, what it raised and the line (``STRATARL_DEBUG=1`` shows the traceback).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

ENV_VAR = "STRATARL_IMPORT"
FLAG = "--import"
_LOADED: list[str] = []  # what load_extensions loaded, in order: absolute .py paths and dotted names


class ExtensionError(ValueError):
    """A module named by ``--import`` / ``STRATARL_IMPORT`` cannot be loaded; the message says which and why."""


def split_import_args(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """``(modules, the other arguments)`` from a command line holding ``--import X`` / ``--import=X`` anywhere."""
    modules: list[str] = []
    rest: list[str] = []
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == FLAG:
            if i + 1 >= len(args):
                raise ExtensionError(
                    f"{FLAG} needs a value. Fix: write `{FLAG} my_parts.py` or `{FLAG} my_package.parts`."
                )
            modules.append(args[i + 1])
            i += 2
            continue
        if arg.startswith(FLAG + "="):
            modules.append(arg[len(FLAG) + 1 :])
        else:
            rest.append(arg)
        i += 1
    return modules, rest


def env_imports(environ: dict | None = None) -> list[str]:
    """The entries of ``STRATARL_IMPORT`` (empty entries skipped)."""
    value = (os.environ if environ is None else environ).get(ENV_VAR, "")
    return [entry.strip() for entry in value.split(os.pathsep) if entry.strip()]


def _load_file(path: Path) -> ModuleType:
    path = path.resolve()
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if file and Path(file).resolve() == path:
            return module  # already loaded: registering its parts twice would be refused
    name = path.stem
    if name in sys.modules:
        name = f"stratarl_import_{path.stem}_{abs(hash(str(path))):x}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ExtensionError(
            f"{FLAG} {path}: not a loadable Python file. Fix: pass a .py file or a dotted module name."
        )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as error:
        del sys.modules[name]
        if os.environ.get("STRATARL_DEBUG"):
            raise
        raise ExtensionError(_raised(str(path), error, path)) from None
    return module


def _raised(entry: str, error: Exception, path: Path | None) -> str:
    """One line for a module that failed while it ran: what it raised and where (its own file's line), and a fix."""
    if isinstance(error, SyntaxError):
        where = f" ({error.filename}, line {error.lineno})" if error.lineno else ""
        return f"{FLAG} {entry}: a syntax error{where}: {error.msg}. Fix: correct the module's syntax"
    frames = traceback.extract_tb(error.__traceback__)
    own = [f for f in frames if path is None or Path(f.filename).resolve() == path.resolve()] or frames
    where = f" ({own[-1].filename}, line {own[-1].lineno})" if own else ""
    what = " ".join(str(error).split()) or "no message"
    return (
        f"{FLAG} {entry}: the module raised {type(error).__name__} while loading{where}: {what[:300]}. Fix: correct "
        "the module (STRATARL_DEBUG=1 shows the traceback)"
    )


def load_extension(entry: str) -> ModuleType:
    """Import one ``--import`` entry: a ``.py`` path or a dotted module name."""
    path = Path(entry)
    if entry.endswith(".py") or path.is_file():
        if not path.is_file():
            raise ExtensionError(
                f"{FLAG} {entry}: file not found. Fix: give the path of your module "
                "(relative paths start at the current directory)."
            )
        return _load_file(path)
    try:
        return importlib.import_module(entry)
    except ModuleNotFoundError as error:
        raise ExtensionError(
            f"{FLAG} {entry}: no module named {error.name!r}. Fix: pass a .py path, or put the "
            "module's folder on PYTHONPATH."
        ) from None
    except Exception as error:
        if os.environ.get("STRATARL_DEBUG"):
            raise
        module = sys.modules.get(entry)
        file = getattr(module, "__file__", None)
        raise ExtensionError(_raised(entry, error, Path(file) if file else None)) from None


def loaded_extensions() -> list[str]:
    """The entries :func:`load_extensions` loaded in this process (the command's ``--import`` and
    ``STRATARL_IMPORT``; ``.py`` paths made absolute), in order: a subprocess that builds a retriever (a
    `/retrieve` server worker) loads them too, so a kind they register is known there."""
    return list(_LOADED)


def load_extensions(entries: Sequence[str]) -> list[ModuleType]:
    """Import every entry in order (see :func:`load_extension`); :func:`loaded_extensions` lists them after."""
    modules = []
    for entry in entries:
        modules.append(load_extension(entry))
        remembered = str(Path(entry).resolve()) if entry.endswith(".py") or Path(entry).is_file() else entry
        if remembered not in _LOADED:
            _LOADED.append(remembered)
    return modules
