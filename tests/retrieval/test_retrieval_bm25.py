"""BM25Retriever: hand-derived scores, a slow reference BM25 as oracle, save/load, edge cases."""

from __future__ import annotations

import json
import math
from collections import Counter

import numpy as np
import pytest
import torch

from stratarl.retrieval.base import Passage, Retriever
from stratarl.retrieval.bm25 import BM25Retriever
from stratarl.retrieval.index_files import INDEX_META_FILE


def f32(values) -> torch.Tensor:
    """bm25s scores in float32: compare at float32's default tolerances."""
    return torch.tensor(values, dtype=torch.float32)


def reference_bm25_scores(passages, query, *, stemmer, stopwords, k1=1.5, b=0.75):
    """Slow loop BM25 (Lucene ≥ 8: no k1 + 1 factor) over bm25s's tokens: the oracle for the sparse one."""
    import bm25s
    import Stemmer

    stem = Stemmer.Stemmer(stemmer) if stemmer else None
    docs = bm25s.tokenize(
        [p.contents for p in passages], stopwords=stopwords, stemmer=stem, return_ids=False, show_progress=False
    )
    (query_tokens,) = bm25s.tokenize([query], stopwords=stopwords, stemmer=stem, return_ids=False, show_progress=False)
    n = len(docs)
    avgdl = sum(len(d) for d in docs) / n
    df = Counter(t for d in docs for t in set(d))
    scores = []
    for doc in docs:
        tf = Counter(doc)
        score = 0.0
        for term in query_tokens:  # a repeated query term counts each time, as in bm25s
            if tf[term] == 0:
                continue
            idf = math.log(1 + (n - df[term] + 0.5) / (df[term] + 0.5))
            score += idf * tf[term] / (tf[term] + k1 * (1 - b + b * len(doc) / avgdl))
        scores.append(score)
    return scores


def test_hand_derived_scores():
    # score = Σ idf(t) · tf / (tf + k1·(1 − b + b·|d|/avgdl)), idf = ln(1 + (N − df + 0.5)/(df + 0.5)).
    # N = 2, avgdl = (2 + 4) / 2 = 3, k1 = 1.5, b = 0.75, no stemming or stop words.
    # "banana": df 1 → idf = ln(1 + 1.5/1.5) = ln 2; d0 tf 1, |d| 2:
    #   1 / (1 + 1.5·(0.25 + 0.75·2/3)) = 1/2.125 → score ln2/2.125; d1 has no banana → left out.
    # "apple": df 2 → idf = ln(1 + 0.5/2.5) = ln 1.2; d0: ln1.2/2.125;
    #   d1 tf 2, |d| 4: 2 / (2 + 1.5·(0.25 + 0.75·4/3)) = 2/3.875 → d1 ranks first.
    passages = [Passage("d0", "apple banana"), Passage("d1", "apple apple cherry durian")]
    retriever = BM25Retriever.from_passages(passages, stemmer=None, stopwords=None)
    banana, apple = retriever.search(["banana", "apple"], k=2)
    assert [p.id for p in banana] == ["d0"]
    torch.testing.assert_close(f32([banana[0].score]), f32([math.log(2) / 2.125]))
    assert [p.id for p in apple] == ["d1", "d0"]
    torch.testing.assert_close(f32([p.score for p in apple]), f32([math.log(1.2) * 2 / 3.875, math.log(1.2) / 2.125]))


@pytest.mark.parametrize(
    "query", ["capital city of France", "running races", "the music of New Orleans", "mammals as pets"]
)
def test_matches_reference_implementation(small_passages, bm25_retriever, query):
    expected = reference_bm25_scores(small_passages, query, stemmer="english", stopwords="en")
    (hits,) = bm25_retriever.search([query], k=len(small_passages))
    positive = sorted(((s, i) for i, s in enumerate(expected) if s > 0), reverse=True)
    assert [p.id for p in hits] == [small_passages[i].id for _, i in positive]
    torch.testing.assert_close(f32([p.score for p in hits]), f32([s for s, _ in positive]))


def test_finds_the_right_passage_and_stems(bm25_retriever):
    results = bm25_retriever.search(["capital of Germany", "cats", "highest mountains", "who created python"], k=1)
    assert [hits[0].id for hits in results] == ["1", "2", "4", "3"]  # "cats"→"cat", "mountains"→"mountain"
    assert all(len(hits) == 1 and hits[0].score > 0 for hits in results)


def test_is_a_retriever_and_batched_equals_one_by_one(bm25_retriever):
    assert isinstance(bm25_retriever, Retriever)
    queries = ["jazz music", "light energy plants", "capital", "marathon running distance"]
    batched = bm25_retriever.search(queries, k=3)
    assert batched == [bm25_retriever.search([q], k=3)[0] for q in queries]
    assert all(len(hits) <= 3 for hits in batched)
    assert all(hits[i].score >= hits[i + 1].score for hits in batched for i in range(len(hits) - 1))


