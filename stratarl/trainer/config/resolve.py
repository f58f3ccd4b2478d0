"""From ``algo.*`` to the algorithm's parts: the preset, the parts that replace its own, the parameters.

``resolve_algorithm(cfg.algo)`` returns an :class:`~stratarl.algos.presets.AlgorithmSpec` whose
``*_params`` are the complete keyword arguments the trainer passes to the registered functions.
``Config.validate`` calls it once; the trainer reads ``cfg.algorithm``. Every keyword has one source:

1. a shared knob of ``algo`` (``KNOBS``), passed only to a part whose signature has that keyword;
2. else the preset's own parameters for a part it names (a preset never sets a knob's keyword);
3. else ``algo.advantage_params`` / ``algo.policy_loss_params`` / ``algo.normalizer_params``, checked
   against the registered function's keyword signature (an unknown key is refused with the valid ones, and
   a key that a knob or another field sets is refused with that field's name).

``describe(name, spec)`` prints the resolved algorithm.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable, Mapping
from typing import Any

from stratarl.algos.params import Param, ParamError
from stratarl.algos.presets import CRITICS, NO_CORRECTION, NO_NORMALIZER, PRESETS, RATIO_LEVELS, AlgorithmSpec
from stratarl.algos.registry import (
    advantage_info,
    advantage_names,
    behaviour_correction_names,
    get_advantage,
    get_behaviour_correction,
    get_grad_normalizer,
    get_policy_loss,
    grad_normalizer_names,
    keyword_params,
    param_specs,
    policy_loss_names,
)
from stratarl.config_errors import close_match, fail
from stratarl.config_tree import coerce
from stratarl.trainer.config.legacy import note_deprecated, set_once

# (algo field, keyword of the registered function) per part: a knob reaches every part that takes it.
KNOBS: Mapping[str, tuple[tuple[str, str], ...]] = {
    "advantage": (("alpha", "alpha"), ("epsilon", "eps"), ("gamma", "gamma"), ("lam", "lam")),
    "policy_loss": (("clip_low", "clip_low"), ("clip_high", "clip_high"), ("loss_agg", "agg")),
    "normalizer": (("sorl_delta", "delta"), ("sorl_delta_rule", "rule"), ("sorl_delta_ema", "ema")),
    "behaviour_correction": (),
}
# Keywords the trainer sets itself from another field (the same value must reach the KL, entropy and
# value terms and the micro-batch weights, or the ratio level must be one named choice).
RESERVED: Mapping[str, Mapping[str, str]] = {
    "advantage": {},
    "policy_loss": {
        "level": "algo.ratio_level",
        "agg": "algo.loss_agg",
        "norm_length": "rollout.max_total_tokens",
        "token_weights": "algo.behaviour_correction",
    },
    "normalizer": {},
    "behaviour_correction": {},
}
_EMPTY = inspect.Parameter.empty
REGISTER_HINT = (
    "or register one in a module loaded with `stratarl train --import my_parts.py` (README: a new algorithm)"
)


def _part_params(algo: Any, p: str, part: str, name: str, fn: Callable, preset: Mapping, extra: dict) -> dict:
    valid = keyword_params(fn)
    explicit = dict(getattr(algo, f"{part}_params") or {})
    knobs = {kw: f"{p}.{knob}" for knob, kw in KNOBS[part]}
    for key, value in explicit.items():
        where = f"{p}.{part}_params.{key}"
        if key in RESERVED[part]:
            fail(
                where,
                value,
                f"the trainer sets `{key}` from `{RESERVED[part][key]}`",
                f"set {RESERVED[part][key]} instead",
            )
        if key not in valid:
            keys = ", ".join(k for k in valid if k not in RESERVED[part]) or "none"
            fail(
                where,
                value,
                f"{part.replace('_', ' ')} {name!r} has no parameter `{key}`",
                f"{close_match(key, valid)}valid parameters: {keys}",
            )
        if key in knobs:  # move_knob_params moves it when the config is validated; a hand-built AlgoConfig
            fail(
                where, value, f"`{key}` is set by `{knobs[key]}` (one home per parameter)", f"set {knobs[key]} instead"
            )
    out = {kw: getattr(algo, knob) for knob, kw in KNOBS[part] if kw in valid}
    out.update({k: v for k, v in extra.items() if k in valid})
    out.update(preset)
    out.update(explicit)
    missing = [k for k, default in valid.items() if default is _EMPTY and k not in out]
    if missing:
        fail(
            f"{p}.{part}_params",
            explicit,
            f"{part.replace('_', ' ')} {name!r} needs `{missing[0]}`",
            f"set {p}.{part}_params.{missing[0]}=...",
        )
    what = f"{_KINDS[part]} {name!r}"
    return _checked(out, param_specs(part, name, fn), _sources(p, part, explicit, knobs, extra), what)


def _sources(p: str, part: str, explicit: Mapping, knobs: Mapping[str, str], extra: Mapping) -> dict[str, str]:
    """The config field each keyword's value came from (the one an error names)."""
    out = {kw: RESERVED[part].get(kw, f"{p}.{part}_params.{kw}") for kw in extra}
    out.update(knobs)
    out.update({kw: f"{p}.{part}_params.{kw}" for kw in explicit})
    return out


