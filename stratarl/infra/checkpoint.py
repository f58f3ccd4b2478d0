"""Checkpoints written atomically, with everything an exact resume needs.

Layout of ``<run>/checkpoints/step_000004/``:

    model.safetensors     every parameter and buffer of the policy (LoRA included)
    value_head.safetensors  the critic's head (PPO family only)
    state.pt              optimizer, scheduler, RNG states, data sampler, step counter
                          (plain types and tensors only: loaded with weights_only=True)
    manifest.json         size and sha256 of every other file, written last

A checkpoint is written into a temporary sibling folder, completed by its manifest and
published by rename (stratarl.publish: a re-save of the same step moves the old folder aside
and deletes it only once the new one is in place); ``latest`` (a one-line text file) is then
replaced atomically. A kill at any instant therefore leaves at least one complete checkpoint;
`find_checkpoint` returns the newest one whose checksums match, naming what it skipped (a
moved-aside copy included).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_model, save_model

from stratarl.publish import (
    REPLACED_PREFIX,
    fsync_dir,
    fsync_tree,
    publish_dir,
    replaced_copies,
    staging_dir,
    write_atomic,
)

MANIFEST = "manifest.json"
REQUIRED_FILES = ("model.safetensors", "state.pt")
TMP_PREFIX = ".step_"  # stratarl.publish.staging_dir of a step_N folder
REPLACED_STEP_PREFIX = f"{REPLACED_PREFIX}step_"  # where publish_dir moves an old step_N aside


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
            take = order[self.position : self.position + (k - len(out))]
            out.extend(take)
            self.position += len(take)
            if self.position >= self.num_items:
                self.epoch, self.position = self.epoch + 1, 0
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "num_items": self.num_items, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["num_items"] != self.num_items:
            raise ValueError(
                f"checkpoint's data sampler saw {state['num_items']} training examples, this run has "
                f"{self.num_items}: resume with the same data config"
            )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


def rng_state(generator: torch.Generator | None = None) -> dict[str, Any]:
    """RNG states as tensors and plain types (loadable with weights_only=True)."""
    py = random.getstate()
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": [py[0], list(py[1]), py[2]]}
    if generator is not None:
        state["generator"] = generator.get_state()
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any], generator: torch.Generator | None = None) -> None:
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    if generator is not None and "generator" in state:
        generator.set_state(state["generator"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class CheckpointError(ValueError):
    """A checkpoint folder is incomplete or damaged (missing file, size or checksum mismatch)."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_manifest(folder: Path, step: int) -> None:
    """Fsync every file, then write ``manifest.json`` (size + sha256 of each) last: its presence means
    the folder is complete."""
    fsync_tree(folder)
    files = {f.name: {"bytes": f.stat().st_size, "sha256": _sha256(f)} for f in sorted(folder.iterdir())}
    body = json.dumps({"format": 1, "step": step, "files": files}, indent=1) + "\n"
    with open(folder / MANIFEST, "w") as f:
        f.write(body)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(folder)


def verify_checkpoint(path: str | Path) -> None:
    """Raise `CheckpointError` unless every file the manifest lists is there with its size and sha256.
    A folder without a manifest (written by stratarl before checksums) passes when its files exist."""
    path = Path(path)
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        for name in REQUIRED_FILES:
            if not (path / name).is_file():
                raise CheckpointError(f"{path}: no {MANIFEST} and no {name} (an incomplete write)")
        return
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        raise CheckpointError(f"{path}/{MANIFEST} is damaged (not the JSON stratarl writes)") from None
    for name in REQUIRED_FILES:
        if name not in files:
            raise CheckpointError(f"{path}/{MANIFEST} does not list {name}")
    for name, expected in files.items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"{f} is missing")
        size = f.stat().st_size
        if size != expected.get("bytes"):
            raise CheckpointError(
                f"{f} has {size} bytes, the manifest says {expected.get('bytes')} ("
                + size_mismatch_cause(size, expected.get("bytes"))
                + ")"
            )
        if _sha256(f) != expected.get("sha256"):
            raise CheckpointError(f"{f} fails its sha256 checksum (the file changed on disk after it was written)")


def size_mismatch_cause(size: int, expected: object) -> str:
    """Why a checkpoint file's size differs from its manifest: shorter is a write cut off (torn); longer
    means something wrote to it after the checkpoint was complete."""
    if isinstance(expected, int) and size < expected:
        return "cut short: a torn write"
    return "it grew after the checkpoint was written: something else wrote to it"


def shape_mismatches(model: torch.nn.Module, file: Path) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    """(name, shape in ``file``, shape in ``model``) for every tensor both have with different shapes,
    read from the safetensors header only."""
    with safe_open(str(file), framework="pt") as f:
        saved = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118  safe_open is not iterable
    return [
        (name, saved[name], tuple(t.shape))
        for name, t in model.state_dict().items()
        if name in saved and saved[name] != tuple(t.shape)
    ]  # in the model's order: the embedding first


