"""Whole documents by title: what the rollout's ``open`` tool reads.

A Search-R1 corpus stores a document as one or more passages whose ``contents`` start with the same title line
(Wikipedia dumps cut an article into 100-word passages). A document is therefore every passage of that title, in
corpus order. Titles match after `normalize_title` (quotes and surrounding whitespace stripped, case folded,
inner whitespace collapsed).

`title_lookup_for(retriever)` finds the lookup a retriever offers, in this order:

1. the retriever's own ``documents(titles)`` (any class can offer it: the `TitleLookup` Protocol);
2. a `TitleIndex` over its ``passages`` (BM25 and dense indexes hold them), built once per retriever on the
   first lookup (one pass over the corpus);
3. otherwise (a remote server), a search for the title whose hits are kept only when their title matches
   (`SearchTitleLookup`): the passages a search finds, not necessarily the whole document.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from stratarl.retrieval.base import Passage, Retriever


@runtime_checkable
class TitleLookup(Protocol):
    """Anything that returns, for each title, the passages of the document with that title (corpus order;
    empty when there is none). Raises on failure, as a retriever does."""

    def documents(self, titles: list[str]) -> list[list[Passage]]: ...


def normalize_title(title: str) -> str:
    """``'  "Paris" '`` -> ``'paris'``: quotes and outer whitespace stripped, case folded, inner whitespace
    collapsed."""
    return " ".join(title.strip().strip('"').strip().casefold().split())


class TitleIndex:
    """Title -> indices of its passages in ``passages``, built in one pass; ``documents`` reads only those."""

    def __init__(self, passages: Sequence[Passage]) -> None:
        self.passages = passages
        self._index: dict[str, list[int]] = {}
        for i, passage in enumerate(passages):
            self._index.setdefault(normalize_title(passage.title), []).append(i)

    def __len__(self) -> int:
        return len(self._index)

    def documents(self, titles: list[str]) -> list[list[Passage]]:
        return [[self.passages[i] for i in self._index.get(normalize_title(t), [])] for t in titles]


class SearchTitleLookup:
    """A retriever without its corpus at hand (a remote server): search each title and keep the hits whose
    title matches it (at most ``k`` passages of the document)."""

    def __init__(self, retriever: Retriever, k: int = 10) -> None:
        self.retriever = retriever
        self.k = k

    def documents(self, titles: list[str]) -> list[list[Passage]]:
        results = self.retriever.search(list(titles), self.k)
        return [
            [p for p in hits if normalize_title(p.title) == normalize_title(title)]
            for title, hits in zip(titles, results)
        ]


_BUILT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def title_lookup_for(retriever: object) -> TitleLookup:
    """The title lookup ``retriever`` offers (see the module docstring); a proxy's ``inner`` retriever is
    unwrapped first (``TimedRetriever``). A `TitleIndex` is built once per retriever object and kept while the
    retriever lives."""
    inner = getattr(retriever, "inner", retriever)
    if isinstance(inner, TitleLookup):
        return inner
    passages = getattr(inner, "passages", None)
    if passages is None:
        return SearchTitleLookup(retriever)  # type: ignore[arg-type]  # through the proxy: its faults are counted
    try:
        index = _BUILT.get(inner)
    except TypeError:  # an object that takes no weak reference: index it for this call only
        return TitleIndex(passages)
    if index is None:
        index = _BUILT[inner] = TitleIndex(passages)
    return index
