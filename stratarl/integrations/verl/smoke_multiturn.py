"""veRL's trainer on real multi-turn search, on a CPU: ``tool_agent`` loop, hf server, ``stratarl serve``.

    python -m stratarl.integrations.verl.smoke_multiturn --workdir /tmp/verl-mt [--steps 2] [overrides…]

What :mod:`stratarl.integrations.verl.smoke` runs, but multi-turn: veRL's ``tool_agent`` loop with
the ``hermes`` parser, the recipe's search tool (``recipes/verl/search_tool.py``) against a real
``stratarl serve`` (BM25 over :data:`CORPUS`, on 127.0.0.1, a free port), and a policy that calls it
some of the time (:mod:`stratarl.integrations.verl.agent_model`: after each ``assistant`` it searches
or answers with equal odds, so a group of 6 usually holds several search counts). Groups of 6,
``algorithm.adv_estimator=stratified_grpo`` and ``policy_loss.loss_mode=sorl`` (``--loss-mode`` to
change), at most 4 assistant turns, responses of at most :data:`RESPONSE_LENGTH` tokens (enough for
3 searches, so no tool response is dropped). Files in ``--workdir``: ``main_ppo.log``,
``rollouts/<step>.jsonl`` (veRL's dump, with the reward function's ``tool_calls`` and ``num_turns``),
``strata.jsonl`` (what the estimator saw: uid, stratum, reward, advantage per rollout) and
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

from stratarl.algos import stratified_advantages
from stratarl.integrations.verl import smoke
from stratarl.integrations.verl.advantage import DUMP_ENV
from stratarl.integrations.verl.agent_model import build_agent_model

REPO = Path(__file__).resolve().parents[3]
GROUP_SIZE = 6
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


def write_corpus(path: Path) -> Path:
    """A Search-R1 corpus jsonl (``{"id", "contents": "\\"Title\\"\\ntext"}``) of :data:`CORPUS`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"id": str(i), "contents": f'"{title}"\n{text}'}) for i, (title, text) in enumerate(CORPUS)]
    path.write_text("\n".join(lines) + "\n")
    return path


