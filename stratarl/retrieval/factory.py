"""``build_retriever(spec)``: one entry point from a config value to a Retriever."""

from __future__ import annotations

from pathlib import Path

from stratarl.retrieval.base import Retriever
from stratarl.retrieval.bm25 import BM25Retriever, read_index_meta
from stratarl.retrieval.remote import RemoteRetriever, normalize_retrieve_url

RETRIEVER_KINDS = ("bm25", "dense", "remote")
_SPEC_KEYS = {
    "bm25": {"kind", "index", "corpus", "stemmer", "stopwords", "k1", "b", "mmap", "mmap_corpus"},
    "dense": {
        "kind", "index", "corpus", "model", "prefixes", "query_prefix", "passage_prefix", "pooling",
        "normalize", "max_length", "device", "batch_size", "cache_dir", "backend", "dense_index",
        "mmap", "mmap_corpus", "nprobe", "ef_search",
    },
    "remote": {"kind", "url", "timeout_s", "max_retries", "backoff_s", "batch_size", "return_scores"},
}
_SPEC_HELP = (
    'e.g. {"kind": "bm25", "index": "DIR"}, {"kind": "bm25", "corpus": "corpus.jsonl"}, '
    '{"kind": "dense", "corpus": "corpus.jsonl", "model": "PATH"}, {"kind": "remote", "url": "http://127.0.0.1:8000/retrieve"}; '
    'or a string: an index directory, a corpus .jsonl, or an http(s) URL'
)


def _spec_from_string(spec: str) -> dict:
    if spec.startswith(("http://", "https://")):
        return {"kind": "remote", "url": spec}
    path = Path(spec)
    if path.is_dir():
        return {"index": spec}
    if path.is_file():
        return {"kind": "bm25", "corpus": spec}
    raise ValueError(f"retriever spec {spec!r} is not a URL, an index directory or a corpus file; {_SPEC_HELP}")


def remote_url(spec: dict | str) -> str | None:
    """The ``/retrieve`` URL when ``spec`` names a remote retriever (a URL string or ``kind: remote``), else None.
    Reads nothing from disk."""
    if isinstance(spec, str) and spec.startswith(("http://", "https://")):
        return normalize_retrieve_url(spec)
    if isinstance(spec, dict) and spec.get("kind") == "remote" and isinstance(spec.get("url"), str):
        return normalize_retrieve_url(spec["url"])
    return None


def build_retriever(spec: dict | str) -> Retriever:
    """Make a retriever from a spec.

    ``{"index": DIR}`` (kind read from the index), ``{"kind": "bm25"|"dense", "index": DIR}``,
    ``{"kind": "bm25"|"dense", "corpus": PATH, ...build options}``, ``{"kind": "remote", "url": URL, ...}``;
    a string is an http(s) URL, an index directory or a corpus jsonl (BM25).
    """
    if isinstance(spec, (str, Path)):
        spec = _spec_from_string(str(spec))
    if not isinstance(spec, dict):
        raise TypeError(f"retriever spec must be a dict or a string, got {type(spec).__name__}; {_SPEC_HELP}")
    spec = dict(spec)
    if "kind" not in spec and "index" in spec:
        spec["kind"] = read_index_meta(spec["index"])["kind"]
    kind = spec.get("kind", "bm25")
    if kind not in RETRIEVER_KINDS:
        raise ValueError(f"unknown retriever kind {kind!r}; valid kinds: {', '.join(RETRIEVER_KINDS)}")
    unknown = sorted(set(spec) - _SPEC_KEYS[kind])
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} for a {kind} retriever; valid keys: {sorted(_SPEC_KEYS[kind])}")
    options = {key: value for key, value in spec.items() if key not in ("kind", "index", "corpus", "url")}

    if kind == "remote":
        if "url" not in spec:
            raise ValueError(f"a remote retriever needs 'url'; {_SPEC_HELP}")
        return RemoteRetriever(spec["url"], **options)
    if ("index" in spec) == ("corpus" in spec):
        raise ValueError(f"a {kind} retriever needs exactly one of 'index' (a built index) or 'corpus' (build now); {_SPEC_HELP}")
    if kind == "bm25":
        if "index" in spec:
            extra = sorted(set(options) - {"mmap", "mmap_corpus"})
            if extra:
                raise ValueError(f"{extra} only apply when building from a corpus, not when loading an index")
            return BM25Retriever.load(spec["index"], **options)
        options.pop("mmap", None)
        options.pop("mmap_corpus", None)
        return BM25Retriever.from_corpus(spec["corpus"], **options)
    from stratarl.retrieval.dense import DenseRetriever  # imports torch: only for a dense spec

    if "index" in spec:
        load_keys = {"model", "device", "batch_size", "backend", "mmap", "mmap_corpus", "nprobe", "ef_search"}
        extra = sorted(set(options) - load_keys)
        if extra:
            raise ValueError(f"{extra} are fixed when a dense index is built; they cannot change when loading it "
                             f"(keys for loading: {sorted(load_keys)})")
        return DenseRetriever.load(spec["index"], **options)
    load_only = sorted(set(options) & {"mmap", "mmap_corpus", "nprobe", "ef_search"})
    if load_only:
        raise ValueError(f"{load_only} apply when loading a dense index ('index': DIR); when building from a corpus "
                         "put nprobe / ef_search in dense_index, e.g. {'kind': 'ivf', 'nprobe': 64}")
    return DenseRetriever.from_corpus(spec["corpus"], **options)
