"""The PhantomWiki baselines' question files and summary: what each setting's prompt holds, and the CIs' arithmetic."""

from __future__ import annotations

from pathlib import Path

import pytest

from stratarl.data.phantomwiki import UniverseSpec, write_universe
from stratarl.data.search_r1 import load_examples

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "external" / "phantomwiki_baselines.py"
FIXTURE = Path(__file__).resolve().parents[1] / "data" / "fixtures" / "phantomwiki_seed3"


@pytest.fixture(scope="module")
def bench(load_script):
    return load_script(BENCH, "phantomwiki_baselines")


def test_each_setting_gets_its_own_prompt(bench, tmp_path):
    universe = tmp_path / "u3"
    write_universe(FIXTURE, universe, UniverseSpec(seed=3, max_tree_size=12, num_trees=2, questions_per_type=2))
    files = bench.setting_files(universe, tmp_path / "work", rag_k=4)
    searched = load_examples(str(files["search"]))
    closed = load_examples(str(files["closed_book"]))
    rag = load_examples(str(files["rag"]))
    assert [e.id for e in closed] == [e.id for e in searched] == [e.id for e in rag]
    assert [e.golden_answers for e in rag] == [e.golden_answers for e in searched]
    question = next(e for e in rag if e.question == "Who is the child of Ramiro Duquette?")
    content = question.prompt[0]["content"]
    # one retrieval with the question: 4 articles, the person's own first, inside <information>
    assert content.count("Doc ") == 4 and "Doc 1(Title: Ramiro Duquette)" in content
    assert "<search>" not in content and content.endswith("Question: Who is the child of Ramiro Duquette?\n")
    closed_content = next(e for e in closed if e.id == question.id).prompt[0]["content"]
    assert "<information>" not in closed_content and "<search>" not in closed_content
    assert "<search> query </search>" in next(e for e in searched if e.id == question.id).prompt[0]["content"]


def test_summary_means_and_difficulties(bench):
    rows = [
        {"em": 1.0, "f1": 1.0, "searches": 1.0, "answered": 1.0, "question_type": "difficulty_1"},
        {"em": 0.0, "f1": 0.5, "searches": 2.0, "answered": 1.0, "question_type": "difficulty_1"},
        {"em": 0.0, "f1": 0.0, "searches": 0.0, "answered": 0.0, "question_type": "difficulty_2"},
    ]
    summary = bench.summarise(rows)
    assert summary["all"]["n"] == 3 and summary["all"]["f1"]["mean"] == pytest.approx(0.5)
    assert summary["all"]["answer_rate"] == pytest.approx(2 / 3) and summary["all"]["searches_mean"] == 1.0
    assert summary["per_difficulty"]["difficulty_1"]["em"]["mean"] == 0.5
    assert summary["per_difficulty"]["difficulty_2"]["n"] == 1