def _checked(values: dict, specs: Mapping[str, Param], sources: Mapping[str, str], what: str) -> dict:
    """``values`` checked against the part's declared types and ranges (stratarl.algos.params): one config error
    naming the field for a value of the wrong type, out of range or not finite."""
    out = dict(values)
    for key, value in values.items():
        spec = specs.get(key)
        if spec is None:
            continue
        try:
            out[key] = spec.check(value)
        except ParamError as error:
            where = sources.get(key, f"{what}: {key}")
            fail(where, value, f"{error.why}: the {what} takes `{key}` as {spec.describe()}", error.fix)
    return out


def _registered(p: str, field: str, name: str, names: list[str], kind: str) -> None:
    if name not in names:
        fail(
            f"{p}.{field}",
            name,
            f"no {kind} of that name is registered",
            f"{close_match(name, names)}use one of {', '.join(names)}, {REGISTER_HINT}",
        )


def _part_names(algo: Any) -> dict[str, str]:
    """The registered name each part of ``algo`` resolves to (the preset's unless replaced); {} for an unknown preset."""
    base = PRESETS.get(algo.name)
    if base is None:
        return {}
    return {
        "advantage": algo.advantage or base.advantage,
        "policy_loss": algo.policy_loss or base.policy_loss,
        "normalizer": algo.normalizer or base.normalizer,
        "behaviour_correction": algo.behaviour_correction,
    }


_GETTERS = {
    "advantage": (advantage_names, get_advantage),
    "policy_loss": (policy_loss_names, get_policy_loss),
    "normalizer": (grad_normalizer_names, get_grad_normalizer),
    "behaviour_correction": (behaviour_correction_names, get_behaviour_correction),
}


def move_knob_params(algo: Any, note: Callable[[str], None] | None = None) -> Any:
    """``algo`` (an ``AlgoConfig``) with every shared knob's keyword written inside a ``*_params`` mapping moved to
    the knob, where the part's function takes it (``algo.normalizer_params.delta`` -> ``algo.sorl_delta``): the
    older spelling, read once, so each parameter has one home. A knob set to another value is refused, naming
    both; a key the part does not take stays, for ``resolve_algorithm`` to refuse with the valid ones."""
    fields = {f.name: getattr(algo, f.name) for f in dataclasses.fields(algo)}
    changed = False
    for part, name in _part_names(algo).items():
        names, get = _GETTERS[part]
        params = dict(fields[f"{part}_params"] or {})
        if name not in names() or not params:
            continue
        valid = keyword_params(get(name))
        for knob, kw in KNOBS[part]:
            if kw in params and kw in valid and kw not in RESERVED[part]:
                # typed as the knob is (a string "1e-6", nan and inf refused, naming the spelling used)
                value = coerce(params.pop(kw), typing.get_type_hints(type(algo))[knob], f"algo.{part}_params.{kw}")
                set_once(fields, knob, value, f"{part}_params.{kw}")
                (note or note_deprecated)(f"algo.{part}_params.{kw} is deprecated; read as algo.{knob}={value}")
                changed = True
        fields[f"{part}_params"] = params
    return dataclasses.replace(algo, **fields) if changed else algo


