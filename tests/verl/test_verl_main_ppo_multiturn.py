"""veRL's own trainer on real multi-turn search, on a CPU, with stratified_grpo and sorl, on both trainers.

`python -m harness.smoke_multiturn --trainer v1|legacy`: veRL's tool_agent loop and
hermes parser, the hf rollout server, the recipe's search tool against a real `stratarl serve` (BM25) on
loopback, a tiny policy that searches or answers with equal odds, groups of 6, two steps with
`algorithm.adv_estimator=stratified_grpo` and `policy_loss.loss_mode=sorl` in one run (both plugins see
the same multi-turn batches). Once on veRL's default v1 trainer (`trainer.use_v1=true`, TransferQueue,
batches reordered by length, rows keyed `{uid}_{session}_{index}`) with two FSDP2 data-parallel ranks (gloo,
two hf rollout replicas), and once on the legacy RayPPOTrainer with one rank.
The strata the estimator takes from veRL's response mask are checked against an independent count (the
agent loop's num_turns and tool_rewards, recorded by the reward function) and against the server's own
counter. About 3–4 minutes per trainer on 2 cores.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

pytest.importorskip("verl.trainer.ppo.core_algos", reason="needs veRL (make test-verl runs these in .venv-verl)")

from harness import smoke_multiturn as mt

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", params=[("v1", 2), ("legacy", 1)], ids=["v1-2ranks", "legacy-1rank"])
def run(request, tmp_path_factory, smoke_multiturn):
    trainer, ranks = request.param
    workdir = tmp_path_factory.mktemp(f"verl-multiturn-{trainer}")
    _, log = smoke_multiturn(workdir, "--trainer", trainer, "--ranks", str(ranks))
    loaded = mt.load_run(workdir)
    loaded["trainer"], loaded["ranks_count"], loaded["log"] = trainer, ranks, log
    return loaded


@pytest.mark.slow
def test_main_ppo_runs_multi_turn_steps_on_the_chosen_trainer(run):
    # veRL's TaskRunnerV1 drives the v1 trainer; main_ppo_v0's TaskRunner the legacy one.
    assert ("TaskRunnerV1 pid=" in run["log"]) == (run["trainer"] == "v1")
    assert sorted(run["metrics"]) == [1, 2]
    assert max(m["num_turns/max"] for m in run["metrics"].values()) >= 4  # some rollout searched
    for rows in run["rollouts"].values():
        assert len([row for row in rows if not mt.is_padding(row.get("uid", ""))]) == 2 * mt.GROUP_SIZE
    assert len(run["rewards"]) == 2 * 2 * mt.GROUP_SIZE  # every rollout scored once (no validation, no prefetch)


@pytest.mark.slow
def test_strata_from_the_mask_equal_the_agent_loops_tool_rounds_and_the_searches_served(run):
    """Per prompt group: the estimator's (reward, stratum) == the reward function's (score, (num_turns − 2)/2),
    and (num_turns − 2)/2 == len(tool_rewards) for every rollout; the server answered exactly that many."""
    assert len(run["estimator"]) == len(run["metrics"])  # one estimator call per step
    for step, groups in mt.groups_by_step(run).items():
        assert len(groups) == 2
        for group in groups:
            assert len(group["estimator"]) == len(group["agent"]) == mt.GROUP_SIZE
            assert sorted((r, k) for r, k, _ in group["estimator"]) == sorted((s, k) for s, k, _ in group["agent"])
            assert all(rounds == calls for _, rounds, calls in group["agent"])
        if run["trainer"] == "legacy":
            # The legacy trainer keeps the batch order (balance_batch=false) and dumps the reward extras:
            # row for row, the stratum equals that rollout's own counts.
            rows, seen = run["rollouts"][step], run["estimator"][step - 1]
            assert seen["strata"] == [mt.tool_rounds(row) for row in rows] == [int(row["tool_calls"]) for row in rows]
        else:
            # v1 hands the estimator its row keys: one output per session (tool_agent), no padding needed here.
            keys = run["estimator"][step - 1]["keys"]
            assert len(keys) == len(set(keys)) and all(key.endswith("_0") for key in keys)
    rounds = sum(mt.tool_rounds(record) for record in run["rewards"])
    assert rounds > 0
    assert run["server"]["requests"] == run["server"]["queries"] == rounds


@pytest.mark.slow
def test_some_group_holds_several_strata(run):
    distinct = [
        len({k for _, k, _ in group["agent"]}) for groups in mt.groups_by_step(run).values() for group in groups
    ]
    assert max(distinct) >= 2


@pytest.mark.slow
def test_logged_advantages_are_stratified_grpo_on_the_agent_loops_counts(run):
    changed = False
    for step, groups in mt.groups_by_step(run).items():
        m = run["metrics"][step]
        expected = mt.expected_advantages(groups)
        for group, triples in zip(groups, expected):
            seen = sorted(group["estimator"])
            assert [(r, k) for r, k, _ in seen] == [(r, k) for r, k, _ in triples]
            assert [a for _, _, a in seen] == pytest.approx([a for _, _, a in triples], abs=1e-4)
        flat_expected = [a for triples in expected for _, _, a in triples]
        assert m["critic/advantages/max"] == pytest.approx(max(flat_expected), abs=1e-4)
        assert m["critic/advantages/min"] == pytest.approx(min(flat_expected), abs=1e-4)
        one = [a for triples in mt.expected_advantages(groups, single_stratum=True) for _, _, a in triples]
        changed |= (max(flat_expected), min(flat_expected)) != pytest.approx((max(one), min(one)), abs=1e-3)
    assert changed, "the strata never changed the logged advantages (every step as with one stratum)"


@pytest.mark.slow
def test_sorl_ran_turn_level_over_multi_turn_rows(run):
    for m in run["metrics"].values():
        for key in (
            "actor/sorl/c_norm",
            "actor/sorl/scale",
            "actor/turn_clipfrac",
            "actor/turn_ratio_mean",
            "actor/pg_loss",
            "actor/grad_norm",
        ):
            assert math.isfinite(m[key]), key
        assert m["actor/sorl/c_norm"] >= 0 and m["actor/sorl/scale"] > 0
    # The turn-level ratio and its clip fractions ran over rows with several assistant turns.
    assert max(m["actor/turns_per_row"] for m in run["metrics"].values()) > 1
    assert max(m["actor/multi_turn_frac"] for m in run["metrics"].values()) > 0
    # SORLTrainingWorker's own record on every rank: 2 steps × 2 mini-batches; each step's first mini-batch
    # is on-policy (‖C‖ = 0, scale 1/δ), the second is not.
    ranks = run["ranks_count"]
    by_call: dict[int, list[dict]] = {}
    for record in run["ranks"]:
        assert record["world"] == ranks
        by_call.setdefault(record["call"], []).append(record)
    assert sorted(by_call) == [1, 2, 3, 4]
    for records in by_call.values():
        assert sorted(r["rank"] for r in records) == list(range(ranks))
        # One global ‖C‖ and one parameter state on every rank (FSDP2 reduces C like any gradient).
        assert len({r["c_norm"] for r in records}) == 1 and len({r["params_sha"] for r in records}) == 1
    assert by_call[1][0]["c_norm"] == by_call[3][0]["c_norm"] == 0.0
    assert max(records[0]["c_norm"] for records in by_call.values()) > 0
