"""Part parameters are checked when the config loads (stratarl.algos.params, declared at registration): a value of
the wrong type, out of range or not finite is one config error naming the field, before any model is built; a
user's part declares its own ranges with ``params=``, and an undeclared keyword is checked by its default's type."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from stratarl.algos import Param, register_advantage
from stratarl.algos.params import ParamError, param_from_default
from stratarl.algos.registry import get_advantage, param_specs
from stratarl.config_errors import ConfigError
from stratarl.trainer.config import load_config

TINY = Path(__file__).resolve().parents[3] / "configs" / "tiny.yaml"
TIS = ["algo.behaviour_correction=tis"]


@pytest.fixture
def own_advantages():
    """Advantages a test registers are unregistered afterwards (other tests list the registered names)."""
    from stratarl.algos import registry

    before = set(registry._ADVANTAGES)
    yield
    for name in set(registry._ADVANTAGES) - before:
        del registry._ADVANTAGES[name]
        registry._ADVANTAGE_INFO.pop(name, None)
        registry._PARAMS["advantage"].pop(name, None)


@pytest.mark.parametrize(
    "overrides, field, words",
    [
        # the cases: accepted (step_weight=-1), skipped every update (nan), late bare ValueErrors, a traceback
        (["algo.name=gigpo", "algo.advantage_params.step_weight=-1"], "algo.advantage_params.step_weight", ">= 0"),
        (["algo.name=gigpo", "algo.advantage_params.step_weight=.nan"], "algo.advantage_params.step_weight", "finite"),
        (["algo.name=gigpo", "algo.advantage_params.step_weight=.inf"], "algo.advantage_params.step_weight", "finite"),
        ([*TIS, "algo.behaviour_correction_params.cap=-1"], "algo.behaviour_correction_params.cap", "> 1"),
        ([*TIS, "algo.behaviour_correction_params.level=word"], "algo.behaviour_correction_params.level", "turn"),
        (
            ["algo.name=gigpo", "algo.advantage_params.similarity_threshold=1.5"],
            "algo.advantage_params.similarity_threshold",
            "<= 1, or null",
        ),
        (
            ["algo.name=gigpo", "algo.advantage_params.similarity_threshold=high"],
            "algo.advantage_params.similarity_threshold",
            "not a number",
        ),
        (["algo.advantage_params.std_ddof=1.5"], "algo.advantage_params.std_ddof", "not an integer"),
        (["algo.advantage_params.scale_by_std=maybe"], "algo.advantage_params.scale_by_std", "true or false"),
        (["algo.policy_loss_params.dual_clip=0.5"], "algo.policy_loss_params.dual_clip", "> 1"),
        (["algo.name=so_grpo", "algo.sorl_delta_ema=.nan"], "algo.sorl_delta_ema", "finite"),
        (["algo.advantage_params.eps=.nan"], "algo.advantage_params.eps", "finite"),
        (["algo.advantage_params.eps=high"], "algo.advantage_params.eps", "number"),
    ],
)
def test_a_bad_part_parameter_is_one_config_error_naming_its_field(overrides, field, words):
    with pytest.raises(ConfigError) as error:
        load_config(TINY, overrides)
    message = str(error.value)
    assert f"config field `{field}`" in message and words in message and "Fix:" in message, message
    assert "\n" not in message


def test_good_values_load_and_a_numeric_string_is_read_as_a_number():
    cfg = load_config(
        TINY,
        ["algo.name=gigpo", "algo.advantage_params.step_weight=0.5", "algo.advantage_params.similarity_threshold=0.9"],
    )
    assert cfg.algorithm.advantage_params["step_weight"] == 0.5
    assert cfg.algorithm.advantage_params["similarity_threshold"] == 0.9
    decoupled = load_config(TINY, ["algo.behaviour_correction=decoupled", "algo.behaviour_correction_params.cap=null"])
    assert decoupled.algorithm.correction_params["cap"] is None
    knob = load_config(TINY, ["algo.advantage_params.eps=1e-5"])  # YAML 1.1 reads 1e-5 as a string
    assert knob.algo.epsilon == 1e-5 and isinstance(knob.algo.epsilon, float)


def test_every_built_in_part_declares_every_parameter_it_takes():
    from stratarl.algos import registry

    kinds = {
        "advantage": (registry.advantage_names, registry.get_advantage),
        "policy_loss": (registry.policy_loss_names, registry.get_policy_loss),
        "normalizer": (registry.grad_normalizer_names, registry.get_grad_normalizer),
        "behaviour_correction": (registry.behaviour_correction_names, registry.get_behaviour_correction),
    }
    for kind, (names, get) in kinds.items():
        for name in ("grpo", "drgrpo", "stratified", "gae", "gigpo", "ppo", "sorl", "tis", "mis", "decoupled"):
            if name in names():
                declared = registry._PARAMS[kind][name]
                assert set(declared) == set(registry.keyword_params(get(name))), (kind, name)


def test_a_users_part_declares_its_ranges_and_its_undeclared_keywords_are_typed_by_their_defaults(own_advantages):
    name = "i54_test_scaled"

    @register_advantage(name, group_relative=True, params={"scale": Param.number(gt=0)})
    def scaled(batch, *, scale: float = 1.0, shift: float = 0.0, rounds: int = 1, mode: str = "a"):
        return batch.rewards, batch.rewards

    specs = param_specs("advantage", name, get_advantage(name))
    assert specs["scale"] == Param.number(gt=0) and specs["shift"] == Param.number()
    assert specs["rounds"] == Param.integer() and specs["mode"] == Param.string()
    base = [f"algo.advantage={name}"]
    assert load_config(TINY, [*base, "algo.advantage_params.scale=2"]).algorithm.advantage_params["scale"] == 2
    for value, words in (("-1", "> 0"), (".nan", "finite"), ("high", "not a number")):
        with pytest.raises(ConfigError, match=r"`algo\.advantage_params\.scale`.*" + words):
            load_config(TINY, [*base, f"algo.advantage_params.scale={value}"])
    with pytest.raises(ConfigError, match=r"`algo\.advantage_params\.shift` = nan.*finite"):
        load_config(TINY, [*base, "algo.advantage_params.shift=.nan"])
    with pytest.raises(ConfigError, match=r"`algo\.advantage_params\.rounds`.*integer"):
        load_config(TINY, [*base, "algo.advantage_params.rounds=two"])


def test_a_declaration_of_a_keyword_the_part_lacks_is_refused_at_registration(own_advantages):
    with pytest.raises(ValueError, match="declares 'scael'"):

        @register_advantage("i54_test_misdeclared", params={"scael": Param.number()})
        def misdeclared(batch, *, scale: float = 1.0):
            return batch.rewards, batch.rewards

    from stratarl.algos.registry import advantage_names

    assert "i54_test_misdeclared" not in advantage_names()  # the name stays free for the corrected declaration


def test_param_checks_hand_cases():
    assert Param.number(gt=1).check(2) == 2 and Param.number(gt=1, optional=True).check(None) is None
    for spec, value in (
        (Param.number(gt=1), 1),
        (Param.number(ge=0, lt=1), 1.0),
        (Param.number(), math.inf),
        (Param.number(), True),
        (Param.integer(ge=1), 0),
        (Param.choice("a", "b"), "c"),
        (Param.flag(), 1),
        (Param.any(), math.nan),
        (Param.any(), [1.0, [math.inf]]),
        (Param.any(), {"w": math.nan}),
    ):
        with pytest.raises(ParamError):
            spec.check(value)
    assert param_from_default(None) == Param.any() and param_from_default(True) == Param.flag()
    assert Param.number(gt=0, le=1, optional=True).describe() == "a number > 0 and <= 1, or null"


def test_the_command_line_refuses_a_non_numeric_parameter_in_one_line(tmp_path):
    """Before: `similarity_threshold=high` was a traceback after the model was built."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "stratarl.cli",
            "train",
            str(TINY),
            "algo.name=gigpo",
            "algo.advantage_params.similarity_threshold=high",
            "--run-dir",
            str(tmp_path / "run"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "algo.advantage_params.similarity_threshold" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_refused_second_registration_keeps_the_registered_parts_declaration():
    """Registering a taken name is refused, and the refused part's (empty) declaration must not replace the
    registered part's: a bad value for it is still refused at load afterwards."""
    from stratarl.algos import register_behaviour_correction, registry

    def impostor(batch, *, eps: float = 1e-6, std_ddof: int = 1, scale_by_std: bool = True):
        raise AssertionError("never called")

    def correction(old_log_probs, behaviour_log_probs, response_mask, *, cap: float = 2.0, level: str = "token"):
        raise AssertionError("never called")

    for register, kind, name in (
        (register_advantage, "advantage", "grpo"),
        (register_behaviour_correction, "behaviour_correction", "tis"),
    ):
        before = dict(registry._PARAMS[kind][name])
        with pytest.raises(ValueError, match="already registered"):
            register(name)(impostor if kind == "advantage" else correction)
        assert registry._PARAMS[kind][name] == before and before
    with pytest.raises(ConfigError, match="algo.advantage_params.std_ddof"):
        load_config(TINY, ["algo.name=grpo", "algo.advantage_params.std_ddof=-1"])
