"""SORL's exact normalisation with two FSDP2 data-parallel ranks (gloo, CPU), against one rank on the same batch.

`python -m harness.dp_check`: veRL's own actor worker (ActorRolloutRefWorker, FSDP2
engine, ppo_loss, its mini-batch loop) with SORLTrainingWorker installed by the plugins, in one process and
in two gloo processes, each rank handed veRL's chunk_tensordict chunk of the same 12-rollout multi-turn
batch (advantages from veRL's compute_advantage with stratified_grpo over the whole batch). ‖C‖ must be the
norm of the *global* clipping-bias gradient: equal on both ranks and to the one-rank run, and the update
identical. About 1–2 minutes on 2 cores. (The multi-turn main_ppo smoke runs its v1 trainer on two ranks
too: tests/verl/test_verl_main_ppo_multiturn.py.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("verl.trainer.ppo.core_algos", reason="needs veRL (make test-verl runs these in .venv-verl)")

from harness import dp_check, smoke

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("verl-two-ranks")
    run = subprocess.run(
        [sys.executable, "-m", "harness.dp_check", "--workdir", str(workdir)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": smoke.pythonpath()},  # the harness lives in tests/verl
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]
    loaded = json.loads((workdir / "result.json").read_text())
    loaded["stdout"] = run.stdout
    return loaded


def test_rank_order_gives_every_optimizer_step_the_same_global_rows():
    order = dp_check.rank_order(12, 2, 2)
    assert order == [0, 1, 2, 6, 7, 8, 3, 4, 5, 9, 10, 11]
    rank0, rank1 = order[:6], order[6:]
    # Mini-batch k of the two-rank run = rank 0's k-th three rows + rank 1's k-th three rows.
    assert sorted(rank0[:3] + rank1[:3]) == list(range(6)) and sorted(rank0[3:] + rank1[3:]) == list(range(6, 12))
    assert dp_check.rank_order(12, 1, 2) == list(range(12))


@pytest.mark.slow
def test_c_norm_is_global_equal_on_both_ranks_and_to_one_rank(result):
    (single,), (rank0, rank1) = result["single"], result["several"]
    assert (rank0["world"], rank1["world"], rank0["rank"], rank1["rank"]) == (2, 2, 0, 1)
    # The ranks held different rollouts (veRL's chunks), yet one ‖C‖ per optimizer step, the global one.
    assert set(rank0["rows"]).isdisjoint(rank1["rows"]) and sorted(rank0["rows"] + rank1["rows"]) == list(range(12))
    assert len(single["c_norm"]) == 2 and min(single["c_norm"]) > 0  # both mini-batches clip
    assert rank0["c_norm"] == rank1["c_norm"]
    assert rank0["c_norm"] == pytest.approx(single["c_norm"], rel=1e-6)
    for record in (single, rank0, rank1):
        # SORL's rule on every rank: scale = 1 / max(‖C‖, δ).
        assert record["scale"] == pytest.approx([1 / max(c, smoke.SORL_DELTA) for c in record["c_norm"]], rel=1e-9)
    assert rank0["grad_norm"] == rank1["grad_norm"]
    assert rank0["grad_norm"] == pytest.approx(single["grad_norm"], rel=1e-6)


@pytest.mark.slow
def test_parameters_identical_on_both_ranks_and_equal_to_the_one_rank_step(result):
    (_single,), (rank0, rank1) = result["single"], result["several"]
    assert rank0["params_sha"] == rank1["params_sha"]  # the full (all-gathered) parameters after the update
    assert result["param_max_abs_update"] > 1e-4  # the update moved the parameters
    assert result["param_max_abs_diff"] <= 1e-6  # two ranks == one rank, within float tolerance
    assert "max |θ(world 2) − θ(world 1)|" in result["stdout"]


@pytest.mark.slow
def test_advantages_are_stratified_over_the_whole_batch(result):
    assert result["advantages_max_abs_diff"] < 1e-6
