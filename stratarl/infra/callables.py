"""Functions named in a config (``algo.reward``, ``algo.stratum_key``), resolved without surprises.

Two spellings:

    package.module:function     imported from an installed package or a folder on PYTHONPATH,
                                never from the current directory by accident
    path/to/file.py:function    loaded from that file (a relative path starts at the current directory)

`python -m stratarl.cli` puts the current directory first on ``sys.path``; a module of the same
name sitting there (a planted ``evil.py``, or a stray copy) would otherwise shadow the installed
one. That entry is ignored unless the directory is also listed in ``PYTHONPATH``.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def _explicit_paths() -> set[str]:
    return {os.path.realpath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}


@contextmanager
def _without_implicit_cwd() -> Iterator[None]:
    """Drop ``sys.path`` entries that stand for the current directory (``''``, ``.``, its absolute path)
    unless PYTHONPATH names it; restore them afterwards."""
    cwd, explicit = os.path.realpath(os.getcwd()), _explicit_paths()
    saved = list(sys.path)
    sys.path[:] = [p for p in saved if os.path.realpath(p or ".") != cwd or os.path.realpath(p or ".") in explicit]
    try:
        yield
    finally:
        sys.path[:] = saved


@functools.lru_cache(maxsize=64)
def resolve_callable(spec: str, field: str, *, num_args: int) -> Callable[..., Any]:
    """The function ``spec`` names (see the module docstring), checked to accept ``num_args`` positional
    arguments. Raises ValueError naming ``field`` and the fix. Resolved once per spec (a file is run once)."""
    target, _, name = spec.rpartition(":")
    if not target or not name:
        raise ValueError(f"{field}={spec!r}: expected `package.module:function` or `path/to/file.py:function`")
    try:
        if target.endswith(".py"):
            path = Path(target).expanduser().resolve()
            if not path.is_file():
                raise ImportError(f"no file {path}")
            module_spec = importlib.util.spec_from_file_location(f"stratarl_user_{path.stem}", path)
            if module_spec is None or module_spec.loader is None:
                raise ImportError(f"{path} cannot be imported as a module")
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            with _without_implicit_cwd():
                module = importlib.import_module(target)
        fn: Callable[..., Any] = getattr(module, name)
    except (ImportError, AttributeError, SyntaxError) as error:
        raise ValueError(
            f"{field}={spec!r}: cannot import it ({error}). Fix: name a function of an installed "
            "package (`package.module:function`; the current directory is not searched) or give its "
            "file: `path/to/file.py:function`"
        ) from None
    if not callable(fn):
        raise ValueError(f"{field}={spec!r}: {name} is a {type(fn).__name__}, not a function")
    try:
        inspect.signature(fn).bind(*range(num_args))
    except TypeError:
        raise ValueError(
            f"{field}={spec!r}: {name}{inspect.signature(fn)} cannot be called with {num_args} "
            "positional argument(s). Fix: see the field's documentation for the signature"
        ) from None
    except ValueError:  # builtins without a signature: accept
        pass
    return fn
