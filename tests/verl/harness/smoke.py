"""Run veRL's own trainer (``verl.trainer.main_ppo``) with stratarl's plugins on a CPU, end to end.

    PYTHONPATH=tests/verl python -m harness.smoke --workdir /tmp/verl-smoke [--steps 2] [hydra overrides…]

Builds everything offline in ``--workdir``: a word-level tokenizer with a chat template, a one-layer
Llama whose weights are set by hand to a bigram model (after ``assistant`` it writes
``<answer> Paris </answer>`` or ``<answer> Rome </answer>`` with equal odds, then ends), and one
capital-city question in two wordings in veRL's RL-dataset format. About half the rollouts earn
stratarl's exact-match reward, so groups have reward variance and the update is not zero.

Then it starts ``python -m verl.trainer.main_ppo`` in Ray local mode, on veRL's default v1 trainer
(``--trainer v1``: ``trainer.use_v1=true``, ``PPOTrainerSync`` over TransferQueue) or the legacy
``RayPPOTrainer`` (``--trainer legacy``: ``trainer.use_v1=false``), with

- ``algorithm.adv_estimator=stratified_grpo`` and ``actor.policy_loss.loss_mode=sorl``,
- ``actor_rollout_ref.rollout.name=hf`` (single turn) and ``actor.strategy=fsdp2`` on one CPU
  process, two mini-batches per step (lr 0.01, clip range 0.001: the second, off-policy one clips,
  so SORL's ‖C‖ > 0),
- the plugins loaded only through ``VERL_USE_EXTERNAL_MODULES``, in the driver and (through
  ``ray_kwargs.ray_init.runtime_env.env_vars``) in every Ray worker, with ``VERL_PLATFORM=stratarl_cpu``.

It writes veRL's console log to ``<workdir>/main_ppo.log`` and the rollouts of each step to
``<workdir>/rollouts/``. Exit status: main_ppo's. Takes about two minutes on two cores. Before starting
it checks that every veRL hook the plugins rely on is where veRL 0.9.1 has it (:mod:`.compat`), and
exits with one line naming the installed version and the moved hooks otherwise.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from stratarl.integrations.verl import compat
from stratarl.integrations.verl import reward as plugin_reward

# Two wordings of one question, so both groups of a batch prefer the same answer: the first
# mini-batch's update then moves the second one's turns past the clip bound (SORL's C ≠ 0).
QUESTIONS = [("What is", "Paris"), ("Which city is", "Paris")] * 2
ANSWERS = ["Paris", "Rome"]
SPECIAL = ["<|pad|>", "<|im_end|>", "<|im_start|>", "[UNK]"]
WORDS = [
    "system",
    "user",
    "assistant",
    "<answer>",
    "</answer>",
    *ANSWERS,
    "Question:",
    "What",
    "Which",
    "city",
    "is",
    "the",
    "capital",
    "of",
    "France",
    "?",
]
# Single-turn rollouts have no searches, so every group is one stratum and Stratified GRPO's numbers
# equal GRPO's at any α; a large ε (read only by stratarl's estimator) makes its use visible in
# veRL's critic/advantages/* metrics: a [1, 1, 1, 0] group gets 0.25/1.5, not veRL's 0.25/0.5.
STRATIFIED_EPS = 1.0
# δ below the ‖C‖ of an off-policy mini-batch, so SORL's scale 1/max(‖C‖, δ) acts (≠ 1).
SORL_DELTA = 0.01
PLUGINS = "stratarl.integrations.verl,harness.verl_cpu"
# The CPU harness alone (platform, FSDP engines for cpu, hf rollout): plain veRL on a CPU, no plugin.
CPU_HARNESS = "harness.verl_cpu"
# veRL's two trainers: v1 (the default since veRL 0.9.0) and the legacy RayPPOTrainer (deprecated).
TRAINERS = ("v1", "legacy")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


def build_tokenizer(folder: Path, words: list[str] | None = None):
    """A word-level tokenizer (whitespace split) over ``words`` (default :data:`WORDS`), ChatML-like template."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers  # start-up cost: the smoke worker only
    from transformers import PreTrainedTokenizerFast  # start-up cost: the smoke worker only

    vocab = {token: i for i, token in enumerate(SPECIAL + list(words or WORDS))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<|pad|>", eos_token="<|im_end|>", unk_token="[UNK]"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    return tokenizer


ANSWER_RULES = {"assistant": ["<answer>"], "<answer>": ANSWERS, **{a: ["</answer>"] for a in ANSWERS}}


def bigram_logits(tokenizer, strength: float = 12.0, rules: dict[str, list[str]] | None = None):
    """Next-token logits [V, V] (row = current token), equal odds among each rule's next tokens.

    Default rules (:data:`ANSWER_RULES`): assistant → <answer> → Paris|Rome → </answer> → eos;
    any token without a rule → eos.
    """
    import torch  # start-up cost: the smoke worker only

    ids = tokenizer.convert_tokens_to_ids
    size = len(tokenizer)
    table = torch.zeros(size, size)
    table[:, ids("<|im_end|>")] = strength  # anything else: stop
    for current, nexts in (rules or ANSWER_RULES).items():
        table[ids(current)] = 0.0
        for token in nexts:
            table[ids(current), ids(token)] = strength
    return table


def build_model(
    folder: Path, seed: int = 0, *, words: list[str] | None = None, rules: dict[str, list[str]] | None = None
) -> Path:
    """Tokenizer + a one-layer Llama that computes :func:`bigram_logits` exactly, saved with safetensors.

    Attention and MLP outputs are zero (``o_proj``, ``down_proj``), so the last hidden state is the
    RMS-normalised embedding of the current token; with one-hot embeddings that is √d·e_i, and an
    untied ``lm_head`` with columns ``table[i] / √d`` gives the bigram logits. Training changes all
    of these weights, so the policy moves away from the bigram model at the first update.
    """
    import torch  # start-up cost: the smoke worker only
    from transformers import LlamaConfig, LlamaForCausalLM  # start-up cost: the smoke worker only

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(folder, words)
    size = len(tokenizer)
    hidden = 8 * ((size + 7) // 8)
    config = LlamaConfig(
        vocab_size=size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(torch.eye(size, hidden))
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        lm_head = torch.zeros(size, hidden)
        lm_head[:, :size] = bigram_logits(tokenizer, rules=rules).T / hidden**0.5
        model.lm_head.weight.copy_(lm_head)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def write_data(folder: Path) -> tuple[Path, Path]:
    """train.parquet (4 rows, 2 batches of 2) and val.parquet (2) in veRL's RL-dataset format (single turn)."""
    import pyarrow as pa  # start-up cost: only when a data file is written
    import pyarrow.parquet as pq  # start-up cost: only when a data file is written

    folder.mkdir(parents=True, exist_ok=True)
    rows = [
        {
            "data_source": "searchR1_nq",
            "prompt": [{"role": "user", "content": f"Question: {opening} the capital of France ?"}],
            "ability": "fact-reasoning",
            "reward_model": {"style": "rule", "ground_truth": {"target": [capital]}},
            "extra_info": {"index": i, "split": "train"},
        }
        for i, (opening, capital) in enumerate(QUESTIONS)
    ]
    train, val = folder / "train.parquet", folder / "val.parquet"
    pq.write_table(pa.Table.from_pylist(rows), train)
    pq.write_table(pa.Table.from_pylist(rows[:2]), val)
    return train, val


def trainer_overrides(trainer: str) -> list[str]:
    """``trainer.use_v1`` and what each trainer needs on a 2-core CPU."""
    if trainer == "v1":
        # veRL's config asks for 8 TransferQueue storage units (a Ray actor of 1 CPU each); one is enough here.
        return ["trainer.use_v1=true", "transfer_queue.backend.SimpleStorage.num_data_storage_units=1"]
    if trainer == "legacy":
        return ["trainer.use_v1=false"]
    raise ValueError(f"trainer must be one of {TRAINERS}, got {trainer!r}")


def main_ppo_overrides(
    workdir: Path, *, steps: int = 2, group_size: int = 4, trainer: str = "v1", n_ranks: int = 1
) -> list[str]:
    """Hydra overrides for veRL's ``ppo_trainer`` config: the CPU smoke run described in the module doc.

    ``n_ranks``: training processes (FSDP2 data-parallel ranks over gloo), one logical GPU each.
    """
    reward = Path(plugin_reward.__file__)  # stratarl's compute_score, loaded by veRL from its path
    env = "+ray_kwargs.ray_init.runtime_env.env_vars"
    return [
        *trainer_overrides(trainer),
        "trainer.device=cpu",
        f"trainer.n_gpus_per_node={n_ranks}",
        "trainer.nnodes=1",
        f"trainer.total_training_steps={steps}",
        "trainer.logger=console",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        f"trainer.default_local_dir={workdir / 'checkpoints'}",
        f"trainer.rollout_data_dir={workdir / 'rollouts'}",
        f"data.train_files={workdir / 'data' / 'train.parquet'}",
        f"data.val_files={workdir / 'data' / 'val.parquet'}",
        "data.train_batch_size=2",
        "data.max_prompt_length=32",
        "data.max_response_length=8",
        "data.dataloader_num_workers=0",
        "data.shuffle=false",
        # Legacy trainer: keep veRL's group order (mini-batch k = prompt group k). The v1 trainer always
        # reorders the batch by sequence length across ranks.
        "trainer.balance_batch=false",
        f"actor_rollout_ref.model.path={workdir / 'model'}",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        "actor_rollout_ref.actor.strategy=fsdp2",
        # torch.compile of veRL's entropy kernel builds C++ with inductor: minutes on a small CPU.
        "actor_rollout_ref.actor.use_torch_compile=false",
        "actor_rollout_ref.actor.fsdp_config.use_torch_compile=false",
        "actor_rollout_ref.actor.ppo_mini_batch_size=1",  # 2 optimizer steps per batch
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.actor.optim.lr=0.01",
        # A tight clip range, so the second (off-policy) mini-batch of a step clips: ‖C‖ > 0.
        "actor_rollout_ref.actor.clip_ratio=0.001",
        "actor_rollout_ref.actor.clip_ratio_low=0.001",
        "actor_rollout_ref.actor.clip_ratio_high=0.001",
        "actor_rollout_ref.actor.use_kl_loss=false",
        "actor_rollout_ref.actor.policy_loss._target_=stratarl.integrations.verl.config.SORLPolicyLossConfig",
        "actor_rollout_ref.actor.policy_loss.loss_mode=sorl",
        f"+actor_rollout_ref.actor.policy_loss.sorl_delta={SORL_DELTA}",
        "actor_rollout_ref.rollout.name=hf",
        f"actor_rollout_ref.rollout.n={group_size}",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        "algorithm._target_=stratarl.integrations.verl.config.StratifiedAlgoConfig",
        "algorithm.adv_estimator=stratified_grpo",
        "+algorithm.stratified_grpo._target_=stratarl.integrations.verl.config.StratifiedGRPOConfig",
        f"+algorithm.stratified_grpo.eps={STRATIFIED_EPS}",
        f"reward.custom_reward_function.path={reward}",
        "reward.custom_reward_function.name=compute_score",
        "reward.num_workers=1",
        # Logical resources: one "GPU" slot = one training process (stratarl_cpu platform); veRL's
        # placement group takes 3 CPUs beside them, the driver, agent/reward loops and (v1) TransferQueue's
        # controller and storage unit one each. Logical counts: the processes share the machine's cores.
        "+ray_kwargs.ray_init.num_cpus=16",
        f"+ray_kwargs.ray_init.num_gpus={n_ranks}",
        f'{env}.VERL_USE_EXTERNAL_MODULES="{PLUGINS}"',
        f"{env}.VERL_PLATFORM=stratarl_cpu",
        f"{env}.PYTHONPATH={pythonpath()}",
    ]


def with_overrides(base: list[str], extra: list[str]) -> list[str]:
    """``base`` Hydra overrides with the keys of ``extra`` replaced (Hydra refuses a key given twice)."""

    def key(item: str) -> str:
        return item.split("=", 1)[0].lstrip("+")

    replaced = {key(item) for item in extra}
    return [item for item in base if key(item) not in replaced] + extra


def pythonpath() -> str:
    """The folders stratarl and this harness are imported from (the checkout, and tests/verl for ``harness``),
    ahead of any PYTHONPATH already set (Ray workers need all of them)."""
    repo = Path(__file__).resolve().parents[3]
    here = f"{repo}{os.pathsep}{repo / 'tests' / 'verl'}"
    current = os.environ.get("PYTHONPATH", "")
    return here if not current else f"{here}{os.pathsep}{current}"


def run(
    workdir: Path, *, steps: int = 2, trainer: str = "v1", extra: list[str] | None = None, timeout_s: float = 900
) -> int:
    """Build model and data in ``workdir``, run main_ppo, tee its output to ``workdir/main_ppo.log``."""
    compat.require_hooks()
    workdir = workdir.resolve()
    build_model(workdir / "model")
    write_data(workdir / "data")
    env = {
        **os.environ,
        "VERL_USE_EXTERNAL_MODULES": PLUGINS,
        "VERL_PLATFORM": "stratarl_cpu",
        "PYTHONPATH": pythonpath(),
        "HYDRA_FULL_ERROR": "1",
        "RAY_DEDUP_LOGS": "0",
        "TOKENIZERS_PARALLELISM": "false",
    }
    overrides = main_ppo_overrides(workdir, steps=steps, trainer=trainer)
    command = [sys.executable, "-m", "verl.trainer.main_ppo", *with_overrides(overrides, extra or [])]
    log = workdir / "main_ppo.log"
    with open(log, "w") as out:
        result = subprocess.run(
            command, env=env, cwd=workdir, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s, check=False
        )
    return result.returncode


def print_steps(workdir: Path, code: int) -> None:
    """The step lines of ``workdir/main_ppo.log`` (cut to 400 characters) and the exit status."""
    log = (workdir / "main_ppo.log").read_text().splitlines()
    print("\n".join(line[:400] for line in log if "step:" in line and " - " in line))
    print(f"main_ppo exit status {code}; full log: {workdir / 'main_ppo.log'}")


def main(argv: list[str] | None = None) -> int:
    """Single-turn smoke; the multi-turn one is `PYTHONPATH=tests/verl python -m harness.smoke_multiturn`."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, required=True, help="folder for model, data, log and rollouts")
    parser.add_argument("--steps", type=int, default=2, help="training steps (default 2)")
    parser.add_argument(
        "--trainer",
        choices=TRAINERS,
        default="v1",
        help="veRL trainer: v1 (trainer.use_v1=true, veRL's default) or legacy (RayPPOTrainer)",
    )
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for main_ppo")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    if compat.preflight():
        return 2
    code = run(args.workdir, steps=args.steps, trainer=args.trainer, extra=args.overrides)
    print_steps(args.workdir, code)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
