"""The algorithms as values: each preset names the parts it is built from.

An algorithm is five parts, each a registered name (stratarl.algos.registry) or a fixed choice:

    advantage     the estimator: ``fn(AdvantageBatch, **params) -> (advantages, returns)``
    policy_loss   the clipped surrogate: ``fn(log_probs, old_log_probs, advantages, mask, **params)``
    ratio_level   token | turn | sequence: where the importance ratio is taken (the loss's ``level``)
    normalizer    none | a registered gradient normaliser (``sorl``: g / max(‖C‖, δ))
    critic        none | value_head (a value head on the policy's hidden states; GAE needs it)

and, outside every preset, the behaviour correction (``algo.behaviour_correction``: none, or a registered
correction such as tis / mis / decoupled that weights the policy loss per token by π_old / π_behav).

``algo.name`` picks a row of :data:`PRESETS`; ``algo.advantage``, ``algo.policy_loss``,
``algo.ratio_level``, ``algo.normalizer``, ``algo.critic`` and the ``*_params`` mappings replace
single parts of it. The trainer only ever reads the resolved parts, never the preset's name.

A preset's ``*_params`` never repeat a parameter that a shared config knob already sets
(``algo.alpha``, ``algo.epsilon``, ``algo.clip_low`` ...; see stratarl.trainer.config), so a knob
always means the same thing whatever the preset.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

RATIO_LEVELS = ("token", "turn", "sequence")
CRITICS = ("none", "value_head")
NO_NORMALIZER = "none"
NO_CORRECTION = "none"


def _frozen(params: Mapping[str, Any] | None = None) -> Mapping[str, Any]:
    return MappingProxyType(dict(params or {}))


@dataclass(frozen=True)
class AlgorithmSpec:
    """One algorithm: its parts and their parameters (keyword arguments of the registered functions)."""

    advantage: str
    policy_loss: str = "ppo"
    ratio_level: str = "token"
    normalizer: str = NO_NORMALIZER
    critic: str = "none"
    advantage_params: Mapping[str, Any] = field(default_factory=_frozen)
    policy_loss_params: Mapping[str, Any] = field(default_factory=_frozen)
    normalizer_params: Mapping[str, Any] = field(default_factory=_frozen)
    summary: str = ""
    correction: str = NO_CORRECTION
    correction_params: Mapping[str, Any] = field(default_factory=_frozen)

    def __post_init__(self) -> None:
        if self.ratio_level not in RATIO_LEVELS:
            raise ValueError(f"ratio_level {self.ratio_level!r}: use one of {', '.join(RATIO_LEVELS)}")
        if self.critic not in CRITICS:
            raise ValueError(f"critic {self.critic!r}: use one of {', '.join(CRITICS)}")
        for name in ("advantage_params", "policy_loss_params", "normalizer_params", "correction_params"):
            object.__setattr__(self, name, _frozen(getattr(self, name)))

    @property
    def uses_critic(self) -> bool:
        return self.critic != "none"

    @property
    def uses_normalizer(self) -> bool:
        return self.normalizer != NO_NORMALIZER

    @property
    def uses_correction(self) -> bool:
        return self.correction != NO_CORRECTION


# The one table of algorithms. Sources: GRPO (arXiv 2402.03300), Stratified GRPO (2510.06214),
# PPO with GAE (1707.06347, 1506.02438), SORL's SO-PPO / SO-GRPO (2511.20718), Dr.GRPO (2503.20783),
# GSPO (2507.18071), GiGPO (2505.10978).
PRESETS: Mapping[str, AlgorithmSpec] = MappingProxyType(
    {
        "grpo": AlgorithmSpec("grpo", summary="group-normalised advantage (GN), token ratio"),
        "stratified_grpo": AlgorithmSpec(
            "stratified", summary="alpha * SAN + (1 - alpha) * GN over search-count strata, token ratio"
        ),
        "ppo": AlgorithmSpec("gae", critic="value_head", summary="value head + GAE, token ratio"),
        "so_ppo": AlgorithmSpec(
            "gae",
            ratio_level="turn",
            normalizer="sorl",
            critic="value_head",
            summary="value head + GAE, turn ratio, clipping-triggered normalisation",
        ),
        "so_grpo": AlgorithmSpec(
            "grpo",
            ratio_level="turn",
            normalizer="sorl",
            summary="GN advantage, turn ratio, clipping-triggered normalisation",
        ),
        "drgrpo": AlgorithmSpec(
            "drgrpo",
            summary="mean-only group advantage R - mean(R), token ratio "
            "(the paper's constant-length aggregation: algo.loss_agg=seq-mean-token-sum-norm)",
        ),
        "gspo": AlgorithmSpec(
            "grpo",
            ratio_level="sequence",
            summary="GN advantage, length-normalised sequence ratio "
            "(the paper clips at 3e-4 / 4e-4: set algo.clip_low / clip_high)",
        ),
        "gigpo": AlgorithmSpec(
            "gigpo",
            summary="GN episode advantage + step advantage of turns sharing an anchor state "
            "(exact; algo.advantage_params.similarity_threshold pools similar ones), "
            "token ratio; step discount algo.gamma (paper / verl-agent: 0.95)",
        ),
    }
)


def preset_names() -> list[str]:
    return list(PRESETS)


def get_preset(name: str) -> AlgorithmSpec:
    """The preset ``name`` (KeyError lists the valid names)."""
    if name not in PRESETS:
        raise KeyError(f"unknown algorithm {name!r}; presets: {', '.join(PRESETS)}")
    return PRESETS[name]
