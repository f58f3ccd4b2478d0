"""The RL loop of `stratarl train`, readable top to bottom.

    for each step:
        prompts   <- next P questions from a seeded sampler (state: epoch, position)
        rollouts  <- G rollouts per prompt: the multi-turn engine + the run's retriever
        rewards   <- outcome reward of each rollout's final answer (EM by default)
        strata    <- structural key of each rollout (number of searches by default; `random`: those
                     strata permuted inside each group, the control arm)
        old / ref log-probs, values  <- one no-grad pass of the trainer
        advantages <- the algorithm's estimator (``cfg.algo.spec.advantage``: a registered name)
        update    <- K epochs x M mini-batches of optimizer steps (policy loss at the spec's ratio level,
                     the spec's gradient normaliser if any, then gradient-norm clipping)
        log metrics (incl. stratum/cross_var, stratum/zero_san_frac, reward/em_by_type/*), transcripts;
        checkpoint every N steps

The algorithm is one value: ``algo.name`` picks a preset of stratarl.algos.presets (grpo,
stratified_grpo, ppo, so_ppo, so_grpo, drgrpo, gspo) and ``algo.advantage`` / ``policy_loss`` /
``ratio_level`` / ``normalizer`` / ``critic`` replace its parts (stratarl.trainer.algorithm). This
loop reads only the resolved parts, never the preset's name.
"""

from __future__ import annotations

import json
import shlex
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

import stratarl.trainer.rollouts as rollouts_module  # called through the module, so a test's spy on it is seen
import stratarl.trainer.update as update_module
from stratarl.algos.registry import AdvantageBatch, get_advantage
from stratarl.algos.strata import cross_stratum_variance, shuffle_strata_within_groups, zero_san_fraction
from stratarl.trainer import checkpoint as ckpt
from stratarl.trainer.batch import collate_rollouts, scatter_response_values
from stratarl.trainer.config import Config, save_config
from stratarl.trainer.evaluate import collection_config, eval_metrics, evaluate, format_table, overall, save_eval
from stratarl.trainer.metrics import MetricsLogger, PhaseTimer, format_step_line, write_transcripts
from stratarl.trainer.rollouts import (
    advantage_metrics,
    reward_function,
    rollout_metrics,
    stratum_function,
    transcript,
)
from stratarl.trainer.setup import SINGLE_THREAD_MAX_PARAMS, step_threads  # noqa: F401 (re-exported)
from stratarl.trainer.setup import TimedRetriever, build_task_retriever, limit_per_source, load_policy, load_task
from stratarl.trainer.precision import check_placement, policy_of
from stratarl.trainer.progress import progress
from stratarl.trainer.update import build_learner, score_batch

def compute_advantages(cfg: Config, batch, rewards: list[float], group_ids: list[int], strata: list[int]) -> None:
    """Fill ``batch.advantages`` and ``batch.returns`` [B, T] with the algorithm's estimator (``algo.spec``)."""
    spec = cfg.algo.spec
    device = batch.response_mask.device
    inputs = AdvantageBatch(rewards=torch.tensor(rewards, dtype=torch.float32, device=device),
                            group_ids=torch.tensor(group_ids, device=device),
                            response_mask=batch.response_mask, strata_ids=torch.tensor(strata, device=device),
                            values=batch.old_values)
    batch.advantages, batch.returns = get_advantage(spec.advantage)(inputs, **spec.advantage_params)


def advantage_strata(cfg: Config, observed: list[int], group_ids: list[int], step: int) -> list[int]:
    """The strata the advantage uses: the observed ones, or for ``algo.stratum_key: random`` the observed
    strata permuted inside each group (same sizes, random members; seeded by trainer.seed and the step,
    so a resumed run draws the same strata)."""
    if cfg.algo.stratum_key != "random":
        return list(observed)
    generator = torch.Generator().manual_seed(cfg.trainer.seed * 1_000_003 + step)
    return shuffle_strata_within_groups(torch.tensor(observed), torch.tensor(group_ids), generator).tolist()


