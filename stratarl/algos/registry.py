"""Registries: a new advantage estimator, policy loss, gradient normaliser or behaviour-policy correction is
one decorated function.

One signature per kind:

- advantage: ``fn(batch: AdvantageBatch, **params) -> (advantages [B, T], returns [B, T])``.
  Every estimator sees the same inputs (outcome rewards, ids, strata, mask, and the critic's
  values when there is one), so the trainer never special-cases GAE or GRPO. Outcome
  estimators broadcast their [B] advantage over policy tokens and return it as ``returns`` too
  (veRL's convention). What costs the trainer work is declared at registration and filled only for
  the estimators that declare it: the critic's values (``needs_values``), each turn's anchor state
  (``needs_step_states``, GiGPO). An estimator may also declare ``metrics``:
  ``fn(batch: AdvantageBatch, **params) -> dict[str, float]``, called with the estimator's own parameters
  and logged with the step's metrics.
- policy loss: ``fn(log_probs, old_log_probs, advantages, response_mask, **params) -> PolicyLossOutput``
  (``loss``, ``metrics``, ``clip_bias``; all [B, T] inputs).
- gradient normaliser: ``fn(parameters, **params) -> GradNormalizer`` (an object with ``backward``,
  ``apply``, ``state_dict``, ``load_state_dict``; SORL's :class:`ClipBiasNormalizer` is ``sorl``).
- behaviour correction: ``fn(old_log_probs, behaviour_log_probs, response_mask, **params) -> CorrectionOutput``
  (``weights`` [B, T] detached, 0 off the mask, for the policy loss's ``token_weights``; ``metrics`` with
  the three ``offpolicy/`` keys). Built in: ``tis``, ``mis``, ``decoupled`` (stratarl.algos.corrections).

Every parameter is keyword-only with a default, so :func:`keyword_params` can list a part's
parameters and a config can be checked against them before any tensor exists. Each decorator takes
``params={keyword: Param}`` (stratarl.algos.params): the types and ranges a config's values must have
(:func:`param_specs`); a keyword left undeclared is checked by its default's type, and no part receives a
number that is not finite.
An unknown name raises a KeyError listing the registered ones (each table is a :class:`stratarl.registry.Registry`).

A part registered from a user's module (``stratarl train --import my_parts.py`` or the
``STRATARL_IMPORT`` environment variable, see :mod:`stratarl.extensions`) is reachable from the
config by its name, e.g. ``algo.advantage=rloo``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from torch import Tensor

from stratarl.algos.advantages import (
    STRATIFIED_ALPHA,
    broadcast_to_tokens,
    gae_advantages,
    grpo_advantages,
    outcome_to_token_rewards,
    positive_part,
    reinforce_advantages,
    stratified_advantages,
)
from stratarl.algos.corrections import CorrectionOutput, decoupled_weights, mis_weights, tis_weights
from stratarl.algos.gigpo import gigpo_advantages, step_group_metrics, step_groups, token_step_ids
from stratarl.algos.losses import AGG_MODES, PolicyLossOutput, clipped_policy_loss
from stratarl.algos.params import Param, check_params_declared, param_from_default
from stratarl.algos.sorl import DELTA_RULES, ClipBiasNormalizer
from stratarl.algos.turns import LEVELS
from stratarl.registry import Registry


@dataclass(frozen=True)
class AdvantageBatch:
    """Inputs every advantage estimator receives.

    rewards: [B] outcome reward per rollout.
    group_ids: [B] integer prompt-group id (any values).
    response_mask: [B, T] 1 on policy tokens.
    strata_ids: [B] integer structural key (e.g. search count), or None.
    values: [B, T] critic values, or None (no critic).
    token_rewards: [B, T] per-token rewards (e.g. with a KL penalty folded in), or None
        (then estimators that need them put ``rewards`` on the last policy token).
    step_states: per rollout, the anchor-state key (a str) of each of its policy turns, in order (turn k = the
        k-th run of ``response_mask = 1``): the observations appended before that turn
        (:func:`stratarl.algos.gigpo.anchor_state`); None unless the estimator registered with
        ``needs_step_states`` (GiGPO). Keys are text, not ids, so the estimator's own parameters (exact or
        similarity matching) decide which states pool.
    """

    rewards: Tensor
    group_ids: Tensor
    response_mask: Tensor
    strata_ids: Tensor | None = None
    values: Tensor | None = None
    token_rewards: Tensor | None = None
    step_states: tuple[tuple[str, ...], ...] | None = None


class GradNormalizer(Protocol):
    """Rescales the accumulated gradient of one optimizer step (SORL's clipping-triggered normalisation)."""

    def backward(self, loss: Tensor, clip_bias: Tensor | None, *, skip_clip_bias: bool = False) -> None: ...

    def apply(self) -> dict[str, Tensor]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class AdvantageInfo:
    """What the config checks need to know about an estimator (declared at registration).

    needs_values: it reads ``AdvantageBatch.values``, so the algorithm needs a critic.
    group_relative: it compares the rollouts of one prompt, so a group of one rollout gets advantage 0.
    needs_step_states: it reads ``AdvantageBatch.step_states`` (the trainer decodes each turn's anchor state).
    metrics: ``fn(batch, **params) -> dict[str, float]`` the trainer logs each step, or None.
    """

    needs_values: bool = False
    group_relative: bool = False
    needs_step_states: bool = False
    metrics: Callable[..., dict[str, float]] | None = None


AdvantageFn = Callable[..., tuple[Tensor, Tensor]]
PolicyLossFn = Callable[..., PolicyLossOutput]
NormalizerFn = Callable[..., GradNormalizer]
CorrectionFn = Callable[..., CorrectionOutput]
_ADVANTAGES: Registry[AdvantageFn] = Registry("advantage estimator")
_ADVANTAGE_INFO: dict[str, AdvantageInfo] = {}
_POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss")
_NORMALIZERS: Registry[NormalizerFn] = Registry("gradient normaliser")
_CORRECTIONS: Registry[CorrectionFn] = Registry("behaviour correction")
_PARAMS: dict[str, dict[str, Mapping[str, Param]]] = {
    "advantage": {},
    "policy_loss": {},
    "normalizer": {},
    "behaviour_correction": {},
}
ParamSpecs = Mapping[str, Param] | None


def _declare(kind: str, name: str, fn: Callable[..., Any], params: ParamSpecs) -> None:
    declared = dict(params or {})
    check_params_declared(name, declared, keyword_params(fn))
    _PARAMS[kind][name] = declared


def _add_declared(registry: Registry[Any], kind: str, name: str, fn: Callable[..., Any], params: ParamSpecs) -> None:
    """Declare ``fn``'s parameters, then register it; a bad declaration leaves the name free, and a name taken by
    another part keeps that part's declaration."""
    previous = _PARAMS[kind].get(name)
    _declare(kind, name, fn, params)
    try:
        registry.add(name, fn)
    except ValueError:
        if previous is None:
            _PARAMS[kind].pop(name, None)
        else:
            _PARAMS[kind][name] = previous
        raise


def _decorator(
    registry: Registry[Any], kind: str, name: str, params: ParamSpecs
) -> Callable[[Callable[..., Any]], Any]:
    registry.check_name(name)

    def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
        _add_declared(registry, kind, name, fn, params)
        return fn

    return decorator


def register_advantage(
    name: str,
    *,
    needs_values: bool = False,
    group_relative: bool = False,
    needs_step_states: bool = False,
    metrics: Callable[..., dict[str, float]] | None = None,
    params: ParamSpecs = None,
) -> Callable[[AdvantageFn], AdvantageFn]:
    """Decorator: register ``fn(batch: AdvantageBatch, **params) -> (advantages [B,T], returns [B,T])``.

    ``needs_values``: the estimator reads the critic's values (a config without a critic is refused).
    ``group_relative``: it normalises inside prompt groups (``rollout.group_size`` 1 is refused).
    ``needs_step_states``: it reads ``AdvantageBatch.step_states`` (the trainer fills them only then).
    ``metrics``: ``fn(batch, **params) -> dict[str, float]``, called with the estimator's parameters; the
    trainer logs what it returns.
    ``params``: ``{keyword: Param}``, the types and ranges of its keywords (stratarl.algos.params).
    """
    _ADVANTAGES.check_name(name)

    def decorator(fn: AdvantageFn) -> AdvantageFn:
        _add_declared(_ADVANTAGES, "advantage", name, fn, params)
        _ADVANTAGE_INFO[name] = AdvantageInfo(
            needs_values=needs_values,
            group_relative=group_relative,
            needs_step_states=needs_step_states,
            metrics=metrics,
        )
        return fn

    return decorator


def register_policy_loss(name: str, *, params: ParamSpecs = None) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator: register ``fn(log_probs, old_log_probs, advantages, response_mask, **params) -> PolicyLossOutput``
    (``params``: ``{keyword: Param}``, the types and ranges of its keywords)."""
    return _decorator(_POLICY_LOSSES, "policy_loss", name, params)


def register_grad_normalizer(name: str, *, params: ParamSpecs = None) -> Callable[[NormalizerFn], NormalizerFn]:
    """Decorator: register ``fn(parameters, **params) -> GradNormalizer`` (see :class:`GradNormalizer`;
    ``params``: ``{keyword: Param}``)."""
    return _decorator(_NORMALIZERS, "normalizer", name, params)


def register_behaviour_correction(name: str, *, params: ParamSpecs = None) -> Callable[[CorrectionFn], CorrectionFn]:
    """Decorator: register ``fn(old_log_probs, behaviour_log_probs, response_mask, **params) -> CorrectionOutput``
    (``params``: ``{keyword: Param}``)."""
    return _decorator(_CORRECTIONS, "behaviour_correction", name, params)


def param_specs(kind: str, name: str, fn: Callable[..., Any]) -> dict[str, Param]:
    """The check of each keyword of part ``name`` of ``kind`` (advantage, policy_loss, normalizer,
    behaviour_correction): its declared ``Param``, else one from its default's type (`param_from_default`)."""
    declared = _PARAMS.get(kind, {}).get(name, {})
    return {k: declared.get(k) or param_from_default(d) for k, d in keyword_params(fn).items()}


def get_advantage(name: str) -> AdvantageFn:
    """The advantage estimator registered as ``name`` (KeyError lists the valid names)."""
    return _ADVANTAGES.lookup(name)


def get_policy_loss(name: str) -> PolicyLossFn:
    """The policy loss registered as ``name`` (KeyError lists the valid names)."""
    return _POLICY_LOSSES.lookup(name)


def get_grad_normalizer(name: str) -> NormalizerFn:
    """The gradient normaliser registered as ``name`` (KeyError lists the valid names)."""
    return _NORMALIZERS.lookup(name)


def get_behaviour_correction(name: str) -> CorrectionFn:
    """The behaviour-policy correction registered as ``name`` (KeyError lists the valid names)."""
    return _CORRECTIONS.lookup(name)


def advantage_info(name: str) -> AdvantageInfo:
    """What estimator ``name`` declared at registration (KeyError lists the valid names)."""
    _ADVANTAGES.lookup(name)
    return _ADVANTAGE_INFO.get(name, AdvantageInfo())


def advantage_names() -> list[str]:
    return _ADVANTAGES.names()


def policy_loss_names() -> list[str]:
    return _POLICY_LOSSES.names()


def grad_normalizer_names() -> list[str]:
    return _NORMALIZERS.names()


def behaviour_correction_names() -> list[str]:
    return _CORRECTIONS.names()


def keyword_params(fn: Callable[..., Any]) -> dict[str, Any]:
    """The keyword parameters a registered part accepts, with their defaults (``inspect.Parameter.empty``
    when it has none). The leading positional inputs (batch; log-probs ...; parameters) are not listed;
    a part that takes ``**kwargs`` lists only its named keywords."""
    out = {}
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is not p.empty:
            out[p.name] = p.default
        elif p.kind == p.KEYWORD_ONLY:
            out[p.name] = p.empty
    return out


def _outcome(batch: AdvantageBatch, advantages: Tensor) -> tuple[Tensor, Tensor]:
    token = broadcast_to_tokens(advantages, batch.response_mask)
    return token, token


_EPS = Param.number(ge=0)
_DDOF = Param.integer(ge=0)
_UNIT = Param.number(ge=0, le=1)
_STD = {"eps": _EPS, "std_ddof": _DDOF, "scale_by_std": Param.flag()}


@register_advantage("grpo", group_relative=True, params=_STD)
def _grpo(
    batch: AdvantageBatch, *, eps: float = 1e-6, std_ddof: int = 1, scale_by_std: bool = True
) -> tuple[Tensor, Tensor]:
    """GRPO (GN) advantage broadcast over policy tokens; see :func:`grpo_advantages`."""
    adv = grpo_advantages(batch.rewards, batch.group_ids, eps=eps, std_ddof=std_ddof, scale_by_std=scale_by_std)
    return _outcome(batch, adv)


@register_advantage("drgrpo", group_relative=True, params={"std_ddof": _DDOF})
def _drgrpo(batch: AdvantageBatch, *, std_ddof: int = 1) -> tuple[Tensor, Tensor]:
    """Dr.GRPO mean-only advantage ``R − mean_g R`` (arXiv 2503.20783)."""
    return _outcome(batch, grpo_advantages(batch.rewards, batch.group_ids, std_ddof=std_ddof, scale_by_std=False))


@register_advantage("grpo_positive", group_relative=True, params=_STD)
def _grpo_positive(
    batch: AdvantageBatch, *, eps: float = 1e-6, std_ddof: int = 1, scale_by_std: bool = True
) -> tuple[Tensor, Tensor]:
    """GRPO's advantage with its negative half set to 0, ``max(A_GN, 0)``: the rollouts above their group's
    mean are pushed up as in GRPO, the others are not pushed down (an ablation, not a method)."""
    adv = grpo_advantages(batch.rewards, batch.group_ids, eps=eps, std_ddof=std_ddof, scale_by_std=scale_by_std)
    return _outcome(batch, positive_part(adv))


@register_advantage("reinforce", params={})
def _reinforce(batch: AdvantageBatch) -> tuple[Tensor, Tensor]:
    """REINFORCE without a baseline, ``A = R`` broadcast over policy tokens; see :func:`reinforce_advantages`."""
    return _outcome(batch, reinforce_advantages(batch.rewards))


@register_advantage("stratified", group_relative=True, params={**_STD, "alpha": _UNIT})
def _stratified(
    batch: AdvantageBatch,
    *,
    alpha: float = STRATIFIED_ALPHA,
    eps: float = 1e-6,
    std_ddof: int = 1,
    scale_by_std: bool = True,
) -> tuple[Tensor, Tensor]:
    """Stratified GRPO advantage broadcast over policy tokens; see :func:`stratified_advantages`."""
    if batch.strata_ids is None:
        raise ValueError(
            "advantage estimator 'stratified' needs AdvantageBatch.strata_ids "
            "(e.g. search_counts(response_mask)); got None"
        )
    adv = stratified_advantages(
        batch.rewards,
        batch.group_ids,
        batch.strata_ids,
        alpha=alpha,
        eps=eps,
        std_ddof=std_ddof,
        scale_by_std=scale_by_std,
    )
    return _outcome(batch, adv)


@register_advantage("gae", needs_values=True, params={"gamma": _UNIT, "lam": _UNIT, "whiten": Param.flag()})
def _gae(batch: AdvantageBatch, *, gamma: float = 1.0, lam: float = 1.0, whiten: bool = False) -> tuple[Tensor, Tensor]:
    """GAE over policy tokens (PPO / SO-PPO with a critic); see :func:`gae_advantages`."""
    if batch.values is None:
        raise ValueError("advantage estimator 'gae' needs AdvantageBatch.values from a critic; got None")
    token_rewards = batch.token_rewards
    if token_rewards is None:
        token_rewards = outcome_to_token_rewards(batch.rewards, batch.response_mask)
    return gae_advantages(token_rewards, batch.values, batch.response_mask, gamma=gamma, lam=lam, whiten=whiten)


def _step_groups(batch: AdvantageBatch, similarity_threshold: float | None) -> tuple[tuple[int, ...], ...]:
    if batch.step_states is None:
        raise ValueError(
            "advantage estimator 'gigpo' needs AdvantageBatch.step_states (each turn's anchor state, "
            "e.g. stratarl.rollout.collect.step_states); got None"
        )
    return step_groups(batch.step_states, batch.group_ids, similarity_threshold=similarity_threshold)


def _gigpo_metrics(
    batch: AdvantageBatch, *, similarity_threshold: float | None = None, **_: object
) -> dict[str, float]:
    """GiGPO's step-group sizes (:func:`~stratarl.algos.gigpo.step_group_metrics`), as the estimator groups them."""
    return step_group_metrics(_step_groups(batch, similarity_threshold))


@register_advantage(
    "gigpo",
    group_relative=True,
    needs_step_states=True,
    metrics=_gigpo_metrics,
    params={
        **_STD,
        "gamma": _UNIT,
        "step_weight": Param.number(ge=0),
        "similarity_threshold": Param.number(gt=0, le=1, optional=True),
    },
)
def _gigpo(
    batch: AdvantageBatch,
    *,
    gamma: float = 1.0,
    step_weight: float = 1.0,
    eps: float = 1e-6,
    std_ddof: int = 1,
    scale_by_std: bool = True,
    similarity_threshold: float | None = None,
) -> tuple[Tensor, Tensor]:
    """GiGPO (arXiv 2505.10978): A^E + ω · A^S per turn; see :mod:`stratarl.algos.gigpo`. ``gamma`` is the step
    discount (the shared knob ``algo.gamma``; verl-agent's recipes: 0.95), ``step_weight`` ω, ``scale_by_std``
    F_norm = std (True) or 1, ``similarity_threshold`` None for exact anchor states or the difflib ratio at
    which two states pool (verl-agent: 0.95 by default, 0.9 in its search recipe)."""
    ids = token_step_ids(_step_groups(batch, similarity_threshold), batch.response_mask)
    adv = gigpo_advantages(
        batch.rewards,
        batch.group_ids,
        batch.response_mask,
        ids,
        gamma=gamma,
        step_weight=step_weight,
        eps=eps,
        std_ddof=std_ddof,
        scale_by_std=scale_by_std,
    )
    return adv, adv


# The clipped surrogate is the ``ppo`` loss; SO-PPO / SO-GRPO use it too, at the turn ratio level and with the
# ``sorl`` gradient normaliser (stratarl.algos.presets).
register_policy_loss(
    "ppo",
    params={
        "level": Param.choice(*LEVELS),
        "clip_low": Param.number(gt=0, lt=1),
        "clip_high": Param.number(gt=0),
        "dual_clip": Param.number(gt=1, optional=True),
        "agg": Param.choice(*AGG_MODES),
        "norm_length": Param.integer(ge=1, optional=True),
        "token_weights": Param.any(),
    },
)(clipped_policy_loss)

# Behaviour-policy corrections (docs/algorithms.md, "Behaviour-policy corrections").
_CAP = {"cap": Param.number(gt=1), "level": Param.choice(*LEVELS)}
register_behaviour_correction("tis", params=_CAP)(tis_weights)
register_behaviour_correction("mis", params=_CAP)(mis_weights)
register_behaviour_correction("decoupled", params={"cap": Param.number(gt=1, optional=True)})(decoupled_weights)


@register_grad_normalizer(
    "sorl",
    params={"delta": Param.number(gt=0), "rule": Param.choice(*DELTA_RULES), "ema": Param.number(ge=0, lt=1)},
)
def _sorl_normalizer(
    parameters: Iterable[Tensor], *, delta: float = 1.0, rule: str = "fixed", ema: float = 0.9
) -> ClipBiasNormalizer:
    """SORL's clipping-triggered normalisation g / max(‖C‖, δ); see :class:`ClipBiasNormalizer`."""
    return ClipBiasNormalizer(parameters, delta=delta, rule=rule, ema=ema)
