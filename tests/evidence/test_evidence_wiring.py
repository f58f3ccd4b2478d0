"""algo.normalizer (and its older spelling algo.sorl_normalize) and algo.stratum_key=random wiring, per-type EM,
stratum metrics of a step."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch

from stratarl.data.examples import Example
from stratarl.evaluation.greedy import aggregate, eval_metrics
from stratarl.rollout.collect import Scoring
from stratarl.trainer.batch import collate_sequences
from stratarl.trainer.config import ConfigError, load_config
from stratarl.trainer.learner import build_learner
from stratarl.trainer.settings import StepSettings, UpdateSettings
from stratarl.trainer.step import advantage_strata, em_by_type, stratum_metrics
from stratarl.trainer.update import accumulate_gradients, score_batch


def _cfg(*overrides):
    return load_config(
        None,
        [
            "model.name=tiny-random",
            "algo.kl_coef=0.0",
            "trainer.logprob_chunk_tokens=7",
            "algo.sorl_delta=1e-6",
            *overrides,
        ],
    )


def _clipped_batch(learner, cfg, seed=0, rows=6):
    """A batch whose old log-probs sit 2 nats below the current ones: every ratio e^2 is clipped."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 500, (4,), generator=g).tolist() for _ in range(rows)]
    responses = [torch.randint(3, 500, (8,), generator=g).tolist() for _ in range(rows)]
    masks = [[1, 1, 1, 0, 0, 1, 1, 1] for _ in range(rows)]  # two turns around an observation
    tokens = collate_sequences(prompts, responses, masks, pad_id=0)
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0, 1.5, 0.7])[:rows][:, None] * tokens.response_mask
    batch = score_batch(learner, tokens, UpdateSettings.from_config(cfg)).with_advantages(adv, adv.clone())
    return dataclasses.replace(batch, old_logprobs=batch.old_logprobs - 2.0 * batch.response_mask)


@pytest.mark.parametrize(
    "name, flag, expected",
    [
        ("grpo", None, False),
        ("ppo", None, False),
        ("so_grpo", None, True),
        ("so_ppo", None, True),
        ("grpo", True, True),
        ("so_grpo", False, False),
    ],
)
def test_sorl_normalize_defaults_and_overrides(name, flag, expected):
    overrides = [f"algo.name={name}"] + ([f"algo.sorl_normalize={str(flag).lower()}"] if flag is not None else [])
    assert _cfg(*overrides).algorithm.uses_normalizer is expected
    named = [f"algo.name={name}"] + ([f"algo.normalizer={'sorl' if flag else 'none'}"] if flag is not None else [])
    assert _cfg(*named).algorithm == _cfg(*overrides).algorithm  # the older spelling is read as the new one


def test_sorl_normalize_rejects_non_bool():
    with pytest.raises(ConfigError, match="algo.sorl_normalize"):
        _cfg("algo.sorl_normalize=maybe")


def test_normalisation_only_arm_scales_a_clipped_step(tiny_model):
    cfg = _cfg("algo.name=grpo", "algo.sorl_normalize=true")
    learner = build_learner(copy.deepcopy(tiny_model), cfg, total_optimizer_steps=1)
    assert learner.normalizer is not None and cfg.algorithm.ratio_level == "token"
    metrics = accumulate_gradients(learner, _clipped_batch(learner, cfg), UpdateSettings.from_config(cfg))
    assert metrics["loss/clip_frac"] > 0 and "loss/clip_frac_turn" not in metrics  # token-level ratio
    out = learner.normalizer.apply()
    assert float(out["sorl/c_norm"]) > 0
    assert float(out["sorl/scale"]) != 1.0
    torch.testing.assert_close(out["sorl/scale"], 1.0 / out["sorl/c_norm"])


def test_turn_ratio_only_arm_leaves_a_clipped_step_unscaled(tiny_model):
    cfg_turn_only = _cfg("algo.name=so_grpo", "algo.sorl_normalize=false")
    cfg_so = _cfg("algo.name=so_grpo")
    grads = []
    for cfg in (cfg_turn_only, cfg_so):
        model = copy.deepcopy(tiny_model)
        learner = build_learner(model, cfg, total_optimizer_steps=1)
        metrics = accumulate_gradients(learner, _clipped_batch(learner, cfg), UpdateSettings.from_config(cfg))
        assert metrics["loss/clip_frac_turn"] > 0  # turn-level ratio in both
        if cfg is cfg_turn_only:
            assert learner.normalizer is None  # nothing rescales .grad: scale 1
        else:
            scale = float(learner.normalizer.apply()["sorl/scale"])
            assert scale < 1.0
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    # The normalised step is exactly the turn-ratio-only gradient times SO-GRPO's scale.
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a * scale)


def test_random_stratum_key_is_valid_and_typos_get_a_hint():
    assert _cfg("algo.stratum_key=random").algo.stratum_key == "random"
    with pytest.raises(ConfigError, match="did you mean 'random'"):
        _cfg("algo.stratum_key=randon")


