"""Building a BM25 index: (term, passage) counts, their BM25 weights, and the index directory.

`bm25_matrix` weighs a corpus held in memory (`BM25Retriever.from_passages`); `build_bm25_index` streams
a corpus file into an index directory in bounded memory (Wikipedia's 21M passages on a 24 GB machine).
Both tokenise with `BM25Tokenizer`, count with `count_term_pairs` and weigh with `bm25_weights`, so they
write the same arrays. The index directory (`stratarl.retrieval.index_files` for the files all indexes
share) holds bm25s's own files, so ``bm25s.BM25.load`` reads our indexes too::

    params.index.json, vocab.index.json        bm25s's settings and vocabulary (stem → term id)
    {data,indices,indptr}.csc.index.npy         the weight matrix stored by term (CSR over terms)

Everything is JSON or ``.npy``; arrays are loaded with ``allow_pickle=False``, so loading an index
never unpickles anything.
"""

from __future__ import annotations

import json
import shutil
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import bm25s
import numpy as np

from stratarl.retrieval.bm25_text import BM25Tokenizer, make_stemmer, stopword_set
from stratarl.retrieval.corpus import CorpusError, corpus_line, iter_corpus
from stratarl.retrieval.index_files import INDEX_CORPUS_FILE, INDEX_OFFSETS_FILE, start_index_dir, write_index_meta

BM25_FORMAT_VERSION = 1
SCRATCH_DIR = ".build"  # the streamed build's (term, passage, tf) files, deleted at the end


def bm25_weights(term, doc, tf, *, df: np.ndarray, lengths: np.ndarray, k1: float, b: float) -> np.ndarray:
    """BM25 weights (float32) of (term, document) pairs: Okapi BM25 (Robertson & Zaragoza 2009) with
    Lucene's variant (Lucene ≥ 8, bm25s's "lucene" method), which drops the rank-neutral factor k1 + 1:

        W[t, d] = IDF(t) · tf(t,d) / (tf(t,d) + k1·(1 − b + b·|d|/avgdl)),
        IDF(t)  = ln(1 + (N − df(t) + 0.5)/(df(t) + 0.5))      (Lucene's idf: never negative)

    ``term``, ``doc``, ``tf``: the pairs and their term frequencies; ``df`` [V]: the documents holding each
    term; ``lengths`` [N]: each document's term count |d| (avgdl: their mean).
    """
    num_docs = len(lengths)
    idf = np.log(1.0 + (num_docs - df + 0.5) / (df + 0.5))
    avgdl = max(float(lengths.mean()), 1e-9)
    return (idf[term] * tf / (tf + k1 * (1.0 - b + b * lengths[doc] / avgdl))).astype(np.float32)


