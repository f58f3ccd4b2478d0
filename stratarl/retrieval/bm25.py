"""BM25 retrieval over a Search-R1 corpus: PyStemmer tokens, a precomputed sparse BM25 matrix.

The matrix is built with a few vectorised numpy passes (the same weights as ``bm25s``'s
"lucene" method, about 3x faster to build) and searched in batches with torch (``index_add_`` +
``topk``, about 6x bm25s's per-query loop at 100k passages); it is saved and loaded in bm25s's
own format, so ``bm25s.BM25.load`` reads our indexes too.

Index directory layout (``BM25Retriever.save``)::

    stratarl_index.json   {"kind": "bm25", "format_version": 1, "stemmer", "stopwords", "num_passages", ...}
    corpus.jsonl          the passages, Search-R1 format, in index order
    corpus.offsets.npy    byte offset of each line (`build_bm25_index` only; for ``load(mmap_corpus=True)``)
    params.index.json, vocab.index.json, data/indices/indptr.csc.index.npy   (bm25s's own files)

`build_bm25_index(corpus, dir)` writes the same directory while streaming the corpus, in bounded memory
(Wikipedia's 21M passages on a 24 GB machine); ``load(mmap=True, mmap_corpus=True)`` serves it from disk.

Everything is JSON or ``.npy``; arrays are loaded with ``allow_pickle=False`` (bm25s's default,
passed explicitly here), so loading an index never unpickles anything.
"""

from __future__ import annotations

import json
import re
import shutil
import threading
import warnings
from array import array
from pathlib import Path

from typing import TYPE_CHECKING

import numpy as np

from stratarl.retrieval.base import Passage
from stratarl.retrieval.corpus import CorpusError, CorpusFile, corpus_line_offsets, iter_corpus, load_corpus, write_corpus

if TYPE_CHECKING:
    import torch

INDEX_META_FILE = "stratarl_index.json"
INDEX_CORPUS_FILE = "corpus.jsonl"
INDEX_OFFSETS_FILE = "corpus.offsets.npy"  # byte offset of each passage's line (written by build_bm25_index)
BM25_FORMAT_VERSION = 1


def index_passages(index_dir: Path, *, mmap_corpus: bool = False) -> list[Passage] | CorpusFile:
    """The passages of a saved index (BM25 or dense), in index order: its ``corpus.jsonl`` read into
    memory, or with ``mmap_corpus=True`` a `CorpusFile` reading each passage from disk when asked for
    (through ``corpus.offsets.npy`` when the index has one, else an offset table built on open)."""
    corpus_path = index_dir / INDEX_CORPUS_FILE
    if not mmap_corpus:
        return list(iter_corpus(corpus_path))
    offsets_path = index_dir / INDEX_OFFSETS_FILE
    offsets = np.load(offsets_path, mmap_mode="r", allow_pickle=False) if offsets_path.is_file() else None
    return CorpusFile(corpus_path, offsets)


def read_index_meta(index_dir: str | Path) -> dict:
    """The ``stratarl_index.json`` of an index directory, with a clear error when it is not one."""
    index_dir = Path(index_dir)
    meta_path = index_dir / INDEX_META_FILE
    if not meta_path.is_file():
        raise FileNotFoundError(
            f"{index_dir} is not a stratarl index (no {INDEX_META_FILE}). "
            "Build one with `stratarl index build --corpus CORPUS.jsonl --out DIR`."
        )
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{meta_path}: invalid JSON ({error.msg}); rebuild the index with `stratarl index build`") from None
    if not isinstance(meta, dict) or "kind" not in meta:
        raise ValueError(f"{meta_path}: expected a JSON object with a 'kind' field; rebuild the index")
    return meta


def _make_stemmer(name: str | None):
    if name is None:
        return None
    import Stemmer

    try:
        return Stemmer.Stemmer(name)
    except KeyError:
        raise ValueError(
            f"unknown stemmer {name!r}; valid PyStemmer languages: {', '.join(sorted(Stemmer.algorithms()))} (or None)"
        ) from None