def stratum_metrics(cfg: Config, collected, strata: list[int]) -> dict[str, float]:
    """stratum/cross_var and stratum/zero_san_frac on the strata the advantage used (see
    stratarl.algos.strata); with random strata also stratum/cross_var_observed on the real ones."""
    if not collected.rewards:
        return {}
    rewards, groups = torch.tensor(collected.rewards, dtype=torch.float64), torch.tensor(collected.group_ids)
    used = torch.tensor(strata)
    out = {"stratum/cross_var": float(cross_stratum_variance(rewards, groups, used)),
           "stratum/zero_san_frac": float(zero_san_fraction(rewards, groups, used))}
    if cfg.algo.stratum_key == "random":
        out["stratum/cross_var_observed"] = float(cross_stratum_variance(rewards, groups, torch.tensor(collected.strata)))
    return out


def em_by_type(examples: list, em: list[float], prefix: str = "reward/em_by_type") -> dict[str, float]:
    """Mean EM per ``metadata['question_type']`` (synthetic KB: single, 2hop, ...); {} when no example has one."""
    by_type: dict[str, list[float]] = {}
    for example, value in zip(examples, em):
        question_type = example.metadata.get("question_type") if example.metadata else None
        if question_type is not None:
            by_type.setdefault(str(question_type), []).append(value)
    return {f"{prefix}/{t}": sum(v) / len(v) for t, v in sorted(by_type.items())}


def fault_metrics(faulty: list[bool], max_failed_fraction: float, mini_batches: int) -> dict[str, float]:
    """``retrieval/faulty_rollout_frac``: the share of the step's rollouts kept out of the update because a
    search of theirs failed in the retriever; ``update/skipped`` 1.0 when the step takes no optimizer
    step: that share passes ``max_failed_fraction`` (retrieval.max_failed_fraction), or fewer clean
    rollouts remain than trainer.mini_batches needs."""
    share = sum(faulty) / max(1, len(faulty))
    clean = len(faulty) - sum(faulty)
    skipped = share > max_failed_fraction or (clean < mini_batches and clean < len(faulty))
    return {"retrieval/faulty_rollout_frac": share, "update/skipped": float(skipped)}


@dataclass
class RunState:
    """Everything a step reads or mutates, built once per run."""

    cfg: Config
    run_dir: Path
    model: torch.nn.Module
    tokenizer: object
    task: object
    retriever: object
    generator: object
    learner: object
    sampler: ckpt.DataSampler
    shuffle_rng: torch.Generator
    logger: MetricsLogger
    timer: PhaseTimer = field(default_factory=PhaseTimer)
    step: int = 0
    prompt_cache: dict = field(default_factory=dict)

    @property
    def ckpt_dir(self) -> Path:
        return self.run_dir / "checkpoints"


def rl_step(run: RunState) -> dict[str, float]:
    """One RL step: rollouts -> rewards -> strata -> advantages -> K x M updates. Returns its metrics.
    A small policy runs it on one thread (``step_threads``)."""
    with step_threads(run.model):
        metrics = _rl_step(run)
        metrics["perf/threads"] = float(torch.get_num_threads())
    return metrics


