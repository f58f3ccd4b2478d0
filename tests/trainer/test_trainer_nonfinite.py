"""A step whose loss or gradient is not finite stops the run (stratarl.trainer.stops.nonfinite_step): exit code 4,
one line naming the step, no checkpoint of the suspect weights; it is never skipped while the run ends `done`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from stratarl.algos import register_advantage
from stratarl.trainer.config import load_config
from stratarl.trainer.stops import NONFINITE_STOP_CODE, nonfinite_step

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"
NAN_ADVANTAGE = "i54_test_nan_advantage"


@pytest.fixture
def nan_advantage():
    """An estimator whose every policy-token advantage is NaN (a loss, so a gradient, that is not finite),
    unregistered afterwards."""
    from stratarl.algos import registry

    @register_advantage(NAN_ADVANTAGE)
    def _nan_advantage(batch):
        nan = torch.full(batch.response_mask.shape, float("nan"))
        return nan, nan

    yield NAN_ADVANTAGE
    del registry._ADVANTAGES[NAN_ADVANTAGE]
    registry._ADVANTAGE_INFO.pop(NAN_ADVANTAGE, None)
    registry._PARAMS["advantage"].pop(NAN_ADVANTAGE, None)


def test_nonfinite_step_hand_cases():
    assert nonfinite_step(1, {"optim/skipped_steps": 0.0, "loss/policy": 0.3}) is None
    assert nonfinite_step(1, {}) is None  # a step without an update (retrieval faults) is not this stop
    assert "step 2: the gradient is not finite" in nonfinite_step(2, {"optim/skipped_steps": 0.5, "loss/policy": 0.1})
    assert "the policy loss is not finite (nan)" in nonfinite_step(3, {"loss/policy": float("nan")})


def test_a_nan_loss_stops_the_run_with_exit_code_4(tmp_path, tiny_overrides, capsys, nan_advantage):
    """Before: the optimizer skipped every step, the run wrote a checkpoint of step 3 and ended `done`, exit 0."""
    from stratarl.trainer.rl import train

    cfg = load_config(
        TINY,
        [
            *tiny_overrides,
            f"algo.advantage={NAN_ADVANTAGE}",
            "trainer.steps=3",
            "trainer.prompts_per_step=2",
            "rollout.group_size=2",
            "eval.before_after=false",
        ],
    )
    summary = train(cfg, tmp_path / "run")
    assert summary["exit_code"] == NONFINITE_STOP_CODE
    assert summary["steps"] == 1 and summary["checkpoint"] is None
    assert summary["stop_reason"].startswith("step 1: ") and "not finite" in summary["stop_reason"]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["exit_code"] == NONFINITE_STOP_CODE
    assert not list((tmp_path / "run" / "checkpoints").glob("step_*"))
    err = capsys.readouterr().err
    assert "error: step 1: " in err
