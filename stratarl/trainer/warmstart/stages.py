"""The warm start (`stratarl sft`): reading pre-training, demonstrations, the reading probe, and the cache.

reading      copy pre-training on fresh single-hop worlds          (sft.reading_steps; worlds.reading_batches)
demos        demonstrations: the task's own questions (sft.source task) or a stream of fresh worlds
             (sft.source worlds; worlds.world_batches), optionally with reading rehearsal (sft.reading_mix)
probe        with sft.probe_every: greedy rollouts on a world never trained on decide when it is done
             (stratarl.trainer.warmstart.probe); a warm start that never passes raises WarmStartFailed
cache        with sft.cache: kept under $STRATARL_CACHE/warmstart/<name>-<hash of what it depends on>,
             published by rename (stratarl.publish)

``warm_start`` resolves the config once into ``WarmStartSettings`` (stratarl.trainer.warmstart.settings); the
stages read those, never the config (the cache key, ``warm_start_key``, is the config's own).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import shutil
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from stratarl.cache import cache_root
from stratarl.infra.metrics import MetricsLogger
from stratarl.infra.progress import progress as progress_display
from stratarl.models import save_pretrained_model
from stratarl.publish import publish_dir, staging_dir
from stratarl.trainer.config import Config
from stratarl.trainer.setup import build_task_retriever, load_policy, load_task
from stratarl.trainer.warmstart.demos import Demonstration, render_demonstrations
from stratarl.trainer.warmstart.probe import (
    PROBE_WORLD_OFFSET,
    ProbeResult,
    WarmStartFailed,
    probe_questions,
    run_probe,
)
from stratarl.trainer.warmstart.settings import WarmStartSettings
from stratarl.trainer.warmstart.sft import demo_shortfall, run_sft
from stratarl.trainer.warmstart.worlds import REHEARSAL_WORLD_OFFSET, reading_batches, world_batches, world_seed


def warm_start_key(cfg: Config) -> dict:
    """Everything a warm start depends on (the cache key of ``sft.cache``): not the RL settings. A bf16
    warm start (``trainer.precision`` resolving to bf16 on this machine) has its own key; fp32 keys carry no
    precision."""
    sft = dataclasses.asdict(cfg.sft)
    defaults = {f.name: f.default for f in dataclasses.fields(cfg.sft)}
    # Options at their defaults leave the keys of warm starts built before the options existed unchanged.
    for option in ("guess_on", "wrong_hop_pool", "open_fraction"):
        if sft[option] == defaults[option]:
            del sft[option]
    model = dataclasses.asdict(cfg.model)
    if model["word_vocabulary"] is None:  # unset, the keys of warm starts built before the option stay unchanged
        del model["word_vocabulary"]
    key = {
        "model": model,
        "data": dataclasses.asdict(cfg.data),
        "retrieval": dataclasses.asdict(cfg.retrieval),
        "max_obs_tokens": cfg.rollout.max_obs_tokens,
        "prompt_template": cfg.rollout.prompt_template,
        "sft": sft,
        "grad_clip": cfg.optim.grad_clip,
        "micro_batch_tokens": cfg.trainer.micro_batch_tokens,
    }
    if cfg.device_policy.precision == "bf16":  # the precision the warm start's forward passes run in
        key["precision"] = "bf16"
    # The demonstrations' protocol and tools (stratarl.trainer.warmstart.render); the defaults leave older keys as
    # they were.
    if cfg.rollout.protocol != "search_r1" or cfg.rollout.tools != ["search"] or cfg.rollout.tool_params:
        key["protocol"] = {
            "protocol": cfg.rollout.protocol,
            "tools": list(cfg.rollout.tools),
            "tool_params": cfg.rollout.tool_params,
        }
    return key


def warm_start_cache_dir(cfg: Config) -> Path:
    """``$STRATARL_CACHE/warmstart/<name>-<hash of warm_start_key(cfg)>``."""
    digest = hashlib.sha256(json.dumps(warm_start_key(cfg), sort_keys=True, default=str).encode()).hexdigest()[:12]
    return cache_root() / "warmstart" / f"{cfg.model.name}-{digest}"


def cached_warm_start(cfg: Config, *, rebuild: bool = False, progress: bool = True) -> tuple[Path, dict | None]:
    """The cached warm start of ``cfg`` (built on first use, or again with ``rebuild``): (model folder,
    summary of the build or None when it was reused). Built beside the cache and published by rename, so a
    crash never leaves a half-written model that a later run would trust. A warm start that fails its probe
    is kept, without a model, in ``<cache>.failed`` (a name no lookup reads), where its error points."""
    final = warm_start_cache_dir(cfg)
    if (final / "model" / "config.json").is_file() and not rebuild:
        return final / "model", None
    staged = staging_dir(final)
    try:
        summary = warm_start(cfg, staged, progress=progress)
    except WarmStartFailed as error:
        kept = publish_dir(staged, final.parent / f"{final.name}.failed")
        raise error.moved_to(kept) from None
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    publish_dir(staged, final)
    summary["model"] = str(final / "model")
    return final / "model", summary


def _stage_bar(settings: WarmStartSettings, enabled: bool, total: int, desc: str):
    """The progress display of one warm-start stage (``stratarl.infra.progress``), or None."""
    return progress_display(total, desc) if enabled and settings.progress else None


def _bar_step(bar, loss: float) -> None:
    if bar is not None:
        bar.set_postfix(loss=f"{loss:.3f}")
        bar.update(1)


def _reading_stage(settings: WarmStartSettings, model, tokenizer, *, progress: bool) -> dict:
    """Copy pre-training on fresh single-hop worlds (``sft.reading_steps``); returns its summary."""
    r = settings.reading
    started = time.perf_counter()
    bar = _stage_bar(settings, progress, r.steps, "sft reading")
    batches = reading_batches(settings, tokenizer, batch_size=r.batch_size, curriculum=r.curriculum)
    reading = run_sft(
        model,
        None,
        tokenizer.pad_token_id,
        lr=settings.lr,
        epochs=1,
        batch_size=r.batch_size,
        schedule="constant",
        batches=batches,
        total_steps=r.steps,
        on_step=lambda step, total, m: _bar_step(bar, m["sft/loss"]),
        **settings.loop.kwargs(),
    )
    if bar is not None:
        bar.close()
    reading["seconds"] = time.perf_counter() - started
    print(
        f"reading pre-training: {r.steps} steps in {reading['seconds']:.0f}s, answer loss "
        f"{reading['first_steps_loss']:.3f} -> {reading['last_steps_loss']:.3f}",
        flush=True,
    )
    return reading


def _probe_hook(
    settings: WarmStartSettings,
    model,
    tokenizer,
    logger: MetricsLogger,
    bar,
    total_steps: int,
    probes: list[ProbeResult],
):
    """``done(step)`` for ``run_sft``: the reading probe after ``sft.steps`` and every ``sft.probe_every`` steps
    after that; True once it passes. Each result is logged, printed and appended to ``probes``."""
    p, worlds = settings.probe, settings.worlds
    questions = probe_questions(worlds, p.questions, seed=world_seed(worlds.task_seed, PROBE_WORLD_OFFSET))

    def done(step: int) -> bool:
        if (step - total_steps) % p.every:
            return False
        model.eval()
        result = run_probe(model, tokenizer, p, questions, step=step)
        model.train()
        probes.append(result)
        logger.log(step, result.metrics())
        passed = result.passed(p.min_em)
        message = f"{result.line()}: {'passed' if passed else 'below'} sft.probe_min_em={p.min_em:g}"
        (bar.write if bar is not None else print)(message)
        if not passed and bar is not None:
            bar.total = min(bar.total + p.every, settings.step_limit)
        return passed

    return done


@dataclass
class DemoTally:
    """What the demonstration stage trained on, for the summary (the demonstrations themselves are not kept)."""

    kinds: Counter = field(default_factory=Counter)
    policy_tokens: int = 0

    def add(self, batch: Iterable[Demonstration]) -> None:
        for d in batch:
            self.kinds[d.kind] += 1
            self.policy_tokens += sum(d.response_mask)

    def counted(self, batches: Iterable[list[Demonstration]]) -> Iterator[list[Demonstration]]:
        """``batches``, each one counted as it is drawn."""
        for batch in batches:
            self.add(batch)
            yield batch


@dataclass
class DemoPlan:
    """The demonstration stage's input: a fixed list (``sft.source: task``) or a stream of batches (``worlds``)."""

    sample: list[Demonstration]
    demos: list[Demonstration] | None
    batches: Iterator[list[Demonstration]] | None
    total_steps: int


