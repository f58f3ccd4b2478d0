"""The ``algo`` section: which algorithm, and the one home of each of its parameters.

An algorithm is a preset (``name``) whose five parts can each be replaced (stratarl.algos.presets). A
parameter has exactly one spelling:

- the shared knobs below (``alpha``, ``epsilon``, ``gamma``, ``lam``; ``clip_low``, ``clip_high``, ``loss_agg``;
  ``sorl_delta``, ``sorl_delta_rule``, ``sorl_delta_ema``) reach every part whose function takes that keyword;
- ``advantage_params`` / ``policy_loss_params`` / ``normalizer_params`` hold only the other keywords of the
  registered function (a key that a knob or another field sets is refused, naming that field).

Older spellings (``turn_level_ratio``, ``sorl_normalize``, the ``sorl`` policy loss, knob keys inside the
``*_params`` mappings) are rewritten into these once, when a config is loaded (stratarl.trainer.config.legacy).
stratarl.trainer.config.resolve resolves the section into a frozen ``AlgorithmSpec`` once, in ``Config.validate``.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from stratarl.algos.advantages import STRATIFIED_ALPHA, check_alpha
from stratarl.algos.losses import AGG_MODES, AggMode, KlEstimator
from stratarl.algos.presets import PRESETS
from stratarl.algos.sorl import DeltaRule
from stratarl.config_errors import close_match
from stratarl.config_errors import fail as _fail
from stratarl.config_tree import check_choices
from stratarl.rewards import RewardParamError, check_reward_params, reward_names
from stratarl.rollout.collect import OVERLONG_RULES, STRATUM_KEYS, OverlongRule, is_stratum_key

ALGORITHMS = tuple(PRESETS)  # the presets' names (stratarl.algos.presets)
SorlOrder = Literal["before_clip", "after_clip"]
SORL_ORDERS: tuple[SorlOrder, ...] = get_args(SorlOrder)
LOSS_AGGREGATIONS = AGG_MODES  # stratarl.algos.losses.AggMode


@dataclass
class AlgoConfig:
    """The algorithm: a preset (`name`) whose parts `advantage`, `policy_loss`, `ratio_level`, `normalizer`
    and `critic` can each be replaced; see stratarl.algos.presets and stratarl.trainer.config.resolve."""

    name: str = "stratified_grpo"
    """The preset: grpo, stratified_grpo, ppo, so_ppo, so_grpo, drgrpo, gspo or gigpo (stratarl.algos.presets.PRESETS)."""
    advantage: str | None = None
    """Advantage estimator, a registered name (grpo, drgrpo, grpo_positive, reinforce, stratified, gae, gigpo,
    or one a `--import`ed module registers); null: the preset's."""
    advantage_params: dict[str, Any] = field(default_factory=dict)
    """Other keyword arguments of the estimator (checked against its signature), e.g. `{std_ddof: 0}`; alpha,
    eps, gamma and lam are the shared knobs `alpha`, `epsilon`, `gamma`, `lam`."""
    policy_loss: str | None = None
    """Policy loss, a registered name (ppo, or one a `--import`ed module registers); null: the preset's."""
    policy_loss_params: dict[str, Any] = field(default_factory=dict)
    """Other keyword arguments of the policy loss, e.g. `{dual_clip: 3.0}` (dual clip, Ye et al. 2020); the clip
    range, ratio level and aggregation are `clip_low` / `clip_high`, `ratio_level` and `loss_agg`."""
    ratio_level: Literal["token", "turn", "sequence"] | None = None
    """Importance ratio per token, per turn (SORL) or per rollout (GSPO); null: the preset's."""
    normalizer: str | None = None
    """Gradient normaliser: `none` or a registered name (`sorl`: g / max(||C||, delta)); null: the preset's.
    `sorl` on grpo / ppo is the "normalisation only" ablation, `none` on so_* the "turn-level ratio only" one."""
    normalizer_params: dict[str, Any] = field(default_factory=dict)
    """Other keyword arguments of the normaliser; delta, rule and ema are `sorl_delta`, `sorl_delta_rule`,
    `sorl_delta_ema`."""
    critic: str | None = None
    """`none` or `value_head` (a value head on the policy's hidden states; GAE needs it); null: the preset's."""
    alpha: float = STRATIFIED_ALPHA
    """Stratified GRPO blend: alpha * SAN + (1 - alpha) * GN (0 = GRPO, 1 = pure SAN; paper: 0.6)."""
    stratum_key: str = "num_searches"
    """How rollouts are stratified: `num_searches` (paper: the retriever calls run: the `search` tool's calls),
    `tool_calls` (the calls of every tool of `rollout.tools` that ran), `tool_calls[open,search]` (those of the tools
    named), `observation_blocks` (the
    observation blocks between policy turns, from the response mask alone: the veRL plugin's definition, which
    also counts invalid-action feedback and misses a trailing observation), `answered`, `random` (control: the num_searches strata's sizes kept inside each group, rollouts assigned to them by a seeded random permutation), or `module:function` taking a Rollout and returning a hashable key."""
    stratum_cap: int | None = None
    """With num_searches / tool_calls / observation_blocks: counts >= cap share one stratum (None: no cap)."""
    epsilon: float = 1e-6
    """Advantage normaliser epsilon (the GRPO baseline's)."""
    clip_low: float = 0.2
    """Lower clip range: ratios below 1 - clip_low are clipped."""
    clip_high: float = 0.2
    """Upper clip range: ratios above 1 + clip_high are clipped."""
    loss_agg: AggMode = "token-mean"
    """Loss aggregation of every term: token-mean (Search-R1), seq-mean-token-mean, seq-mean-token-sum, or
    seq-mean-token-sum-norm (Dr.GRPO: each rollout's token sum over one constant L = rollout.max_total_tokens)."""
    sorl_delta: float = 1.0
    """SORL normalisation floor delta: g <- g / max(||C||, delta) (rule `fixed`); with rule `running_pg`
    the multiple of the running policy-gradient norm at which the normalisation engages."""
    sorl_delta_rule: DeltaRule = "fixed"
    """`fixed` (the paper's formula; delta 1 reads delta as a gradient-norm threshold, a small delta as a floor
    that divides every step by ||C||; docs/training.md) or `running_pg` (scale-free: delta_t = delta x the moving
    average of ||grad J_PPO|| over previous optimizer steps, and g <- g * min(1, delta_t / ||C||))."""
    sorl_delta_ema: float = 0.9
    """Moving-average coefficient of the `running_pg` rule's statistic."""
    sorl_order: SorlOrder = "before_clip"
    """Where the SORL factor is applied: `before_clip` (then gradient-norm clipping, optim.grad_clip, can undo it
    unless ||C|| > max(delta, ||grad||)) or `after_clip` (clip first, so the factor always reaches the optimizer)."""
    kl_coef: float = 0.001
    """Reference-model KL coefficient (k3 estimator); 0 disables the reference model entirely."""
    kl_estimator: KlEstimator = "k3"
    """KL estimator: k1, k2 or k3."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient (loss -= coef * entropy)."""
    gamma: float = 1.0
    """Discount of every estimator that takes one: GAE's (PPO family; Search-R1: 1) and GiGPO's step returns
    (1 by default; the GiGPO paper uses 0.95, which favours rollouts that answer in fewer turns)."""
    lam: float = 1.0
    """GAE lambda (PPO family; Search-R1: 1)."""
    value_clip: float = 0.2
    """Clipped value loss range (PPO family)."""
    critic_lr: float = 1e-5
    """Learning rate of the value head (PPO family; Search-R1: 1e-5)."""
    critic_detach: bool = True
    """Value head reads detached policy hidden states (a cheap critic that never disturbs the policy)."""
    old_logprobs: Literal["recompute", "rollout"] = "recompute"
    """The log-probs the PPO clip is centred on (pi_old): `recompute` (the learner's forward pass before the update,
    as veRL) or `rollout` (the sampler's own, pi_behav; saves a forward pass). With an off-policy source
    (trainer.policy_lag, rollout.precision) `rollout` makes the ratio, the clip and SORL's turn ratio and
    normaliser act against the behaviour policy."""
    behaviour_correction: str = "none"
    """Behaviour-policy correction: `none`, or a registered name (`tis`: truncated IS weights min(pi_old/pi_behav, C);
    `mis`: mask tokens / turns / rollouts whose ratio lies outside [1/C, C]; `decoupled`: AReaL's decoupled PPO;
    or one a `--import`ed module registers). Its weights multiply the per-token clipped loss after the clip,
    before SORL's normalisation and gradient-norm clipping (docs/training.md, Off-policy training). Needs
    old_logprobs=recompute (with `rollout`, pi_old is pi_behav and every weight would be 1)."""
    behaviour_correction_params: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the correction (checked against its signature), e.g. `{cap: 2.0, level: turn}`."""
    reward: str = "em"
    """The reward, a registered name: em (Search-R1), subem, f1, multiple_choice; em_format, subem_format,
    f1_format (gated by Search-R1's format check); judge (an LLM behind an OpenAI-compatible endpoint); one a
    `--import`ed module registers (stratarl.rewards.register_reward); or `package.module:function` taking
    (response_text, golds). Multiple-choice data sources (medqa, medmcqa, synthetic_mc) score the answer by
    letter or option text whatever the answer score named, as Search-R1 picks its scorer by data_source."""
    reward_params: dict[str, Any] = field(default_factory=dict)
    """The reward's keyword arguments, typed and range-checked at load: `invalid_action_penalty` and
    `tool_call_cost` (every built-in reward; >= 0, default 0: subtracted per invalid action / tool call),
    `format_score` (the *_format rewards; [0, 1), default 0.2), `url`, `model`, `timeout_s`, `api_key_env` (judge);
    README.md, Rewards."""
    overlong: OverlongRule = "keep"
    """Rollouts that ran out of budget without an answer (rollout.max_total_tokens, or the turn budget):
    `keep` (trained like any other), `mask` (out of the loss: their tokens weigh 0; the group baselines still
    count them), or `reward` (their reward becomes `overlong_reward`; their raw outcome is kept)."""
    overlong_reward: float = 0.0
    """The reward of an overlong rollout with `overlong: reward` (e.g. -0.5 for a soft penalty)."""

    def validate(self, p: str) -> None:
        check_choices(self, p)
        try:
            check_alpha(self.alpha)
        except ValueError:
            _fail(f"{p}.alpha", self.alpha, "the blend weight must lie in [0, 1]", f"use {STRATIFIED_ALPHA} (paper)")
        if not is_stratum_key(self.stratum_key):
            close = difflib.get_close_matches(self.stratum_key, STRATUM_KEYS, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            _fail(
                f"{p}.stratum_key",
                self.stratum_key,
                "unknown stratum key",
                f"{hint}use num_searches, observation_blocks, answered, random, tool_calls, tool_calls[open,search], "
                "or `package.module:function`",
            )
        if self.stratum_cap is not None and self.stratum_cap < 1:
            _fail(f"{p}.stratum_cap", self.stratum_cap, "must be >= 1 or null", "use null for no cap")
        for key in ("clip_low", "clip_high"):
            if not 0 < getattr(self, key) < 1:
                _fail(f"{p}.{key}", getattr(self, key), "clip ranges must lie in (0, 1)", "use 0.2")
        if not self.sorl_delta > 0 or not math.isfinite(self.sorl_delta):
            _fail(f"{p}.sorl_delta", self.sorl_delta, "the floor must be positive and finite", "use 1.0")
        if not 0 <= self.sorl_delta_ema < 1:
            _fail(f"{p}.sorl_delta_ema", self.sorl_delta_ema, "must lie in [0, 1)", "use 0.9")
        if self.kl_coef < 0:
            _fail(f"{p}.kl_coef", self.kl_coef, "must be >= 0", "use 0.001, or 0 to disable the reference model")
        self._check_reward(p)
        if self.epsilon < 0:
            _fail(f"{p}.epsilon", self.epsilon, "must be >= 0", "use 1e-6")
        if self.critic_lr <= 0:
            _fail(
                f"{p}.critic_lr", self.critic_lr, "the critic's learning rate must be positive", "use 1e-5 (Search-R1)"
            )
        if self.value_clip <= 0:
            _fail(f"{p}.value_clip", self.value_clip, "the value clip range must be positive", "use 0.2")
        if self.entropy_coef < 0:
            _fail(
                f"{p}.entropy_coef",
                self.entropy_coef,
                "a negative bonus would penalise entropy",
                "use 0.0 or e.g. 0.001",
            )
        if not (0 <= self.gamma <= 1 and 0 <= self.lam <= 1):
            _fail(f"{p}.gamma/lam", (self.gamma, self.lam), "must lie in [0, 1]", "use 1.0 (Search-R1)")

    def _check_reward(self, p: str) -> None:
        """The reward resolves and its parameters are known, typed and in range (stratarl.rewards)."""
        if ":" in self.reward:
            if self.reward_params:
                _fail(
                    f"{p}.reward_params",
                    self.reward_params,
                    "a `package.module:function` reward takes (response_text, golds) and no parameters",
                    "drop algo.reward_params, or register the reward with stratarl.rewards.register_reward",
                )
        elif self.reward not in reward_names():
            _fail(
                f"{p}.reward",
                self.reward,
                "unknown reward",
                f"{close_match(self.reward, reward_names())}use one of {', '.join(reward_names())}, a reward a "
                "`--import`ed module registers, or `package.module:function`",
            )
        else:
            try:
                check_reward_params(self.reward, self.reward_params)
            except RewardParamError as error:
                _fail(f"{p}.reward_params.{error.key}", error.value, error.why, error.fix)
        if self.overlong not in OVERLONG_RULES:
            _fail(f"{p}.overlong", self.overlong, "unknown rule", f"use one of {', '.join(OVERLONG_RULES)}")
        if not math.isfinite(self.overlong_reward):
            _fail(f"{p}.overlong_reward", self.overlong_reward, "must be finite", "use e.g. 0.0 or -0.5")
