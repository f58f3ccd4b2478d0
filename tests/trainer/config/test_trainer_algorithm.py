"""An algorithm is one value: presets expand into registered parts, parameters are checked against the parts'
signatures, the legacy knobs keep their meaning, and cross-part / cross-section mistakes are refused at load."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest
import torch

import stratarl.algos.registry as registry
from stratarl.algos import AdvantageBatch, broadcast_to_tokens, register_advantage
from stratarl.algos.presets import PRESETS, AlgorithmSpec, get_preset
from stratarl.trainer.config import ConfigError, load_config
from stratarl.trainer.config.resolve import KNOBS, describe

TINY = Path(__file__).resolve().parents[3] / "configs" / "tiny.yaml"


def _spec(*overrides: str) -> AlgorithmSpec:
    return load_config(None, list(overrides)).algorithm


# The parts each preset stood for before presets were a table (trainer/config.py's tuples, rl.py's
# ADVANTAGE_OF, update.py's loss choice), written out by hand. SO-PPO / SO-GRPO named a `sorl` policy loss,
# which was the `ppo` surrogate under another name (its ratio level always came from the turn level): the
# alias is gone, the surrogate and its level are the same.
BEFORE = {
    "grpo": ("grpo", {"eps": 1e-6}, "ppo", "token", "none", "none"),
    "stratified_grpo": ("stratified", {"alpha": 0.6, "eps": 1e-6}, "ppo", "token", "none", "none"),
    "ppo": ("gae", {"gamma": 1.0, "lam": 1.0}, "ppo", "token", "none", "value_head"),
    "so_ppo": ("gae", {"gamma": 1.0, "lam": 1.0}, "ppo", "turn", "sorl", "value_head"),
    "so_grpo": ("grpo", {"eps": 1e-6}, "ppo", "turn", "sorl", "none"),
}


@pytest.mark.parametrize("name", list(BEFORE))
def test_each_preset_expands_into_the_parts_it_always_had(name):
    spec = _spec(f"algo.name={name}")
    advantage, params, loss, level, normalizer, critic = BEFORE[name]
    assert (spec.advantage, dict(spec.advantage_params), spec.policy_loss) == (advantage, params, loss)
    assert (spec.ratio_level, spec.normalizer, spec.critic) == (level, normalizer, critic)
    assert dict(spec.policy_loss_params) == {"level": level, "clip_low": 0.2, "clip_high": 0.2, "agg": "token-mean"}
    expected_norm = {"delta": 1.0, "rule": "fixed", "ema": 0.9} if normalizer == "sorl" else {}
    assert dict(spec.normalizer_params) == expected_norm


def test_drgrpo_and_gspo_are_presets_of_existing_parts():
    assert (_spec("algo.name=drgrpo").advantage, _spec("algo.name=drgrpo").ratio_level) == ("drgrpo", "token")
    gspo = _spec("algo.name=gspo")
    assert (gspo.advantage, gspo.policy_loss, gspo.ratio_level) == ("grpo", "ppo", "sequence")


def test_every_preset_names_registered_parts_and_no_knob_parameter():
    knob_keywords = {kw for pairs in KNOBS.values() for _, kw in pairs}
    for name, preset in PRESETS.items():
        assert preset.advantage in registry.advantage_names(), name
        assert preset.policy_loss in registry.policy_loss_names(), name
        assert preset.normalizer == "none" or preset.normalizer in registry.grad_normalizer_names(), name
        for params in (preset.advantage_params, preset.policy_loss_params, preset.normalizer_params):
            assert not set(params) & knob_keywords, f"{name}: a preset parameter would hide a shared knob"
    with pytest.raises(KeyError, match="unknown algorithm 'rloo'; presets: grpo, stratified_grpo"):
        get_preset("rloo")


def test_presets_are_immutable_values():
    with pytest.raises(TypeError):
        PRESETS["grpo"] = PRESETS["ppo"]  # type: ignore[index]
    with pytest.raises(TypeError):
        PRESETS["so_ppo"].normalizer_params["delta"] = 2.0  # type: ignore[index]


# --------------------------------------------------------------------------- knobs and parameters


def test_shared_knobs_reach_exactly_the_parts_that_take_them():
    spec = _spec(
        "algo.name=stratified_grpo",
        "algo.alpha=0.25",
        "algo.epsilon=0.01",
        "algo.gamma=0.5",
        "algo.clip_high=0.28",
        "algo.sorl_delta=3.0",
    )
    assert dict(spec.advantage_params) == {"alpha": 0.25, "eps": 0.01}  # gamma is GAE's, not Stratified GRPO's
    assert spec.policy_loss_params["clip_high"] == 0.28
    assert spec.normalizer_params == {}  # no normaliser: delta goes nowhere
    spec = _spec(
        "algo.name=so_ppo",
        "algo.gamma=0.5",
        "algo.lam=0.9",
        "algo.alpha=0.1",
        "algo.sorl_delta=3.0",
        "algo.sorl_delta_rule=running_pg",
    )
    assert dict(spec.advantage_params) == {"gamma": 0.5, "lam": 0.9}
    assert dict(spec.normalizer_params) == {"delta": 3.0, "rule": "running_pg", "ema": 0.9}


def test_explicit_parameters_reach_the_part_and_a_knobs_keyword_is_read_as_the_knob():
    spec = _spec(
        "algo.name=grpo", "algo.advantage_params={std_ddof: 0, eps: 0.5}", "algo.policy_loss_params.dual_clip=3.0"
    )
    assert dict(spec.advantage_params) == {"eps": 0.5, "std_ddof": 0}
    assert spec.policy_loss_params["dual_clip"] == 3.0
    cfg = load_config(None, ["algo.name=so_grpo", "algo.normalizer_params.delta=3"])
    assert cfg.algo.sorl_delta == 3.0 and cfg.algo.normalizer_params == {}  # one home: algo.sorl_delta
    assert cfg.algorithm == _spec("algo.name=so_grpo", "algo.sorl_delta=3")
    # Two spellings of one parameter with different values: refused, naming both.
    with pytest.raises(ConfigError, match=r"`algo.sorl_delta` = 2.*contradicts `algo.normalizer_params.delta`"):
        _spec("algo.name=so_grpo", "algo.sorl_delta=2", "algo.normalizer_params.delta=3")
    with pytest.raises(ConfigError, match=r"`algo.alpha` = 0.3.*contradicts `algo.advantage_params.alpha`"):
        _spec("algo.name=stratified_grpo", "algo.alpha=0.3", "algo.advantage_params.alpha=0.5")


def test_unknown_parameter_lists_the_valid_ones():
    with pytest.raises(ConfigError) as info:
        _spec("algo.name=grpo", "algo.advantage_params.alpah=0.3")
    msg = str(info.value)
    assert "`algo.advantage_params.alpah`" in msg and "advantage 'grpo' has no parameter `alpah`" in msg
    assert "valid parameters: eps, std_ddof, scale_by_std" in msg
    with pytest.raises(
        ConfigError, match=r"did you mean 'dual_clip'\? valid parameters: clip_low, clip_high, dual_clip\.$"
    ):
        _spec("algo.policy_loss_params.dual_clp=3")
    with pytest.raises(ConfigError, match="valid parameters: delta, rule, ema"):
        _spec("algo.name=so_grpo", "algo.normalizer_params.beta=1")


def test_parameters_the_trainer_owns_point_to_their_field():
    with pytest.raises(ConfigError, match=r"`algo.policy_loss_params.level`.*set algo.ratio_level instead"):
        _spec("algo.policy_loss_params.level=turn")
    with pytest.raises(ConfigError, match=r"set algo.loss_agg instead"):
        _spec("algo.policy_loss_params.agg=seq-mean-token-mean")
    with pytest.raises(
        ConfigError, match=r"`algo.policy_loss_params.norm_length`.*set rollout.max_total_tokens instead"
    ):
        _spec("algo.policy_loss_params.norm_length=100")
    with pytest.raises(ConfigError, match=r"`algo.normalizer_params`.*no gradient normaliser is in use"):
        _spec("algo.name=grpo", "algo.normalizer_params.beta=2")


def test_legacy_switches_and_named_parts_agree_or_are_refused():
    assert _spec("algo.name=grpo", "algo.turn_level_ratio=true").ratio_level == "turn"
    assert _spec("algo.name=so_grpo", "algo.turn_level_ratio=false").ratio_level == "token"
    assert _spec("algo.name=grpo", "algo.sorl_normalize=true").normalizer == "sorl"
    assert _spec("algo.name=so_ppo", "algo.sorl_normalize=false").normalizer == "none"
    assert _spec("algo.name=grpo", "algo.ratio_level=sequence").ratio_level == "sequence"
    assert _spec("algo.name=so_grpo", "algo.normalizer=none").normalizer == "none"
    assert _spec("algo.name=grpo", "algo.ratio_level=turn", "algo.turn_level_ratio=true").ratio_level == "turn"
    with pytest.raises(ConfigError, match="`algo.ratio_level` = 'sequence': contradicts `algo.turn_level_ratio`"):
        _spec("algo.ratio_level=sequence", "algo.turn_level_ratio=true")
    with pytest.raises(ConfigError, match="`algo.normalizer` = 'none': contradicts `algo.sorl_normalize`"):
        _spec("algo.normalizer=none", "algo.sorl_normalize=true")


def test_unknown_parts_are_refused_with_the_registered_names():
    with pytest.raises(ConfigError) as info:
        _spec("algo.advantage=rloo")
    msg = str(info.value)
    assert "`algo.advantage` = 'rloo': no advantage estimator of that name is registered" in msg
    assert "use one of drgrpo, gae, gigpo, grpo, grpo_positive, reinforce, stratified" in msg and "--import" in msg
    with pytest.raises(ConfigError, match="did you mean 'ppo'"):
        _spec("algo.policy_loss=ppp")
    with pytest.raises(
        ConfigError,
        match=r"`algo.ratio_level` = 'turns': not an allowed value. Fix: did you mean 'turn'\? use one of token, turn",
    ):
        _spec("algo.ratio_level=turns")
    with pytest.raises(ConfigError, match="`algo.critic` = 'mlp': unknown critic"):
        _spec("algo.critic=mlp")
    with pytest.raises(
        ConfigError, match="`algo.name` = 'stratified': unknown algorithm. Fix: did you mean 'stratified_grpo'"
    ):
        _spec("algo.name=stratified")


def test_an_estimator_that_reads_values_needs_a_critic():
    with pytest.raises(
        ConfigError, match="`algo.critic` = 'none': advantage estimator 'gae' reads the critic's values"
    ):
        _spec("algo.name=grpo", "algo.advantage=gae")
    assert _spec("algo.name=grpo", "algo.advantage=gae", "algo.critic=value_head").uses_critic
    assert not _spec("algo.name=ppo", "algo.advantage=grpo", "algo.critic=none").uses_critic


@pytest.fixture
def registered(monkeypatch):
    """Register test parts for one test only (the registries are module-level dicts)."""

    def add(table: str, name: str, fn, info=None):
        monkeypatch.setitem(getattr(registry, table), name, fn)
        if info is not None:
            monkeypatch.setitem(registry._ADVANTAGE_INFO, name, info)

    return add


def test_a_registered_estimator_is_checked_against_its_own_signature(registered):
    def mine(batch, *, eps, temperature: float = 2.0):
        return batch.rewards, batch.rewards

    registered("_ADVANTAGES", "mine", mine)
    # The knob fills the keyword it names; the function keeps its own default for the rest.
    assert dict(_spec("algo.advantage=mine", "algo.epsilon=0.1").advantage_params) == {"eps": 0.1}
    with pytest.raises(ConfigError, match="valid parameters: eps, temperature"):
        _spec("algo.advantage=mine", "algo.advantage_params.alpha=1")

    def needs_scale(batch, *, scale):
        return batch.rewards, batch.rewards

    registered("_ADVANTAGES", "needs_scale", needs_scale)
    with pytest.raises(ConfigError, match=r"advantage 'needs_scale' needs `scale`.*algo.advantage_params.scale="):
        _spec("algo.advantage=needs_scale")
    assert _spec("algo.advantage=needs_scale", "algo.advantage_params.scale=3").advantage_params["scale"] == 3


def test_a_policy_loss_without_a_level_keyword_takes_token_ratios_only(registered):
    def token_only(log_probs, old_log_probs, advantages, response_mask, *, clip_low: float = 0.2):
        raise AssertionError("not called at load time")

    registered("_POLICY_LOSSES", "token_only", token_only)
    spec = _spec("algo.name=grpo", "algo.policy_loss=token_only", "algo.clip_low=0.1")
    assert dict(spec.policy_loss_params) == {"clip_low": 0.1}  # no level, no clip_high, no agg: it takes none
    with pytest.raises(ConfigError, match="policy loss 'token_only' takes no `level` keyword"):
        _spec("algo.name=so_grpo", "algo.policy_loss=token_only", "algo.normalizer=none")


def test_keyword_params_lists_keywords_with_defaults_and_required_ones():
    def fn(a, b=1, *, c, d=None, **rest):
        return a

    assert registry.keyword_params(fn) == {"b": 1, "c": inspect.Parameter.empty, "d": None}
    assert list(registry.keyword_params(registry.get_policy_loss("ppo"))) == [
        "level",
        "clip_low",
        "clip_high",
        "dual_clip",
        "agg",
        "norm_length",
        "token_weights",
    ]


def test_describe_names_every_part():
    line = describe("so_ppo", _spec("algo.name=so_ppo"))
    assert line.startswith("so_ppo: advantage gae (gamma=1.0, lam=1.0), policy loss ppo (")
    assert (
        "ratio turn" in line
        and "normaliser sorl (delta=1.0, rule=fixed, ema=0.9)" in line
        and "critic value_head" in line
    )


# --------------------------------------------------------------------------- across sections


def test_more_mini_batches_than_rollouts_is_refused_at_load():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["trainer.prompts_per_step=2", "rollout.group_size=3", "trainer.mini_batches=7"])
    msg = str(info.value)
    assert "`trainer.mini_batches` = 7" in msg and "2 x 3 = 6 rollouts" in msg and "trainer.mini_batches <= 6" in msg
    load_config(None, ["trainer.prompts_per_step=2", "rollout.group_size=3", "trainer.mini_batches=6"])


@pytest.mark.parametrize("name", ["grpo", "stratified_grpo", "so_grpo", "drgrpo", "gspo"])
def test_group_of_one_with_a_group_relative_estimator_is_refused(name):
    with pytest.raises(ConfigError, match=r"`rollout.group_size` = 1: advantage estimator .* compares the rollouts"):
        load_config(None, [f"algo.name={name}", "rollout.group_size=1"])


def test_group_of_one_is_fine_with_a_critic():
    assert load_config(None, ["algo.name=ppo", "rollout.group_size=1"]).algorithm.uses_critic


# --------------------------------------------------------------------------- the part reaches the trainer


def test_the_trainer_calls_the_estimator_the_config_names_with_its_parameters(registered):
    """The run's estimator is the registered one the spec names, with the resolved parameters bound."""
    from stratarl.trainer.batch import ScoredBatch, collate_sequences
    from stratarl.trainer.config.resolve import bound_advantage
    from stratarl.trainer.step import advantage_inputs, compute_advantages

    seen = {}

    def scaled(batch: AdvantageBatch, *, eps: float = 0.0, scale: float = 1.0):
        seen.update(eps=eps, scale=scale)
        adv = broadcast_to_tokens(batch.rewards * scale, batch.response_mask)
        return adv, adv

    registered("_ADVANTAGES", "scaled", scaled)
    cfg = load_config(None, ["algo.advantage=scaled", "algo.advantage_params.scale=3.0", "algo.epsilon=0.5"])
    tokens = collate_sequences([[5, 6], [7]], [[1, 2, 3], [4, 5]], [[1, 0, 1], [1, 1]], pad_id=0)
    scored = ScoredBatch(
        **vars(tokens),
        old_logprobs=torch.zeros_like(tokens.response_mask),
        on_policy=False,
        ref_logprobs=None,
        old_values=None,
    )
    batch = compute_advantages(
        bound_advantage(cfg.algorithm), scored, advantage_inputs(scored, [1.0, -2.0], [0, 0], [0, 0])
    )
    assert seen == {"eps": 0.5, "scale": 3.0}
    torch.testing.assert_close(batch.advantages, torch.tensor([[3.0, 0.0, 3.0], [-6.0, -6.0, 0.0]]))


