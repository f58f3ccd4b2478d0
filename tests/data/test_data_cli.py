"""`stratarl data ...` in a subprocess, as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from stratarl.cli import main
from stratarl.data.search_r1 import load_examples
from stratarl.data.synth import generate_knowledge_base
from stratarl.retrieval.corpus import load_corpus


def run_cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "stratarl.cli", "data", *args], capture_output=True, text=True, cwd=cwd, timeout=120
    )


@pytest.fixture(scope="module")
def synth_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("synth")
    result = run_cli(
        "synth",
        "--out",
        str(out),
        "--seed",
        "3",
        "--size",
        "300",
        "--num-train",
        "40",
        "--num-test",
        "20",
        "--check-retrieval",
    )
    assert result.returncode == 0, result.stderr
    return out


def test_synth_writes_all_files(synth_dir):
    assert sorted(p.name for p in synth_dir.iterdir()) == [
        "README.md",
        "corpus.jsonl",
        "stats.json",
        "test.parquet",
        "train.parquet",
    ]
    stats = json.loads((synth_dir / "stats.json").read_text())
    assert stats["config"]["seed"] == 3 and stats["passages"] == 300
    assert stats["bm25_hop_recall"]["all"]["top3"] >= 0.9
    assert len(load_examples(synth_dir / "train.parquet")) == 40
    # The CLI writes exactly what the seeded Python generator makes.
    kb = generate_knowledge_base(seed=3, size=300, num_train=40, num_test=20)
    assert load_corpus(synth_dir / "corpus.jsonl") == kb.passages
    assert [e.question for e in load_examples(synth_dir / "test.parquet")] == [e.question for e in kb.test]


def test_inspect_counts_and_rows(synth_dir):
    result = run_cli("inspect", str(synth_dir / "test.parquet"), "--rows", "2")
    assert result.returncode == 0, result.stderr
    assert "20 questions" in result.stdout and "by data_source: synthkb=20" in result.stdout
    assert result.stdout.count("\n- id=") == 2
    corpus = run_cli("inspect", str(synth_dir / "corpus.jsonl"))
    assert "corpus with 300 passages" in corpus.stdout


def test_convert_to_jsonl_and_back(synth_dir, tmp_path, capsys):
    # In-process (the subprocess path is covered above): writing imports torch via the rollout package.
    assert main(["data", "convert", str(synth_dir / "test.parquet"), str(tmp_path / "t.jsonl"), "--limit", "5"]) == 0
    assert "wrote 5 rows" in capsys.readouterr().out
    converted = load_examples(tmp_path / "t.jsonl")
    original = load_examples(synth_dir / "test.parquet", limit=5)
    assert [(e.id, e.question, e.golden_answers) for e in converted] == [
        (e.id, e.question, e.golden_answers) for e in original
    ]


def test_errors_are_one_line_not_tracebacks(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q"}\n')
    stderr = {}
    for args in (
        ("convert", str(bad), str(tmp_path / "o.parquet")),
        ("inspect", str(bad)),
        ("synth", "--out", str(tmp_path / "x"), "--size", "tiny"),
    ):
        result = run_cli(*args)
        assert result.returncode == 2, args
        assert result.stderr.startswith("error: ") and "Traceback" not in result.stderr, result.stderr
        stderr[args[0]] = result.stderr
    assert "row 0: no gold answers" in stderr["inspect"] and "unknown size 'tiny'" in stderr["synth"]
    assert not (tmp_path / "o.parquet").exists() and not (tmp_path / "x").exists()
