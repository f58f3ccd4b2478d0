"""Both evidence experiments end to end at --reduced sizes, through the real CLI (subprocesses).

The two runners go concurrently (one job each) and share one warm start (same task and sizes): 5
`stratarl` processes in all (1 sft, 2 x 2 train), then each aggregates in-process.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

RUNNER = Path(__file__).resolve().parents[2] / "benchmarks" / "evidence" / "run.py"


@pytest.mark.slow
def test_reduced_experiments_run_and_aggregate(tmp_path):
    procs = {
        name: subprocess.Popen(
            [
                sys.executable,
                str(RUNNER),
                name,
                "--reduced",
                "--jobs",
                "1",
                "--out",
                str(tmp_path / "runs"),
                "--cache",
                str(tmp_path / "kb"),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for name in ("stratified", "sorl")
    }
    outputs = {name: p.communicate(timeout=300)[0] for name, p in procs.items()}
    for name, p in procs.items():
        assert p.returncode == 0, outputs[name]
    expected = {"stratified": ("guessable", {"grpo", "stratified"}), "sorl": ("high", {"grpo", "so_grpo"})}
    for name, (condition, arms) in expected.items():
        root = tmp_path / "runs" / name
        data = json.loads((root / "aggregate" / "aggregate.json").read_text())
        block = data["conditions"][condition]
        assert set(block["arms"]) == arms
        for arm in block["arms"].values():
            assert arm["n"] == 1 and arm["runs"]["0"]["steps"] == 2
            for m in arm["metrics"].values():
                assert m["half_width"] is None  # one seed: CI explicitly null
                assert m["mean"] is not None and math.isfinite(m["mean"])
        (other,) = arms - {"grpo"}
        paired = block["paired"][other]
        assert paired["final/reward/mean"]["seeds"] == [0] and paired["final/reward/mean"]["half_width"] is None
        assert (root / "aggregate" / "aggregate.md").is_file() and (root / "aggregate" / "report.html").is_file()
        run_dir = root / condition / "grpo-s0"
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        train = [r for r in rows if "reward/mean" in r]
        assert "stratum/cross_var" in train[0] and "stratum/zero_san_frac" in train[0]
    # One warm start for the task both reduced experiments use: trained by one runner, reused by the other.
    assert [p.parent.parent.name for p in (tmp_path / "runs" / "warmstart").glob("*/model/config.json")] == [
        "guessable"
    ]
    assert sum(out.count("[done] warm start") for out in outputs.values()) == 1
    assert sum(out.count("[skip] warm start") for out in outputs.values()) == 1
    # Same seed -> same data order across arms: the first step's questions match.
    sorl = tmp_path / "runs" / "sorl" / "high"
    assert (sorl / "so_grpo-s0" / "metrics.jsonl").is_file()
    first = [
        json.loads((sorl / a / "transcripts" / "step_000001.jsonl").read_text().splitlines()[0])["question"]
        for a in ("grpo-s0", "so_grpo-s0")
    ]
    assert first[0] == first[1]
    # A rerun skips every finished run and just re-aggregates.
    rerun = subprocess.run(
        [
            sys.executable,
            str(RUNNER),
            "sorl",
            "--reduced",
            "--out",
            str(tmp_path / "runs"),
            "--cache",
            str(tmp_path / "kb"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    # Both runs are summarised (under <out>/results with --reduced): neither they nor the warm start run again.
    assert rerun.stdout.count("[skip (summary)]") == 2 and "0 to run after 0 warm start(s)" in rerun.stdout


TABLES = RUNNER.parent / "tables.py"


@pytest.mark.slow
def test_lab_experiments_write_summaries_that_regenerate_the_tables(tmp_path):
    """v2 (lab) experiments at --reduced sizes: each finished run writes its committed-style summary; the
    tables regenerate from the summaries alone; a rerun elsewhere (another --out) skips every summarised run."""
    common = ["--reduced", "--jobs", "1", "--cache", str(tmp_path / "kb"), "--results", str(tmp_path / "results")]
    for name in ("lab_stratified", "lab_sorl"):
        out = subprocess.run(
            [sys.executable, str(RUNNER), name, "--out", str(tmp_path / "runs"), *common],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, out.stdout + out.stderr
    # Both experiments' multihop task is the same: one warm start, trained once.
    assert sorted(p.parent.parent.name for p in (tmp_path / "runs" / "warmstart").glob("*/model/config.json")) == [
        "multihop"
    ]
    summaries = sorted((tmp_path / "results").glob("*/*/*.json"))
    assert [p.relative_to(tmp_path / "results").as_posix() for p in summaries] == [
        "lab_sorl/d4/grpo-s0.json",
        "lab_sorl/d4/so_grpo-s0.json",
        "lab_stratified/multihop/grpo-s0.json",
        "lab_stratified/multihop/strat_a0.6-s0.json",
    ]
    run = json.loads(summaries[1].read_text())
    assert run["arm"] == "so_grpo" and run["steps"] == 2 and len(run["per_step"]["reward/mean"]) == 2
    assert len(run["config_hash"]) == 16 and not any(o.startswith("model.init_from") for o in run["overrides"])
    assert set(run["eval"]) == {"before", "after"} and run["eval"]["after"]["n"] == 4
    assert "sorl/c_norm" in run["binned"]["metrics"] and "sorl/engaged" in run["binned"]["metrics"]
    assert summaries[1].stat().st_size < 20_000  # a summary is small enough to commit
    # Tables from the summaries alone (the run folders deleted).
    import shutil

    shutil.rmtree(tmp_path / "runs")
    tables = subprocess.run(
        [
            sys.executable,
            str(TABLES),
            "lab_sorl",
            "--results",
            str(tmp_path / "results"),
            "--out",
            str(tmp_path / "docs"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert tables.returncode == 0, tables.stdout + tables.stderr
    md = (tmp_path / "docs" / "lab_sorl.md").read_text()
    assert (
        "## d4 (2 runs)" in md and "| so_grpo | em_after |" in md and (tmp_path / "docs" / "lab_sorl_d4.png").is_file()
    )
    data = json.loads((tmp_path / "docs" / "lab_sorl.json").read_text())
    assert data[0]["paired"]["so_grpo"]["em_after"]["seeds"] == [0]
    # A sweep continued in another place: every summarised run is skipped, no warm start is trained.
    rerun = subprocess.run(
        [sys.executable, str(RUNNER), "lab_stratified", "--out", str(tmp_path / "elsewhere"), *common],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert rerun.stdout.count("[skip (summary)]") == 2, rerun.stdout + rerun.stderr
    assert "2 already summarised" in rerun.stdout and "0 to run after 0 warm start(s)" in rerun.stdout
    assert not (tmp_path / "elsewhere" / "warmstart").exists()


def test_table_metrics_of_a_run_summary(load_script):
    """The tables' per-run metrics on hand-made summaries: a steady run has not collapsed, one whose reward
    falls from 0.6 to 0 has; windows and eval fields are read as documented."""
    tables = load_script(TABLES, "evidence_tables")
    steady = {
        "per_step": {"reward/mean": [0.6, 0.4, 0.7, 0.5] * 50},
        "eval": {"after": {"em": 0.8}, "before": {"em": 0.3}},
        "binned": {"bin_steps": 10, "metrics": {"sorl/engaged": [0.0, 0.5, 1.0]}},
    }
    falling = {"per_step": {"reward/mean": [0.6] * 100 + [0.0] * 100}, "eval": {}, "binned": {"metrics": {}}}
    metric = {name: fn for name, (_, fn) in tables.METRICS.items()}
    assert metric["collapsed"](steady) == 0.0 and metric["collapsed"](falling) == 1.0
    assert math.isclose(metric["reward_1_100"](falling), 0.6) and metric["reward_last_50"](falling) == 0.0
    assert math.isclose(metric["reward_all"](steady), 0.55)
    assert math.isclose(metric["em_gain"](steady), 0.5) and metric["em_after"](falling) is None
    assert metric["engaged"](steady) == 0.5 and metric["c_norm"](steady) is None
