"""The files every saved index directory (BM25 or dense) holds besides its own arrays.

stratarl_index.json   {"kind": "bm25" | "dense", "format_version", "num_passages", ...}: written last
corpus.jsonl          the passages, Search-R1 format, in index order
corpus.offsets.npy    byte offset of each line (for ``mmap_corpus=True``)
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from stratarl.retrieval.base import Passage
from stratarl.retrieval.corpus import CorpusFile, corpus_line_offsets, iter_corpus, write_corpus

INDEX_META_FILE = "stratarl_index.json"
INDEX_CORPUS_FILE = "corpus.jsonl"
INDEX_OFFSETS_FILE = "corpus.offsets.npy"  # byte offset of each passage's line


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


def start_index_dir(index_dir: str | Path) -> Path:
    """Make ``index_dir`` (if needed) and remove its ``stratarl_index.json``: a directory being written is not
    a complete index until `write_index_meta`. Returns it as a Path."""
    index_dir = Path(index_dir)
    index_dir.mkdir(parents=True, exist_ok=True)
    (index_dir / INDEX_META_FILE).unlink(missing_ok=True)
    return index_dir


def write_index_passages(passages, index_dir: Path) -> None:
    """Write ``corpus.jsonl`` and its ``corpus.offsets.npy`` into ``index_dir``."""
    write_corpus(passages, index_dir / INDEX_CORPUS_FILE)
    np.save(index_dir / INDEX_OFFSETS_FILE, corpus_line_offsets(index_dir / INDEX_CORPUS_FILE), allow_pickle=False)


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
        raise ValueError(
            f"{meta_path}: invalid JSON ({error.msg}); rebuild the index with `stratarl index build`"
        ) from None
    if not isinstance(meta, dict) or "kind" not in meta:
        raise ValueError(f"{meta_path}: expected a JSON object with a 'kind' field; rebuild the index")
    return meta


def check_index_kind(index_dir: Path, kind: str) -> dict:
    """`read_index_meta`, with a `ValueError` unless the index is of ``kind`` (``"bm25"`` or ``"dense"``)."""
    meta = read_index_meta(index_dir)
    if meta["kind"] != kind:
        label = {"bm25": "BM25"}.get(kind, kind)
        raise ValueError(f"{index_dir} holds a {meta['kind']!r} index, not a {label} one; load it with build_retriever")
    return meta


def write_index_meta(index_dir: Path, meta: dict) -> None:
    """Write ``stratarl_index.json``. Written last: a directory with this file is a complete index."""
    (index_dir / INDEX_META_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
