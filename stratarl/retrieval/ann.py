"""Approximate nearest-neighbour indexes (faiss IVF and HNSW) for dense retrieval beyond exact search's memory.

faiss is optional: it is imported when a faiss index is built or loaded (`import_faiss`), with an error
naming the package to install when it is missing. All indexes use inner product (cosine on normalised embeddings).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DENSE_INDEX_KINDS = ("exact", "ivf", "hnsw")
DENSE_CODES = ("flat", "fp16", "sq8", "pq")
ADD_CHUNK = 65_536  # vectors added to (or encoded for) a faiss index at a time
_FAISS_HINT = "`pip install faiss-cpu` (or faiss-gpu), or use dense_index='exact'"


def import_faiss(needed_by: str = "an approximate dense index (ivf, hnsw)", fix: str = _FAISS_HINT):
    """The faiss module, or `ModuleNotFoundError` saying that ``needed_by`` needs it and how to ``fix`` that."""
    try:
        import faiss  # optional dependency (pip install faiss-cpu)
    except ImportError:
        raise ModuleNotFoundError(f"{needed_by} needs faiss: {fix}") from None
    return faiss


@dataclass(frozen=True)
class DenseIndexSettings:
    """How passage embeddings are searched: exactly, or with an approximate faiss index.

    ``kind``: ``exact`` (all embeddings in memory, Q·Eᵀ; the default), ``ivf`` (faiss IndexIVF: k-means
    into ``nlist`` lists, a query scans the ``nprobe`` nearest lists) or ``hnsw`` (faiss IndexHNSW: a
    graph of ``hnsw_m`` links per vector, ``ef_search`` candidates per query).
    ``codes``: how each vector is stored: ``flat`` float32 (4·D bytes), ``fp16`` (2·D), ``sq8`` (D bytes,
    8-bit scalar quantiser), ``pq`` (``pq_m`` bytes, product quantiser; ivf only). At 21M passages x 384
    dims: flat 30 GiB, fp16 15, sq8 7.5, pq with pq_m=48 under 1 GiB (+ 8 bytes of id per vector for ivf).
    ``nlist`` None: 4·√N, at most N/39 (faiss's k-means wants ≥ 39 points per list) and at least 1.
    ``train_size`` None: min(N, 64·nlist) passages train the lists and codes.
    """

    kind: str = "exact"
    nlist: int | None = None
    nprobe: int = 32
    codes: str = "flat"
    pq_m: int = 48
    hnsw_m: int = 32
    ef_construction: int = 200
    ef_search: int = 128
    train_size: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in DENSE_INDEX_KINDS:
            raise ValueError(f"dense_index kind must be one of {', '.join(DENSE_INDEX_KINDS)}, got {self.kind!r}")
        if self.codes not in DENSE_CODES:
            raise ValueError(f"dense_index codes must be one of {', '.join(DENSE_CODES)}, got {self.codes!r}")
        for name in ("nprobe", "pq_m", "hnsw_m", "ef_construction", "ef_search"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"dense_index {name} must be a positive integer, got {value!r}")
        for name in ("nlist", "train_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"dense_index {name} must be a positive integer or None, got {value!r}")
        if self.kind == "exact" and self.codes != "flat":
            raise ValueError(
                f"dense_index codes={self.codes!r} needs kind 'ivf' or 'hnsw' (exact search keeps float32 embeddings)"
            )
        if self.kind == "hnsw" and self.codes == "pq":
            raise ValueError("dense_index codes='pq' is for kind 'ivf'; HNSW takes flat, fp16 or sq8")

    @classmethod
    def coerce(cls, value: str | dict | DenseIndexSettings | None) -> DenseIndexSettings:
        """A settings object from a kind name, a dict of fields, or settings (None: exact)."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            return cls(kind=value)
        if isinstance(value, dict):
            fields = set(cls.__dataclass_fields__)
            unknown = sorted(set(value) - fields)
            if unknown:
                raise ValueError(f"unknown dense_index key(s) {unknown}; valid keys: {sorted(fields)}")
            return cls(**value)
        raise TypeError(
            f"dense_index must be 'exact', 'ivf', 'hnsw' or a dict of DenseIndexSettings fields, got {value!r}"
        )

    def resolved_nlist(self, num_vectors: int) -> int:
        if self.nlist is not None:
            return self.nlist
        return max(1, min(int(4 * num_vectors**0.5), num_vectors // 39))


def new_faiss_index(num_vectors: int, dim: int, settings: DenseIndexSettings):
    """An empty faiss inner-product index for ``settings`` (ivf or hnsw) and how many vectors train it."""
    faiss = import_faiss()
    if settings.kind == "exact":
        raise ValueError("faiss indexes here are approximate (kind 'ivf' or 'hnsw'); exact search needs no index")
    n, ip = num_vectors, faiss.METRIC_INNER_PRODUCT
    scalar = {"fp16": faiss.ScalarQuantizer.QT_fp16, "sq8": faiss.ScalarQuantizer.QT_8bit}
    if settings.kind == "ivf":
        nlist = settings.resolved_nlist(n)
        if nlist > n:
            raise ValueError(
                f"dense_index nlist={nlist} exceeds the {n} passages; use at most {n} (about 4·√N is typical)"
            )
        quantizer = faiss.IndexFlatIP(dim)
        if settings.codes == "flat":
            index = faiss.IndexIVFFlat(quantizer, dim, nlist, ip)
        elif settings.codes == "pq":
            if dim % settings.pq_m:
                raise ValueError(
                    f"dense_index pq_m={settings.pq_m} must divide the embedding size {dim}; e.g. 48 or 96 for 384"
                )
            if n < 256:
                raise ValueError(
                    f"dense_index codes='pq' needs at least 256 passages to train its codebooks (got {n}); use 'sq8'"
                )
            index = faiss.IndexIVFPQ(quantizer, dim, nlist, settings.pq_m, 8, ip)
        else:
            index = faiss.IndexIVFScalarQuantizer(quantizer, dim, nlist, scalar[settings.codes], ip)
        index.nprobe = min(settings.nprobe, nlist)
        return index, min(n, settings.train_size or 64 * nlist)
    if settings.codes == "flat":
        index = faiss.IndexHNSWFlat(dim, settings.hnsw_m, ip)
    else:
        index = faiss.IndexHNSWSQ(dim, scalar[settings.codes], settings.hnsw_m, ip)
    index.hnsw.efConstruction = settings.ef_construction
    index.hnsw.efSearch = settings.ef_search
    return index, min(n, settings.train_size or 65_536)


def training_rows(num_vectors: int, train_size: int, seed: int = 0) -> np.ndarray:
    """The rows (sorted) that train an index: all of them, or ``train_size`` drawn with ``seed``."""
    if train_size >= num_vectors:
        return np.arange(num_vectors)
    return np.sort(np.random.default_rng(seed).choice(num_vectors, train_size, replace=False))


def build_faiss_index(embeddings, settings: DenseIndexSettings, *, seed: int = 0):
    """A faiss inner-product index (ivf or hnsw, as ``settings``) holding ``embeddings`` (float32 [N, D]).

    Trained on ``train_size`` rows drawn with ``seed`` (`training_rows`), then filled in chunks of 65,536.
    """
    vectors = np.ascontiguousarray(np.asarray(embeddings, dtype=np.float32))
    if vectors.ndim != 2 or len(vectors) == 0:
        raise ValueError(f"embeddings must be a non-empty [N, D] array, got shape {vectors.shape}")
    index, train_size = new_faiss_index(len(vectors), vectors.shape[1], settings)
    if not index.is_trained:
        index.train(vectors[training_rows(len(vectors), train_size, seed)])
    for start in range(0, len(vectors), ADD_CHUNK):
        index.add(vectors[start : start + ADD_CHUNK])
    return index


def encode_into_faiss_index(texts: list[str], encoder, settings: DenseIndexSettings, *, seed: int = 0):
    """`build_faiss_index` over ``encoder.encode(texts)`` without ever holding all the embeddings.

    The training rows are encoded first (and again when added), then the texts ``ADD_CHUNK`` at a time:
    memory is one chunk of embeddings plus the index's codes (7.5 GiB for 21M x 384 with sq8, where
    the float32 embeddings alone would take 30 GiB). Same rows, same index as `build_faiss_index`.
    """
    if not texts:
        raise ValueError("cannot build a dense index from an empty list of passages")
    first = encoder.encode(texts[:1]).detach().cpu().float().numpy()
    index, train_size = new_faiss_index(len(texts), first.shape[1], settings)
    if not index.is_trained:
        rows = training_rows(len(texts), train_size, seed)
        sample = np.concatenate(
            [
                encoder.encode([texts[i] for i in rows[j : j + ADD_CHUNK]]).detach().cpu().float().numpy()
                for j in range(0, len(rows), ADD_CHUNK)
            ]
        )
        index.train(sample)
        del sample
    for start in range(0, len(texts), ADD_CHUNK):
        index.add(np.ascontiguousarray(encoder.encode(texts[start : start + ADD_CHUNK]).detach().cpu().float().numpy()))
    return index


def exact_faiss_index(embeddings):
    """A faiss ``IndexFlatIP`` (exact inner product) holding ``embeddings`` (float32 [N, D]): ``backend="faiss"``."""
    faiss = import_faiss("backend='faiss'", "`pip install faiss-cpu` (or use backend='torch')")
    index = faiss.IndexFlatIP(embeddings.shape[1])
    index.add(embeddings)
    return index


def set_search_params(index, settings: DenseIndexSettings) -> None:
    """Apply the query-time knobs (nprobe, ef_search) to a built or loaded faiss index."""
    faiss = import_faiss()
    if settings.kind == "ivf":
        faiss.extract_index_ivf(index).nprobe = min(settings.nprobe, faiss.extract_index_ivf(index).nlist)
    elif settings.kind == "hnsw":
        index.hnsw.efSearch = settings.ef_search
