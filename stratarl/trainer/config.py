"""One typed config tree for `stratarl train`, `sft` and `eval`.

Loaded from YAML, then dotted command-line overrides are applied
(``stratarl train configs/demo.yaml algo.name=grpo trainer.steps=20``), then the
whole tree is validated. Every error names the field path, the bad value, why it
is wrong and how to fix it. Unknown keys list the valid ones with a close-match
suggestion. The resolved tree is saved as ``config.yaml`` in the run directory.

Defaults follow Search-R1 / the two papers (ALGORITHMS.md §3) where they apply
to any model size; the shipped configs shrink sizes for CPU runs.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from stratarl.algos.losses import KL_ESTIMATORS
from stratarl.algos.presets import PRESETS, AlgorithmSpec
from stratarl.algos.registry import advantage_info
from stratarl.algos.sorl import DELTA_RULES as SORL_DELTA_RULES
from stratarl.trainer.algorithm import resolve_algorithm
from stratarl.config_errors import ConfigError
from stratarl.config_tree import apply_overrides, build, check_choices, parse_override
from stratarl.config_errors import fail as _fail
from stratarl.rollout.config import RolloutConfig

ALGORITHMS = tuple(PRESETS)  # the presets' names (stratarl.algos.presets)
STRATUM_KEYS = ("num_searches", "observation_blocks", "answered", "random")
OPTIMIZERS = ("adamw", "sgd")
SORL_ORDERS = ("before_clip", "after_clip")
LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")

__all__ = ["ALGORITHMS", "Config", "ConfigError", "SORL_DELTA_RULES", "apply_overrides", "config_from_dict", "load_config",
           "parse_override", "save_config"]


@dataclass
class LoraConfig:
    enabled: bool = False
    """Train LoRA adapters (peft) instead of all weights: cheaper optimizer state on CPU."""
    r: int = 16
    """LoRA rank."""
    alpha: int = 32
    """LoRA scaling numerator (scale = alpha / r)."""
    dropout: float = 0.0
    """Dropout on the LoRA input. Must be 0: the behaviour log-probs are computed in eval mode (no dropout) and
    the update runs in train mode, so with dropout the first optimizer step would not be on-policy."""
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj", "gate_proj"])
    """Module names that get adapters."""

    def validate(self, p: str) -> None:
        check_choices(self, p)
        if self.r < 1:
            _fail(f"{p}.r", self.r, "the LoRA rank must be at least 1", "use e.g. 8 or 16")
        if self.dropout != 0.0:
            _fail(f"{p}.dropout", self.dropout, "the behaviour log-probs are computed without dropout (eval mode) and the "
                  "update with it (train mode), so the ratios of the first, on-policy step would not be 1",
                  "use 0.0 (regularise with optim.weight_decay instead)")
        if not self.target_modules:
            _fail(f"{p}.target_modules", self.target_modules, "no module would get an adapter", "list e.g. [q_proj, v_proj]")


@dataclass
class ModelConfig:
    name: str = "smollm2-135m-instruct"
    """Bundled alias (smollm2-135m-instruct), local folder, hub id, `tiny-random` (random Llama over the SmolLM2 tokenizer, for tests), or `word-tiny` (random Llama over a word-level vocabulary built from the task's corpus and questions; sizes from tiny_*; see docs/wordlevel.md)."""
    init_from: str | None = None
    """A model folder (safetensors) to start from instead of `name`'s weights, e.g. an `stratarl sft` output (`<run>/sft/model`)."""
    tokenizer: str | None = None
    """Tokenizer to load; default: the same as `name` (SmolLM2's for `tiny-random`)."""
    tiny_hidden_size: int = 64
    """`tiny-random` only: hidden size."""
    tiny_num_layers: int = 2
    """`tiny-random` only: number of layers."""
    tiny_num_heads: int = 4
    """`tiny-random` only: attention heads."""
    tiny_intermediate_size: int = 128
    """`tiny-random` only: MLP width."""
    tiny_copy_init: float = 0.0
    """`tiny-random` / `word-tiny` only: start each attention layer's value and output projections at this
    times the identity (0: random), so copying a word from the context works from the first step
    (the lab's policy uses 1.0; docs/lab.md)."""
    trainable_layers: int = 0
    """Train only the last N transformer layers (+ final norm); embeddings and the rest stay frozen, so the
    backward pass stops at layer L-N (about 2x cheaper on CPU with N = L/5). 0 trains everything."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass: less memory, ~30% more compute."""
    lora: LoraConfig = field(default_factory=LoraConfig)

    def validate(self, p: str) -> None:
        check_choices(self, p)
        for name in ("tiny_hidden_size", "tiny_num_layers", "tiny_num_heads", "tiny_intermediate_size"):
            if getattr(self, name) < 1:
                _fail(f"{p}.{name}", getattr(self, name), "sizes must be positive", "use a positive integer")
        if self.tiny_hidden_size % self.tiny_num_heads:
            _fail(f"{p}.tiny_hidden_size", self.tiny_hidden_size, f"must be divisible by tiny_num_heads={self.tiny_num_heads}",
                  "pick a multiple of the head count")
        if self.trainable_layers < 0:
            _fail(f"{p}.trainable_layers", self.trainable_layers, "must be >= 0", "use 0 to train all layers")
        if self.init_from is not None and not Path(self.init_from).exists():
            _fail(f"{p}.init_from", self.init_from, "no such folder", "run `stratarl sft` first or point at an existing model folder")
        self.lora.validate(f"{p}.lora")


@dataclass
class SyntheticDataConfig:
    seed: int = 0
    """Seed of the synthetic knowledge base (same seed, same corpus and questions)."""
    cache_dir: str | None = None
    """Where the generated KB lives; default `$STRATARL_CACHE/synth/seed<seed>-<hash of options>`."""
    options: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for `stratarl.data.synth.generate_knowledge_base` (sizes, question types)."""


@dataclass
class DataConfig:
    source: Literal["synthetic", "files"] = "synthetic"
    """`synthetic`: the generated knowledge-base task; `files`: Search-R1 parquet/jsonl in `train_files` / `test_files`."""
    train_files: list[str] = field(default_factory=list)
    """Training question files (Search-R1 parquet or jsonl)."""
    test_files: list[str] = field(default_factory=list)
    """Held-out question files, used by eval."""
    corpus: str | None = None
    """Corpus jsonl for `retrieval` when `source: files` and `retrieval.spec` does not name an index."""
    max_train_examples: int | None = None
    """Keep at most this many training questions (None: all)."""
    max_eval_examples: int | None = 200
    """Evaluate on at most this many held-out questions per data_source (None: all)."""
    synthetic: SyntheticDataConfig = field(default_factory=SyntheticDataConfig)

    def validate(self, p: str) -> None:
        check_choices(self, p)
        if self.source == "files" and not self.train_files:
            _fail(f"{p}.train_files", self.train_files, "`data.source: files` needs training files",
                  "list parquet/jsonl paths, or set data.source=synthetic")
        for key in ("train_files", "test_files"):
            for f in getattr(self, key):
                if not Path(f).exists():
                    _fail(f"{p}.{key}", f, "file not found", "check the path (relative paths start at the current directory)")
        for key in ("max_train_examples", "max_eval_examples"):
            v = getattr(self, key)
            if v is not None and v < 1:
                _fail(f"{p}.{key}", v, "must be positive or null", "use null for all examples")


@dataclass
class RetrievalConfig:
    spec: Any = "bm25"
    """What `stratarl.retrieval.build_retriever` gets: `bm25` (index built and cached from the corpus), an index folder, a URL of a `/retrieve` server, or a dict."""
    topk: int = 3
    """Passages per search (Search-R1: 3)."""
    step_budget_s: float | None = 120.0
    """Most wall seconds one training step may spend in searches (a hanging server costs at most this per
    step): a remote retriever stops retrying at it, and once it is spent the step's remaining searches
    fail at once. null: no budget."""
    max_failed_fraction: float = 0.5
    """Rollouts with a failed search are kept out of the update; a step where more than this fraction of
    its rollouts are such takes no optimizer step (`update/skipped`). A step also counts as failing when
    more than this fraction of its searches fail (the terminal warns on every step with a failed search)."""
    max_failed_steps: int = 3
    """Stop the run, with a checkpoint (never newer than the last healthy update) and a message naming the
    retriever, its last error and the time spent, after this many consecutive failing steps (0: never stop)."""

    def validate(self, p: str) -> None:
        check_choices(self, p)
        if self.topk < 1:
            _fail(f"{p}.topk", self.topk, "at least one passage per search is needed", "use 3 (Search-R1)")
        if self.step_budget_s is not None and self.step_budget_s <= 0:
            _fail(f"{p}.step_budget_s", self.step_budget_s, "must be positive or null", "use e.g. 120, or null for no budget")
        if not 0 <= self.max_failed_fraction < 1:
            _fail(f"{p}.max_failed_fraction", self.max_failed_fraction, "must lie in [0, 1)", "use 0.5")
        if self.max_failed_steps < 0:
            _fail(f"{p}.max_failed_steps", self.max_failed_steps, "must be >= 0", "use 3, or 0 to never stop")


@dataclass
class AlgoConfig:
    """The algorithm: a preset (`name`) whose parts `advantage`, `policy_loss`, `ratio_level`, `normalizer`
    and `critic` can each be replaced; see stratarl.algos.presets and stratarl.trainer.algorithm."""

    name: str = "stratified_grpo"
    """The preset: grpo, stratified_grpo, ppo, so_ppo, so_grpo, drgrpo or gspo (stratarl.algos.presets.PRESETS)."""
    advantage: str | None = None
    """Advantage estimator, a registered name (grpo, drgrpo, stratified, gae, or one a `--import`ed module
    registers); null: the preset's."""
    advantage_params: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the estimator (checked against its signature), e.g. `{std_ddof: 0}`; they win over
    the shared knobs alpha, epsilon, gamma, lam."""
    policy_loss: str | None = None
    """Policy loss, a registered name (ppo, sorl, ...); null: the preset's."""
    policy_loss_params: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the policy loss, e.g. `{dual_clip: 3.0}` (dual clip, Ye et al. 2020); they win over
    clip_low / clip_high. The ratio level and aggregation are `ratio_level` and `loss_agg`."""
    ratio_level: Literal["token", "turn", "sequence"] | None = None
    """Importance ratio per token, per turn (SORL) or per rollout (GSPO); null: the preset's (or turn_level_ratio)."""
    normalizer: str | None = None
    """Gradient normaliser: `none` or a registered name (`sorl`: g / max(||C||, delta)); null: the preset's
    (or sorl_normalize)."""
    normalizer_params: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the normaliser; they win over sorl_delta, sorl_delta_rule, sorl_delta_ema."""
    critic: str | None = None
    """`none` or `value_head` (a value head on the policy's hidden states; GAE needs it); null: the preset's."""
    alpha: float = 0.6
    """Stratified GRPO blend: alpha * SAN + (1 - alpha) * GN (0 = GRPO, 1 = pure SAN; paper: 0.6)."""
    stratum_key: str = "num_searches"
    """How rollouts are stratified: `num_searches` (paper: the retriever calls run), `observation_blocks` (the
    observation blocks between policy turns, from the response mask alone: the veRL plugin's definition, which
    also counts invalid-action feedback and misses a trailing observation), `answered`, `random` (control: the num_searches strata's sizes kept inside each group, rollouts assigned to them by a seeded random permutation), or `module:function` taking a Rollout and returning a hashable key."""
    stratum_cap: int | None = None
    """With num_searches / observation_blocks: counts >= cap share one stratum (None: no cap)."""
    epsilon: float = 1e-6
    """Advantage normaliser epsilon (the GRPO baseline's)."""
    clip_low: float = 0.2
    """Lower clip range: ratios below 1 - clip_low are clipped."""
    clip_high: float = 0.2
    """Upper clip range: ratios above 1 + clip_high are clipped."""
    loss_agg: Literal[LOSS_AGGREGATIONS] = "token-mean"
    """Loss aggregation of every term: token-mean (Search-R1), seq-mean-token-mean, seq-mean-token-sum, or
    seq-mean-token-sum-norm (Dr.GRPO: each rollout's token sum over one constant L = rollout.max_total_tokens)."""
    turn_level_ratio: bool | None = None
    """Use SORL's turn-level importance ratio (true: ratio_level turn, false: token); None: the preset's
    (on for so_ppo / so_grpo)."""
    sorl_normalize: bool | None = None
    """SORL's clipping-triggered normalisation g / max(||C||, delta) (true: normalizer sorl, false: none); None: the
    preset's, on for so_ppo / so_grpo (true on grpo / ppo gives the "normalisation only" ablation, false on so_* the "turn-level ratio only" one)."""
    sorl_delta: float = 1.0
    """SORL normalisation floor delta: g <- g / max(||C||, delta) (rule `fixed`); with rule `running_pg`
    the multiple of the running policy-gradient norm at which the normalisation engages."""
    sorl_delta_rule: Literal[SORL_DELTA_RULES] = "fixed"
    """`fixed` (the paper's formula; delta 1 reads delta as a gradient-norm threshold, a small delta as a floor
    that divides every step by ||C||; docs/training.md) or `running_pg` (scale-free: delta_t = delta x the moving
    average of ||grad J_PPO|| over previous optimizer steps, and g <- g * min(1, delta_t / ||C||))."""
    sorl_delta_ema: float = 0.9
    """Moving-average coefficient of the `running_pg` rule's statistic."""
    sorl_order: Literal[SORL_ORDERS] = "before_clip"
    """Where the SORL factor is applied: `before_clip` (then gradient-norm clipping, optim.grad_clip, can undo it
    unless ||C|| > max(delta, ||grad||)) or `after_clip` (clip first, so the factor always reaches the optimizer)."""
    kl_coef: float = 0.001
    """Reference-model KL coefficient (k3 estimator); 0 disables the reference model entirely."""
    kl_estimator: Literal[KL_ESTIMATORS] = "k3"
    """KL estimator: k1, k2 or k3."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient (loss -= coef * entropy)."""
    gamma: float = 1.0
    """GAE discount (PPO family; Search-R1: 1)."""
    lam: float = 1.0
    """GAE lambda (PPO family; Search-R1: 1)."""
    value_clip: float = 0.2
    """Clipped value loss range (PPO family)."""
    critic_lr: float = 1e-5
    """Learning rate of the value head (PPO family; Search-R1: 1e-5)."""
    critic_detach: bool = True
    """Value head reads detached policy hidden states (a cheap critic that never disturbs the policy)."""
    old_logprobs: Literal["recompute", "rollout"] = "recompute"
    """Behaviour log-probs: `recompute` (a trainer forward pass, as veRL) or `rollout` (the sampler's own; saves a forward pass)."""
    reward: str = "em"
    """Outcome reward: em (Search-R1), subem, f1, multiple_choice, or `package.module:function` taking
    (response_text, golds). Multiple-choice data sources (medqa, medmcqa, synthetic_mc) always use
    multiple_choice (the letter or the option text), as Search-R1 picks its scorer by data_source."""

    def validate(self, p: str) -> None:
        check_choices(self, p)
        resolve_algorithm(self, p)
        if not 0.0 <= self.alpha <= 1.0:
            _fail(f"{p}.alpha", self.alpha, "the blend weight must lie in [0, 1]", "use 0.6 (paper)")
        if self.stratum_key not in STRATUM_KEYS and ":" not in self.stratum_key:
            close = difflib.get_close_matches(self.stratum_key, STRATUM_KEYS, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            _fail(f"{p}.stratum_key", self.stratum_key, "unknown stratum key",
                  f"{hint}use num_searches, observation_blocks, answered, random, or `package.module:function`")
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
        if self.reward not in ("em", "subem", "f1", "multiple_choice") and ":" not in self.reward:
            _fail(f"{p}.reward", self.reward, "unknown reward",
                  "use em, subem, f1, multiple_choice or `package.module:function`")
        if self.epsilon < 0:
            _fail(f"{p}.epsilon", self.epsilon, "must be >= 0", "use 1e-6")
        if self.critic_lr <= 0:
            _fail(f"{p}.critic_lr", self.critic_lr, "the critic's learning rate must be positive", "use 1e-5 (Search-R1)")
        if self.value_clip <= 0:
            _fail(f"{p}.value_clip", self.value_clip, "the value clip range must be positive", "use 0.2")
        if self.entropy_coef < 0:
            _fail(f"{p}.entropy_coef", self.entropy_coef, "a negative bonus would penalise entropy", "use 0.0 or e.g. 0.001")
        if not (0 <= self.gamma <= 1 and 0 <= self.lam <= 1):
            _fail(f"{p}.gamma/lam", (self.gamma, self.lam), "must lie in [0, 1]", "use 1.0 (Search-R1)")

    @property
    def spec(self) -> AlgorithmSpec:
        """The resolved parts and their complete parameters (what the trainer passes to each part)."""
        return resolve_algorithm(self)

    @property
    def uses_critic(self) -> bool:
        return self.spec.uses_critic

    @property
    def use_turn_ratio(self) -> bool:
        return self.spec.ratio_level == "turn"

    @property
    def use_sorl_normalize(self) -> bool:
        return self.spec.uses_normalizer


@dataclass
class OptimConfig:
    lr: float = 1e-6
    """Policy learning rate (Search-R1: 1e-6 for 3B models; small models on CPU like 1e-5..1e-4)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up, in optimizer steps."""
    schedule: Literal["constant", "cosine"] = "constant"
    """After warm-up: constant or cosine (to 10% of lr at the last optimizer step)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 disables)."""
    name: Literal[OPTIMIZERS] = "adamw"
    """Policy optimizer: `adamw`, or `sgd` (a control: SGD, unlike Adam, is not invariant to a constant
    gradient scale; it needs a much larger lr)."""
    momentum: float = 0.0
    """SGD momentum (optim.name = sgd)."""

    def validate(self, p: str) -> None:
        check_choices(self, p)
        if self.lr <= 0:
            _fail(f"{p}.lr", self.lr, "the learning rate must be positive", "use e.g. 1e-6 (3B) or 1e-5 (135M)")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            _fail(f"{p}.betas", self.betas, "need two values in [0, 1)", "use [0.9, 0.999]")
        if self.weight_decay < 0:
            _fail(f"{p}.weight_decay", self.weight_decay, "must be >= 0", "use 0.0 or e.g. 0.01")
        if self.warmup_steps < 0:
            _fail(f"{p}.warmup_steps", self.warmup_steps, "must be >= 0", "use 0 or a few steps")
        if self.grad_clip < 0:
            _fail(f"{p}.grad_clip", self.grad_clip, "must be >= 0", "use 1.0, or 0 to disable")
        if not 0 <= self.momentum < 1:
            _fail(f"{p}.momentum", self.momentum, "must lie in [0, 1)", "use 0 or 0.9")


@dataclass
class TrainerConfig:
    steps: int = 100
    """RL steps; each draws `prompts_per_step` prompts and makes group_size rollouts of each."""
    prompts_per_step: int = 8
    """Prompts per rollout batch."""
    epochs: int = 1
    """K: passes over each rollout batch (off-policy degree is epochs x mini_batches optimizer steps)."""
    mini_batches: int = 1
    """M: optimizer steps per pass; only the very first step of a batch is on-policy."""
    micro_batch_tokens: int = 4096
    """Token budget (rows x padded length) of one forward/backward; gradients accumulate over micro-batches."""
    logprob_chunk_tokens: int = 1024
    """Response tokens per chunk of the selective log-softmax (bounds the [tokens x vocab] buffer)."""
    prefix_from_rollouts: bool = True
    """With frozen lower layers (`model.trainable_layers`), the update's frozen prefix is the hidden states the
    fast decoder kept while sampling, not a second pass over the frozen layers (falls back to that pass,
    `perf/prefix_from_rollouts` 0, when they do not cover the batch). false: always the second pass."""
    seed: int = 0
    """Seeds data order, rollout sampling and initialisation."""
    output_dir: str = "runs"
    """Runs are written to `<output_dir>/<run_name>`."""
    run_name: str | None = None
    """Default: `<algo>-<timestamp>`."""
    save_every: int = 0
    """Checkpoint every N steps (0: only at the end and on Ctrl-C)."""
    keep_last: int = 2
    """Keep the last k checkpoints."""
    eval_every: int = 0
    """Evaluate every N steps (0: only before and after training when eval.before_after)."""
    num_threads: int = 0
    """torch intra-op threads; 0 = os.cpu_count()."""
    device: str = "cpu"
    """cpu, cuda or cuda:N. On CUDA the policy, value head, reference model and batches live on the GPU;
    retrieval stays on the CPU; the `kv_cache` backend uses the generic KV-cache loop (docs/training.md, One GPU)."""
    precision: Literal["auto", "fp32", "bf16", "bf16_native"] = "auto"
    """Forward passes in fp32, or in bf16 (fp32 master weights, optimizer state and log-probs);
    `auto`: bf16 on a CUDA GPU that supports it, fp32 on a CPU; `bf16_native`: bf16 wherever the device has
    bf16 matmul units (a CUDA GPU with bf16, a CPU with AVX512-BF16 or AMX), else fp32
    (stratarl.trainer.precision). No fp16: it would need loss scaling."""

    def validate(self, p: str) -> None:
        check_choices(self, p)
        for key in ("steps", "prompts_per_step", "epochs", "mini_batches", "micro_batch_tokens", "logprob_chunk_tokens", "keep_last"):
            if getattr(self, key) < 1:
                _fail(f"{p}.{key}", getattr(self, key), "must be at least 1", "use a positive integer")
        for key in ("save_every", "eval_every", "num_threads"):
            if getattr(self, key) < 0:
                _fail(f"{p}.{key}", getattr(self, key), "must be >= 0", "use 0 to disable")
        if not (self.device == "cpu" or re.fullmatch(r"cuda(:\d+)?", self.device)):
            _fail(f"{p}.device", self.device, "unknown device", "use cpu, cuda or cuda:N (e.g. cuda:0)")


@dataclass
class SFTConfig:
    enabled: bool = False
    """`stratarl train` first runs the warm-start stage (unless model.init_from is set or the run resumes)."""
    num_demos: int = 256
    """Demonstration trajectories rendered from the synthetic KB's training questions."""
    epochs: int = 1
    """Passes over the demonstrations."""
    lr: float = 1e-4
    """SFT learning rate (AdamW, linear warm-up over 5%, then `schedule`)."""
    schedule: Literal["constant", "cosine"] = "constant"
    """After warm-up: constant, or cosine (decays to 10% of lr at the last step; better for short runs)."""
    batch_size: int = 8
    """Demonstrations per optimizer step."""
    no_search_fraction: float = 0.2
    """Fraction of demonstrations that answer straight away without searching (imperfect on purpose)."""
    wrong_hop_fraction: float = 0.1
    """Fraction of multi-hop demonstrations whose last hop searches with a wrong query (imperfect on purpose)."""
    early_answer_fraction: float = 0.0
    """Fraction of multi-hop demonstrations that stop after their first search and answer what it found
    (the first hop's answer): a deliberately weak search policy that RL can improve by searching more."""
    seed: int = 0
    """Seeds demonstration choice and order, and the initial weights of a from-scratch model."""
    source: Literal["task", "worlds"] = "task"
    """Where demonstrations come from. `task`: the task's own training questions (`num_demos`, `epochs`).
    `worlds`: a stream of freshly generated synthetic worlds drawn from the task's shared name pool
    (data.synthetic.options.name_pool), none of them the task's own world, so no fact repeats and the
    policy must learn to copy names from the passages it reads (`steps` x `batch_size` demos; docs/lab.md)."""
    steps: int = 0
    """`source: worlds`: optimizer steps (each on `batch_size` demonstrations never seen before)."""
    world_options: dict[str, Any] = field(default_factory=dict)
    """`source: worlds`: generator options of the demonstration worlds, layered over data.synthetic.options
    (e.g. `{size: 300, num_train: 150}`: small worlds are cheap to generate and index)."""
    reading_steps: int = 0
    """`source: worlds`: copy pre-training steps before the trajectories: an observation of a fresh world
    followed by every question about its first passage, loss on the answers only (docs/lab.md)."""
    reading_curriculum: int = 0
    """The first N reading steps shorten the observation to the sentence holding the answer, with
    probability 1 - step / N (a short context first: the tiny model finds what to copy sooner)."""
    reading_batch_size: int = 32
    """Reading examples per optimizer step."""
    reading_agent_fraction: float = 0.0
    """Share of reading examples laid out as the agent sees them: the question in the prompt, a search of
    it, the observation, the answer turn (``render_reading_examples``); the rest ask after the observation."""
    reading_mix: int = 0
    """`source: worlds`: reading examples (full observations, from worlds of their own) added to every
    demonstration batch, so the demonstrations do not erase the copying the reading stage taught."""
    observation_loss: float = 0.0
    """Weight of the next-token loss on observation (retrieved passage) tokens, relative to policy tokens.
    Passages repeat names (title, subject, relations), so this trains copying; the policy never emits them."""
    probe_every: int = 0
    """`source: worlds`: the reading probe (stratarl.trainer.probe): greedy rollouts on single-hop and 2-hop
    questions of a world never trained on. 0: off (the warm start ends after `steps`). N > 0: probe after
    `steps`, and if single-hop EM is below `probe_min_em`, train N more steps and probe again, up to
    `max_steps`; a warm start that never passes stops the run with an error (it is not cached)."""
    probe_min_em: float = 0.6
    """Greedy single-hop EM on the probe world that the warm start must reach."""
    probe_questions: int = 40
    """Probe questions of each kind (single-hop, 2-hop)."""
    max_steps: int = 0
    """With the probe: the most demonstration steps before giving up (0: 3 x `steps`)."""
    cache: bool = False
    """Keep the warm start in `$STRATARL_CACHE/warmstart/<hash of what it depends on>` and reuse it in every
    run with the same model, data, retrieval, rollout caps and sft settings (seeds of RL runs share it);
    `stratarl sft CONFIG --rebuild` rebuilds it."""

    @property
    def step_limit(self) -> int:
        """The most demonstration steps with the probe: `max_steps`, or 3 x `steps` when it is 0."""
        return self.max_steps or 3 * self.steps

    def validate(self, p: str) -> None:
        check_choices(self, p)
        for key in ("num_demos", "epochs", "batch_size"):
            if getattr(self, key) < 1:
                _fail(f"{p}.{key}", getattr(self, key), "must be at least 1", "use a positive integer")
        if self.lr <= 0 or self.lr != self.lr or self.lr == float("inf"):
            _fail(f"{p}.lr", self.lr, "must be a positive finite number", "use 1e-4")
        for key in ("no_search_fraction", "wrong_hop_fraction", "early_answer_fraction"):
            if not 0 <= getattr(self, key) <= 1:
                _fail(f"{p}.{key}", getattr(self, key), "a fraction must lie in [0, 1]", "use e.g. 0.1")
        total = self.no_search_fraction + self.wrong_hop_fraction + self.early_answer_fraction
        if total > 1:
            _fail(f"{p}.early_answer_fraction", self.early_answer_fraction,
                  f"no_search + wrong_hop + early_answer fractions sum to {total:g} > 1", "lower them")
        if self.steps < 0:
            _fail(f"{p}.steps", self.steps, "must be >= 0", "use e.g. 1000")
        if self.source == "worlds" and self.steps < 1:
            _fail(f"{p}.steps", self.steps, "sft.source=worlds trains for `steps` optimizer steps", "set e.g. sft.steps=1000")
        if self.reading_steps < 0 or self.reading_curriculum < 0 or self.reading_batch_size < 1:
            _fail(f"{p}.reading_steps", (self.reading_steps, self.reading_curriculum, self.reading_batch_size),
                  "reading_steps and reading_curriculum must be >= 0, reading_batch_size >= 1", "use e.g. 1000, 800, 32")
        if not 0 <= self.reading_agent_fraction <= 1:
            _fail(f"{p}.reading_agent_fraction", self.reading_agent_fraction, "a fraction must lie in [0, 1]",
                  "use e.g. 0.5")
        if self.reading_mix < 0:
            _fail(f"{p}.reading_mix", self.reading_mix, "must be >= 0", "use 0 (off) or e.g. 8")
        if self.reading_mix and self.source != "worlds":
            _fail(f"{p}.reading_mix", self.reading_mix, "rehearsal draws fresh worlds",
                  "set sft.source=worlds or sft.reading_mix=0")
        if self.reading_steps and self.source != "worlds":
            _fail(f"{p}.reading_steps", self.reading_steps, "reading pre-training draws fresh worlds",
                  "set sft.source=worlds or sft.reading_steps=0")
        if self.observation_loss < 0:
            _fail(f"{p}.observation_loss", self.observation_loss, "must be >= 0", "use 0 (policy tokens only) or e.g. 0.5")
        if self.probe_every < 0 or self.max_steps < 0 or self.probe_questions < 1:
            _fail(f"{p}.probe_every", (self.probe_every, self.max_steps, self.probe_questions),
                  "probe_every and max_steps must be >= 0, probe_questions >= 1", "use e.g. 20, 0, 40")
        if self.probe_every and self.source != "worlds":
            _fail(f"{p}.probe_every", self.probe_every, "the reading probe draws an unseen world",
                  "set sft.source=worlds or sft.probe_every=0")
        if not 0 <= self.probe_min_em <= 1:
            _fail(f"{p}.probe_min_em", self.probe_min_em, "an EM threshold lies in [0, 1]", "use e.g. 0.6")
        if self.max_steps and self.max_steps < self.steps:
            _fail(f"{p}.max_steps", self.max_steps, f"is below sft.steps={self.steps}", "use 0 (3 x steps) or raise it")


@dataclass
class EvalConfig:
    before_after: bool = True
    """`stratarl train` evaluates the held-out set before the first and after the last step."""
    num_transcripts: int = 4
    """Rollout transcripts saved per eval (prompt, turns, queries, passages, answer, reward, stratum)."""
    batch_size: int = 32
    """Questions per generation batch."""

    def validate(self, p: str) -> None:
        check_choices(self, p)
        if self.num_transcripts < 0 or self.batch_size < 1:
            _fail(f"{p}", (self.num_transcripts, self.batch_size), "num_transcripts >= 0 and batch_size >= 1", "use 4 and 32")


@dataclass
class LoggingConfig:
    tensorboard: bool = True
    """Write TensorBoard event files to `<run>/tensorboard`."""
    wandb: bool = False
    """Also log to Weights & Biases (needs `pip install wandb`)."""
    wandb_project: str = "stratarl"
    """W&B project name."""
    progress: bool = True
    """Progress bars per phase on the terminal."""
    num_transcripts: int = 2
    """Training rollout transcripts saved per step."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    retrieval: RetrievalConfig = field(default_factory=RetrievalConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def validate(self) -> Config:
        for f in dataclasses.fields(self):
            sub = getattr(self, f.name)
            if hasattr(sub, "validate"):
                sub.validate(f.name)
        self._check_across_sections()
        if self.sft.source == "worlds":
            if self.data.source != "synthetic":
                _fail("sft.source", "worlds", "demonstration worlds are synthetic knowledge bases",
                      "use data.source=synthetic, or sft.source=task")
            # A word-level vocabulary is built from the task: only a shared pool lets it spell other worlds'
            # names. A subword tokenizer spells any invented name, so every world may invent its own.
            if (self.model.name == "word-tiny" and not self.model.init_from
                    and not {**self.data.synthetic.options, **self.sft.world_options}.get("name_pool")):
                _fail("data.synthetic.options.name_pool", None,
                      "sft.source=worlds with model.name=word-tiny needs a shared name pool (otherwise every "
                      "world invents words that the task's vocabulary does not know)",
                      "set e.g. data.synthetic.options.name_pool=2000")
        return self

    def _check_across_sections(self) -> None:
        if self.rollout.greedy:
            _fail("rollout.greedy", True, "training rollouts sample (eval is always greedy)",
                  "drop rollout.greedy, or lower rollout.temperature")
        rollouts = self.trainer.prompts_per_step * self.rollout.group_size
        if self.trainer.mini_batches > rollouts:
            _fail("trainer.mini_batches", self.trainer.mini_batches,
                  f"a step has only prompts_per_step x group_size = {self.trainer.prompts_per_step} x "
                  f"{self.rollout.group_size} = {rollouts} rollouts to cut into mini-batches",
                  f"use trainer.mini_batches <= {rollouts}, or raise trainer.prompts_per_step / rollout.group_size")
        spec = self.algo.spec
        if self.rollout.group_size < 2 and advantage_info(spec.advantage).group_relative:
            _fail("rollout.group_size", self.rollout.group_size,
                  f"advantage estimator {spec.advantage!r} compares the rollouts of one prompt, so a group of one "
                  "rollout gets advantage 0 and the policy never moves",
                  "use rollout.group_size >= 2 (Search-R1: 5), or an estimator with a critic (algo.name=ppo)")

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data["rollout"].pop("topk")  # retrieval.topk is the one place for it (see config_from_dict)
        return data


# --------------------------------------------------------------------------- loading


def config_from_dict(data: dict, overrides: list[str] | None = None) -> Config:
    """Build and validate a Config from a (YAML-shaped) dict plus dotted overrides."""
    if not isinstance(data, dict):
        raise ConfigError(f"a config must be a mapping of sections, got {type(data).__name__}. Fix: start the file with e.g. `trainer:`.")
    data = apply_overrides(data, overrides or [])
    rollout = data.get("rollout")
    if isinstance(rollout, dict) and "topk" in rollout:
        raise ConfigError(f"config field `rollout.topk` = {rollout['topk']!r}: passages per search are set once, in "
                          "`retrieval.topk`. Fix: write retrieval.topk instead.")
    cfg = build(Config, data).validate()
    cfg.rollout = cfg.rollout.replace(topk=cfg.retrieval.topk)
    return cfg


class _DuplicateKey(yaml.YAMLError):
    pass


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (plain YAML keeps the last silently)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                first = seen.setdefault(key, key_node.start_mark.line + 1)
            except TypeError:  # an unhashable key: let SafeLoader report it
                continue
            if first != key_node.start_mark.line + 1:
                raise _DuplicateKey(f"key `{key}` appears twice (lines {first} and {key_node.start_mark.line + 1}); "
                                    "the second would silently replace the first. Fix: merge them into one")
        return super().construct_mapping(node, deep=deep)


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """Load a YAML config file (or the defaults when ``path`` is None), apply overrides, validate."""
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} not found. Fix: pass a path such as configs/demo.yaml.")
        try:
            data = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader) or {}
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {str(path)!r} is not UTF-8 text (byte {e.start} cannot be decoded). "
                              "Fix: pass a YAML config such as configs/demo.yaml.") from None
        except _DuplicateKey as e:
            raise ConfigError(f"config file {str(path)!r}: {e}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {str(path)!r} is not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {str(path)!r} must be a mapping of sections. Fix: start it with e.g. `trainer:`.")
    try:
        return config_from_dict(data, overrides)
    except ConfigError as e:
        where = f" (in {path})" if path is not None else ""
        raise ConfigError(f"{e}{where}") from None


def save_config(config: Config, path: str | Path) -> None:
    """Write the resolved config as YAML (loadable by `load_config`)."""
    Path(path).write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
