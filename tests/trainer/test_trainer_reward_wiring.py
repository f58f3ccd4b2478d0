"""The reward, dynamic sampling and overlong handling, pinned on real steps (real tiny model, engine, BM25 and
update). Each test fails when its part is silently not applied: a reward component dropped, the filter reading
the shaped reward, overlong rollouts still in the loss, a reward fault trained on as a 0."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from stratarl.rewards import RewardFault, RewardResult, Trajectory, em_reward, is_valid_format, register_reward
from stratarl.rewards import registry as reward_registry
from stratarl.rollout.collect import Scoring
from stratarl.trainer.batch import collate_rollouts
from stratarl.trainer.config import load_config

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One tiny run for the whole module (each test sets the part it pins, then puts it back)."""
    from stratarl.trainer.run import build_run

    root = tmp_path_factory.mktemp("reward_wiring")
    cfg = load_config(
        TINY,
        [
            f"data.synthetic.cache_dir={root / 'kb'}",
            f"trainer.output_dir={root / 'runs'}",
            "trainer.prompts_per_step=4",
            "rollout.group_size=4",
            "logging.num_transcripts=0",
        ],
    )
    built = build_run(cfg, root / "run")
    yield built
    built.logger.close()


@pytest.fixture
def spy(run):
    """Records the collected rollouts and the batch the update receives; restores the run's parts after."""
    record: dict = {"collected": [], "batch": None}
    parts, scoring, settings = run.parts, run.scoring, run.settings

    def collect(*args, **kwargs):
        collected = parts.collect(*args, **kwargs)
        if record.get("overlong") is not None:  # the test's own overlong flags
            collected = dataclasses.replace(collected, overlong=record["overlong"](collected))
        record["collected"].append(collected)
        return collected

    def update(learner, batch, *args, **kwargs):
        record["batch"] = copy.deepcopy(batch)
        return parts.update(learner, batch, *args, **kwargs)

    run.parts = dataclasses.replace(parts, collect=collect, update=update)
    yield record
    run.parts, run.scoring, run.settings = parts, scoring, settings


def _set(run, **step):
    run.settings = dataclasses.replace(run.settings, step=dataclasses.replace(run.settings.step, **step))


@pytest.fixture
def own_rewards(monkeypatch):
    monkeypatch.setattr(reward_registry, "_REWARDS", reward_registry._REWARDS.copy())


def test_every_reward_component_reaches_the_reward_and_the_metrics(run, spy):
    from stratarl.trainer.step import rl_step

    params = {"format_score": 0.2, "tool_call_cost": 0.1, "invalid_action_penalty": 0.05}
    run.scoring = Scoring.from_names("em_format", reward_params=params)
    metrics = rl_step(run)
    (collected,) = spy["collected"]
    for rollout, example, total, outcome in zip(
        collected.rollouts, collected.examples, collected.rewards, collected.outcomes
    ):
        em = em_reward(rollout.response_text, example.golden_answers)
        gated = (
            (1.0 if is_valid_format(rollout.response_text) else 0.8)
            if em
            else (0.2 * is_valid_format(rollout.response_text))
        )
        expected = gated - 0.1 * rollout.num_searches - 0.05 * rollout.invalid_actions
        assert total == pytest.approx(expected) and outcome == em
    assert any(r.invalid_actions for r in collected.rollouts)  # the penalty had something to act on
    names = ("answer", "format", "invalid_penalty", "tool_cost")
    parts = [metrics[f"reward/{name}_mean"] for name in names]
    assert sum(parts) == pytest.approx(metrics["reward/mean"])
    assert metrics["reward/invalid_penalty_mean"] < 0
    assert metrics["reward/outcome_mean"] == pytest.approx(sum(collected.outcomes) / len(collected.outcomes))
    # The advantage read the shaped totals: the update trained on them.
    assert spy["batch"] is not None


def test_dynamic_sampling_drops_groups_whose_outcome_is_constant_whatever_the_shaped_reward(run, spy, own_rewards):
    from stratarl.trainer.step import rl_step

    @register_reward("shaped_only")
    def shaped_only(trajectory: Trajectory) -> RewardResult:
        # The shaped total varies with the response's length; the raw outcome is always 0.
        shaping = float(len(trajectory.response_text) % 2)
        return RewardResult(total=shaping, outcome=0.0, components={"shaping": shaping})

    run.scoring = Scoring.from_names("shaped_only")
    _set(run, dynamic_sampling=True, dynamic_sampling_attempts=2)
    metrics = rl_step(run)
    assert len(spy["collected"]) == 2 and spy["batch"] is None  # two collections, no update
    assert any(len(set(c.rewards)) > 1 for c in spy["collected"])  # the shaped totals did vary
    assert metrics["dynsample/filtered_share"] == 1.0 and metrics["dynsample/kept_groups"] == 0.0
    assert metrics["dynsample/short"] == 1.0 and metrics["update/no_signal"] == 1.0
    assert metrics["dynsample/attempts"] == 2.0