def _rl_step(run: RunState) -> dict[str, float]:
    cfg, timer = run.cfg, run.timer
    step_start = time.perf_counter()
    examples = [run.task.train[i] for i in run.sampler.next(cfg.trainer.prompts_per_step)]

    # The generator keeps the hidden states entering the lowest trainable layer: the frozen prefix the
    # update needs, already computed while sampling (None when the fast update does not run).
    capture = update_module.capture_layer(run.learner) if cfg.trainer.prefix_from_rollouts else None
    collected = rollouts_module.collect(run.generator, run.retriever, run.tokenizer, examples, collection_config(cfg),
                        group_size=cfg.rollout.group_size, prompt_cache=run.prompt_cache, capture_layer=capture)
    timer.add("generation", collected.generation_s)
    timer.add("retrieval", collected.retrieval_s)
    faulty = rollouts_module.faulty_rollouts(collected.rollouts)
    faults = fault_metrics(faulty, cfg.retrieval.max_failed_fraction, cfg.trainer.mini_batches)
    if faults["update/skipped"]:  # no optimizer step: the rewards are the broken retriever's
        metrics = {**rollout_metrics(collected), **faults, **timer.pop()}
        metrics["time/step"] = time.perf_counter() - step_start
        return metrics
    if any(faulty):
        collected = rollouts_module.without_rollouts(collected, faulty)
    strata = advantage_strata(cfg, collected.strata, collected.group_ids, run.step)

    batch = collate_rollouts(collected.rollouts, run.tokenizer.pad_token_id)
    batch.old_logprobs = scatter_response_values([r.sampling_logprobs for r in collected.rollouts], batch.response_lengths)
    batch = batch.to(cfg.trainer.device)
    with timer("frozen_prefix"):  # the frozen layers, once for the scoring pass and every optimizer step
        states = [r.frozen_states for r in collected.rollouts] if capture is not None else None
        prefix = update_module.batch_prefix(run.learner, batch, cfg, states=states)
    for rollout in collected.rollouts:
        rollout.frozen_states = None  # the states' memory, now in the prefix
    with timer("logprobs"):
        score_batch(run.learner, batch, cfg, prefix, shortcut=True)
    compute_advantages(cfg, batch, collected.rewards, collected.group_ids, strata)

    with timer("update"):
        update = update_module.update_policy(run.learner, batch, cfg, run.shuffle_rng, prefix=prefix)

    metrics = {**rollout_metrics(collected), **advantage_metrics(batch.advantages, batch.response_mask), **update,
               **stratum_metrics(cfg, collected, strata), **em_by_type(collected.examples, collected.em), **faults}
    metrics.update(timer.pop())
    metrics["perf/prefix_from_rollouts"] = float(prefix is not None and prefix.source == "rollouts")
    metrics["time/step"] = time.perf_counter() - step_start
    update_tokens = float(batch.attention_mask.sum()) * cfg.trainer.epochs
    metrics["perf/update_tokens_per_s"] = update_tokens / max(metrics.get("time/update", 0.0), 1e-9)
    generated = sum(sum(r.response_mask) for r in collected.rollouts)
    metrics["perf/generation_tokens_per_s"] = generated / max(collected.generation_s, 1e-9)
    if cfg.logging.num_transcripts:
        adv = batch.advantages[:, 0] if batch.advantages.shape[1] else torch.zeros(batch.size)
        records = [transcript(r, e, run.tokenizer, reward=rw, stratum=s, advantage=float(a))
                   for r, e, rw, s, a in zip(collected.rollouts, collected.examples, collected.rewards,
                                             strata, adv.tolist())][:cfg.logging.num_transcripts]
        write_transcripts(run.run_dir / "transcripts" / f"step_{run.step + 1:06d}.jsonl", records)
    return metrics


# --------------------------------------------------------------------------- checkpoints


def progress_state(run: RunState) -> dict:
    """The state a step advances even when it takes no optimizer step: RNGs and the data sampler (copies)."""
    return {"rng": ckpt.rng_state(getattr(run.generator, "rng", None)), "shuffle_rng": run.shuffle_rng.get_state(),
            "sampler": run.sampler.state_dict()}


def save(run: RunState, at: tuple[int, dict] | None = None) -> Path:
    """Checkpoint the run at its current step; ``at`` = (step, `progress_state` then) checkpoints that
    earlier step instead: the last healthy update, when only skipped steps followed it (weights,
    optimizer, scheduler and SORL statistic are unchanged since)."""
    step, progress = at if at is not None else (run.step, progress_state(run))
    state = {
        "optimizer": run.learner.optimizer.state_dict(),
        "scheduler": run.learner.scheduler.state_dict(),
        **progress,
    }
    if run.learner.normalizer is not None:
        state["sorl"] = run.learner.normalizer.state_dict()
    return ckpt.save_checkpoint(run.ckpt_dir, step, model=run.model, state=state,
                                value_head=run.learner.value_head, keep_last=run.cfg.trainer.keep_last)


def restore(run: RunState, path: Path) -> None:
    state = ckpt.load_checkpoint(path, model=run.model, value_head=run.learner.value_head)
    run.learner.optimizer.load_state_dict(state["optimizer"])
    run.learner.scheduler.load_state_dict(state["scheduler"])
    ckpt.set_rng_state(state["rng"], getattr(run.generator, "rng", None))
    run.shuffle_rng.set_state(state["shuffle_rng"])
    run.sampler.load_state_dict(state["sampler"])
    if run.learner.normalizer is not None and "sorl" in state:
        run.learner.normalizer.load_state_dict(state["sorl"])
    run.step = int(state["step"])


