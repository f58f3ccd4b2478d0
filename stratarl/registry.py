"""`Registry`: what every registry of stratarl does (the algorithm's parts, retriever kinds, dataset formats).

A registry maps names to entries in registration order. A name is registered once: registering the same
object again (a module imported twice) is allowed, another object under a taken name is refused. A taken or
an unknown name is one error line that lists the registered names. Standard library only, so the pure
algorithm core can use it too.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class Registry(dict[str, T]):
    """name -> entry, in registration order; a dict, so a test can register a part for one test only
    (``monkeypatch.setitem``) or work on a ``copy()``.

    kind: what an entry is, as the messages name it ("advantage estimator", "retriever kind").
    listed_as: the words before the registered names in an unknown-name error ("registered", "valid kinds").
    how_to_add: appended to an unknown-name error, e.g. "(a kind of your own: register_retriever in a module
        loaded with --import)".
    unknown_error: the exception an unknown name raises (KeyError or ValueError).
    source: the object a user registered, given its entry (default: the entry itself); registering the same
        source again under its name is allowed.
    """

    def __init__(
        self,
        kind: str,
        *,
        listed_as: str = "registered",
        how_to_add: str = "",
        unknown_error: type[Exception] = KeyError,
        source: Callable[[T], object] | None = None,
    ) -> None:
        super().__init__()
        self.kind = kind
        self.listed_as = listed_as
        self.how_to_add = how_to_add
        self.unknown_error = unknown_error
        self.source = source

    def names(self) -> list[str]:
        """The registered names, sorted."""
        return sorted(self)

    def check_name(self, name: Any) -> None:
        """Refuse a name that is not a non-empty string (ValueError)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.kind} name is a non-empty string, got {name!r}")

    def add(self, name: str, entry: T) -> T:
        """Register ``entry`` as ``name`` and return it; a name taken by another source is refused (ValueError)."""
        self.check_name(name)
        source_of = self.source or (lambda registered: registered)
        if name in self and source_of(self[name]) is not source_of(entry):
            owner = source_of(self[name])
            raise ValueError(
                f"{self.kind} {name!r} is already registered (by {getattr(owner, '__qualname__', repr(owner))}); "
                f"pick another name (registered: {', '.join(self.names())})"
            )
        self[name] = entry
        return entry

    def decorator(self, name: str) -> Callable[[T], T]:
        """A decorator that registers the decorated function or class itself as ``name``."""
        self.check_name(name)
        return lambda entry: self.add(name, entry)

    def lookup(self, name: str) -> T:
        """The entry registered as ``name``; an unknown name raises ``unknown_error`` listing the registered ones."""
        if name not in self:
            hint = f" {self.how_to_add}" if self.how_to_add else ""
            raise self.unknown_error(f"unknown {self.kind} {name!r}; {self.listed_as}: {', '.join(self.names())}{hint}")
        return self[name]

    def copy(self) -> Registry[T]:
        """A registry with the same settings and entries (``dict.copy`` would drop the settings)."""
        return copy.copy(self)
