"""Reading a run directory: who the run is (arm, condition, seed) and its training-step metrics."""

from __future__ import annotations

import json
import math
from pathlib import Path

import yaml

from stratarl.infra.metrics import read_metrics


def run_info(run_dir: Path) -> dict:
    """``{"arm", "condition", "seed"}`` of a run (arm.json, else config.yaml's algo.name / trainer.seed)."""
    info: dict = {}
    arm_file = run_dir / "arm.json"
    if arm_file.is_file():
        info = json.loads(arm_file.read_text())
    config_file = run_dir / "config.yaml"
    config = yaml.safe_load(config_file.read_text()) if config_file.is_file() else {}
    info.setdefault("arm", (config.get("algo") or {}).get("name", run_dir.name))
    info.setdefault("seed", (config.get("trainer") or {}).get("seed", 0))
    info.setdefault("condition", "")
    return info


def metric_series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of metric ``key`` over ``rows``, finite numbers only."""
    steps, values = [], []
    for row in rows:
        value = row.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            steps.append(int(row["step"]))
            values.append(float(value))
    return steps, values


def train_rows(run_dir: Path) -> list[dict]:
    """Training-step rows of metrics.jsonl in step order (eval rows share step numbers but carry no
    reward/mean; after a resume a re-run step appears twice and its last row wins)."""
    by_step = {
        int(r["step"]): r
        for r in read_metrics(run_dir)
        if "reward/mean" in r and isinstance(r.get("step"), (int, float))
    }
    return [by_step[s] for s in sorted(by_step)]
