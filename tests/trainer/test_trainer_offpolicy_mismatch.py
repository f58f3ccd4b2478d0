"""A stale-weights step with one optimizer step per batch measures the sampler/learner mismatch on the update's
own forward (no scoring pass), and measures what the scoring pass would: the same metrics, the same training."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from stratarl.trainer import update as update_module
from stratarl.trainer.config import load_config
from stratarl.trainer.update import update_policy

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"
ONE_STEP = [
    "trainer.prompts_per_step=3",
    "rollout.group_size=3",
    "algo.name=grpo",
    "trainer.policy_lag=2",
    "trainer.epochs=1",
    "trainer.mini_batches=1",
    "optim.lr=0.02",
    "algo.kl_coef=0",  # no reference pass: every scoring pass left is the mismatch measurement
]


def _run_steps(tmp_path, tiny_overrides, name: str, *, separate_pass: bool, monkeypatch) -> tuple[list, int]:
    from stratarl.trainer.run import build_run
    from stratarl.trainer.step import rl_step

    run = build_run(load_config(TINY, [*tiny_overrides, *ONE_STEP]), tmp_path / name)
    if separate_pass:  # an update without the keyword: the step falls back to the scoring pass

        def plain(learner, batch, settings, generator, *, forward=None):
            return update_policy(learner, batch, settings, generator, forward=forward)

        run.parts = dataclasses.replace(run.parts, update=plain)
    passes = []
    real = update_module._score_rows
    monkeypatch.setattr(update_module, "_score_rows", lambda *a, **k: passes.append(1) or real(*a, **k))
    rows = []
    try:
        for _ in range(3):
            rows.append(rl_step(run))
            run.step += 1
    finally:
        run.logger.close()
    return rows, len(passes)


def test_the_update_measures_the_mismatch_without_a_scoring_pass(tmp_path, tiny_overrides, monkeypatch):
    in_update, passes = _run_steps(tmp_path, tiny_overrides, "a", separate_pass=False, monkeypatch=monkeypatch)
    scored, scoring_passes = _run_steps(tmp_path, tiny_overrides, "b", separate_pass=True, monkeypatch=monkeypatch)
    assert passes == 0 and scoring_passes > 0
    assert [m["offpolicy/lag"] for m in in_update] == [0.0, 1.0, 2.0]
    assert in_update[2]["offpolicy/mismatch"] > 1e-3  # two updates since the snapshot: a real mismatch
    for a, b in zip(in_update, scored, strict=True):
        assert a["loss/policy"] == b["loss/policy"]  # the same training
        for key in ("offpolicy/mismatch", "offpolicy/kl_k3", "offpolicy/ratio_max"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6)


def test_learner_logprobs_need_one_optimizer_step(tmp_path, tiny_overrides):
    from stratarl.trainer.run import build_run

    run = build_run(load_config(TINY, [*tiny_overrides, "trainer.epochs=2"]), tmp_path / "r")
    with pytest.raises(ValueError, match="one optimizer step"):
        update_policy(run.learner, None, run.settings.update, run.shuffle_rng, learner_logprobs=torch.zeros(1, 1))
    run.logger.close()
