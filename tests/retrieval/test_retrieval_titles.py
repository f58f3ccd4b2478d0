"""Whole documents by title (the `open` tool's side of retrieval)."""

from __future__ import annotations

import pytest

from stratarl.retrieval.base import Passage
from stratarl.retrieval.bm25 import BM25Retriever
from stratarl.retrieval.timed import TimedRetriever
from stratarl.retrieval.titles import SearchTitleLookup, TitleIndex, normalize_title, title_lookup_for

PASSAGES = [
    Passage("0", '"Paris"\nParis is the capital of France.'),
    Passage("1", '"Rome"\nRome is the capital of Italy.'),
    Passage("2", '"Paris"\nIt lies on the Seine.'),
    Passage("3", '"Paris (band)"\nA band.'),
]


@pytest.mark.parametrize(
    ("raw", "norm"), [('  "Paris" ', "paris"), ("Paris  (band)", "paris (band)"), ("ROME", "rome")]
)
def test_normalize_title(raw, norm):
    assert normalize_title(raw) == norm


def test_a_document_is_every_passage_of_its_title_in_corpus_order():
    index = TitleIndex(PASSAGES)
    assert len(index) == 3
    assert [[p.id for p in doc] for doc in index.documents(["paris", " Rome", "Berlin"])] == [["0", "2"], ["1"], []]


def test_a_bm25_index_is_looked_up_through_the_timed_proxy_and_indexed_once():
    bm25 = BM25Retriever.from_passages(PASSAGES)
    timed = TimedRetriever(bm25)
    lookup = title_lookup_for(timed)
    assert isinstance(lookup, TitleIndex) and lookup is title_lookup_for(bm25)
    assert [p.id for p in lookup.documents(["Paris (band)"])[0]] == ["3"]


def test_a_retriever_with_a_lookup_of_its_own_keeps_it():
    class Own:
        def search(self, queries, k):
            return [[] for _ in queries]

        def documents(self, titles):
            return [[PASSAGES[1]] for _ in titles]

    own = Own()
    assert title_lookup_for(own) is own


def test_without_the_corpus_a_search_keeps_only_hits_of_that_title():
    class Remote:
        def __init__(self):
            self.asked = []

        def search(self, queries, k):
            self.asked.append((list(queries), k))
            return [list(PASSAGES) for _ in queries]

    remote = Remote()
    lookup = title_lookup_for(remote)
    assert isinstance(lookup, SearchTitleLookup)
    assert [p.id for p in lookup.documents(["Paris"])[0]] == ["0", "2"]
    assert remote.asked == [(["Paris"], 10)]
