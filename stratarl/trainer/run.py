"""A run's state, built once from its config, and its checkpoints (save, restore, resume).

``build_run`` resolves everything a step needs once: the settings of the step and the update (the algorithm
and the device policy among them: ``RunSettings``), the task, the retriever (timed, with the step's budget), the
policy and its learner (optimizer, scheduler, reference, critic, normaliser, policy loss), the generator, the
reward and stratum functions, the advantage estimator, the data sampler and the logger. ``RunParts`` are the
collaborators a step calls, each typed by a Protocol; each can be replaced (a test injects a scripted generator
or wraps the update) without touching a module global.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from stratarl.algos.registry import AdvantageBatch
from stratarl.infra import checkpoint as ckpt
from stratarl.infra.allocator import reuse_large_allocations
from stratarl.infra.metrics import MetricsLogger, PhaseTimer
from stratarl.infra.precision import DevicePolicy, check_placement
from stratarl.retrieval.timed import TimedRetriever
from stratarl.rollout.backends import make_generator
from stratarl.rollout.collect import CollectedBatch, Question, Scoring, collect
from stratarl.rollout.config import RolloutConfig
from stratarl.rollout.generation import Generator
from stratarl.trainer.batch import TrainBatch
from stratarl.trainer.behaviour import BehaviourPolicy, LagResumeError
from stratarl.trainer.config import Config
from stratarl.trainer.config.resolve import bound_advantage
from stratarl.trainer.forward import PolicyForward
from stratarl.trainer.learner import Learner, build_learner
from stratarl.trainer.settings import RunSettings, UpdateSettings
from stratarl.trainer.setup import build_task_retriever, load_policy, load_task, scoring_of
from stratarl.trainer.task import TaskData
from stratarl.trainer.update import update_policy

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class MakeGenerator(Protocol):
    """How a run makes its generator (``stratarl.rollout.backends.make_generator``)."""

    def __call__(
        self,
        model: torch.nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        backend: str,
        *,
        seed: int,
        policy: DevicePolicy,
    ) -> Generator: ...


class Collect(Protocol):
    """How a step collects its rollouts (``stratarl.rollout.collect.collect``)."""

    def __call__(
        self,
        generator: Generator,
        retriever: TimedRetriever,
        tokenizer: PreTrainedTokenizerBase,
        examples: Sequence[Question],
        rollout: RolloutConfig,
        scoring: Scoring,
        *,
        group_size: int,
        prompt_cache: dict | None = None,
        capture_layer: int | None = None,
    ) -> CollectedBatch: ...


class Update(Protocol):
    """How a step updates the policy on its train batch (``stratarl.trainer.update.update_policy``)."""

    def __call__(
        self,
        learner: Learner,
        batch: TrainBatch,
        settings: UpdateSettings,
        generator: torch.Generator,
        *,
        forward: PolicyForward | None = None,
    ) -> dict[str, float]: ...

    # An update may also take ``learner_logprobs`` (``update_policy``'s): the step then reads the learner's
    # log-probs of a one-optimizer-step update from its own forward (stratarl.trainer.step._mismatch_in_update).


class BoundAdvantage(Protocol):
    """The algorithm's advantage estimator with its parameters bound: (advantages, returns) [B, T]."""

    def __call__(self, batch: AdvantageBatch, /) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass(frozen=True)
class RunParts:
    """The collaborators a run calls: how it makes its generator, collects rollouts and updates the policy."""

    make_generator: MakeGenerator = make_generator
    collect: Collect = collect
    update: Update = update_policy


DEFAULT_PARTS = RunParts()
"""The collaborators of a run built without ``parts`` (the command line's runs; a test of the command line may
replace it, the one seam for that)."""


@dataclass
class RunState:
    """Everything a step reads or mutates, built once per run (``build_run``)."""

    cfg: Config
    """The config the run was built from: the loop's steps, checkpoints and evals read it; a step reads
    ``settings``."""
    settings: RunSettings
    """What the step and the update read, resolved once from ``cfg`` (the algorithm, the device policy)."""
    run_dir: Path
    model: torch.nn.Module
    tokenizer: PreTrainedTokenizerBase
    task: TaskData
    retriever: TimedRetriever
    generator: Generator
    learner: Learner
    scoring: Scoring
    advantage: BoundAdvantage
    """The algorithm's estimator with its parameters bound: ``advantage(AdvantageBatch) -> (advantages, returns)``."""
    sampler: ckpt.DataSampler
    shuffle_rng: torch.Generator
    logger: MetricsLogger
    parts: RunParts = field(default_factory=RunParts)
    timer: PhaseTimer = field(default_factory=PhaseTimer)
    step: int = 0
    prompt_cache: dict = field(default_factory=dict)
    reward_fault: str = ""
    """The last message of a reward that could not score a rollout (a judge's fault), for the stop message."""
    behaviour: BehaviourPolicy | None = None
    """The sampler copy and weight snapshots of a run with an off-policy source (trainer.policy_lag,
    rollout.precision); None: the learner samples (``generator`` runs on ``model``)."""

    @property
    def ckpt_dir(self) -> Path:
        return self.run_dir / "checkpoints"


