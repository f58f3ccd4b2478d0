"""What a registered part's parameters may be: their types and ranges, declared once, checked when a config loads.

Each registered part (advantage estimator, policy loss, gradient normaliser, behaviour correction) declares its
keyword parameters as ``Param`` values at registration (``register_advantage("gigpo", params={"step_weight":
Param.number(ge=0)})``), so a config whose value is of the wrong type, outside the range or not finite is refused
when it loads, with the config field named, before any model is built. A parameter a part does not declare is
checked by the type of its default (a float default: a finite number; an int: an integer; a bool: true or false;
a str: a string), so a user's part without ``params=`` still gets its types checked and every non-finite number
refused (docs/training.md, "Algorithms"). Standard library only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["number", "integer", "bool", "choice", "string", "any"]


class ParamError(ValueError):
    """A value a part's parameter does not accept: ``why`` it is wrong and ``fix``, the one-line parts of a
    config error (stratarl.config_errors.fail)."""

    def __init__(self, why: str, fix: str) -> None:
        super().__init__(f"{why}. Fix: {fix}")
        self.why = why
        self.fix = fix


def _bound_text(gt: float | None, ge: float | None, lt: float | None, le: float | None) -> str:
    parts = [f"> {gt}" if gt is not None else "", f">= {ge}" if ge is not None else ""]
    parts += [f"< {lt}" if lt is not None else "", f"<= {le}" if le is not None else ""]
    return " and ".join(p for p in parts if p)


@dataclass(frozen=True)
class Param:
    """One parameter's type and range. Build with ``Param.number`` / ``integer`` / ``flag`` / ``choice`` /
    ``string`` / ``any``; ``optional``: None is accepted too (e.g. "no cap")."""

    kind: Kind
    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None
    choices: tuple[str, ...] = ()
    optional: bool = False

    @classmethod
    def number(
        cls,
        *,
        gt: float | None = None,
        ge: float | None = None,
        lt: float | None = None,
        le: float | None = None,
        optional: bool = False,
    ) -> Param:
        """A finite real number (an int is accepted) within the given bounds."""
        return cls("number", gt, ge, lt, le, optional=optional)

    @classmethod
    def integer(cls, *, ge: int | None = None, le: int | None = None, optional: bool = False) -> Param:
        """A whole number within the given bounds."""
        return cls("integer", ge=ge, le=le, optional=optional)

    @classmethod
    def flag(cls) -> Param:
        """true or false."""
        return cls("bool")

    @classmethod
    def choice(cls, *choices: str) -> Param:
        """One of ``choices``."""
        return cls("choice", choices=tuple(choices))

    @classmethod
    def string(cls, *, optional: bool = False) -> Param:
        """Any string."""
        return cls("string", optional=optional)

    @classmethod
    def any(cls) -> Param:
        """Anything (a value the trainer passes itself, e.g. a tensor); non-finite numbers are still refused."""
        return cls("any", optional=True)

    def describe(self) -> str:
        """The accepted values in words, e.g. ``a number > 1, or null``."""
        if self.kind in ("number", "integer"):
            bounds = _bound_text(self.gt, self.ge, self.lt, self.le)
            text = ("a number" if self.kind == "number" else "an integer") + (f" {bounds}" if bounds else "")
        elif self.kind == "choice":
            text = f"one of {', '.join(self.choices)}"
        else:
            text = {"bool": "true or false", "string": "a string", "any": "any value"}[self.kind]
        return text + (", or null" if self.optional and self.kind != "any" else "")

    def check(self, value: Any) -> Any:
        """``value`` as the part receives it (a numeric string such as ``"1e-6"`` read as a number), or
        `ParamError` saying why it is refused and how to fix it."""
        if value is None and self.optional:
            return None
        if not _all_finite(value):
            raise ParamError("not a finite number (nan and inf would train a NaN model)", f"use {self.describe()}")
        if self.kind == "any":
            return value
        if self.kind == "bool":
            if not isinstance(value, bool):
                raise ParamError("not true or false", "write true or false")
            return value
        if self.kind in ("choice", "string"):
            if not isinstance(value, str) or (self.kind == "choice" and value not in self.choices):
                raise ParamError("not an allowed value", f"use {self.describe()}")
            return value
        return self._check_number(value)

    def _check_number(self, value: Any) -> Any:
        if isinstance(value, str) and self.kind == "number":
            try:  # YAML 1.1 reads `1e-6` (no dot) as a string
                value = float(value)
            except ValueError:
                raise ParamError("not a number", f"use {self.describe()}") from None
            if not math.isfinite(value):
                raise ParamError("not a finite number (nan and inf would train a NaN model)", f"use {self.describe()}")
        if self.kind == "integer" and (isinstance(value, bool) or not isinstance(value, int)):
            raise ParamError("not an integer", f"use {self.describe()}")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ParamError("not a number", f"use {self.describe()}")
        low_ok = (self.gt is None or value > self.gt) and (self.ge is None or value >= self.ge)
        high_ok = (self.lt is None or value < self.lt) and (self.le is None or value <= self.le)
        if not (low_ok and high_ok):
            raise ParamError("out of range", f"use {self.describe()}")
        return value


def _all_finite(value: Any) -> bool:
    """No float in ``value`` (a number, or one inside lists, tuples and mappings) is NaN or infinite."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, (list, tuple)):
        return all(_all_finite(v) for v in value)
    if isinstance(value, Mapping):
        return all(_all_finite(v) for v in value.values())
    return True


def param_from_default(default: Any) -> Param:
    """The check of an undeclared parameter, from its default's type (None or no default: any value, finite)."""
    if isinstance(default, bool):
        return Param.flag()
    if isinstance(default, int):
        return Param.integer()
    if isinstance(default, float):
        return Param.number()
    if isinstance(default, str):
        return Param.string()
    return Param.any()


def check_params_declared(name: str, declared: Mapping[str, Param], keywords: Mapping[str, Any]) -> None:
    """A registration's ``params`` name only keywords the part takes (``keywords``: `keyword_params`), and each
    is a ``Param``; a `ValueError` naming the part otherwise (raised when the decorator runs)."""
    for key, spec in declared.items():
        if key not in keywords:
            raise ValueError(f"{name}: params declares {key!r}, which the function does not take ({sorted(keywords)})")
        if not isinstance(spec, Param):
            raise ValueError(f"{name}: params[{key!r}] = {spec!r} is not a stratarl.algos.params.Param")