class NoCheckpointError(RuntimeError):
    """`--resume` found no intact checkpoint to continue from."""


def restore_newest(run: RunState) -> tuple[Path | None, list[str]]:
    """Restore the newest checkpoint that verifies and loads; returns it (None: none did) and one line
    per checkpoint skipped on the way. Stale temporary folders of killed writes are removed first."""
    ckpt.clean_stale(run.ckpt_dir)
    skipped: list[str] = []
    pointer = run.ckpt_dir / "latest"
    if pointer.exists() and ckpt.latest_checkpoint(run.ckpt_dir) is None:
        skipped.append(f"{pointer} does not name a checkpoint folder")
    for path in ckpt.checkpoint_candidates(run.ckpt_dir):
        try:
            restore(run, path)
        except (ckpt.CheckpointError, KeyError, TypeError) as error:
            skipped.append(str(error) if isinstance(error, ckpt.CheckpointError) else f"{path}: state.pt lacks {error}")
            continue
        return ckpt.reinstate(path), skipped
    return None, skipped


def resume_or_fail(run: RunState, *, start_over: bool) -> None:
    """Restore for `--resume`: the newest intact checkpoint (a warning names each one skipped); with
    none, step 0 only when ``start_over``, else `NoCheckpointError`. metrics.jsonl then loses the rows
    of steps after the restored one (they are trained again)."""
    path, skipped = restore_newest(run)
    for line in skipped:
        print(f"warning: skipped checkpoint: {line}", file=sys.stderr, flush=True)
    if path is None and not start_over:
        found = "; ".join(skipped) if skipped else f"{run.ckpt_dir} holds none"
        raise NoCheckpointError(f"--resume {run.run_dir}: no intact checkpoint to continue from ({found}). Fix: "
                                f"`stratarl train --resume {run.run_dir} --start-over` trains it again from step 0 "
                                "in the same directory (its metrics.jsonl is cleared)")
    if path is None:
        print(f"--start-over: no intact checkpoint in {run.ckpt_dir}; training from step 0", flush=True)
    else:
        print(f"resumed from {path} (step {run.step})", flush=True)
    redo_eval = run.step >= run.cfg.trainer.steps and run.cfg.eval.before_after
    run.logger.truncate(lambda row: row.get("step", 0) < run.step or (
        row.get("step") == run.step and run.step > 0 and not (redo_eval and "time/eval" in row)))


# --------------------------------------------------------------------------- setup


def build_run(cfg: Config, run_dir: Path, *, init_from: str | None = None) -> RunState:
    """Model, retriever, generator, optimizer, sampler and logger for ``cfg`` (fresh state)."""
    reward_function(cfg.algo.reward)  # a config-named function that cannot load fails before any work
    if cfg.algo.stratum_key != "random":
        stratum_function(cfg.algo.stratum_key, cfg.algo.stratum_cap)
    policy_of(cfg.trainer)  # bf16 on a GPU without it fails here, before any work
    torch.manual_seed(cfg.trainer.seed)
    task = load_task(cfg)
    retriever = TimedRetriever(build_task_retriever(cfg, task), budget_s=cfg.retrieval.step_budget_s)
    model_cfg = cfg.model if init_from is None else type(cfg.model)(**{**cfg.model.__dict__, "init_from": init_from})
    model, tokenizer = load_policy(model_cfg, seed=cfg.trainer.seed, device=cfg.trainer.device, task=task)
    total_optimizer_steps = cfg.trainer.steps * cfg.trainer.epochs * cfg.trainer.mini_batches
    learner = build_learner(model, cfg, total_optimizer_steps)
    check_placement(model, cfg.trainer.device, learner.value_head, learner.ref_model)
    generator = rollouts_module.make_generator(model, tokenizer, cfg.rollout.backend, seed=cfg.trainer.seed,
                                               precision=cfg.trainer.precision)
    logger = MetricsLogger(run_dir, tensorboard=cfg.logging.tensorboard, wandb=cfg.logging.wandb,
                           wandb_project=cfg.logging.wandb_project, config=cfg.to_dict())
    return RunState(cfg=cfg, run_dir=run_dir, model=model, tokenizer=tokenizer, task=task, retriever=retriever,
                    generator=generator, learner=learner, sampler=ckpt.DataSampler(len(task.train), cfg.trainer.seed),
                    shuffle_rng=torch.Generator().manual_seed(cfg.trainer.seed + 1), logger=logger)


