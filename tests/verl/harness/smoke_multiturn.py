"""veRL's trainer on real multi-turn search, on a CPU: ``tool_agent`` loop, hf server, ``stratarl serve``.

    PYTHONPATH=tests/verl python -m harness.smoke_multiturn --workdir /tmp/verl-mt [--trainer v1|legacy]
        [--ranks 1|2] [--steps 2] [--loss-mode sorl|turn_ppo|vanilla] [overrides…]

What :mod:`harness.smoke` runs, but multi-turn: veRL's ``tool_agent`` loop with
the ``hermes`` parser, the recipe's search tool (``recipes/verl/search_tool.py``) against a real
``stratarl serve`` (BM25 over :data:`CORPUS`, on 127.0.0.1, a free port), and a policy that calls it
some of the time (:mod:`harness.agent_model`: after each ``assistant`` it searches
or answers with equal odds, so a group of 6 usually holds several search counts). Groups of 6,
``algorithm.adv_estimator=stratified_grpo`` and ``policy_loss.loss_mode=sorl`` (``--loss-mode`` to
change), at most 4 assistant turns, responses of at most :data:`RESPONSE_LENGTH` tokens (enough for
3 searches, so no tool response is dropped), on veRL's v1 trainer (default) or the legacy one
(``--trainer legacy``), with one FSDP2 rank or two (``--ranks 2``, gloo). Files in ``--workdir``:
``main_ppo.log``, ``rollouts/<step>.jsonl`` (veRL's dump), ``strata.jsonl`` (what the estimator saw: uid,
stratum, reward, advantage per rollout, and under v1 the row keys), ``rewards.jsonl`` (the reward
function's record of every rollout: data index, score, the agent loop's ``num_turns`` and tool calls),
``ranks.jsonl`` (SORL's step on every rank: ‖C‖, scale, a digest of the parameters after the step) and
``server.json`` (the server's ``/health`` counters after the run).

The server runs in an interpreter that has bm25s (veRL's environment need not):
``$STRATARL_SERVE_PYTHON``, else ``.venv/bin/python`` of this checkout, else this interpreter.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from harness import smoke, smollm2
from harness.agent_model import build_agent_model
from stratarl.algos import STRATIFIED_ALPHA, grpo_advantages, stratified_advantages
from stratarl.integrations.verl import compat
from stratarl.integrations.verl.advantage import STRATA_DUMP_ENV
from stratarl.integrations.verl.reward import REWARD_DUMP_ENV
from stratarl.integrations.verl.worker import SORL_DUMP_ENV
from stratarl.integrations.verl_data import VERL_USER_TEMPLATE
from stratarl.retrieval.base import Passage
from stratarl.retrieval.corpus import write_corpus

REPO = Path(__file__).resolve().parents[3]
GROUP_SIZE = 6
SMOLLM2_GROUP_SIZE = 4
RESPONSE_LENGTH = 128
MAX_ASSISTANT_TURNS = 4
TOPK = 1
# Ray gives its raylet a fixed 30 s to register (ray/_private/node.py); on a loaded machine that can
# fail before veRL starts. Only that failure is retried.
RAY_START_TIMEOUT = "The current node timed out during startup"
RAY_START_ATTEMPTS = 3
CORPUS = [
    ("Paris", "Paris is the capital of France ."),
    ("Rome", "Rome is the capital of Italy ."),
    ("France", "France is a country in Europe ."),
    ("Berlin", "Berlin is the capital of Germany ."),
]
# Two questions per step (two batches of two): distinct prompts, so a group is one prompt's rollouts.
QUESTIONS = [
    "What is the capital of France ?",
    "Which city is the capital of France ?",
    "What city is the capital of France ?",
    "Which is the capital of France ?",
]


def write_smoke_corpus(path: Path) -> Path:
    """:data:`CORPUS` as a Search-R1 corpus jsonl (passage ``i``: ``"Title"\\ntext``)."""
    return write_corpus([Passage(str(i), f'"{title}"\n{text}') for i, (title, text) in enumerate(CORPUS)], path)


MODELS = ("tiny", "smollm2")


def user_prompt(question: str, model: str = "tiny") -> str:
    """The user message: ``Question: …`` for the tiny policy, the recipe's Search-R1 prompt for a real model."""
    if model == "tiny":
        return f"Question: {question}"
    return VERL_USER_TEMPLATE.format(question=question)


