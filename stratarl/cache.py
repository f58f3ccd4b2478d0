"""Where stratarl keeps what it derives once and reuses (converted models, embeddings, synthetic tasks,
warm starts): ``$STRATARL_CACHE``, else ``~/.cache/stratarl``."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$STRATARL_CACHE`` or ``~/.cache/stratarl`` (read on every call, so tests can redirect it)."""
    return Path(os.environ.get("STRATARL_CACHE", Path.home() / ".cache" / "stratarl"))
