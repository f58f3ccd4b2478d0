"""The recipe configs load and validate with veRL's config system; tool, reward and plugin loading."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

# "verl.trainer…", not "verl": in the main venv this folder itself is importable as a namespace package "verl".
pytest.importorskip("verl.trainer.ppo.core_algos", reason="needs veRL (make test-verl runs these in .venv-verl)")

from hydra import compose, initialize_config_dir
from verl.trainer.ppo.utils import need_critic, need_reference_policy
from verl.utils.config import omega_conf_to_dataclass, validate_config

import stratarl.integrations.verl  # noqa: F401
from stratarl.integrations.verl.config import SORLPolicyLossConfig, StratifiedAlgoConfig
from stratarl.retrieval.base import Passage

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "recipes" / "verl"
RUNNABLE = ["stratified_grpo", "so_grpo", "stratified_so_grpo"]


def load_recipe(name: str, monkeypatch):
    monkeypatch.setenv("STRATARL_VERL_RECIPE_DIR", str(RECIPES))
    with initialize_config_dir(config_dir=str(RECIPES), version_base=None):
        return compose(config_name=name)


def test_every_runnable_recipe_is_tested():
    parts = {"search_r1_base"} | {p.stem for p in RECIPES.glob("part_*.yaml")}
    shipped = sorted(p.stem for p in RECIPES.glob("*.yaml") if p.stem not in parts)
    assert shipped == sorted(RUNNABLE)


@pytest.mark.parametrize("name", RUNNABLE)
def test_recipe_composes_and_passes_verl_validation(name, monkeypatch):
    cfg = load_recipe(name, monkeypatch)
    validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    algorithm = omega_conf_to_dataclass(cfg.algorithm)
    stratified = name in ("stratified_grpo", "stratified_so_grpo")
    sorl = name in ("so_grpo", "stratified_so_grpo")
    assert cfg.algorithm.adv_estimator == ("stratified_grpo" if stratified else "grpo")
    if stratified:
        assert isinstance(algorithm, StratifiedAlgoConfig) and algorithm.stratified_grpo.alpha == 0.6
    if sorl:
        assert isinstance(actor.policy_loss, SORLPolicyLossConfig)
        assert (actor.policy_loss.loss_mode, actor.policy_loss.sorl_delta) == ("sorl", 1.0)
    else:
        assert actor.policy_loss.loss_mode == "vanilla"
    # Search-R1 setup (docs/algorithms.md §3).
    assert cfg.actor_rollout_ref.rollout.n == 5
    assert cfg.actor_rollout_ref.rollout.multi_turn.max_assistant_turns == 4
    assert (actor.clip_ratio, actor.kl_loss_coef, actor.kl_loss_type) == (0.2, 0.001, "low_var_kl")
    env = cfg.ray_kwargs.ray_init.runtime_env.env_vars
    assert env.VERL_USE_EXTERNAL_MODULES == "stratarl.integrations.verl"
    # veRL's default trainer (v1, sync mode): the recipes do not opt out of it.
    assert cfg.trainer.use_v1 is True and cfg.trainer.v1.trainer_mode == "sync"
    assert Path(cfg.actor_rollout_ref.rollout.multi_turn.function_tool_path).is_file()
    assert Path(cfg.reward.custom_reward_function.path).is_file()


def test_recipe_reward_loads_through_verl(monkeypatch):
    from verl.trainer.ppo.reward import get_custom_reward_fn

    score = get_custom_reward_fn(load_recipe("stratified_grpo", monkeypatch))
    truth = {"target": ["Paris", "paris, france"]}
    assert score("searchR1_nq", "<think>x</think><answer> Paris </answer>", truth) == 1.0
    assert score("synth", "<answer>Lyon</answer>", truth) == 0.0
    assert score("synth", "no answer tag", truth) == 0.0


class StubRetriever:
    def search(self, queries, k):
        return [
            [Passage(id=f"{q}-{i}", contents=f'"Title {q} {i}"\ntext {i} about {q}') for i in range(k)] for q in queries
        ]


def test_search_tool_queries_a_retrieve_server(monkeypatch):
    """veRL loads recipes/verl/search_tool.py; its `search` calls a real /retrieve server on loopback."""
    import asyncio

    import uvicorn
    from verl.tools.function_tool import load_function_tools_from_path

    from stratarl.integrations import search_tool
    from stratarl.retrieval.server import create_app

    server = uvicorn.Server(uvicorn.Config(create_app(StubRetriever()), host="127.0.0.1", port=0, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        for _ in range(200):
            if server.started:
                break
            threading.Event().wait(0.05)
        port = server.servers[0].sockets[0].getsockname()[1]
        monkeypatch.setenv("STRATARL_RETRIEVER_URL", f"http://127.0.0.1:{port}/retrieve")
        monkeypatch.setattr(search_tool, "_retriever", None)
        (tool,) = [t for t in load_function_tools_from_path(str(RECIPES / "search_tool.py")) if t.name == "search"]
        params = tool.tool_schema.function.parameters
        assert params.properties["query_list"].type == "array"
        text = asyncio.run(tool.call({"query_list": ["capital"]}))
        assert text == "\n".join(f'Doc {i + 1}(Title: "Title capital {i}") text {i} about capital' for i in range(3))
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        monkeypatch.setattr(search_tool, "_retriever", None)


def test_search_documents_formats_several_queries_and_rejects_bad_input():
    from stratarl.integrations.verl.search_tool import search_documents

    text = search_documents(["a", " b "], retriever=StubRetriever(), topk=1)
    assert text == 'Doc 1(Title: "Title a 0") text 0 about a\nDoc 1(Title: "Title b 0") text 0 about b'
    with pytest.raises(ValueError, match="query_list is empty"):
        search_documents(["  "], retriever=StubRetriever())
    with pytest.raises(ValueError, match="at most 8"):
        search_documents([str(i) for i in range(9)], retriever=StubRetriever())


@pytest.mark.slow
def test_plugins_load_in_a_fresh_process_through_verl_use_external_modules():
    """What every Ray worker does: `import verl` with VERL_USE_EXTERNAL_MODULES set, nothing else."""
    code = (
        "import verl\n"
        "from verl.trainer.ppo import core_algos\n"
        "from verl.workers.engine_workers import ActorRolloutRefWorker\n"
        "print(core_algos.get_adv_estimator_fn('stratified_grpo').__module__)\n"
        "print(core_algos.get_policy_loss_fn('turn_ppo').__module__)\n"
        "print(core_algos.get_policy_loss_fn('sorl').__module__)\n"
        "print(ActorRolloutRefWorker.actor_worker_cls.__name__)\n"
        "from stratarl.cli import main\n"
        "raise SystemExit(main(['verl', 'check']))\n"
    )
    env = {**os.environ, "VERL_USE_EXTERNAL_MODULES": "stratarl.integrations.verl", "PYTHONWARNINGS": "ignore"}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[:4] == [
        "stratarl.integrations.verl.advantage",
        "stratarl.integrations.verl.losses",
        "stratarl.integrations.verl.losses",
        "SORLTrainingWorker",
    ]
    assert any(line.startswith("veRL 0.9.1") for line in lines)
    assert "actor worker: SORLTrainingWorker (SORL normalisation active for loss_mode=sorl)" in lines


@pytest.mark.parametrize("name", RUNNABLE)
def test_dry_run_composes_the_recipe_with_our_estimator_loss_tool_and_agent_loop(name, monkeypatch, capsys):
    """run.sh --dry-run's module: veRL's loader + validation, stopped before any worker starts."""
    from stratarl.integrations.verl import dry_run

    monkeypatch.setenv("STRATARL_VERL_RECIPE_DIR", str(RECIPES))
    assert dry_run.main(["--config-dir", str(RECIPES), "--config-name", name]) == 0
    lines = dict(line.split(": ", 1) for line in capsys.readouterr().out.splitlines() if ": " in line)
    stratified, sorl = name != "so_grpo", name != "stratified_grpo"
    assert lines["algorithm.adv_estimator"] == ("stratified_grpo" if stratified else "grpo")
    assert lines["actor.policy_loss.loss_mode"] == ("sorl" if sorl else "vanilla")
    assert lines["rollout.multi_turn.tools"] == "search"
    assert lines["rollout.agent.default_agent_loop"] == "tool_agent"
    assert lines["rollout.multi_turn.format"] == "hermes"
    assert lines["rollout.name"] == "vllm"
    # Search-R1's setup on 8 GPUs: 512 prompts × 5, observations of ~500 tokens (2000 characters).
    assert (lines["data.train_batch_size"], lines["rollout.n"], lines["trainer.n_gpus_per_node"]) == ("512", "5", "8")
    assert lines["rollout.multi_turn.max_tool_response_length (characters)"] == "2000"
    assert lines["model.path"] == "Qwen/Qwen2.5-3B-Instruct"
    assert lines["trainer"] == "v1 (trainer.use_v1=true, trainer.v1.trainer_mode=sync)"  # veRL's default trainer


@pytest.mark.parametrize(
    ("name", "override", "plugin"),
    [
        ("stratified_grpo", "algorithm.rollout_correction.rollout_rs=seq_mean_k1", "stratified_grpo"),
        ("so_grpo", "algorithm.rollout_correction.rollout_rs=token_k1", "loss_mode=sorl"),
        ("stratified_so_grpo", "algorithm.rollout_correction.bypass_mode=true", "loss_mode=sorl"),
    ],
)
def test_dry_run_refuses_rollout_corrections_that_cannot_compose(name, override, plugin, monkeypatch, capsys):
    from stratarl.integrations.verl import dry_run

    monkeypatch.setenv("STRATARL_VERL_RECIPE_DIR", str(RECIPES))
    assert dry_run.main(["--config-dir", str(RECIPES), "--config-name", name, override]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    setting = override.split("=")[0].rsplit(".", 1)[1]
    assert f"{plugin} cannot compose with" in err[0] and setting in err[0] and "; fix: " in err[0]


@pytest.mark.parametrize(
    ("name", "overrides"),
    [
        # TIS weights + whole-rollout rejection with the SORL loss (veRL's grpo estimator).
        (
            "so_grpo",
            [
                "algorithm.rollout_correction.rollout_is=token",
                "algorithm.rollout_correction.rollout_rs=seq_mean_k1",
                "algorithm.rollout_correction.rollout_rs_threshold='0.5_2.0'",
            ],
        ),
        # Sequence TIS with stratified_grpo and the SORL loss.
        ("stratified_so_grpo", ["algorithm.rollout_correction.rollout_is=sequence"]),
        # Rejection in bypass mode happens after the advantage: composes with stratified_grpo and veRL's loss.
        (
            "stratified_grpo",
            [
                "algorithm.rollout_correction.bypass_mode=true",
                "algorithm.rollout_correction.rollout_rs=token_k1",
                "algorithm.rollout_correction.rollout_rs_threshold=2.0",
            ],
        ),
    ],
)
def test_dry_run_accepts_rollout_corrections_that_compose(name, overrides, monkeypatch, capsys):
    from stratarl.integrations.verl import dry_run

    monkeypatch.setenv("STRATARL_VERL_RECIPE_DIR", str(RECIPES))
    assert dry_run.main(["--config-dir", str(RECIPES), "--config-name", name, *overrides]) == 0, capsys.readouterr().err


def test_dry_run_reports_an_unknown_key_in_one_line(monkeypatch, capsys):
    from stratarl.integrations.verl import dry_run

    monkeypatch.setenv("STRATARL_VERL_RECIPE_DIR", str(RECIPES))
    assert dry_run.main(["--config-dir", str(RECIPES), "--config-name", "so_grpo", "algorithm.no_such_key=1"]) == 1
    assert "no_such_key" in capsys.readouterr().err


def test_run_sh_dry_run_execs_the_dry_run_module_without_data_or_server(tmp_path):
    """PYTHON=echo: run.sh --dry-run needs no data folder or server and hands the recipe to dry_run."""
    env = {
        **os.environ,
        "PYTHON": "echo",
        "STRATARL_VERL_DATA": str(tmp_path / "missing"),
        "STRATARL_RETRIEVER_URL": "http://127.0.0.1:9/retrieve",
    }
    result = subprocess.run(
        ["bash", str(RECIPES / "run.sh"), "--dry-run", "so_grpo", "trainer.nnodes=2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [
        "-m",
        "stratarl.integrations.verl.dry_run",
        "--config-dir",
        str(RECIPES),
        "--config-name",
        "so_grpo",
        "trainer.nnodes=2",
    ]
    without = subprocess.run(
        ["bash", str(RECIPES / "run.sh"), "so_grpo"], env=env, capture_output=True, text=True, timeout=60
    )
    assert without.returncode == 2 and "train.parquet not found" in without.stderr
