"""`stratarl verl convert-data`: veRL's Search-R1 parquet variant (needs no veRL; runs in both venvs)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pq = pytest.importorskip("pyarrow.parquet")

from stratarl.data.examples import Example  # noqa: E402
from stratarl.data.search_r1 import load_examples  # noqa: E402
from stratarl.integrations.verl_data import VERL_USER_TEMPLATE, verl_search_row  # noqa: E402


def run_cli(*args, cwd):
    return subprocess.run(
        [sys.executable, "-m", "stratarl.cli", "verl", *args], capture_output=True, text=True, timeout=120, cwd=cwd
    )


@pytest.fixture()
def search_r1_jsonl(tmp_path):
    rows = [
        {
            "id": "nq-7",
            "question": "who wrote hamlet",
            "golden_answers": ["Shakespeare", "William Shakespeare"],
            "data_source": "nq",
            "extra_info": {"split": "train", "index": 0},
        },
        {
            "id": "hotpot-1",
            "question": "Which river flows through Paris?",
            "golden_answers": ["Seine"],
            "data_source": "hotpotqa",
            "extra_info": {"split": "train", "index": 0},
        },
    ]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_convert_data_writes_verl_rows_that_read_back(search_r1_jsonl, tmp_path):
    out = tmp_path / "verl" / "train.parquet"
    result = run_cli("convert-data", str(search_r1_jsonl), str(out), "--split", "train", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "wrote 2 rows" in result.stdout
    rows = pq.read_table(out).to_pylist()
    first = rows[0]
    assert first["data_source"] == "searchR1_nq"
    assert first["agent_name"] == "tool_agent"
    assert [m["role"] for m in first["prompt"]] == ["system", "user"]
    assert first["prompt"][1]["content"] == VERL_USER_TEMPLATE.format(question="who wrote hamlet?")
    golds = ["Shakespeare", "William Shakespeare"]
    assert first["reward_model"] == {"style": "rule", "ground_truth": {"target": golds}}
    search_kwargs = first["extra_info"]["tools_kwargs"]["search"]["create_kwargs"]
    assert search_kwargs["ground_truth"] == {"target": ["Shakespeare", "William Shakespeare"]}
    assert search_kwargs["data_source"] == "searchR1_nq"
    assert [r["extra_info"]["index"] for r in rows] == [0, 1]  # the row number, not the source's index
    # stratarl's loader reads veRL's variant back into the same questions and answers.
    back = load_examples(out)
    assert [(e.question, e.golden_answers, e.data_source) for e in back] == [
        ("who wrote hamlet?", ("Shakespeare", "William Shakespeare"), "nq"),
        ("Which river flows through Paris?", ("Seine",), "hotpotqa"),
    ]


def test_convert_data_errors_name_the_problem(search_r1_jsonl, tmp_path):
    missing = run_cli("convert-data", str(tmp_path / "nope.jsonl"), str(tmp_path / "o.parquet"), cwd=tmp_path)
    assert missing.returncode == 2 and "nope.jsonl" in missing.stderr and "Traceback" not in missing.stderr
    wrong_suffix = run_cli("convert-data", str(search_r1_jsonl), str(tmp_path / "o.jsonl"), cwd=tmp_path)
    assert wrong_suffix.returncode == 2 and "parquet" in wrong_suffix.stderr
    bad_limit = run_cli("convert-data", str(search_r1_jsonl), str(tmp_path / "o.parquet"), "--limit", "0", cwd=tmp_path)
    assert bad_limit.returncode == 2 and "--limit" in bad_limit.stderr


def test_row_keeps_an_existing_prefix_and_needs_answers():
    row = verl_search_row(Example(id="x", question="q", golden_answers=("a",), data_source="searchR1_nq"), 3)
    assert row["data_source"] == "searchR1_nq" and row["extra_info"]["index"] == 3
    with pytest.raises(ValueError, match="no gold answers"):
        verl_search_row(Example(id="y", question="q", golden_answers=(), data_source="nq"), 0)


def test_verl_check_without_verl_says_how_to_install(tmp_path):
    import importlib.util

    if importlib.util.find_spec("verl.trainer") is not None:
        pytest.skip("veRL is installed here; test_verl_recipe.py runs `stratarl verl check` with it")
    result = run_cli("check", cwd=tmp_path)
    assert result.returncode == 2
    assert "needs veRL" in result.stderr and "requirements/verl.txt" in result.stderr
    assert "Traceback" not in result.stderr
