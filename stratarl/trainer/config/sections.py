"""The config tree's sections other than ``algo`` and ``sft``: model, data, retrieval, optimizer, trainer, eval,
logging (the ``rollout`` section is stratarl.rollout.config.RolloutConfig). Each field has its doc; each
section validates itself and names the field path in its errors."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from stratarl.config_errors import fail as _fail
from stratarl.config_tree import check_choices
from stratarl.infra.precision import PrecisionSetting

Optimizer = Literal["adamw", "sgd"]
OPTIMIZERS: tuple[Optimizer, ...] = get_args(Optimizer)


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
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj", "gate_proj"]
    )
    """Module names that get adapters."""

    def validate(self, p: str) -> None:
        check_choices(self, p)
        if self.r < 1:
            _fail(f"{p}.r", self.r, "the LoRA rank must be at least 1", "use e.g. 8 or 16")
        if self.dropout != 0.0:
            _fail(
                f"{p}.dropout",
                self.dropout,
                "the behaviour log-probs are computed without dropout (eval mode) and the "
                "update with it (train mode), so the ratios of the first, on-policy step would not be 1",
                "use 0.0 (regularise with optim.weight_decay instead)",
            )
        if not self.target_modules:
            _fail(
                f"{p}.target_modules",
                self.target_modules,
                "no module would get an adapter",
                "list e.g. [q_proj, v_proj]",
            )


@dataclass
class ModelConfig:
    name: str = "smollm2-135m-instruct"
    """Bundled alias (smollm2-135m-instruct), local folder, hub id, `tiny-random` (random Llama over the SmolLM2 tokenizer, for tests), or `word-tiny` (random Llama over a word-level vocabulary built from the task's corpus and questions; sizes from tiny_*; see docs/wordlevel.md)."""
    init_from: str | None = None
    """A model folder (safetensors) to start from instead of `name`'s weights, e.g. an `stratarl sft` output (`<run>/sft/model`)."""
    tokenizer: str | None = None
    """Tokenizer to load; default: the same as `name` (SmolLM2's for `tiny-random`)."""
    word_vocabulary: str | None = None
    """A closed word list (one word a line), e.g. the `vocabulary.txt` that `stratarl data phantomwiki` writes
    (every word PhantomWiki's generator can produce). `word-tiny` then builds its vocabulary from the protocol's
    texts and this list only, never from the run's corpus and questions, so every universe and seed gets the same
    vocabulary. Set-up checks that the run's corpus and questions hold no word outside the policy's vocabulary
    (with `init_from` too: the loaded tokenizer is checked) and fails naming the file. Default: the vocabulary of
    the task's own corpus and questions (docs/wordlevel.md)."""
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
            _fail(
                f"{p}.tiny_hidden_size",
                self.tiny_hidden_size,
                f"must be divisible by tiny_num_heads={self.tiny_num_heads}",
                "pick a multiple of the head count",
            )
        if self.trainable_layers < 0:
            _fail(f"{p}.trainable_layers", self.trainable_layers, "must be >= 0", "use 0 to train all layers")
        if self.init_from is not None and not Path(self.init_from).exists():
            _fail(
                f"{p}.init_from",
                self.init_from,
                "no such folder",
                "run `stratarl sft` first or point at an existing model folder",
            )
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
    """Training question files (parquet, jsonl or json; rows in a registered dataset format: Search-R1 and its
    veRL / SkyRL variants, MedQA, MedMCQA, or one a `--import`ed module registers)."""
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
            _fail(
                f"{p}.train_files",
                self.train_files,
                "`data.source: files` needs training files",
                "list parquet/jsonl paths, or set data.source=synthetic",
            )
        for key in ("train_files", "test_files"):
            for f in getattr(self, key):
                if not Path(f).exists():
                    _fail(
                        f"{p}.{key}",
                        f,
                        "file not found",
                        "check the path (relative paths start at the current directory)",
                    )
        for key in ("max_train_examples", "max_eval_examples"):
            v = getattr(self, key)
            if v is not None and v < 1:
                _fail(f"{p}.{key}", v, "must be positive or null", "use null for all examples")


@dataclass
class RetrievalConfig:
    spec: Any = "bm25"
    """What `stratarl.retrieval.build_retriever` gets: `bm25` (index built and cached from the corpus), an index folder, a URL of a `/retrieve` server, or a dict (`{kind: NAME, ...}`: bm25, dense, remote, or a kind a `--import`ed module registers with `register_retriever`)."""
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
            _fail(
                f"{p}.step_budget_s",
                self.step_budget_s,
                "must be positive or null",
                "use e.g. 120, or null for no budget",
            )
        if not 0 <= self.max_failed_fraction < 1:
            _fail(f"{p}.max_failed_fraction", self.max_failed_fraction, "must lie in [0, 1)", "use 0.5")
        if self.max_failed_steps < 0:
            _fail(f"{p}.max_failed_steps", self.max_failed_steps, "must be >= 0", "use 3, or 0 to never stop")


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
    name: Optimizer = "adamw"
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
    policy_lag: int = 0
    """k: the batch trained at RL step s is sampled with the weights of step s - k (stale weights, as in an
    asynchronous pipeline; the first k steps use the oldest weights there are). 0: on-policy sampling, today's
    loop. Keeps k + 1 copies of the trainable parameters, saved in checkpoints (docs/training.md)."""
    policy_lag_mode: Literal["fixed", "uniform"] = "fixed"
    """`fixed`: every batch lags by k; `uniform`: each batch's lag is drawn from 0..k (bounded staleness, as
    AReaL's max_head_offpolicyness), seeded by trainer.seed and the step."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: drop the prompt groups whose raw outcome (the answer score before any shaping,
    algo.reward) is the same for every rollout, and collect more prompts to refill the batch, at most
    `dynamic_sampling_attempts` collections per step; when they run out, the step trains on the groups it kept
    (`dynsample/short` 1; no update when it kept none). docs/training.md, Dynamic sampling."""
    dynamic_sampling_attempts: int = 4
    """Most collections of one step with dynamic sampling, the first included (>= 1)."""
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
    precision: PrecisionSetting = "auto"
    """Forward passes in fp32, or in bf16 (fp32 master weights, optimizer state and log-probs);
    `auto`: bf16 on a CUDA GPU that supports it, fp32 on a CPU; `bf16_native`: bf16 wherever the device has
    bf16 matmul units (a CUDA GPU with bf16, a CPU with AVX512-BF16 or AMX), else fp32
    (stratarl.infra.precision). No fp16: it would need loss scaling."""

    def validate(self, p: str) -> None:
        check_choices(self, p)
        for key in (
            "steps",
            "prompts_per_step",
            "epochs",
            "mini_batches",
            "micro_batch_tokens",
            "logprob_chunk_tokens",
            "keep_last",
            "dynamic_sampling_attempts",
        ):
            if getattr(self, key) < 1:
                _fail(f"{p}.{key}", getattr(self, key), "must be at least 1", "use a positive integer")
        if self.policy_lag < 0:
            _fail(
                f"{p}.policy_lag",
                self.policy_lag,
                "a lag counts steps behind the learner, so it cannot be negative",
                "use 0 (on-policy) or e.g. 2, 8",
            )
        for key in ("save_every", "eval_every", "num_threads"):
            if getattr(self, key) < 0:
                _fail(f"{p}.{key}", getattr(self, key), "must be >= 0", "use 0 to disable")
        if not (self.device == "cpu" or re.fullmatch(r"cuda(:\d+)?", self.device)):
            _fail(f"{p}.device", self.device, "unknown device", "use cpu, cuda or cuda:N (e.g. cuda:0)")


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
            _fail(
                f"{p}",
                (self.num_transcripts, self.batch_size),
                "num_transcripts >= 0 and batch_size >= 1",
                "use 4 and 32",
            )


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