def test_register_advantage_records_what_the_checks_need():
    assert registry.advantage_info("gae").needs_values and not registry.advantage_info("gae").group_relative
    assert registry.advantage_info("stratified").group_relative
    with pytest.raises(KeyError, match="unknown advantage estimator"):
        registry.advantage_info("nope")

    @register_advantage("_test_info_only", needs_values=True)
    def _fn(batch):
        return batch.rewards, batch.rewards

    try:
        assert registry.advantage_info("_test_info_only").needs_values
    finally:
        del registry._ADVANTAGES["_test_info_only"], registry._ADVANTAGE_INFO["_test_info_only"]


# --------------------------------------------------------------------------- real steps of the new presets


def _real_step(tmp_path, tiny_overrides, *overrides, record=None):
    """One real RL step of the tiny config. ``record``: a dict that gets every policy-loss call's keyword
    arguments (``loss_calls``), the collected rollouts (``collected``) and the batch the update received
    (``batch``), by injection into the run."""
    from stratarl.trainer.run import build_run
    from stratarl.trainer.step import rl_step

    cfg = load_config(TINY, [*tiny_overrides, "trainer.prompts_per_step=4", "rollout.group_size=4", *overrides])
    run = build_run(cfg, tmp_path / "run")
    if record is not None:
        real_loss, real_update, real_collect = run.learner.policy_loss, run.parts.update, run.parts.collect

        def collect(*args, **kwargs):
            record["collected"] = real_collect(*args, **kwargs)
            return record["collected"]

        def policy_loss(*args, **kwargs):
            record.setdefault("loss_calls", []).append((cfg.algorithm.policy_loss, dict(kwargs)))
            return real_loss(*args, **kwargs)

        def update(learner, batch, *args, **kwargs):
            record["batch"] = batch
            return real_update(learner, batch, *args, **kwargs)

        run.learner.policy_loss = policy_loss
        run.parts = dataclasses.replace(run.parts, collect=collect, update=update)
    try:
        return run, rl_step(run)
    finally:
        run.logger.close()


