"""Populations: K training runs in one process, one after another, each through the solo run's own code.

A sweep (arms x seeds x worlds) is many independent runs of one architecture. ``run_population`` trains them in
one process, in member order: each member runs ``stratarl train``'s own pipeline (``train_member``:
stratarl.trainer.rl.train; the command line passes the warm-start pipeline of `stratarl train`), so it builds its
own run exactly as a solo run does: its config, run directory (config.yaml, metrics.jsonl, transcripts/,
checkpoints/, eval/, summary.json, laid out as a solo run's), task and world, retriever, model, optimizer, data
sampler, generator RNG and logger. Nothing is shared between members but the process, so a member's numbers are
its solo run's bit for bit (the same code on the same inputs). What a population saves is what is per run: one
interpreter start and one import of torch (docs/lab.md, "Sweeps as populations").

A member that fails (its warm start refused, an exception in a step, an update that left non-finite weights) is
dropped and reported (``MemberResult.error``), and the next one starts; a member whose run stopped early
(retrieval failures, a non-finite step: a non-zero exit code in its summary) is reported as stopped
(``MemberResult.status``). A signal stops the member that runs as it stops a solo run (it finishes the step and
checkpoints), and the members after it do not start (``NOT_STARTED``). Resume is per member (``Member.resume``:
its newest checkpoint, as `stratarl train --resume`).
"""

from __future__ import annotations

import sys
import time
import traceback
from collections.abc import Sequence
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from stratarl.rollout.backends import make_generator
from stratarl.rollout.collect import collect
from stratarl.trainer.batch import TrainBatch
from stratarl.trainer.config import Config
from stratarl.trainer.forward import PolicyForward
from stratarl.trainer.learner import Learner
from stratarl.trainer.rl import train
from stratarl.trainer.run import RunParts
from stratarl.trainer.settings import UpdateSettings
from stratarl.trainer.update import update_policy


@dataclass
class Member:
    """One run of a population: what `stratarl train CONFIG --run-dir RUN_DIR` (or `--resume RUN_DIR`) runs."""

    name: str
    cfg: Config
    run_dir: Path
    resume: bool = False
    start_over: bool = False
    allow_lag_change: bool = False
    """With ``resume``: resume even when the checkpoint cannot reproduce the policy lags (`--allow-lag-change`)."""


@dataclass
class MemberResult:
    """How a member ended: its run's summary (as `stratarl train` returns it), or the error that dropped it.

    ``status``: ``done`` (it ran to the end, exit code 0), ``stopped`` (its run stopped early with a non-zero exit
    code: retrieval failures, a signal, a non-finite step; ``reason`` says which) or ``dropped`` (an exception ended
    it; ``error``). ``exit_code`` is what `stratarl train` would have exited with (1 for a dropped member)."""

    name: str
    run_dir: Path
    summary: dict | None = None
    error: str | None = None
    trace: str = ""

    @property
    def ok(self) -> bool:
        """Whether the member finished: ``done``, neither stopped early nor dropped."""
        return self.status == "done"

    @property
    def exit_code(self) -> int:
        if self.error is not None or self.summary is None:
            return 1
        return int(self.summary.get("exit_code", 0) or 0)

    @property
    def status(self) -> str:
        if self.error is not None or self.summary is None:
            return "dropped"
        return "stopped" if self.exit_code else "done"

    @property
    def reason(self) -> str:
        """Why the member did not finish ('' when done)."""
        if self.status == "dropped":
            return self.error or "no summary"
        if self.status == "stopped":
            return str((self.summary or {}).get("stop_reason") or f"exit code {self.exit_code}")
        return ""


@dataclass
class PopulationReport:
    """A population's members' results and its wall time."""

    members: list[MemberResult]
    seconds: float


