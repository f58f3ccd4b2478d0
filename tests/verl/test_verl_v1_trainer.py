"""What veRL's v1 trainer (trainer.use_v1=true, veRL's default) hands an estimator, through its own code.

veRL 0.9.1's v1 trainer calls every estimator through `verl.trainer.ppo.v1.utils.
compute_advantage_for_multi_trajectories(data, batch_keys, …)`, which differs from the legacy path in two
ways: the batch may hold synthetic padding rows (`upsample_batch_to_divisible_size`: uid `pad…`, all-0
mask, reward 0), and an agent loop may return several outputs per session (keys `{uid}_{session}_{index}`;
veRL's GRPO then scores only the last one, any other estimator gets every row). Also: the pinned veRL
version and the hooks the plugins rely on (stratarl.integrations.verl.compat), checked on the installed veRL.
"""

from __future__ import annotations

import re
import uuid
from pathlib import Path

import pytest

# "verl.trainer…", not "verl": in the main venv this folder itself is importable as a namespace package "verl".
pytest.importorskip("verl.trainer.ppo.core_algos", reason="needs veRL (make test-verl runs these in .venv-verl)")

import numpy as np
import torch
from harness import smoke
from omegaconf import OmegaConf
from verl import DataProto
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.ray_trainer import compute_advantage
from verl.trainer.ppo.v1.utils import compute_advantage_for_multi_trajectories

import stratarl.integrations.verl  # noqa: F401  (registers the estimator)
from stratarl.algos import stratified_advantages
from stratarl.integrations.verl import compat
from stratarl.integrations.verl.advantage import multi_output_sessions

REPO = Path(__file__).resolve().parents[2]
T = 12


def mask_with_rounds(rounds: int) -> list[int]:
    row = [1, 1, 0] * rounds + [1, 1]
    return (row + [0] * T)[:T]


def v1_batch(rewards, rounds, uids, keys, *, padding: int = 0):
    """A DataProto as v1's `_compute_advantage` builds it, plus `padding` synthetic rows at the end."""
    masks = [mask_with_rounds(k) for k in rounds] + [[0] * T] * padding
    mask = torch.tensor(masks, dtype=torch.float32)
    scores = torch.zeros_like(mask)
    for i, r in enumerate(rewards):
        scores[i, int(mask[i].nonzero().max())] = r
    pad_uid = f"pad{uuid.uuid4().hex}"
    all_uids = list(uids) + [pad_uid] * padding
    all_keys = list(keys) + [f"{pad_uid}_{i}_0" for i in range(padding)]
    data = DataProto.from_dict(
        tensors={"token_level_rewards": scores, "response_mask": mask},
        non_tensors={"uid": np.array(all_uids, dtype=object)},
    )
    return data, all_keys


def algorithm(estimator="stratified_grpo", alpha=0.6):
    return OmegaConf.create(
        {
            "adv_estimator": estimator,
            "norm_adv_by_std_in_grpo": True,
            "stratified_grpo": {"alpha": alpha},
            "gamma": 1.0,
            "lam": 1.0,
        }
    )


def v1_advantages(data, keys, estimator="stratified_grpo", alpha=0.6):
    out = compute_advantage_for_multi_trajectories(
        data,
        batch_keys=keys,
        adv_estimator=estimator,
        num_repeat=1,
        norm_adv_by_std_in_grpo=True,
        config=algorithm(estimator, alpha),
    )
    return out.batch["advantages"]


@pytest.fixture()
def sessions():
    """Two prompts × 5 sessions, one output each (tool_agent), rows interleaved as v1's balancing leaves them."""
    uid_a, uid_b = str(uuid.uuid4()), str(uuid.uuid4())
    rewards = [1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0]
    rounds = [0, 2, 1, 0, 1, 1, 2, 0, 2, 2]
    uids = [uid_a, uid_b] * 5
    keys = [f"{u}_{i // 2}_0" for i, u in enumerate(uids)]
    return rewards, rounds, uids, keys


def expected(rewards, rounds, uids, alpha=0.6):
    groups = torch.tensor([sorted(set(uids)).index(u) for u in uids])
    return stratified_advantages(torch.tensor(rewards), groups, torch.tensor(rounds), alpha=alpha, eps=1e-6, std_ddof=1)


def test_v1_path_gives_stratified_advantages_and_padding_rows_change_nothing(sessions):
    rewards, rounds, uids, keys = sessions
    data, all_keys = v1_batch(rewards, rounds, uids, keys, padding=3)
    adv = v1_advantages(data, all_keys)
    mask = data.batch["response_mask"]
    real = len(rewards)
    torch.testing.assert_close(adv[:real], expected(rewards, rounds, uids)[:, None] * mask[:real])
    assert bool((adv[real:] == 0).all())  # the padding group: reward 0, advantage 0
    # The same rows through the legacy trainer's compute_advantage, without padding: identical.
    legacy_data, _ = v1_batch(rewards, rounds, uids, keys)
    legacy = compute_advantage(legacy_data, adv_estimator="stratified_grpo", config=algorithm())
    torch.testing.assert_close(adv[:real], legacy.batch["advantages"])