def test_edge_cases(bm25_retriever, small_passages):
    assert bm25_retriever.search([], k=3) == []
    # No query term in the vocabulary, only stop words, or nothing at all: no passage, not random ones.
    assert bm25_retriever.search(["zzzqqq", "the of and", ""], k=3) == [[], [], []]
    # k above the corpus size is clamped, not an error.
    (hits,) = bm25_retriever.search(["capital"], k=100)
    assert {p.id for p in hits} == {"0", "1"}
    for bad_k in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="k must be a positive integer"):
            bm25_retriever.search(["capital"], k=bad_k)
    with pytest.raises(ValueError, match="empty list of passages"):
        BM25Retriever.from_passages([])
    with pytest.raises(ValueError, match="unknown stemmer 'klingon'"):
        BM25Retriever.from_passages(small_passages, stemmer="klingon")


def test_save_load_round_trip_without_pickles(tmp_path, small_corpus_path, bm25_retriever):
    built = BM25Retriever.from_corpus(small_corpus_path)
    index_dir = built.save(tmp_path / "index")
    meta = json.loads((index_dir / INDEX_META_FILE).read_text())
    assert (meta["kind"], meta["num_passages"], meta["stemmer"]) == ("bm25", 8, "english")
    for npy in index_dir.glob("*.npy"):
        np.load(npy, allow_pickle=False)  # raises if any array was pickled
    loaded = BM25Retriever.load(index_dir)
    queries = ["capital of France", "domesticated pets", "programming"]
    assert loaded.search(queries, k=3) == bm25_retriever.search(queries, k=3)
    assert BM25Retriever.load(index_dir, mmap=True).search(queries, k=3) == loaded.search(queries, k=3)


def test_load_errors_are_clear(tmp_path, bm25_retriever):
    with pytest.raises(FileNotFoundError, match="not a stratarl index.*stratarl index build"):
        BM25Retriever.load(tmp_path)
    index_dir = bm25_retriever.save(tmp_path / "index")
    (index_dir / INDEX_META_FILE).write_text(json.dumps({"kind": "dense"}))
    with pytest.raises(ValueError, match="holds a 'dense' index"):
        BM25Retriever.load(index_dir)


def test_tokenizer_matches_bm25s(small_passages):
    import bm25s
    import Stemmer

    from stratarl.retrieval.bm25_text import stopword_set as _stopword_set
    from stratarl.retrieval.bm25_text import tokenize_to_ids

    texts = [p.contents for p in small_passages] + ["The CATS were running; it's 42 km!", ""]
    stemmer = Stemmer.Stemmer("english")
    ids, vocab = tokenize_to_ids(texts, stopwords=_stopword_set("en"), stemmer=stemmer)
    id_to_term = {i: t for t, i in vocab.items()}
    expected = bm25s.tokenize(texts, stopwords="en", stemmer=stemmer, return_ids=False, show_progress=False)
    assert [[id_to_term[i] for i in doc] for doc in ids] == expected
    # With a fixed vocabulary, unknown terms are dropped and the vocabulary is untouched.
    known, same_vocab = tokenize_to_ids(["cats zebra"], stopwords=frozenset(), stemmer=stemmer, vocab=vocab)
    assert known == [[vocab["cat"]]] and same_vocab is vocab and "zebra" not in vocab


def test_index_scores_equal_a_native_bm25s_index(small_passages, bm25_retriever):
    import bm25s
    import Stemmer

    from stratarl.retrieval.bm25 import sparse_top_k

    stemmer = Stemmer.Stemmer("english")
    native = bm25s.BM25()
    native.index(
        bm25s.tokenize([p.contents for p in small_passages], stemmer=stemmer, show_progress=False), show_progress=False
    )
    n = len(small_passages)
    for query in ["capital city of France", "cats pets", "highest mountain energy capital"]:
        (tokens,) = bm25s.tokenize([query], stemmer=stemmer, return_ids=False, show_progress=False)
        expected = native.get_scores(tokens)
        terms = [bm25_retriever._vocab[t] for t in tokens]
        scores, indices = sparse_top_k(
            bm25_retriever._weights, bm25_retriever._doc_ids, bm25_retriever._term_ptr, n, [terms], n
        )
        ours = torch.zeros(n).scatter_(0, indices[0], scores[0])
        torch.testing.assert_close(ours, torch.from_numpy(expected))


def test_sparse_top_k_chunking_and_hand_case():
    from stratarl.retrieval.bm25 import sparse_top_k

    # W (terms × docs) = [[1, 0, 2], [0, 3, 1]] stored by term: term 0 → docs 0, 2; term 1 → docs 1, 2.
    weights = torch.tensor([1.0, 2.0, 3.0, 1.0])
    doc_ids = torch.tensor([0, 2, 1, 2], dtype=torch.int32)
    term_ptr = np.array([0, 2, 4])
    queries = [[0], [1], [0, 1], [0, 0], []]
    # Query scores: [1,0,2], [0,3,1], [1,3,3], [2,0,4] (a repeated term counts twice), [0,0,0].
    expected = torch.tensor([[1.0, 0, 2], [0, 3, 1], [1, 3, 3], [2, 0, 4], [0, 0, 0]])
    for max_cells in (1, 3, 100):  # 1 query per block, 1 per block (3 docs), all at once
        scores, indices = sparse_top_k(weights, doc_ids, term_ptr, 3, queries, 3, max_cells=max_cells)
        torch.testing.assert_close(scores, expected.sort(dim=1, descending=True).values)
        torch.testing.assert_close(torch.gather(expected, 1, indices), scores)
    with pytest.raises(ValueError, match="k must be in"):
        sparse_top_k(weights, doc_ids, term_ptr, 3, queries, 4)
