"""Build what a run needs from its config: policy + tokenizer, question sets, retriever.

Shared by `stratarl train`, `sft` and `eval` so the three always see the same
model, data and retriever for the same config.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import torch

from stratarl.cache import cache_root
from stratarl.config_errors import ConfigError
from stratarl.data.examples import Example
from stratarl.data.phantomwiki_vocabulary import read_vocabulary
from stratarl.data.search_r1 import load_example_files, load_examples
from stratarl.data.synth import SYNTH_VERSION
from stratarl.data.wordlevel import closed_word_tokenizer, task_texts, unknown_in_texts, word_tokenizer_for_task
from stratarl.evaluation.greedy import EvalSettings
from stratarl.models import (
    DEFAULT_MODEL,
    build_tiny_model,
    freeze_all_but_last_layers,
    load_model,
    load_tokenizer,
    wrap_lora,
)
from stratarl.retrieval.base import Retriever
from stratarl.retrieval.corpus import load_corpus
from stratarl.retrieval.factory import build_corpus_retriever, build_retriever, corpus_kind
from stratarl.rewards import build_reward
from stratarl.rollout.collect import Scoring
from stratarl.trainer.config import Config, ModelConfig
from stratarl.trainer.synthetic import load_synthetic_task
from stratarl.trainer.task import TaskData
from stratarl.trainer.warmstart.render import ANSWER_THOUGHT, SEARCH_THOUGHT

TINY_MODEL = "tiny-random"
WORD_MODEL = "word-tiny"


def check_device(device: str) -> None:
    """Raise `ConfigError` when ``trainer.device`` names a device this torch build cannot use."""

    if device.startswith("cuda") and not torch.cuda.is_available():
        why = "this torch build has no CUDA support" if torch.version.cuda is None else "no CUDA GPU is visible"
        raise ConfigError(
            f"config field `trainer.device` = {device!r}: {why}. Fix: set trainer.device=cpu, or "
            "install a CUDA build of torch on a machine with a GPU."
        )
    index = torch.device(device).index if device.startswith("cuda") else None
    if index is not None and index >= torch.cuda.device_count():
        raise ConfigError(
            f"config field `trainer.device` = {device!r}: only {torch.cuda.device_count()} CUDA GPU(s) "
            f"are visible (cuda:0 to cuda:{torch.cuda.device_count() - 1}). Fix: set trainer.device=cuda:0, "
            "or check CUDA_VISIBLE_DEVICES."
        )


def load_policy(
    model_cfg: ModelConfig, *, seed: int = 0, device: str = "cpu", trainable: bool = True, task: TaskData | None = None
):
    """(model, tokenizer) for ``model_cfg``: ``init_from`` folder, `tiny-random`, `word-tiny`, or a bundled/hub model.

    `word-tiny` builds a word-level vocabulary from ``task``'s corpus and questions
    (docs/wordlevel.md), so it needs ``task``; with ``model.word_vocabulary`` from that closed word list
    instead, and then ``task``'s corpus and questions must hold no word outside the vocabulary
    (``check_word_coverage``, whatever the model).

    With ``model.lora.enabled`` and ``trainable`` the model is wrapped by peft
    (only adapter weights train). The model is returned in eval mode (no dropout),
    so log-probs of the same tokens agree between the rollout and the update.
    """
    check_device(device)

    tokenizer_name = model_cfg.tokenizer or (DEFAULT_MODEL if model_cfg.name == TINY_MODEL else model_cfg.name)
    if model_cfg.init_from:
        tokenizer = load_tokenizer(model_cfg.tokenizer or model_cfg.init_from)
        model = load_model(model_cfg.init_from)
    elif model_cfg.name in (TINY_MODEL, WORD_MODEL):
        if model_cfg.name == WORD_MODEL:
            tokenizer = _word_tokenizer(task, model_cfg.word_vocabulary)
        else:
            tokenizer = load_tokenizer(tokenizer_name)
        model = build_tiny_model(
            tokenizer,
            hidden_size=model_cfg.tiny_hidden_size,
            num_layers=model_cfg.tiny_num_layers,
            num_heads=model_cfg.tiny_num_heads,
            intermediate_size=model_cfg.tiny_intermediate_size,
            seed=seed,
            copy_init=model_cfg.tiny_copy_init,
        )
    else:
        tokenizer = load_tokenizer(tokenizer_name)
        model = load_model(model_cfg.name)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if model_cfg.word_vocabulary is not None and task is not None:
        check_word_coverage(tokenizer, task, model_cfg.word_vocabulary)
    model.config.use_cache = False
    if model_cfg.gradient_checkpointing and trainable:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if model_cfg.trainable_layers and trainable:
        freeze_all_but_last_layers(model, model_cfg.trainable_layers)
    if model_cfg.lora.enabled and trainable:
        model = wrap_lora(model, model_cfg.lora)
    return model.to(device).eval(), tokenizer


def _word_tokenizer(task: TaskData | None, vocabulary: str | None = None):
    if vocabulary is not None:  # a closed vocabulary: the same for every run over its data, whatever the task
        try:
            words = read_vocabulary(vocabulary)
        except ValueError as error:
            raise ConfigError(f"config field `model.word_vocabulary`: {error}") from None
        return closed_word_tokenizer(words, extra_texts=[SEARCH_THOUGHT, ANSWER_THOUGHT])
    if task is None or task.corpus_path is None:
        raise ValueError(
            f"model.name={WORD_MODEL} builds its vocabulary from the task's corpus and questions; "
            "it needs a task with a corpus (data.source: synthetic, or data.corpus set)"
        )
    return word_tokenizer_for_task(
        load_corpus(task.corpus_path),
        [*task.train, *task.test],
        extra_texts=[SEARCH_THOUGHT, ANSWER_THOUGHT, *task.vocabulary_texts],
    )


def check_word_coverage(tokenizer, task: TaskData, vocabulary: str) -> None:
    """Raise `ConfigError`, naming the file, when the task's corpus or questions hold a word ``tokenizer`` spells
    as its unknown token (``model.word_vocabulary`` promises a vocabulary that covers the run's data)."""
    fix = (
        "Fix: generate the data and the word list with one `stratarl data phantomwiki` (same phantom-wiki "
        "version), or unset model.word_vocabulary"
    )
    what = f"the word-level vocabulary (model.word_vocabulary={vocabulary})"
    if task.corpus_path is not None:
        missing = unknown_in_texts(tokenizer, (p.contents for p in task.passages or load_corpus(task.corpus_path)))
        if missing:
            raise ConfigError(f"{task.corpus_path}: words outside {what}: {', '.join(map(repr, missing))}. {fix}")
    if not unknown_in_texts(tokenizer, task_texts([], [*task.train, *task.test]), limit=1):
        return
    for path in task.question_files or ["the task's questions"]:
        examples = load_examples(path) if task.question_files else [*task.train, *task.test]
        missing = unknown_in_texts(tokenizer, task_texts([], examples))
        if missing:
            raise ConfigError(f"{path}: words outside {what}: {', '.join(map(repr, missing))}. {fix}")


# --------------------------------------------------------------------------- data


def synthetic_dir(cfg: Config) -> Path:
    syn = cfg.data.synthetic
    if syn.cache_dir:
        return Path(syn.cache_dir)

    # The generator's version is part of the key: a changed generator never reuses a stale cache.
    key = {"version": SYNTH_VERSION, **syn.options}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:10]
    return cache_root() / "synth" / f"seed{syn.seed}-{digest}"


