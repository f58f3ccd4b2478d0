"""Registries: a new advantage estimator or policy loss is one decorated function.

One signature per kind:

- advantage: ``fn(batch: AdvantageBatch, **params) -> (advantages [B, T], returns [B, T])``.
  Every estimator sees the same inputs (outcome rewards, ids, strata, mask, and the critic's
  values when there is one), so the trainer never special-cases GAE or GRPO. Outcome
  estimators broadcast their [B] advantage over policy tokens and return it as ``returns`` too
  (veRL's convention).
- policy loss: ``fn(log_probs, old_log_probs, advantages, response_mask, **params) -> PolicyLossOutput``
  (``loss``, ``metrics``, ``clip_bias``; all [B, T] inputs).

An unknown name raises a KeyError listing the registered ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from stratarl.algos.advantages import (
    broadcast_to_tokens,
    gae_advantages,
    grpo_advantages,
    outcome_to_token_rewards,
    stratified_advantages,
)
from stratarl.algos.losses import PolicyLossOutput, clipped_policy_loss


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
    """

    rewards: Tensor
    group_ids: Tensor
    response_mask: Tensor
    strata_ids: Tensor | None = None
    values: Tensor | None = None
    token_rewards: Tensor | None = None


AdvantageFn = Callable[..., tuple[Tensor, Tensor]]
PolicyLossFn = Callable[..., PolicyLossOutput]
_ADVANTAGES: dict[str, AdvantageFn] = {}
_POLICY_LOSSES: dict[str, PolicyLossFn] = {}


def _register(table: dict, kind: str, name: str):
    def decorator(fn):
        if name in table and table[name] is not fn:
            raise ValueError(f"{kind} {name!r} is already registered (by {table[name].__qualname__})")
        table[name] = fn
        return fn

    return decorator


def _lookup(table: dict, kind: str, name: str):
    if name not in table:
        valid = ", ".join(sorted(table))
        raise KeyError(f"unknown {kind} {name!r}; registered: {valid}")
    return table[name]


def register_advantage(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    """Decorator: register ``fn(batch: AdvantageBatch, **params) -> (advantages [B,T], returns [B,T])``."""
    return _register(_ADVANTAGES, "advantage estimator", name)


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator: register ``fn(log_probs, old_log_probs, advantages, response_mask, **params) -> PolicyLossOutput``."""
    return _register(_POLICY_LOSSES, "policy loss", name)


def get_advantage(name: str) -> AdvantageFn:
    """The advantage estimator registered as ``name`` (KeyError lists the valid names)."""
    return _lookup(_ADVANTAGES, "advantage estimator", name)


def get_policy_loss(name: str) -> PolicyLossFn:
    """The policy loss registered as ``name`` (KeyError lists the valid names)."""
    return _lookup(_POLICY_LOSSES, "policy loss", name)


def advantage_names() -> list[str]:
    return sorted(_ADVANTAGES)


def policy_loss_names() -> list[str]:
    return sorted(_POLICY_LOSSES)


def _outcome(batch: AdvantageBatch, advantages: Tensor) -> tuple[Tensor, Tensor]:
    token = broadcast_to_tokens(advantages, batch.response_mask)
    return token, token


@register_advantage("grpo")
def _grpo(batch: AdvantageBatch, *, eps: float = 1e-6, std_ddof: int = 1, scale_by_std: bool = True):
    """GRPO (GN) advantage broadcast over policy tokens; see :func:`grpo_advantages`."""
    adv = grpo_advantages(batch.rewards, batch.group_ids, eps=eps, std_ddof=std_ddof, scale_by_std=scale_by_std)
    return _outcome(batch, adv)


@register_advantage("drgrpo")
def _drgrpo(batch: AdvantageBatch, *, std_ddof: int = 1):
    """Dr.GRPO mean-only advantage ``R − mean_g R`` (arXiv 2503.20783)."""
    return _outcome(batch, grpo_advantages(batch.rewards, batch.group_ids, std_ddof=std_ddof, scale_by_std=False))


@register_advantage("stratified")
def _stratified(
    batch: AdvantageBatch,
    *,
    alpha: float = 0.6,
    eps: float = 1e-6,
    std_ddof: int = 1,
    scale_by_std: bool = True,
):
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


@register_advantage("gae")
def _gae(batch: AdvantageBatch, *, gamma: float = 1.0, lam: float = 1.0):
    """GAE over policy tokens (PPO / SO-PPO with a critic); see :func:`gae_advantages`."""
    if batch.values is None:
        raise ValueError("advantage estimator 'gae' needs AdvantageBatch.values from a critic; got None")
    token_rewards = batch.token_rewards
    if token_rewards is None:
        token_rewards = outcome_to_token_rewards(batch.rewards, batch.response_mask)
    return gae_advantages(token_rewards, batch.values, batch.response_mask, gamma=gamma, lam=lam)


@register_policy_loss("ppo")
def _ppo(log_probs, old_log_probs, advantages, response_mask, **params) -> PolicyLossOutput:
    """Clipped surrogate, token-level ratios by default; see :func:`clipped_policy_loss`."""
    return clipped_policy_loss(log_probs, old_log_probs, advantages, response_mask, **params)


@register_policy_loss("sorl")
def _sorl(log_probs, old_log_probs, advantages, response_mask, *, level: str = "turn", **params) -> PolicyLossOutput:
    """SORL's clipped surrogate: turn-level ratios by default (pair it with ClipBiasNormalizer)."""
    return clipped_policy_loss(log_probs, old_log_probs, advantages, response_mask, level=level, **params)
