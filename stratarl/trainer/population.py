"""Populations: K training runs in one process, each through the solo run's own code, their heavy calls batched.

A sweep (arms x seeds x worlds) is many independent runs of one architecture. ``run_population`` trains them in
one process: each member runs ``stratarl train``'s own pipeline (``train_member``: stratarl.trainer.rl.train;
the command line passes the warm-start pipeline of `stratarl train`) in a thread of its own, one member at a
time (stratarl.infra.lockstep), so it builds its own run exactly as a solo run does: its config, run directory
(config.yaml, metrics.jsonl, transcripts/, checkpoints/, eval/, summary.json, laid out as a solo run's), task and
world, retriever, model, optimizer, data sampler, generator RNG and logger. Nothing is shared between members
but the process.

Two of the run's collaborators (``RunParts``, the seam a run offers for them) meet the other members' instead of
computing at once:

    generate   a member's generator (``PopulationGenerator``) hands its ``generate`` call to the population;
               the calls of every member that waits in one run together (stratarl.rollout.population_generate:
               each member's rows sampled with its own RNG and stop rules, the forward passes stacked)
    update     a member's ``update_policy`` call runs with the other members' (stratarl.trainer.population_update:
               each member's optimizer steps as alone, the forward / backward passes stacked)

With ``stack=False`` (the default) each call runs alone, on its member's objects, in the member's thread count: a
member's numbers are then its solo run's bit for bit (the same code on the same inputs). With ``stack=True`` the
calls run as one stacked computation and equal the solo run's up to float rounding (other kernels), so sampled
tokens can differ after some steps. On the lab's shapes (32 rollouts of ~200 tokens, a 64-wide policy) stacking
saves nothing: the ops are already large (compute-bound matmuls, attention at head size 16, elementwise passes
over 10^4-token activations), per-op overhead is a small share, and the stacked update recomputes each row's
prompt (the solo update shares it), so it is slower (docs/lab.md, "Sweeps as populations").

A member that fails (its warm start refused, an exception in a step, weights that became non-finite) is
dropped and reported (``MemberResult.error``), and the others go on; a member whose run stopped early (retrieval
failures, a non-finite step: a non-zero exit code in its summary) is reported as stopped (``MemberResult.status``). Resume is per member (``Member.resume``: its newest
checkpoint, as `stratarl train --resume`).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import torch

from stratarl.infra.lockstep import Lockstep
from stratarl.rollout.backends import make_generator
from stratarl.rollout.collect import collect
from stratarl.rollout.generation import Generation, Generator, SamplingParams
from stratarl.rollout.population_generate import GenerateCall, generate_together
from stratarl.trainer.batch import TrainBatch
from stratarl.trainer.config import Config
from stratarl.trainer.forward import PolicyForward
from stratarl.trainer.learner import Learner
from stratarl.trainer.population_update import UpdateCall, update_together
from stratarl.trainer.rl import train
from stratarl.trainer.run import RunParts
from stratarl.trainer.settings import UpdateSettings


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
    """A population's members' results, its wall time and what it batched (kind -> [members per call])."""

    members: list[MemberResult]
    seconds: float
    batches: dict[str, list[int]] = field(default_factory=dict)


class PopulationGenerator(Generator):
    """A member's generator: its own (``inner``: RNG, prefix cache, stop rules), whose ``generate`` calls run
    together with the other members' (``Lockstep.call("generate", ...)``). Checkpoints save ``rng``, which is
    the inner generator's."""

    def __init__(self, inner: Generator, lockstep: Lockstep) -> None:
        self.inner = inner
        self.lockstep = lockstep
        self.rng = inner.rng
        self.supports_cache_keys = inner.supports_cache_keys
        self.supports_capture = inner.supports_capture

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        max_new_tokens: Sequence[int] | None = None,
        cache_keys: Sequence | None = None,
        capture_layer: int | None = None,
    ) -> list[Generation]:
        call = GenerateCall(self.inner, prompts, params, max_new_tokens, cache_keys)
        return self.lockstep.call("generate", _Pending(call, capture_layer, torch.get_num_threads()))