@pytest.mark.slow
def test_gspo_and_dual_clip_reach_the_real_update(tmp_path, tiny_overrides):
    record = {}
    _, metrics = _real_step(
        tmp_path,
        tiny_overrides,
        "algo.name=gspo",
        "algo.policy_loss_params.dual_clip=1.5",
        "algo.clip_low=0.05",
        record=record,
    )
    loss_kwargs = record["loss_calls"]
    assert loss_kwargs and {name for name, _ in loss_kwargs} == {"ppo"}
    for _, kwargs in loss_kwargs:
        assert kwargs == {
            "level": "sequence",
            "clip_low": 0.05,
            "clip_high": 0.2,
            "agg": "token-mean",
            "dual_clip": 1.5,
        }
    assert "loss/clip_frac_turn" not in metrics


@pytest.mark.slow
def test_drgrpo_updates_with_mean_only_advantages(tmp_path, tiny_overrides):
    from stratarl.algos import grpo_advantages

    record = {}
    _real_step(tmp_path, tiny_overrides, "algo.name=drgrpo", record=record)
    batch, collected = record["batch"], record["collected"]
    rewards, groups = torch.tensor(collected.rewards), torch.tensor(collected.group_ids)
    expected = broadcast_to_tokens(grpo_advantages(rewards, groups, scale_by_std=False), batch.response_mask)
    torch.testing.assert_close(batch.advantages, expected)
    scaled = broadcast_to_tokens(grpo_advantages(rewards, groups), batch.response_mask)
    assert not torch.allclose(batch.advantages, scaled, atol=1e-4)  # the batch tells Dr.GRPO from GRPO


def test_no_code_outside_the_resolution_compares_the_algorithms_name():
    """The trainer reads the resolved parts; only stratarl.trainer.config.resolve looks a preset up by name
    (no `algo.name == ...`, `algo.name in ...` or `TABLE[algo.name]` anywhere else)."""
    import ast

    root = Path(__file__).resolve().parents[3] / "stratarl"

    def is_algo_name(node) -> bool:
        return (
            isinstance(node, ast.Attribute)
            and node.attr == "name"
            and (
                (isinstance(node.value, ast.Attribute) and node.value.attr == "algo")
                or (isinstance(node.value, ast.Name) and node.value.id == "algo")
            )
        )

    offenders = []
    for path in root.rglob("*.py"):
        if path.name == "resolve.py" and path.parent.name == "config":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            compared = isinstance(node, ast.Compare) and any(is_algo_name(n) for n in (node.left, *node.comparators))
            looked_up = isinstance(node, ast.Subscript) and is_algo_name(node.slice)  # e.g. TABLE[cfg.algo.name]
            if compared or looked_up:
                offenders.append(f"{path.relative_to(root)}:{node.lineno}")
    assert offenders == []