def write_data(folder: Path) -> tuple[Path, Path]:
    """train.parquet (:data:`QUESTIONS`, gold Paris) and val.parquet in veRL's format, ``agent_name: tool_agent``."""
    import pyarrow as pa  # start-up cost: only when a data file is written
    import pyarrow.parquet as pq  # start-up cost: only when a data file is written

    folder.mkdir(parents=True, exist_ok=True)
    rows = [
        {
            "data_source": "searchR1_nq",
            "prompt": [{"role": "user", "content": f"Question: {question}"}],
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
            probe = subprocess.run([python, "-c", "import bm25s"], capture_output=True)
            if probe.returncode == 0:
                return python
    raise RuntimeError(
        "no interpreter with bm25s for `stratarl serve`: set STRATARL_SERVE_PYTHON to stratarl's main "
        "environment (e.g. .venv/bin/python after `make test`)"
    )


def free_port() -> int:
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
        [serve_python(), "-m", "stratarl.cli", "serve", "--corpus", str(corpus), "--host", "127.0.0.1",
         "--port", str(port), "--topk", str(TOPK), "--log-level", "warning"],
        cwd=REPO, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
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


def with_overrides(base: list[str], extra: list[str]) -> list[str]:
    """``base`` Hydra overrides with the keys of ``extra`` replaced (Hydra refuses a key given twice)."""
    def key(item: str) -> str:
        return item.split("=", 1)[0].lstrip("+")

    replaced = {key(item) for item in extra}
    return [item for item in base if key(item) not in replaced] + extra


def main_ppo_overrides(workdir: Path, url: str, *, steps: int = 2, loss_mode: str = "sorl") -> list[str]:
    """Hydra overrides: the single-turn smoke's, made multi-turn (see the module doc)."""
    env = "+ray_kwargs.ray_init.runtime_env.env_vars"
    base = smoke.main_ppo_overrides(workdir, steps=steps, group_size=GROUP_SIZE)
    sorl = loss_mode == "sorl"
    if loss_mode not in ("sorl", "turn_ppo"):  # veRL's own loss: veRL's config class, no δ
        base = [item for item in base if "policy_loss._target_" not in item and "sorl_delta" not in item]
    return with_overrides(base, [
        "data.max_prompt_length=32",
        f"data.max_response_length={RESPONSE_LENGTH}",
        "data.return_raw_chat=true",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={GROUP_SIZE}",
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
        f"{env}.{DUMP_ENV}={workdir / 'strata.jsonl'}",
    ])


def run(workdir: Path, *, steps: int = 2, loss_mode: str = "sorl", extra: list[str] | None = None,
        timeout_s: float = 900) -> int:
    """Build model, data and corpus, serve the corpus, run main_ppo; writes the files of the module doc."""
    workdir = workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    build_agent_model(workdir / "model")
    write_data(workdir / "data")
    (workdir / "strata.jsonl").unlink(missing_ok=True)
    server, url = start_server(write_corpus(workdir / "corpus.jsonl"), workdir / "server.log")
    try:
        env = {
            **os.environ,
            "VERL_USE_EXTERNAL_MODULES": smoke.PLUGINS,
            "VERL_PLATFORM": "stratarl_cpu",
            "PYTHONPATH": smoke.pythonpath(),
            "HYDRA_FULL_ERROR": "1",
            "RAY_DEDUP_LOGS": "0",
            "TOKENIZERS_PARALLELISM": "false",
        }
        overrides = with_overrides(main_ppo_overrides(workdir, url, steps=steps, loss_mode=loss_mode), extra or [])
        command = [sys.executable, "-m", "verl.trainer.main_ppo", *overrides]
        for _attempt in range(RAY_START_ATTEMPTS):
            started = time.monotonic()
            with open(workdir / "main_ppo.log", "w") as out:
                result = subprocess.run(command, env=env, cwd=workdir, stdout=out, stderr=subprocess.STDOUT,
                                        timeout=timeout_s)
            if result.returncode == 0 or RAY_START_TIMEOUT not in (workdir / "main_ppo.log").read_text():
                break
        stats = health(url + "/health")["stats"]
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
    """The run's files: ``metrics`` {step: …}, ``rollouts`` {step: rows}, ``estimator`` [one record a step], ``server``."""
    workdir = Path(workdir)
    metrics = step_metrics((workdir / "main_ppo.log").read_text())
    rollouts = {
        step: [json.loads(line) for line in (workdir / "rollouts" / f"{step}.jsonl").read_text().splitlines()]
        for step in metrics
    }
    strata_file = workdir / "strata.jsonl"
    estimator = [json.loads(line) for line in strata_file.read_text().splitlines()] if strata_file.exists() else []
    server = json.loads((workdir / "server.json").read_text())
    return {"metrics": metrics, "rollouts": rollouts, "estimator": estimator, "server": server}


def tool_rounds(row: dict) -> int:
    """Tool rounds of a dumped rollout from the agent loop's own count: (num_turns − 2) / 2."""
    return (int(row["num_turns"]) - 2) // 2


def expected_advantages(rows: list[dict], *, single_stratum: bool = False, alpha: float = 0.6):
    """stratarl's Stratified GRPO on dumped rows: groups = prompt text, strata = :func:`tool_rounds`."""
    import torch  # start-up cost: the smoke worker only

    index: dict[str, int] = {}
    groups = torch.tensor([index.setdefault(row["input"], len(index)) for row in rows])
    strata = torch.tensor([0 if single_stratum else tool_rounds(row) for row in rows])
    rewards = torch.tensor([float(row["score"]) for row in rows])
    return stratified_advantages(rewards, groups, strata, alpha=alpha, eps=smoke.STRATIFIED_EPS, std_ddof=1)


def report(workdir: Path) -> str:
    """Strata per group, the advantage check, searches served and wall time, one line each."""
    run = load_run(workdir)
    lines = []
    for step, rows in run["rollouts"].items():
        m = run["metrics"][step]
        per_group: dict[str, list[int]] = {}
        for row in rows:
            per_group.setdefault(row["input"], []).append(tool_rounds(row))
        adv, flat = expected_advantages(rows), expected_advantages(rows, single_stratum=True)
        lines.append(
            f"step {step}: strata per group {[sorted(v) for v in per_group.values()]}; "
            f"num_turns/max {m.get('num_turns/max')}; logged advantages max/min "
            f"{m['critic/advantages/max']:.4f}/{m['critic/advantages/min']:.4f}, stratarl on the dump "
            f"{float(adv.max()):.4f}/{float(adv.min()):.4f}, one stratum {float(flat.max()):.4f}/{float(flat.min()):.4f}"
        )
    calls = sum(int(row["tool_calls"]) for rows in run["rollouts"].values() for row in rows)
    served = run["server"]
    lines.append(f"searches: {calls} tool calls recorded by the reward function, {served['requests']} requests / "
                 f"{served['queries']} queries served by stratarl serve; main_ppo wall time {served['main_ppo_wall_s']} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, required=True, help="folder for model, data, log, rollouts, server")
    parser.add_argument("--steps", type=int, default=2, help="training steps (default 2)")
    parser.add_argument("--loss-mode", default="sorl", choices=("sorl", "turn_ppo", "vanilla"),
                        help="actor loss (default sorl)")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for main_ppo")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    code = run(args.workdir, steps=args.steps, loss_mode=args.loss_mode, extra=args.overrides)
    smoke.print_steps(args.workdir, code)
    if code == 0:
        print(report(args.workdir))
    return code


if __name__ == "__main__":
    raise SystemExit(main())
