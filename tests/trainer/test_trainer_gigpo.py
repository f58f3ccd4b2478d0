"""GiGPO in the trainer: `algo.name=gigpo` resolves, the anchor states come from the collected rollouts, and on a
real step (real tiny model, engine, BM25 and update) the update receives GiGPO's advantages, not GRPO's."""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

import pytest
import torch

from stratarl.algos.advantages import broadcast_to_tokens, grpo_advantages
from stratarl.config_errors import ConfigError
from stratarl.retrieval.base import Passage
from stratarl.rollout.collect import step_states
from stratarl.rollout.engine import Rollout, Turn
from stratarl.rollout.parsing import Action
from stratarl.trainer.config import load_config

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"
ORACLES = Path(__file__).resolve().parents[1] / "algos" / "algos_oracles.py"


def test_the_preset_resolves_with_its_parameters_and_knobs():
    spec = load_config(None, ["algo.name=gigpo"]).algorithm
    assert (spec.advantage, spec.policy_loss, spec.ratio_level, spec.normalizer, spec.critic) == (
        "gigpo",
        "ppo",
        "token",
        "none",
        "none",
    )
    assert dict(spec.advantage_params) == {"gamma": 1.0, "eps": 1e-6}  # the knobs; the rest keep their defaults
    spec = load_config(
        None,
        [
            "algo.name=gigpo",
            "algo.gamma=0.95",
            "algo.epsilon=1e-5",
            "algo.advantage_params.similarity_threshold=0.9",
            "algo.advantage_params.step_weight=0.5",
        ],
    ).algorithm
    assert {k: spec.advantage_params[k] for k in ("gamma", "eps", "similarity_threshold", "step_weight")} == {
        "gamma": 0.95,
        "eps": 1e-5,
        "similarity_threshold": 0.9,
        "step_weight": 0.5,
    }
    with pytest.raises(ConfigError, match="has no parameter `omega`"):
        load_config(None, ["algo.name=gigpo", "algo.advantage_params.omega=1.0"])
    with pytest.raises(ConfigError, match="group_size"):
        load_config(None, ["algo.name=gigpo", "rollout.group_size=1"])
    other = load_config(None, ["algo.name=grpo", "algo.advantage=gigpo"]).algorithm  # the estimator alone
    assert other.advantage == "gigpo" and other.ratio_level == "token"