def count_term_pairs(terms: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(term, document, tf) of each distinct pair in tokenised documents, term-major, document-minor.

    ``terms``: the documents' term ids one document after another; ``lengths``: each document's count.
    Documents are numbered from 0 in order; the arrays are int64.
    """
    num_docs = len(lengths)
    doc_of_token = np.repeat(np.arange(num_docs, dtype=np.int64), lengths)
    # One key per (term, doc); sorting them gives term-major, doc-minor order directly.
    pairs, tf = np.unique(terms.astype(np.int64) * num_docs + doc_of_token, return_counts=True)
    return pairs // num_docs, pairs % num_docs, tf


def term_pointers(df: np.ndarray) -> np.ndarray:
    """Where each term's postings start in the term-major arrays (int64 [V + 1]; the last entry is nnz)."""
    term_ptr = np.zeros(len(df) + 1, dtype=np.int64)
    np.cumsum(df, out=term_ptr[1:])
    return term_ptr


def bm25_matrix(
    terms: np.ndarray, lengths: np.ndarray, num_terms: int, *, k1: float, b: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """BM25 weights (`bm25_weights`) of every (term, document) pair of a tokenised corpus, stored by term.

    ``terms``, ``lengths``: as `BM25Tokenizer.term_arrays` returns them. Returns (weights float32 [nnz],
    doc ids int32 [nnz], term_ptr int64 [V + 1]): the arrays bm25s saves as ``data``/``indices``/``indptr``.
    """
    term, doc, tf = count_term_pairs(terms, lengths)
    df = np.bincount(term, minlength=num_terms)
    weights = bm25_weights(term, doc, tf, df=df, lengths=lengths, k1=k1, b=b)
    return weights, doc.astype(np.int32), term_pointers(df)


def bm25s_model(k1: float, b: float) -> bm25s.BM25:
    """A bm25s model with our weighting (`bm25_weights`): it saves, and gives the settings of, our index files."""
    return bm25s.BM25(k1=k1, b=b, method="lucene", idf_method="lucene")


def index_in_memory(texts: list[str], *, stemmer: str | None, stopwords: str | None, k1: float, b: float) -> bm25s.BM25:
    """A bm25s model holding the BM25 index of ``texts`` (one per passage): saved in bm25s's own format."""
    tokenizer = BM25Tokenizer(stopwords=stopword_set(stopwords), stemmer=make_stemmer(stemmer))
    terms, lengths = tokenizer.term_arrays(texts)
    vocab = tokenizer.terms
    weights, doc_ids, term_ptr = bm25_matrix(terms, lengths, len(vocab), k1=k1, b=b)
    model = bm25s_model(k1, b)
    model.scores = {"data": weights, "indices": doc_ids, "indptr": term_ptr, "num_docs": len(texts)}
    model.vocab_dict = {**vocab, "": len(vocab)}  # bm25s's placeholder term for empty queries
    model.unique_token_ids_set = set(model.vocab_dict.values())
    model.nonoccurrence_array = None  # lucene BM25 has no non-occurrence term
    return model


def bm25_index_meta(num_passages: int, *, stemmer: str | None, stopwords: str | None, k1: float, b: float) -> dict:
    """The ``stratarl_index.json`` of a BM25 index."""
    return {
        "kind": "bm25",
        "format_version": BM25_FORMAT_VERSION,
        "num_passages": num_passages,
        "stemmer": stemmer,
        "stopwords": stopwords,
        "k1": k1,
        "b": b,
    }


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
    chunk's BM25 weights (`bm25_weights`) and writes them straight into the memory-mapped ``.npy``
    files at their term-major positions. Memory: one chunk's arrays, the vocabulary and 8 bytes per
    passage; never the corpus or the matrix (they live in the page cache).
    ``progress(stage, passages_done)``: optional callback. Returns ``index_dir``.
    """
    if chunk_passages < 1:
        raise ValueError(f"chunk_passages must be a positive integer, got {chunk_passages!r}")
    index_dir = Path(index_dir)
    scratch = _start_build(corpus, index_dir)
    tokenizer = BM25Tokenizer(stopwords=stopword_set(stopwords), stemmer=make_stemmer(stemmer))
    chunks = _TokenisedChunks(scratch, tokenizer, progress)
    try:
        offsets = _copy_and_tokenise(corpus, index_dir / INDEX_CORPUS_FILE, chunks, chunk_passages)
    except BaseException:  # a broken line (CorpusError), a full disk, Ctrl-C: leave no scratch files behind
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    if chunks.num_docs == 0:
        shutil.rmtree(scratch, ignore_errors=True)
        raise CorpusError(f"{corpus}: the corpus has no passages; it needs one JSON object per line")
    if chunks.num_docs >= 2**31:
        raise ValueError(
            f"{chunks.num_docs} passages do not fit int32 passage ids; split the corpus into shards below 2^31"
        )
    np.save(index_dir / INDEX_OFFSETS_FILE, np.frombuffer(offsets, dtype=np.int64))
    del offsets
    _write_weights(index_dir, chunks, k1=k1, b=b)
    shutil.rmtree(scratch, ignore_errors=True)
    _write_bm25s_files(index_dir, tokenizer.terms, chunks.num_docs, k1=k1, b=b)
    write_index_meta(index_dir, bm25_index_meta(chunks.num_docs, stemmer=stemmer, stopwords=stopwords, k1=k1, b=b))
    return index_dir


def _start_build(corpus: str | Path, index_dir: Path) -> Path:
    """Check ``corpus`` is not the file the build writes, make ``index_dir`` and an empty scratch folder in it."""
    if Path(corpus).resolve() == (index_dir / INDEX_CORPUS_FILE).resolve():
        raise ValueError(
            f"{corpus} is the corpus file the index writes; building would overwrite what it reads. "
            "Fix: build into another directory"
        )
    start_index_dir(index_dir)
    scratch = index_dir / SCRATCH_DIR
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir()
    return scratch


@dataclass
class _TokenisedChunks:
    """Pass 1's results so far: each chunk's (term, passage, tf) triples, saved under ``scratch``, and what
    pass 2 needs besides (document frequencies, passage lengths, passages per chunk)."""

    scratch: Path
    tokenizer: BM25Tokenizer
    progress: Callable[[str, int], None] | None = None
    df: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    lengths: list[np.ndarray] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    num_docs: int = 0

    def add(self, texts: list[str]) -> None:
        """Tokenise one chunk of passages, count its pairs and save them; passage ids continue the last chunk's."""
        terms, lengths = self.tokenizer.term_arrays(texts)
        term, doc, tf = count_term_pairs(terms, lengths)
        chunk_df = np.bincount(term, minlength=len(self.tokenizer.terms))
        self.df = _padded(self.df, len(chunk_df)) + chunk_df
        number = len(self.sizes)
        np.save(self.scratch / f"{number}.term.npy", term.astype(np.int32))
        np.save(self.scratch / f"{number}.doc.npy", (doc + self.num_docs).astype(np.int32))
        np.save(self.scratch / f"{number}.tf.npy", tf.astype(np.int32))
        self.lengths.append(lengths)
        self.sizes.append(len(texts))
        self.num_docs += len(texts)
        if self.progress is not None:
            self.progress("tokenised", self.num_docs)

    def load(self, number: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Chunk ``number``'s (term, passage, tf) triples, as `add` saved them."""
        return tuple(np.load(self.scratch / f"{number}.{name}.npy") for name in ("term", "doc", "tf"))


def _padded(counts: np.ndarray, size: int) -> np.ndarray:
    """``counts`` followed by zeros up to ``size`` entries (terms first seen later have no count yet)."""
    return np.concatenate([counts, np.zeros(size - len(counts), dtype=np.int64)])


def _copy_and_tokenise(corpus: str | Path, copy_path: Path, chunks: _TokenisedChunks, chunk_passages: int) -> array:
    """Pass 1: copy the corpus to ``copy_path`` and tokenise it ``chunk_passages`` at a time into ``chunks``.
    Returns the byte offset of each line of the copy."""
    offsets = array("q")  # 8 bytes a passage (a list of ints would take 36)
    position = 0
    texts: list[str] = []
    with open(copy_path, "w", encoding="utf-8") as out:
        for passage in iter_corpus(corpus):
            line = corpus_line(passage)
            out.write(line)
            offsets.append(position)
            position += len(line.encode("utf-8")) if not line.isascii() else len(line)
            texts.append(passage.contents)
            if len(texts) == chunk_passages:
                chunks.add(texts)
                texts = []
    if texts:
        chunks.add(texts)
    return offsets


def _write_weights(index_dir: Path, chunks: _TokenisedChunks, *, k1: float, b: float) -> None:
    """Pass 2: each chunk's BM25 weights into their final places (term-major, passage order within a
    term, as `bm25_matrix`), in the memory-mapped ``data`` and ``indices`` arrays; then ``indptr``."""
    num_terms = len(chunks.tokenizer.terms)
    df = _padded(chunks.df, num_terms)
    lengths = np.concatenate(chunks.lengths)
    term_ptr = term_pointers(df)
    data, indices = _open_matrix_arrays(index_dir, int(term_ptr[-1]))
    next_slot = term_ptr[:-1].copy()
    done = 0
    for number, size in enumerate(chunks.sizes):
        term, doc, tf = chunks.load(number)
        counts = np.bincount(term, minlength=num_terms)
        first = np.cumsum(counts) - counts  # where each term's run starts in this chunk's (sorted) triples
        slots = next_slot[term] + (np.arange(len(term), dtype=np.int64) - first[term])
        data[slots] = bm25_weights(term, doc, tf, df=df, lengths=lengths, k1=k1, b=b)
        indices[slots] = doc
        next_slot += counts
        done += size
        if chunks.progress is not None:
            chunks.progress("weighted", done)
    for name, values in (("data", data), ("indices", indices)):
        if isinstance(values, np.memmap):
            values.flush()
        else:
            np.save(index_dir / f"{name}.csc.index.npy", values)
    np.save(index_dir / "indptr.csc.index.npy", term_ptr)


def _open_matrix_arrays(index_dir: Path, nnz: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``data`` (float32) and ``indices`` (int32) arrays of ``nnz`` entries, memory-mapped ``.npy`` files."""
    if not nnz:  # every word a stop word: an empty matrix (a memory map cannot be empty)
        return np.zeros(0, dtype=np.float32), np.zeros(0, dtype=np.int32)
    open_memmap = np.lib.format.open_memmap
    data = open_memmap(index_dir / "data.csc.index.npy", mode="w+", dtype=np.float32, shape=(nnz,))
    indices = open_memmap(index_dir / "indices.csc.index.npy", mode="w+", dtype=np.int32, shape=(nnz,))
    return data, indices


def _write_bm25s_files(index_dir: Path, vocab: dict[str, int], num_docs: int, *, k1: float, b: float) -> None:
    """bm25s's own vocab and params files, as `bm25s.BM25.save` writes them."""
    model = bm25s_model(k1, b)
    vocab_json = json.dumps({**vocab, "": len(vocab)}, ensure_ascii=False)  # "": bm25s's placeholder term
    (index_dir / "vocab.index.json").write_text(vocab_json, encoding="utf-8")
    params = {
        "k1": model.k1,
        "b": model.b,
        "delta": model.delta,
        "method": model.method,
        "idf_method": model.idf_method,
        "dtype": model.dtype,
        "int_dtype": model.int_dtype,
        "num_docs": num_docs,
        "version": bm25s.__version__,
        "backend": model.backend,
    }
    (index_dir / "params.index.json").write_text(json.dumps(params, indent=4), encoding="utf-8")
