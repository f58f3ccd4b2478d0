"""build_retriever: every spec form, and errors that list the valid choices."""

from __future__ import annotations

import pytest

from stratarl.retrieval.bm25 import BM25Retriever
from stratarl.retrieval.factory import build_retriever
from stratarl.retrieval.remote import RemoteRetriever


def test_bm25_from_corpus_and_from_index(tmp_path, small_corpus_path, bm25_retriever):
    from_corpus = build_retriever({"kind": "bm25", "corpus": str(small_corpus_path)})
    assert isinstance(from_corpus, BM25Retriever)
    index_dir = from_corpus.save(tmp_path / "idx")
    for spec in (
        {"kind": "bm25", "index": str(index_dir)},
        {"index": str(index_dir)},
        str(index_dir),
        str(small_corpus_path),
    ):
        retriever = build_retriever(spec)
        assert isinstance(retriever, BM25Retriever)
        assert retriever.search(["capital of Germany"], 2) == bm25_retriever.search(["capital of Germany"], 2)
    unstemmed = build_retriever({"kind": "bm25", "corpus": small_corpus_path, "stemmer": None})
    assert unstemmed.search(["cats"], 1) == [[]]  # without stemming "cats" does not match "cat"


def test_remote_specs():
    remote = build_retriever({"kind": "remote", "url": "http://127.0.0.1:9/retrieve", "timeout_s": 2, "max_retries": 1})
    assert isinstance(remote, RemoteRetriever) and (remote.timeout_s, remote.max_retries) == (2, 1)
    assert build_retriever("http://127.0.0.1:9").url == "http://127.0.0.1:9/retrieve"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"kind": "splade", "corpus": "c.jsonl"}, "unknown retriever kind 'splade'; valid kinds: bm25, dense, remote"),
        (
            {"kind": "bm25", "corpus": "c.jsonl", "topk": 3},
            r"unknown key\(s\) \['topk'\] for a bm25 retriever; valid keys",
        ),
        ({"kind": "bm25"}, "exactly one of 'index'"),
        ({"kind": "bm25", "index": "a", "corpus": "b"}, "exactly one of 'index'"),
        ({"kind": "remote"}, "needs 'url'"),
        ("/no/such/thing", "not a URL, an index directory or a corpus file"),
    ],
)
def test_bad_specs(spec, message):
    with pytest.raises(ValueError, match=message):
        build_retriever(spec)


def test_index_options_that_only_apply_to_building(tmp_path, bm25_retriever):
    index_dir = bm25_retriever.save(tmp_path / "idx")
    with pytest.raises(ValueError, match="only apply when building"):
        build_retriever({"kind": "bm25", "index": str(index_dir), "stemmer": None})
    with pytest.raises(TypeError, match="dict or a string"):
        build_retriever(3)


def test_the_default_spec_indexes_the_task_corpus_through_the_factory_once(tmp_path, small_corpus_path, monkeypatch):
    """`retrieval.spec: bm25` (the default) builds the task's corpus index through build_retriever, saves it beside
    the corpus, and the next run loads it instead of building again."""
    import shutil

    from stratarl.retrieval import factory
    from stratarl.trainer.config import load_config
    from stratarl.trainer.setup import build_task_retriever
    from stratarl.trainer.task import TaskData

    corpus = tmp_path / "corpus.jsonl"
    shutil.copy(small_corpus_path, corpus)
    assert factory.corpus_kind("bm25") == "bm25" and factory.corpus_kind({"kind": "bm25"}) is None
    assert factory.corpus_kind(str(corpus)) is None
    specs = []
    real = factory.build_retriever
    monkeypatch.setattr(factory, "build_retriever", lambda spec: specs.append(spec) or real(spec))
    cfg = load_config(None, ["model.name=tiny-random"])
    task = TaskData(train=[], test=[], corpus_path=corpus)
    built = build_task_retriever(cfg, task)
    assert specs == [{"kind": "bm25", "corpus": str(corpus)}] and (tmp_path / "corpus.bm25").is_dir()
    loaded = build_task_retriever(cfg, task)
    assert specs[1:] == [{"kind": "bm25", "index": str(tmp_path / "corpus.bm25")}]  # the cached index, not a rebuild
    assert loaded.search(["capital of Germany"], 2) == built.search(["capital of Germany"], 2)
    with pytest.raises(ValueError, match=r"retrieval.spec=bm25 needs a corpus: set data.corpus=PATH"):
        build_task_retriever(cfg, TaskData(train=[], test=[], corpus_path=None))
