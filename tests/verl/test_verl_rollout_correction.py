"""veRL's rollout correction (``algorithm.rollout_correction``) with stratarl's plugins, at CPU size.

What composes: veRL's TIS / IcePop weights (``rollout_is``) with ``turn_ppo`` / ``sorl`` (multiplied in
after the clip, before SORL's normalisation and gradient clipping) and with ``stratified_grpo`` (never
read); the whole-rollout rejection modes (``seq_*``) with the turn-level losses; rejection in bypass mode
with ``stratified_grpo``. What is refused, in one line each: token-level rejection (it splits turns and
adds phantom strata), any rejection before ``stratified_grpo`` in decoupled mode, bypass mode with the
turn-level losses. The weights and masks come from veRL's own ``rollout_corr_helper``.
"""

from __future__ import annotations

import copy
from functools import partial
from pathlib import Path

import pytest

# "verl.trainer…", not "verl": in the main venv this folder itself is importable as a namespace package "verl".
pytest.importorskip("verl.trainer.ppo.core_algos", reason="needs veRL (make test-verl runs these in .venv-verl)")

import numpy as np
import torch
from omegaconf import OmegaConf
from test_verl_losses import (
    actor_config,
    inputs,
    multi_token_turns_mask,
    one_token_turns_mask,
    value_and_grad,
)
from test_verl_sorl_step import CpuEngine, make_batch, padded_response_log_probs, reference_step, tiny_lm
from test_verl_sorl_step import actor_config as sorl_actor_config
from verl import DataProto
from verl.trainer.config.algorithm import RolloutCorrectionConfig
from verl.trainer.ppo import core_algos, rollout_corr_helper
from verl.trainer.ppo.ray_trainer import compute_advantage
from verl.workers.utils.losses import ppo_loss

import stratarl.integrations.verl  # noqa: F401  (registers the plugins)
from stratarl.algos import (
    aggregate_loss,
    clipped_policy_loss,
    decoupled_weights,
    importance_ratios,
    mis_weights,
    num_turns,
    search_counts,
    tis_weights,
    turn_ids,
)
from stratarl.integrations.verl import guards, sorl_train_batch
from stratarl.integrations.verl.config import SORLPolicyLossConfig, StratifiedAlgoConfig
from stratarl.integrations.verl.losses import SORL_STEP_ACTIVE, turn_level_loss, verl_aggregation_factor

VERL_AGG_MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean"]
LOSS_WHERE = "actor_rollout_ref.actor.policy_loss.rollout_correction"


def verl_correction(old, rollout, mask, **settings) -> DataProto:
    """veRL's own pre-advantage step on a small batch: IS weights added, response_mask rejected."""
    batch = DataProto.from_dict(
        tensors={"old_log_probs": old, "rollout_log_probs": rollout, "response_mask": mask.to(old.dtype)}
    )
    batch, _ = rollout_corr_helper.compute_rollout_correction_and_add_to_batch(batch, settings)
    return batch


def clipped_turn_tokens(log_prob, old, adv, mask, *, low=0.2, high=0.28, dual=3.0) -> torch.Tensor:
    """The tokens PPO clips at turn level, from the definition (docs/algorithms.md): the turn ratio r_k
    and the sign of the turn's summed advantage decide, for every token of the turn."""
    mask = mask.bool()
    ratio = importance_ratios(log_prob.detach(), old, mask, level="turn")
    ids = turn_ids(mask)
    decision = torch.zeros_like(adv)
    for b in range(mask.shape[0]):
        for k in ids[b][mask[b]].unique().tolist():
            turn = mask[b] & (ids[b] == k)
            decision[b, turn] = adv[b, turn].sum()
    return mask & (((decision > 0) & (ratio > 1 + high)) | ((decision < 0) & ((ratio < 1 - low) | (ratio > dual))))


# --- The option sets and the order of veRL's steps that the guards rely on -------------------------------------


def test_the_guards_know_verl_s_rejection_options():
    assert guards.TOKEN_RS_OPTIONS == rollout_corr_helper.TOKEN_LEVEL_ROLLOUT_RS_OPTIONS
    assert guards.TOKEN_RS_OPTIONS | guards.SEQUENCE_RS_OPTIONS == rollout_corr_helper.SUPPORTED_ROLLOUT_RS_OPTIONS
    assert not guards.TOKEN_RS_OPTIONS & guards.SEQUENCE_RS_OPTIONS


