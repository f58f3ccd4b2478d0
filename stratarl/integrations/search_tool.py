"""The search tool for veRL's tool agent loop: stratarl's ``/retrieve`` client + Search-R1's Doc format.

veRL 0.9.1 ships no search tool; its agent loop loads ``@function_tool`` functions from the file
named by ``actor_rollout_ref.rollout.multi_turn.function_tool_path`` (recipes/verl/search_tool.py
wraps :func:`search_documents`). The server is any Search-R1-compatible ``/retrieve`` endpoint,
normally ``stratarl serve`` (docs/compatibility.md, Retrieval server).

This module lives outside :mod:`stratarl.integrations.verl` on purpose: importing it registers no
stratarl plugin, so the recipe's tool serves plain veRL runs (veRL's own GRPO) as well
(docs/verl.md, "Search-R1 on veRL without the plugins"). It imports no veRL and no torch.

Environment: ``STRATARL_RETRIEVER_URL`` (default ``http://127.0.0.1:8000/retrieve``),
``STRATARL_RETRIEVER_TOPK`` (default 3), ``STRATARL_RETRIEVER_TIMEOUT_S`` (default 30).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence

from stratarl.retrieval.base import Retriever
from stratarl.retrieval.remote import RemoteRetriever
from stratarl.rollout.parsing import format_documents

DEFAULT_URL = "http://127.0.0.1:8000/retrieve"
MAX_QUERIES = 8
MAX_QUERY_CHARS = 2000

_lock = threading.Lock()
_retriever: Retriever | None = None


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {raw!r}") from None
    if value < 1:
        raise ValueError(f"environment variable {name} must be >= 1, got {value}")
    return value


def default_retriever() -> Retriever:
    """One shared :class:`~stratarl.retrieval.remote.RemoteRetriever` per process (thread-safe)."""
    global _retriever  # noqa: PLW0603  one client per process, made on first use (its connection pool is shared)
    with _lock:
        if _retriever is None:
            _retriever = RemoteRetriever(
                os.environ.get("STRATARL_RETRIEVER_URL", DEFAULT_URL),
                timeout_s=float(_env_int("STRATARL_RETRIEVER_TIMEOUT_S", 30)),
            )
        return _retriever


def search_documents(query_list: Sequence[str], *, retriever: Retriever | None = None, topk: int | None = None) -> str:
    """Search every query and return Search-R1's result text, one block per query.

    A single query gives ``Doc 1(Title: …) …`` lines exactly as Search-R1's ``<information>``
    content; the blocks of several queries are joined by one newline. Empty / oversized input is rejected
    with a message the model sees (veRL turns tool exceptions into tool responses).
    """
    if isinstance(query_list, str):
        query_list = [query_list]
    queries = [str(q).strip() for q in query_list if str(q).strip()]
    if not queries:
        raise ValueError("query_list is empty: pass at least one non-empty query")
    if len(queries) > MAX_QUERIES:
        raise ValueError(f"query_list has {len(queries)} queries; at most {MAX_QUERIES} per call")
    queries = [q[:MAX_QUERY_CHARS] for q in queries]
    k = topk if topk is not None else _env_int("STRATARL_RETRIEVER_TOPK", 3)
    hits = (retriever or default_retriever()).search(queries, k)
    return "\n".join(format_documents(passages).strip() for passages in hits)