def test_v1_alpha_zero_equals_v1_grpo_for_one_output_sessions(sessions):
    rewards, rounds, uids, keys = sessions
    data, all_keys = v1_batch(rewards, rounds, uids, keys, padding=2)
    ours = v1_advantages(data, all_keys, alpha=0.0)
    data, all_keys = v1_batch(rewards, rounds, uids, keys, padding=2)
    grpo = v1_advantages(data, all_keys, estimator=core_algos.AdvantageEstimator.GRPO)
    torch.testing.assert_close(ours, grpo)


def test_v1_multi_output_sessions_are_refused_in_one_line(sessions):
    rewards, rounds, uids, keys = sessions
    # Session 0 of the first prompt returned two outputs (e.g. a context-compacting agent loop).
    extra_key = keys[0].rsplit("_", 1)[0] + "_1"
    data, all_keys = v1_batch([*rewards, rewards[0]], [*rounds, 1], [*uids, uids[0]], [*keys, extra_key])
    with pytest.raises(ValueError) as error:
        v1_advantages(data, all_keys)
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("stratified_grpo cannot compose with an agent loop that returns several outputs")
    for setting in ("trainer.use_v1=true", "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent"):
        assert setting in message
    # veRL's own GRPO accepts it (it scores each session's last output): the refusal is ours alone.
    data, all_keys = v1_batch([*rewards, rewards[0]], [*rounds, 1], [*uids, uids[0]], [*keys, extra_key])
    assert v1_advantages(data, all_keys, estimator=core_algos.AdvantageEstimator.GRPO).shape[0] == len(all_keys)


def test_session_keys_and_the_legacy_path():
    assert multi_output_sessions(["a-1_0_0", "a-1_1_0", "pad9_0_0"]) == {}
    assert multi_output_sessions(["a-1_0_0", "a-1_0_1", "a-1_1_0"]) == {"a-1_0": 2}
    # The legacy trainer passes no keys: the same rows with duplicate "sessions" are just rollouts there.
    data, _ = v1_batch([1.0, 0.0], [0, 1], ["u", "u"], ["u_0_0", "u_0_1"])
    compute_advantage(data, adv_estimator="stratified_grpo", config=algorithm())


# --- pinned version and hooks ----------------------------------------------------------------------


def test_installed_verl_is_a_tested_version_with_every_hook_in_place():
    assert compat.verl_version() in compat.TESTED_VERL_VERSIONS
    assert compat.moved_hooks() == []
    assert compat.require_hooks() == compat.verl_version()


def test_requirements_pin_the_tested_verl_and_the_v1_trainer_dependencies():
    pins = dict(
        line.split("==", 1)
        for line in (REPO / "requirements" / "verl.txt").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    )
    assert pins["verl"] == compat.TESTED_VERL_VERSIONS[-1]
    # transferqueue (import name transfer_queue) and what it imports; installed with --no-deps.
    for name in ("transferqueue", "pyzmq", "msgspec", "prometheus_client"):
        assert name in pins, name


def test_a_moved_hook_fails_loudly_naming_the_version(monkeypatch, capsys):
    monkeypatch.delattr(core_algos, "register_adv_est")
    problems = compat.moved_hooks()
    assert len(problems) == 1 and problems[0].startswith("register_adv_est")
    with pytest.raises(RuntimeError, match=re.escape(f"veRL {compat.verl_version()}: 1 hook(s)")):
        compat.require_hooks()
    # The smoke refuses to start, with the same line, before building anything.
    assert smoke.main(["--workdir", "/nonexistent/never-created"]) == 2
    err = capsys.readouterr().err
    assert "register_adv_est" in err and "tested with veRL 0.9.1" in err
    assert not Path("/nonexistent/never-created").exists()


def test_smoke_overrides_select_each_trainer():
    v1 = smoke.main_ppo_overrides(Path("/w"), trainer="v1")
    legacy = smoke.main_ppo_overrides(Path("/w"), trainer="legacy")
    assert "trainer.use_v1=true" in v1 and "trainer.use_v1=false" not in v1
    assert "trainer.use_v1=false" in legacy and "trainer.use_v1=true" not in legacy
    two = smoke.main_ppo_overrides(Path("/w"), n_ranks=2)
    assert "trainer.n_gpus_per_node=2" in two and "+ray_kwargs.ray_init.num_gpus=2" in two
