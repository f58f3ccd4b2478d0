"""Build what a run needs from its config: policy + tokenizer, question sets, retriever.

Shared by `stratarl train`, `sft` and `eval` so the three always see the same
model, data and retriever for the same config.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from stratarl.cache import cache_root
from stratarl.config_errors import ConfigError
from stratarl.data.examples import Example
from stratarl.data.models import DEFAULT_MODEL, build_tiny_model, load_model, load_tokenizer
from stratarl.data.search_r1 import load_example_files
from stratarl.data.synth import SYNTH_VERSION
from stratarl.data.wordlevel import word_tokenizer_for_task
from stratarl.retrieval.base import Passage, RetrievalError, Retriever
from stratarl.retrieval.bm25 import BM25Retriever
from stratarl.retrieval.corpus import load_corpus
from stratarl.retrieval.factory import build_retriever
from stratarl.trainer.config import Config, ModelConfig
from stratarl.trainer.demos import ANSWER_THOUGHT, SEARCH_THOUGHT
from stratarl.trainer.synthetic import load_synthetic_task
from stratarl.trainer.task import TaskData

TINY_MODEL = "tiny-random"
WORD_MODEL = "word-tiny"


def check_device(device: str) -> None:
    """Raise `ConfigError` when ``trainer.device`` names a device this torch build cannot use."""

    if device.startswith("cuda") and not torch.cuda.is_available():
        why = "this torch build has no CUDA support" if torch.version.cuda is None else "no CUDA GPU is visible"
        raise ConfigError(f"config field `trainer.device` = {device!r}: {why}. Fix: set trainer.device=cpu, or "
                          "install a CUDA build of torch on a machine with a GPU.")
    index = torch.device(device).index if device.startswith("cuda") else None
    if index is not None and index >= torch.cuda.device_count():
        raise ConfigError(f"config field `trainer.device` = {device!r}: only {torch.cuda.device_count()} CUDA GPU(s) "
                          f"are visible (cuda:0 to cuda:{torch.cuda.device_count() - 1}). Fix: set trainer.device=cuda:0, "
                          "or check CUDA_VISIBLE_DEVICES.")


def load_policy(model_cfg: ModelConfig, *, seed: int = 0, device: str = "cpu", trainable: bool = True,
                task: TaskData | None = None):
    """(model, tokenizer) for ``model_cfg``: ``init_from`` folder, `tiny-random`, `word-tiny`, or a bundled/hub model.

    `word-tiny` builds a word-level vocabulary from ``task``'s corpus and questions
    (docs/wordlevel.md), so it needs ``task``.

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
        tokenizer = _word_tokenizer(task) if model_cfg.name == WORD_MODEL else load_tokenizer(tokenizer_name)
        model = build_tiny_model(tokenizer, hidden_size=model_cfg.tiny_hidden_size, num_layers=model_cfg.tiny_num_layers,
                                 num_heads=model_cfg.tiny_num_heads, intermediate_size=model_cfg.tiny_intermediate_size,
                                 seed=seed, copy_init=model_cfg.tiny_copy_init)
    else:
        tokenizer = load_tokenizer(tokenizer_name)
        model = load_model(model_cfg.name)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.config.use_cache = False
    if model_cfg.gradient_checkpointing and trainable:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if model_cfg.trainable_layers and trainable:
        freeze_all_but_last_layers(model, model_cfg.trainable_layers)
    if model_cfg.lora.enabled and trainable:
        model = _wrap_lora(model, model_cfg)
    return model.to(device).eval(), tokenizer


def _word_tokenizer(task: TaskData | None):
    if task is None or task.corpus_path is None:
        raise ValueError(f"model.name={WORD_MODEL} builds its vocabulary from the task's corpus and questions; "
                         "it needs a task with a corpus (data.source: synthetic, or data.corpus set)")
    return word_tokenizer_for_task(load_corpus(task.corpus_path), [*task.train, *task.test],
                                   extra_texts=[SEARCH_THOUGHT, ANSWER_THOUGHT, *task.vocabulary_texts])


def freeze_all_but_last_layers(model, n: int) -> None:
    """requires_grad only on the last ``n`` decoder layers and the final norm (in place).

    Autograd then never goes below layer L - n: the lower layers run forward only.
    """
    decoder = model.get_decoder()
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise ValueError("model.trainable_layers needs a decoder with a `.layers` list (Llama/Qwen/Mistral-style models)")
    if n > len(layers):
        raise ValueError(f"model.trainable_layers={n} but the model has only {len(layers)} layers; use at most {len(layers)}")
    for p in model.parameters():
        p.requires_grad_(False)
    for layer in list(layers)[-n:]:
        for p in layer.parameters():
            p.requires_grad_(True)
    norm = getattr(decoder, "norm", None)
    if norm is not None:
        for p in norm.parameters():
            p.requires_grad_(True)