def _verl_source(relative: str) -> str:
    import verl

    return (Path(verl.__file__).parent / relative).read_text()


@pytest.mark.parametrize(
    "relative",
    ["trainer/ppo/ray_trainer.py", "trainer/ppo/v1/trainer_base.py", "experimental/separation/ray_trainer.py"],
)
def test_verl_rejects_before_the_advantage_and_only_in_decoupled_mode(relative):
    """Why the estimator and the loss both read the rewritten mask: in every veRL 0.9.1 trainer the
    correction step runs, unless bypass_mode, before compute_advantage (and so before the actor update)."""
    source = _verl_source(relative)
    correction = source.index("compute_rollout_correction_and_add_to_batch(")
    advantage = source.index("compute_advantage", correction)
    guard = source.rindex("not bypass_recomputing_logprobs", 0, correction)
    assert guard < correction < advantage
    assert source.count("compute_rollout_correction_and_add_to_batch(") == 1


def test_bypass_mode_swaps_the_actor_loss():
    """The reason bypass_mode is refused with turn_ppo / sorl: veRL's trainer replaces the loss mode."""
    batch = DataProto.from_dict(tensors={"rollout_log_probs": torch.zeros(2, 3), "old_log_probs": torch.ones(2, 3)})
    policy_loss = OmegaConf.create({"loss_mode": "sorl"})
    rollout_corr_helper.apply_bypass_mode(batch, OmegaConf.create({"bypass_mode": True}), policy_loss)
    assert policy_loss.loss_mode == "bypass_mode"
    assert torch.equal(batch.batch["old_log_probs"], batch.batch["rollout_log_probs"])


# --- TIS weights through turn_ppo / sorl: hand-checked ----------------------------------------------------------


def hand_case():
    """One rollout, turns {0, 1} and {3}; θ = θ_old, so every turn ratio is 1 and nothing clips.
    π_old / π_rollout per policy token: 1.5, 3.0 | 0.5; advantages 1, 1 | −1."""
    mask = torch.tensor([[1, 1, 0, 1]], dtype=torch.bool)
    old = torch.tensor([[-1.0, -2.0, 0.0, -0.5]], dtype=torch.float64)
    rollout = old - torch.log(torch.tensor([[1.5, 3.0, 1.0, 0.5]], dtype=torch.float64))
    adv = torch.tensor([[1.0, 1.0, 0.0, -1.0]], dtype=torch.float64)
    return mask, old, rollout, adv


@pytest.mark.parametrize(
    ("settings", "weights", "loss", "grad"),
    [
        # token TIS, C = 2: w = 1.5, min(3, 2) = 2 | 0.5. loss = −(1.5 + 2 − 0.5)/3 = −1.
        # d/dlogπ_t = −(1/N)(1/|k|) Σ_{s∈k} w_s A_s:
        # turn 0: −(1/3)(1/2)(3.5) = −7/12; turn 1: −(1/3)(−0.5) = 1/6.
        (
            {"rollout_is": "token", "rollout_is_threshold": 2.0},
            [1.5, 2.0, 0.0, 0.5],
            -1.0,
            [-7 / 12, -7 / 12, 0, 1 / 6],
        ),
        # sequence TIS, C = 2: w = min(1.5·3·0.5 = 2.25, 2) = 2 on every policy token. loss = −2(1 + 1 − 1)/3.
        # turn 0: −(1/3)(1/2)(4) = −2/3; turn 1: −(1/3)(−2) = 2/3.
        (
            {"rollout_is": "sequence", "rollout_is_threshold": 2.0},
            [2.0, 2.0, 0.0, 2.0],
            -2 / 3,
            [-2 / 3, -2 / 3, 0, 2 / 3],
        ),
        # IcePop [0.6, 2.5]: 1.5 kept; 3.0 and 0.5 zeroed. loss = −1.5/3. The zeroed token stays in its turn:
        # turn 0's ratio still averages both tokens, so both get −(1/3)(1/2)(1.5) = −1/4 (no split turn).
        ({"rollout_is": "token", "rollout_is_threshold": "0.6_2.5"}, [1.5, 0.0, 0.0, 0.0], -0.5, [-0.25, -0.25, 0, 0]),
    ],
)
@pytest.mark.parametrize("loss_mode", ["turn_ppo", "sorl"])
def test_verl_weights_through_the_turn_losses_by_hand(settings, weights, loss, grad, loss_mode):
    mask, old, rollout, adv = hand_case()
    batch = verl_correction(old, rollout, mask, **settings)
    assert torch.equal(batch.batch["response_mask"].bool(), mask)  # rollout_is never touches the mask
    w = batch.batch["rollout_is_weights"]
    torch.testing.assert_close(w, torch.tensor([weights], dtype=torch.float64))
    fn = core_algos.get_policy_loss_fn(loss_mode)
    config = actor_config(loss_mode)
    token = SORL_STEP_ACTIVE.set(True)  # sorl's loss runs inside the SORL step only
    try:
        value, gradient = value_and_grad(
            lambda lp: fn(old, lp, adv, mask, "token-mean", config, rollout_is_weights=w)[0],
            old.clone().requires_grad_(True),
        )
    finally:
        SORL_STEP_ACTIVE.reset(token)
    torch.testing.assert_close(value, torch.tensor(loss, dtype=torch.float64))
    torch.testing.assert_close(gradient, torch.tensor([grad], dtype=torch.float64))


