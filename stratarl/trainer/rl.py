"""The RL loop of `stratarl train`, readable top to bottom.

    build the run once (stratarl.trainer.run.build_run): task, retriever, policy, learner, generator
    evaluate the held-out set before the first step
    for each step (stratarl.trainer.step.rl_step):
        prompts -> rollouts -> rewards -> strata -> scored batch -> advantages -> K x M updates
        log metrics and transcripts; checkpoint every N steps; evaluate every M steps
        stop early on a signal or a retriever that keeps failing (stratarl.trainer.stops)
    checkpoint (never newer than the last healthy update), evaluate after the last step, write summary.json

The algorithm is one value: ``algo.name`` picks a preset of stratarl.algos.presets (grpo,
stratified_grpo, ppo, so_ppo, so_grpo, drgrpo, gspo, gigpo) and ``algo.advantage`` / ``policy_loss`` /
``ratio_level`` / ``normalizer`` / ``critic`` replace its parts. ``Config.validate`` resolves it once
(``cfg.algorithm``); the loop reads the preset's name only as a label (summary.json's ``algo``), never to choose
what a step does.
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from stratarl.evaluation.greedy import eval_metrics, evaluate, format_table, overall, save_eval
from stratarl.infra.checkpoint import latest_checkpoint
from stratarl.infra.metrics import format_step_line
from stratarl.infra.progress import progress
from stratarl.trainer.config import Config, save_config
from stratarl.trainer.run import RunParts, RunState, build_run, progress_state, resume_or_fail, save
from stratarl.trainer.setup import eval_settings, limit_per_source
from stratarl.trainer.step import rl_step
from stratarl.trainer.stops import (
    NONFINITE_STOP_CODE,
    RETRIEVAL_STOP_CODE,
    GracefulInterrupt,
    RetrievalWatch,
    nonfinite_step,
)


def _run_eval(run: RunState, tag: str) -> dict:
    examples = limit_per_source(run.task.test, run.cfg.data.max_eval_examples)
    if not examples:
        return {}
    with run.retriever.unbudgeted():
        result = evaluate(
            run.model,
            run.tokenizer,
            run.retriever,
            examples,
            eval_settings(run.cfg, run.scoring),
            num_transcripts=run.cfg.eval.num_transcripts,
            progress=run.cfg.logging.progress,
            desc=f"eval {tag}",
        )
    save_eval(result, run.run_dir, tag)
    run.logger.log(run.step, {**eval_metrics(result), "time/eval": result["seconds"]})
    print(format_table(result, title=f"eval [{tag}] step {run.step}: {len(examples)} held-out questions"), flush=True)
    return overall(result)


@dataclass
class LoopState:
    """What the step loop leaves: the last step's metrics, why it stopped early (a retriever that keeps
    failing), and the last healthy update while only skipped steps follow it (step, progress state then)."""

    last: dict = field(default_factory=dict)
    stopped: str | None = None
    healthy: tuple[int, dict] | None = None
    code: int = 0
    """The exit code of an early stop (``stops.RETRIEVAL_STOP_CODE``, ``stops.NONFINITE_STOP_CODE``)."""


def train(
    cfg: Config,
    run_dir: str | Path,
    *,
    resume: bool = False,
    init_from: str | None = None,
    start_over: bool = False,
    parts: RunParts | None = None,
    step: Callable[[RunState], dict[str, float]] = rl_step,
    allow_lag_change: bool = False,
) -> dict:
    """Run (or resume) RL training in ``run_dir``; returns a summary (final metrics, eval before/after).

    ``resume`` continues from the newest intact checkpoint (`resume_or_fail`); config.yaml is rewritten
    only once the run is built and restored, so a resume that fails leaves it as it was; ``allow_lag_change``
    resumes even when the checkpoint cannot reproduce the policy lags (`LagResumeError` otherwise). ``parts`` and
    ``step``: the collaborators (a test injects a scripted generator, or wraps the step)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if not resume:
        save_config(cfg, run_dir / "config.yaml")
    run = build_run(cfg, run_dir, init_from=init_from, parts=parts)
    if resume:
        resume_or_fail(run, start_over=start_over, allow_lag_change=allow_lag_change)
        save_config(cfg, run_dir / "config.yaml")
    summary: dict = {"run_dir": str(run_dir), "algo": cfg.algo.name, "start_step": run.step}
    started = time.perf_counter()
    if cfg.eval.before_after and run.step == 0:
        summary["eval_before"] = _run_eval(run, "before")
    with GracefulInterrupt() as interrupt:
        state = _run_steps(run, step, interrupt)
        if state.code == NONFINITE_STOP_CODE:  # the weights of this step are suspect: keep the checkpoints on disk
            path = latest_checkpoint(run.ckpt_dir)
        else:
            path = save(run, at=state.healthy)  # never a checkpoint newer than the last healthy update
        summary["checkpoint"] = None if path is None else str(path)
        if state.healthy is not None:
            summary["checkpoint_step"] = state.healthy[0]
        summary["interrupted"] = interrupt.requested
        summary["exit_code"] = interrupt.exit_code or state.code
        if state.stopped is not None or interrupt.requested:
            summary["stop_reason"] = state.stopped or f"stopped by a signal (exit code {interrupt.exit_code})"
    _finish(run, state, path, summary, interrupted=interrupt.requested)
    summary.update({"steps": run.step, "final": state.last, "train_seconds": time.perf_counter() - started})
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    run.logger.close()
    return summary


