"""Run-directory logging: metrics as JSONL + TensorBoard (+ W&B when asked), phase timers, transcripts.

Metric keys are namespaced (``reward/mean``, ``rollout/search_calls_mean``,
``loss/clip_frac``, ``sorl/c_norm``, ``time/generation``). ``metrics.jsonl`` has
one JSON object per step: ``{"step": s, "<key>": value, ...}``.
"""

from __future__ import annotations

import json
import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from stratarl.publish import write_atomic


def _plain(value: Any) -> Any:
    """Tensors / numpy scalars -> Python floats (``.item()`` happens here, in the logger only)."""
    if hasattr(value, "item") and getattr(value, "numel", lambda: 1)() == 1:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else value
    return value


class PhaseTimer:
    """Accumulates wall time per named phase: ``with timer("generation"): ...``."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.totals[phase] += time.perf_counter() - start

    def add(self, phase: str, seconds: float) -> None:
        self.totals[phase] += seconds

    def pop(self) -> dict[str, float]:
        """Return ``time/<phase>`` seconds since the last pop and reset."""
        out = {f"time/{k}": v for k, v in self.totals.items()}
        self.totals = defaultdict(float)
        return out


class MetricsLogger:
    """Writes ``metrics.jsonl`` and TensorBoard events under ``run_dir``; W&B optional."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        tensorboard: bool = True,
        wandb: bool = False,
        wandb_project: str = "stratarl",
        config: dict[str, Any] | None = None,
        filename: str = "metrics.jsonl",
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._path = self.run_dir / filename
        self._jsonl = open(self._path, "a", buffering=1)  # noqa: SIM115  open for the logger's life; close() closes it
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # optional: logging.tensorboard (pulls in tensorboard)

            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))
        self._wandb = None
        if wandb:
            try:
                import wandb as wandb_module  # optional dependency: logging.wandb
            except ImportError:
                raise RuntimeError(
                    "logging.wandb=true needs the wandb package: `pip install wandb`, or set logging.wandb=false"
                ) from None
            self._wandb = wandb_module.init(
                project=wandb_project,
                dir=str(self.run_dir),
                config=config or {},
                name=self.run_dir.name,
                resume="allow",
            )

    def log(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        """Record one step's metrics; returns them as plain Python values."""
        plain = {k: _plain(v) for k, v in metrics.items()}
        self._jsonl.write(json.dumps({"step": step, **plain}) + "\n")
        numeric = {k: v for k, v in plain.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self._tb is not None:
            for key, value in numeric.items():
                self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(numeric, step=step)
        return plain

    def truncate(self, keep: Callable[[dict[str, Any]], bool]) -> int:
        """Keep only the rows for which ``keep(row)`` is true (a resume drops the steps it trains again);
        the file is replaced atomically. Returns the number of rows dropped."""
        self._jsonl.close()
        rows = read_metrics(self.run_dir, self._path.name)
        kept = [row for row in rows if keep(row)]
        write_atomic(self._path, "".join(json.dumps(row) + "\n" for row in kept))
        self._jsonl = open(self._path, "a", buffering=1)  # noqa: SIM115  as in __init__: close() closes it
        return len(rows) - len(kept)

    def close(self) -> None:
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def write_transcripts(path: str | Path, transcripts: list[dict[str, Any]]) -> None:
    """One JSON object per line: prompt, turns, queries, passages, answer, reward, stratum."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for t in transcripts:
            f.write(json.dumps(t, ensure_ascii=False) + "\n")


def read_metrics(run_dir: str | Path, filename: str = "metrics.jsonl") -> list[dict[str, Any]]:
    """All rows of a run's metrics file (skipping a torn last line after a crash)."""
    rows: list[dict[str, Any]] = []
    path = Path(run_dir) / filename
    if not path.is_file():
        return rows
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def format_step_line(step: int, total: int, m: dict[str, Any]) -> str:
    """The one line per step printed to the terminal."""

    def g(key: str, fmt: str = "{:.3f}") -> str:
        v = m.get(key)
        return fmt.format(v) if isinstance(v, (int, float)) else "-"

    return (
        f"step {step}/{total} | reward {g('reward/mean')} | em {g('reward/em')} | "
        f"searches {g('rollout/search_calls_mean', '{:.2f}')} | loss {g('loss/policy', '{:+.4f}')} | "
        f"kl {g('loss/kl', '{:.4f}')} | clip {g('loss/clip_frac', '{:.3f}')} | "
        f"gnorm {g('optim/grad_norm', '{:.2f}')} | {g('time/step', '{:.1f}')}s | "
        f"{g('perf/update_tokens_per_s', '{:.0f}')} tok/s"
        + (" | no update (retrieval faults)" if m.get("update/skipped") else "")
        + (" | no update (nothing to train on)" if m.get("update/no_signal") else "")
        + (f" | kept {g('dynsample/kept_groups', '{:.0f}')} groups" if "dynsample/kept_groups" in m else "")
    )