@pytest.mark.parametrize("rollout_is", ["token", "sequence"])
@pytest.mark.parametrize("mode", VERL_AGG_MODES)
def test_weighted_turn_ppo_is_stratarl_s_weighted_loss(rollout_is, mode):
    """Off-policy (turns clip high, low and dual) with veRL's weights: the same value and gradient as
    stratarl's clipped_policy_loss(token_weights=w), the loss of its own trainer, in every aggregation."""
    mask = multi_token_turns_mask()
    old, log_prob, adv = inputs(mask)
    rollout = old - 0.4 * torch.randn(mask.shape, generator=torch.Generator().manual_seed(5))
    w = verl_correction(old, rollout, mask, rollout_is=rollout_is, rollout_is_threshold=2.0).batch["rollout_is_weights"]
    assert 0 < float(w[mask].min()) < 1 < float(w[mask].max())
    config = actor_config()
    stratarl_mode, factor, norm_length = verl_aggregation_factor(mode, mask, config.global_batch_info)
    turn_ppo = core_algos.get_policy_loss_fn("turn_ppo")
    ours, ours_grad = value_and_grad(
        lambda lp: turn_ppo(old, lp, adv, mask, mode, config, rollout_is_weights=w)[0], log_prob
    )
    ref, ref_grad = value_and_grad(
        lambda lp: (
            factor
            * clipped_policy_loss(
                lp,
                old,
                adv,
                mask,
                level="turn",
                clip_low=0.2,
                clip_high=0.28,
                dual_clip=3.0,
                agg=stratarl_mode,
                norm_length=norm_length,
                token_weights=w,
            ).loss
        ),
        log_prob,
    )
    torch.testing.assert_close(ours, ref)
    torch.testing.assert_close(ours_grad, ref_grad)
    unweighted, _ = value_and_grad(lambda lp: turn_ppo(old, lp, adv, mask, mode, config)[0], log_prob)
    assert not torch.isclose(ours, unweighted)


@pytest.mark.parametrize("mode", VERL_AGG_MODES)
def test_with_one_token_turns_the_weights_act_as_in_verl_vanilla(mode):
    """veRL's `vanilla` multiplies its clipped per-token loss by rollout_is_weights: with one-token turns our
    turn-level loss is token PPO, so veRL's own code is the oracle for the order (after the clip)."""
    mask = one_token_turns_mask()
    old, log_prob, adv = inputs(mask, seed=1)
    rollout = old - 0.5 * torch.randn(mask.shape, generator=torch.Generator().manual_seed(6))
    w = verl_correction(old, rollout, mask, rollout_is="token", rollout_is_threshold=2.0).batch["rollout_is_weights"]
    config = actor_config()
    ours_fn, verl_fn = core_algos.get_policy_loss_fn("turn_ppo"), core_algos.get_policy_loss_fn("vanilla")
    ours, ours_grad = value_and_grad(
        lambda lp: ours_fn(old, lp, adv, mask, mode, config, rollout_is_weights=w)[0], log_prob
    )
    ref, ref_grad = value_and_grad(
        lambda lp: verl_fn(old, lp, adv, mask, mode, config, rollout_is_weights=w)[0], log_prob
    )
    torch.testing.assert_close(ours, ref)
    torch.testing.assert_close(ours_grad, ref_grad)


# --- The order relative to SORL's normalisation ----------------------------------------------------------------