def _check_k(k: int) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive integer, got {k!r}")


_WORD = re.compile(r"(?u)\b\w\w+\b")  # scikit-learn's / bm25s's token pattern


def _stopword_set(stopwords: str | None) -> frozenset[str]:
    from bm25s.tokenization import _infer_stopwords

    return frozenset(_infer_stopwords(stopwords))


def tokenize_to_ids(
    texts: list[str], *, stopwords: frozenset[str], stemmer, vocab: dict[str, int] | None = None
) -> tuple[list[list[int]], dict[str, int]]:
    """Lower-case → words of 2+ word characters → drop stop words → stem → term ids.

    The same text processing as ``bm25s.tokenize`` (which rebuilds the stop-word set once per
    text: most of its time). With ``vocab`` (the index's term → id), unknown terms are dropped
    and the vocabulary is not changed; without it a new vocabulary is built and returned.
    Each distinct word is stemmed once.
    """
    word_ids: dict[str, int] = {}
    docs_as_word_ids = []
    for text in texts:
        ids = []
        for word in _WORD.findall(text.lower()):
            if word in stopwords:
                continue
            word_id = word_ids.get(word)
            if word_id is None:
                word_id = word_ids[word] = len(word_ids)
            ids.append(word_id)
        docs_as_word_ids.append(ids)
    words = list(word_ids)
    stems = stemmer.stemWords(words) if stemmer is not None else words
    if vocab is None:
        new_vocab: dict[str, int] = {}
        term_of_word = [new_vocab.setdefault(stem, len(new_vocab)) for stem in stems]
        return [[term_of_word[i] for i in ids] for ids in docs_as_word_ids], new_vocab
    term_of_word = [vocab.get(stem, -1) for stem in stems]
    docs = [[term_of_word[i] for i in ids if term_of_word[i] >= 0] for ids in docs_as_word_ids]
    return docs, vocab