def _wrap_lora(model, model_cfg: ModelConfig):
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise RuntimeError("model.lora.enabled=true needs peft: `pip install peft`, or set model.lora.enabled=false") from None
    lora = model_cfg.lora
    config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                        target_modules=list(lora.target_modules), task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def merged_model(model):
    """A plain HF model to save: LoRA adapters merged in (a copy), or the model itself."""
    if hasattr(model, "merge_and_unload"):
        return copy.deepcopy(model).merge_and_unload()
    return model


def save_pretrained_model(model, tokenizer, path: str | Path) -> Path:
    """Save a loadable model folder (safetensors + tokenizer), LoRA merged. Written into a temporary
    sibling and renamed into place, so a kill never leaves a half-written folder with a config.json."""

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    try:
        merged_model(model).save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if path.exists():
            shutil.rmtree(path)
        tmp.rename(path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


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
        data = TaskData(train, test, Path(cfg.data.corpus) if cfg.data.corpus else None)
    if cfg.data.max_train_examples is not None:
        data.train = data.train[:cfg.data.max_train_examples]
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
    """The retriever for ``cfg.retrieval.spec``; `bm25` indexes the task's corpus (cached next to it)."""
    spec = cfg.retrieval.spec
    if spec == "bm25":
        if task.corpus_path is None:
            raise ValueError("retrieval.spec=bm25 needs a corpus: set data.corpus=PATH (Search-R1 corpus jsonl), "
                             "or point retrieval.spec at an index folder or a /retrieve URL")
        index_dir = task.corpus_path.parent / f"{task.corpus_path.stem}.bm25"
        if (index_dir / "stratarl_index.json").is_file():
            try:
                return BM25Retriever.load(index_dir)
            except Exception:  # a stale or foreign index: rebuild below
                pass
        retriever = BM25Retriever.from_corpus(task.corpus_path)
        try:
            retriever.save(index_dir)
        except OSError:
            pass
        return retriever
    return build_retriever(spec)


class TimedRetriever:
    """Retriever proxy that adds the wall time of every ``search`` call to ``seconds`` and counts the
    queries that failed (raised, or a reply with the wrong number of result lists).

    ``budget_s`` bounds the time searches may take between two `start_step` calls: a retriever with a
    ``deadline`` attribute (`RemoteRetriever`) stops retrying at it, and once the budget is spent every
    further search of the step fails at once instead of waiting on a hanging server."""

    def __init__(self, inner: Retriever, budget_s: float | None = None) -> None:
        self.inner = inner
        self.budget_s = budget_s
        self.seconds = 0.0
        self.calls = 0
        self.start_step()

    def start_step(self) -> None:
        """Reset the per-step counters and the time budget."""
        self.step_queries = self.step_failed = 0
        self.step_seconds = 0.0
        self.last_error = ""

    @property
    def where(self) -> str:
        """The server URL (remote retrievers) or the retriever's repr."""
        return getattr(self.inner, "url", None) or repr(self.inner)

    def search(self, queries: list[str], k: int) -> list[list[Passage]]:
    
        start = time.perf_counter()
        self.step_queries += len(queries)
        try:
            remaining = None if self.budget_s is None else self.budget_s - self.step_seconds
            if remaining is not None and remaining <= 0:
                raise RetrievalError(f"this step's retrieval time budget (retrieval.step_budget_s={self.budget_s:g}) "
                                     "is spent; the search was not sent")
            if hasattr(self.inner, "deadline"):
                self.inner.deadline = None if remaining is None else time.monotonic() + remaining
            results = self.inner.search(queries, k)
            if not isinstance(results, list) or len(results) != len(queries):
                got = len(results) if isinstance(results, list) else type(results).__name__
                raise RetrievalError(f"retriever returned {got} result lists for {len(queries)} queries")
            return results
        except Exception as error:
            self.step_failed += len(queries)
            self.last_error = f"{type(error).__name__}: {error}"
            raise
        finally:
            elapsed = time.perf_counter() - start
            self.seconds += elapsed
            self.step_seconds += elapsed
            self.calls += len(queries)

    @contextmanager
    def unbudgeted(self):
        """No step budget inside (evaluation: its searches are not a training step's)."""
        budget, self.budget_s = self.budget_s, None
        try:
            yield self
        finally:
            self.budget_s = budget

    def pop_seconds(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def set_threads(num_threads: int) -> int:
    n = num_threads or os.cpu_count() or 1
    torch.set_num_threads(n)
    return n


# Policies below this many parameters run their RL step (and warm start, eval) on one intra-op thread, whatever
# trainer.num_threads says: each of the step's ~10^4 ops takes microseconds, too little to split,
# and on a machine whose other core is busy every parallel op waits for a descheduled thread
# (lab config, 0.3 M parameters, a loaded 2-core machine: 11.9 s a step on 2 threads, 0.82 s on 1).
SINGLE_THREAD_MAX_PARAMS = 5_000_000


@contextmanager
def step_threads(model: torch.nn.Module):
    """One intra-op thread for a policy under ``SINGLE_THREAD_MAX_PARAMS`` parameters, restored after."""
    before = torch.get_num_threads()
    small = sum(p.numel() for p in model.parameters()) < SINGLE_THREAD_MAX_PARAMS
    if small and before > 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)
