"""veRL's own trainer, `python -m verl.trainer.main_ppo`, end to end on a CPU with stratarl's plugins.

Two training steps of veRL's default v1 trainer (trainer.use_v1=true: PPOTrainerSync over TransferQueue)
in Ray local mode (hf rollout server, FSDP2 actor on gloo, stratified_grpo advantages, the sorl loss in
SORLTrainingWorker), the plugins loaded only through VERL_USE_EXTERNAL_MODULES
(harness.smoke). The legacy RayPPOTrainer runs in test_verl_main_ppo_multiturn.py.
About two minutes on 2 cores.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

pytest.importorskip("verl.trainer.ppo.core_algos", reason="needs veRL (make test-verl runs these in .venv-verl)")

import torch
from harness.smoke import SORL_DELTA, STRATIFIED_EPS, pythonpath
from harness.smoke_multiturn import step_metrics

from stratarl.algos import stratified_advantages

REPO = Path(__file__).resolve().parents[2]


def expected_extremes(rollouts: Path, *, alpha: float, eps: float) -> tuple[float, float]:
    """max/min advantage that stratarl's Stratified GRPO gives the dumped rollouts of one step.

    Groups: veRL repeats each prompt n times, so a group is the rollouts with the same input.
    Single-turn responses have no tool observations: every rollout is in stratum 0.
    """
    rows = [json.loads(line) for line in rollouts.read_text().splitlines()]
    index: dict[str, int] = defaultdict(lambda: len(index))
    groups = torch.tensor([index[row["input"]] for row in rows])
    rewards = torch.tensor([float(row["score"]) for row in rows])
    adv = stratified_advantages(rewards, groups, torch.zeros_like(groups), alpha=alpha, eps=eps, std_ddof=1)
    return float(adv.max()), float(adv.min())


@pytest.mark.slow
def test_main_ppo_runs_two_steps_on_cpu_with_stratified_grpo_and_sorl(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "harness.smoke", "--workdir", str(tmp_path), "--steps", "2"],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": pythonpath()},  # the harness lives in tests/verl
    )
    log = (tmp_path / "main_ppo.log").read_text() if (tmp_path / "main_ppo.log").exists() else ""
    assert result.returncode == 0, (result.stderr + log)[-6000:]
    steps = step_metrics(log)
    assert sorted(steps) == [1, 2], f"veRL logged steps {sorted(steps)}; log tail:\n{log[-3000:]}"
    assert "TaskRunnerV1 pid=" in log  # veRL's v1 trainer (its default)

    for step, m in steps.items():
        # Generation, reward and update all happened, and the update is finite.
        assert m["response_length/mean"] > 0
        assert math.isfinite(m["actor/pg_loss"]) and math.isfinite(m["actor/grad_norm"])
        # Only SORLTrainingWorker's optimizer step logs sorl/*: the sorl loss ran inside veRL's
        # actor worker with the clipping-triggered normalisation, in a Ray worker that loaded the
        # plugins through VERL_USE_EXTERNAL_MODULES alone. turn_* come from the turn-level loss.
        assert "actor/sorl/c_norm" in m and "actor/sorl/scale" in m and "actor/turn_clipfrac" in m
        assert math.isfinite(m["actor/sorl/c_norm"]) and m["actor/sorl/c_norm"] >= 0

        # The advantages are stratarl's estimator with its own settings block (ε = STRATIFIED_EPS,
        # which veRL's estimators never read): they match stratarl.algos on the dumped rollouts
        # and differ from what veRL's grpo (ε = 1e-6) would give the same rewards.
        rollouts = tmp_path / "rollouts" / f"{step}.jsonl"
        high, low = expected_extremes(rollouts, alpha=0.6, eps=STRATIFIED_EPS)
        assert m["critic/advantages/max"] == pytest.approx(high, abs=1e-4)
        assert m["critic/advantages/min"] == pytest.approx(low, abs=1e-4)
        grpo_high, grpo_low = expected_extremes(rollouts, alpha=0.0, eps=1e-6)
        if (high, low) != (0.0, 0.0):  # some group has reward variance
            assert (grpo_high, grpo_low) != pytest.approx((high, low), abs=1e-3)

    # Step 1 samples from the initial bigram model with per-prompt seeds: its groups have reward
    # variance, so its update is real.
    assert steps[1]["critic/advantages/max"] > 0 and steps[1]["actor/grad_norm"] > 0

    # Each step has two mini-batches (one prompt group each); veRL logs the mean over them.
    # The first starts at θ = θ_old, so nothing clips: ‖C‖₁ = 0 and scale₁ = 1/max(0, δ) = 1/δ.
    # The second is off-policy by one update: scale₂ = 1/max(‖C‖₂, δ). So with the logged means,
    # c̄ = ‖C‖₂ / 2 and scalē = (1/δ + 1/max(2c̄, δ)) / 2, exactly SORL's rule.
    for step, m in steps.items():
        c_second = 2 * m["actor/sorl/c_norm"]
        expected_scale = (1.0 / SORL_DELTA + 1.0 / max(c_second, SORL_DELTA)) / 2
        assert m["actor/sorl/scale"] == pytest.approx(expected_scale, rel=1e-5), f"step {step}"
    # lr 0.01 with clip 0.001: the off-policy mini-batch's turns clip, and ‖C‖ > δ shrinks its step.
    assert max(m["actor/turn_clipfrac"] for m in steps.values()) > 0
    assert max(m["actor/sorl/c_norm"] for m in steps.values()) > SORL_DELTA / 2
