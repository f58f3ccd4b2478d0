"""veRL plugins: importing this module registers stratarl's algorithms with veRL's own registries.

- advantage estimator ``stratified_grpo`` (``algorithm.adv_estimator=stratified_grpo``);
- policy loss ``turn_ppo`` (SORL's turn-level ratio with per-turn clipping);
- policy loss ``sorl`` (the same loss + SORL's exact clipping-triggered gradient normalisation,
  applied by :class:`~stratarl.integrations.verl.worker.SORLTrainingWorker`, which this import
  installs as ``ActorRolloutRefWorker.actor_worker_cls``).

Load it in every Ray worker with ``VERL_USE_EXTERNAL_MODULES=stratarl.integrations.verl``
(veRL imports the listed modules at ``import verl``). See docs/verl.md and recipes/verl/.
CPU smoke runs of veRL's trainer with the plugins live beside the tests (tests/verl/harness). The veRL
versions the plugins are tested with, and the hooks they rely on: :mod:`stratarl.integrations.verl.compat`;
a recipe composed and validated without starting a worker: :mod:`stratarl.integrations.verl.dry_run`.
"""

from __future__ import annotations

try:
    from verl.trainer.ppo.core_algos import register_adv_est, register_policy_loss
except ModuleNotFoundError as error:  # pragma: no cover - exercised only without veRL
    raise ImportError(
        "stratarl.integrations.verl needs veRL (tested with verl==0.9.1): create the veRL environment with "
        "`make .venv-verl/.stamp` or `pip install -r requirements/verl.txt` (see docs/verl.md). "
        f"Original error: {error}"
    ) from error

from stratarl.integrations.verl.advantage import ESTIMATOR_NAME, compute_stratified_grpo_advantage
from stratarl.integrations.verl.losses import SORL, TURN_PPO, compute_sorl_loss, compute_turn_ppo_loss
from stratarl.integrations.verl.worker import SORLTrainingWorker, install_actor_worker, sorl_train_batch

register_adv_est(ESTIMATOR_NAME)(compute_stratified_grpo_advantage)
register_policy_loss(TURN_PPO)(compute_turn_ppo_loss)
register_policy_loss(SORL)(compute_sorl_loss)
ACTOR_WORKER_INSTALLED = install_actor_worker()

__all__ = [
    "ACTOR_WORKER_INSTALLED",
    "ESTIMATOR_NAME",
    "SORL",
    "TURN_PPO",
    "SORLTrainingWorker",
    "compute_sorl_loss",
    "compute_stratified_grpo_advantage",
    "compute_turn_ppo_loss",
    "install_actor_worker",
    "sorl_train_batch",
]
