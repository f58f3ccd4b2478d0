"""The warm start's settings: resolved once from the config (a frozen copy), the only thing its stages read."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import pytest

from stratarl.trainer.config import load_config
from stratarl.trainer.warmstart import demos, sft
from stratarl.trainer.warmstart.settings import WarmStartSettings

WARMSTART = Path(__file__).resolve().parents[3] / "stratarl" / "trainer" / "warmstart"
# Where the config stops: the entry points resolve it (as build_run resolves RunSettings) and key the cache on it.
ENTRY_POINTS = {"warm_start", "cached_warm_start", "warm_start_key", "warm_start_cache_dir", "from_config"}


def _cfg():
    return load_config(
        None,
        [
            "model.name=tiny-random",
            "sft.source=worlds",
            "sft.steps=5",
            "sft.probe_every=2",
            "sft.world_options={size: 300}",
            "data.synthetic.options={name_pool: 50}",
            "rollout.max_obs_tokens=77",
        ],
    )


def test_the_settings_are_a_frozen_copy_of_what_the_config_says():
    cfg = _cfg()
    s = WarmStartSettings.from_config(cfg)
    assert (s.source, s.steps, s.step_limit, s.probe.every) == ("worlds", 5, 15, 2)
    assert s.worlds.generator_options(hop_mix=(1.0, 0.0, 0.0)) == {
        "name_pool": 50,
        "size": 300,
        "hop_mix": (1.0, 0.0, 0.0),
    }
    assert s.style.max_obs_tokens == 77 and s.probe.eval.rollout.max_obs_tokens == 77
    cfg.sft.world_options["size"] = 9  # a config changed afterwards changes nothing resolved
    cfg.data.synthetic.options["name_pool"] = 1
    assert s.worlds.generator_options() == {"name_pool": 50, "size": 300}
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.steps = 6  # type: ignore[misc]
    with pytest.raises(TypeError):
        s.worlds.options["size"] = 1  # type: ignore[index]


def test_each_group_of_keyword_arguments_is_what_its_callee_takes():
    s = WarmStartSettings.from_config(_cfg())
    assert set(s.style.kwargs()) <= set(inspect.signature(demos.render_demonstrations).parameters)
    assert set(s.loop.kwargs()) <= set(inspect.signature(sft._run_sft).parameters)


def test_no_warm_start_stage_takes_the_config():
    takers = []
    for path in sorted(WARMSTART.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name not in ENTRY_POINTS:
                args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                if any(
                    a.arg == "cfg" or (a.annotation is not None and "Config" in ast.unparse(a.annotation)) for a in args
                ):
                    takers.append(f"{path.name}::{node.name}")
    assert takers == []
