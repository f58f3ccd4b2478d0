"""``build_retriever(spec)``: one entry point from a config value to a Retriever.

The keys a spec may hold are the keyword parameters of the retriever's constructors (`spec_options`):
``BM25Retriever.from_passages`` / ``load``, ``DenseRetriever.from_passages`` / ``load``, ``RemoteRetriever``.
"""

from __future__ import annotations

import inspect
from pathlib import Path

from stratarl.retrieval.base import Retriever
from stratarl.retrieval.index_files import read_index_meta
from stratarl.retrieval.remote import RemoteRetriever, normalize_retrieve_url

RETRIEVER_KINDS = ("bm25", "dense", "remote")
_SOURCE_KEYS = ("kind", "index", "corpus", "url")  # where the retriever comes from: not passed on as options
_NOT_SPEC_OPTIONS = {"encoder"}  # DenseRetriever.from_passages(encoder=) takes a loaded model, not a config value
_SPEC_HELP = (
    'e.g. {"kind": "bm25", "index": "DIR"}, {"kind": "bm25", "corpus": "corpus.jsonl"}, '
    '{"kind": "dense", "corpus": "corpus.jsonl", "model": "PATH"}, {"kind": "remote", "url": "http://127.0.0.1:8000/retrieve"}; '
    'or a string: an index directory, a corpus .jsonl, or an http(s) URL'
)


def spec_options(constructor) -> set[str]:
    """The spec keys ``constructor`` takes: its keyword parameters (those with a default, and keyword-only ones)."""
    return {
        p.name
        for p in inspect.signature(constructor).parameters.values()
        if p.kind is p.KEYWORD_ONLY or (p.kind is p.POSITIONAL_OR_KEYWORD and p.default is not p.empty)
    } - _NOT_SPEC_OPTIONS


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
    if kind == "remote":
        _check_keys(spec, kind, {"kind"} | spec_options(RemoteRetriever))
        if "url" not in spec:
            raise ValueError(f"a remote retriever needs 'url'; {_SPEC_HELP}")
        return RemoteRetriever(spec["url"], **_options(spec))
    if kind == "bm25":
        from stratarl.retrieval.bm25 import BM25Retriever  # imports torch: a worker pool's parent builds no retriever

        return _index_retriever(BM25Retriever, kind, spec)
    from stratarl.retrieval.dense import DenseRetriever  # imports torch: only for a dense spec

    return _index_retriever(DenseRetriever, kind, spec)


def _check_keys(spec: dict, kind: str, valid: set[str]) -> None:
    unknown = sorted(set(spec) - valid)
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} for a {kind} retriever; valid keys: {sorted(valid)}")


def _options(spec: dict) -> dict:
    return {key: value for key, value in spec.items() if key not in _SOURCE_KEYS}


_BUILD_ONLY_ERRORS = {  # keys a spec that loads a built index may not hold: {keys}, and {load_keys} it may
    "bm25": "{keys} only apply when building from a corpus, not when loading an index",
    "dense": "{keys} are fixed when a dense index is built; they cannot change when loading it (keys for loading: {load_keys})",
}


def _index_retriever(retriever_class, kind: str, spec: dict):
    """A BM25 or dense retriever: ``retriever_class.load`` for ``index``, ``from_corpus`` for ``corpus``."""
    build_keys, load_keys = spec_options(retriever_class.from_passages), spec_options(retriever_class.load)
    _check_keys(spec, kind, {"kind", "index", "corpus"} | build_keys | load_keys)
    if ("index" in spec) == ("corpus" in spec):
        raise ValueError(f"a {kind} retriever needs exactly one of 'index' (a built index) or 'corpus' (build now); {_SPEC_HELP}")
    options = _options(spec)
    if "index" in spec:
        build_only = sorted(set(options) - load_keys)
        if build_only:
            raise ValueError(_BUILD_ONLY_ERRORS[kind].format(keys=build_only, load_keys=sorted(load_keys)))
        return retriever_class.load(spec["index"], **options)
    load_only = sorted(set(options) - build_keys)
    if load_only and kind == "dense":
        raise ValueError(f"{load_only} apply when loading a dense index ('index': DIR); when building from a corpus "
                         "put nprobe / ef_search in dense_index, e.g. {'kind': 'ivf', 'nprobe': 64}")
    build_options = {key: value for key, value in options.items() if key in build_keys}  # BM25: loading keys ignored
    return retriever_class.from_corpus(spec["corpus"], **build_options)