_Call = TypeVar("_Call", GenerateCall, UpdateCall)


@dataclass
class _Pending(Generic[_Call]):
    """A call with what running it alone needs: the capture layer (never stacked) and the caller's thread count."""

    call: _Call
    capture_layer: int | None
    threads: int


@contextmanager
def _threads(n: int):
    """Run a handler's call in ``n`` intra-op threads (what the member's own step would have used)."""
    before = torch.get_num_threads()
    if before != n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def _generate_alone(pending: _Pending[GenerateCall]):
    call = pending.call
    extra: dict[str, Any] = {} if call.cache_keys is None else {"cache_keys": call.cache_keys}
    if pending.capture_layer is not None:
        extra["capture_layer"] = pending.capture_layer
    try:
        with _threads(pending.threads):
            return call.generator.generate(call.prompts, call.params, call.max_new_tokens, **extra)
    except Exception as error:  # noqa: BLE001 - this member's failure only
        return error


def _update_alone(pending: _Pending[UpdateCall]):
    call = pending.call
    try:
        with _threads(pending.threads):
            return call.alone()
    except Exception as error:  # noqa: BLE001 - this member's failure only
        return error


def _finite(call: UpdateCall, result):
    """``result``, or a ``FloatingPointError`` when the update left a non-finite weight (the member is dropped)."""
    if isinstance(result, BaseException):
        return result
    modules = [call.learner.model] + ([call.learner.value_head] if call.learner.value_head is not None else [])
    for module in modules:
        for name, param in module.named_parameters():
            if not bool(torch.isfinite(param).all()):
                return FloatingPointError(
                    f"the update left non-finite weights ({name}); the member is dropped "
                    "(its run directory keeps its last checkpoint)"
                )
    return result


class _Handlers:
    """The population's two batched calls. ``stack``: stacked computation (else each call alone, as solo);
    ``instrument(kind)``: a context each call runs in (a benchmark's FLOP counter), or None."""

    def __init__(self, stack: bool, threads: int, instrument: Callable[[str], AbstractContextManager] | None) -> None:
        self.stack = stack
        self.threads = threads
        self.instrument = instrument

    def __call__(self, kind: str):
        run = getattr(self, kind)

        def handler(batch):
            with self.instrument(kind) if self.instrument is not None else nullcontext():
                return run(batch)

        return handler

    def generate(self, batch: list[tuple[int, _Pending[GenerateCall]]]) -> list:
        pending = [p for _, p in batch]
        if not self.stack:
            return [_generate_alone(p) for p in pending]
        results: list = [None] * len(pending)
        stackable = [i for i, p in enumerate(pending) if p.capture_layer is None]
        for i, p in enumerate(pending):
            if p.capture_layer is not None:
                results[i] = _generate_alone(p)
        with _threads(self.threads):
            for i, out in zip(stackable, generate_together([pending[i].call for i in stackable])):
                results[i] = out
        return results

    def update(self, batch: list[tuple[int, _Pending[UpdateCall]]]) -> list:
        pending = [p for _, p in batch]
        with torch.enable_grad():
            if self.stack:
                with _threads(self.threads):
                    results = update_together([p.call for p in pending])
            else:
                results = [_update_alone(p) for p in pending]
        return [_finite(p.call, r) for p, r in zip(pending, results)]