def test_clip_bias_is_the_weighted_is_gradient_minus_the_weighted_ppo_gradient():
    """∇J_C = ∇J_IS − ∇J_PPO with J_IS = agg_t w_t r_k A_t: SORL's C is taken on the weighted clipped tokens."""
    mask = multi_token_turns_mask()
    old, log_prob, adv = inputs(mask)
    rollout = old - 0.4 * torch.randn(mask.shape, generator=torch.Generator().manual_seed(7))
    w = verl_correction(old, rollout, mask, rollout_is="token", rollout_is_threshold=2.0).batch["rollout_is_weights"]
    config = actor_config()

    def objective(part):
        return lambda lp: turn_level_loss(old, lp, adv, mask, "token-mean", config, w)[part]

    _, loss_grad = value_and_grad(objective(0), log_prob)  # loss = −J_PPO
    _, c_grad = value_and_grad(objective(1), log_prob)  # J_C
    _, is_grad = value_and_grad(
        lambda lp: aggregate_loss(w * importance_ratios(lp, old, mask, level="turn") * adv, mask), log_prob
    )
    torch.testing.assert_close(c_grad, is_grad + loss_grad)
    assert c_grad.abs().sum() > 0


def test_zero_weights_on_the_clipped_tokens_zero_the_clip_bias():
    mask = multi_token_turns_mask()
    old, log_prob, adv = inputs(mask)
    clipped = clipped_turn_tokens(log_prob, old, adv, mask)
    assert clipped.any() and (mask & ~clipped).any()
    config = actor_config()
    w = torch.where(clipped, 0.0, 1.5)
    _, c_grad = value_and_grad(lambda lp: turn_level_loss(old, lp, adv, mask, "token-mean", config, w)[1], log_prob)
    assert torch.equal(c_grad, torch.zeros_like(c_grad))
    _, unweighted = value_and_grad(
        lambda lp: turn_level_loss(old, lp, adv, mask, "token-mean", config, None)[1], log_prob
    )
    assert unweighted.abs().sum() > 0
    # Clipping decisions do not see the weights.
    _, _, metrics = turn_level_loss(old, log_prob, adv, mask, "token-mean", config, w)
    _, _, plain = turn_level_loss(old, log_prob, adv, mask, "token-mean", config, None)
    assert metrics["actor/turn_clipfrac"] == plain["actor/turn_clipfrac"] > 0


def weighted_sorl_batch(model, *, seed: int):
    data = make_batch(model, off_policy=0.7, seed=seed)
    mask = data["response_mask"]
    noise = torch.randn(mask.shape, generator=torch.Generator().manual_seed(seed))
    rollout = data["old_log_probs"] - 0.5 * noise * mask
    w, _ = rollout_corr_helper.compute_rollout_correction_weights(
        data["old_log_probs"] - rollout, mask, rollout_is="token", rollout_is_threshold=2.0
    )
    data["rollout_is_weights"] = w.float()
    return data


@pytest.mark.parametrize("delta", [1e-3, 1.0])
def test_sorl_step_with_verl_weights_matches_stratarl(delta):
    """veRL's actor step with veRL's TIS weights = stratarl's ClipBiasNormalizer step with the same weights."""
    model = tiny_lm()
    data = weighted_sorl_batch(model, seed=0)
    reference_model, unweighted_model = copy.deepcopy(model), copy.deepcopy(model)
    engine = CpuEngine(model, micro_batch_size=2)
    outputs = sorl_train_batch(engine, data, partial(ppo_loss, config=sorl_actor_config("sorl", delta)), delta=delta)
    expected_grads, expected = reference_step(reference_model, data, delta=delta)
    for got, want in zip(engine.stepped_grads, expected_grads):
        torch.testing.assert_close(got, want)
    c_norm = float(outputs["metrics"]["sorl/c_norm"].aggregate())
    torch.testing.assert_close(torch.tensor(c_norm), expected["sorl/c_norm"])
    assert c_norm > 0
    # The weights reached C: without them ‖C‖ differs.
    unweighted = copy.deepcopy(data)
    del unweighted["rollout_is_weights"]
    _, plain = reference_step(unweighted_model, unweighted, delta=delta)
    assert not torch.isclose(plain["sorl/c_norm"], expected["sorl/c_norm"])


