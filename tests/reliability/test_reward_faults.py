"""Reward faults (a judge that fails) are handled as retrieval faults are: the rollout is kept out of the
update, a step with too many takes no update, and a run whose steps keep failing stops naming the fault."""

from __future__ import annotations

from types import SimpleNamespace

from stratarl.rollout.collect import faulty_rollouts
from stratarl.trainer.stops import RetrievalWatch


def test_a_reward_fault_makes_its_rollout_faulty():
    rollouts = [SimpleNamespace(tool_errors=0), SimpleNamespace(tool_errors=1), SimpleNamespace(tool_errors=0)]
    assert faulty_rollouts(rollouts) == [False, True, False]
    assert faulty_rollouts(rollouts, ["", "", "judge down"]) == [False, True, True]


def test_steps_skipped_for_reward_faults_stop_the_run_naming_the_fault(capsys):
    watch = RetrievalWatch(max_failed_fraction=0.5, max_failed_steps=2)
    retriever = SimpleNamespace(step_queries=4, step_failed=0, step_seconds=0.1, where="bm25", last_error="")
    assert watch.check(1, retriever, skipped=True, reward_fault="judge http://x: HTTP 500") is None
    message = watch.check(2, retriever, skipped=True, reward_fault="judge http://x: HTTP 500")
    assert message is not None and message.startswith("reward failed") and "HTTP 500" in message
    assert "algo.reward_params.url" in message
    err = capsys.readouterr().err
    assert "warning: step 1: the step took no update: the reward could not score" in err
    # A healthy step resets the count.
    assert watch.check(3, retriever) is None and watch.failing_in_a_row == 0