def population_parts(lockstep: Lockstep) -> RunParts:
    """The collaborators of a population member's run: its own generator wrapped to meet the others', the solo
    collection, and an update that runs with the others'."""

    def member_generator(model, tokenizer, backend: str, *, seed: int, policy) -> Generator:
        return PopulationGenerator(make_generator(model, tokenizer, backend, seed=seed, policy=policy), lockstep)

    def member_update(
        learner: Learner,
        batch: TrainBatch,
        settings: UpdateSettings,
        generator: torch.Generator,
        *,
        forward: PolicyForward | None = None,
    ) -> dict[str, float]:
        call = UpdateCall(learner, batch, settings, generator, forward)
        return lockstep.call("update", _Pending(call, None, torch.get_num_threads()))

    return RunParts(make_generator=member_generator, collect=collect, update=member_update)


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


class _MemberLogs:
    """Each member's output (stdout and stderr) appended to its run directory's ``train.log`` while it runs."""

    def __init__(self, members: Sequence[Member], stack: ExitStack) -> None:
        self.stdout, self.stderr = sys.stdout, sys.stderr
        self.files = []
        for member in members:
            member.run_dir.mkdir(parents=True, exist_ok=True)
            log = open(member.run_dir / "train.log", "a", buffering=1)  # noqa: SIM115  the ExitStack closes it
            self.files.append(stack.enter_context(log))

    def __call__(self, index: int | None) -> None:
        target = (self.stdout, self.stderr) if index is None else (self.files[index], self.files[index])
        sys.stdout, sys.stderr = target


class MemberPipeline(Protocol):
    """How one member is run: ``train_member``, or the command line's warm start then RL (``run_pipeline``).
    A member with ``allow_lag_change`` also gets the keyword ``allow_lag_change=True``."""

    def __call__(
        self, cfg: Config, run_dir: Path, *, resume: bool, start_over: bool, parts: RunParts | None
    ) -> dict: ...


def run_population(
    members: Sequence[Member],
    *,
    pipeline: MemberPipeline = train_member,
    stack: bool = False,
    threads: int = 1,
    logs: bool = True,
    instrument: Callable[[str], AbstractContextManager] | None = None,
) -> PopulationReport:
    """Train ``members`` in this process (module docstring); returns each one's result. ``pipeline(cfg, run_dir,
    resume=, start_over=, parts=)`` runs one member (default ``train_member``); ``stack``: batched computation
    (False: each call alone, bit for bit the solo run); ``threads``: intra-op threads of the stacked calls;
    ``logs``: each member's output goes to its run directory's train.log; ``instrument(kind)``: a context every
    batched call of ``kind`` (generate, update) runs in (benchmarks/bench_sweep.py counts FLOPs with it)."""
    names = [m.name for m in members]
    if len(set(names)) != len(names) or len({Path(m.run_dir).resolve() for m in members}) != len(members):
        raise ValueError(f"population members need distinct names and run directories, got {names}")
    handlers = _Handlers(stack, threads, instrument)
    started = time.perf_counter()
    with ExitStack() as files:
        on_turn = _MemberLogs(members, files) if logs else None
        lockstep = Lockstep(
            {"generate": handlers("generate"), "update": handlers("update")},
            priority=("generate", "update"),
            on_turn=on_turn,
        )
        parts = population_parts(lockstep)
        bodies = [
            lambda m=m: pipeline(
                m.cfg,
                Path(m.run_dir),
                resume=m.resume,
                start_over=m.start_over,
                parts=parts,
                **({"allow_lag_change": True} if m.allow_lag_change else {}),
            )
            for m in members
        ]
        outcomes = lockstep.run(bodies)
    results = []
    for member, outcome in zip(members, outcomes):
        error = None if outcome.error is None else f"{type(outcome.error).__name__}: {outcome.error}"
        results.append(MemberResult(member.name, Path(member.run_dir), outcome.value, error, outcome.trace))
        if error is not None:
            print(
                f"population: member {member.name} failed and was dropped ({error}); run directory {member.run_dir}",
                file=sys.stderr,
                flush=True,
            )
    batches: dict[str, list[int]] = {}
    for kind, size in lockstep.batches:
        batches.setdefault(kind, []).append(size)
    return PopulationReport(results, time.perf_counter() - started, batches)
