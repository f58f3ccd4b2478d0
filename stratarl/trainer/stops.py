"""When a run stops early: a signal (finish the step, checkpoint, exit 128 + the signal), a retriever or a
reward (an LLM judge) that keeps failing (stop with a checkpoint and a message naming it), or a step whose loss or
gradient is not finite (stop at once, keeping the checkpoints already written)."""

from __future__ import annotations

import math
import signal
import sys
from dataclasses import dataclass

from stratarl.retrieval.timed import TimedRetriever

STOP_SIGNALS = {"SIGINT": "Ctrl-C", "SIGTERM": "SIGTERM", "SIGHUP": "SIGHUP"}
RETRIEVAL_STOP_CODE = 3
"""Exit code of `stratarl train` when retrieval failures stopped the run (a signal gives 128 + its number)."""
NONFINITE_STOP_CODE = 4
"""Exit code of `stratarl train` when a step's loss or gradient was not finite (`nonfinite_step`)."""


class GracefulInterrupt:
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
        print(
            f"\n{what}: finishing this step, then saving a checkpoint (a second {what} aborts without saving)",
            file=sys.stderr,
            flush=True,
        )

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

    def check(self, step: int, retriever: TimedRetriever, skipped: bool = False, reward_fault: str = "") -> str | None:
        """After step ``step``: a warning line on stderr if searches failed; the stop message, or None.
        ``reward_fault``: the step's last reward fault (a judge that failed), when its rollouts were kept out."""
        total, failed = retriever.step_queries, retriever.step_failed
        if not failed and not skipped:
            self.failing_in_a_row, self.failing_seconds = 0, 0.0
            return None
        if skipped and not failed and reward_fault:  # the reward failed, not the retriever
            return self._reward_failed(step, reward_fault)
        outcome = "; the step took no update" if skipped else ""
        print(
            f"warning: step {step}: {failed} of {total} searches failed in {retriever.step_seconds:.1f} s"
            f"{outcome} ({retriever.where}: {one_line(retriever.last_error, 300)})",
            file=sys.stderr,
            flush=True,
        )
        if skipped or failed > self.max_failed_fraction * total:
            self.failing_in_a_row += 1
            self.failing_seconds += retriever.step_seconds
        else:
            self.failing_in_a_row, self.failing_seconds = 0, 0.0
        if self.max_failed_steps and self.failing_in_a_row >= self.max_failed_steps:
            return (
                f"retrieval failed: more than {self.max_failed_fraction:.0%} of the searches failed in "
                f"{self.failing_in_a_row} consecutive steps ({self.failing_seconds:.1f} s spent in searches); "
                f"retriever {retriever.where}; last error: {one_line(retriever.last_error, 500)}. Fix: check "
                "the server (or retrieval.spec), then resume (retrieval.max_failed_steps=0 never stops)"
            )
        return None

    def _reward_failed(self, step: int, reward_fault: str) -> str | None:
        """A step that took no update because its reward could not score its rollouts: warn, count, stop."""
        print(
            f"warning: step {step}: the step took no update: the reward could not score more than "
            f"{self.max_failed_fraction:.0%} of its rollouts ({one_line(reward_fault, 300)})",
            file=sys.stderr,
            flush=True,
        )
        self.failing_in_a_row += 1
        if self.max_failed_steps and self.failing_in_a_row >= self.max_failed_steps:
            return (
                f"reward failed: the reward could not score more than {self.max_failed_fraction:.0%} of the "
                f"rollouts in {self.failing_in_a_row} consecutive steps; last fault: {one_line(reward_fault, 500)}. "
                "Fix: check the judge's server (algo.reward_params.url), then resume "
                "(retrieval.max_failed_steps=0 never stops)"
            )
        return None


def one_line(text: str, limit: int) -> str:
    """``text`` on one line (newlines and runs of spaces folded), cut to ``limit`` characters with an ellipsis."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def nonfinite_step(step: int, metrics: dict[str, float]) -> str | None:
    """The stop message when step ``step``'s update met a loss or a gradient that is not finite (its optimizer
    skipped that step: ``optim/skipped_steps`` > 0, or ``loss/policy`` is NaN / inf); None when it is healthy.
    Training on would skip every later step as well, or train on garbage: the run stops instead."""
    skipped = float(metrics.get("optim/skipped_steps", 0.0))
    loss = float(metrics.get("loss/policy", 0.0))
    if skipped == 0.0 and math.isfinite(loss):
        return None
    what = f"the policy loss is not finite ({loss})" if not math.isfinite(loss) else "the gradient is not finite"
    return (
        f"step {step}: {what}, so its update cannot be applied. Fix: check the algorithm's parameters (algo.*, "
        "e.g. an advantage or loss parameter that makes NaN) and optim.lr, then resume from the last checkpoint"
    )
