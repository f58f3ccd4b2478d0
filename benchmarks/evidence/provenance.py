"""Provenance of an evidence run: what its result depends on beyond its design hash, recorded when it starts.

running.py stores it in the run's arm.json (``started``) and copies it into the committed summary
(``provenance``): commit and dirty flag, sha256 of the base config's contents, the warm start's digest,
torch's version, threads, CPU model. Standard library only (no torch import: the version is read from the
package metadata of the interpreter that trains).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
RESULTS = HERE / "results"


def child_env() -> dict:
    """The environment every process the runner starts gets: this one's, with one intra-op thread (the runs
    execute ``--jobs`` at a time, each on one thread); provenance records its thread settings."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return env


def commit() -> str | None:
    """The checkout's commit (short hash; None outside a git checkout)."""
    try:
        out = subprocess.run(
            ["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def file_sha256(path: Path) -> str:
    """sha256 (hex) of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def folder_digest(folder: Path) -> str | None:
    """sha256 over a folder's files (relative path and content digest of each, sorted): equal exactly when
    the files are; None when the folder does not exist."""
    if not folder.is_dir():
        return None
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(f"{path.relative_to(folder).as_posix()}\0{file_sha256(path)}\n".encode())
    return digest.hexdigest()


def dirty() -> bool | None:
    """Whether the checkout has uncommitted changes to tracked files (the committed summaries under
    results/ aside: a sweep writes them as it goes); None outside a git checkout."""
    try:
        out = subprocess.run(
            [
                "git",
                "-C",
                str(HERE),
                "status",
                "--porcelain",
                "--untracked-files=no",
                "--",
                ".",
                f":(exclude){RESULTS.relative_to(REPO).as_posix()}",
            ],
            capture_output=True,
            text=True,
            timeout=10,
            cwd=REPO,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return bool(out.stdout.strip()) if out.returncode == 0 else None


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux, else platform.processor())."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def override(overrides: list[str], key: str) -> str | None:
    """The last value ``overrides`` gives ``key`` (the one that wins), else None."""
    values = [o.split("=", 1)[1] for o in overrides if o.startswith(f"{key}=")]
    return values[-1] if values else None


def provenance(spec, env: dict | None = None) -> dict:
    """What the run ``spec`` (a planning.RunSpec: ``base`` path, ``overrides``) depends on beyond its design hash:
    the commit and whether the tree was dirty, the base config's contents (sha256, not its name), the warm
    start it loads (digest of the model files at model.init_from; None without one), torch's version, the
    threads it may use (``env``: the environment it runs in), the CPU model and Python's version."""
    env = dict(os.environ) if env is None else env
    init_from = override(spec.overrides, "model.init_from")
    try:
        torch_version = importlib.metadata.version("torch")  # the training interpreter's, without importing it
    except importlib.metadata.PackageNotFoundError:
        torch_version = None
    return {
        "commit": commit(),
        "dirty": dirty(),
        "base_config": Path(spec.base).name,
        "base_config_sha256": file_sha256(Path(spec.base)) if spec.base and Path(spec.base).is_file() else None,
        "warmstart_sha256": folder_digest(Path(init_from)) if init_from else None,
        "torch": torch_version,
        "python": platform.python_version(),
        "threads": {
            "trainer.num_threads": override(spec.overrides, "trainer.num_threads"),
            "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS"),
            "MKL_NUM_THREADS": env.get("MKL_NUM_THREADS"),
        },
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
    }