def test_random_strata_collect_the_search_counts_and_permute_per_step():
    from stratarl.rollout.engine import Rollout

    cfg = _cfg("algo.stratum_key=random", "trainer.seed=3")
    searched_twice = Rollout(prompt_ids=[1], response_ids=[5] * 3, response_mask=[1, 0, 1], num_searches=2)
    # Random strata collect the observed search counts; the trainer permutes them afterwards.
    assert Scoring.from_names(stratum_key="random").stratum(searched_twice) == 2
    assert cfg.algo.stratum_key == "random"
    plain = _cfg()
    observed = [0, 0, 1, 2, 2, 2, 0, 1, 1, 1, 3, 0]
    groups = [0] * 6 + [1] * 6
    first, again, later = (advantage_strata(StepSettings.from_config(cfg), observed, groups, s) for s in (0, 0, 1))
    assert first == again and first != later and first != observed
    for g in (0, 1):
        assert sorted(first[g * 6 : (g + 1) * 6]) == sorted(observed[g * 6 : (g + 1) * 6])
    assert advantage_strata(StepSettings.from_config(plain), observed, groups, 0) == observed


class _Collected:
    def __init__(self, rewards, group_ids, strata):
        self.rewards, self.group_ids, self.strata = rewards, group_ids, strata


def test_stratum_metrics_of_a_step():
    collected = _Collected([1.0, 1.0, 0.0, 0.0], [0, 0, 0, 0], [1, 1, 0, 0])
    m = stratum_metrics(StepSettings.from_config(_cfg()), collected, collected.strata)
    assert m == {
        "stratum/cross_var": pytest.approx(0.25),
        "stratum/zero_san_frac": 1.0,
        "stratum/live_groups_frac": 0.0,
    }
    m = stratum_metrics(StepSettings.from_config(_cfg("algo.stratum_key=random")), collected, [1, 0, 1, 0])
    assert m["stratum/cross_var"] == pytest.approx(0.0) and m["stratum/cross_var_observed"] == pytest.approx(0.25)
    # live strata are read on the observed strata whatever the advantage used: two live strata in one group
    live = _Collected([1.0, 0.0, 1.0, 0.0, 1.0, 1.0], [0] * 6, [1, 1, 2, 2, 3, 3])
    assert stratum_metrics(StepSettings.from_config(_cfg()), live, live.strata)["stratum/live_groups_frac"] == 1.0
    shuffled = stratum_metrics(
        StepSettings.from_config(_cfg("algo.stratum_key=random")), live, [1, 2, 1, 2, 3, 3]
    )  # 0 live if used
    assert shuffled["stratum/live_groups_frac"] == 1.0


def _example(i, question_type):
    return Example(
        id=str(i),
        question="q",
        golden_answers=("a",),
        metadata={"question_type": question_type} if question_type else {},
    )


def test_em_by_type():
    examples = [_example(0, "single_hop"), _example(1, "multi_hop_2"), _example(2, "multi_hop_2"), _example(3, None)]
    assert em_by_type(examples, [1.0, 0.0, 1.0, 1.0]) == {
        "reward/em_by_type/multi_hop_2": 0.5,
        "reward/em_by_type/single_hop": 1.0,
    }
    assert em_by_type([_example(0, None)], [1.0]) == {}


def test_eval_metrics_include_question_types():
    scores = [
        {"em": 1.0, "subem": 1.0, "f1": 1.0, "searches": 1.0, "answered": 1.0},
        {"em": 0.0, "subem": 0.0, "f1": 0.0, "searches": 3.0, "answered": 0.0},
    ]
    per_type = aggregate(scores, ["single_hop", "multi_hop_2"], with_all=False)
    assert set(per_type) == {"single_hop", "multi_hop_2"}
    result = {"per_source": aggregate(scores, ["kb", "kb"]), "per_type": per_type}
    m = eval_metrics(result)
    assert m["eval/type/single_hop/em"] == 1.0 and m["eval/type/multi_hop_2/searches_mean"] == 3.0
    assert m["eval/kb/em"] == 0.5


# --------------------------------------------------------------------------- Paper B controls


def test_sorl_scale_hand_derived_cases():
    from stratarl.algos import sorl_scale

    t = torch.tensor
    # fixed (the paper's formula): 1 / max(||C||, delta)
    assert float(sorl_scale(t(0.5), delta=1.0)[0]) == 1.0
    assert float(sorl_scale(t(2.0), delta=1.0)[0]) == 0.5
    assert float(sorl_scale(t(0.5), delta=0.1)[0]) == 2.0  # above the floor: 1 / ||C||
    # running_pg: delta_t = delta * m; factor = min(1, delta_t / ||C||)
    scale, floor = sorl_scale(t(0.5), delta=2.0, rule="running_pg", pg_norm_ema=0.5)
    assert float(floor) == 1.0 and float(scale) == 1.0
    scale, floor = sorl_scale(t(4.0), delta=2.0, rule="running_pg", pg_norm_ema=0.5)
    assert float(scale) == 0.25
    assert float(sorl_scale(t(3.0), delta=1.0, rule="running_pg", pg_norm_ema=0.0)[0]) == 1.0  # zero gradient
    with pytest.raises(ValueError, match="pg_norm_ema"):
        sorl_scale(t(1.0), delta=1.0, rule="running_pg")
    with pytest.raises(ValueError, match="unknown delta rule"):
        sorl_scale(t(1.0), delta=1.0, rule="nope")


