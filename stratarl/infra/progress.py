"""Progress a person can watch: a bar with an ETA on a terminal, a line every half minute elsewhere.

Warm starts and RL runs take minutes. On a terminal (stderr is a TTY) ``progress`` is a tqdm bar;
in a log file, a CI job or a notebook cell captured to text, a bar's carriage returns would be one
unreadable line, so it prints one plain line at most every ``interval_s`` seconds instead:

    sft: 120/800 steps (15%), loss=0.412, 2.10 s/step, elapsed 4m12s, ETA 23m48s
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, Protocol, TextIO


def format_duration(seconds: float) -> str:
    """``75`` -> ``1m15s``; ``3725`` -> ``1h02m``; under a minute: ``42s``."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class ProgressBar(Protocol):
    """What a progress display offers: tqdm's bar and ``LineProgress`` both have these."""

    def update(self, n: int = 1, /) -> object: ...

    def set_postfix(self, **values: Any) -> None: ...

    def write(self, text: str, /) -> None: ...

    def close(self) -> None: ...


class LineProgress:
    """The non-terminal progress display: the same ``update`` / ``set_postfix`` / ``write`` / ``close`` calls
    as a tqdm bar; prints a line when ``interval_s`` has passed since the last one, and at ``close``."""

    def __init__(
        self,
        total: int,
        desc: str,
        unit: str = "step",
        *,
        initial: int = 0,
        interval_s: float = 30.0,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total, self.desc, self.unit, self.n = int(total), desc, unit, int(initial)
        self.interval_s, self.stream, self.clock = interval_s, stream, clock
        self.postfix: dict[str, Any] = {}
        self.start = self.last = clock()
        self.start_n = self.n
        self.closed = False

    def _out(self) -> TextIO:
        return self.stream if self.stream is not None else sys.stderr

    def line(self) -> str:
        elapsed = self.clock() - self.start
        done = self.n - self.start_n
        parts = [
            f"{self.desc}: {self.n}/{self.total} {self.unit}s"
            + (f" ({100 * self.n / self.total:.0f}%)" if self.total else "")
        ]
        parts += [f"{k}={v}" for k, v in self.postfix.items()]
        if done > 0:
            per = elapsed / done
            parts.append(f"{per:.2f} s/{self.unit}")
            parts.append(f"elapsed {format_duration(elapsed)}")
            if self.total > self.n:
                parts.append(f"ETA {format_duration(per * (self.total - self.n))}")
        return ", ".join(parts)

    def update(self, n: int = 1) -> None:
        self.n += n
        now = self.clock()
        if now - self.last >= self.interval_s:
            self.last = now
            print(self.line(), file=self._out(), flush=True)

    def set_postfix(self, **values: Any) -> None:
        self.postfix = dict(values)

    def write(self, text: str) -> None:
        print(text, file=sys.stdout, flush=True)

    def close(self) -> None:
        if not self.closed and self.n > self.start_n:
            print(self.line(), file=self._out(), flush=True)
        self.closed = True


def progress(
    total: int, desc: str, unit: str = "step", *, initial: int = 0, leave: bool = True, interval_s: float = 30.0
) -> ProgressBar:
    """A tqdm bar on a terminal, else a ``LineProgress`` (see the module docstring)."""
    if sys.stderr.isatty():
        from tqdm.auto import tqdm  # optional at import time: `stratarl --help` stays fast

        return tqdm(total=total, initial=initial, desc=desc, unit=unit, dynamic_ncols=True, leave=leave)
    return LineProgress(total, desc, unit, initial=initial, interval_s=interval_s)
