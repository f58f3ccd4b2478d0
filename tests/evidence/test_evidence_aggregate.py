"""`stratarl report --aggregate`: grouping by arm.json, per-arm CIs, paired differences, files written."""

from __future__ import annotations

import json
import math

import pytest

from stratarl.cli import main
from stratarl.evaluation.aggregate import aggregate_runs, run_scalars
from stratarl.evaluation.rundir import run_info

# Per (arm, seed): the reward curve. Arm "better" is the baseline + 0.1 at every step of every seed.
CURVES = {
    ("grpo", 0): [0.1, 0.2, 0.3, 0.4],
    ("grpo", 1): [0.0, 0.1, 0.1, 0.2],
    ("grpo", 2): [0.2, 0.2, 0.4, 0.6],
    ("better", 0): [0.2, 0.3, 0.4, 0.5],
    ("better", 1): [0.1, 0.2, 0.2, 0.3],
    ("better", 2): [0.3, 0.3, 0.5, 0.7],
    ("crash", 0): [0.4, 0.4, 0.0, 0.0],  # collapses at step 3 (window 1, patience 2)
}


def _write_run(root, arm, seed, rewards, condition="taskA", eval_em=None):
    d = root / condition / f"{arm}-s{seed}"
    d.mkdir(parents=True)
    (d / "arm.json").write_text(json.dumps({"arm": arm, "seed": seed, "condition": condition}))
    with open(d / "metrics.jsonl", "w") as f:
        for step, r in enumerate(rewards, start=1):
            f.write(
                json.dumps(
                    {
                        "step": step,
                        "reward/mean": r,
                        "reward/em": r / 2,
                        "rollout/valid_action_rate": 1.0,
                        "loss/clip_frac": 0.1 * seed,
                        "reward/em_by_type/single_hop": r,
                    }
                )
                + "\n"
            )
        f.write(json.dumps({"step": len(rewards), "eval/synthkb/em": 0.5}) + "\n")  # an eval row: not a train step
    if eval_em is not None:
        (d / "eval").mkdir()
        (d / "eval" / "after.json").write_text(
            json.dumps({"per_source": {"synthkb": {"em": eval_em}}, "per_type": {"single_hop": {"em": eval_em}}})
        )
    return d


@pytest.fixture
def runs(tmp_path):
    dirs = [
        _write_run(tmp_path, arm, seed, curve, eval_em=0.1 * seed + (0.2 if arm == "better" else 0.0))
        for (arm, seed), curve in CURVES.items()
    ]
    return tmp_path, dirs


def test_run_scalars_definitions(runs):
    _, dirs = runs
    s = run_scalars(dirs[0], final_window=2)
    assert s["steps"] == 4
    assert math.isclose(s["final/reward/mean"], 0.35)  # mean of the last 2 steps
    assert math.isclose(s["auc/reward/mean"], 0.25)  # mean over all 4 steps
    assert math.isclose(s["final/reward/em"], 0.175)
    assert s["eval_after/em"] == 0.0 and s["eval_after/em_by_type/single_hop"] == 0.0
    assert s["collapse"] == {"step": None, "reason": None}


def test_arm_info_falls_back_to_the_config(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    (d / "config.yaml").write_text("algo: {name: so_ppo}\ntrainer: {seed: 4}\n")
    assert run_info(d) == {"arm": "so_ppo", "seed": 4, "condition": ""}


def test_aggregate_ci_and_paired_difference(runs):
    _, dirs = runs
    from stratarl.evaluation.stats import CollapseRule

    result = aggregate_runs(dirs, "grpo", final_window=2, rule=CollapseRule(window=1, patience=2))
    block = result["conditions"]["taskA"]
    assert set(block["arms"]) == {"grpo", "better", "crash"}
    grpo = block["arms"]["grpo"]
    finals = [0.35, 0.15, 0.5]
    mean = sum(finals) / 3
    std = math.sqrt(sum((x - mean) ** 2 for x in finals) / 2)
    m = grpo["metrics"]["final/reward/mean"]
    assert m["n"] == 3 and math.isclose(m["mean"], mean) and math.isclose(m["half_width"], 4.303 * std / math.sqrt(3))
    paired = block["paired"]["better"]["final/reward/mean"]
    assert paired["seeds"] == [0, 1, 2]
    assert math.isclose(paired["mean"], 0.1) and paired["half_width"] < 1e-9  # the same +0.1 on every seed
    assert math.isclose(block["paired"]["better"]["eval_after/em"]["mean"], 0.2)
    crash = block["arms"]["crash"]
    assert crash["n"] == 1 and crash["metrics"]["final/reward/mean"]["half_width"] is None
    assert crash["collapse_steps"] == {"0": 3} and crash["collapsed_runs"] == 1
    assert block["paired"]["crash"]["final/reward/mean"]["seeds"] == [0]  # paired with grpo seed 0 only


def test_conditions_are_compared_separately_and_duplicates_rejected(tmp_path):
    a = _write_run(tmp_path, "grpo", 0, [0.1, 0.2], condition="low")
    b = _write_run(tmp_path, "grpo", 0, [0.5, 0.6], condition="high")
    result = aggregate_runs([a, b], "grpo")
    assert set(result["conditions"]) == {"low", "high"}
    with pytest.raises(ValueError, match="seed 0"):
        aggregate_runs([a, a], "grpo")


def test_missing_baseline_is_reported(runs):
    _, dirs = runs
    block = aggregate_runs(dirs, "ppo")["conditions"]["taskA"]
    assert block["paired"] == {} and "no arm named 'ppo'" in block["baseline_missing"]


def test_cli_writes_json_markdown_plots_and_page(runs, capsys):
    root, dirs = runs
    out = root / "agg" / "page.html"
    assert (
        main(["report", "--aggregate", "--baseline", "grpo", "--final-window", "2", "--out", str(out), *map(str, dirs)])
        == 0
    )
    data = json.loads((root / "agg" / "aggregate.json").read_text())
    assert data["baseline"] == "grpo" and data["final_window"] == 2
    md = (root / "agg" / "aggregate.md").read_text()
    assert "| better |" in md and "Paired difference" in md and "0.100 ± 0.000" in md
    assert (root / "agg" / "curves_taskA.png").stat().st_size > 1000
    page = out.read_text()
    assert "data:image/png;base64," in page and "<table>" in page


def test_cli_aggregate_rejects_a_non_run_directory(tmp_path, capsys):
    assert main(["report", "--aggregate", str(tmp_path)]) == 1
    assert "metrics.jsonl" in capsys.readouterr().err
