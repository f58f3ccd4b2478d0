"""Warm-start stage: supervised fine-tuning on demonstration trajectories.

A demonstration is a full agent trajectory in the exact token layout the rollout
engine produces (prompt ids, response ids, response mask with 0 on observation
tokens). The loss is the token-mean negative log-likelihood of policy tokens only:

    L = - (1 / N) sum_{b, t : mask[b, t] = 1} log pi(y_{b, t} | y_{b, <t}, x_b),   N = number of policy tokens

Observation tokens (retrieved passages) are context, never targets.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import os
import random
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import torch

from stratarl.cache import cache_root
from stratarl.data.synth import generate_knowledge_base
from stratarl.retrieval.bm25 import BM25Retriever
from stratarl.trainer.batch import collate_sequences, micro_batches
from stratarl.trainer.demos import Demonstration, render_demonstrations, render_reading_examples
from stratarl.trainer.logprobs import response_logprobs
from stratarl.trainer.metrics import MetricsLogger
from stratarl.trainer.precision import policy_for_model, policy_of
from stratarl.trainer.probe import PROBE_WORLD_OFFSET, ProbeResult, WarmStartFailed, probe_questions, run_probe
from stratarl.trainer.progress import progress as progress_display
from stratarl.trainer.setup import build_task_retriever, load_policy, load_task, save_pretrained_model, step_threads
from stratarl.trainer.update import lr_multiplier


def sft_step(model: torch.nn.Module, demos: Sequence[Demonstration], pad_id: int, *, micro_batch_tokens: int,
             chunk_tokens: int, observation_weight: float = 0.0, precision: str = "auto") -> dict[str, float]:
    """Accumulate the gradient of the token-mean NLL over ``demos`` (one optimizer step's worth).

    Each micro-batch's summed NLL is divided by the policy-token count of the whole step, so
    the accumulated gradient equals that of one big batch. With ``observation_weight`` w > 0
    observation tokens are targets too, with weight w:

        L = - sum_t m_t log pi(y_t | y_<t) / sum_t m_t,   m_t = 1 on policy tokens, w on observation tokens

    Returns the loss (policy tokens only, comparable across w), the weighted loss and token counts.
    ``precision`` (``trainer.precision``): the forward passes run under bf16 autocast with `bf16` (and
    `auto` on a CUDA GPU); stratarl.trainer.precision.
    """
    autocast = policy_for_model(model, precision).autocast
    batch = collate_sequences([d.prompt_ids for d in demos], [d.response_ids for d in demos],
                              [d.response_mask for d in demos], pad_id).to(next(model.parameters()).device)
    total = batch.num_policy_tokens
    if total == 0:
        return {"loss": 0.0, "weighted_loss": 0.0, "policy_tokens": 0, "tokens": 0}
    def token_weights(b) -> torch.Tensor:
        in_response = (torch.arange(b.response_mask.shape[1], device=b.response_mask.device).view(1, -1)
                       < b.response_lengths.view(-1, 1).to(b.response_mask.device)).float()
        return b.response_mask + observation_weight * (in_response - b.response_mask)

    weight_total = float(token_weights(batch).sum())
    loss_sum, weighted_sum = 0.0, 0.0
    for rows in micro_batches(batch.row_lengths(), micro_batch_tokens):
        mb = batch.select(rows)
        weights = token_weights(mb)
        with autocast():
            out = response_logprobs(model, mb.input_ids, mb.attention_mask, mb.prompt_lengths, (weights > 0).float(),
                                    chunk_tokens=chunk_tokens)
        nll = -(out["logprobs"] * weights).sum() / weight_total
        nll.backward()
        weighted_sum += float(nll.detach())
        loss_sum += float(-(out["logprobs"].detach() * mb.response_mask).sum()) / total
    return {"loss": loss_sum, "weighted_loss": weighted_sum, "policy_tokens": total,
            "tokens": int(batch.attention_mask.sum())}


def lr_factor(step: int, total_steps: int, warmup_steps: int, schedule: str) -> float:
    """Multiplier of the base lr at optimizer step ``step`` (0-based).

    Warm-up: (step + 1) / warmup_steps for the first ``warmup_steps`` steps. Then
    ``constant``: 1; ``cosine``: 0.1 + 0.9 * (1 + cos(pi * p)) / 2 with p going 0 -> 1 from the end of
    warm-up to the last step (step total_steps - 1), so the last step runs at 10% of the lr.
    """
    if schedule not in ("constant", "cosine"):
        raise ValueError(f"unknown SFT lr schedule {schedule!r}; use constant or cosine")
    return lr_multiplier(step, warmup_steps, total_steps - 1 - warmup_steps, schedule)


def epoch_batches(demos: Sequence[Demonstration], *, epochs: int, batch_size: int, seed: int) -> Iterator[list[Demonstration]]:
    """``epochs`` seeded shuffles of ``demos``, cut into batches of ``batch_size`` (the last one may be short)."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        order = torch.randperm(len(demos), generator=generator).tolist()
        for start in range(0, len(order), batch_size):
            yield [demos[i] for i in order[start:start + batch_size]]


def _run_sft(model: torch.nn.Module, demos: Sequence[Demonstration] | None, pad_id: int, *, lr: float, epochs: int,
            batch_size: int, seed: int, micro_batch_tokens: int, chunk_tokens: int, grad_clip: float = 1.0,
            warmup_fraction: float = 0.05, schedule: str = "constant", observation_weight: float = 0.0,
            batches: Iterable[list[Demonstration]] | None = None, total_steps: int | None = None,
            on_step: Callable[[int, int, dict], None] | None = None, precision: str = "auto",
            done: Callable[[int], bool] | None = None, max_steps: int | None = None) -> dict[str, float]:
    """Fine-tune ``model`` in place: AdamW, linear warm-up, then a constant lr or a cosine decay to
    10% of it at the last step (``lr_factor``).

    Batches are ``epochs`` shuffled passes over ``demos``, or, for a stream of fresh demonstrations,
    the first ``total_steps`` items of ``batches`` (then ``demos`` is None; "epoch" losses are the
    first and last 10% of the steps).
    ``on_step(step, total_steps, metrics)`` is called after each optimizer step
    (metrics keys ``sft/loss``, ``sft/lr``, ``sft/grad_norm``, ``sft/tokens_per_s``).
    ``precision``: of the forward passes (``sft_step``).
    ``done(step)``: with a stream, called after every step from ``total_steps`` on; the stream goes on past
    ``total_steps`` (up to ``max_steps``, the lr schedule held at its last value) until it returns True.
    Returns the mean loss of the first and the last epoch, and of the first and last 3 steps.
    """
    if batches is None:
        if not demos:
            raise ValueError("no demonstrations to fine-tune on (sft.num_demos is 0 or the training set is empty)")
        total_steps = math.ceil(len(demos) / batch_size) * epochs
        batches = epoch_batches(demos, epochs=epochs, batch_size=batch_size, seed=seed)
        epoch_steps = math.ceil(len(demos) / batch_size)
    else:
        if not total_steps or total_steps < 1:
            raise ValueError("a stream of demonstration batches needs total_steps >= 1 (sft.steps)")
        epoch_steps = max(1, total_steps // 10)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    warmup = max(1, int(warmup_fraction * total_steps))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, total_steps, warmup, schedule))
    model.train()
    step, step_losses = 0, []
    limit = max(total_steps, max_steps or 0) if done is not None else total_steps
    for chunk in itertools.islice(batches, limit):
        t0 = time.perf_counter()
        stats = sft_step(model, chunk, pad_id, micro_batch_tokens=micro_batch_tokens, chunk_tokens=chunk_tokens,
                         observation_weight=observation_weight, precision=precision)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        step_losses.append(stats["loss"])
        dt = time.perf_counter() - t0
        if on_step is not None:
            on_step(step, total_steps, {"sft/loss": stats["loss"], "sft/weighted_loss": stats["weighted_loss"],
                                        "sft/lr": scheduler.get_last_lr()[0], "sft/grad_norm": float(grad_norm),
                                        "sft/policy_tokens": stats["policy_tokens"],
                                        "sft/tokens_per_s": stats["tokens"] / max(dt, 1e-9), "time/sft_step": dt})
        if done is not None and step >= total_steps and done(step):
            break
    model.eval()
    if not step_losses:
        raise ValueError("the demonstration stream ended before the first step")
    first, last = step_losses[:epoch_steps], step_losses[-epoch_steps:]
    head, tail = step_losses[:3], step_losses[-3:]
    return {"first_epoch_loss": sum(first) / len(first), "last_epoch_loss": sum(last) / len(last), "steps": step,
            "first_steps_loss": sum(head) / len(head), "last_steps_loss": sum(tail) / len(tail)}


def run_sft(model: torch.nn.Module, demos: Sequence[Demonstration] | None, pad_id: int, **kwargs) -> dict[str, float]:
    """Fine-tune ``model`` in place (see ``_run_sft`` for the arguments), on one thread for a small model
    (``stratarl.trainer.setup.step_threads``)."""
    with step_threads(model):
        return _run_sft(model, demos, pad_id, **kwargs)


def demo_shortfall(requested: int, rendered: int, num_questions: int) -> str | None:
    """A warning when fewer demonstrations were rendered than ``sft.num_demos`` asked for, else None.

    render_demonstrations makes at most one per training question (and drops correct ones whose
    gold passage the retriever missed), so a small KB silently caps the warm start.
    """
    if rendered >= requested:
        return None
    return (f"warning: sft.num_demos={requested} but only {rendered} demonstrations were rendered from "
            f"{num_questions} training questions (at most one each). Fix: raise data.synthetic.options.num_train "
            "(and size: a small KB holds a few hundred questions), or lower sft.num_demos and raise sft.epochs")


# Demonstration worlds of task seed s are seeds WORLD_SEED_STRIDE * (s + 1) + i, i = 0, 1, ...: far
# from any task seed a user writes, so the task's own world is never among them (checked, too).
WORLD_SEED_STRIDE = 1_000_003


def world_seed(task_seed: int, index: int) -> int:
    """Seed of the ``index``-th demonstration world of the task with seed ``task_seed``."""
    return WORLD_SEED_STRIDE * (task_seed + 1) + index


def _world(cfg, index: int, **overrides):
    """The ``index``-th demonstration world (a SyntheticKB) and its BM25 retriever."""
    options = {**cfg.data.synthetic.options, **cfg.sft.world_options, **overrides}
    try:
        kb = generate_knowledge_base(seed=world_seed(cfg.data.synthetic.seed, index), **options)
    except TypeError as error:
        raise ValueError(f"sft.world_options {cfg.sft.world_options!r} do not fit generate_knowledge_base: {error}. "
                         "Fix: use its keyword arguments (size, num_train, hop_mix, ...)") from None
    return kb, BM25Retriever.from_passages(kb.passages)


def _mixed_batches(render: Callable[[int, int], list[Demonstration]], *, batch_size: int, mix_worlds: int,
                   rng: random.Random) -> Iterator[list[Demonstration]]:
    """Endless batches drawn from a shuffled pool that holds at least ``mix_worlds`` batches' worth:
    ``render(world_index, batches_so_far)`` refills it one fresh world at a time (so one batch is not
    one world's facts)."""
    pool: list[Demonstration] = []
    index, produced = 0, 0
    while True:
        while len(pool) < batch_size * mix_worlds:
            pool += render(index, produced)
            index += 1
        rng.shuffle(pool)
        batch, pool = pool[:batch_size], pool[batch_size:]
        produced += 1
        yield batch


def reading_batches(cfg, tokenizer, *, batch_size: int, curriculum: int, mix_worlds: int = 4,
                    first_world: int | None = None) -> Iterator[list[Demonstration]]:
    """Endless batches of reading examples (``render_reading_examples``) from fresh single-hop worlds; a world
    rendered after i batches shortens observations to one sentence with probability max(0, 1 - i / curriculum).
    Reading worlds are numbered from ``first_world`` (default ``READING_WORLD_OFFSET``, the far end of the
    demonstration worlds' range), so the stages never share a world; the rehearsal stream that
    ``sft.reading_mix`` adds to the demonstrations starts at ``REHEARSAL_WORLD_OFFSET``."""

    first_world = READING_WORLD_OFFSET if first_world is None else first_world
    rng = random.Random(cfg.sft.seed + 1 + first_world - READING_WORLD_OFFSET)

    def render(index: int, produced: int) -> list[Demonstration]:
        kb, retriever = _world(cfg, first_world + index, hop_mix=(1.0, 0.0, 0.0))
        return render_reading_examples(kb.train, tokenizer, retriever, {p.id: p.contents for p in kb.passages},
                                       topk=cfg.retrieval.topk, max_obs_tokens=cfg.rollout.max_obs_tokens, rng=rng,
                                       sentence_probability=max(0.0, 1.0 - produced / curriculum) if curriculum else 0.0,
                                       agent_probability=cfg.sft.reading_agent_fraction,
                                       prompt_template=cfg.rollout.prompt_template)

    return _mixed_batches(render, batch_size=batch_size, mix_worlds=mix_worlds, rng=rng)


# Reading worlds start here (demonstration worlds count up from 0): far apart, never the same seed.
READING_WORLD_OFFSET = WORLD_SEED_STRIDE // 2
# The rehearsal stream's reading worlds (``sft.reading_mix``), past the reading stage's (it draws a few hundred).
REHEARSAL_WORLD_OFFSET = READING_WORLD_OFFSET + 100_000


def world_demonstrations(cfg, tokenizer, index: int) -> list[Demonstration]:
    """All demonstrations of the ``index``-th fresh world: a synthetic KB drawn from the task's name pool
    with ``sft.world_options`` over ``data.synthetic.options``, indexed with its own BM25, rendered with the
    same prompt, observation caps and imperfect-demo mix as ``sft.source: task``, shuffled."""

    kb, retriever = _world(cfg, index)
    seed = world_seed(cfg.data.synthetic.seed, index)
    s = cfg.sft
    return render_demonstrations(kb.train, tokenizer, retriever, num_demos=len(kb.train), topk=cfg.retrieval.topk,
                                 max_obs_tokens=cfg.rollout.max_obs_tokens, no_search_fraction=s.no_search_fraction,
                                 wrong_hop_fraction=s.wrong_hop_fraction, early_answer_fraction=s.early_answer_fraction,
                                 seed=seed, prompt_template=cfg.rollout.prompt_template)


def world_batches(cfg, tokenizer, *, batch_size: int, mix_worlds: int = 4) -> Iterator[list[Demonstration]]:
    """Endless batches of demonstrations never seen before: worlds 0, 1, 2, ... are rendered on demand and
    each batch draws from ``mix_worlds`` worlds at a time (so one batch is not one world's facts)."""
    return _mixed_batches(lambda index, _: world_demonstrations(cfg, tokenizer, index), batch_size=batch_size,
                          mix_worlds=mix_worlds, rng=random.Random(cfg.sft.seed))


def warm_start_key(cfg) -> dict:
    """Everything a warm start depends on (the cache key of ``sft.cache``): not the RL settings. A bf16
    warm start (``trainer.precision`` resolving to bf16 on this machine) has its own key; fp32 keys carry no
    precision."""
    key = {"model": dataclasses.asdict(cfg.model), "data": dataclasses.asdict(cfg.data),
           "retrieval": dataclasses.asdict(cfg.retrieval), "max_obs_tokens": cfg.rollout.max_obs_tokens,
           "prompt_template": cfg.rollout.prompt_template,
           "sft": dataclasses.asdict(cfg.sft), "grad_clip": cfg.optim.grad_clip,
           "micro_batch_tokens": cfg.trainer.micro_batch_tokens}
    if policy_of(cfg.trainer).precision == "bf16":  # the precision the warm start's forward passes run in
        key["precision"] = "bf16"
    return key


def warm_start_cache_dir(cfg) -> Path:
    """``$STRATARL_CACHE/warmstart/<name>-<hash of warm_start_key(cfg)>``."""
    digest = hashlib.sha256(json.dumps(warm_start_key(cfg), sort_keys=True, default=str).encode()).hexdigest()[:12]
    return cache_root() / "warmstart" / f"{cfg.model.name}-{digest}"


def cached_warm_start(cfg, *, rebuild: bool = False, progress: bool = True) -> tuple[Path, dict | None]:
    """The cached warm start of ``cfg`` (built on first use, or again with ``rebuild``): (model folder,
    summary of the build or None when it was reused). Built in a temporary sibling and renamed, so a
    crash never leaves a half-written model that a later run would trust."""
    final = warm_start_cache_dir(cfg)
    if (final / "model" / "config.json").is_file() and not rebuild:
        return final / "model", None
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        try:
            summary = warm_start(cfg, tmp, progress=progress)
        except WarmStartFailed as error:
            # No model was saved; keep the demonstrations and losses that the error points to, beside the
            # cache (a name no cache lookup reads), instead of deleting them with the temporary folder.
            kept = final.parent / f"{final.name}.failed"
            if kept.exists():
                shutil.rmtree(kept)
            os.replace(tmp, kept)
            raise WarmStartFailed(str(error).replace(str(tmp), str(kept))) from None
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    summary["model"] = str(final / "model")
    return final / "model", summary


def _stage_bar(cfg, enabled: bool, total: int, desc: str):
    """The progress display of one warm-start stage (``stratarl.trainer.progress``), or None."""
    return progress_display(total, desc) if enabled and cfg.logging.progress else None


def _bar_step(bar, loss: float) -> None:
    if bar is not None:
        bar.set_postfix(loss=f"{loss:.3f}")
        bar.update(1)


def _reading_stage(cfg, model, tokenizer, *, progress: bool) -> dict:
    """Copy pre-training on fresh single-hop worlds (``sft.reading_steps``); returns its summary."""
    s = cfg.sft
    started = time.perf_counter()
    bar = _stage_bar(cfg, progress, s.reading_steps, "sft reading")
    reading = run_sft(model, None, tokenizer.pad_token_id, lr=s.lr, epochs=1, batch_size=s.reading_batch_size,
                      seed=s.seed, micro_batch_tokens=cfg.trainer.micro_batch_tokens,
                      chunk_tokens=cfg.trainer.logprob_chunk_tokens, grad_clip=cfg.optim.grad_clip,
                      schedule="constant", batches=reading_batches(cfg, tokenizer, batch_size=s.reading_batch_size,
                                                                   curriculum=s.reading_curriculum),
                      total_steps=s.reading_steps, precision=cfg.trainer.precision,
                      on_step=lambda step, total, m: _bar_step(bar, m["sft/loss"]))
    if bar is not None:
        bar.close()
    reading["seconds"] = time.perf_counter() - started
    print(f"reading pre-training: {s.reading_steps} steps in {reading['seconds']:.0f}s, answer loss "
          f"{reading['first_steps_loss']:.3f} -> {reading['last_steps_loss']:.3f}", flush=True)
    return reading


def _probe_hook(cfg, model, tokenizer, logger, bar, total_steps: int, probes: list[ProbeResult]):
    """``done(step)`` for ``run_sft``: the reading probe after ``sft.steps`` and every ``sft.probe_every`` steps
    after that; True once it passes. Each result is logged, printed and appended to ``probes``."""
    s = cfg.sft
    questions = probe_questions(cfg, s.probe_questions, seed=world_seed(cfg.data.synthetic.seed, PROBE_WORLD_OFFSET))

    def done(step: int) -> bool:
        if (step - total_steps) % s.probe_every:
            return False
        model.eval()
        result = run_probe(model, tokenizer, cfg, questions, step=step)
        model.train()
        probes.append(result)
        logger.log(step, result.metrics())
        passed = result.passed(s.probe_min_em)
        message = f"{result.line()}: {'passed' if passed else 'below'} sft.probe_min_em={s.probe_min_em:g}"
        (bar.write if bar is not None else print)(message)
        if not passed and bar is not None:
            bar.total = min(bar.total + s.probe_every, s.step_limit)
        return passed

    return done


def warm_start(cfg, out_dir, *, progress: bool = True) -> dict:
    """`stratarl sft`: render demonstrations from the training questions, fine-tune, save ``<out_dir>/model``.

    Uses the run config's model, data, retrieval (for observations), rollout caps and
    ``sft`` section. Writes ``sft_metrics.jsonl`` and ``demos_sample.jsonl`` next to the model.
    With ``sft.probe_every`` the demonstration stage runs until the reading probe passes
    (stratarl.trainer.probe) and raises ``WarmStartFailed`` if it never does within ``sft.max_steps``.
    Returns a summary with the loss of the first and last epoch, the demo mix and the probes.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    s = cfg.sft
    torch.manual_seed(s.seed)
    task = load_task(cfg)
    model, tokenizer = load_policy(cfg.model, seed=s.seed, device=cfg.trainer.device, task=task)
    seen_kinds: Counter = Counter()  # what was trained on, for the summary (demos themselves are not kept)
    seen_policy_tokens = 0
    reading = _reading_stage(cfg, model, tokenizer, progress=progress) if s.reading_steps else None
    if s.source == "worlds":
        stream = world_batches(cfg, tokenizer, batch_size=s.batch_size)
        if s.reading_mix:
            # Rehearsal: without it, demonstrations erase the reading stage's copying in a few hundred steps
            # (held-out reading accuracy 1.00 -> 0.00 by step 200 on one world) and the agent's copying
            # has to be found again, by the luck of the world stream (docs/lab.md).
            rehearsal = reading_batches(cfg, tokenizer, batch_size=s.reading_mix, curriculum=0,
                                        first_world=REHEARSAL_WORLD_OFFSET)
            stream = (demos + reads for demos, reads in zip(stream, rehearsal))
        sample = next(stream)
        total_steps = s.steps

        def record(batch_iter):
            nonlocal seen_policy_tokens
            for batch in batch_iter:
                seen_kinds.update(d.kind for d in batch)
                seen_policy_tokens += sum(sum(d.response_mask) for d in batch)
                yield batch

        train_batches, demos = record(itertools.chain([sample], stream)), None
    else:
        retriever = build_task_retriever(cfg, task)
        demos = render_demonstrations(task.train, tokenizer, retriever, num_demos=s.num_demos, topk=cfg.retrieval.topk,
                                      max_obs_tokens=cfg.rollout.max_obs_tokens, no_search_fraction=s.no_search_fraction,
                                      wrong_hop_fraction=s.wrong_hop_fraction,
                                      early_answer_fraction=s.early_answer_fraction, seed=s.seed,
                                      prompt_template=cfg.rollout.prompt_template)
        shortfall = demo_shortfall(s.num_demos, len(demos), len(task.train))
        if shortfall:
            print(shortfall, flush=True)
        sample, train_batches, total_steps = demos, None, math.ceil(len(demos) / s.batch_size) * s.epochs
    with open(out_dir / "demos_sample.jsonl", "w") as f:
        for d in sample[:5]:
            f.write(json.dumps({"kind": d.kind, "example_id": d.example_id, **d.meta,
                                "text": tokenizer.decode(d.response_ids)}) + "\n")
    logger = MetricsLogger(out_dir, tensorboard=cfg.logging.tensorboard, filename="sft_metrics.jsonl")
    bar = _stage_bar(cfg, progress, total_steps, "sft")
    probes: list[ProbeResult] = []
    done = _probe_hook(cfg, model, tokenizer, logger, bar, total_steps, probes) if s.probe_every else None

    def on_step(step: int, total: int, metrics: dict) -> None:
        logger.log(step, metrics)
        _bar_step(bar, metrics["sft/loss"])

    result = run_sft(model, demos, tokenizer.pad_token_id, lr=s.lr, epochs=s.epochs, batch_size=s.batch_size,
                     seed=s.seed, micro_batch_tokens=cfg.trainer.micro_batch_tokens,
                     chunk_tokens=cfg.trainer.logprob_chunk_tokens, grad_clip=cfg.optim.grad_clip, schedule=s.schedule,
                     observation_weight=s.observation_loss, batches=train_batches,
                     total_steps=total_steps if train_batches is not None else None, on_step=on_step,
                     precision=cfg.trainer.precision, done=done, max_steps=s.step_limit)
    if bar is not None:
        bar.close()
    logger.close()
    if probes and not probes[-1].passed(s.probe_min_em):
        raise WarmStartFailed(
            f"the warm start did not pass its reading probe: greedy single-hop EM {probes[-1].single_hop_em:.3f} < "
            f"sft.probe_min_em={s.probe_min_em:g} on {probes[-1].num_single_hop} questions of an unseen world after "
            f"{result['steps']} steps (sft.max_steps={s.step_limit}); nothing was cached. Fix: raise "
            f"sft.max_steps or sft.lr, or read the demonstrations in {out_dir / 'demos_sample.jsonl'} and the losses "
            f"in {out_dir / 'sft_metrics.jsonl'}")
    path = save_pretrained_model(model, tokenizer, out_dir / "model")
    if demos is not None:
        seen_kinds, seen_policy_tokens = Counter(d.kind for d in demos), sum(sum(d.response_mask) for d in demos)
    summary = {**result, "model": str(path), "source": s.source, "reading": reading, "num_demos": sum(seen_kinds.values()),
               "demo_kinds": dict(seen_kinds), "policy_tokens": seen_policy_tokens,
               "probes": [dataclasses.asdict(p) for p in probes],
               "probe_passed": bool(probes) and probes[-1].passed(s.probe_min_em),
               "seconds": time.perf_counter() - started}
    (out_dir / "sft_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
