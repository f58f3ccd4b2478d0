"""From ``algo.*`` to the algorithm's parts: the preset, the parts that replace its own, the parameters.

``resolve_algorithm(cfg.algo)`` returns an :class:`~stratarl.algos.presets.AlgorithmSpec` whose
``*_params`` are the complete keyword arguments the trainer passes to the registered functions.
Parameters come from three layers, later ones winning:

1. the shared knobs of ``algo`` (below), each passed only to a part whose signature has that keyword;
2. the preset's own parameters for a part it names (none overlap a knob);
3. ``algo.advantage_params`` / ``algo.policy_loss_params`` / ``algo.normalizer_params``, checked
   against the registered function's keyword signature (an unknown key is refused with the valid ones).

The legacy switches keep their meaning: ``algo.turn_level_ratio`` (true: ratio level turn, false:
token) and ``algo.sorl_normalize`` (true: normaliser ``sorl``, false: none) replace the preset's part;
``algo.ratio_level`` / ``algo.normalizer`` do the same by name, and a contradiction is refused.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from stratarl.algos.presets import CRITICS, NO_NORMALIZER, PRESETS, RATIO_LEVELS, AlgorithmSpec
from stratarl.algos.registry import (
    advantage_info,
    advantage_names,
    get_advantage,
    get_grad_normalizer,
    get_policy_loss,
    grad_normalizer_names,
    keyword_params,
    policy_loss_names,
)
from stratarl.config_errors import close_match, fail

# (algo field, keyword of the registered function) per part: a knob reaches every part that takes it.
KNOBS: Mapping[str, tuple[tuple[str, str], ...]] = {
    "advantage": (("alpha", "alpha"), ("epsilon", "eps"), ("gamma", "gamma"), ("lam", "lam")),
    "policy_loss": (("clip_low", "clip_low"), ("clip_high", "clip_high"), ("loss_agg", "agg")),
    "normalizer": (("sorl_delta", "delta"), ("sorl_delta_rule", "rule"), ("sorl_delta_ema", "ema")),
}
# Keywords the trainer sets itself from another field (the same value must reach the KL, entropy and
# value terms and the micro-batch weights, or the ratio level must be one named choice).
RESERVED: Mapping[str, Mapping[str, str]] = {
    "advantage": {},
    "policy_loss": {"level": "algo.ratio_level", "agg": "algo.loss_agg", "norm_length": "rollout.max_total_tokens"},
    "normalizer": {},
}
_EMPTY = inspect.Parameter.empty
REGISTER_HINT = "or register one in a module loaded with `stratarl train --import my_parts.py` (README: a new algorithm)"


def _part_params(algo: Any, p: str, part: str, name: str, fn: Callable, preset: Mapping, extra: dict) -> dict:
    valid = keyword_params(fn)
    explicit = dict(getattr(algo, f"{part}_params") or {})
    for key, value in explicit.items():
        where = f"{p}.{part}_params.{key}"
        if key in RESERVED[part]:
            fail(where, value, f"the trainer sets `{key}` from `{RESERVED[part][key]}`", f"set {RESERVED[part][key]} instead")
        if key not in valid:
            keys = ", ".join(k for k in valid if k not in RESERVED[part]) or "none"
            fail(where, value, f"{part.replace('_', ' ')} {name!r} has no parameter `{key}`",
                 f"{close_match(key, valid)}valid parameters: {keys}")
    out = {kw: getattr(algo, knob) for knob, kw in KNOBS[part] if kw in valid}
    out.update({k: v for k, v in extra.items() if k in valid})
    out.update(preset)
    out.update(explicit)
    missing = [k for k, default in valid.items() if default is _EMPTY and k not in out]
    if missing:
        fail(f"{p}.{part}_params", explicit, f"{part.replace('_', ' ')} {name!r} needs `{missing[0]}`",
             f"set {p}.{part}_params.{missing[0]}=...")
    return out


def _registered(p: str, field: str, name: str, names: list[str], kind: str) -> None:
    if name not in names:
        fail(f"{p}.{field}", name, f"no {kind} of that name is registered",
             f"{close_match(name, names)}use one of {', '.join(names)}, {REGISTER_HINT}")


def _switch(p: str, field: str, named: str | None, legacy_field: str, legacy: str | None, default: str) -> str:
    """The part chosen by name, else by the legacy boolean switch, else the preset's."""
    if named is not None and legacy is not None and named != legacy:
        fail(f"{p}.{field}", named, f"contradicts `{p}.{legacy_field}` (which means {legacy!r})",
             f"drop one of the two (set {p}.{legacy_field}=null)")
    return named if named is not None else legacy if legacy is not None else default


