"""The real-Wikipedia eval script: each setting's `stratarl eval` command and the table of a summary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "external" / "wikislice_eval.py"


@pytest.fixture(scope="module")
def script(load_script):
    return load_script(SCRIPT, "wikislice_eval")


def test_closed_book_gets_the_no_search_rows_and_no_search_turn(script):
    search = script.eval_command("configs/smollm2.yaml", Path("s"), "search", 1, ["model.init_from=m"])
    closed = script.eval_command("configs/smollm2.yaml", Path("s"), "closed_book", 1, [])
    assert search[search.index("--data") + 1] == str(Path("s") / "test.parquet")
    assert closed[closed.index("--data") + 1] == str(Path("s") / "test_closed_book.parquet")
    assert "rollout.max_turns=0" in closed and not any(a.startswith("rollout.max_turns") for a in search)
    assert f"data.corpus={Path('s') / 'corpus.jsonl'}" in search and "trainer.num_threads=1" in search
    assert search[-3] == "model.init_from=m"  # a --set override reaches the eval, before --data


def test_table_has_one_row_per_setting_and_source(script):
    interval = {"mean": 0.25, "low": 0.0, "high": 0.61}
    block = {"searches_mean": 1.0, "answer_rate": 0.5, "count": 4, "em": interval, "f1": {"mean": 0.5, "low": None}}
    summary = {"label": "m", "settings": {"search": {"wall_s": 12.0, "per_source": {"fanoutqa": block}}}}
    lines = script.table(summary).splitlines()
    assert lines[2] == "| m | search | fanoutqa | 4 | 0.250 [0.000, 0.610] | 0.500 | 1.00 | - | 0.50 | - | 12 s |"


def test_gold_in_response_reads_every_turn_without_tags(script, tmp_path):
    records = [
        {"example_id": "fanoutqa-1", "golds": ["Asia"], "turns": [{"text": "I think"}, {"text": "it is Asia."}]},
        {"example_id": "fanoutqa-2", "golds": ["Cupertino, California"], "turns": [{"text": "Apple Inc."}]},
        {"example_id": "freshqa-3", "golds": ["1941"], "turns": [{"text": "<answer> 1941 </answer>"}]},
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    found = script.gold_in_response(path)
    assert found == {"fanoutqa": [1.0, 0.0], "freshqa": [1.0]}
    assert script._share(found, "all") == pytest.approx(2 / 3) and script._share(found, "nq") is None


def test_evidence_shown_reads_the_titles_of_every_search(script, tmp_path):
    def passage(title):
        return {"id": "0", "contents": f'"{title}"\nText.'}

    records = [
        {"example_id": "fanoutqa-1", "searches": [{"passages": [passage("K2")]}, {"passages": [passage("Asia")]}]},
        {"example_id": "fanoutqa-2", "searches": [{"passages": [passage("Apple Inc.")]}]},
        {"example_id": "freshqa-3", "searches": []},
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    shown = script.evidence_shown(path, {"fanoutqa-1": "Asia", "fanoutqa-2": "Apple", "freshqa-3": "Pearl Harbor"})
    assert shown == {"fanoutqa": [1.0, 0.0], "freshqa": [0.0]}  # "Apple" is not "Apple Inc."


def test_search_gain_pairs_the_same_questions(script):
    per_source = {"fanoutqa": {}, "freshqa": {}, "all": {}}
    summary = {
        "label": "m",
        "settings": {  # per_question: id -> [em, f1]
            "search": {
                "per_source": per_source,
                "per_question": {"fanoutqa-1": [1, 1], "fanoutqa-2": [0, 0.5], "freshqa-3": [1, 1]},
            },
            "closed_book": {"per_question": {"fanoutqa-1": [0, 0], "fanoutqa-2": [0, 0.5], "freshqa-3": [1, 1]}},
        },
    }
    rows = script.search_gain(summary).splitlines()[2:]
    # fanoutqa: EM differences 1, 0 -> +0.5; F1 differences 1, 0 -> +0.5; all: EM 1, 0, 0 -> +0.333
    assert rows[0].startswith("| m | fanoutqa | 2 | +0.500 [") and "| +0.500 [" in rows[0]
    assert rows[1].startswith("| m | freshqa | 1 | +0.000")
    assert rows[2].startswith("| m | all | 3 | +0.333 [")
    assert script.search_gain({"label": "m", "settings": {"search": summary["settings"]["search"]}}) == ""