def build_run(cfg: Config, run_dir: Path, *, init_from: str | None = None, parts: RunParts | None = None) -> RunState:
    """Model, retriever, generator, optimizer, sampler and logger for ``cfg`` (fresh state); ``parts``: the
    collaborators (default ``DEFAULT_PARTS``)."""
    parts = DEFAULT_PARTS if parts is None else parts
    reuse_large_allocations()  # the step's large tensors from memory the process holds, not fresh pages
    # A config-named reward or stratum function that cannot load, or bf16 asked of a GPU without it, fails here,
    # before any work.
    scoring = scoring_of(cfg)
    settings = RunSettings.from_config(cfg)
    torch.manual_seed(cfg.trainer.seed)
    task = load_task(cfg)
    retriever = TimedRetriever(build_task_retriever(cfg, task), budget_s=cfg.retrieval.step_budget_s)
    model_cfg = cfg.model if init_from is None else type(cfg.model)(**{**cfg.model.__dict__, "init_from": init_from})
    model, tokenizer = load_policy(model_cfg, seed=cfg.trainer.seed, device=cfg.trainer.device, task=task)
    total_optimizer_steps = cfg.trainer.steps * cfg.trainer.epochs * cfg.trainer.mini_batches
    learner = build_learner(model, cfg, total_optimizer_steps)
    check_placement(model, cfg.trainer.device, learner.value_head, learner.ref_model)
    behaviour = None
    if cfg.trainer.policy_lag > 0 or cfg.rollout.precision is not None:
        behaviour = BehaviourPolicy.create(
            model,
            precision=cfg.rollout.precision,
            learner_policy=settings.policy,
            max_lag=cfg.trainer.policy_lag,
            mode=cfg.trainer.policy_lag_mode,
            seed=cfg.trainer.seed,
        )
    generator = parts.make_generator(
        model if behaviour is None else behaviour.sampler,
        tokenizer,
        cfg.rollout.backend,
        seed=cfg.trainer.seed,
        policy=settings.policy if behaviour is None else behaviour.policy,
    )
    logger = MetricsLogger(
        run_dir,
        tensorboard=cfg.logging.tensorboard,
        wandb=cfg.logging.wandb,
        wandb_project=cfg.logging.wandb_project,
        config=cfg.to_dict(),
    )
    return RunState(
        cfg=cfg,
        settings=settings,
        run_dir=run_dir,
        model=model,
        tokenizer=tokenizer,
        task=task,
        retriever=retriever,
        generator=generator,
        learner=learner,
        scoring=scoring,
        advantage=bound_advantage(settings.algorithm),
        sampler=ckpt.DataSampler(len(task.train), cfg.trainer.seed),
        shuffle_rng=torch.Generator().manual_seed(cfg.trainer.seed + 1),
        logger=logger,
        parts=parts,
        behaviour=behaviour,
    )


# --------------------------------------------------------------------------- checkpoints


def progress_state(run: RunState) -> dict:
    """The state a step advances even when it takes no optimizer step: RNGs and the data sampler (copies)."""
    return {
        "rng": ckpt.rng_state(run.generator.rng),
        "shuffle_rng": run.shuffle_rng.get_state(),
        "sampler": run.sampler.state_dict(),
    }


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
    if run.behaviour is not None:
        state["behaviour"] = run.behaviour.state_dict(step)  # the stale weights the next k steps sample with
    return ckpt.save_checkpoint(
        run.ckpt_dir,
        step,
        model=run.model,
        state=state,
        value_head=run.learner.value_head,
        keep_last=run.cfg.trainer.keep_last,
    )


def restore(run: RunState, path: Path, *, allow_lag_change: bool = False) -> None:
    """Load checkpoint ``path`` into the run. A damaged weight snapshot is a `CheckpointError` (the caller falls
    back to an earlier checkpoint); a checkpoint that cannot reproduce the policy lags is a `LagResumeError`
    unless ``allow_lag_change``."""
    state = ckpt.load_checkpoint(path, model=run.model, value_head=run.learner.value_head)
    check_lags(run, state, path, allow_lag_change=allow_lag_change)
    run.learner.optimizer.load_state_dict(state["optimizer"])
    run.learner.scheduler.load_state_dict(state["scheduler"])
    ckpt.set_rng_state(state["rng"], run.generator.rng)
    run.shuffle_rng.set_state(state["shuffle_rng"])
    run.sampler.load_state_dict(state["sampler"])
    if run.learner.normalizer is not None and "sorl" in state:
        run.learner.normalizer.load_state_dict(state["sorl"])
    if run.behaviour is not None and "behaviour" in state:
        run.behaviour.load_state_dict(state["behaviour"], int(state["step"]))
    run.step = int(state["step"])


