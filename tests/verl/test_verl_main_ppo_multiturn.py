"""veRL's own trainer on real multi-turn search, on a CPU, with stratified_grpo and sorl.

`python -m stratarl.integrations.verl.smoke_multiturn`: veRL's tool_agent loop and hermes parser,
the hf rollout server, the recipe's search tool against a real `stratarl serve` (BM25) on loopback,
a tiny policy that searches or answers with equal odds, groups of 6, two steps of RayPPOTrainer with
`algorithm.adv_estimator=stratified_grpo` and `policy_loss.loss_mode=sorl` in one run (both plugins
see the same multi-turn batches). The strata the estimator takes from veRL's response mask are
checked against an independent count (the agent loop's num_turns and tool_rewards, recorded by the
reward function) and against the server's own counter. A few minutes on 2 cores.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("verl.trainer.ppo.core_algos", reason="needs veRL (make test-verl runs these in .venv-verl)")

from stratarl.integrations.verl import smoke_multiturn as mt  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    try:
        mt.serve_python()
    except RuntimeError as error:
        pytest.skip(str(error))
    workdir = tmp_path_factory.mktemp("verl-multiturn")
    result = subprocess.run(
        [sys.executable, "-m", "stratarl.integrations.verl.smoke_multiturn", "--workdir", str(workdir)],
        capture_output=True, text=True, timeout=1200, cwd=REPO, env={**os.environ},
    )
    log = (workdir / "main_ppo.log").read_text() if (workdir / "main_ppo.log").exists() else ""
    assert result.returncode == 0, (result.stdout + result.stderr + log)[-6000:]
    return mt.load_run(workdir)


@pytest.mark.slow
def test_main_ppo_runs_multi_turn_steps(run):
    assert sorted(run["metrics"]) == [1, 2]
    assert max(m["num_turns/max"] for m in run["metrics"].values()) >= 4  # some rollout searched
    for rows in run["rollouts"].values():
        assert len(rows) == 2 * mt.GROUP_SIZE


@pytest.mark.slow
def test_mask_blocks_equal_tool_calls_and_the_searches_served(run):
    """Per rollout: stratum from the mask == (num_turns − 2)/2 == len(tool_rewards); server agrees."""
    assert len(run["estimator"]) == len(run["metrics"])  # one estimator call per step
    for step, rows in run["rollouts"].items():
        seen = run["estimator"][step - 1]
        # Same batch, same order (balance_batch=false): the rewards line up row by row.
        assert seen["rewards"] == pytest.approx([float(row["score"]) for row in rows])
        assert seen["strata"] == [mt.tool_rounds(row) for row in rows]
        assert seen["strata"] == [int(row["tool_calls"]) for row in rows]
    calls = sum(int(row["tool_calls"]) for rows in run["rollouts"].values() for row in rows)
    assert calls > 0
    assert run["server"]["requests"] == run["server"]["queries"] == calls


@pytest.mark.slow
def test_some_group_holds_several_strata(run):
    distinct = []
    for rows in run["rollouts"].values():
        groups: dict[str, set[int]] = {}
        for row in rows:
            groups.setdefault(row["input"], set()).add(mt.tool_rounds(row))
        distinct.extend(len(strata) for strata in groups.values())
    assert max(distinct) >= 2


@pytest.mark.slow
def test_logged_advantages_are_stratified_grpo_on_the_dumped_rollouts(run):
    changed = False
    for step, rows in run["rollouts"].items():
        m = run["metrics"][step]
        expected = mt.expected_advantages(rows)
        one_stratum = mt.expected_advantages(rows, single_stratum=True)
        assert m["critic/advantages/max"] == pytest.approx(float(expected.max()), abs=1e-4)
        assert m["critic/advantages/min"] == pytest.approx(float(expected.min()), abs=1e-4)
        assert run["estimator"][step - 1]["advantages"] == pytest.approx(expected.tolist(), abs=1e-4)
        logged = (m["critic/advantages/max"], m["critic/advantages/min"])
        changed |= logged != pytest.approx((float(one_stratum.max()), float(one_stratum.min())), abs=1e-3)
    assert changed, "the strata never changed the logged advantages (every step as with one stratum)"


@pytest.mark.slow
def test_sorl_ran_turn_level_over_multi_turn_rows(run):
    for m in run["metrics"].values():
        for key in ("actor/sorl/c_norm", "actor/sorl/scale", "actor/turn_clipfrac", "actor/turn_ratio_mean",
                    "actor/pg_loss", "actor/grad_norm"):
            assert math.isfinite(m[key]), key
        assert m["actor/sorl/c_norm"] >= 0 and m["actor/sorl/scale"] > 0
    # The turn-level ratio and its clip fractions ran over rows with several assistant turns.
    assert max(m["actor/turns_per_row"] for m in run["metrics"].values()) > 1
    assert max(m["actor/multi_turn_frac"] for m in run["metrics"].values()) > 0
