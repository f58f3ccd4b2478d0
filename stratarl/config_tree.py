"""A typed config tree from plain data: dataclass sections, checked field by field against their annotations.

``build(cls, data)`` makes a ``cls`` (a dataclass whose fields may be dataclasses, lists, dicts, Literals,
``X | None``) from a YAML-shaped dict, ``apply_overrides`` sets dotted ``key=value`` overrides first. Every
error is a :class:`~stratarl.config_errors.ConfigError` naming the field path, the bad value and the fix;
an unknown key lists the valid ones with a close-match suggestion.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math
import types
import typing
from typing import Any, Literal, Union

import yaml

from stratarl.config_errors import ConfigError, close_match
from stratarl.config_errors import fail as _fail

__all__ = ["apply_overrides", "build", "check_choices", "parse_override"]


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def coerce(value: Any, tp: Any, path: str) -> Any:
    """``value`` checked against the annotation ``tp`` (ints widen to floats; a config error naming ``path``)."""
    return _coerce(value, tp, path)


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """Check ``value`` against the annotation ``tp`` (ints widen to floats)."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        others = [a for a in args if a is not type(None)]
        if len(others) == 1:  # `X | None`: X's own message (e.g. a Literal's choices)
            return _coerce(value, others[0], path)
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, path)
            except ConfigError as e:
                errors.append(str(e))
        _fail(path, value, f"expected {' or '.join(_type_name(a) for a in args)}", "change the value's type")
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            hint = close_match(value, [str(c) for c in choices]) if isinstance(value, str) else ""
            _fail(path, value, "not an allowed value", f"{hint}use one of {', '.join(map(str, choices))}")
        return value
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            _fail(path, value, "expected a mapping of sub-fields", f"write it as `{path}: {{...}}` or use dotted keys")
        return build(tp, value, path)
    if origin is list:
        if not isinstance(value, (list, tuple)):
            _fail(path, value, "expected a list", f"write e.g. `{path}=[a,b]`")
        (item,) = typing.get_args(tp) or (Any,)
        return [_coerce(v, item, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            _fail(path, value, "expected a mapping", f"write e.g. `{path}: {{key: value}}`")
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            _fail(path, value, "expected true or false", "write true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            _fail(path, value, "expected an integer", "write a whole number, e.g. 4")
        return value
    if tp is float:
        if isinstance(value, str):
            # YAML 1.1 reads `3e-5` (no dot) as a string; accept any numeric spelling.
            with contextlib.suppress(ValueError):
                value = float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            _fail(path, value, "expected a number", "write e.g. 0.5 or 1e-6")
        if not math.isfinite(value):
            _fail(
                path, value, "must be a finite number (inf and nan would train a NaN model)", "write e.g. 0.5 or 1e-6"
            )
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            _fail(path, value, "expected a string", "quote the value")
        return value
    return value


def _unknown_key(cls: type, key: str, path: str) -> None:
    valid = [f.name for f in dataclasses.fields(cls)]
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f"did you mean `{path + '.' if path else ''}{close[0]}`? " if close else ""
    where = f"`{path}`" if path else "the top level"
    raise ConfigError(
        f"unknown config key `{path + '.' if path else ''}{key}` in {where}. Fix: {hint}valid keys: {', '.join(valid)}."
    )


def build(cls: type, data: dict, path: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            _unknown_key(cls, key, path)
        kwargs[key] = _coerce(value, hints[key], f"{path}.{key}" if path else key)
    try:
        return cls(**kwargs)
    except ConfigError as error:
        # A section that validates itself on construction (the rollout engine's RolloutConfig) names its
        # fields by its class; name them by their place in this tree instead.
        raise ConfigError(str(error).replace(f"`{cls.__name__}.", f"`{path}.", 1)) from None


def _merge(base: dict, update: dict) -> dict:
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and key not in ("options",):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"algo.name=grpo"`` -> (["algo", "name"], "grpo"); the value is read as YAML
    (``20`` -> int, ``true`` -> bool, ``[a,b]`` -> list, ``null`` -> None)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} has no `=`. Fix: write `section.field=value`, e.g. `trainer.steps=20`.")
    key, raw = text.split("=", 1)
    keys = list(key.strip().split("."))
    if not all(keys):
        raise ConfigError(f"override {text!r}: empty key. Fix: write `section.field=value`.")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return keys, value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Return a copy of ``data`` with every dotted override set (validated later)."""
    out = _merge({}, data)
    for text in overrides:
        keys, value = parse_override(text)
        node = out
        for k in keys[:-1]:
            child = node.get(k)
            node[k] = dict(child) if isinstance(child, dict) else {}
            node = node[k]
        node[keys[-1]] = value
    return out


def check_choices(section: Any, path: str) -> None:
    """Check every Literal-typed field of the dataclass ``section`` (also ``Literal[...] | None``), so a section
    built directly in code is held to the same choices as one loaded from YAML."""
    for name, tp in typing.get_type_hints(type(section)).items():
        args = typing.get_args(tp) if typing.get_origin(tp) in (Union, types.UnionType) else (tp,)
        for arg in args:
            if typing.get_origin(arg) is Literal:
                value = getattr(section, name)
                if value is None and type(None) in args:
                    break
                _coerce(value, arg, f"{path}.{name}")
