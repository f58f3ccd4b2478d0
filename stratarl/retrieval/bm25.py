"""BM25 retrieval over a Search-R1 corpus: `BM25Retriever`, searched in batches with torch.

The index is a precomputed sparse BM25 matrix (`stratarl.retrieval.bm25_build`: the same weights as
``bm25s``'s "lucene" method, saved in bm25s's own format); a batch of queries is scored with
``index_add_`` over each query term's postings and ranked with ``topk`` (about 6x bm25s's per-query
loop at 100k passages). ``load(mmap=True, mmap_corpus=True)`` serves a Wikipedia-size index from disk.
Text processing: `stratarl.retrieval.bm25_text`; the index directory: `stratarl.retrieval.bm25_build`.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Sequence
from pathlib import Path

import bm25s
import numpy as np
import torch

from stratarl.retrieval.base import Passage, ranked_passages, search_request
from stratarl.retrieval.bm25_build import bm25_index_meta, index_in_memory
from stratarl.retrieval.bm25_text import make_stemmer, stopword_set, tokenize_to_ids
from stratarl.retrieval.corpus import load_corpus
from stratarl.retrieval.index_files import (
    check_index_kind,
    index_passages,
    start_index_dir,
    write_index_meta,
    write_index_passages,
)


def sparse_top_k(
    weights: torch.Tensor,
    doc_ids: torch.Tensor,
    term_ptr: np.ndarray,
    num_docs: int,
    query_terms: list[list[int]],
    k: int,
    *,
    max_cells: int = 1 << 20,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores and top-k of sparse term-weight retrieval for a batch of queries.

    score[b, d] = Σ_{t ∈ query b} W[t, d], with W [V, N] stored by term (CSR over terms:
    ``term_ptr`` [V + 1], ``doc_ids`` and ``weights`` [nnz]), which is bm25s's precomputed
    BM25 matrix; a term repeated in a query counts each time (as in bm25s).
    Returns (scores [B, k], doc indices [B, k]) best first; ties are broken arbitrarily.

    Each posting list is added with one ``index_add_`` (a view, no copy) into a dense [rows, N]
    block (rows = max_cells // N, so memory stays bounded on big corpora; the default 4 MB block stays
    in cache: 16 MB blocks searched 1.7x fewer queries per CPU-second at 100k passages), then ``torch.topk`` row
    by row. Blocks come from ``np.zeros`` (calloc), and ops run on single rows, because torch's
    parallel ops (``zero_``, multi-row ``topk``) wait for its thread pool, which costs milliseconds
    per call on a busy machine: ~10x slower than this in our measurements.
    """
    if not 1 <= k <= num_docs:
        raise ValueError(f"k must be in [1, num_docs={num_docs}], got {k}")
    rows_per_chunk = max(1, min(len(query_terms), max_cells // num_docs))
    all_scores, all_indices = [], []
    for start in range(0, len(query_terms), rows_per_chunk):
        chunk = query_terms[start : start + rows_per_chunk]
        scores = torch.from_numpy(np.zeros((len(chunk), num_docs), dtype=np.float32))
        for row, terms in enumerate(chunk):
            for term in terms:
                lo, hi = int(term_ptr[term]), int(term_ptr[term + 1])
                scores[row].index_add_(0, doc_ids[lo:hi], weights[lo:hi])
        for row in scores:  # row by row: topk over several rows waits for torch's thread pool
            top_scores, top_indices = blocked_top_k(row, k)
            all_scores.append(top_scores)
            all_indices.append(top_indices)
    return torch.stack(all_scores), torch.stack(all_indices)


TOP_K_BLOCK = 1 << 18


def blocked_top_k(row: torch.Tensor, k: int, *, block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(row, k)`` of a 1-D tensor, computed over blocks of ``block`` entries and merged.

    The same top-k values (ties broken arbitrarily, as ``torch.topk``'s are); its cost is linear in
    ``row``'s length. ``torch.topk`` over one long row is not: on one core it took 3 ms at 1M entries,
    7 ms at 2M and 52 ms at 5M, against 2, 4 and 10 ms in 256k blocks (46 ms at 21M, Wikipedia's
    passage count), which made single-query BM25 throughput fall as N^-1.9 instead of ~1/N.
    """
    if row.dim() != 1 or not 1 <= k <= row.numel():
        raise ValueError(
            f"blocked_top_k needs a 1-D tensor and 1 <= k <= its length, got shape {tuple(row.shape)}, k={k}"
        )
    block = TOP_K_BLOCK if block is None else block
    if row.numel() <= block:
        return torch.topk(row, k)
    values, indices = [], []
    for start in range(0, row.numel(), block):
        part = row[start : start + block]
        top_values, top_indices = torch.topk(part, min(k, part.numel()))
        values.append(top_values)
        indices.append(top_indices + start)
    candidates, candidate_indices = torch.cat(values), torch.cat(indices)
    best, where = torch.topk(candidates, k)
    return best, candidate_indices[where]


class BM25Retriever:
    """Okapi BM25 (Robertson & Zaragoza 2009, Lucene's variant as bm25s's "lucene" method; k1=1.5, b=0.75)
    over a list of passages: score(q, d) = Σ_{t ∈ q} W[t, d], with the weights W of `bm25_weights`.

    Text is lower-cased, split on ``\\w\\w+``, English stop words removed and Snowball-stemmed
    (``stemmer=None`` turns stemming off). ``search`` returns at most ``k`` passages per query, best
    first; passages that share no term with the query (score 0) are left out, as Pyserini's BM25
    in Search-R1 does. Safe to call from several threads (only tokenisation is serialised).
    """

    def __init__(self, model, passages: Sequence[Passage], *, stemmer: str | None, stopwords: str | None) -> None:
        if model.scores["num_docs"] != len(passages):
            raise ValueError(
                f"BM25 index holds {model.scores['num_docs']} documents but the corpus has {len(passages)} passages; "
                "rebuild the index from this corpus"
            )
        self._model = model
        self.passages = passages
        self.stemmer_name = stemmer
        self.stopwords = stopwords
        self._stemmer = make_stemmer(stemmer)
        self._stopwords = stopword_set(stopwords)
        self._vocab = model.vocab_dict
        self._lock = threading.Lock()
        # torch views of bm25s's arrays (no copy; memory-mapped arrays stay mapped).
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only mmap arrays: we never write them
            self._weights = torch.from_numpy(np.asarray(model.scores["data"], dtype=np.float32))
            self._doc_ids = torch.from_numpy(np.asarray(model.scores["indices"]))
        self._term_ptr = np.asarray(model.scores["indptr"])

    def __len__(self) -> int:
        return len(self.passages)

    def __repr__(self) -> str:
        return f"BM25Retriever(num_passages={len(self.passages)}, stemmer={self.stemmer_name!r})"

    @classmethod
    def from_passages(
        cls,
        passages: list[Passage],
        *,
        stemmer: str | None = "english",
        stopwords: str | None = "en",
        k1: float = 1.5,
        b: float = 0.75,
    ) -> BM25Retriever:
        """Index passages (title and text both count: the whole ``contents`` is indexed)."""
        passages = list(passages)
        if not passages:
            raise ValueError("cannot build a BM25 index from an empty list of passages")
        model = index_in_memory([p.contents for p in passages], stemmer=stemmer, stopwords=stopwords, k1=k1, b=b)
        return cls(model, passages, stemmer=stemmer, stopwords=stopwords)

    @classmethod
    def from_corpus(cls, path: str | Path, **kwargs) -> BM25Retriever:
        """Build from a Search-R1 corpus jsonl (see `load_corpus`); kwargs as in `from_passages`."""
        return cls.from_passages(load_corpus(path), **kwargs)

    def save(self, index_dir: str | Path) -> Path:
        """Write the index and the corpus to ``index_dir`` (created if needed); returns it."""
        index_dir = start_index_dir(index_dir)
        self._model.save(index_dir, corpus=None, allow_pickle=False, show_progress=False)
        write_index_passages(self.passages, index_dir)
        meta = bm25_index_meta(
            len(self.passages), stemmer=self.stemmer_name, stopwords=self.stopwords, k1=self._model.k1, b=self._model.b
        )
        write_index_meta(index_dir, meta)
        return index_dir

    @classmethod
    def load(cls, index_dir: str | Path, *, mmap: bool = False, mmap_corpus: bool = False) -> BM25Retriever:
        """Load an index saved by `save` or `build_bm25_index`.

        ``mmap=True`` maps the score arrays instead of reading them; ``mmap_corpus=True`` reads
        passages from the index's ``corpus.jsonl`` when a search returns them (`CorpusFile`) instead
        of holding them all in memory. Both together: a Wikipedia-size index serves in little RAM.
        """
        index_dir = Path(index_dir)
        meta = check_index_kind(index_dir, "bm25")
        model = bm25s.BM25.load(index_dir, mmap=mmap, allow_pickle=False, load_corpus=False, show_progress=False)
        passages = index_passages(index_dir, mmap_corpus=mmap_corpus)
        return cls(model, passages, stemmer=meta.get("stemmer"), stopwords=meta.get("stopwords"))

    def search(self, queries: list[str], k: int) -> list[list[Passage]]:
        """Top-``k`` passages for each query, best first, scores attached; one list per query, in order."""
        queries, k_eff = search_request(queries, k, len(self.passages))
        if not queries:
            return []
        num_terms = len(self._term_ptr) - 1
        with self._lock:  # PyStemmer objects are not thread-safe
            query_terms, _ = tokenize_to_ids(
                queries, stopwords=self._stopwords, stemmer=self._stemmer, vocab=self._vocab
            )
        # bm25s's "" placeholder term has no postings (id num_terms): it contributes nothing.
        query_terms = [[t for t in terms if t < num_terms] for terms in query_terms]
        scores, indices = sparse_top_k(
            self._weights, self._doc_ids, self._term_ptr, len(self.passages), query_terms, k_eff
        )
        # A passage that shares no term with the query scores 0: it was not found.
        return ranked_passages(self.passages, indices.tolist(), scores.tolist(), keep=lambda i, s: s > 0.0)
