"""A resume is exact for every piece of state: with a warm-up and a decaying learning rate, SORL's
running statistic, a value head and the data sampler mid-epoch, 1 step + kill + resume + 1 step ends bit for
bit where 2 straight steps end, and leaving any one of those pieces unrestored breaks that."""

from __future__ import annotations

import copy
import shutil
import sys

import pytest
from fault_injection import TINY, compare_runs, final_weights, run_killed

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="needs fork and SIGKILL")

STEPS = 2
OVERRIDES = [
    "algo.name=so_ppo",
    "algo.sorl_delta_rule=running_pg",  # SORL with its running statistic, and
    # a value head (the GAE critic)
    "trainer.epochs=2",
    "algo.clip_low=0.02",
    "algo.clip_high=0.02",
    "algo.sorl_delta=0.01",  # the
    # second epoch clips, so the clip-bias gradient exceeds the statistic's floor and SORL scales steps
    "optim.grad_clip=0",  # clipping every step to norm 1 would hide SORL's scale
    "optim.warmup_steps=6",
    "optim.schedule=cosine",  # 8 optimizer steps: the resume (after 4) is
    # inside the warm-up, the last 2 decay
    "trainer.prompts_per_step=3",  # 8 training questions: step 1 ends mid-epoch (position 3 of 8)
    "trainer.save_every=1",
    f"trainer.steps={STEPS}",
]


def _fresh(run, piece: str):
    """The un-restored value of ``piece`` in a just-built run, and how to put it back after a restore."""
    learner = run.learner
    if piece == "scheduler":
        saved = copy.deepcopy(learner.scheduler.state_dict())
        return lambda: learner.scheduler.load_state_dict(saved)
    if piece == "sorl":
        saved = copy.deepcopy(learner.normalizer.state_dict())
        return lambda: learner.normalizer.load_state_dict(saved)
    if piece == "value_head":
        saved = copy.deepcopy(learner.value_head.state_dict())
        return lambda: learner.value_head.load_state_dict(saved)
    if piece == "sampler":
        saved = run.sampler.state_dict()
        return lambda: run.sampler.load_state_dict(saved)
    raise ValueError(piece)


@pytest.fixture(scope="module")
def runs(base_overrides, tmp_path_factory):
    """(config, the straight 2-step run, the same run killed before step 2: its newest checkpoint is step 1).
    Not a 1-step run: its schedule would decay over 1 step, not 2."""
    from stratarl.trainer.config import load_config
    from stratarl.trainer.rl import train

    root = tmp_path_factory.mktemp("resume_state")
    cfg = load_config(TINY, [*base_overrides, *OVERRIDES])
    train(cfg, root / "straight")
    killed, completed = run_killed(cfg, root / "half", ("rl_step", 2, "before"))
    assert killed and completed == [1]
    return cfg, root / "straight", root / "half"


def test_resume_restores_every_piece_bit_exact(runs, tmp_path):
    from stratarl.trainer.rl import train

    cfg, straight, half = runs
    run_dir = tmp_path / "run"
    shutil.copytree(half, run_dir)
    summary = train(cfg, run_dir, resume=True)
    assert summary["start_step"] == 1 and summary["steps"] == STEPS
    assert compare_runs(straight, run_dir, STEPS) == []


@pytest.fixture(scope="module")
def rebuilt(runs, tmp_path_factory):
    """One run built from the config, restored again before each sabotaged step (building costs more
    than the step)."""
    from stratarl.trainer.run import build_run

    cfg, _, _ = runs
    return build_run(cfg, tmp_path_factory.mktemp("rebuilt"))


@pytest.mark.parametrize("piece", [None, "scheduler", "sorl", "value_head", "sampler"])
def test_a_resume_that_skips_one_piece_is_caught(runs, rebuilt, piece):
    import torch

    from stratarl.trainer.run import restore
    from stratarl.trainer.step import rl_step

    _, straight, half = runs
    put_back = _fresh(rebuilt, piece) if piece is not None else None
    restore(rebuilt, half / "checkpoints" / "step_000001")
    if put_back is not None:
        put_back()
    rl_step(rebuilt)
    expected = final_weights(straight, STEPS)
    weights = rebuilt.model.state_dict()
    same = all(torch.equal(weights[k].cpu(), v) for k, v in expected.items())
    assert same == (piece is None)
