"""Config dataclasses that extend veRL's config tree with stratarl's settings.

veRL validates its config against dataclasses (``omega_conf_to_dataclass``), so an extra key
needs a dataclass that declares it. The recipes select them with ``_target_``:

    algorithm._target_: stratarl.integrations.verl.config.StratifiedAlgoConfig
    actor_rollout_ref.actor.policy_loss._target_: stratarl.integrations.verl.config.SORLPolicyLossConfig
"""

from __future__ import annotations

from dataclasses import dataclass, field

from verl.base_config import BaseConfig
from verl.trainer.config import AlgoConfig
from verl.workers.config.actor import PolicyLossConfig

from stratarl.algos.advantages import STRATIFIED_ALPHA, check_alpha
from stratarl.integrations.verl.advantage import stratum_cap_from
from stratarl.integrations.verl.guards import refuse_for_estimator, refuse_for_turn_loss


@dataclass
class StratifiedGRPOConfig(BaseConfig):
    """Stratified GRPO settings (Zhu et al., arXiv 2510.06214), veRL's ``algorithm.stratified_grpo``.

    Args:
        alpha: blend α in [0, 1]: A = α · A_SAN + (1 − α) · A_GN (0 = GRPO, 1 = pure SAN; paper 0.6).
        eps: ε added to the std (veRL's GRPO uses 1e-6).
        std_ddof: 1 = Bessel's correction (veRL's GRPO, ``torch.std``), 0 = population std.
        stratum_cap: search counts ≥ cap share one stratum; None = one stratum per count (as the trainer's
            ``algo.stratum_cap``). ``strata_cap``, the older spelling, still loads.
    """

    alpha: float = STRATIFIED_ALPHA
    eps: float = 1e-6
    std_ddof: int = 1
    stratum_cap: int | None = None
    strata_cap: int | None = None  # the older spelling of stratum_cap: read into it

    def __post_init__(self) -> None:
        # BaseConfig freezes a field once set; the older spelling is folded in here, before anything reads it.
        object.__setattr__(self, "stratum_cap", stratum_cap_from(self, where="algorithm.stratified_grpo"))
        check_alpha(self.alpha, "algorithm.stratified_grpo.alpha")
        if self.eps < 0:
            raise ValueError(f"algorithm.stratified_grpo.eps must be >= 0, got {self.eps}")
        if self.std_ddof not in (0, 1):
            raise ValueError(f"algorithm.stratified_grpo.std_ddof must be 0 or 1, got {self.std_ddof}")
        if self.stratum_cap is not None and self.stratum_cap < 0:
            raise ValueError(f"algorithm.stratified_grpo.stratum_cap must be >= 0 or null, got {self.stratum_cap}")


@dataclass
class StratifiedAlgoConfig(AlgoConfig):
    """veRL's ``AlgoConfig`` plus the ``stratified_grpo`` block read by the ``stratified_grpo`` estimator."""

    stratified_grpo: StratifiedGRPOConfig = field(default_factory=StratifiedGRPOConfig)

    def __post_init__(self) -> None:
        parent = getattr(super(), "__post_init__", None)
        if parent is not None:
            parent()
        if self.adv_estimator == "stratified_grpo":
            refuse_for_estimator(self.rollout_correction, where="algorithm.rollout_correction")


@dataclass
class SORLPolicyLossConfig(PolicyLossConfig):
    """veRL's policy-loss config plus SORL's δ.

    Args:
        sorl_delta: δ > 0 in g ← ∇J_PPO / max(‖C‖, δ) (Li et al., arXiv 2511.20718). Default 1,
            the threshold reading: plain PPO steps until the clipping bias ‖C‖ exceeds 1; a small δ is
            the floor reading (every step divided by ‖C‖). Neither is confirmed as the paper's value
            (docs/training.md, "SORL's normalisation"). Read by the SORL actor step
            when ``loss_mode`` is ``sorl``.
    """

    sorl_delta: float = 1.0

    def __post_init__(self) -> None:
        parent = getattr(super(), "__post_init__", None)
        if parent is not None:
            parent()
        if self.loss_mode in ("turn_ppo", "sorl"):
            # The recipes link this block to algorithm.rollout_correction (part_sorl.yaml).
            refuse_for_turn_loss(
                self.rollout_correction,
                plugin=f"loss_mode={self.loss_mode}",
                where="actor_rollout_ref.actor.policy_loss.rollout_correction",
            )
        if self.sorl_delta <= 0:
            raise ValueError(
                f"actor.policy_loss.sorl_delta must be > 0 (stratarl's default is 1, the threshold reading), got {self.sorl_delta}"
            )