def write_data(folder: Path, model: str = "tiny") -> tuple[Path, Path]:
    """train.parquet (:data:`QUESTIONS`, gold Paris) and val.parquet in veRL's format, ``agent_name: tool_agent``."""
    import pyarrow as pa  # start-up cost: only when a data file is written
    import pyarrow.parquet as pq  # start-up cost: only when a data file is written

    folder.mkdir(parents=True, exist_ok=True)
    rows = [
        {
            "data_source": "searchR1_nq",
            "prompt": [{"role": "user", "content": user_prompt(question, model)}],
            "ability": "fact-reasoning",
            "reward_model": {"style": "rule", "ground_truth": {"target": ["Paris"]}},
            "extra_info": {"index": i, "split": "train"},
            "agent_name": "tool_agent",
        }
        for i, question in enumerate(QUESTIONS)
    ]
    train, val = folder / "train.parquet", folder / "val.parquet"
    pq.write_table(pa.Table.from_pylist(rows), train)
    pq.write_table(pa.Table.from_pylist(rows[:2]), val)
    return train, val


def serve_python() -> str:
    """An interpreter that can run ``stratarl serve`` with BM25 (see the module doc)."""
    candidates = [os.environ.get("STRATARL_SERVE_PYTHON"), str(REPO / ".venv" / "bin" / "python"), sys.executable]
    for python in candidates:
        if python and Path(python).exists():
            probe = subprocess.run([python, "-c", "import bm25s"], capture_output=True, check=False)
            if probe.returncode == 0:
                return python
    raise RuntimeError(
        "no interpreter with bm25s for `stratarl serve`: set STRATARL_SERVE_PYTHON to stratarl's main "
        "environment (e.g. .venv/bin/python after `make test`)"
    )


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def health(url: str, timeout_s: float = 5.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return json.loads(response.read())


def start_server(corpus: Path, log: Path, *, timeout_s: float = 120.0) -> tuple[subprocess.Popen, str]:
    """``stratarl serve --corpus`` on 127.0.0.1 and a free port; returns (process, base url) once healthy."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": smoke.pythonpath()}
    process = subprocess.Popen(
        [
            serve_python(),
            "-m",
            "stratarl.cli",
            "serve",
            "--corpus",
            str(corpus),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--topk",
            str(TOPK),
            "--log-level",
            "warning",
        ],
        cwd=REPO,
        env=env,
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"stratarl serve exited with {process.returncode}; see {log}")
        try:
            health(base + "/health", timeout_s=1.0)
            return process, base
        except OSError:
            time.sleep(0.5)
    process.terminate()
    raise RuntimeError(f"stratarl serve did not answer {base}/health within {timeout_s:.0f} s; see {log}")


with_overrides = smoke.with_overrides


# Keys of the plugin runs that plain veRL does not have (our config classes, settings, reward, dumps).
PLUGIN_KEYS = (
    "policy_loss._target_",
    "sorl_delta",
    "algorithm._target_",
    "algorithm.stratified_grpo",
    "reward.custom_reward_function",
    "VERL_USE_EXTERNAL_MODULES",
    STRATA_DUMP_ENV,
    REWARD_DUMP_ENV,
    SORL_DUMP_ENV,
)


def without_plugins(overrides: list[str]) -> list[str]:
    """The same run on plain veRL: its own ``grpo`` and ``vanilla`` loss, its own Search-R1 EM reward
    (data_source ``searchR1_nq``), and only the CPU harness (:mod:`harness.verl_cpu`) loaded;
    the search tool is still ``recipes/verl/search_tool.py`` against ``stratarl serve``."""
    env = "+ray_kwargs.ray_init.runtime_env.env_vars"
    kept = [item for item in overrides if not any(key in item.split("=", 1)[0] for key in PLUGIN_KEYS)]
    return with_overrides(
        kept,
        [
            "algorithm.adv_estimator=grpo",
            "actor_rollout_ref.actor.policy_loss.loss_mode=vanilla",
            f"{env}.VERL_USE_EXTERNAL_MODULES={smoke.CPU_HARNESS}",
        ],
    )


def main_ppo_overrides(
    workdir: Path,
    url: str,
    *,
    steps: int = 2,
    loss_mode: str = "sorl",
    trainer: str = "v1",
    n_ranks: int = 1,
    plugins: bool = True,
) -> list[str]:
    """Hydra overrides: the single-turn smoke's, made multi-turn (see the module doc)."""
    env = "+ray_kwargs.ray_init.runtime_env.env_vars"
    base = smoke.main_ppo_overrides(workdir, steps=steps, group_size=GROUP_SIZE, trainer=trainer, n_ranks=n_ranks)
    if loss_mode not in ("sorl", "turn_ppo"):  # veRL's own loss: veRL's config class, no δ
        base = [item for item in base if "policy_loss._target_" not in item and "sorl_delta" not in item]
    overrides = with_overrides(
        base,
        [
            "data.max_prompt_length=32",
            f"data.max_response_length={RESPONSE_LENGTH}",
            "data.return_raw_chat=true",
            # A mini-batch is one prompt group (GROUP_SIZE rows) split over the ranks; a micro-batch must fit in it.
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={GROUP_SIZE // n_ranks}",
            f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={GROUP_SIZE}",
            f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode}",
            "actor_rollout_ref.rollout.multi_turn.enable=true",
            "actor_rollout_ref.rollout.multi_turn.format=hermes",
            f"actor_rollout_ref.rollout.multi_turn.max_assistant_turns={MAX_ASSISTANT_TURNS}",
            "actor_rollout_ref.rollout.multi_turn.max_tool_response_length=2000",
            f"actor_rollout_ref.rollout.multi_turn.function_tool_path={REPO / 'recipes' / 'verl' / 'search_tool.py'}",
            "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent",
            "reward.custom_reward_function.name=compute_score_with_turns",
            f"{env}.STRATARL_RETRIEVER_URL={url}/retrieve",
            f'{env}.STRATARL_RETRIEVER_TOPK="{TOPK}"',
            f"{env}.{STRATA_DUMP_ENV}={workdir / 'strata.jsonl'}",
            f"{env}.{REWARD_DUMP_ENV}={workdir / 'rewards.jsonl'}",
            f"{env}.{SORL_DUMP_ENV}={workdir / 'ranks.jsonl'}",
        ],
    )
    return overrides if plugins else without_plugins(overrides)


def smollm2_overrides(steps: int) -> list[str]:
    """The real-model run (:mod:`.smollm2`): one step of 2 prompts × 4 rollouts, Search-R1 prompt lengths,
    one optimizer step on the whole batch with ``turn_ppo`` (SORL's extra pass would double the actor's
    time on a 135M model; ``sorl`` is covered by the tiny-policy runs)."""
    return [
        f"trainer.total_training_steps={steps}",
        f"actor_rollout_ref.rollout.n={SMOLLM2_GROUP_SIZE}",
        "data.max_prompt_length=512",
        "data.max_response_length=256",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={2 * SMOLLM2_GROUP_SIZE}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={2 * SMOLLM2_GROUP_SIZE}",
        "actor_rollout_ref.actor.policy_loss.loss_mode=turn_ppo",
        "actor_rollout_ref.actor.optim.lr=1e-6",
        f"actor_rollout_ref.rollout.multi_turn.max_assistant_turns={smollm2.MAX_ASSISTANT_TURNS}",
    ]


def run(
    workdir: Path,
    *,
    steps: int = 2,
    loss_mode: str = "sorl",
    trainer: str = "v1",
    n_ranks: int = 1,
    plugins: bool = True,
    model: str = "tiny",
    extra: list[str] | None = None,
    timeout_s: float = 900,
) -> int:
    """Build model, data and corpus, serve the corpus, run main_ppo; writes the files of the module doc."""
    compat.require_hooks()
    workdir = workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    write_data(workdir / "data", model)
    server, url = start_server(write_smoke_corpus(workdir / "corpus.jsonl"), workdir / "server.log")
    try:
        if model == "smollm2":
            # The warm start renders its demonstrations through veRL's loop and the real server.
            os.environ["STRATARL_RETRIEVER_URL"] = f"{url}/retrieve"
            os.environ["STRATARL_RETRIEVER_TOPK"] = str(TOPK)
            summary = smollm2.build_tool_model(workdir / "model", [user_prompt(q, model) for q in QUESTIONS[:2]])
            (workdir / "warm_start.json").write_text(json.dumps(summary, indent=1))
            extra = smollm2_overrides(steps) + list(extra or [])
        else:
            build_agent_model(workdir / "model")
        env = {
            **os.environ,
            "VERL_USE_EXTERNAL_MODULES": smoke.PLUGINS if plugins else smoke.CPU_HARNESS,
            "VERL_PLATFORM": "stratarl_cpu",
            "PYTHONPATH": smoke.pythonpath(),
            "HYDRA_FULL_ERROR": "1",
            "RAY_DEDUP_LOGS": "0",
            "TOKENIZERS_PARALLELISM": "false",
        }
        base = main_ppo_overrides(
            workdir, url, steps=steps, loss_mode=loss_mode, trainer=trainer, n_ranks=n_ranks, plugins=plugins
        )
        overrides = with_overrides(base, extra or [])
        command = [sys.executable, "-m", "verl.trainer.main_ppo", *overrides]
        # What the server answered before main_ppo (the real model's warm start renders its demonstrations
        # against it); server.json holds main_ppo's requests only.
        before = health(url + "/health")["stats"]
        for _attempt in range(RAY_START_ATTEMPTS):
            for name in ("strata.jsonl", "rewards.jsonl", "ranks.jsonl"):
                (workdir / name).unlink(missing_ok=True)
            started = time.monotonic()
            with open(workdir / "main_ppo.log", "w") as out:
                result = subprocess.run(
                    command, env=env, cwd=workdir, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s, check=False
                )
            if result.returncode == 0 or RAY_START_TIMEOUT not in (workdir / "main_ppo.log").read_text():
                break
        stats = health(url + "/health")["stats"]
        for key in ("requests", "queries"):
            stats[f"{key}_before_main_ppo"] = before[key]
            stats[key] -= before[key]
        stats["main_ppo_wall_s"] = round(time.monotonic() - started, 1)
        (workdir / "server.json").write_text(json.dumps(stats, indent=1))
    finally:
        server.terminate()
        server.wait(timeout=30)
    return result.returncode


METRIC = re.compile(r"([\w/@.\-]+):(?:np\.\w+\()?(-?(?:\d+\.?\d*(?:e[-+]?\d+)?|nan|inf))")


def step_metrics(log: str) -> dict[int, dict[str, float]]:
    """veRL's console logger lines ``step:N - key:value - …`` → {N: {key: value}}."""
    steps = {}
    for line in log.splitlines():
        match = re.search(r"step:(\d+) - (.*)", line)
        if match:
            steps[int(match.group(1))] = {k: float(v) for k, v in METRIC.findall(match.group(2))}
    return steps


def load_run(workdir: Path) -> dict:
    """The run's files: ``metrics`` {step: …}, ``rollouts`` {step: rows}, ``estimator`` [one record a step],
    ``rewards`` [one record per scored rollout], ``server``, and ``ranks`` [SORL's per-rank records, if any]."""
    workdir = Path(workdir)
    metrics = step_metrics((workdir / "main_ppo.log").read_text())
    rollouts = {
        step: [json.loads(line) for line in (workdir / "rollouts" / f"{step}.jsonl").read_text().splitlines()]
        for step in metrics
    }

    def lines(name: str) -> list[dict]:
        path = workdir / name
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    server = json.loads((workdir / "server.json").read_text())
    return {
        "metrics": metrics,
        "rollouts": rollouts,
        "estimator": lines("strata.jsonl"),
        "rewards": lines("rewards.jsonl"),
        "server": server,
        "ranks": lines("ranks.jsonl"),
    }


def tool_rounds(row: dict) -> int:
    """Tool rounds of a rollout from the agent loop's own count: (num_turns − 2) / 2."""
    return (int(row["num_turns"]) - 2) // 2


def question_index(text: str) -> int:
    """The index of the one :data:`QUESTIONS` entry a decoded prompt holds."""
    found = [i for i, question in enumerate(QUESTIONS) if question in text]
    if len(found) != 1:
        raise ValueError(f"prompt {text!r} holds {len(found)} of the smoke's questions, expected 1")
    return found[0]


def is_padding(uid: str) -> bool:
    """veRL's v1 trainer pads a batch with synthetic rows of uid ``pad<hex>`` (upsample_batch_to_divisible_size)."""
    return str(uid).startswith("pad")


def groups_by_step(run: dict) -> dict[int, list[dict]]:
    """Per step, one entry per prompt group, joining the estimator's record with the reward function's.

    Each entry: ``uid``, ``question`` (index into :data:`QUESTIONS`), ``estimator`` [(reward, stratum,
    advantage)] as the estimator saw and gave them, ``agent`` [(score, tool rounds, tool calls)] as the
    reward function recorded them from the agent loop (``num_turns`` and ``len(tool_rewards)``). The
    estimator's rows are tied to a prompt through veRL's rollout dump: row for row (legacy trainer, which
    keeps the batch order) or by row key (v1, whose estimator record carries the keys). Padding rows
    (v1) are left out.
    """
    rewards_by_question: dict[int, list[tuple[float, int, int]]] = {}
    for record in run["rewards"]:
        rewards_by_question.setdefault(int(record["index"]), []).append(
            (float(record["score"]), tool_rounds(record), int(record["tool_calls"]))
        )
    steps = {}
    for step, rows in run["rollouts"].items():
        record = run["estimator"][step - 1]
        if "keys" in record:
            input_of_key = {row["uid"]: row["input"] for row in rows}
            inputs = [input_of_key[key] for key in record["keys"]]
        else:
            if len(rows) != len(record["uid"]):
                raise ValueError(f"step {step}: {len(rows)} dumped rollouts, {len(record['uid'])} estimator rows")
            inputs = [row["input"] for row in rows]
        groups: dict[str, dict] = {}
        for i, uid in enumerate(record["uid"]):
            if is_padding(uid):
                continue
            group = groups.setdefault(uid, {"uid": uid, "question": question_index(inputs[i]), "estimator": []})
            if question_index(inputs[i]) != group["question"]:
                raise ValueError(f"step {step}: uid {uid} spans two prompts")
            group["estimator"].append(
                (float(record["rewards"][i]), int(record["strata"][i]), float(record["advantages"][i]))
            )
        for group in groups.values():
            group["agent"] = rewards_by_question.get(group["question"], [])
        steps[step] = list(groups.values())
    return steps


def expected_advantages(groups: list[dict], *, single_stratum: bool = False, alpha: float = STRATIFIED_ALPHA):
    """stratarl's Stratified GRPO on the reward function's records of one step, group by group.

    Returns one list per group of (score, tool rounds, advantage), sorted; strata are the agent loop's
    tool rounds (or all 0 with ``single_stratum``), ε = the smoke's ``algorithm.stratified_grpo.eps``.
    """
    import torch  # start-up cost: the smoke worker only

    rows = [(g, score, rounds) for g, group in enumerate(groups) for score, rounds, _ in group["agent"]]
    group_ids = torch.tensor([g for g, _, _ in rows])
    rewards = torch.tensor([score for _, score, _ in rows])
    strata = torch.tensor([0 if single_stratum else rounds for _, _, rounds in rows])
    adv = stratified_advantages(rewards, group_ids, strata, alpha=alpha, eps=smoke.STRATIFIED_EPS, std_ddof=1)
    out: list[list[tuple[float, int, float]]] = [[] for _ in groups]
    for (g, score, rounds), a in zip(rows, adv.tolist()):
        out[g].append((score, rounds, a))
    return [sorted(triples) for triples in out]


def report(workdir: Path) -> str:
    """Strata per group, the advantage check, searches served, SORL's ‖C‖ per rank and wall time."""
    run = load_run(workdir)
    lines = []
    for step, groups in groups_by_step(run).items():
        m = run["metrics"][step]
        adv = [a for group in expected_advantages(groups) for _, _, a in group]
        flat = [a for group in expected_advantages(groups, single_stratum=True) for _, _, a in group]
        strata = [sorted(rounds for _, rounds, _ in group["agent"]) for group in groups]
        lines.append(
            f"step {step}: strata per group {strata}; num_turns/max {m.get('num_turns/max')}; logged advantages "
            f"max/min {m['critic/advantages/max']:.4f}/{m['critic/advantages/min']:.4f}, stratarl on the agent "
            f"loop's counts {max(adv):.4f}/{min(adv):.4f}, one stratum {max(flat):.4f}/{min(flat):.4f}"
        )
    rounds = sum(tool_rounds(record) for record in run["rewards"])
    calls = sum(int(record["tool_calls"]) for record in run["rewards"])
    served = run["server"]
    lines.append(
        f"searches: {rounds} tool rounds / {calls} tool calls recorded by the reward function over "
        f"{len(run['rewards'])} rollouts, {served['requests']} requests / {served['queries']} queries "
        f"served by stratarl serve; main_ppo wall time {served['main_ppo_wall_s']} s"
    )
    lines.extend(
        f"sorl step {record['call']} rank {record['rank']}/{record['world']}: ‖C‖ {record['c_norm']:.6g}, "
        f"scale {record['scale']:.6g}, params after step sha {record['params_sha'][:12]}"
        for record in run["ranks"]
    )
    return "\n".join(lines)


def grpo_advantages_on_dump(rows: list[dict]):
    """veRL's GRPO (ε 1e-6, Bessel std) on the rollout dump: groups = prompt text, rewards = dumped scores."""
    import torch  # start-up cost: the smoke worker only

    index: dict[str, int] = {}
    groups = torch.tensor([index.setdefault(row["input"], len(index)) for row in rows])
    rewards = torch.tensor([float(row["score"]) for row in rows])
    return grpo_advantages(rewards, groups, eps=1e-6, std_ddof=1)


def plain_tool_rounds(metrics: dict[str, float], rows: int) -> float:
    """Tool rounds in a step from veRL's own ``num_turns/mean`` over its rollouts: Σ (num_turns − 2) / 2."""
    return rows * (metrics["num_turns/mean"] - 2) / 2


def load_rollouts(workdir: Path, step: int) -> list[dict]:
    """veRL's rollout dump of one step (``trainer.rollout_data_dir``)."""
    return [json.loads(line) for line in (Path(workdir) / "rollouts" / f"{step}.jsonl").read_text().splitlines()]


def report_without_plugins(workdir: Path) -> str:
    """Per step: rollouts, tool rounds (veRL's num_turns), scores, veRL's GRPO advantages; searches served."""
    metrics = step_metrics((Path(workdir) / "main_ppo.log").read_text())
    server = json.loads((Path(workdir) / "server.json").read_text())
    lines, rounds = [], 0.0
    for step, m in metrics.items():
        rows = [row for row in load_rollouts(workdir, step) if not is_padding(row.get("uid", ""))]
        step_rounds = plain_tool_rounds(m, len(rows))
        rounds += step_rounds
        adv = grpo_advantages_on_dump(rows)
        lines.append(
            f"step {step}: {len(rows)} rollouts, {step_rounds:g} tool rounds (num_turns mean "
            f"{m['num_turns/mean']:g}, max {m['num_turns/max']:g}), score mean {m['critic/score/mean']:g}; "
            f"logged advantages max/min {m['critic/advantages/max']:.4f}/{m['critic/advantages/min']:.4f}, "
            f"veRL's GRPO on the dump {float(adv.max()):.4f}/{float(adv.min()):.4f}"
        )
    lines.append(
        f"searches: {rounds:g} tool rounds (veRL's num_turns), {server['requests']} requests / "
        f"{server['queries']} queries served by stratarl serve; main_ppo wall time {server['main_ppo_wall_s']} s"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, required=True, help="folder for model, data, log, rollouts, server")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default 2; 1 with --model smollm2)")
    parser.add_argument(
        "--loss-mode", default="sorl", choices=("sorl", "turn_ppo", "vanilla"), help="actor loss (default sorl)"
    )
    parser.add_argument(
        "--trainer",
        choices=smoke.TRAINERS,
        default="v1",
        help="veRL trainer: v1 (trainer.use_v1=true, veRL's default) or legacy (RayPPOTrainer)",
    )
    parser.add_argument("--ranks", type=int, default=1, help="FSDP2 data-parallel ranks on gloo (default 1)")
    parser.add_argument(
        "--model",
        choices=MODELS,
        default="tiny",
        help="tiny: the word-level bigram policy; smollm2: SmolLM2-135M-Instruct, warm-started to "
        "call the tool (one step, 2 prompts × 4; harness.smollm2)",
    )
    parser.add_argument(
        "--without-plugins",
        action="store_true",
        help="plain veRL: its grpo, vanilla loss and Search-R1 reward; only the recipe's search tool",
    )
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for main_ppo")
    args = parser.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    if compat.preflight():
        return 2
    steps = args.steps if args.steps is not None else (1 if args.model == "smollm2" else 2)
    code = run(
        args.workdir,
        steps=steps,
        loss_mode=args.loss_mode,
        trainer=args.trainer,
        n_ranks=args.ranks,
        plugins=not args.without_plugins,
        model=args.model,
        extra=args.overrides,
    )
    smoke.print_steps(args.workdir, code)
    if code == 0:
        print(report_without_plugins(args.workdir) if args.without_plugins else report(args.workdir))
        if (args.workdir / "warm_start.json").exists():
            print(f"warm start: {json.loads((args.workdir / 'warm_start.json').read_text())}")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