def resolve_algorithm(algo: Any, p: str = "algo") -> AlgorithmSpec:
    """The parts of ``algo`` (an ``AlgoConfig``) with complete parameters; raises ConfigError on bad input."""
    if algo.name not in PRESETS:
        fail(f"{p}.name", algo.name, "unknown algorithm", f"{close_match(algo.name, PRESETS)}use one of {', '.join(PRESETS)}")
    base = PRESETS[algo.name]

    advantage = algo.advantage or base.advantage
    _registered(p, "advantage", advantage, advantage_names(), "advantage estimator")
    advantage_params = _part_params(algo, p, "advantage", advantage, get_advantage(advantage),
                                    base.advantage_params if advantage == base.advantage else {}, {})

    legacy_level = None if algo.turn_level_ratio is None else ("turn" if algo.turn_level_ratio else "token")
    level = _switch(p, "ratio_level", algo.ratio_level, "turn_level_ratio", legacy_level, base.ratio_level)
    if level not in RATIO_LEVELS:
        fail(f"{p}.ratio_level", level, "unknown ratio level", f"{close_match(level, RATIO_LEVELS)}use one of {', '.join(RATIO_LEVELS)}")
    policy_loss = algo.policy_loss or base.policy_loss
    _registered(p, "policy_loss", policy_loss, policy_loss_names(), "policy loss")
    loss_fn = get_policy_loss(policy_loss)
    if "level" not in keyword_params(loss_fn) and level != "token":
        fail(f"{p}.ratio_level", level, f"policy loss {policy_loss!r} takes no `level` keyword (token ratios only)",
             f"use {p}.ratio_level=token, or a policy loss with a `level` parameter")
    if algo.loss_agg == "seq-mean-token-sum-norm" and "norm_length" not in keyword_params(loss_fn):
        fail(f"{p}.loss_agg", algo.loss_agg, f"policy loss {policy_loss!r} takes no `norm_length` (the constant L)",
             f"use another {p}.loss_agg, or a policy loss with a `norm_length` parameter")
    policy_loss_params = _part_params(algo, p, "policy_loss", policy_loss, loss_fn,
                                      base.policy_loss_params if policy_loss == base.policy_loss else {}, {"level": level})

    legacy_norm = None if algo.sorl_normalize is None else ("sorl" if algo.sorl_normalize else NO_NORMALIZER)
    normalizer = _switch(p, "normalizer", algo.normalizer, "sorl_normalize", legacy_norm, base.normalizer)
    normalizer_params: dict = {}
    if normalizer == NO_NORMALIZER:
        if algo.normalizer_params:
            fail(f"{p}.normalizer_params", algo.normalizer_params, "no gradient normaliser is in use",
                 f"set {p}.normalizer=sorl, or drop the parameters")
    else:
        _registered(p, "normalizer", normalizer, grad_normalizer_names(), "gradient normaliser")
        normalizer_params = _part_params(algo, p, "normalizer", normalizer, get_grad_normalizer(normalizer),
                                         base.normalizer_params if normalizer == base.normalizer else {}, {})

    critic = algo.critic or base.critic
    if critic not in CRITICS:
        fail(f"{p}.critic", critic, "unknown critic", f"use one of {', '.join(CRITICS)}")
    if advantage_info(advantage).needs_values and critic == "none":
        fail(f"{p}.critic", critic, f"advantage estimator {advantage!r} reads the critic's values",
             f"set {p}.critic=value_head, or use an estimator without a critic (e.g. {p}.advantage=grpo)")
    return AlgorithmSpec(advantage, policy_loss=policy_loss, ratio_level=level, normalizer=normalizer, critic=critic,
                         advantage_params=advantage_params, policy_loss_params=policy_loss_params,
                         normalizer_params=normalizer_params, summary=base.summary)


def describe(name: str, spec: AlgorithmSpec) -> str:
    """One line naming the parts, e.g. ``stratified_grpo: advantage stratified (alpha=0.6, eps=1e-06), ...``."""

    def part(label: str, value: str, params: Mapping) -> str:
        shown = ", ".join(f"{k}={v}" for k, v in params.items())
        return f"{label} {value}" + (f" ({shown})" if shown else "")

    loss_params = {k: v for k, v in spec.policy_loss_params.items() if k != "level"}
    parts = [part("advantage", spec.advantage, spec.advantage_params),
             part("policy loss", spec.policy_loss, loss_params), f"ratio {spec.ratio_level}",
             part("normaliser", spec.normalizer, spec.normalizer_params), f"critic {spec.critic}"]
    return f"{name}: " + ", ".join(parts)
