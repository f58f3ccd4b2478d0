"""Every entry point in a subprocess: train (and Ctrl-C), eval, report, sft, and clean errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"
pytestmark = pytest.mark.slow


def _env(reward_path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(reward_path), env.get("PYTHONPATH", "")])
    return env


def _stratarl(*args, env, timeout=240, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "stratarl.cli", *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=cwd,
    )


def test_train_eval_report_in_subprocesses(tmp_path, tiny_overrides, reward_path):
    env = _env(reward_path)
    run_dir = tmp_path / "run"
    out = _stratarl("train", TINY, *tiny_overrides, "algo.name=so_grpo", "--run-dir", run_dir, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "step 2/2" in out.stdout and (run_dir / "checkpoints" / "latest").is_file()
    assert (run_dir / "config.yaml").is_file() and (run_dir / "summary.json").is_file()

    out = _stratarl("eval", run_dir, "data.max_eval_examples=3", env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "data_source" in out.stdout and "synthkb" in out.stdout
    result = json.loads((run_dir / "eval" / "eval.json").read_text())
    assert result["per_source"]["synthkb"]["count"] == 3
    assert result["model"].endswith("step_000002")
    assert len((run_dir / "eval" / "eval_transcripts.jsonl").read_text().splitlines()) == 2

    other = tmp_path / "other"
    out = _stratarl("train", TINY, *tiny_overrides, "algo.name=grpo", "trainer.steps=1", "--run-dir", other, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    html_path = tmp_path / "report.html"
    out = _stratarl("report", run_dir, other, "--out", html_path, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    page = html_path.read_text()
    assert "data:image/png;base64," in page and "run" in page and "other" in page
    assert (tmp_path / "reward.png").is_file() and (tmp_path / "loss.png").is_file()


def test_config_errors_are_one_clear_line(tmp_path, reward_path):
    out = _stratarl("train", TINY, "trainer.stpes=3", env=_env(reward_path))
    assert out.returncode == 2
    assert "did you mean `trainer.steps`" in out.stderr and "Traceback" not in out.stderr
    out = _stratarl("report", tmp_path, env=_env(reward_path))
    assert out.returncode == 1 and "no metrics.jsonl" in out.stderr and "Traceback" not in out.stderr
    # sft.enabled=false (the default) keeps `train` from checking the warm start; `stratarl sft` checks it itself.
    out = _stratarl("sft", TINY, "sft.probe_every=5", "--out", tmp_path / "sft", env=_env(reward_path))
    assert out.returncode == 2, out.stderr[-3000:]
    assert "sft.probe_every" in out.stderr and "the reading probe draws an unseen world" in out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "sft").exists()


def test_ctrl_c_saves_a_checkpoint_and_exits_cleanly(tmp_path, tiny_overrides, reward_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "stratarl.cli",
            "train",
            str(TINY),
            *tiny_overrides,
            "trainer.steps=200",
            "--run-dir",
            str(run_dir),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(reward_path),
    )
    try:
        for line in proc.stdout:
            if line.startswith("step 1/"):
                proc.send_signal(signal.SIGINT)
                break
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr and "resume with" in stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["interrupted"] is True and 1 <= summary["steps"] < 200
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step_{summary['steps']:06d}"