class _Letters:
    """Decodes ids as letters (0 → 'a'), the only tokenizer method step_states uses."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(ord("a") + i) for i in ids)


def test_step_states_are_the_observations_before_each_turn():
    # Response: turn 0 (ids 9 9), observation (0 1), turn 1 (9), invalid feedback (2), turn 2 (9 9), trailing obs (3).
    rollout = Rollout(
        prompt_ids=[5, 5],
        response_ids=[9, 9, 0, 1, 9, 2, 9, 9, 3],
        response_mask=[1, 1, 0, 0, 1, 0, 1, 1, 0],
        turns=[
            Turn(0, 2, Action("search", "q"), "stop", (2, 4)),
            Turn(4, 5, Action("invalid", ""), "stop", (5, 6)),
            Turn(6, 8, Action("search", "r"), "stop", (8, 9)),
        ],
        queries=["q", "r"],
        passages=[[Passage("1", "x")], [Passage("2", "y")]],
    )
    sep = "\x1e"
    assert step_states(rollout, _Letters()) == ("", sep + "ab", sep + "ab" + sep + "c")


def _states_from_mask(rollout, tokenizer):
    """Independent of stratarl: the observations are the runs of mask 0 between two runs of mask 1."""
    mask, ids = rollout.response_mask, rollout.response_ids
    runs, states, seen = [], [], []
    t = 0
    while t < len(mask):
        start = t
        while t < len(mask) and mask[t] == mask[start]:
            t += 1
        runs.append((mask[start], start, t))
    for index, (policy, start, end) in enumerate(runs):
        if policy:
            states.append("".join("\x1e" + text for text in seen))
        elif index > 0:
            seen.append(tokenizer.decode(ids[start:end], skip_special_tokens=False))
    return tuple(states)


@pytest.mark.slow
def test_a_real_step_updates_with_gigpo_advantages_and_logs_the_step_groups(tmp_path, tiny_overrides, load_script):
    from stratarl.trainer.run import build_run
    from stratarl.trainer.step import rl_step

    oracles = load_script(ORACLES, "algos_oracles_for_gigpo")
    # The tiny random model never searches: every rollout reads the same invalid-action feedback, so each turn's
    # step group would be its whole prompt group. The spy makes rollouts 2 and 3 of each group read a different
    # first feedback token (same length), as different searches would: their second turn is then alone in its
    # step group while rollouts 0 and 1 share one. (The frozen prefix is recomputed from the edited tokens.)
    cfg = load_config(
        TINY,
        [
            *tiny_overrides,
            "trainer.prompts_per_step=4",
            "rollout.group_size=4",
            "algo.name=gigpo",
            "algo.gamma=0.8",
            "trainer.prefix_from_rollouts=false",
        ],
    )
    run = build_run(cfg, tmp_path / "run")
    record = {}
    real_collect, real_update = run.parts.collect, run.parts.update

    def collect(*args, **kwargs):
        record["collected"] = real_collect(*args, **kwargs)
        for index, rollout in enumerate(record["collected"].rollouts):
            if index % 4 >= 2 and rollout.turns[0].observation_span is not None:
                rollout.response_ids[rollout.turns[0].observation_span[0]] = 100 + index % 4
        return record["collected"]

    def update(learner, batch, *args, **kwargs):
        record["batch"] = batch
        return real_update(learner, batch, *args, **kwargs)

    run.parts = dataclasses.replace(run.parts, collect=collect, update=update)
    try:
        metrics = rl_step(run)
        tokenizer = run.tokenizer
    finally:
        run.logger.close()

    collected, batch = record["collected"], record["batch"]
    states = tuple(_states_from_mask(r, tokenizer) for r in collected.rollouts)
    assert states == tuple(step_states(r, tokenizer) for r in collected.rollouts)
    rewards, groups, mask = (torch.tensor(collected.rewards), torch.tensor(collected.group_ids), batch.response_mask)
    expected, clusters = oracles.gigpo_loop(rewards, groups, mask, states, gamma=0.8)
    torch.testing.assert_close(batch.advantages.double(), expected, rtol=1e-5, atol=1e-5)

    # Dropping the step level would leave GRPO's advantages: they differ exactly on the turns whose step group
    # has two or more steps with different returns, and there are such turns in this batch.
    grpo = broadcast_to_tokens(grpo_advantages(rewards, groups), mask)
    differs = (batch.advantages - grpo).abs() > 1e-6
    acting = torch.zeros_like(differs)
    for members in clusters:
        returns = {
            round(0.8 ** (len(oracles.policy_runs_loop(mask[b])) - 1 - k) * float(rewards[b]), 9) for b, k in members
        }
        if len(members) > 1 and len(returns) > 1:
            for b, k in members:
                acting[b, oracles.policy_runs_loop(mask[b])[k]] = True
    assert acting.any() and torch.equal(differs, acting)

    sizes = [len(c) for c in clusters]
    steps = [len(c) for c in clusters for _ in c]
    assert metrics["gigpo/step_group_size_mean"] == pytest.approx(sum(sizes) / len(sizes))
    assert metrics["gigpo/singleton_step_frac"] == pytest.approx(sum(s == 1 for s in steps) / len(steps))
    assert metrics["gigpo/step_groups"] == len(sizes)
    assert 0 < metrics["gigpo/singleton_step_frac"] < 1 and max(sizes) >= 2  # both kinds of step group occur
    by_size = Counter(min(size, 4) for size in sizes)
    assert metrics["gigpo/step_group_size_frac/1"] == pytest.approx(by_size[1] / len(sizes))