def _demo_plan(settings: WarmStartSettings, tokenizer, task, retriever, tally: DemoTally) -> DemoPlan:
    """The demonstrations: a stream of fresh worlds' (with their rehearsal), or the task's own questions rendered
    with ``retriever`` (the task's; None with ``sft.source: worlds``)."""
    s = settings
    if s.source == "worlds":
        stream = world_batches(settings, tokenizer, batch_size=s.batch_size)
        if s.reading.mix:
            # Rehearsal: without it, demonstrations erase the reading stage's copying in a few hundred steps
            # (held-out reading accuracy 1.00 -> 0.00 by step 200 on one world; docs/lab.md).
            rehearsal = reading_batches(
                settings, tokenizer, batch_size=s.reading.mix, curriculum=0, first_world=REHEARSAL_WORLD_OFFSET
            )
            stream = (demos + reads for demos, reads in zip(stream, rehearsal))
        sample = next(stream)
        return DemoPlan(sample, None, tally.counted(itertools.chain([sample], stream)), s.steps)
    demos = render_demonstrations(
        task.train,
        tokenizer,
        retriever,
        num_demos=s.num_demos,
        seed=s.seed,
        **s.style.kwargs(),
    )
    shortfall = demo_shortfall(s.num_demos, len(demos), len(task.train))
    if shortfall:
        print(shortfall, flush=True)
    tally.add(demos)
    return DemoPlan(demos, demos, None, math.ceil(len(demos) / s.batch_size) * s.epochs)


