"""kill -9 at seeded points of a tiny run, inside the checkpoint writer included (the re-save of the
last step too), then `--resume`: the run must continue from the newest checkpoint that was complete
before the kill and end bit for bit where an uninterrupted run ends."""

from __future__ import annotations

import sys

import pytest
from fault_injection import STEPS, compare_runs, count_calls, random_targets, run_killed

pytestmark = [pytest.mark.slow, pytest.mark.skipif(sys.platform == "win32", reason="needs fork and SIGKILL")]

# Checkpoint writes of this run: steps 1, 2, 3, then step 3 again (save_every divides steps).
# os.replace runs twice per write (the folder, then `latest`) and three times when the step folder
# already exists (the old copy moves aside first): calls 7-9 belong to the re-save.
NAMED = [
    ("rl_step", 2, "before"),  # mid-run, between checkpoints
    ("save_model", 2, "torn"),  # the model file of step 2 half-written
    ("write_manifest", 3, "before"),  # step 3 complete but unsigned
    ("os.replace", 8, "before"),  # the re-save: old copy moved aside, new one not yet in place
    ("os.replace", 9, "before"),  # the re-save: new folder in place, `latest` not yet rewritten
]


def _kill_and_resume(cfg, tmp_path, target, straight):
    from stratarl.trainer.rl import train

    run_dir = tmp_path / "run"
    killed, completed = run_killed(cfg, run_dir, target)
    assert killed, f"{target} was never reached"
    newest = max(completed, default=0)
    summary = train(cfg, run_dir, resume=True, start_over=not completed)
    assert newest <= summary["start_step"] <= STEPS, (target, completed, summary["start_step"])
    assert compare_runs(straight, run_dir, STEPS) == []
    leftovers = [p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".")]
    assert leftovers == [] or leftovers == [".latest.tmp"], leftovers


@pytest.mark.parametrize("target", NAMED, ids=[f"{n}-{i}-{w}" for n, i, w in NAMED])
def test_named_kill_points_resume_bit_exact(tiny_cfg, straight_run, tmp_path, target):
    _kill_and_resume(tiny_cfg, tmp_path, target, straight_run)


def test_seeded_random_kill_points_resume_bit_exact(tiny_cfg, straight_run, tmp_path):
    counts = count_calls(tiny_cfg, tmp_path / "count")
    assert counts["save_model"] == STEPS + 1 and counts["rl_step"] == STEPS
    for index, target in enumerate(random_targets(counts, 1, seed=15)):
        _kill_and_resume(tiny_cfg, tmp_path / str(index), target, straight_run)