def test_dynamic_sampling_keeps_groups_whose_outcome_varies(run, spy, own_rewards):
    from stratarl.trainer.step import rl_step

    @register_reward("outcome_only")
    def outcome_only(trajectory: Trajectory) -> RewardResult:
        return RewardResult(total=0.5, outcome=float(len(trajectory.response_text) % 2), components={})

    run.scoring = Scoring.from_names("outcome_only")
    _set(run, dynamic_sampling=True, dynamic_sampling_attempts=3)
    metrics = rl_step(run)
    kept = int(metrics["dynsample/kept_groups"])
    assert kept >= 1 and spy["batch"] is not None and spy["batch"].size == 4 * kept
    varied = [
        len({len(r.response_text) % 2 for r in c.rollouts[g * 4 : g * 4 + 4]}) > 1
        for c in spy["collected"]
        for g in range(len(c.rollouts) // 4)
    ]
    assert kept == min(4, sum(varied))


def _mask_step(run, spy, rule):
    from stratarl.trainer.step import rl_step

    spy["overlong"] = lambda c: [i % 3 == 0 for i in range(len(c.rollouts))]
    _set(run, mask_overlong=rule == "mask")
    metrics = rl_step(run)
    (collected,) = spy["collected"]
    tokens = collate_rollouts(collected.rollouts, run.tokenizer.pad_token_id)
    return metrics, collected, tokens.response_mask, spy["batch"]


def test_overlong_rollouts_are_out_of_the_loss_with_mask(run, spy):
    metrics, collected, mask, batch = _mask_step(run, spy, "mask")
    flagged = torch.tensor(collected.overlong)
    assert flagged.any() and not flagged.all()
    assert torch.equal(batch.response_mask[flagged], torch.zeros_like(batch.response_mask[flagged]))
    assert torch.equal(batch.advantages[flagged], torch.zeros_like(batch.advantages[flagged]))
    assert torch.equal(batch.response_mask[~flagged], mask[~flagged].to(batch.response_mask.dtype))
    assert metrics["rollout/overlong_masked"] == float(flagged.sum())
    assert metrics["rollout/truncated_share"] == pytest.approx(float(flagged.float().mean()))


def test_overlong_rollouts_stay_in_the_loss_with_keep(run, spy):
    # The control: the same flags, rule keep -> every row keeps its mask (so the test above can fail).
    metrics, _, mask, batch = _mask_step(run, spy, "keep")
    assert torch.equal(batch.response_mask, mask.to(batch.response_mask.dtype))
    assert "rollout/overlong_masked" not in metrics and metrics["rollout/truncated_share"] > 0


def test_a_reward_fault_is_never_trained_on(run, spy, own_rewards):
    from stratarl.trainer.step import rl_step

    @register_reward("unreachable_judge")
    def unreachable_judge(trajectory: Trajectory) -> float:
        raise RewardFault("judge http://127.0.0.1:9: ConnectionRefusedError")

    run.scoring = Scoring.from_names("unreachable_judge")
    metrics = rl_step(run)
    assert spy["batch"] is None and metrics["update/skipped"] == 1.0
    assert metrics["retrieval/faulty_rollout_frac"] == 1.0 and metrics["reward/faulty_rollouts"] == 16.0
    assert "ConnectionRefusedError" in run.reward_fault


def test_an_eval_never_asks_the_judge():
    # The eval scores EM / SubEM / F1 itself; its scoring's reward is EM, so no request reaches the (absent) judge.
    from stratarl.trainer.setup import eval_settings, scoring_of

    cfg = load_config(
        None, ["algo.reward=judge", "algo.reward_params.url=http://127.0.0.1:9", "algo.stratum_key=answered"]
    )
    answered = Trajectory(response_text="<answer>Ada</answer>", answer="Ada", golds=("Ada",))
    with pytest.raises(RewardFault):
        scoring_of(cfg).reward(answered)  # the run's own reward does ask, and nothing listens there
    settings = eval_settings(cfg)
    assert settings.scoring.reward(answered).total == 1.0
    assert settings.scoring.stratum is not None and settings.scoring.overlong == "keep"


USER_REWARD = """
from stratarl.rewards import RewardResult, Trajectory, at_least, register_reward

@register_reward("parity_and_length", checks={"per_char": at_least(0.0)})
def parity_and_length(trajectory: Trajectory, *, per_char: float = 0.0) -> RewardResult:
    parity = float(len(trajectory.response_text) % 2 == 0)
    length = -per_char * len(trajectory.response_text)
    return RewardResult(total=parity + length, outcome=parity, components={"parity": parity, "length": length})
"""


@pytest.mark.slow
def test_a_users_reward_trains_from_the_command_line_with_import(tmp_path, stratarl_cli):
    plugin = tmp_path / "my_reward.py"
    plugin.write_text(USER_REWARD)
    run_dir = tmp_path / "run"
    common = [f"data.synthetic.cache_dir={tmp_path / 'kb'}", "trainer.steps=1", "logging.tensorboard=false"]
    out = stratarl_cli(
        "train", TINY, "--import", plugin, "algo.reward=parity_and_length", "algo.reward_params.per_char=0.001",
        *common, "--run-dir", run_dir,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    (row,) = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "reward/mean" in r]
    assert row["reward/parity_mean"] + row["reward/length_mean"] == pytest.approx(row["reward/mean"])
    assert row["reward/length_mean"] < 0 and row["reward/outcome_mean"] == row["reward/parity_mean"]
    bad = stratarl_cli(
        "train", TINY, "--import", plugin, "algo.reward=parity_and_length", "algo.reward_params.per_char=-1"
    )
    assert bad.returncode == 2 and "`algo.reward_params.per_char` = -1" in bad.stderr and "Traceback" not in bad.stderr
