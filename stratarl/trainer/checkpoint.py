"""Checkpoints written atomically, with everything an exact resume needs.

Layout of ``<run>/checkpoints/step_000004/``:

    model.safetensors     every parameter and buffer of the policy (LoRA included)
    value_head.safetensors  the critic's head (PPO family only)
    state.pt              optimizer, scheduler, RNG states, data sampler, step counter
                          (plain types and tensors only: loaded with weights_only=True)

A checkpoint is written into a temporary sibling folder and renamed into place;
``latest`` (a one-line text file) is then replaced atomically. A crash at any
point leaves the previous ``latest`` checkpoint intact and loadable.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_model, save_model


@dataclass
class DataSampler:
    """Seeded epoch-wise shuffling whose whole state is (epoch, position).

    Epoch e visits ``randperm(n, seed + e)`` in order; ``next(k)`` returns the next
    k indices, rolling into the next epoch. Resuming at (epoch, position) gives
    exactly the indices a straight run would have drawn.
    """

    num_items: int
    seed: int
    epoch: int = 0
    position: int = 0

    def __post_init__(self) -> None:
        if self.num_items < 1:
            raise ValueError("DataSampler needs at least one item (the training set is empty)")

    def _order(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_items, generator=g).tolist()

    def next(self, k: int) -> list[int]:
        out: list[int] = []
        while len(out) < k:
            order = self._order(self.epoch)
            take = order[self.position:self.position + (k - len(out))]
            out.extend(take)
            self.position += len(take)
            if self.position >= self.num_items:
                self.epoch, self.position = self.epoch + 1, 0
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "num_items": self.num_items, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state["num_items"] != self.num_items:
            raise ValueError(f"checkpoint's data sampler saw {state['num_items']} training examples, this run has "
                             f"{self.num_items}: resume with the same data config")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


def rng_state(generator: torch.Generator | None = None) -> dict:
    """RNG states as tensors and plain types (loadable with weights_only=True)."""
    py = random.getstate()
    state = {"torch": torch.get_rng_state(), "python": [py[0], list(py[1]), py[2]]}
    if generator is not None:
        state["generator"] = generator.get_state()
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict, generator: torch.Generator | None = None) -> None:
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    if generator is not None and "generator" in state:
        generator.set_state(state["generator"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(ckpt_dir: str | Path, step: int, *, model: torch.nn.Module, state: dict[str, Any],
                    value_head: torch.nn.Module | None = None, keep_last: int = 2) -> Path:
    """Write checkpoint ``step`` atomically, point ``latest`` at it, prune to ``keep_last``."""
    root = Path(ckpt_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".step_{step:06d}-", dir=root))
    try:
        save_model(model, str(tmp / "model.safetensors"))
        if value_head is not None:
            save_model(value_head, str(tmp / "value_head.safetensors"))
        torch.save({**state, "step": step}, tmp / "state.pt")
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        _atomic_write_text(root / "latest", final.name + "\n")
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    _prune(root, keep_last)
    return final


def _prune(root: Path, keep_last: int) -> None:
    steps = sorted(p for p in root.glob("step_*") if p.is_dir())
    latest = latest_checkpoint(root)
    for old in steps[:-keep_last]:
        if latest is None or old != latest:
            shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(ckpt_dir: str | Path) -> Path | None:
    """The checkpoint ``latest`` points at, or None when there is none."""
    root = Path(ckpt_dir)
    pointer = root / "latest"
    if not pointer.is_file():
        return None
    path = root / pointer.read_text().strip()
    return path if (path / "state.pt").is_file() else None


def load_checkpoint(path: str | Path, *, model: torch.nn.Module, value_head: torch.nn.Module | None = None) -> dict:
    """Load weights into ``model`` (and ``value_head``) in place; return the training state dict."""
    path = Path(path)
    if not (path / "state.pt").is_file():
        raise FileNotFoundError(f"{path} is not a stratarl checkpoint (no state.pt); pass a run directory or a "
                                "checkpoints/step_* folder")
    try:
        missing, unexpected = load_model(model, str(path / "model.safetensors"), strict=False)
    except RuntimeError as error:  # shape mismatch
        raise ValueError(f"checkpoint {path} does not match the model ({str(error)[:300]}); resume with the same "
                         "model config") from None
    if missing or unexpected:
        raise ValueError(f"checkpoint {path} does not match the model: missing {sorted(missing)[:5]}, unexpected "
                         f"{sorted(unexpected)[:5]}; resume with the same model config")
    if value_head is not None:
        load_model(value_head, str(path / "value_head.safetensors"))
    return torch.load(path / "state.pt", weights_only=True)