_KINDS = {
    "advantage": "advantage estimator",
    "policy_loss": "policy loss",
    "normalizer": "gradient normaliser",
    "behaviour_correction": "behaviour correction",
}


def _registered_part(algo: Any, p: str, part: str) -> tuple[str, Callable]:
    """The registered name of ``part`` (the preset's unless replaced) and its function; refuses an unknown name."""
    name = _part_names(algo)[part]
    names, get = _GETTERS[part]
    _registered(p, part, name, names(), _KINDS[part])
    return name, get(name)


def _preset_params(base: AlgorithmSpec, part: str, name: str) -> Mapping:
    """The preset's own parameters of ``part``, when the config kept the preset's choice of it."""
    return getattr(base, f"{part}_params") if name == getattr(base, part) else {}


def resolve_algorithm(algo: Any, p: str = "algo") -> AlgorithmSpec:
    """The parts of ``algo`` (an ``AlgoConfig``) with complete parameters; raises ConfigError on bad input."""
    if algo.name not in PRESETS:
        fail(
            f"{p}.name",
            algo.name,
            "unknown algorithm",
            f"{close_match(algo.name, PRESETS)}use one of {', '.join(PRESETS)}",
        )
    base = PRESETS[algo.name]

    advantage, advantage_fn = _registered_part(algo, p, "advantage")
    advantage_params = _part_params(
        algo, p, "advantage", advantage, advantage_fn, _preset_params(base, "advantage", advantage), {}
    )

    level = algo.ratio_level or base.ratio_level
    if level not in RATIO_LEVELS:
        fail(
            f"{p}.ratio_level",
            level,
            "unknown ratio level",
            f"{close_match(level, RATIO_LEVELS)}use one of {', '.join(RATIO_LEVELS)}",
        )
    policy_loss, loss_fn = _registered_part(algo, p, "policy_loss")
    if "level" not in keyword_params(loss_fn) and level != "token":
        fail(
            f"{p}.ratio_level",
            level,
            f"policy loss {policy_loss!r} takes no `level` keyword (token ratios only)",
            f"use {p}.ratio_level=token, or a policy loss with a `level` parameter",
        )
    if algo.loss_agg == "seq-mean-token-sum-norm" and "norm_length" not in keyword_params(loss_fn):
        fail(
            f"{p}.loss_agg",
            algo.loss_agg,
            f"policy loss {policy_loss!r} takes no `norm_length` (the constant L)",
            f"use another {p}.loss_agg, or a policy loss with a `norm_length` parameter",
        )
    policy_loss_params = _part_params(
        algo, p, "policy_loss", policy_loss, loss_fn, _preset_params(base, "policy_loss", policy_loss), {"level": level}
    )

    normalizer = _part_names(algo)["normalizer"]
    normalizer_params: dict = {}
    if normalizer == NO_NORMALIZER:
        if algo.normalizer_params:
            fail(
                f"{p}.normalizer_params",
                algo.normalizer_params,
                "no gradient normaliser is in use",
                f"set {p}.normalizer=sorl, or drop the parameters",
            )
    else:
        normalizer, normalizer_fn = _registered_part(algo, p, "normalizer")
        normalizer_params = _part_params(
            algo, p, "normalizer", normalizer, normalizer_fn, _preset_params(base, "normalizer", normalizer), {}
        )

    correction, correction_params = _resolve_correction(algo, p, policy_loss, loss_fn)
    critic = algo.critic or base.critic
    if critic not in CRITICS:
        fail(f"{p}.critic", critic, "unknown critic", f"use one of {', '.join(CRITICS)}")
    if advantage_info(advantage).needs_values and critic == "none":
        fail(
            f"{p}.critic",
            critic,
            f"advantage estimator {advantage!r} reads the critic's values",
            f"set {p}.critic=value_head, or use an estimator without a critic (e.g. {p}.advantage=grpo)",
        )
    return AlgorithmSpec(
        advantage,
        policy_loss=policy_loss,
        ratio_level=level,
        normalizer=normalizer,
        critic=critic,
        advantage_params=advantage_params,
        policy_loss_params=policy_loss_params,
        normalizer_params=normalizer_params,
        summary=base.summary,
        correction=correction,
        correction_params=correction_params,
    )


