"""benchmarks/external/phantomwiki_gain.py and `stratarl report --benchmark`: the files they write hold the JSON's
numbers, and two results over different questions are refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "external" / "phantomwiki_gain.py"


def _row(i, f1, difficulty=1):
    return {
        "example_id": i,
        "question_type": f"difficulty_{difficulty}",
        "em": float(f1 == 1),
        "f1": f1,
        "searches": 1.0,
        "answered": 1.0,
    }


def _result(path, label, scores):
    rows = [_row(i, f1) for i, f1 in scores.items()]
    path.write_text(
        json.dumps({"label": label, "universes": [], "commands": [], "settings": {"search": {"per_question": rows}}})
    )
    return path


@pytest.fixture(scope="module")
def gain_script(load_script):
    return load_script(BENCH, "phantomwiki_gain")


def test_the_script_writes_the_gain_its_table_and_its_page(gain_script, tmp_path, capsys):
    # F1 differences by id: +1, +0.5, 0, 0 -> mean 0.375
    before = _result(tmp_path / "warm.json", "warm start", {"q1": 0.0, "q2": 0.5, "q3": 1.0, "q4": 0.0})
    after = _result(tmp_path / "rl.json", "after RL", {"q4": 0.0, "q3": 1.0, "q2": 1.0, "q1": 1.0})
    assert gain_script.main(["--before", str(before), "--after", str(after), "--out", str(tmp_path / "g.json")]) == 0
    gain = json.loads((tmp_path / "g.json").read_text())
    assert gain["all"]["f1"]["gain"]["mean"] == pytest.approx(0.375) and gain["all"]["f1"]["up"] == 2
    assert gain["transcripts"]["gained"]["id"] == "q1" and gain["transcripts"]["lost"] is None
    assert "+0.375" in (tmp_path / "g.md").read_text() and "+0.375" in (tmp_path / "g.html").read_text()
    assert "gained: q1 F1 0.00 -> 1.00 (transcript missing)" in capsys.readouterr().out


def test_the_script_refuses_other_questions_in_one_line(gain_script, tmp_path, capsys):
    before = _result(tmp_path / "a.json", "a", {"q1": 0.0})
    after = _result(tmp_path / "b.json", "b", {"q2": 0.0})
    assert gain_script.main(["--before", str(before), "--after", str(after), "--out", str(tmp_path / "g.json")]) == 2
    err = capsys.readouterr().err
    assert "do not cover the same questions" in err and err.count("\n") == 1
    assert not (tmp_path / "g.json").exists()


def test_stratarl_report_renders_a_benchmark(stratarl_cli, tmp_path):
    before = _result(tmp_path / "warm.json", "warm start", {"q1": 0.0, "q2": 0.5})
    after = _result(tmp_path / "rl.json", "after RL", {"q1": 1.0, "q2": 0.5})
    done = stratarl_cli("report", "--benchmark", after, "--before", before)
    assert done.returncode == 0, done.stderr
    page = (tmp_path / "rl.html").read_text()
    assert "Did it learn?" in page and "after RL vs warm start (search): F1 +0.500" in page
    refused = stratarl_cli("report")
    assert refused.returncode != 0 and "--benchmark" in refused.stderr and refused.stderr.count("\n") == 1