def check_lags(run: RunState, state: dict, path: Path, *, allow_lag_change: bool) -> None:
    """The behaviour state of checkpoint ``path``: its snapshots fit the model (else `CheckpointError`), and it
    reproduces the run's lags (else `LagResumeError`, or a warning with ``allow_lag_change``)."""
    saved = state.get("behaviour")
    if saved is not None and not isinstance(saved, dict):
        raise ckpt.CheckpointError(f"{path}/state.pt: its weight snapshots are damaged")
    if run.behaviour is not None and saved is not None:
        run.behaviour.check_shapes(saved, f"{path}/state.pt")
    try:
        if run.behaviour is not None:
            problem = run.behaviour.resume_problem(saved, int(state["step"]))
        elif saved is not None and int(saved.get("max_lag", 0)) > 0 and int(state["step"]) > 0:
            problem = f"the checkpoint was written with trainer.policy_lag {saved['max_lag']}, this run has 0"
        else:
            problem = None
    except (ValueError, TypeError) as error:  # lag settings that are not numbers: a damaged state.pt
        raise ckpt.CheckpointError(f"{path}/state.pt: its weight snapshots' settings are damaged ({error})") from None
    if problem is None:
        return
    if not allow_lag_change:
        raise LagResumeError(
            f"--resume {run.run_dir}: {problem}. Fix: resume with the run's own trainer.policy_lag and "
            "policy_lag_mode, or pass --allow-lag-change to resume with shorter lags on purpose"
        )
    print(f"warning: --allow-lag-change: {problem}", file=sys.stderr, flush=True)


class NoCheckpointError(RuntimeError):
    """`--resume` found no intact checkpoint to continue from."""


def restore_newest(run: RunState, *, allow_lag_change: bool = False) -> tuple[Path | None, list[str]]:
    """Restore the newest checkpoint that verifies and loads; returns it (None: none did) and one line
    per checkpoint skipped on the way. Stale temporary folders of killed writes are removed first."""
    ckpt.clean_stale(run.ckpt_dir)
    skipped: list[str] = []
    pointer = run.ckpt_dir / "latest"
    if pointer.exists() and ckpt.latest_checkpoint(run.ckpt_dir) is None:
        skipped.append(f"{pointer} does not name a checkpoint folder")
    for path in ckpt.checkpoint_candidates(run.ckpt_dir):
        try:
            restore(run, path, allow_lag_change=allow_lag_change)
        except (ckpt.CheckpointError, KeyError, TypeError) as error:
            skipped.append(str(error) if isinstance(error, ckpt.CheckpointError) else f"{path}: state.pt lacks {error}")
            continue
        return ckpt.reinstate(path), skipped
    return None, skipped


def resume_or_fail(run: RunState, *, start_over: bool, allow_lag_change: bool = False) -> None:
    """Restore for `--resume`: the newest intact checkpoint (a warning names each one skipped); with
    none, step 0 only when ``start_over``, else `NoCheckpointError`. metrics.jsonl then loses the rows
    of steps after the restored one (they are trained again)."""
    path, skipped = restore_newest(run, allow_lag_change=allow_lag_change)
    for line in skipped:
        print(f"warning: skipped checkpoint: {line}", file=sys.stderr, flush=True)
    if path is None and not start_over:
        found = "; ".join(skipped) if skipped else f"{run.ckpt_dir} holds none"
        raise NoCheckpointError(
            f"--resume {run.run_dir}: no intact checkpoint to continue from ({found}). Fix: "
            f"`stratarl train --resume {run.run_dir} --start-over` trains it again from step 0 "
            "in the same directory (its metrics.jsonl is cleared)"
        )
    if path is None:
        print(f"--start-over: no intact checkpoint in {run.ckpt_dir}; training from step 0", flush=True)
    else:
        print(f"resumed from {path} (step {run.step})", flush=True)
    redo_eval = run.step >= run.cfg.trainer.steps and run.cfg.eval.before_after
    run.logger.truncate(
        lambda row: (
            row.get("step", 0) < run.step
            or (row.get("step") == run.step and run.step > 0 and not (redo_eval and "time/eval" in row))
        )
    )