def bm25_matrix(
    docs: list[list[int]], num_terms: int, *, k1: float, b: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """BM25 weights of every (term, document) pair, stored by term (CSR over terms).

    W[t, d] = IDF(t) · tf(t,d) / (tf(t,d) + k1·(1 − b + b·|d|/avgdl)),
    IDF(t) = ln(1 + (N − df(t) + 0.5)/(df(t) + 0.5))   (Lucene ≥ 8, as bm25s's "lucene" method).
    Returns (weights float32 [nnz], doc ids int32 [nnz], term_ptr int64 [V + 1]): the arrays bm25s
    saves as ``data``/``indices``/``indptr``, computed with a few vectorised numpy passes.
    """
    num_docs = len(docs)
    lengths = np.fromiter((len(d) for d in docs), dtype=np.int64, count=num_docs)
    terms = np.fromiter((t for d in docs for t in d), dtype=np.int64, count=int(lengths.sum()))
    doc_of_token = np.repeat(np.arange(num_docs, dtype=np.int64), lengths)
    # One key per (term, doc); sorting them gives term-major, doc-minor order directly.
    pairs, tf = np.unique(terms * num_docs + doc_of_token, return_counts=True)
    term, doc = pairs // num_docs, pairs % num_docs
    df = np.bincount(term, minlength=num_terms)
    idf = np.log(1.0 + (num_docs - df + 0.5) / (df + 0.5))
    avgdl = max(float(lengths.mean()), 1e-9)
    weights = idf[term] * tf / (tf + k1 * (1.0 - b + b * lengths[doc] / avgdl))
    term_ptr = np.zeros(num_terms + 1, dtype=np.int64)
    np.cumsum(df, out=term_ptr[1:])
    return weights.astype(np.float32), doc.astype(np.int32), term_ptr


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
    import torch  # here, not at module level: `stratarl index info` and `--help` stay fast

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
    import torch  # here, not at module level: `stratarl index info` and `--help` stay fast

    if row.dim() != 1 or not 1 <= k <= row.numel():
        raise ValueError(f"blocked_top_k needs a 1-D tensor and 1 <= k <= its length, got shape {tuple(row.shape)}, k={k}")
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
    """Okapi BM25 (bm25s's "lucene" variant, k1=1.5, b=0.75) over a list of passages.

    score(q, d) = Σ_{t ∈ q} IDF(t) · tf(t,d) / (tf(t,d) + k1·(1 − b + b·|d|/avgdl)),
    IDF(t) = ln(1 + (N − df(t) + 0.5)/(df(t) + 0.5))
    (Robertson & Zaragoza 2009, as in Lucene ≥ 8, which drops the rank-neutral factor k1 + 1).

    Text is lower-cased, split on ``\\w\\w+``, English stop words removed and Snowball-stemmed
    (``stemmer=None`` turns stemming off). ``search`` returns at most ``k`` passages per query, best
    first; passages that share no term with the query (score 0) are left out, as Pyserini's BM25
    in Search-R1 does. Safe to call from several threads (only tokenisation is serialised).
    """

    def __init__(self, model, passages: list[Passage], *, stemmer: str | None, stopwords: str | None) -> None:
        if model.scores["num_docs"] != len(passages):
            raise ValueError(
                f"BM25 index holds {model.scores['num_docs']} documents but the corpus has {len(passages)} passages; "
                "rebuild the index from this corpus"
            )
        self._model = model
        self.passages = passages
        self.stemmer_name = stemmer
        self.stopwords = stopwords
        self._stemmer = _make_stemmer(stemmer)
        self._stopwords = _stopword_set(stopwords)
        self._vocab = model.vocab_dict
        self._lock = threading.Lock()
        import torch

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
        import bm25s

        passages = list(passages)
        if not passages:
            raise ValueError("cannot build a BM25 index from an empty list of passages")
        docs, vocab = tokenize_to_ids(
            [p.contents for p in passages], stopwords=_stopword_set(stopwords), stemmer=_make_stemmer(stemmer)
        )
        weights, doc_ids, term_ptr = bm25_matrix(docs, len(vocab), k1=k1, b=b)
        # A bm25s model holding our arrays: saved and loaded in bm25s's own format (usable by bm25s).
        model = bm25s.BM25(k1=k1, b=b, method="lucene", idf_method="lucene")
        model.scores = {"data": weights, "indices": doc_ids, "indptr": term_ptr, "num_docs": len(passages)}
        model.vocab_dict = {**vocab, "": len(vocab)}  # bm25s's placeholder term for empty queries
        model.unique_token_ids_set = set(model.vocab_dict.values())
        model.nonoccurrence_array = None  # lucene BM25 has no non-occurrence term
        return cls(model, passages, stemmer=stemmer, stopwords=stopwords)

    @classmethod
    def from_corpus(cls, path: str | Path, **kwargs) -> BM25Retriever:
        """Build from a Search-R1 corpus jsonl (see `load_corpus`); kwargs as in `from_passages`."""
        return cls.from_passages(load_corpus(path), **kwargs)

    def save(self, index_dir: str | Path) -> Path:
        """Write the index and the corpus to ``index_dir`` (created if needed); returns it."""
        index_dir = Path(index_dir)
        index_dir.mkdir(parents=True, exist_ok=True)
        self._model.save(index_dir, corpus=None, allow_pickle=False, show_progress=False)
        write_corpus(self.passages, index_dir / INDEX_CORPUS_FILE)
        np.save(index_dir / INDEX_OFFSETS_FILE, corpus_line_offsets(index_dir / INDEX_CORPUS_FILE), allow_pickle=False)
        meta = {
            "kind": "bm25",
            "format_version": BM25_FORMAT_VERSION,
            "num_passages": len(self.passages),
            "stemmer": self.stemmer_name,
            "stopwords": self.stopwords,
            "k1": self._model.k1,
            "b": self._model.b,
        }
        # Written last: a directory with this file is a complete index.
        (index_dir / INDEX_META_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        return index_dir

    @classmethod
    def load(cls, index_dir: str | Path, *, mmap: bool = False, mmap_corpus: bool = False) -> BM25Retriever:
        """Load an index saved by `save` or `build_bm25_index`.

        ``mmap=True`` maps the score arrays instead of reading them; ``mmap_corpus=True`` reads
        passages from the index's ``corpus.jsonl`` when a search returns them (`CorpusFile`) instead
        of holding them all in memory. Both together: a Wikipedia-size index serves in little RAM.
        """
        import bm25s

        index_dir = Path(index_dir)
        meta = read_index_meta(index_dir)
        if meta["kind"] != "bm25":
            raise ValueError(f"{index_dir} holds a {meta['kind']!r} index, not a BM25 one; load it with build_retriever")
        model = bm25s.BM25.load(index_dir, mmap=mmap, allow_pickle=False, load_corpus=False, show_progress=False)
        passages = index_passages(index_dir, mmap_corpus=mmap_corpus)
        return cls(model, passages, stemmer=meta.get("stemmer"), stopwords=meta.get("stopwords"))

    def search(self, queries: list[str], k: int) -> list[list[Passage]]:
        """Top-``k`` passages for each query, best first, scores attached; one list per query, in order."""
        _check_k(k)
        queries = list(queries)
        if not queries:
            return []
        k_eff = min(k, len(self.passages))
        num_terms = len(self._term_ptr) - 1
        with self._lock:  # PyStemmer objects are not thread-safe
            query_terms, _ = tokenize_to_ids(queries, stopwords=self._stopwords, stemmer=self._stemmer, vocab=self._vocab)
        # bm25s's "" placeholder term has no postings (id num_terms): it contributes nothing.
        query_terms = [[t for t in terms if t < num_terms] for terms in query_terms]
        scores, indices = sparse_top_k(
            self._weights, self._doc_ids, self._term_ptr, len(self.passages), query_terms, k_eff
        )
        results = []
        for row_indices, row_scores in zip(indices.tolist(), scores.tolist()):
            results.append(
                [
                    Passage(self.passages[i].id, self.passages[i].contents, float(s))
                    for i, s in zip(row_indices, row_scores)
                    if s > 0.0
                ]
            )
        return results


def _tokenize_chunk(
    texts: list[str], *, stopwords: frozenset[str], stemmer, vocab: dict[str, int], words: dict[str, int], term_of_word: list[int]
) -> tuple[np.ndarray, np.ndarray]:
    """`tokenize_to_ids` for one chunk of a corpus streamed through it: the flat term ids and the lengths.

    ``vocab`` (stem → term id), ``words`` (word → index) and ``term_of_word`` grow in place across
    chunks, in first-occurrence order, so the vocabulary is exactly the one `tokenize_to_ids`
    builds from the whole corpus at once. Each distinct word is stemmed once.
    """
    flat: list[int] = []
    lengths: list[int] = []
    known = len(words)
    for text in texts:
        before = len(flat)
        for word in _WORD.findall(text.lower()):
            if word in stopwords:
                continue
            index = words.get(word)
            if index is None:
                index = words[word] = len(words)
            flat.append(index)
        lengths.append(len(flat) - before)
    new_words = list(words)[known:] if len(words) > known else []
    stems = stemmer.stemWords(new_words) if stemmer is not None else new_words
    term_of_word.extend(vocab.setdefault(stem, len(vocab)) for stem in stems)
    lookup = np.asarray(term_of_word, dtype=np.int32)
    return lookup[np.asarray(flat, dtype=np.int64)], np.asarray(lengths, dtype=np.int64)


def build_bm25_index(
    corpus: str | Path,
    index_dir: str | Path,
    *,
    stemmer: str | None = "english",
    stopwords: str | None = "en",
    k1: float = 1.5,
    b: float = 0.75,
    chunk_passages: int = 250_000,
    progress=None,
) -> Path:
    """Index a corpus jsonl into ``index_dir`` in bounded memory: the same index as `BM25Retriever.save`.

    Pass 1 streams the corpus ``chunk_passages`` at a time: tokenise, count (term, passage, tf)
    triples (kept on disk under ``index_dir/.build``), copy the passages to ``corpus.jsonl`` and
    their byte offsets to ``corpus.offsets.npy``. Pass 2, once df and avgdl are known, computes each
    chunk's BM25 weights (as `bm25_matrix`) and writes them straight into the memory-mapped
    ``.npy`` files at their term-major positions. Memory: one chunk's arrays, the vocabulary and
    8 bytes per passage; never the corpus or the matrix (they live in the page cache).
    ``progress(stage, passages_done)``: optional callback. Returns ``index_dir``.
    """
    import bm25s

    if chunk_passages < 1:
        raise ValueError(f"chunk_passages must be a positive integer, got {chunk_passages!r}")
    index_dir = Path(index_dir)
    if Path(corpus).resolve() == (index_dir / INDEX_CORPUS_FILE).resolve():
        raise ValueError(f"{corpus} is the corpus file the index writes; building would overwrite what it reads. "
                         "Fix: build into another directory")
    index_dir.mkdir(parents=True, exist_ok=True)
    (index_dir / INDEX_META_FILE).unlink(missing_ok=True)  # the directory is not a complete index until the end
    scratch = index_dir / ".build"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir()
    stopword_set, stemmer_object = _stopword_set(stopwords), _make_stemmer(stemmer)
    vocab: dict[str, int] = {}
    words: dict[str, int] = {}
    term_of_word: list[int] = []
    df = np.zeros(0, dtype=np.int64)
    all_lengths, chunk_sizes = [], []
    offsets = array("q")  # 8 bytes a passage (a list of ints would take 36)
    position, num_docs = 0, 0

    def flush(texts: list[str]) -> None:
        nonlocal df, num_docs
        terms, lengths = _tokenize_chunk(
            texts, stopwords=stopword_set, stemmer=stemmer_object, vocab=vocab, words=words, term_of_word=term_of_word
        )
        n = len(texts)
        local_doc = np.repeat(np.arange(n, dtype=np.int64), lengths)
        pairs, tf = np.unique(terms.astype(np.int64) * n + local_doc, return_counts=True)
        term = (pairs // n).astype(np.int32)
        chunk_df = np.bincount(term, minlength=len(vocab))
        if len(df) < len(chunk_df):
            df = np.concatenate([df, np.zeros(len(chunk_df) - len(df), dtype=np.int64)])
        df += chunk_df
        number = len(chunk_sizes)
        np.save(scratch / f"{number}.term.npy", term)
        np.save(scratch / f"{number}.doc.npy", (pairs % n + num_docs).astype(np.int32))
        np.save(scratch / f"{number}.tf.npy", tf.astype(np.int32))
        all_lengths.append(lengths)
        chunk_sizes.append(n)
        num_docs += n
        if progress is not None:
            progress("tokenised", num_docs)

    texts: list[str] = []
    try:
        with open(index_dir / INDEX_CORPUS_FILE, "w", encoding="utf-8") as out:
            for passage in iter_corpus(corpus):
                line = json.dumps(passage.to_document(), ensure_ascii=False) + "\n"
                out.write(line)
                offsets.append(position)
                position += len(line.encode("utf-8")) if not line.isascii() else len(line)
                texts.append(passage.contents)
                if len(texts) == chunk_passages:
                    flush(texts)
                    texts = []
        if texts:
            flush(texts)
    except BaseException:  # a broken line (CorpusError), a full disk, Ctrl-C: leave no scratch files behind
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    if num_docs == 0:
        shutil.rmtree(scratch, ignore_errors=True)
        raise CorpusError(f"{corpus}: the corpus has no passages; it needs one JSON object per line")
    if num_docs >= 2**31:
        raise ValueError(f"{num_docs} passages do not fit int32 passage ids; split the corpus into shards below 2^31")
    np.save(index_dir / INDEX_OFFSETS_FILE, np.frombuffer(offsets, dtype=np.int64))
    del offsets

    # Pass 2: weights into their final places (term-major, passage order within a term, as bm25_matrix).
    num_terms = len(vocab)
    df = np.concatenate([df, np.zeros(num_terms - len(df), dtype=np.int64)])
    lengths = np.concatenate(all_lengths)
    idf = np.log(1.0 + (num_docs - df + 0.5) / (df + 0.5))
    avgdl = max(float(lengths.mean()), 1e-9)
    term_ptr = np.zeros(num_terms + 1, dtype=np.int64)
    np.cumsum(df, out=term_ptr[1:])
    nnz = int(term_ptr[-1])
    if nnz:
        open_memmap = np.lib.format.open_memmap
        data = open_memmap(index_dir / "data.csc.index.npy", mode="w+", dtype=np.float32, shape=(nnz,))
        indices = open_memmap(index_dir / "indices.csc.index.npy", mode="w+", dtype=np.int32, shape=(nnz,))
    else:  # every word a stop word: an empty matrix (a memory map cannot be empty)
        data, indices = np.zeros(0, dtype=np.float32), np.zeros(0, dtype=np.int32)
    next_slot = term_ptr[:-1].copy()
    done = 0
    for number, n in enumerate(chunk_sizes):
        term = np.load(scratch / f"{number}.term.npy")
        doc = np.load(scratch / f"{number}.doc.npy")
        tf = np.load(scratch / f"{number}.tf.npy")
        counts = np.bincount(term, minlength=num_terms)
        first = np.cumsum(counts) - counts  # where each term's run starts in this chunk's (sorted) triples
        slots = next_slot[term] + (np.arange(len(term), dtype=np.int64) - first[term])
        weights = idf[term] * tf / (tf + k1 * (1.0 - b + b * lengths[doc] / avgdl))
        data[slots] = weights.astype(np.float32)
        indices[slots] = doc
        next_slot += counts
        done += n
        if progress is not None:
            progress("weighted", done)
    if nnz:
        data.flush()
        indices.flush()
    else:
        np.save(index_dir / "data.csc.index.npy", data)
        np.save(index_dir / "indices.csc.index.npy", indices)
    del data, indices
    np.save(index_dir / "indptr.csc.index.npy", term_ptr)
    shutil.rmtree(scratch, ignore_errors=True)

    # bm25s's own vocab and params files, as `BM25.save` writes them.
    model = bm25s.BM25(k1=k1, b=b, method="lucene", idf_method="lucene")
    (index_dir / "vocab.index.json").write_text(json.dumps({**vocab, "": num_terms}, ensure_ascii=False), encoding="utf-8")
    params = {
        "k1": model.k1, "b": model.b, "delta": model.delta, "method": model.method, "idf_method": model.idf_method,
        "dtype": model.dtype, "int_dtype": model.int_dtype, "num_docs": num_docs, "version": bm25s.__version__,
        "backend": model.backend,
    }
    (index_dir / "params.index.json").write_text(json.dumps(params, indent=4), encoding="utf-8")
    meta = {
        "kind": "bm25", "format_version": BM25_FORMAT_VERSION, "num_passages": num_docs,
        "stemmer": stemmer, "stopwords": stopwords, "k1": k1, "b": b,
    }
    (index_dir / INDEX_META_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return index_dir
