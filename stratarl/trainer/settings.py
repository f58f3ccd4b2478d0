"""What a run's step and update read, resolved once from the config into small frozen values.

``RunSettings.from_config(cfg)`` (``build_run`` calls it once) resolves the algorithm (``resolve_algorithm``)
and the device / precision policy (``DevicePolicy``) and copies the plain values the step and the update read.
Nothing downstream reads the config tree: a test builds the settings it needs (``UpdateSettings.from_config``),
and no copy of a config can lose a resolved value, because none is stored in it.

    RunSettings     algorithm, policy; the step's and the update's settings
    StepSettings    rollouts per step, the strata, the frozen prefix's source, fault budget, transcripts, dynamic
                    sampling, the overlong mask
    UpdateSettings  the loss terms' coefficients, micro-batching, epochs x mini-batches, clipping
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from stratarl.algos.presets import AlgorithmSpec
from stratarl.infra.precision import DevicePolicy, policy_of
from stratarl.rollout.config import RolloutConfig
from stratarl.trainer.config.resolve import resolve_algorithm

if TYPE_CHECKING:
    from stratarl.trainer.config import Config


@dataclass(frozen=True)
class UpdateSettings:
    """The policy update's settings (stratarl.trainer.update): how its loss is built and its steps are taken."""

    algorithm: AlgorithmSpec
    """The resolved algorithm: the policy loss, normaliser, critic and correction with their parameters."""
    policy: DevicePolicy
    """Where the forward passes run and in what precision (their autocast)."""
    epochs: int
    """K passes over each rollout batch (``trainer.epochs``)."""
    mini_batches: int
    """M optimizer steps per pass (``trainer.mini_batches``)."""
    micro_batch_tokens: int
    """Token budget of one forward / backward (``trainer.micro_batch_tokens``)."""
    logprob_chunk_tokens: int
    """Rows of one chunk of the selective log-softmax (``trainer.logprob_chunk_tokens``)."""
    temperature: float
    """The sampling temperature the log-probs are taken at (``rollout.temperature``)."""
    old_logprobs: Literal["recompute", "rollout"]
    """Where pi_old comes from (``algo.old_logprobs``)."""
    loss_agg: str
    """How every loss term is aggregated over tokens and rows (``algo.loss_agg``)."""
    norm_length: int | None
    """The constant L of ``seq-mean-token-sum-norm`` (``rollout.max_total_tokens``); None for the others."""
    kl_coef: float
    """Weight of KL(pi || pi_ref) in the loss; 0: no reference model (``algo.kl_coef``)."""
    kl_estimator: str
    """k1, k2 or k3 (``algo.kl_estimator``)."""
    entropy_coef: float
    """Weight of the entropy bonus (``algo.entropy_coef``)."""
    value_clip: float
    """The clipped value loss's range (``algo.value_clip``; with a critic)."""
    critic_detach: bool
    """The value head reads detached hidden states (``algo.critic_detach``)."""
    sorl_order: str
    """The gradient normaliser before or after clipping (``algo.sorl_order``)."""
    grad_clip: float
    """Gradient-norm clip; 0: none (``optim.grad_clip``)."""

    @classmethod
    def from_config(
        cls, cfg: Config, algorithm: AlgorithmSpec | None = None, policy: DevicePolicy | None = None
    ) -> UpdateSettings:
        """The update settings of ``cfg`` (``algorithm`` / ``policy``: already resolved ones, else resolved here)."""
        algo, trainer = cfg.algo, cfg.trainer
        return cls(
            algorithm=resolve_algorithm(algo) if algorithm is None else algorithm,
            policy=policy_of(trainer) if policy is None else policy,
            epochs=trainer.epochs,
            mini_batches=trainer.mini_batches,
            micro_batch_tokens=trainer.micro_batch_tokens,
            logprob_chunk_tokens=trainer.logprob_chunk_tokens,
            temperature=cfg.rollout.temperature,
            old_logprobs=algo.old_logprobs,
            loss_agg=algo.loss_agg,
            norm_length=cfg.rollout.max_total_tokens if algo.loss_agg == "seq-mean-token-sum-norm" else None,
            kl_coef=algo.kl_coef,
            kl_estimator=algo.kl_estimator,
            entropy_coef=algo.entropy_coef,
            value_clip=algo.value_clip,
            critic_detach=algo.critic_detach,
            sorl_order=algo.sorl_order,
            grad_clip=cfg.optim.grad_clip,
        )

    @property
    def on_policy_shortcut(self) -> bool:
        """Whether the old log-probs are the update's own forward, detached: `recompute` with one optimizer step
        per rollout batch (epochs x mini_batches = 1). Recomputing them in a separate pass would give the same
        numbers up to float rounding (the same weights on the same tokens), so that pass is skipped and every
        ratio of the step is exactly 1, in any precision."""
        return self.old_logprobs == "recompute" and self.epochs * self.mini_batches == 1