def _write_sample(path: Path, sample: list[Demonstration], tokenizer) -> None:
    with open(path, "w") as f:
        for d in sample[:5]:
            f.write(
                json.dumps(
                    {"kind": d.kind, "example_id": d.example_id, **d.meta, "text": tokenizer.decode(d.response_ids)}
                )
                + "\n"
            )


def _demo_stage(
    settings: WarmStartSettings, model, tokenizer, plan: DemoPlan, out_dir: Path, *, progress: bool
) -> tuple[dict, list[ProbeResult]]:
    """Fine-tune on the plan's demonstrations (until the probe passes, with ``sft.probe_every``); returns the
    optimizer loop's summary and the probes."""
    s = settings
    logger = MetricsLogger(out_dir, tensorboard=s.tensorboard, filename="sft_metrics.jsonl")
    bar = _stage_bar(s, progress, plan.total_steps, "sft")
    probes: list[ProbeResult] = []
    done = _probe_hook(s, model, tokenizer, logger, bar, plan.total_steps, probes) if s.probe.every else None

    def on_step(step: int, total: int, metrics: dict) -> None:
        logger.log(step, metrics)
        _bar_step(bar, metrics["sft/loss"])

    result = run_sft(
        model,
        plan.demos,
        tokenizer.pad_token_id,
        lr=s.lr,
        epochs=s.epochs,
        batch_size=s.batch_size,
        schedule=s.schedule,
        observation_weight=s.observation_loss,
        batches=plan.batches,
        total_steps=plan.total_steps if plan.batches is not None else None,
        on_step=on_step,
        done=done,
        max_steps=s.step_limit,
        **s.loop.kwargs(),
    )
    if bar is not None:
        bar.close()
    logger.close()
    return result, probes


def warm_start(cfg: Config, out_dir, *, progress: bool = True) -> dict:
    """`stratarl sft`: fine-tune the run's policy on demonstrations and save ``<out_dir>/model``.

    Uses the run config's model, data, retrieval (for observations), rollout caps and
    ``sft`` section. Writes ``sft_metrics.jsonl`` and ``demos_sample.jsonl`` next to the model.
    With ``sft.probe_every`` the demonstration stage runs until the reading probe passes
    (stratarl.trainer.warmstart.probe) and raises ``WarmStartFailed`` if it never does within ``sft.max_steps``.
    Returns a summary with the loss of the first and last epoch, the demo mix and the probes.
    """
    s = WarmStartSettings.from_config(cfg)  # the config stops here: the stages read these
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    torch.manual_seed(s.seed)
    task = load_task(cfg)
    model, tokenizer = load_policy(cfg.model, seed=s.seed, device=cfg.trainer.device, task=task)
    reading = _reading_stage(s, model, tokenizer, progress=progress) if s.reading.steps else None
    retriever = build_task_retriever(cfg, task) if s.source == "task" else None
    tally = DemoTally()
    plan = _demo_plan(s, tokenizer, task, retriever, tally)
    _write_sample(out_dir / "demos_sample.jsonl", plan.sample, tokenizer)
    result, probes = _demo_stage(s, model, tokenizer, plan, out_dir, progress=progress)
    if probes and not probes[-1].passed(s.probe.min_em):
        raise WarmStartFailed(probes[-1], s.probe.min_em, result["steps"], s.step_limit, out_dir)
    path = save_pretrained_model(model, tokenizer, out_dir / "model")
    summary = {
        **result,
        "model": str(path),
        "source": s.source,
        "reading": reading,
        "num_demos": sum(tally.kinds.values()),
        "demo_kinds": dict(tally.kinds),
        "policy_tokens": tally.policy_tokens,
        "probes": [dataclasses.asdict(p) for p in probes],
        "probe_passed": bool(probes) and probes[-1].passed(s.probe.min_em),
        "seconds": time.perf_counter() - started,
    }
    (out_dir / "sft_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
