"""Publish by rename: build a file or a folder beside its target, then rename it into place.

Every cache and checkpoint of stratarl is written this way, by these functions, with one rule set:

1. Build in ``staging_dir(target)``: a fresh sibling ``.<name>-XXXXXX`` on the same filesystem, so the
   final rename is atomic. A folder's files are fsynced before it is published.
2. If a target is already there and ``keep_existing(target)`` says it is complete (another process
   published a good one meanwhile), keep it and drop the staged copy.
3. Otherwise move an existing target aside first, to ``.replaced-<name>-XXXXXX/<name>`` (aside, then
   swap): at no moment is there neither the old copy nor the new one on disk. The old copy is deleted
   only once the new one is in place; a crash in between leaves it aside, where `recover_replaced` (or a
   checkpoint search) finds it.
4. Rename the staged folder to the target and fsync the parent folder.

A reader therefore sees the old target, the new one, or (in the instant between the two renames) the
moved-aside old one; never a half-written one. ``write_atomic`` does the same for a single file.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

REPLACED_PREFIX = ".replaced-"
"""Folders that hold a moved-aside old copy are named ``.replaced-<name>-XXXXXX``."""


def fsync_dir(path: Path) -> None:
    """fsync a folder's entry list (a rename inside it is then durable); a no-op where the OS refuses."""
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


def fsync_tree(folder: Path) -> None:
    """fsync every file directly inside ``folder``, then the folder itself."""
    for path in folder.iterdir():
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    fsync_dir(folder)


def staging_dir(target: str | Path) -> Path:
    """A new empty sibling folder of ``target`` to build it in (``.<name>-XXXXXX``)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))


def _share(folder: Path) -> None:
    # mkdtemp and the safetensors writer make owner-only entries; a shared cache must stay readable by
    # the machine's other users.
    folder.chmod(0o755)
    for path in folder.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)


def publish_dir(
    staged: str | Path,
    target: str | Path,
    *,
    keep_existing: Callable[[Path], bool] | None = None,
    readable_by_all: bool = False,
) -> Path:
    """Move the finished folder ``staged`` to ``target`` (the rules in the module docstring); returns ``target``.

    ``keep_existing(target)``: True when a target already there is complete and should be kept (then
    ``staged`` is deleted). ``readable_by_all``: make the published files readable by every user (a cache)."""
    staged, target = Path(staged), Path(target)
    if readable_by_all:
        _share(staged)
    fsync_tree(staged)
    if keep_existing is not None and target.exists() and keep_existing(target):
        shutil.rmtree(staged, ignore_errors=True)
        return target
    aside = None
    if target.exists():
        aside = Path(tempfile.mkdtemp(prefix=f"{REPLACED_PREFIX}{target.name}-", dir=target.parent))
        os.replace(target, aside / target.name)
    try:
        os.replace(staged, target)
    except OSError:
        # Another process published between our check and our rename: keep theirs if it is complete.
        if aside is None and keep_existing is not None and target.exists() and keep_existing(target):
            shutil.rmtree(staged, ignore_errors=True)
            return target
        raise  # a moved-aside old copy stays where recover_replaced (or a checkpoint search) finds it
    fsync_dir(target.parent)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    return target


@contextmanager
def staged_dir(
    target: str | Path, *, keep_existing: Callable[[Path], bool] | None = None, readable_by_all: bool = False
) -> Iterator[Path]:
    """``with staged_dir(target) as tmp:`` build the folder in ``tmp``; on a normal exit it is published at
    ``target`` (``publish_dir``), on an exception it is deleted and ``target`` is left as it was."""
    staged = staging_dir(target)
    try:
        yield staged
        publish_dir(staged, target, keep_existing=keep_existing, readable_by_all=readable_by_all)
    finally:
        if staged.exists():
            shutil.rmtree(staged, ignore_errors=True)


def write_atomic(path: str | Path, data: str | bytes, *, unique: bool = False) -> Path:
    """Write ``data`` to ``path`` through a fsynced temporary sibling ``.<name>.tmp`` and one rename. With
    ``unique`` the temporary name also holds the process id (several processes may write the same file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp" if unique else f".{path.name}.tmp")
    with open(tmp, "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def replaced_copies(parent: str | Path, name_prefix: str = "") -> list[Path]:
    """The moved-aside old copies under ``parent`` whose name starts with ``name_prefix`` (paths of the copies
    themselves, inside their ``.replaced-*`` folders)."""
    parent = Path(parent)
    if not parent.is_dir():
        return []
    return [
        c
        for p in sorted(parent.glob(f"{REPLACED_PREFIX}{name_prefix}*"))
        if p.is_dir()
        for c in sorted(p.iterdir())
        if c.is_dir()
    ]


def recover_replaced(target: str | Path) -> Path | None:
    """After a crash between the two renames of a replacement: put the moved-aside copy of ``target`` back
    when ``target`` itself is missing; returns the target when something was put back, else None."""
    target = Path(target)
    if target.exists():
        return None
    for copy in replaced_copies(target.parent, target.name):
        if copy.name == target.name:
            os.replace(copy, target)
            shutil.rmtree(copy.parent, ignore_errors=True)
            fsync_dir(target.parent)
            return target
    return None
