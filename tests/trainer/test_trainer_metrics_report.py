"""Metrics files, the step line, and the HTML report."""

from __future__ import annotations

import json

import pytest
import torch

from stratarl.evaluation.report import build_report
from stratarl.infra.metrics import MetricsLogger, PhaseTimer, format_step_line, read_metrics


def test_logger_writes_jsonl_and_tensorboard(tmp_path):
    logger = MetricsLogger(tmp_path, tensorboard=True)
    plain = logger.log(1, {"reward/mean": torch.tensor(0.5), "loss/kl": 0.25, "note": "x", "bad": float("nan")})
    logger.close()
    assert plain["reward/mean"] == 0.5 and plain["bad"] is None
    rows = read_metrics(tmp_path)
    assert rows == [{"step": 1, "reward/mean": 0.5, "loss/kl": 0.25, "note": "x", "bad": None}]
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_read_metrics_skips_a_torn_last_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "a": 1}\n{"step": 2, "a"')
    assert read_metrics(tmp_path) == [{"step": 1, "a": 1}]


def test_phase_timer_accumulates_and_resets():
    timer = PhaseTimer()
    with timer("update"):
        pass
    timer.add("update", 2.0)
    timer.add("generation", 1.0)
    out = timer.pop()
    assert out["time/generation"] == 1.0 and out["time/update"] >= 2.0
    assert timer.pop() == {}


def test_step_line_shows_key_numbers():
    line = format_step_line(3, 10, {"reward/mean": 0.25, "reward/em": 0.125, "rollout/search_calls_mean": 1.5})
    assert line.startswith("step 3/10") and "reward 0.250" in line and "em 0.125" in line and "searches 1.50" in line


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