def mismatch_message(path: Path, mismatches: list[tuple[str, tuple[int, ...], tuple[int, ...]]]) -> str:
    """One line: how many tensors differ, the first with both shapes, and the fix."""
    name, saved, own = mismatches[0]
    more = f" and {len(mismatches) - 1} more" if len(mismatches) > 1 else ""
    return (
        f"checkpoint {path} was saved from a different model: {name} is {list(saved)} there but {list(own)} "
        f"in this one{more}. Fix: use the model settings the run was trained with ({_run_config(path)})"
    )


def _run_config(path: Path) -> str:
    """Where a checkpoint's model settings are: model.* in its run's config.yaml."""
    run_config = Path(path).parent.parent / "config.yaml"
    return f"model.* in {run_config}" if run_config.is_file() else "model.* in the run's config.yaml"


def previous_checkpoint_note(root: Path) -> str:
    """What a failed save leaves to resume from: ``the previous checkpoint (step_N) is intact``, or, when the run
    wrote none yet, that a resume starts over."""
    try:
        have, _ = find_checkpoint(root)
    except OSError:
        have = None
    if have is None:
        return "no earlier checkpoint exists yet (a resume needs --start-over)"
    return f"the previous checkpoint ({Path(have).name}) is intact"


def _disk_error(error: OSError, root: Path) -> OSError:
    if error.errno == errno.ENOSPC:
        return OSError(
            errno.ENOSPC,
            f"disk full while writing a checkpoint under {root}; {previous_checkpoint_note(root)}. Fix: free space "
            "(or lower trainer.keep_last), then `stratarl train --resume RUN_DIR`",
        )
    if error.errno in (errno.EACCES, errno.EROFS, errno.EPERM):
        return OSError(
            error.errno,
            f"cannot write a checkpoint under {root} ({error.strerror}). Fix: make the run "
            "directory writable or choose another one with --run-dir",
        )
    return error


def save_checkpoint(
    ckpt_dir: str | Path,
    step: int,
    *,
    model: torch.nn.Module,
    state: dict[str, Any],
    value_head: torch.nn.Module | None = None,
    keep_last: int = 2,
) -> Path:
    """Write checkpoint ``step`` so that a kill at any instant leaves a loadable one, point ``latest``
    at it, prune to ``keep_last``.

    The files go to a temporary sibling folder, get a manifest (sha256 per file) last, and the folder
    is published by rename (``stratarl.publish.publish_dir``): re-saving an existing step moves the old
    folder aside first (``.replaced-step_N-*``) and deletes it only after the new one is in place, so there
    is always a complete copy on disk; ``find_checkpoint`` also looks at such a folder.
    """
    root = Path(ckpt_dir)
    final = root / f"step_{step:06d}"
    try:
        tmp = staging_dir(final)
    except OSError as error:
        raise _disk_error(error, root) from None
    try:
        save_model(model, str(tmp / "model.safetensors"))
        if value_head is not None:
            save_model(value_head, str(tmp / "value_head.safetensors"))
        torch.save({**state, "step": step}, tmp / "state.pt")
        _write_manifest(tmp, step)
        publish_dir(tmp, final)
        write_atomic(root / "latest", final.name + "\n")
        fsync_dir(root)
    except OSError as error:
        raise _disk_error(error, root) from None
    except (RuntimeError, SafetensorError) as error:
        # torch.save reports a full disk as "[enforce fail at inline_container.cc]", safetensors as
        # "IoError(Os { code: 28, kind: StorageFull ... })".
        free = shutil.disk_usage(root).free
        if free < (64 << 20) or "StorageFull" in str(error):
            raise OSError(
                errno.ENOSPC,
                f"disk full while writing a checkpoint under {root} ({free >> 20} MiB "
                f"free); {previous_checkpoint_note(root)}. Fix: free space, then `stratarl train --resume "
                "RUN_DIR`",
            ) from None
        raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    clean_stale(root)
    _prune(root, keep_last)
    return final


def clean_stale(root: str | Path) -> list[Path]:
    """Remove temporary folders left by killed writes (``.step_*``), and moved-aside old copies
    (``.replaced-*``) whose step folder is back in place. Returns what was removed."""
    root = Path(root)
    removed = []
    for tmp in sorted(root.glob(".latest*.tmp")) if root.is_dir() else []:
        tmp.unlink()
        removed.append(tmp)
    for p in sorted(root.glob(f"{TMP_PREFIX}*")) if root.is_dir() else []:
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    for p in sorted(root.glob(f"{REPLACED_STEP_PREFIX}*")) if root.is_dir() else []:
        inner = [c for c in p.iterdir() if c.is_dir()] if p.is_dir() else []
        if not inner or all((root / c.name).is_dir() for c in inner):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def _prune(root: Path, keep_last: int) -> None:
    steps = sorted(p for p in root.glob("step_*") if p.is_dir())
    latest = latest_checkpoint(root)
    for old in steps[:-keep_last]:
        if latest is None or old != latest:
            shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(ckpt_dir: str | Path) -> Path | None:
    """The checkpoint ``latest`` points at, or None when there is none (no checksum check: see
    `find_checkpoint`)."""
    root = Path(ckpt_dir)
    pointer = root / "latest"
    try:
        name = pointer.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    path = root / name
    return path if name.startswith("step_") and "/" not in name and path.is_dir() else None


