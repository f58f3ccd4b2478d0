"""The evidence runner with `--population K` (benchmarks/evidence/population.py): the runs of a reduced experiment
train as one `stratarl population` process, each in its own run directory with its summary, and aggregate as
solo runs do; a rerun skips them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

RUNNER = Path(__file__).resolve().parents[2] / "benchmarks" / "evidence" / "run.py"


@pytest.mark.slow
def test_a_reduced_experiment_runs_as_one_population(tmp_path):
    common = [
        "stratified",
        "--reduced",
        "--jobs",
        "1",
        "--out",
        str(tmp_path / "runs"),
        "--cache",
        str(tmp_path / "kb"),
    ]
    out = subprocess.run(
        [sys.executable, str(RUNNER), *common, "--population", "2"], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("[done] guessable/") == 2 and "0 failed" in out.stdout
    (spec,) = (tmp_path / "runs" / "populations").glob("population-*.out.json")
    population = json.loads(spec.read_text())
    assert [m["ok"] for m in population["members"]] == [True, True] and population["exit_code"] == 0
    root = tmp_path / "runs" / "stratified"
    for arm in ("grpo", "stratified"):
        run_dir = root / "guessable" / f"{arm}-s0"
        assert json.loads((run_dir / "summary.json").read_text())["steps"] == 2
        assert json.loads((run_dir / "arm.json").read_text())["arm"] == arm
        assert "step 2/2" in (run_dir / "train.log").read_text()
        summary = json.loads(
            (tmp_path / "runs" / "results" / "stratified" / "guessable" / f"{arm}-s0.json").read_text()
        )
        # members run one after another: a member's time is its own run's
        own = json.loads((run_dir / "summary.json").read_text())["train_seconds"]
        assert "population" not in summary and summary["train_seconds"] == pytest.approx(own, rel=1e-3)
    assert set(json.loads((root / "aggregate" / "aggregate.json").read_text())["conditions"]["guessable"]["arms"]) == {
        "grpo",
        "stratified",
    }
    rerun = subprocess.run(
        [sys.executable, str(RUNNER), *common, "--population", "2"], capture_output=True, text=True, timeout=120
    )
    assert rerun.returncode == 0 and rerun.stdout.count("[skip (summary)]") == 2, rerun.stdout + rerun.stderr


def test_a_member_the_population_reports_stopped_is_a_failed_run_even_when_its_steps_all_ran(tmp_path, monkeypatch):
    """A run stopped by retrieval failures on its last step has summary.json with all its steps: the population's
    own summary (status stopped, exit code 3) makes it FAIL, not `done`, and its result is not written."""
    sys.path.insert(0, str(RUNNER.parent))
    import population as populations

    written, trained = [], []

    class Spec:
        condition, arm, seed, steps, overrides = "c", "grpo", 0, 2, []
        run_dir = tmp_path / "runs" / "c" / "grpo-s0"

        def config_hash(self):
            return "h"

    monkeypatch.setattr(populations.summaries, "committed", lambda *a: False)
    # every step ran once the population did
    monkeypatch.setattr(populations.summaries, "finished", lambda run_dir, steps: bool(trained))
    monkeypatch.setattr(populations.summaries, "write_result", lambda *a: written.append(a))
    monkeypatch.setattr(populations.running, "try_lock", lambda lock: 99)
    monkeypatch.setattr(
        populations.running, "write_arm", lambda d, spec, exp, resumed: (d / "arm.json").write_text("{}")
    )
    monkeypatch.setattr(populations.running, "STRATARL", ["stratarl"])

    def fake_call(cmd, **kwargs):
        trained.append(cmd)
        out = Path(cmd[cmd.index("--summary") + 1])
        member = {"run_dir": str(Spec.run_dir), "status": "stopped", "exit_code": 3, "reason": "retriever down"}
        out.write_text(json.dumps({"members": [member]}))
        return 3

    monkeypatch.setattr(populations.subprocess, "call", fake_call)
    monkeypatch.setattr(populations.os, "close", lambda fd: None)
    (status,) = populations._run_group([Spec()], {"base_path": "x.yaml"}, 2, tmp_path / "res", 0, tmp_path)
    assert trained and status.startswith("FAIL stopped (exit code 3: retriever down") and written == []
