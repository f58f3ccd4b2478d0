"""One config tree: the trainer's `rollout:` section is the rollout engine's own config class, and the
checks that span sections run at load time."""

from __future__ import annotations

import dataclasses

import pytest

from stratarl.rollout.config import RolloutConfig
from stratarl.rollout.engine import RolloutConfig as EngineRolloutConfig
from stratarl.trainer.config import Config, ConfigError, load_config, save_config


def test_the_trainer_embeds_the_engines_config_class():
    assert EngineRolloutConfig is RolloutConfig
    hints = {f.name: f.type for f in dataclasses.fields(Config)}
    assert hints["rollout"] in (RolloutConfig, "RolloutConfig")
    assert isinstance(load_config(None).rollout, RolloutConfig)


def test_every_field_of_the_rollout_config_is_documented():
    import ast
    import inspect

    import stratarl.rollout.config as module

    tree = ast.parse(inspect.getsource(module))
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "RolloutConfig"]
    body = cls.body
    documented = {
        body[i].target.id
        for i in range(len(body) - 1)
        if isinstance(body[i], ast.AnnAssign)
        and isinstance(body[i + 1], ast.Expr)
        and isinstance(body[i + 1].value, ast.Constant)
    }
    assert documented == {f.name for f in dataclasses.fields(RolloutConfig)}


def test_the_rollout_section_carries_the_runs_topk_and_collect_chooses_greedy():
    cfg = load_config(None, ["retrieval.topk=2", "rollout.max_turns=1", "rollout.temperature=0.7"])
    train, evaluation = cfg.rollout, cfg.rollout.replace(greedy=True)  # what collect(..., greedy=True) runs
    assert (train.topk, train.max_turns, train.temperature, train.greedy) == (2, 1, 0.7, False)
    assert evaluation.greedy and evaluation.topk == 2
    assert train.sampling_params().temperature == 0.7
    programmatic = Config()
    programmatic.retrieval.topk = 5
    assert programmatic.validate().rollout.topk == 5  # validation gives the rollout section retrieval.topk


def test_passages_per_search_have_one_place():
    with pytest.raises(ConfigError, match="`rollout.topk` = 5: passages per search are set once, in `retrieval.topk`"):
        load_config(None, ["rollout.topk=5"])


def test_a_saved_config_loads_back_with_its_rollout_section(tmp_path):
    cfg = load_config(
        None, ["retrieval.topk=4", "rollout.backend=hf", "algo.name=gspo", "algo.policy_loss_params.dual_clip=3.0"]
    )
    save_config(cfg, tmp_path / "config.yaml")
    again = load_config(tmp_path / "config.yaml")
    assert again.rollout == cfg.rollout and again.algo == cfg.algo and again.rollout.topk == 4


def test_rollout_errors_name_the_field_in_the_tree_and_in_the_engine():
    with pytest.raises(ConfigError, match=r"config field `rollout.max_obs_tokens` = 4: must be >= 16"):
        load_config(None, ["rollout.max_obs_tokens=4"])
    with pytest.raises(ConfigError, match=r"config field `RolloutConfig.max_obs_tokens` = 4"):
        RolloutConfig(max_obs_tokens=4)
    with pytest.raises(
        ConfigError, match=r"`rollout.backend` = 'vllm': not an allowed value. Fix: use one of kv_cache"
    ):
        load_config(None, ["rollout.backend=vllm"])
    with pytest.raises(ConfigError, match=r"`rollout.greedy` = True: training rollouts sample"):
        load_config(None, ["rollout.greedy=true"])


def test_kl_estimator_and_aggregation_choices_list_the_valid_ones():
    with pytest.raises(
        ConfigError,
        match=r"`algo.kl_estimator` = 'k4': not an allowed value. Fix: (did you mean 'k.'\? )?use one of k1, k2, k3",
    ):
        load_config(None, ["algo.kl_estimator=k4"])
    assert load_config(None, ["algo.kl_coef=0", "algo.kl_estimator=k1"]).algo.kl_estimator == "k1"
    with pytest.raises(ConfigError, match=r"did you mean 'token-mean'"):
        load_config(None, ["algo.loss_agg=token_mean"])


def test_observation_blocks_is_the_veRL_plugins_stratum_and_differs_from_num_searches_where_documented():
    from stratarl.rollout.collect import stratum_function
    from stratarl.rollout.engine import Rollout

    invalid_then_answer = Rollout(prompt_ids=[1], response_ids=[5] * 5, response_mask=[1, 1, 0, 0, 1], num_searches=0)
    cut_after_search = Rollout(prompt_ids=[1], response_ids=[5] * 4, response_mask=[1, 1, 0, 0], num_searches=1)
    three = Rollout(prompt_ids=[1], response_ids=[5] * 7, response_mask=[1, 0, 1, 0, 1, 0, 1], num_searches=3)
    searches, blocks = stratum_function("num_searches", None), stratum_function("observation_blocks", None)
    assert [searches(r) for r in (invalid_then_answer, cut_after_search, three)] == [0, 1, 3]
    assert [blocks(r) for r in (invalid_then_answer, cut_after_search, three)] == [1, 0, 3]
    assert stratum_function("observation_blocks", 2)(three) == 2
    assert load_config(None, ["algo.stratum_key=observation_blocks"]).algo.stratum_key == "observation_blocks"


def test_choices_are_literals_of_the_parts_own_tuples():
    import typing

    from stratarl.algos.losses import AGG_MODES, KL_ESTIMATORS
    from stratarl.algos.sorl import DELTA_RULES
    from stratarl.trainer.config import AlgoConfig, OptimConfig

    hints = typing.get_type_hints(AlgoConfig)
    assert typing.get_args(hints["kl_estimator"]) == KL_ESTIMATORS
    assert typing.get_args(hints["sorl_delta_rule"]) == DELTA_RULES
    assert typing.get_args(hints["loss_agg"]) == AGG_MODES
    assert typing.get_args(typing.get_type_hints(OptimConfig)["name"]) == ("adamw", "sgd")
    with pytest.raises(
        ConfigError, match=r"`optim.schedule` = 'cosin': not an allowed value. Fix: did you mean 'cosine'"
    ):
        load_config(None, ["optim.schedule=cosin"])


def test_a_section_built_in_code_is_held_to_the_same_choices():
    from stratarl.trainer.config import AlgoConfig, OptimConfig

    with pytest.raises(ConfigError, match=r"`optim.name` = 'adam': not an allowed value. Fix: did you mean 'adamw'"):
        OptimConfig(name="adam").validate("optim")
    with pytest.raises(ConfigError, match=r"`algo.ratio_level` = 'turns'"):
        AlgoConfig(ratio_level="turns").validate("algo")
    AlgoConfig(ratio_level=None).validate("algo")
