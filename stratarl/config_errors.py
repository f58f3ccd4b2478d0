"""The one error type of every config in stratarl (the trainer's tree, the rollout engine's config) and its
what / why / fix message."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any


class ConfigError(ValueError):
    """A config file or override is invalid; the message says which field and how to fix it."""


def fail(path: str, value: Any, why: str, fix: str) -> None:
    """Raise ``config field `path` = value: why. Fix: fix.``"""
    raise ConfigError(f"config field `{path}` = {value!r}: {why}. Fix: {fix}.")


def close_match(word: str, choices: Iterable[str]) -> str:
    """``"did you mean 'x'? "`` for the closest of ``choices``, or ``""``."""
    close = difflib.get_close_matches(str(word), list(choices), n=1)
    return f"did you mean {close[0]!r}? " if close else ""


def yaml_syntax_error(path, error: Exception) -> str:
    """One line for a YAML syntax error in the file ``path``: where (line, column) and what the parser expected.
    (PyYAML's own text spans several lines and names the file `<unicode string>`.)"""
    mark = getattr(error, "problem_mark", None) or getattr(error, "context_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    what = getattr(error, "problem", None) or " ".join(str(error).split())
    context, context_mark = getattr(error, "context", None), getattr(error, "context_mark", None)
    if context and context_mark is not None and context_mark is not mark:
        what += f" ({context} that starts at line {context_mark.line + 1}, column {context_mark.column + 1})"
    elif context:
        what += f" ({context})"
    return f"{path} is not valid YAML{where}: {what}. Fix: correct the YAML syntax there"