def _run_steps(run: RunState, step: Callable[[RunState], dict[str, float]], interrupt: GracefulInterrupt) -> LoopState:
    """Steps until ``trainer.steps``, a stop signal, or a retriever that keeps failing; logs each, checkpoints
    every ``trainer.save_every`` (never while only skipped steps follow the last update) and evaluates every
    ``trainer.eval_every``."""
    cfg, state = run.cfg, LoopState()
    bar = progress(cfg.trainer.steps, "train", initial=run.step) if cfg.logging.progress else None
    watch = RetrievalWatch(cfg.retrieval.max_failed_fraction, cfg.retrieval.max_failed_steps)
    while run.step < cfg.trainer.steps and not interrupt.requested and state.stopped is None:
        run.retriever.start_step()
        before = (run.step, progress_state(run))
        metrics = step(run)
        skipped = bool(metrics.get("update/skipped"))
        state.healthy = (state.healthy or before) if skipped else None
        run.step += 1
        state.last = run.logger.log(run.step, metrics)
        if bar is not None:
            bar.set_postfix(reward=f"{state.last['reward/mean']:.3f}", em=f"{state.last['reward/em']:.3f}")
            bar.update(1)
        _print_line(bar, format_step_line(run.step, cfg.trainer.steps, state.last))
        state.stopped = watch.check(run.step, run.retriever, skipped, run.reward_fault if skipped else "")
        state.code = RETRIEVAL_STOP_CODE if state.stopped else 0
        if state.stopped is None and (bad := nonfinite_step(run.step, metrics)) is not None:
            state.stopped, state.code = bad, NONFINITE_STOP_CODE
            break
        if cfg.trainer.save_every and run.step % cfg.trainer.save_every == 0 and state.healthy is None:
            save(run)
        if (
            cfg.trainer.eval_every
            and run.step % cfg.trainer.eval_every == 0
            and run.step < cfg.trainer.steps
            and state.stopped is None
        ):
            _run_eval(run, f"step_{run.step:06d}")
    if bar is not None:
        bar.close()
    return state


def _finish(run: RunState, state: LoopState, path: Path | None, summary: dict, *, interrupted: bool) -> None:
    """How the run ended, on the terminal (with the resume command when it stopped early); the held-out eval
    after the last step when it ran to the end."""
    resume_hint = f"resume with `stratarl train --resume {shlex.quote(str(run.run_dir))}`"
    if state.healthy is not None:
        print(
            f"steps {state.healthy[0] + 1}-{run.step} took no update (retrieval faults): the checkpoint {path} "
            f"holds step {state.healthy[0]}, the last healthy update",
            file=sys.stderr,
            flush=True,
        )
    if state.stopped is not None:
        print(f"error: {state.stopped}", file=sys.stderr, flush=True)
        kept = f"checkpoint {path}" if path is not None else "no checkpoint was written yet"
        if path is None:
            resume_hint = f"train it again with `stratarl train --resume {shlex.quote(str(run.run_dir))} --start-over`"
        print(f"stopped at step {run.step} ({kept}); {resume_hint}", flush=True)
        if state.code == RETRIEVAL_STOP_CODE:
            summary["retrieval_failure"] = state.stopped
    elif interrupted:
        print(f"stopped at step {run.step}; {resume_hint}", flush=True)
    elif run.cfg.eval.before_after:
        summary["eval_after"] = _run_eval(run, "after")


def _print_line(bar, line: str) -> None:
    if bar is not None:
        bar.write(line)
    else:
        print(line, flush=True)
