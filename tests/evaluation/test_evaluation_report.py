"""The HTML report: several runs overlaid in one page, and its errors."""

from __future__ import annotations

import json

import pytest

from stratarl.evaluation.report import build_report


def _fake_run(path, rewards):
    path.mkdir()
    with open(path / "metrics.jsonl", "w") as f:
        for step, r in enumerate(rewards, 1):
            f.write(
                json.dumps(
                    {"step": step, "reward/mean": r, "loss/policy": -r, "sorl/c_norm": 0.0, "stratum/0/reward_mean": r}
                )
                + "\n"
            )
    (path / "eval").mkdir()
    (path / "eval" / "after.json").write_text(
        json.dumps(
            {
                "per_source": {
                    "nq": {"em": 0.5, "subem": 0.5, "f1": 0.6, "searches_mean": 1.0, "answer_rate": 1.0, "count": 4}
                }
            }
        )
    )


def test_report_overlays_runs_in_one_page(tmp_path):
    _fake_run(tmp_path / "grpo", [0.1, 0.2, 0.3])
    _fake_run(tmp_path / "stratified", [0.2, 0.3, 0.5])
    out = build_report([tmp_path / "grpo", tmp_path / "stratified"], tmp_path / "r" / "index.html")
    page = out.read_text()
    assert page.count('curves" src="data:image/png;base64,') == 4  # the grid: reward, stratum, loss, sorl
    assert "grpo" in page and "stratified" in page and "<td>nq</td>" in page
    assert {p.name for p in (tmp_path / "r").glob("*.png")} == {
        "reward.png",
        "stratum.png",
        "loss.png",
        "sorl.png",
        "did_it_learn.png",
        "did_it_learn_searches.png",
        "did_it_learn_strata.png",
    }


def test_report_needs_run_dirs(tmp_path):
    with pytest.raises(FileNotFoundError, match="no metrics.jsonl"):
        build_report([tmp_path])
    with pytest.raises(ValueError, match="at least one"):
        build_report([])


def test_the_transcript_shows_every_tool_call():
    from stratarl.evaluation.report import _turns_html

    record = {
        "turns": [{"text": "<open> Paris </open>", "observation": "obs"}],
        "calls": [
            {"tool": "open", "arguments": {"title": "Paris"}, "status": "ok", "detail": ""},
            {"tool": "bad", "arguments": None, "status": "malformed", "detail": "unknown tool 'bad'"},
        ],
    }
    page = _turns_html(record)
    assert "open({&quot;title&quot;: &quot;Paris&quot;}): ok" in page
    assert "bad(null): malformed (unknown tool &#x27;bad&#x27;)" in page
    assert "Tool calls" not in _turns_html({"turns": record["turns"]})
