"""What a run resolves once from its config: frozen settings that the step and the update read instead of the config
tree, and the resolved algorithm and device policy, which a copy of the config cannot lose."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from stratarl.trainer.config import load_config
from stratarl.trainer.config.resolve import resolve_algorithm
from stratarl.trainer.forward import REFERENCE, PrefixForward
from stratarl.trainer.settings import RunSettings, StepSettings, UpdateSettings

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"


def test_a_copy_of_the_config_keeps_its_algorithm_and_device_policy():
    cfg = load_config(None, ["algo.name=so_grpo", "algo.sorl_delta=0.5"])
    copy = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, steps=7))
    assert copy.algorithm == cfg.algorithm == resolve_algorithm(cfg.algo)
    assert copy.algorithm.normalizer_params["delta"] == 0.5
    assert copy.device_policy == cfg.device_policy
    # A copy with another algorithm section is another algorithm, not a stale one.
    other = dataclasses.replace(cfg, algo=dataclasses.replace(cfg.algo, name="grpo"))
    assert other.algorithm.normalizer == "none" != cfg.algorithm.normalizer


def test_run_settings_are_frozen_plain_values_of_the_config():
    cfg = load_config(
        None,
        [
            "algo.name=ppo",
            "algo.kl_coef=0.01",
            "algo.loss_agg=seq-mean-token-sum-norm",
            "algo.stratum_key=random",
            "rollout.max_total_tokens=300",
            "rollout.temperature=0.7",
            "trainer.epochs=2",
            "optim.grad_clip=0.5",
        ],
    )
    settings = RunSettings.from_config(cfg)
    update, step = settings.update, settings.step
    assert settings.algorithm == cfg.algorithm and settings.policy == cfg.device_policy
    assert (update.kl_coef, update.norm_length, update.temperature, update.grad_clip) == (0.01, 300, 0.7, 0.5)
    assert update.epochs == 2 and not update.on_policy_shortcut
    assert step.random_strata and step.rollout == cfg.rollout
    for value, field in ((settings, "update"), (update, "kl_coef"), (step, "seed"), (step.rollout, "temperature")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(value, field, None)
    assert UpdateSettings.from_config(load_config(None, [])).norm_length is None  # token-mean: no constant L
    assert not StepSettings.from_config(load_config(None, [])).random_strata


def test_a_step_reads_its_settings_not_the_config(tmp_path, tiny_overrides):
    """With the run's config replaced by one that raises on any read, a whole RL step (rollouts, scoring,
    advantages, the update) still runs: the step and the update read only ``run.settings``."""
    from stratarl.trainer.run import build_run
    from stratarl.trainer.step import rl_step

    class Unreadable:
        def __getattr__(self, name):
            raise AssertionError(f"the step read the config tree: cfg.{name}")

    cfg = load_config(TINY, [*tiny_overrides, "trainer.prompts_per_step=2", "rollout.group_size=2"])
    run = build_run(cfg, tmp_path / "run")
    try:
        run.cfg = Unreadable()
        metrics = rl_step(run)
    finally:
        run.logger.close()
    update = run.settings.update
    assert metrics["optim/steps"] == update.epochs * update.mini_batches > 0


def test_a_prefix_forward_selects_rows_of_its_own_selection():
    """``select`` composes: rows of a selection are mapped back to the prefix's batch; the reference path has no
    rows to map."""
    forward = PrefixForward(prefix=None)  # type: ignore[arg-type]  # row mapping needs no states
    assert forward.select([2, 0, 3]).select([1, 2]).rows == (0, 3)
    assert forward.select([4, 5]).rows == (4, 5)
    assert REFERENCE.select([1, 2]) is REFERENCE and REFERENCE.prefix is None