def test_sorl_step_with_zero_weights_on_clipped_tokens_is_weighted_turn_ppo():
    """Weights 0 on every clipped token: ‖C‖ = 0, so at δ = 1 the SORL step is weighted turn_ppo, bit for bit."""
    model = tiny_lm(seed=3)
    data = weighted_sorl_batch(model, seed=3)
    with torch.no_grad():
        current = padded_response_log_probs(model, data)
    clipped = clipped_turn_tokens(
        current, data["old_log_probs"], data["advantages"], data["response_mask"], low=0.2, high=0.2
    )
    assert clipped.any()
    data["rollout_is_weights"] = torch.where(clipped, 0.0, data["rollout_is_weights"])
    plain = CpuEngine(copy.deepcopy(model), micro_batch_size=2)
    plain.train_batch(data, loss_function=partial(ppo_loss, config=sorl_actor_config("turn_ppo")))
    engine = CpuEngine(model, micro_batch_size=2)
    outputs = sorl_train_batch(engine, data, partial(ppo_loss, config=sorl_actor_config("sorl")), delta=1.0)
    assert outputs["metrics"]["sorl/c_norm"].aggregate() == 0.0
    for got, want in zip(engine.stepped_grads, plain.stepped_grads):
        assert torch.equal(got, want)


class ClippingCpuEngine(CpuEngine):
    """CpuEngine whose optimizer step clips the gradient norm first, as veRL's engines do."""

    max_norm = 0.05

    def optimizer_step(self):
        norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.max_norm)
        self.stepped_grads = [p.grad.detach().clone() for p in self.module.parameters()]
        self.optimizer.step()
        return float(norm)


def test_gradient_clipping_comes_after_the_weighted_normalised_step():
    """weights → C → scale 1/max(‖C‖, δ) → veRL's grad-norm clipping: the engine clips the scaled, weighted
    gradient, and logs its norm before clipping."""
    model = tiny_lm()
    data = weighted_sorl_batch(model, seed=0)
    delta = 1e-3
    expected_grads, _ = reference_step(copy.deepcopy(model), data, delta=delta)
    engine = ClippingCpuEngine(model, micro_batch_size=2)
    outputs = sorl_train_batch(engine, data, partial(ppo_loss, config=sorl_actor_config("sorl", delta)), delta=delta)
    norm = float(torch.nn.utils.get_total_norm(expected_grads))
    assert norm > ClippingCpuEngine.max_norm
    assert outputs["metrics"]["grad_norm"] == pytest.approx(norm, rel=1e-5)
    for got, want in zip(engine.stepped_grads, expected_grads):
        # torch's clip_grad_norm_ scales by max_norm / (‖g‖ + 1e-6).
        torch.testing.assert_close(got, want * (ClippingCpuEngine.max_norm / (norm + 1e-6)))


# --- Rejection sampling: what keeps the turn structure ---------------------------------------------------------


def mismatched_batch():
    """Five rollouts of multi_token_turns_mask (row 3 empty) with a constant behaviour log-ratio per row."""
    mask = multi_token_turns_mask()
    old = -torch.rand(mask.shape, generator=torch.Generator().manual_seed(8), dtype=torch.float64) * 2
    per_row = torch.tensor([0.01, 1.5, -0.02, 0.0, -2.0], dtype=torch.float64)[:, None]
    return mask, old, old - per_row * mask  # ρ = log π_old − log π_rollout = per_row on policy tokens


def rs_threshold(option: str):
    return "0.5_2.0" if option.endswith("k1") else 0.5


