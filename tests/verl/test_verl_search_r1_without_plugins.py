"""Search-R1 on plain veRL: `stratarl serve` + recipes/verl/search_tool.py with veRL's own GRPO, no plugin.

veRL removed its own search tool and retriever (verl#6126, #6302); the recipe's tool and `stratarl serve`
serve any veRL run. This runs `main_ppo` on veRL's default v1 trainer with `algorithm.adv_estimator=grpo`,
the `vanilla` loss and veRL's own Search-R1 exact-match reward (data_source `searchR1_nq`), the tool_agent
loop with the hermes parser, and only stratarl's CPU harness loaded (`harness.verl_cpu`: a CPU
platform and an hf rollout server, which GPUs replace with vLLM). docs/verl.md, "Search-R1 on veRL
without the plugins".
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("verl.trainer.ppo.core_algos", reason="needs veRL (make test-verl runs these in .venv-verl)")

from harness import smoke_multiturn as mt

REPO = Path(__file__).resolve().parents[2]

# In a fresh interpreter, as veRL's workers load them: the CPU harness, then the tool from its file.
PROBE = f"""
import os, sys
os.environ["VERL_USE_EXTERNAL_MODULES"] = "harness.verl_cpu"
os.environ["VERL_PLATFORM"] = "stratarl_cpu"
from verl.tools.function_tool import load_function_tools_from_path
from verl.trainer.ppo import core_algos
from verl.workers.engine_workers import ActorRolloutRefWorker
tools = load_function_tools_from_path({str(REPO / "recipes" / "verl" / "search_tool.py")!r})
print("TOOLS", [t.name for t in tools])
print("PLUGIN_PACKAGE", "stratarl.integrations.verl" in sys.modules)
print("ESTIMATOR", "stratified_grpo" in core_algos.ADV_ESTIMATOR_REGISTRY)
print("LOSSES", sorted(set(core_algos.POLICY_LOSS_REGISTRY) & {{"turn_ppo", "sorl"}}))
print("WORKER", ActorRolloutRefWorker.actor_worker_cls.__name__)
"""


def test_the_recipe_tool_and_the_cpu_harness_load_no_plugin():
    env = {**os.environ, "PYTHONPATH": mt.smoke.pythonpath()}  # the harness lives in tests/verl
    result = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300, cwd=REPO, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = dict(line.split(" ", 1) for line in result.stdout.splitlines() if line.split(" ", 1)[0].isupper())
    assert out["TOOLS"] == "['search']"
    assert out["PLUGIN_PACKAGE"] == "False"
    assert out["ESTIMATOR"] == "False" and out["LOSSES"] == "[]"
    assert out["WORKER"] == "CPUTrainingWorker"  # veRL's TrainingWorker + a gloo process group, nothing else


@pytest.fixture(scope="module")
def run(tmp_path_factory, smoke_multiturn):
    workdir = tmp_path_factory.mktemp("verl-search-r1-plain")
    stdout, log = smoke_multiturn(workdir, "--without-plugins")
    return workdir, log, stdout


@pytest.mark.slow
def test_plain_verl_grpo_searches_through_the_recipe_tool(run):
    workdir, log, stdout = run
    metrics = mt.step_metrics(log)
    assert sorted(metrics) == [1, 2]
    assert "TaskRunnerV1 pid=" in log  # veRL's default trainer
    for m in metrics.values():
        # Nothing of stratarl's ran in the trainer: no turn-level loss, no SORL step, no estimator dump.
        assert not any(key.startswith(("actor/sorl/", "actor/turn_")) for key in m)
    assert not (workdir / "strata.jsonl").exists() and not (workdir / "ranks.jsonl").exists()
    # Every tool round the agent loop counted (veRL's num_turns) was one request to stratarl serve.
    rounds = 0.0
    for step, m in metrics.items():
        rows = [r for r in mt.load_rollouts(workdir, step) if not mt.is_padding(r.get("uid", ""))]
        assert len(rows) == 2 * mt.GROUP_SIZE
        rounds += mt.plain_tool_rounds(m, len(rows))
        # veRL's GRPO on its own dump (groups = prompts, veRL's Search-R1 EM scores).
        adv = mt.grpo_advantages_on_dump(rows)
        assert m["critic/advantages/max"] == pytest.approx(float(adv.max()), abs=1e-4)
        assert m["critic/advantages/min"] == pytest.approx(float(adv.min()), abs=1e-4)
    server = mt.json.loads((workdir / "server.json").read_text())
    assert rounds == pytest.approx(round(rounds)) and rounds > 0
    assert server["requests"] == server["queries"] == round(rounds)
    assert "searches:" in stdout