def _step_of(path: Path) -> int:
    try:
        return int(path.name.split("_")[-1])
    except ValueError:
        return -1


def checkpoint_candidates(ckpt_dir: str | Path) -> list[Path]:
    """Checkpoint folders newest first: the one ``latest`` names, then every ``step_*`` by step, then
    moved-aside copies of a re-save that a kill interrupted."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return []
    folders = [p for p in root.glob("step_*") if p.is_dir()]
    folders += replaced_copies(root, "step_")
    ordered = sorted(folders, key=lambda p: (_step_of(p), p.parent == root), reverse=True)
    pointed = latest_checkpoint(root)
    if pointed is not None and pointed in ordered:
        ordered.remove(pointed)
        ordered.insert(0, pointed)
    return ordered


def find_checkpoint(ckpt_dir: str | Path) -> tuple[Path | None, list[str]]:
    """The newest checkpoint whose files pass `verify_checkpoint`, and one line per folder skipped on
    the way (why it was skipped). (None, skipped) when no intact checkpoint exists."""
    skipped = []
    root = Path(ckpt_dir)
    pointed = latest_checkpoint(root)
    if root.is_dir() and (root / "latest").exists() and pointed is None:
        skipped.append(f"{root / 'latest'} does not name a checkpoint folder")
    for path in checkpoint_candidates(root):
        try:
            verify_checkpoint(path)
        except CheckpointError as error:
            skipped.append(str(error))
            continue
        return path, skipped
    return None, skipped


def reinstate(path: str | Path) -> Path:
    """Move a checkpoint found in a moved-aside ``.replaced-*`` folder back to ``step_N`` and point
    ``latest`` at it (after a kill inside a re-save); other paths are returned unchanged."""
    path = Path(path)
    if not path.parent.name.startswith(REPLACED_STEP_PREFIX):
        return path
    root = path.parent.parent
    target = root / path.name
    if target.exists():
        return path
    os.replace(path, target)
    fsync_dir(root)
    write_atomic(root / "latest", target.name + "\n")
    clean_stale(root)
    return target


def load_checkpoint(
    path: str | Path, *, model: torch.nn.Module, value_head: torch.nn.Module | None = None
) -> dict[str, Any]:
    """Verify ``path`` (`verify_checkpoint`), load weights into ``model`` (and ``value_head``) in place,
    and return the training state dict. Raises `CheckpointError` on damaged files."""
    path = Path(path)
    if not (path / "state.pt").is_file() and not (path / MANIFEST).is_file():
        raise FileNotFoundError(
            f"{path} is not a stratarl checkpoint (no state.pt); pass a run directory or a checkpoints/step_* folder"
        )
    verify_checkpoint(path)
    _load_weights(model, path / "model.safetensors", path)
    if value_head is not None:
        _load_weights(value_head, path / "value_head.safetensors", path)
    try:
        state: dict[str, Any] = torch.load(path / "state.pt", weights_only=True)
        return state
    except (RuntimeError, EOFError, pickle.UnpicklingError) as error:
        raise CheckpointError(f"{path}/state.pt cannot be read ({str(error)[:200]})") from None


def _load_weights(module: torch.nn.Module, file: Path, path: Path) -> None:
    """Load ``file`` into ``module`` in place; a checkpoint of another model is one `ValueError` line."""
    try:
        mismatches = shape_mismatches(module, file)
        if mismatches:
            raise ValueError(mismatch_message(path, mismatches))
        missing, unexpected = load_model(module, str(file), strict=False)
    except (SafetensorError, OSError) as error:  # a corrupt header (a folder without a manifest)
        why = error.strerror if isinstance(error, OSError) and error.strerror else str(error)  # no "[Errno 2]"
        raise CheckpointError(f"{file} cannot be read ({' '.join(why.split())[:200]})") from None
    if missing or unexpected:
        names = sorted(missing)[:3] if missing else sorted(unexpected)[:3]
        what = (
            f"{len(missing)} tensor(s) the model has are missing there"
            if missing
            else f"it holds {len(unexpected)} tensor(s) the model lacks"
        )
        raise ValueError(
            f"checkpoint {path} was saved from a different model: {what} (e.g. {', '.join(names)}). "
            f"Fix: use the model settings the run was trained with ({_run_config(path)})"
        )
