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
