"""Reliability figures: kill -9 at seeded random points of a tiny run (the checkpoint writer and the
re-save of the last step included), resume, and compare with an uninterrupted run; then every bad
input of the table in tests/reliability/fault_injection.py.

    python benchmarks/bench_reliability.py                 # 40 kills, seed 0
    python benchmarks/bench_reliability.py --kills 100 --seed 3

Prints:

    kills survived: K / N         the resume started at or after the newest checkpoint that was
                                  complete before the kill (no completed work lost, no silent restart)
    resumes bit-exact: R / N      final weights and metrics.jsonl identical to the uninterrupted run
    bad inputs with clear errors: B / M   one error line naming the file, field or value; no traceback,
                                  no raw errno text, at most one "Fix:"
    outage steps without an update     a retriever failing for steps 2-3 of 4: no optimizer step there
    resumes after an outage bit-exact  stopped in an outage, resumed: ends where a run without it ends
    hanging server                     the worst step's search time vs retrieval.step_budget_s; exit 3
    slow clients closed                byte-by-byte requests closed by `serve --request-timeout`

The tests in tests/reliability/ run a small fixed subset of the same kills on every CI run.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "reliability"))
sys.path.insert(0, str(ROOT))  # the stratarl of this checkout, whichever one the environment installed

STEPS = 3
REWARD = "def length_parity_reward(response_text, golds):\n    return float(len(response_text) % 2 == 0)\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=40, help="kill points to try (default 40)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill points (default 0)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary run folders")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)
    from fault_injection import (
        bad_input_cases,
        clear_error,
        compare_runs,
        count_calls,
        random_targets,
        run_cli,
        run_killed,
    )

    from stratarl.trainer.config import load_config, save_config
    from stratarl.trainer.rl import train

    work = Path(tempfile.mkdtemp(prefix="stratarl-reliability-"))
    (work / "reward.py").write_text(REWARD)
    overrides = [
        f"data.synthetic.cache_dir={work / 'kb'}",
        f"algo.reward={work / 'reward.py'}:length_parity_reward",
        f"trainer.steps={STEPS}",
        "trainer.save_every=1",
        "logging.tensorboard=false",
        "logging.num_transcripts=0",
        "data.synthetic.options.num_train=8",
    ]
    cfg = load_config(ROOT / "configs" / "tiny.yaml", overrides)
    straight = work / "straight"
    train(cfg, straight)
    counts = count_calls(cfg, work / "count")
    targets = random_targets(counts, args.kills, seed=args.seed)

    survived = exact = 0
    failures = []
    for index, target in enumerate(targets):
        run_dir = work / f"kill{index}"
        killed, completed = run_killed(cfg, run_dir, target)
        try:
            summary = train(cfg, run_dir, resume=True, start_over=not completed)
        except Exception as error:
            failures.append(f"{target}: resume failed: {error}")
            continue
        if summary["start_step"] >= max(completed, default=0):
            survived += 1
        else:
            failures.append(f"{target}: resumed at step {summary['start_step']}, newest complete was {max(completed)}")
        problems = compare_runs(straight, run_dir, STEPS)
        exact += not problems
        if problems:
            failures.append(f"{target}: {problems}")
        if not killed:
            failures.append(f"{target}: the kill point was never reached")
        shutil.rmtree(run_dir, ignore_errors=True)

    no_ckpt = work / "no_checkpoint"
    no_ckpt.mkdir()
    save_config(cfg, no_ckpt / "config.yaml")
    cases = bad_input_cases(work / "bad", ROOT / "configs" / "tiny.yaml", work / "kb", no_ckpt, straight)
    clear = 0
    for name, argv, expected in cases:
        code, stderr = run_cli(argv)
        if clear_error(code, stderr, expected):
            clear += 1
        else:
            failures.append(f"bad input {name!r}: exit {code}, stderr {stderr[-300:]!r}")

    faults = retrieval_fault_figures(cfg, work, failures)
    slow = slow_client_figures(failures)

    print()
    for line in failures:
        print(f"FAIL {line}")
    print(f"kill points (seed {args.seed}): " + ", ".join(f"{n}#{i}/{w}" for n, i, w in targets))
    print(f"kills survived: {survived} / {len(targets)}")
    print(f"resumes bit-exact: {exact} / {len(targets)}")
    print(f"bad inputs with clear errors: {clear} / {len(cases)}")
    for line in (*faults, *slow):
        print(line)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


def _snapshot(run) -> dict:
    import copy

    return {
        "model": {k: v.detach().clone() for k, v in run.model.state_dict().items()},
        "optimizer": copy.deepcopy(run.learner.optimizer.state_dict()),
        "scheduler": copy.deepcopy(run.learner.scheduler.state_dict()),
    }


def _same(a: dict, b: dict) -> bool:
    import torch

    try:
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    except AssertionError:
        return False
    return True


def retrieval_fault_figures(cfg, work: Path, failures: list[str]) -> list[str]:
    """Items 1 and 2 of the retrieval faults: an outage of 2 steps (then a recovery) changes neither the
    weights nor the optimizer, a resume after an outage ends where a run without one ends, and a
    hanging server costs at most the step budget (+ margin) per step, then stops the run with exit 3."""
    import json

    from fault_injection import FlakyServer, HangingServer, compare_runs, remote_spec, scripted_parts

    from stratarl.trainer.config import load_config
    from stratarl.trainer.rl import train
    from stratarl.trainer.step import rl_step

    parts = scripted_parts()  # every run below samples with SearchThenAnswerGenerator
    flaky, hanging = FlakyServer(), HangingServer()
    lines = []
    try:
        before: dict[int, dict] = {}

        def spy(run):
            flaky.failing = run.step + 1 in (2, 3)
            before[run.step + 1] = _snapshot(run)
            return rl_step(run)

        outage = load_config(
            ROOT / "configs" / "tiny.yaml",
            [*fault_overrides(work), remote_spec(flaky.url, max_retries=0), "trainer.steps=4", "trainer.save_every=0"],
        )
        train(outage, work / "outage", parts=parts, step=spy)
        rows = [json.loads(x) for x in (work / "outage" / "metrics.jsonl").read_text().splitlines()]
        skipped = [int(r.get("update/skipped", 0)) for r in rows if "reward/mean" in r]
        untouched = _same(before[2], before[4]) and not _same(before[1], before[2])
        if skipped != [0, 1, 1, 0] or not untouched:
            failures.append(f"outage: skipped {skipped}, weights and optimizer untouched: {untouched}")
        lines.append(
            f"outage steps without an update: {sum(skipped[1:3])} / 2 (weights + optimizer unchanged: "
            f"{'yes' if untouched else 'NO'}; healthy steps updated: {2 - skipped[0] - skipped[3]} / 2)"
        )

        base = [*fault_overrides(work), remote_spec(flaky.url, max_retries=0), "trainer.steps=3"]
        flaky.failing = False
        train(load_config(ROOT / "configs" / "tiny.yaml", base), work / "no_outage", parts=parts)
        flaky.failing = True
        stopped = train(
            load_config(ROOT / "configs" / "tiny.yaml", [*base, "retrieval.max_failed_steps=1"]),
            work / "after_outage",
            parts=parts,
        )
        flaky.failing = False
        train(load_config(ROOT / "configs" / "tiny.yaml", base), work / "after_outage", resume=True, parts=parts)
        problems = compare_runs(work / "no_outage", work / "after_outage", 3)
        exact = stopped.get("checkpoint_step") == 0 and not problems
        if not exact:
            failures.append(f"resume after an outage: checkpoint step {stopped.get('checkpoint_step')}, {problems}")
        lines.append(f"resumes after an outage bit-exact: {int(exact)} / 1")

        budget, margin = 0.5, 1.0
        hang = load_config(
            ROOT / "configs" / "tiny.yaml",
            [
                *fault_overrides(work),
                remote_spec(hanging.url),
                "trainer.steps=5",
                "retrieval.max_failed_steps=2",
                f"retrieval.step_budget_s={budget}",
            ],
        )
        summary = train(hang, work / "hang", parts=parts)
        rows = [json.loads(x) for x in (work / "hang" / "metrics.jsonl").read_text().splitlines()]
        worst = max(r["time/retrieval"] for r in rows)
        message = summary.get("retrieval_failure", "")
        ok = (
            summary["exit_code"] == 3
            and worst <= budget + margin
            and hanging.url in message
            and "s spent in searches" in message
            and summary.get("checkpoint_step") == 0
        )
        if not ok:
            failures.append(
                f"hanging server: exit {summary['exit_code']}, worst step {worst:.2f} s, message {message!r}"
            )
        lines.append(
            f"hanging server: worst step {worst:.2f} s in searches (budget {budget} s + margin {margin} s), "
            f"stopped after {summary['steps']} steps with exit {summary['exit_code']}"
        )
    finally:
        flaky.close()
        hanging.close()
    return lines


def slow_client_figures(failures: list[str], clients: int = 100, timeout_s: float = 0.5) -> list[str]:
    """Item 4: ``clients`` sockets that send a request byte by byte (or nothing) are closed after the
    server's request timeout while normal clients are served."""
    import socket
    import threading
    import time

    import httpx

    from stratarl.retrieval.base import Passage
    from stratarl.retrieval.server import ServerThread, create_app

    class Echo:
        def search(self, queries, k):
            return [[Passage(f"{q}#0", q)] for q in queries]

    with ServerThread(create_app(Echo()), request_timeout_s=timeout_s) as running:
        host, port = running.url.removeprefix("http://").split(":")
        slow = [socket.create_connection((host, int(port))) for _ in range(clients)]
        stop = threading.Event()

        def trickle():
            while not stop.is_set():
                for sock in slow[::2]:
                    with contextlib.suppress(OSError):
                        sock.send(b"P")
                time.sleep(0.05)

        threading.Thread(target=trickle, daemon=True).start()
        served = sum(
            httpx.post(f"{running.url}/retrieve", json={"queries": ["a"], "topk": 1}, timeout=30).status_code == 200
            for _ in range(5)
        )
        closed = 0
        for sock in slow:
            sock.settimeout(30)
            try:
                closed += sock.recv(1) == b""
            except (ConnectionResetError, TimeoutError):
                closed += 0
            sock.close()
        stop.set()
    if closed != clients or served != 5:
        failures.append(f"slow clients: {closed} / {clients} closed, {served} / 5 normal requests served")
    return [
        (
            f"slow clients closed: {closed} / {clients} (--request-timeout {timeout_s} s); "
            f"normal requests served meanwhile: {served} / 5"
        )
    ]


def fault_overrides(work: Path) -> list[str]:
    """The tiny run of the retrieval-fault checks (a checkpoint every step, 8 questions, groups of 2)."""
    return [
        f"data.synthetic.cache_dir={work / 'kb'}",
        f"algo.reward={work / 'reward.py'}:length_parity_reward",
        "trainer.save_every=1",
        "logging.tensorboard=false",
        "logging.num_transcripts=0",
        "data.synthetic.options.num_train=8",
        "rollout.group_size=2",
        "trainer.epochs=1",
    ]


if __name__ == "__main__":
    main()