@dataclass(frozen=True)
class StepSettings:
    """One RL step's settings (stratarl.trainer.step), apart from the update's."""

    rollout: RolloutConfig
    """The rollout engine's budgets, sampling and prompt (``rollout:``; frozen)."""
    prompts_per_step: int
    """P questions per step; each gets ``rollout.group_size`` rollouts."""
    seed: int
    """Seeds the random-strata control's permutation (``trainer.seed``)."""
    random_strata: bool
    """``algo.stratum_key: random``: the advantage uses the observed strata permuted inside each group."""
    prefix_from_rollouts: bool
    """The frozen prefix is the states the generator kept while sampling (``trainer.prefix_from_rollouts``)."""
    max_failed_fraction: float
    """A step whose share of rollouts with a failed search passes this takes no update."""
    num_transcripts: int
    """Rollouts written to transcripts/ per step (``logging.num_transcripts``)."""
    device: str
    """Where the batch's tensors live (``trainer.device``)."""
    dynamic_sampling: bool = False
    """Drop prompt groups whose raw outcome is constant and refill the batch (``trainer.dynamic_sampling``)."""
    dynamic_sampling_attempts: int = 1
    """Most collections per step with dynamic sampling (``trainer.dynamic_sampling_attempts``)."""
    mask_overlong: bool = False
    """Overlong rollouts weigh 0 in the loss (``algo.overlong: mask``)."""

    @classmethod
    def from_config(cls, cfg: Config) -> StepSettings:
        return cls(
            rollout=cfg.rollout,
            prompts_per_step=cfg.trainer.prompts_per_step,
            seed=cfg.trainer.seed,
            random_strata=cfg.algo.stratum_key == "random",
            prefix_from_rollouts=cfg.trainer.prefix_from_rollouts,
            max_failed_fraction=cfg.retrieval.max_failed_fraction,
            num_transcripts=cfg.logging.num_transcripts,
            device=cfg.trainer.device,
            dynamic_sampling=cfg.trainer.dynamic_sampling,
            dynamic_sampling_attempts=cfg.trainer.dynamic_sampling_attempts,
            mask_overlong=cfg.algo.overlong == "mask",
        )


@dataclass(frozen=True)
class RunSettings:
    """A run's resolved values, built once by ``build_run``: the algorithm, the device policy, and the
    settings of its step and its update."""

    step: StepSettings
    update: UpdateSettings

    @property
    def algorithm(self) -> AlgorithmSpec:
        return self.update.algorithm

    @property
    def policy(self) -> DevicePolicy:
        return self.update.policy

    @classmethod
    def from_config(cls, cfg: Config) -> RunSettings:
        """Resolve ``cfg`` (validated) once: its algorithm and device policy (bf16 asked of a GPU without it
        fails here, before any work) and the plain values the step and the update read."""
        algorithm, policy = resolve_algorithm(cfg.algo), policy_of(cfg.trainer)
        return cls(StepSettings.from_config(cfg), UpdateSettings.from_config(cfg, algorithm, policy))