@pytest.mark.parametrize("option", sorted(guards.SEQUENCE_RS_OPTIONS))
def test_whole_rollout_rejection_keeps_every_kept_turn(option):
    """Each seq_* mode keeps a rollout's mask whole or zeroes all of it: the kept rollouts' turns are unchanged,
    the turn-level losses accept the setting and give the loss of the kept rollouts alone."""
    mask, old, rollout = mismatched_batch()
    new = verl_correction(old, rollout, mask, rollout_rs=option, rollout_rs_threshold=rs_threshold(option))
    new_mask = new.batch["response_mask"].bool()
    kept = new_mask.any(dim=1)
    assert kept.tolist() == [True, False, True, False, False]  # rows 1 and 4 are far off-policy; row 3 is empty
    assert torch.equal(new_mask[kept], mask[kept]) and not new_mask[~kept].any()
    torch.testing.assert_close(num_turns(new_mask)[kept], num_turns(mask)[kept])

    settings = RolloutCorrectionConfig(rollout_is=None, rollout_rs=option, rollout_rs_threshold=rs_threshold(option))
    for loss_mode in ("turn_ppo", "sorl"):
        assert guards.turn_loss_conflict(settings, plugin=f"loss_mode={loss_mode}", where=LOSS_WHERE) is None
        SORLPolicyLossConfig(loss_mode=loss_mode, rollout_correction=settings)
    _, log_prob, adv = inputs(mask)
    config = actor_config()
    object.__setattr__(config.policy_loss, "rollout_correction", settings)
    turn_ppo = core_algos.get_policy_loss_fn("turn_ppo")
    old32 = old.float()
    value, grad = value_and_grad(lambda lp: turn_ppo(old32, lp, adv, new_mask, "token-mean", config)[0], log_prob)
    alone, alone_grad = value_and_grad(
        lambda lp: turn_ppo(old32[kept], lp[kept], adv[kept], mask[kept], "token-mean", actor_config())[0], log_prob
    )
    torch.testing.assert_close(value, alone)
    torch.testing.assert_close(grad, alone_grad)
    # The estimator, which would read the rejected rollouts as stratum 0, refuses it.
    assert "stratum 0" in guards.estimator_conflict(settings)


@pytest.mark.parametrize("option", sorted(guards.TOKEN_RS_OPTIONS))
def test_token_rejection_splits_a_turn_and_adds_a_phantom_stratum(option):
    """One far-off token in the middle of a 3-token turn: veRL zeroes it in response_mask, which the
    estimator and the turn-level loss then read as one more turn and one more tool round. Refused."""
    mask = torch.tensor([[1, 1, 1, 0, 0, 1, 1, 0]], dtype=torch.bool)
    old = torch.full(mask.shape, -1.0, dtype=torch.float64)
    rollout = old.clone()
    rollout[0, 1] = old[0, 1] - 3.0  # π_old / π_rollout = e³ on token 1 only
    new = verl_correction(old, rollout, mask, rollout_rs=option, rollout_rs_threshold=rs_threshold(option))
    new_mask = new.batch["response_mask"].bool()
    assert new_mask[0].tolist() == [True, False, True, False, False, True, True, False]
    assert (int(num_turns(mask)), int(num_turns(new_mask))) == (2, 3)
    assert (int(search_counts(mask)), int(search_counts(new_mask))) == (1, 2)
    settings = {"rollout_rs": option, "rollout_rs_threshold": rs_threshold(option)}
    assert "splits its turn in two" in guards.turn_loss_conflict(settings, plugin="loss_mode=sorl", where=LOSS_WHERE)
    assert "phantom strata" in guards.estimator_conflict(settings)


# --- stratified_grpo: weights compose, rejection only in bypass mode ------------------------------------------


