"""``build_retriever(spec)``: one entry point from a config value to a Retriever, and ``register_retriever``.

Every retriever kind is a registry entry: the built-ins ``bm25``, ``dense`` and ``remote`` are registered
with :func:`register_retriever` below, exactly as a kind of your own is in a module loaded with
``--import`` (``stratarl train cfg.yaml --import my_retriever.py retrieval.spec={kind: mine}``)::

    from stratarl.retrieval import Passage, register_retriever

    @register_retriever("mine")
    class MyRetriever:
        def __init__(self, *, path: str, boost: float = 1.0): ...
        def search(self, queries: list[str], k: int) -> list[list[Passage]]: ...

A spec's keys other than ``kind`` are the builder's keyword arguments. The keys of the built-ins are
the keyword parameters of their constructors (`spec_options`): ``BM25Retriever.from_passages`` /
``load``, ``DenseRetriever.from_passages`` / ``load``, ``RemoteRetriever``.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from pathlib import Path

from stratarl.registry import Registry
from stratarl.retrieval.base import Retriever
from stratarl.retrieval.index_files import INDEX_META_FILE, read_index_meta
from stratarl.retrieval.remote import RemoteRetriever, normalize_retrieve_url

RetrieverBuilder = Callable[..., Retriever]
_RETRIEVERS: Registry[RetrieverBuilder] = Registry(
    "retriever kind",
    listed_as="valid kinds",
    how_to_add="(a kind of your own: register_retriever in a module loaded with --import)",
    unknown_error=ValueError,
)
_SOURCE_KEYS = ("kind", "index", "corpus", "url")  # where the retriever comes from: not passed on as options
_NOT_SPEC_OPTIONS = {"encoder"}  # DenseRetriever.from_passages(encoder=) takes a loaded model, not a config value


def _spec_help() -> str:
    return (
        'e.g. {"kind": "bm25", "index": "DIR"}, {"kind": "bm25", "corpus": "corpus.jsonl"}, '
        '{"kind": "dense", "corpus": "corpus.jsonl", "model": "PATH"}, {"kind": "remote", "url": "http://127.0.0.1:8000/retrieve"}; '
        f"or a string: an index directory, a corpus .jsonl, an http(s) URL or a registered kind ({', '.join(retriever_names())})"
    )


def register_retriever(name: str) -> Callable[[RetrieverBuilder], RetrieverBuilder]:
    """Decorator: register a retriever kind, so that a spec ``{"kind": name, ...}`` (or the string ``name``)
    builds it.

    The decorated builder, a class or a function, is called with the spec's keys other than ``kind`` as
    keyword arguments and returns a retriever: anything with ``search(queries: list[str], k: int) ->
    list[list[Passage]]``. A spec key the builder does not take is refused, naming the keys it does
    (unless it takes ``**options``). A name registered twice is refused (ValueError).
    """
    return _RETRIEVERS.decorator(name)


def retriever_names() -> list[str]:
    """The registered retriever kinds, sorted (the built-ins and any a loaded module registered)."""
    return _RETRIEVERS.names()


def get_retriever_builder(kind: str) -> RetrieverBuilder:
    """The builder registered as ``kind``; an unknown kind raises a ValueError that lists the registered ones."""
    return _RETRIEVERS.lookup(kind)


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
    if spec in _RETRIEVERS:
        return {"kind": spec}
    raise ValueError(f"retriever spec {spec!r} is not a URL, an index directory or a corpus file; {_spec_help()}")


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
    ``{"kind": "bm25"|"dense", "corpus": PATH, ...build options}``, ``{"kind": "remote", "url": URL, ...}``,
    ``{"kind": NAME, ...}`` for a kind registered with :func:`register_retriever`;
    a string is an http(s) URL, an index directory, a corpus jsonl (BM25) or a registered kind's name.
    """
    if isinstance(spec, (str, Path)):
        spec = _spec_from_string(str(spec))
    if not isinstance(spec, dict):
        raise TypeError(f"retriever spec must be a dict or a string, got {type(spec).__name__}; {_spec_help()}")
    spec = dict(spec)
    if "kind" not in spec and "index" in spec:
        spec["kind"] = read_index_meta(spec["index"])["kind"]
    kind = spec.pop("kind", "bm25")
    builder = get_retriever_builder(kind)
    _check_builder_keys(builder, kind, spec)
    retriever = builder(**spec)
    if not callable(getattr(retriever, "search", None)):
        raise TypeError(
            f"retriever kind {kind!r} built a {type(retriever).__name__}, which has no "
            "search(queries, k) method; a builder returns a retriever"
        )
    return retriever


# Kinds a bare name of which (``bm25``, the default ``retrieval.spec``) means: index the task's own corpus.
CORPUS_KINDS = ("bm25",)


def corpus_kind(spec: dict | str) -> str | None:
    """The kind when ``spec`` is the bare name of a kind in CORPUS_KINDS (``"bm25"``): the training run indexes its
    task's corpus with it (:func:`build_corpus_retriever`); None for every other spec."""
    return spec if isinstance(spec, str) and spec in CORPUS_KINDS else None


