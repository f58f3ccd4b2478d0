"""What an evidence run summary records to reproduce the run (provenance), the per-stratum bins, the
admission check, and the designs of the v3 experiment files (lab_sorl_reuse, lab_stratified_twohop)."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from stratarl.trainer.config import load_config

HERE = Path(__file__).resolve().parents[2] / "benchmarks" / "evidence"


@pytest.fixture(scope="module")
def ev(load_script):
    """(the runner's parts these tests use, from the modules that own them; tables.py)."""
    sys.path.insert(0, str(HERE))
    try:
        import planning
        import provenance
        import running
        import summaries

        tables = load_script(HERE / "tables.py", "evidence_tables_prov")
        run = SimpleNamespace(
            RunSpec=planning.RunSpec,
            load_experiment=planning.load_experiment,
            plan=planning.plan,
            provenance=provenance.provenance,
            write_arm=running.write_arm,
            summarize_run=summaries.summarize_run,
            running=running,
        )
        yield run, tables
    finally:
        sys.path.remove(str(HERE))


def _spec(run, tmp_path: Path, base: Path, warm: Path | None):
    overrides = ["algo.name=grpo", "trainer.num_threads=1", *([f"model.init_from={warm}"] if warm else [])]
    return run.RunSpec("c", "grpo", 0, "t", tmp_path / "run", overrides, str(base), 3)


def test_provenance_hashes_the_base_contents_and_the_warm_start_files(ev, tmp_path):
    run, _ = ev
    base = tmp_path / "lab.yaml"
    base.write_text("trainer: {steps: 3}\n")
    warm = tmp_path / "warm" / "model"
    warm.mkdir(parents=True)
    (warm / "config.json").write_text("{}")
    (warm / "model.safetensors").write_bytes(b"\x00" * 64)
    spec = _spec(run, tmp_path, base, warm)
    first = run.provenance(spec, {"OMP_NUM_THREADS": "1"})
    assert first["base_config"] == "lab.yaml"
    assert first["base_config_sha256"] == hashlib.sha256(base.read_bytes()).hexdigest()
    assert first["torch"] == importlib.metadata.version("torch")
    assert first["threads"] == {"trainer.num_threads": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": None}
    assert first["cpu"] and first["cpu_count"] >= 1 and first["dirty"] in (True, False)
    assert first["commit"] and first["warmstart_sha256"]
    hash_before = spec.config_hash()
    # Same file name, other contents: the design hash (name-based) stays, the recorded content hash moves.
    base.write_text("trainer: {steps: 4}\n")
    (warm / "model.safetensors").write_bytes(b"\x00" * 63 + b"\x01")
    second = run.provenance(spec, {})
    assert spec.config_hash() == hash_before
    assert second["base_config_sha256"] != first["base_config_sha256"]
    assert second["warmstart_sha256"] != first["warmstart_sha256"]
    assert run.provenance(_spec(run, tmp_path, base, None), {})["warmstart_sha256"] is None


def _fake_run(run_dir: Path) -> None:
    """A finished run folder: 12 steps of metrics (strata 1 and 2 searches), summary.json, config.yaml."""
    run_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for step in range(1, 13):
        c2 = 6.0 if step <= 10 else 8.0
        rows.append(
            {
                "step": step,
                "reward/mean": 0.1 * (step % 3),
                "rollout/num": 8.0,
                "stratum/1/count": 8.0 - c2,
                "stratum/1/reward_mean": 0.0,
                "stratum/2/count": c2,
                "stratum/2/reward_mean": (0.5 if step % 2 else 0.25) if step <= 10 else 1.0,
                "rollout/search_calls_frac/2": c2 / 8.0,
                "rollout/search_calls_frac/1": 1 - c2 / 8.0,
            }
        )
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "summary.json").write_text(json.dumps({"steps": 12, "train_seconds": 1.0}))
    (run_dir / "config.yaml").write_text(yaml.safe_dump({"rollout": {"group_size": 4}}))


def test_summary_records_the_provenance_of_the_first_start_and_the_stratum_bins(ev, tmp_path, monkeypatch):
    run, tables = ev
    base = tmp_path / "lab.yaml"
    base.write_text("a: 1\n")
    spec = _spec(run, tmp_path, base, None)
    _fake_run(spec.run_dir)
    exp = {"name": "x", "summary_strata": True}
    started = run.write_arm(spec.run_dir, spec, exp, resumed=False)["started"]
    # Resumed at another commit with another base config: the summary keeps what the run started with.
    monkeypatch.setattr(
        run.running, "provenance", lambda spec, env=None: {"commit": "later", "base_config_sha256": "other"}
    )
    info = run.write_arm(spec.run_dir, spec, exp, resumed=True)
    assert info["started"] == started and info["resumed_at"] == ["later"]
    summary = run.summarize_run(spec, exp, spec.config_hash())
    assert summary["provenance"] == started and summary["commit"] == started["commit"]
    assert summary["provenance"]["base_config_sha256"] == hashlib.sha256(b"a: 1\n").hexdigest()
    bins = summary["binned"]["metrics"]
    # Steps 1-10: 6 two-search rollouts of 2 groups (3 per group) per step, rewards 0.5 / 0.25 alternating;
    # steps 11-12: 8 of them (4 per group), reward 1.
    assert bins["stratum/2/count_per_group"] == [3.0, 4.0]
    assert bins["stratum/2/reward_mean"] == [0.375, 1.0]
    assert bins["rollout/search_calls_frac/2"] == [0.75, 1.0]
    assert summary["first_step"]["stratum/2/reward_mean"] == 0.5
    metric = {name: fn for name, (_, fn) in tables.METRICS.items()}
    assert math.isclose(metric["success_2s_1_100"](summary), (0.375 * 3 + 1.0 * 4) / 7)  # weighted by count
    assert math.isclose(metric["share_2s_1_100"](summary), 0.875)
    assert metric["share_2s_at_100"](summary) is None  # a 12-step run has no steps 91-100
    run_without = run.summarize_run(spec, {"name": "x"}, spec.config_hash())
    assert "stratum/2/reward_mean" not in run_without["binned"]["metrics"] and "first_step" not in run_without


def test_a_resumed_run_reports_the_time_of_all_its_steps_not_only_the_last_process(ev, tmp_path):
    run, _ = ev
    base = tmp_path / "lab.yaml"
    base.write_text("a: 1\n")
    spec = _spec(run, tmp_path, base, None)
    _fake_run(spec.run_dir)
    metrics = spec.run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    rows = [{"step": 0, "time/eval": 100.0}] + [{**r, "time/step": 10.0} for r in rows]
    # Step 12 ran, the process died before its checkpoint, and the resume re-ran it (its last row counts).
    rows += [{**rows[-1], "time/step": 30.0}, {"step": 12, "time/eval": 50.0}]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    whole = run.summarize_run(spec, {"name": "x"}, spec.config_hash())
    assert whole["train_seconds"] == 1.0  # one process: its own clock
    (spec.run_dir / "summary.json").write_text(json.dumps({"steps": 12, "start_step": 10, "train_seconds": 1.0}))
    resumed = run.summarize_run(spec, {"name": "x"}, spec.config_hash())
    assert resumed["train_seconds"] == 100.0 + 11 * 10.0 + 30.0 + 50.0


def test_admission_check_names_each_violated_bound():
    sys.path.insert(0, str(HERE))
    try:
        import admission
    finally:
        sys.path.remove(str(HERE))
    row = {"rollout/search_calls_frac/2": 0.4, "reward/mean": 0.2}
    failures = admission.check(
        row, {"two_search_share": [0.6, 1.0], "success_given_2": [0.25, 0.65], "reward": [0.0, 1.0]}
    )
    assert failures == [
        "two_search_share (rollout/search_calls_frac/2) = 0.400, outside [0.6, 1.0]",
        "success_given_2 (stratum/2/reward_mean) is missing from the warm start's first step",
    ]
    assert admission.check({**row, "rollout/search_calls_frac/2": 0.7}, {"two_search_share": [0.6, 1.0]}) == []
    with pytest.raises(ValueError, match="low <= high"):
        admission.validate({"bounds": {"reward": [1.0, 0.0]}}, "x.yaml")


def test_sorl_reuse_fixes_the_mini_batch_and_the_optimizer_steps(ev, tmp_path):
    run, _ = ev
    exp = run.load_experiment("lab_sorl_reuse")
    _, specs = run.plan(exp, tmp_path, seeds=1, steps=exp["steps"], reduced=False, extra=[])
    arms = {(s.condition, s.arm) for s in specs}
    for arm in ("ppo", "so_ppo", "so_ppo_turn_only", "ppo_norm", "grpo", "so_grpo", "so_ppo_floor", "so_ppo_scalefree"):
        assert ("d16", arm) in arms and ("d4", arm) in arms
    assert ("d1", "so_ppo") in arms
    readings = set()
    for spec in specs:
        cfg = load_config(exp["base_path"], spec.overrides[:-1])
        t = cfg.trainer
        assert t.epochs == 1 and t.steps * t.mini_batches == 512  # same optimizer steps at every degree
        assert t.prompts_per_step * cfg.rollout.group_size // t.mini_batches == 32  # same mini-batch
        assert t.mini_batches == int(spec.condition[1:]) and spec.steps == t.steps
        if cfg.algorithm.uses_normalizer:
            readings.add((cfg.algo.sorl_delta_rule, cfg.algo.sorl_delta))
            # every normaliser arm applies the factor after clipping, but the order controls at d16
            order = "before_clip" if spec.arm.endswith("before_clip") else "after_clip"
            assert cfg.algo.sorl_order == order and (order == "after_clip" or spec.condition == "d16")
    assert readings == {("fixed", 1.0), ("fixed", 1e-3), ("running_pg", 1.0)}


def test_twohop_regime_and_its_metrics(ev, tmp_path):
    run, tables = ev
    exp = run.load_experiment("lab_stratified_twohop")
    _, specs = run.plan(exp, tmp_path, seeds=exp["seeds"], steps=exp["steps"], reduced=False, extra=[])
    assert exp["seeds"] >= 10 and {s.arm for s in specs} == {"grpo", "strat_a0.6", "strat_a1.0", "random_strata"}
    groups = set()
    for spec in specs[:8]:
        cfg = load_config(exp["base_path"], spec.overrides[:-1])
        assert (
            cfg.data.synthetic.options["hop_mix"] == [0.0, 1.0, 0.0] and cfg.sft.wrong_hop_fraction == 0.3
        )  # retuned by the admission check
        groups.add(cfg.rollout.group_size)
    assert groups == {4, 8}
    design = exp["metrics"]
    assert {design["primary"], *design["secondary"]} <= set(tables.METRICS)
    assert set(exp["admission"]["bounds"]) == {"two_search_share", "success_given_2"}


@pytest.mark.slow
def test_reduced_v3_experiments_run_and_write_the_new_summary_fields(tmp_path):
    common = [
        "--reduced",
        "--jobs",
        "1",
        "--cache",
        str(tmp_path / "kb"),
        "--results",
        str(tmp_path / "results"),
        "--out",
        str(tmp_path / "runs"),
    ]
    for name in ("lab_sorl_reuse", "lab_stratified_twohop"):
        out = subprocess.run(
            [sys.executable, str(HERE / "run.py"), name, *common], capture_output=True, text=True, timeout=600
        )
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    reuse = json.loads((tmp_path / "results" / "lab_sorl_reuse" / "d4" / "so_ppo_floor-s0.json").read_text())
    assert reuse["steps"] == 1 and len(reuse["provenance"]["base_config_sha256"]) == 64
    assert reuse["provenance"]["warmstart_sha256"] and reuse["provenance"]["torch"]
    twohop = json.loads((tmp_path / "results" / "lab_stratified_twohop" / "g4" / "grpo-s0.json").read_text())
    assert any(k.startswith("stratum/") and k.endswith("/count_per_group") for k in twohop["binned"]["metrics"])
    # world_from: seed 0 runs on world 3001, with the warm start and admission check of that world
    assert twohop["task"] == "twohop-w3001"
    admitted = json.loads((tmp_path / "runs" / "lab_stratified_twohop" / "admission" / "twohop-w3001.json").read_text())
    assert admitted["admitted"] is True