STOP_SIGNALS = {"SIGINT": "Ctrl-C", "SIGTERM": "SIGTERM", "SIGHUP": "SIGHUP"}
RETRIEVAL_STOP_CODE = 3
"""Exit code of `stratarl train` when retrieval failures stopped the run (a signal gives 128 + its number)."""


class _GracefulInterrupt:
    """First Ctrl-C, SIGTERM or SIGHUP: finish the current step, checkpoint, exit with 128 + the signal
    number (130, 143, 129). A second one aborts at once."""

    def __init__(self) -> None:
        self.requested = False
        self.signum: int | None = None
        self._previous: dict = {}

    def __enter__(self):
        for name in STOP_SIGNALS:
            signum = getattr(signal, name, None)
            if signum is None:  # no SIGHUP on Windows
                continue
            try:
                self._previous[signum] = signal.signal(signum, self._handle)
            except ValueError:  # not the main thread (e.g. inside a notebook worker): no handler
                break
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested, self.signum = True, signum
        what = STOP_SIGNALS.get(signal.Signals(signum).name, str(signum))
        print(f"\n{what}: finishing this step, then saving a checkpoint (a second {what} aborts without saving)",
              file=sys.stderr, flush=True)

    @property
    def exit_code(self) -> int:
        return 128 + int(self.signum) if self.signum is not None else 0

    def __exit__(self, *exc) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)


@dataclass
class RetrievalWatch:
    """Warns on every step with a failed search; counts consecutive failing steps (more than
    ``max_failed_fraction`` of the searches failed, or the step took no update because of them) and
    the seconds they spent in searches, and says when ``max_failed_steps`` of them in a row should
    stop the run."""

    max_failed_fraction: float
    max_failed_steps: int
    failing_in_a_row: int = 0
    failing_seconds: float = 0.0

    def check(self, step: int, retriever, skipped: bool = False) -> str | None:
        """After step ``step``: a warning line on stderr if searches failed; the stop message, or None."""
        total, failed = retriever.step_queries, retriever.step_failed
        if not failed and not skipped:
            self.failing_in_a_row, self.failing_seconds = 0, 0.0
            return None
        outcome = "; the step took no update" if skipped else ""
        print(f"warning: step {step}: {failed} of {total} searches failed in {retriever.step_seconds:.1f} s"
              f"{outcome} ({retriever.where}: {one_line(retriever.last_error, 300)})", file=sys.stderr, flush=True)
        if skipped or failed > self.max_failed_fraction * total:
            self.failing_in_a_row += 1
            self.failing_seconds += retriever.step_seconds
        else:
            self.failing_in_a_row, self.failing_seconds = 0, 0.0
        if self.max_failed_steps and self.failing_in_a_row >= self.max_failed_steps:
            return (f"retrieval failed: more than {self.max_failed_fraction:.0%} of the searches failed in "
                    f"{self.failing_in_a_row} consecutive steps ({self.failing_seconds:.1f} s spent in searches); "
                    f"retriever {retriever.where}; last error: {one_line(retriever.last_error, 500)}. Fix: check "
                    "the server (or retrieval.spec), then resume (retrieval.max_failed_steps=0 never stops)")
        return None