def _finite(learner: Learner) -> None:
    """Raise ``FloatingPointError`` when an update left a non-finite weight (the member is then dropped)."""
    modules = [learner.model] + ([learner.value_head] if learner.value_head is not None else [])
    for module in modules:
        for name, param in module.named_parameters():
            if not bool(torch.isfinite(param).all()):
                raise FloatingPointError(
                    f"the update left non-finite weights ({name}); the member is dropped "
                    "(its run directory keeps its last checkpoint)"
                )


def member_update(
    learner: Learner,
    batch: TrainBatch,
    settings: UpdateSettings,
    generator: torch.Generator,
    *,
    forward: PolicyForward | None = None,
) -> dict[str, float]:
    """The solo run's ``update_policy``, then a check that the weights stayed finite (``_finite``)."""
    metrics = update_policy(learner, batch, settings, generator, forward=forward)
    _finite(learner)
    return metrics


MEMBER_PARTS = RunParts(make_generator=make_generator, collect=collect, update=member_update)
"""The collaborators of a member's run: the solo run's, its update followed by the finiteness check."""


def train_member(
    cfg: Config,
    run_dir: Path,
    *,
    resume: bool = False,
    start_over: bool = False,
    parts: RunParts | None = None,
    allow_lag_change: bool = False,
) -> dict:
    """A member's run without a warm start of its own (``model.init_from`` or a fresh model): ``rl.train``."""
    return train(cfg, run_dir, resume=resume, start_over=start_over, parts=parts, allow_lag_change=allow_lag_change)


@contextmanager
def _member_log(run_dir: Path, logs: bool):
    """The member's output (stdout and stderr) appended to its run directory's ``train.log`` while it runs."""
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    if not logs:
        yield
        return
    with open(Path(run_dir) / "train.log", "a", buffering=1) as log, redirect_stdout(log), redirect_stderr(log):
        yield


class MemberPipeline(Protocol):
    """How one member is run: ``train_member``, or the command line's warm start then RL (``run_pipeline``).
    A member with ``allow_lag_change`` also gets the keyword ``allow_lag_change=True``."""

    def __call__(
        self, cfg: Config, run_dir: Path, *, resume: bool, start_over: bool, parts: RunParts | None
    ) -> dict: ...


NOT_STARTED = "not started: a signal stopped the population before this member"


def run_population(
    members: Sequence[Member], *, pipeline: MemberPipeline = train_member, logs: bool = True
) -> PopulationReport:
    """Train ``members`` in this process, one after another (module docstring); returns each one's result.
    ``pipeline(cfg, run_dir, resume=, start_over=, parts=)`` runs one member (default ``train_member``);
    ``logs``: each member's output goes to its run directory's train.log."""
    names = [m.name for m in members]
    if len(set(names)) != len(names) or len({Path(m.run_dir).resolve() for m in members}) != len(members):
        raise ValueError(f"population members need distinct names and run directories, got {names}")
    started = time.perf_counter()
    results: list[MemberResult] = []
    for member in members:
        if any((r.summary or {}).get("interrupted") for r in results):
            results.append(MemberResult(member.name, Path(member.run_dir), error=NOT_STARTED))
            continue
        extra = {"allow_lag_change": True} if member.allow_lag_change else {}
        try:
            with _member_log(member.run_dir, logs):
                summary = pipeline(
                    member.cfg,
                    Path(member.run_dir),
                    resume=member.resume,
                    start_over=member.start_over,
                    parts=MEMBER_PARTS,
                    **extra,
                )
            results.append(MemberResult(member.name, Path(member.run_dir), summary))
        except (Exception, SystemExit) as failure:  # noqa: BLE001 - a member's failure is its own
            error = f"{type(failure).__name__}: {failure}"
            results.append(MemberResult(member.name, Path(member.run_dir), None, error, traceback.format_exc()))
            print(
                f"population: member {member.name} failed and was dropped ({error}); run directory {member.run_dir}",
                file=sys.stderr,
                flush=True,
            )
    return PopulationReport(results, time.perf_counter() - started)
