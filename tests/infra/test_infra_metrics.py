"""Metrics files, the phase timer and the step line."""

from __future__ import annotations

import torch

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


def test_step_line_says_when_dynamic_sampling_left_nothing_to_train_on():
    line = format_step_line(3, 10, {"reward/mean": 0.0, "update/no_signal": 1.0, "dynsample/kept_groups": 0.0})
    assert line.endswith("| no update (nothing to train on) | kept 0 groups")
    assert "kept" not in format_step_line(3, 10, {"reward/mean": 0.0})
