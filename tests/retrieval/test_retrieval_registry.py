"""register_retriever: the built-in kinds are registry entries, every spec written before still builds, and a
user's own kind, defined in the user's file and loaded with --import, is built by the commands (README:
a retriever of your own)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stratarl.extensions import load_extension
from stratarl.retrieval import factory
from stratarl.retrieval.base import Passage
from stratarl.retrieval.bm25 import BM25Retriever
from stratarl.retrieval.factory import (
    build_retriever,
    get_retriever_builder,
    register_retriever,
    retriever_names,
)
from stratarl.retrieval.remote import RemoteRetriever

MY_RETRIEVER = '''
"""A retriever of the user's own: it finds the passages of a word list that share a word with the query."""
from stratarl.retrieval import Passage, register_retriever


@register_retriever("wordlist")
class WordListRetriever:
    def __init__(self, *, words: str = "alpha beta gamma", tag: str = "w"):
        self.words = words.split()
        self.tag = tag

    def search(self, queries, k):
        return [[Passage(f"{self.tag}{i}", f'"{word}"\\n{word} is a word.') for i, word in enumerate(self.words)
                 if word in query.split()][:k] for query in queries]
'''


@pytest.fixture
def users_kind(tmp_path, monkeypatch):
    """The user's module loaded as `--import` loads it; its kind is unregistered again afterwards."""
    plugin = tmp_path / "my_retriever.py"
    plugin.write_text(MY_RETRIEVER)
    monkeypatch.setattr(factory, "_RETRIEVERS", factory._RETRIEVERS.copy())
    load_extension(str(plugin))
    return plugin


def test_the_built_in_kinds_are_registry_entries():
    assert {"bm25", "dense", "remote"} <= set(retriever_names())
    assert get_retriever_builder("bm25") is factory._bm25
    assert get_retriever_builder("dense") is factory._dense
    assert get_retriever_builder("remote") is factory._remote


@pytest.fixture(scope="module")
def saved_index(tmp_path_factory, bm25_retriever):
    return bm25_retriever.save(tmp_path_factory.mktemp("idx") / "idx")


# Every spec form written before the registry (README, configs, `stratarl serve` / `index search`), by kind.
SPECS_BEFORE = [
    ("bm25 corpus dict", lambda c, i: {"kind": "bm25", "corpus": str(c)}, BM25Retriever),
    ("bm25 corpus Path", lambda c, i: {"kind": "bm25", "corpus": c, "stemmer": None}, BM25Retriever),
    ("corpus without kind", lambda c, i: {"corpus": str(c)}, BM25Retriever),
    ("bm25 index dict", lambda c, i: {"kind": "bm25", "index": str(i)}, BM25Retriever),
    ("index without kind", lambda c, i: {"index": str(i)}, BM25Retriever),
    ("bm25 index mmap", lambda c, i: {"index": str(i), "mmap": True}, BM25Retriever),
    ("index folder string", lambda c, i: str(i), BM25Retriever),
    ("index folder Path", lambda c, i: Path(i), BM25Retriever),
    ("corpus file string", lambda c, i: str(c), BM25Retriever),
    (
        "remote dict",
        lambda c, i: {"kind": "remote", "url": "http://127.0.0.1:9/retrieve", "timeout_s": 2},
        RemoteRetriever,
    ),
    ("http URL", lambda c, i: "http://127.0.0.1:9", RemoteRetriever),
    ("https URL", lambda c, i: "https://example.invalid/retrieve", RemoteRetriever),
]


@pytest.mark.parametrize(("name", "make_spec", "expected"), SPECS_BEFORE, ids=[s[0] for s in SPECS_BEFORE])
def test_every_spec_accepted_before_is_still_accepted(name, make_spec, expected, small_corpus_path, saved_index):
    retriever = build_retriever(make_spec(small_corpus_path, saved_index))
    assert isinstance(retriever, expected)
    if expected is BM25Retriever and "Path" not in name:
        assert [p.id for p in retriever.search(["capital of Germany"], 1)[0]] == ["1"]


def test_a_users_kind_is_built_from_a_spec_and_searched(users_kind):
    assert "wordlist" in retriever_names()
    retriever = build_retriever({"kind": "wordlist", "words": "red green blue", "tag": "c"})
    assert retriever.search(["is it green", "none here"], 3) == [[Passage("c1", '"green"\ngreen is a word.')], []]
    assert build_retriever("wordlist").search(["beta"], 1)[0][0].id == "w1"  # a registered name as the spec


def test_a_users_kind_from_the_training_config(users_kind, tmp_path):
    from stratarl.trainer.config import load_config
    from stratarl.trainer.setup import build_task_retriever
    from stratarl.trainer.task import TaskData

    config = tmp_path / "c.yaml"
    config.write_text("retrieval:\n  spec: {kind: wordlist, words: 'x y'}\n")
    cfg = load_config(config, ["retrieval.spec.tag=t"])
    retriever = build_task_retriever(cfg, TaskData(train=[], test=[], corpus_path=None))
    assert [[p.id for p in hits] for hits in retriever.search(["y", "x y"], 2)] == [["t1"], ["t0", "t1"]]


def test_a_users_kind_key_errors_are_one_line(users_kind):
    with pytest.raises(
        ValueError,
        match=r"unknown key\(s\) \['wrods'\] for a wordlist retriever; valid keys: "
        r"\['kind', 'tag', 'words'\]",
    ):
        build_retriever({"kind": "wordlist", "wrods": "a"})

    @register_retriever("needs_path")
    def needs_path(*, path: str):
        return build_retriever("wordlist")

    with pytest.raises(ValueError, match=r"a needs_path retriever needs key\(s\) \['path'\]"):
        build_retriever({"kind": "needs_path"})

    @register_retriever("not_a_retriever")
    def not_a_retriever():
        return 42

    with pytest.raises(TypeError, match="built a int, which has no search"):
        build_retriever("not_a_retriever")


def test_unknown_and_duplicate_kinds_are_one_line_errors_that_list_the_registered_ones(users_kind):
    with pytest.raises(ValueError) as unknown:
        build_retriever({"kind": "wordlits"})
    message = str(unknown.value)
    assert message.startswith("unknown retriever kind 'wordlits'; valid kinds: bm25, dense, remote, wordlist")
    assert "\n" not in message
    with pytest.raises(ValueError) as duplicate:
        register_retriever("bm25")(lambda **spec: None)
    assert str(duplicate.value).startswith("retriever kind 'bm25' is already registered (by _bm25)")
    assert "registered: bm25, dense, remote, wordlist" in str(duplicate.value) and "\n" not in str(duplicate.value)
    assert get_retriever_builder("bm25") is factory._bm25  # the refused one replaced nothing
    load_extension(str(users_kind))  # the same file again (e.g. --import twice): loaded once, no error
    with pytest.raises(
        ValueError,
        match="is not a URL, an index directory or a corpus file; .*registered kind "
        r"\(bm25, dense, remote, wordlist\)",
    ):
        build_retriever("wordlits")


def test_a_users_kind_answers_stratarl_index_search_with_import(tmp_path, stratarl_cli):
    plugin = tmp_path / "my_retriever.py"
    plugin.write_text(MY_RETRIEVER)
    out = stratarl_cli("index", "search", "wordlist", "gamma rays", "--json", "--import", plugin)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["result"] == [
        [{"document": {"id": "w2", "contents": '"gamma"\ngamma is a word.'}, "score": None}]
    ]
    text = stratarl_cli("--import", plugin, "index", "search", "wordlist", "gamma rays")  # a passage without a score
    assert text.returncode == 0, text.stderr
    assert text.stdout.splitlines() == ["query: gamma rays", "  Doc 1(Title: gamma) gamma is a word.  [id w2]"]
    without = stratarl_cli("index", "search", "wordlist", "gamma rays")
    assert without.returncode != 0 and "Traceback" not in without.stderr
    assert "'wordlist' is not a URL, an index directory or a corpus file" in without.stderr


def test_server_workers_load_the_commands_imports_and_build_a_users_kind(tmp_path, monkeypatch):
    from stratarl import extensions
    from stratarl.extensions import load_extensions, loaded_extensions
    from stratarl.retrieval.remote import RemoteRetriever
    from stratarl.retrieval.workers import WorkerPool

    plugin = tmp_path / "my_retriever.py"
    plugin.write_text(MY_RETRIEVER)
    monkeypatch.setattr(factory, "_RETRIEVERS", factory._RETRIEVERS.copy())
    monkeypatch.setattr(extensions, "_LOADED", [])
    load_extensions([str(plugin)])  # as `stratarl --import my_retriever.py ...` does
    assert loaded_extensions() == [str(plugin.resolve())]
    with WorkerPool({"kind": "wordlist", "tag": "p"}, workers=1, start_timeout_s=120) as pool:
        hits = RemoteRetriever(pool.url, timeout_s=30).search(["beta"], 2)
    assert [[p.id for p in h] for h in hits] == [["p1"]]