def load_task(cfg: Config) -> TaskData:
    """Training and held-out questions for ``cfg.data`` (synthetic KB generated on first use)."""
    if cfg.data.source == "synthetic":
        data = load_synthetic_task(synthetic_dir(cfg), seed=cfg.data.synthetic.seed, options=cfg.data.synthetic.options)
    else:
        # load_example_files keeps ids unique across files (prompts are cached by id).
        train = load_example_files(cfg.data.train_files)
        test = load_example_files(cfg.data.test_files)
        data = TaskData(
            train,
            test,
            Path(cfg.data.corpus) if cfg.data.corpus else None,
            question_files=[*cfg.data.train_files, *cfg.data.test_files],
        )
    if cfg.data.max_train_examples is not None:
        data.train = data.train[: cfg.data.max_train_examples]
    if not data.train:
        raise ValueError("the training set is empty: check data.train_files / data.synthetic.options")
    return data


def limit_per_source(examples: list[Example], limit: int | None) -> list[Example]:
    """At most ``limit`` examples per data_source, in file order."""
    if limit is None:
        return list(examples)
    counts: dict[str, int] = {}
    out = []
    for e in examples:
        if counts.get(e.data_source, 0) < limit:
            counts[e.data_source] = counts.get(e.data_source, 0) + 1
            out.append(e)
    return out


# --------------------------------------------------------------------------- retrieval


def build_task_retriever(cfg: Config, task: TaskData) -> Retriever:
    """The retriever for ``cfg.retrieval.spec``; a bare corpus kind (`bm25`, the default) indexes the task's corpus
    (cached next to it, retrieval.factory.build_corpus_retriever)."""
    spec = cfg.retrieval.spec
    kind = corpus_kind(spec)
    if kind is None:
        return build_retriever(spec)
    if task.corpus_path is None:
        raise ValueError(
            f"retrieval.spec={kind} needs a corpus: set data.corpus=PATH (Search-R1 corpus jsonl), "
            "or point retrieval.spec at an index folder or a /retrieve URL"
        )
    return build_corpus_retriever(kind, task.corpus_path)


def scoring_of(cfg: Config) -> Scoring:
    """The run's reward (``algo.reward`` with ``algo.reward_params``), overlong rule and strata, resolved once."""
    algo = cfg.algo
    return Scoring.from_names(
        algo.reward,
        algo.stratum_key,
        algo.stratum_cap,
        reward_params=algo.reward_params,
        overlong=algo.overlong,
        overlong_reward=algo.overlong_reward,
    )


def eval_settings(cfg: Config, scoring: Scoring | None = None) -> EvalSettings:
    """How ``cfg``'s held-out evaluations run: its rollout section, strata (``scoring``, or resolved from
    ``algo.stratum_key``), device and precision, and ``eval.batch_size``. An eval scores EM / SubEM / F1 itself
    (stratarl.evaluation.greedy.score_rollout) and never reads the reward, so its scoring's reward is plain EM:
    a judge reward is never asked about held-out questions."""
    scoring = dataclasses.replace(scoring or scoring_of(cfg), reward=build_reward("em"))
    return EvalSettings(rollout=cfg.rollout, scoring=scoring, policy=cfg.device_policy, batch_size=cfg.eval.batch_size)