def one_line(text: str, limit: int) -> str:
    """``text`` on one line (newlines and runs of spaces folded), cut to ``limit`` characters with an ellipsis."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[:limit - 3] + "..."


def _run_eval(run: RunState, tag: str) -> dict:
    examples = limit_per_source(run.task.test, run.cfg.data.max_eval_examples)
    if not examples:
        return {}
    with run.retriever.unbudgeted():
        result = evaluate(run.model, run.tokenizer, run.retriever, examples, run.cfg,
                          num_transcripts=run.cfg.eval.num_transcripts, progress=run.cfg.logging.progress,
                          desc=f"eval {tag}")
    save_eval(result, run.run_dir, tag)
    run.logger.log(run.step, {**eval_metrics(result), "time/eval": result["seconds"]})
    print(format_table(result, title=f"eval [{tag}] step {run.step}: {len(examples)} held-out questions"), flush=True)
    return overall(result)


def train(cfg: Config, run_dir: str | Path, *, resume: bool = False, init_from: str | None = None,
          start_over: bool = False) -> dict:
    """Run (or resume) RL training in ``run_dir``; returns a summary (final metrics, eval before/after).

    ``resume`` continues from the newest intact checkpoint (`resume_or_fail`); config.yaml is rewritten
    only once the run is built and restored, so a resume that fails leaves it as it was."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if not resume:
        save_config(cfg, run_dir / "config.yaml")
    run = build_run(cfg, run_dir, init_from=init_from)
    if resume:
        resume_or_fail(run, start_over=start_over)
        save_config(cfg, run_dir / "config.yaml")
    summary: dict = {"run_dir": str(run_dir), "algo": cfg.algo.name, "start_step": run.step}
    started = time.perf_counter()
    if cfg.eval.before_after and run.step == 0:
        summary["eval_before"] = _run_eval(run, "before")
    last: dict = {}
    bar = _step_bar(cfg, run.step)
    watch = RetrievalWatch(cfg.retrieval.max_failed_fraction, cfg.retrieval.max_failed_steps)
    stopped = None
    healthy = None  # (step, progress_state) of the last update while only skipped steps follow it
    with _GracefulInterrupt() as interrupt:
        while run.step < cfg.trainer.steps and not interrupt.requested and stopped is None:
            run.retriever.start_step()
            before = (run.step, progress_state(run))
            metrics = rl_step(run)
            skipped = bool(metrics.get("update/skipped"))
            healthy = (healthy or before) if skipped else None
            run.step += 1
            last = run.logger.log(run.step, metrics)
            if bar is not None:
                bar.set_postfix(reward=f"{last['reward/mean']:.3f}", em=f"{last['reward/em']:.3f}")
                bar.update(1)
            _print_line(bar, format_step_line(run.step, cfg.trainer.steps, last))
            stopped = watch.check(run.step, run.retriever, skipped)
            if cfg.trainer.save_every and run.step % cfg.trainer.save_every == 0 and healthy is None:
                save(run)
            if (cfg.trainer.eval_every and run.step % cfg.trainer.eval_every == 0 and run.step < cfg.trainer.steps
                    and stopped is None):
                _run_eval(run, f"step_{run.step:06d}")
        if bar is not None:
            bar.close()
        path = save(run, at=healthy)  # never a checkpoint newer than the last healthy update
        summary["checkpoint"] = str(path)
        if healthy is not None:
            summary["checkpoint_step"] = healthy[0]
        summary["interrupted"] = interrupt.requested
        summary["exit_code"] = interrupt.exit_code or (RETRIEVAL_STOP_CODE if stopped else 0)
    resume_hint = f"resume with `stratarl train --resume {shlex.quote(str(run_dir))}`"
    if healthy is not None:
        print(f"steps {healthy[0] + 1}-{run.step} took no update (retrieval faults): the checkpoint {path} holds "
              f"step {healthy[0]}, the last healthy update", file=sys.stderr, flush=True)
    if stopped is not None:
        print(f"error: {stopped}", file=sys.stderr, flush=True)
        print(f"stopped at step {run.step} (checkpoint {path}); {resume_hint}", flush=True)
        summary["retrieval_failure"] = stopped
    elif interrupt.requested:
        print(f"stopped at step {run.step}; {resume_hint}", flush=True)
    elif cfg.eval.before_after:
        summary["eval_after"] = _run_eval(run, "after")
    summary.update({"steps": run.step, "final": last, "train_seconds": time.perf_counter() - started})
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    run.logger.close()
    return summary


def _step_bar(cfg: Config, start: int):
    if not cfg.logging.progress:
        return None
    return progress(cfg.trainer.steps, "train", initial=start)


def _print_line(bar, line: str) -> None:
    if bar is not None:
        bar.write(line)
    else:
        print(line, flush=True)