def _resolve_correction(algo: Any, p: str, policy_loss: str, loss_fn: Callable) -> tuple[str, dict]:
    """``algo.behaviour_correction`` and its complete parameters; refuses a correction that cannot act (pi_old is
    the sampler's with old_logprobs=rollout) or a policy loss that takes no per-token weights."""
    name = algo.behaviour_correction
    if name == NO_CORRECTION:
        if algo.behaviour_correction_params:
            fail(
                f"{p}.behaviour_correction_params",
                algo.behaviour_correction_params,
                "no behaviour correction is in use",
                f"set {p}.behaviour_correction=tis (or mis, decoupled), or drop the parameters",
            )
        return NO_CORRECTION, {}
    name, fn = _registered_part(algo, p, "behaviour_correction")
    if algo.old_logprobs != "recompute":
        fail(
            f"{p}.behaviour_correction",
            name,
            "with old_logprobs=rollout the clip is centred on the sampler's own "
            "log-probs, so pi_old / pi_behav is 1 on every token and the correction would do nothing",
            f"set {p}.old_logprobs=recompute, or {p}.behaviour_correction=none (SORL against the behaviour policy)",
        )
    if "token_weights" not in keyword_params(loss_fn):
        fail(
            f"{p}.behaviour_correction",
            name,
            f"policy loss {policy_loss!r} takes no `token_weights` keyword",
            f"use {p}.policy_loss=ppo, or give the loss a `token_weights` parameter ([B, T], multiplies each token's term)",
        )
    defaults = {k: v for k, v in keyword_params(fn).items() if v is not _EMPTY}  # shown by describe, saved complete
    return name, _part_params(algo, p, "behaviour_correction", name, fn, {}, defaults)


def bound_advantage(spec: AlgorithmSpec) -> Callable:
    """The spec's advantage estimator with its parameters bound: ``fn(AdvantageBatch) -> (advantages, returns)``."""
    return functools.partial(get_advantage(spec.advantage), **spec.advantage_params)


def describe(name: str, spec: AlgorithmSpec) -> str:
    """One line naming the parts, e.g. ``stratified_grpo: advantage stratified (alpha=0.6, eps=1e-06), ...``."""

    def part(label: str, value: str, params: Mapping) -> str:
        shown = ", ".join(f"{k}={v}" for k, v in params.items())
        return f"{label} {value}" + (f" ({shown})" if shown else "")

    loss_params = {k: v for k, v in spec.policy_loss_params.items() if k != "level"}
    parts = [
        part("advantage", spec.advantage, spec.advantage_params),
        part("policy loss", spec.policy_loss, loss_params),
        f"ratio {spec.ratio_level}",
        part("normaliser", spec.normalizer, spec.normalizer_params),
        f"critic {spec.critic}",
    ]
    if spec.uses_correction:
        parts.append(part("behaviour correction", spec.correction, spec.correction_params))
    return f"{name}: " + ", ".join(parts)