def strata_batch():
    rows = [[1, 1, 0, 1, 1, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0], [1, 0, 1, 1, 0, 1, 1, 0], [1, 1, 0, 1, 0, 0, 0, 0]]
    mask = torch.tensor(rows, dtype=torch.float64)
    old = -torch.rand(mask.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    rollout = old - 0.7 * torch.randn(mask.shape, generator=torch.Generator().manual_seed(10), dtype=torch.float64)
    scores = torch.zeros_like(mask)
    scores[torch.arange(4), torch.tensor([4, 2, 6, 3])] = torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    return mask, old, rollout, scores


def advantages(mask, scores, rollout_correction):
    batch = DataProto.from_dict(
        tensors={"token_level_rewards": scores, "response_mask": mask},
        non_tensors={"uid": np.array(["g"] * 4, dtype=object)},
    )
    config = OmegaConf.create(
        {
            "adv_estimator": "stratified_grpo",
            "norm_adv_by_std_in_grpo": True,
            "stratified_grpo": {"alpha": 1.0},
            "rollout_correction": rollout_correction,
        }
    )
    return compute_advantage(batch, adv_estimator="stratified_grpo", config=config).batch["advantages"]


@pytest.mark.parametrize("rollout_is", ["token", "sequence"])
def test_rollout_is_weights_leave_the_strata_alone(rollout_is):
    mask, old, rollout, scores = strata_batch()
    settings = {"rollout_is": rollout_is, "rollout_is_threshold": 2.0, "rollout_rs": None, "bypass_mode": False}
    corrected = verl_correction(old, rollout, mask, **settings)
    assert torch.equal(corrected.batch["response_mask"], mask)
    assert search_counts(mask).tolist() == [1, 0, 2, 1]
    torch.testing.assert_close(
        advantages(corrected.batch["response_mask"], scores, settings), advantages(mask, scores, None)
    )
    StratifiedAlgoConfig(adv_estimator="stratified_grpo", rollout_correction=RolloutCorrectionConfig(**settings))


def test_bypass_mode_rejection_comes_after_the_estimator():
    """In bypass mode veRL skips the pre-advantage step (test above) and rejects inside its own loss: the
    estimator reads the intact mask, so any rollout_rs is accepted with stratified_grpo there."""
    mask, _, _, scores = strata_batch()
    for option in ("token_k1", "seq_mean_k3", "token_k2,seq_max_k2"):
        settings = {"bypass_mode": True, "rollout_rs": option, "rollout_rs_threshold": 2.0, "rollout_is": None}
        StratifiedAlgoConfig(adv_estimator="stratified_grpo", rollout_correction=RolloutCorrectionConfig(**settings))
        torch.testing.assert_close(advantages(mask, scores, settings), advantages(mask, scores, None))


# --- The one-line refusals -------------------------------------------------------------------------------------

TURN_TOKEN_RS = (
    "loss_mode=sorl cannot compose with actor_rollout_ref.actor.policy_loss.rollout_correction.rollout_rs="
    "'seq_mean_k1,token_k3': token_k3 zeroes single tokens of response_mask before the actor and the turn-level "
    "loss reads turns from that mask, so a rejected token splits its turn in two (two ratios, two clip "
    "decisions); fix: a whole-rollout mode (seq_sum_*, seq_mean_*, seq_max_*), or weight 0 instead of mask 0 "
    "with rollout_is=token and rollout_is_threshold='<lower>_<upper>' (IcePop)"
)
TURN_BYPASS = (
    "loss_mode=turn_ppo cannot compose with actor_rollout_ref.actor.policy_loss.rollout_correction.bypass_mode="
    "true: veRL's bypass mode swaps actor.policy_loss.loss_mode for its own 'bypass_mode' loss "
    "(rollout_corr_helper.apply_bypass_mode) and applies rollout_is / rollout_rs only inside it, so the "
    "turn-level loss is dropped or runs uncorrected; fix: set "
    "actor_rollout_ref.actor.policy_loss.rollout_correction.bypass_mode=false (decoupled: π_old recomputed, "
    "rollout_is weights and seq_* rollout_rs compose)"
)
ESTIMATOR_TOKEN_RS = (
    "stratified_grpo cannot compose with algorithm.rollout_correction.rollout_rs='token_k1': veRL rewrites "
    "response_mask before compute_advantage and the estimator reads each rollout's tool rounds from it; "
    "token_k1 zeroes single tokens, adding blocks of 0s that are no tool round (phantom strata); fix: set "
    "algorithm.rollout_correction.rollout_rs=null (rollout_is weights compose), or bypass_mode=true with a "
    "token-level actor loss (veRL then rejects inside its loss, after the advantage)"
)
ESTIMATOR_SEQ_RS = (
    "stratified_grpo cannot compose with algorithm.rollout_correction.rollout_rs='seq_sum_k1': veRL rewrites "
    "response_mask before compute_advantage and the estimator reads each rollout's tool rounds from it; a "
    "rejected rollout's all-0 mask puts it in stratum 0 while its reward still counts; fix: set "
    "algorithm.rollout_correction.rollout_rs=null (rollout_is weights compose), or bypass_mode=true with a "
    "token-level actor loss (veRL then rejects inside its loss, after the advantage)"
)


def test_refusal_lines_for_the_turn_level_losses():
    token_rs = RolloutCorrectionConfig(rollout_rs="seq_mean_k1,token_k3", rollout_rs_threshold=2.0)
    bypass = RolloutCorrectionConfig(bypass_mode=True)
    with pytest.raises(ValueError) as error:
        SORLPolicyLossConfig(loss_mode="sorl", rollout_correction=token_rs)
    assert str(error.value) == TURN_TOKEN_RS
    with pytest.raises(ValueError) as error:
        SORLPolicyLossConfig(loss_mode="turn_ppo", rollout_correction=bypass)
    assert str(error.value) == TURN_BYPASS
    for settings in (token_rs, bypass):  # veRL's own losses keep them
        SORLPolicyLossConfig(loss_mode="vanilla", rollout_correction=settings)
    # At run time too (a config built without the dataclass check), through veRL's registry.
    mask = multi_token_turns_mask()
    old, log_prob, adv = inputs(mask)
    config = actor_config()
    object.__setattr__(config.policy_loss, "rollout_correction", bypass)
    with pytest.raises(ValueError) as error:
        core_algos.get_policy_loss_fn("turn_ppo")(old, log_prob, adv, mask, "token-mean", config)
    assert str(error.value) == TURN_BYPASS


def test_refusal_lines_for_the_estimator():
    mask, _, _, scores = strata_batch()
    with pytest.raises(ValueError) as error:
        advantages(mask, scores, {"rollout_rs": "token_k1", "rollout_rs_threshold": 2.0, "bypass_mode": False})
    assert str(error.value) == ESTIMATOR_TOKEN_RS
    with pytest.raises(ValueError) as error:
        StratifiedAlgoConfig(
            adv_estimator="stratified_grpo",
            rollout_correction=RolloutCorrectionConfig(rollout_rs="seq_sum_k1", rollout_rs_threshold=2.0),
        )
    assert str(error.value) == ESTIMATOR_SEQ_RS
    StratifiedAlgoConfig(adv_estimator="grpo", rollout_correction=RolloutCorrectionConfig(rollout_rs="token_k1"))


def test_every_refusal_is_one_line_and_names_a_fix():
    lines = [
        guards.turn_loss_conflict({"rollout_rs": "token_k2"}, plugin="loss_mode=turn_ppo", where=LOSS_WHERE),
        guards.turn_loss_conflict({"rollout_rs": "no_such_mode"}, plugin="loss_mode=sorl", where=LOSS_WHERE),
        guards.estimator_conflict({"rollout_rs": "seq_max_k3"}),
        guards.estimator_conflict({"rollout_rs": "token_k3", "bypass_mode": False}),
    ]
    for line in lines:
        assert line and "\n" not in line and "cannot compose with" in line and "; fix: " in line
    assert guards.turn_loss_conflict({"rollout_rs": None, "rollout_is": "token"}, plugin="p", where="w") is None
    assert guards.estimator_conflict({"rollout_rs": "null", "rollout_is": "sequence"}) is None


# --- The names: veRL's settings and stratarl's algo.behaviour_correction ----------------------------------------


def test_verl_settings_that_are_stratarl_s_corrections():
    """docs/verl.md, "Rollout correction": the settings that compute stratarl's tis / mis / decoupled."""
    mask = multi_token_turns_mask()
    old, _, _ = inputs(mask)
    old = old.double()
    rollout = old - 1.2 * torch.randn(mask.shape, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    rho = old - rollout

    def verl_weights(**settings):
        return verl_correction(old, rollout, mask, **settings).batch["rollout_is_weights"]

    def verl_keep(option):
        return (
            verl_correction(old, rollout, mask, rollout_rs=option, rollout_rs_threshold=2.0)
            .batch["response_mask"]
            .bool()
        )

    # tis (token, C): rollout_is=token, rollout_is_threshold=C.
    torch.testing.assert_close(
        verl_weights(rollout_is="token", rollout_is_threshold=2.0), tis_weights(old, rollout, mask, cap=2.0).weights
    )
    # decoupled (cap C): rollout_is=token with IcePop bounds [≈0, C] (veRL clamps log-ratios at ±20: 1e-9 keeps all).
    torch.testing.assert_close(
        verl_weights(rollout_is="token", rollout_is_threshold="1e-9_5.0"),
        decoupled_weights(old, rollout, mask, cap=5.0).weights,
    )
    # mis (token / sequence, C): token_k1 / seq_mean_k1 keep exactly what mis keeps (as masks, not weights).
    assert torch.equal(verl_keep("token_k1"), mis_weights(old, rollout, mask, cap=2.0).weights.bool())
    sequence_mis = mis_weights(old, rollout, mask, cap=2.0, level="sequence").weights
    assert torch.equal(verl_keep("seq_mean_k1"), sequence_mis.bool())
    # veRL's sequence TIS is the product of the token ratios, not stratarl's geometric mean.
    seq = verl_weights(rollout_is="sequence", rollout_is_threshold=1e6)
    product = torch.exp((rho * mask).sum(dim=1, keepdim=True)).clamp(max=1e6) * mask
    torch.testing.assert_close(seq, product)
