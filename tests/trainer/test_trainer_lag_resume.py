"""Resumes of a run with stale weights (``trainer.policy_lag``) are exact or refused: a checkpoint written at another
lag, or lacking weight snapshots the lag needs, is refused with the reason unless ``--allow-lag-change``; a
snapshot of the wrong shapes falls back to the previous checkpoint as other damaged files do."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from stratarl.infra import checkpoint as ckpt
from stratarl.trainer.behaviour import LagResumeError
from stratarl.trainer.config import load_config

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"
SMALL = ["trainer.prompts_per_step=2", "rollout.group_size=2", "eval.before_after=false", "trainer.save_every=1"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, load_script):
    """A run of 3 steps at policy lag 2 with a checkpoint after each (keep_last 2: steps 2 and 3), trained once."""
    # tests/conftest.py by its path: "conftest" may name tests/verl's in this process
    reward_module = load_script(Path(__file__).resolve().parents[1] / "conftest.py", "tests_conftest").REWARD_MODULE
    from stratarl.trainer.rl import train

    root = tmp_path_factory.mktemp("lagged")
    (root / "stratarl_test_rewards.py").write_text(reward_module)
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(root))
        common = [
            f"data.synthetic.cache_dir={root / 'kb'}",
            "algo.reward=stratarl_test_rewards:length_parity_reward",
            *SMALL,
            "trainer.policy_lag=2",
            "optim.lr=0.02",
        ]
        train(load_config(TINY, [*common, "trainer.steps=3"]), root / "run")
        yield root, common


@pytest.fixture
def lagged(trained, tmp_path, monkeypatch):
    """A copy of the trained run for one test to resume (or damage)."""
    root, common = trained
    monkeypatch.syspath_prepend(str(root))
    shutil.copytree(root / "run", tmp_path / "run")
    return tmp_path / "run", common


def _rewrite_state(folder: Path, edit) -> None:
    """Edit a checkpoint's state.pt and write its manifest again (so it verifies: the damage is in the content)."""
    state = torch.load(folder / "state.pt", weights_only=True)
    edit(state)
    torch.save(state, folder / "state.pt")
    (folder / ckpt.MANIFEST).unlink()
    ckpt._write_manifest(folder, int(state["step"]))


def test_a_resume_at_another_lag_is_refused_unless_asked_for(lagged):
    from stratarl.trainer.rl import train

    run_dir, common = lagged
    for other in (["trainer.policy_lag=1"], ["trainer.policy_lag=3"], ["trainer.policy_lag_mode=uniform"]):
        with pytest.raises(LagResumeError) as error:
            train(load_config(TINY, [*common, *other, "trainer.steps=4"]), run_dir, resume=True)
        message = str(error.value)
        assert "trainer.policy_lag 2 (fixed)" in message and "--allow-lag-change" in message and "\n" not in message
    summary = train(
        load_config(TINY, [*common, "trainer.policy_lag=1", "trainer.steps=4"]),
        run_dir,
        resume=True,
        allow_lag_change=True,
    )
    assert summary["steps"] == 4 and summary["start_step"] == 3


def test_a_resume_without_a_lag_from_a_lagged_checkpoint_is_refused(lagged):
    from stratarl.trainer.rl import train

    run_dir, common = lagged
    with pytest.raises(LagResumeError, match="policy_lag 2, this run has 0"):
        train(load_config(TINY, [*common, "trainer.policy_lag=0", "trainer.steps=4"]), run_dir, resume=True)


def test_a_checkpoint_missing_snapshots_is_refused(lagged):
    """A checkpoint whose snapshots lack a version the lag needs (here an older checkpoint without the lag
    settings, so only the versions tell): the resumed steps would sample with shorter lags."""
    from stratarl.trainer.rl import train

    run_dir, common = lagged

    def drop_oldest(state):
        behaviour = state["behaviour"]
        for key in ("max_lag", "mode", "shortened"):
            behaviour.pop(key, None)
        assert behaviour["versions"] == [0, 1, 2]
        behaviour["versions"], behaviour["weights"] = behaviour["versions"][2:], behaviour["weights"][2:]

    _rewrite_state(run_dir / "checkpoints" / "step_000003", drop_oldest)
    with pytest.raises(LagResumeError, match=r"lacks the weight snapshots of versions \[1\]"):
        train(load_config(TINY, [*common, "trainer.steps=4"]), run_dir, resume=True)


def test_a_snapshot_of_the_wrong_shape_falls_back_to_the_previous_checkpoint(lagged, capsys):
    """Before: a raw tensor-size error and no fallback."""
    from stratarl.trainer.rl import train

    run_dir, common = lagged

    def reshape(state):
        weights = state["behaviour"]["weights"]
        weights[-1][0] = torch.zeros(3, 5)

    _rewrite_state(run_dir / "checkpoints" / "step_000003", reshape)
    summary = train(load_config(TINY, [*common, "trainer.steps=3"]), run_dir, resume=True)
    out = capsys.readouterr()
    assert summary["start_step"] == 2 and summary["steps"] == 3
    assert "warning: skipped checkpoint:" in out.err and "of shape (3, 5)" in out.err
    assert "resumed from" in out.out and "step_000002" in out.out


def test_the_exact_resume_still_resumes(lagged):
    from stratarl.trainer.rl import train

    run_dir, common = lagged
    summary = train(load_config(TINY, [*common, "trainer.steps=4"]), run_dir, resume=True)
    assert summary["start_step"] == 3 and summary["steps"] == 4 and summary["exit_code"] == 0
    state = torch.load(run_dir / "checkpoints" / "step_000004" / "state.pt", weights_only=True)
    assert state["behaviour"]["max_lag"] == 2 and state["behaviour"]["shortened"] == []


def test_snapshot_settings_that_are_not_numbers_count_as_damage(lagged, capsys):
    from stratarl.trainer.rl import train

    run_dir, common = lagged
    _rewrite_state(run_dir / "checkpoints" / "step_000003", lambda state: state["behaviour"].update(max_lag="two"))
    summary = train(load_config(TINY, [*common, "trainer.steps=3"]), run_dir, resume=True)
    assert summary["start_step"] == 2 and "settings are damaged" in capsys.readouterr().err
