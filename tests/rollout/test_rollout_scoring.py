"""Scoring: the trajectory a reward sees, the overlong rule, and a reward fault kept apart from a score."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from stratarl.rewards import RewardFault, RewardResult
from stratarl.rollout.collect import Scoring, is_overlong, score_rollout, trajectory_of
from stratarl.rollout.engine import Rollout, Turn
from stratarl.rollout.parsing import Action
from stratarl.rollout.tools import ToolCall

EXAMPLE = SimpleNamespace(question="Who?", golden_answers=("Ada",), data_source="nq", id="q1", metadata={})


def _rollout(end_reason, *, answered=False, text="<answer>Ada</answer>", **kwargs) -> Rollout:
    rollout = Rollout(prompt_ids=[1], end_reason=end_reason, answered=answered, response_text=text, **kwargs)
    rollout.truncated = end_reason == "max_length"
    rollout.hit_max_turns = end_reason == "max_turns"
    return rollout


@pytest.mark.parametrize(
    ("end_reason", "overlong"), [("answer", False), ("eos", False), ("max_length", True), ("max_turns", True)]
)
def test_overlong_is_a_budget_spent_without_an_answer(end_reason, overlong):
    assert is_overlong(_rollout(end_reason)) is overlong


def test_the_trajectory_a_reward_sees():
    rollout = _rollout("answer", answered=True, answer="Ada", num_searches=1, invalid_actions=1)
    rollout.turns = [Turn(0, 1, Action("search", "q"), "stop"), Turn(1, 2, Action("answer", "Ada"), "stop")]
    # every tool's calls that ran count (a search and an open); a malformed one does not
    rollout.calls = [
        ToolCall("search", {"query": "q"}, "ok"),
        ToolCall("open", {"title": "Ada"}, "ok"),
        ToolCall("open", None, "malformed", "bad JSON", error_kind="bad_json"),
    ]
    view = trajectory_of(rollout, EXAMPLE)
    assert view.actions == (("search", "q"), ("answer", "Ada")) and view.answer == "Ada"
    assert (view.tool_calls, view.invalid_actions, view.truncated) == (2, 1, False)
    assert view.golds == ("Ada",) and view.question == "Who?" and view.data_source == "nq"
    assert trajectory_of(_rollout("eos", answer="Ada"), EXAMPLE).answer is None  # not answered: no answer


def test_overlong_reward_replaces_the_total_and_keeps_the_outcome():
    scoring = Scoring(
        reward=lambda t: RewardResult(0.3, 0.0, {"answer": 0.0, "format": 0.3}),
        stratum=lambda r: 0,
        overlong="reward",
        overlong_reward=-0.5,
    )
    result, fault = score_rollout(scoring, _rollout("max_length"), EXAMPLE)
    assert (result.total, result.outcome, dict(result.components), fault) == (-0.5, 0.0, {"overlong": -0.5}, "")
    kept, _ = score_rollout(scoring, _rollout("eos"), EXAMPLE)
    assert kept.total == 0.3  # a rollout that stopped on its own keeps its reward
    keep = Scoring(reward=scoring.reward, stratum=scoring.stratum)
    assert score_rollout(keep, _rollout("max_length"), EXAMPLE)[0].total == 0.3  # the default keeps it too


def test_a_reward_fault_is_reported_not_scored():
    def failing(trajectory):
        raise RewardFault("judge down")

    result, fault = score_rollout(Scoring(reward=failing, stratum=lambda r: 0), _rollout("answer"), EXAMPLE)
    assert fault == "judge down" and result.total == 0.0


def test_without_loss_zeroes_the_flagged_rows_only():
    from stratarl.trainer.batch import TrainBatch, without_loss

    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0], [1.0, 1.0, 1.0]])
    adv = torch.tensor([[0.5, 0.5, 0.0], [-1.0, 0.0, -1.0], [2.0, 2.0, 2.0]])
    ids = torch.zeros(3, 4, dtype=torch.long)
    batch = TrainBatch(
        ids, torch.ones_like(ids), torch.ones(3, dtype=torch.long), torch.full((3,), 3), mask,
        old_logprobs=torch.zeros(3, 3), on_policy=True, ref_logprobs=None, old_values=None,
        advantages=adv, returns=adv,
    )  # fmt: skip
    out = without_loss(batch, [False, True, False])
    assert torch.equal(out.response_mask, torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0]]))
    assert torch.equal(out.advantages[1], torch.zeros(3)) and torch.equal(out.advantages[[0, 2]], adv[[0, 2]])
    assert torch.equal(batch.response_mask, mask)  # the input is not mutated
    assert without_loss(batch, [False] * 3) is batch
    with pytest.raises(ValueError, match="row flags"):
        without_loss(batch, [True])