@pytest.mark.parametrize("k", [1e-3, 7.0, 1e4])
def test_running_pg_rule_is_scale_free(k):
    """Multiplying the loss (so C and the policy gradient) by k leaves the running_pg factor unchanged;
    the fixed rule's factor changes (that is what makes delta = 1 a size-dependent threshold)."""
    from stratarl.algos import sorl_scale

    c, m = torch.tensor(0.8), 0.3
    base = float(sorl_scale(c, delta=1.5, rule="running_pg", pg_norm_ema=m)[0])
    assert base < 1.0
    assert math.isclose(
        float(sorl_scale(c * k, delta=1.5, rule="running_pg", pg_norm_ema=m * k)[0]), base, rel_tol=1e-6
    )
    assert float(sorl_scale(c * k, delta=0.5)[0]) != float(sorl_scale(c, delta=0.5)[0])


def test_running_pg_statistic_starts_at_the_first_norm_and_resumes_from_a_checkpoint(tiny_model):
    cfg = _cfg("algo.name=so_grpo", "algo.sorl_delta=0.5", "algo.sorl_delta_rule=running_pg", "algo.sorl_delta_ema=0.8")
    learner = build_learner(copy.deepcopy(tiny_model), cfg, total_optimizer_steps=2)
    assert learner.normalizer.rule == "running_pg" and learner.normalizer.ema == 0.8
    batch = _clipped_batch(learner, cfg)
    accumulate_gradients(learner, batch, UpdateSettings.from_config(cfg))
    first = {k: float(v) for k, v in learner.normalizer.apply().items()}
    assert math.isclose(first["sorl/delta"], 0.5 * first["sorl/pg_grad_norm"], rel_tol=1e-6)
    assert first["sorl/engaged"] == float(first["sorl/c_norm"] > first["sorl/delta"])
    saved = copy.deepcopy(learner.normalizer.state_dict())
    assert math.isclose(saved["pg_norm_ema"], first["sorl/pg_grad_norm"], rel_tol=1e-6)  # 0.8 m + 0.2 m = m
    for p in learner.model.parameters():
        p.grad = None
    accumulate_gradients(learner, batch, UpdateSettings.from_config(cfg))
    second = float(learner.normalizer.apply()["sorl/scale"])
    restored = build_learner(copy.deepcopy(tiny_model), cfg, total_optimizer_steps=2)
    restored.normalizer.load_state_dict(saved)
    accumulate_gradients(restored, batch, UpdateSettings.from_config(cfg))
    assert float(restored.normalizer.apply()["sorl/scale"]) == second


def _sgd_step_delta(tiny_model, *overrides):
    """One real optimizer_step with SGD at lr 1: the parameter change is minus the gradient that reached the
    optimizer, so the order of SORL's factor and clipping shows directly."""
    from stratarl.trainer.update import optimizer_step

    cfg = _cfg("optim.name=sgd", "optim.lr=1.0", "optim.grad_clip=1e-4", *overrides)
    model = copy.deepcopy(tiny_model)
    learner = build_learner(model, cfg, total_optimizer_steps=1)
    assert isinstance(learner.optimizer, torch.optim.SGD)
    before = [p.detach().clone() for p in model.parameters()]
    metrics = optimizer_step(learner, _clipped_batch(learner, cfg), UpdateSettings.from_config(cfg))
    return [p.detach() - b for p, b in zip(model.parameters(), before)], metrics


def test_sorl_order_before_clip_is_undone_by_tight_clipping_and_after_clip_is_not(tiny_model):
    plain, _ = _sgd_step_delta(tiny_model, "algo.name=grpo")
    before, m_before = _sgd_step_delta(tiny_model, "algo.name=grpo", "algo.sorl_normalize=true")
    after, m_after = _sgd_step_delta(
        tiny_model, "algo.name=grpo", "algo.sorl_normalize=true", "algo.sorl_order=after_clip"
    )
    scale = m_after["sorl/scale"]
    assert scale < 0.5 and m_before["sorl/scale"] == scale  # the factor is the same; only where it acts differs
    for p, b, a in zip(plain, before, after):
        torch.testing.assert_close(b, p)  # clipping to 1e-4 rescales away the factor
        torch.testing.assert_close(a, p * scale)  # after clipping, the factor reaches the step


def test_optimizer_choice_is_validated():
    with pytest.raises(ConfigError, match="optim.name"):
        _cfg("optim.name=adam")
    with pytest.raises(ConfigError, match="algo.sorl_order"):
        _cfg("algo.sorl_order=later")
    with pytest.raises(ConfigError, match="algo.sorl_delta_rule"):
        _cfg("algo.sorl_delta_rule=relative")
    with pytest.raises(ConfigError, match="optim.momentum"):
        _cfg("optim.momentum=1.0")