def build_corpus_retriever(kind: str, corpus: str | Path) -> Retriever:
    """A ``kind`` retriever over ``corpus``, its index cached beside it (``<corpus stem>.<kind>/``): loaded when a
    complete index is there, else (none, stale or foreign) built from the corpus and saved, unless the folder is
    read-only (then it stays in memory). Both go through :func:`build_retriever`."""
    corpus = Path(corpus)
    index_dir = corpus.parent / f"{corpus.stem}.{kind}"
    if (index_dir / INDEX_META_FILE).is_file():
        try:
            return build_retriever({"kind": kind, "index": str(index_dir)})
        except Exception:  # noqa: BLE001, S110  a stale or foreign index: rebuild below
            pass
    retriever = build_retriever({"kind": kind, "corpus": str(corpus)})
    save = getattr(retriever, "save", None)  # every CORPUS_KINDS retriever has one
    with contextlib.suppress(OSError):  # a read-only corpus folder: the index stays in memory only
        if save is not None:
            save(index_dir)
    return retriever


def _check_builder_keys(builder: RetrieverBuilder, kind: str, spec: dict) -> None:
    """Refuse keys a builder does not take, and missing required ones, before calling it (one line each)."""
    parameters = inspect.signature(builder).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return  # it takes **options and checks them itself (the built-ins do)
    named = [p for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    _check_keys(spec, kind, {"kind"} | {p.name for p in named})
    missing = [p.name for p in named if p.default is p.empty and p.name not in spec]
    if missing:
        raise ValueError(f"a {kind} retriever needs key(s) {missing}; spec keys given: {sorted(spec)}")


def _check_keys(spec: dict, kind: str, valid: set[str]) -> None:
    unknown = sorted(set(spec) - valid)
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} for a {kind} retriever; valid keys: {sorted(valid)}")


def _options(spec: dict) -> dict:
    return {key: value for key, value in spec.items() if key not in _SOURCE_KEYS}


@register_retriever("remote")
def _remote(**spec) -> RemoteRetriever:
    """A ``/retrieve`` server: ``url`` and the keyword parameters of :class:`RemoteRetriever` (an http(s) URL
    string is this kind too)."""
    _check_keys(spec, "remote", {"kind"} | spec_options(RemoteRetriever))
    if "url" not in spec:
        raise ValueError(f"a remote retriever needs 'url'; {_spec_help()}")
    return RemoteRetriever(spec["url"], **_options(spec))


@register_retriever("bm25")
def _bm25(**spec):
    """BM25: ``index`` (a built index) or ``corpus`` (built now), with their keyword options."""
    from stratarl.retrieval.bm25 import BM25Retriever  # imports torch: a worker pool's parent builds no retriever

    return _index_retriever(BM25Retriever, "bm25", spec)


@register_retriever("dense")
def _dense(**spec):
    """Dense (an encoder and a faiss index): ``index`` (a built index) or ``corpus`` (built now), with options."""
    from stratarl.retrieval.dense import DenseRetriever  # imports torch: only for a dense spec

    return _index_retriever(DenseRetriever, "dense", spec)


_BUILD_ONLY_ERRORS = {  # keys a spec that loads a built index may not hold: {keys}, and {load_keys} it may
    "bm25": "{keys} only apply when building from a corpus, not when loading an index",
    "dense": "{keys} are fixed when a dense index is built; they cannot change when loading it (keys for loading: {load_keys})",
}


def _index_retriever(retriever_class, kind: str, spec: dict):
    """A BM25 or dense retriever: ``retriever_class.load`` for ``index``, ``from_corpus`` for ``corpus``."""
    build_keys, load_keys = spec_options(retriever_class.from_passages), spec_options(retriever_class.load)
    _check_keys(spec, kind, {"kind", "index", "corpus"} | build_keys | load_keys)
    if ("index" in spec) == ("corpus" in spec):
        raise ValueError(
            f"a {kind} retriever needs exactly one of 'index' (a built index) or 'corpus' (build now); {_spec_help()}"
        )
    options = _options(spec)
    if "index" in spec:
        build_only = sorted(set(options) - load_keys)
        if build_only:
            raise ValueError(_BUILD_ONLY_ERRORS[kind].format(keys=build_only, load_keys=sorted(load_keys)))
        return retriever_class.load(spec["index"], **options)
    load_only = sorted(set(options) - build_keys)
    if load_only and kind == "dense":
        raise ValueError(
            f"{load_only} apply when loading a dense index ('index': DIR); when building from a corpus "
            "put nprobe / ef_search in dense_index, e.g. {'kind': 'ivf', 'nprobe': 64}"
        )
    build_options = {key: value for key, value in options.items() if key in build_keys}  # BM25: loading keys ignored
    return retriever_class.from_corpus(spec["corpus"], **build_options)
