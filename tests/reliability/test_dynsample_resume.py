"""Dynamic sampling keeps a resume exact: its refills draw from the run's data sampler, whose state the
checkpoint holds, so 1 step + kill + resume + 1 step ends bit for bit where 2 straight steps end."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
from fault_injection import TINY, compare_runs, run_killed

pytestmark = [pytest.mark.skipif(sys.platform == "win32", reason="needs fork and SIGKILL"), pytest.mark.slow]


def test_a_resumed_run_with_dynamic_sampling_is_bit_exact(base_overrides, tmp_path):
    from stratarl.trainer.config import load_config
    from stratarl.trainer.rl import train

    cfg = load_config(
        TINY,
        [
            *base_overrides,
            "trainer.steps=2",
            "trainer.prompts_per_step=2",
            "trainer.dynamic_sampling=true",
            "trainer.dynamic_sampling_attempts=3",
        ],
    )
    train(cfg, tmp_path / "straight")
    rows = [json.loads(line) for line in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    drawn = [row["dynsample/prompts_drawn"] for row in rows if "dynsample/prompts_drawn" in row]
    assert len(drawn) == 2 and max(drawn) > 2  # a refill drew more prompts: the sampler moved by more than P
    killed, completed = run_killed(cfg, tmp_path / "half", ("rl_step", 2, "before"))
    assert killed and completed == [1]
    resumed = tmp_path / "run"
    shutil.copytree(tmp_path / "half", resumed)
    assert train(cfg, resumed, resume=True)["start_step"] == 1
    assert compare_runs(tmp_path / "straight", resumed, 2) == []
