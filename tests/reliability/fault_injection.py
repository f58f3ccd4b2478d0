"""Fault injection for the reliability tests and `benchmarks/bench_reliability.py`.

`run_killed` trains in a forked child that sends itself SIGKILL at a chosen point: the n-th call
of an instrumented function (a training step, or a piece of the checkpoint writer), before or
after it runs, or for a file writer after tearing its output in half. The parent then resumes the
run in-process and compares it with an uninterrupted run bit for bit (`compare_runs`).

Kill points are ``(name, n, when)``; `KILL_POINTS` lists the names. The child records every
checkpoint step whose `save_checkpoint` returned, so the parent knows the newest checkpoint the
resume must find (at least that one; never an older one, never step 0 by accident).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
from pathlib import Path

import torch
from safetensors.torch import load_file

from stratarl.rollout.generation import Generator

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"
STEPS = 3
"""The shared tiny run: 3 steps, a checkpoint every step (so the last one is saved twice)."""

KILL_POINTS = ("rl_step", "save_model", "torch.save", "os.replace", "write_manifest", "rmtree", "fsync")
WRITERS = ("save_model", "torch.save")  # "torn" tears the file they write


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _counting(name: str, real, target: tuple[str, int, str], counts: dict[str, int]):
    target_name, target_n, when = target

    def wrapper(*args, **kwargs):
        counts[name] = counts.get(name, 0) + 1
        hit = name == target_name and counts[name] == target_n
        if hit and when == "before":
            _die()
        out = real(*args, **kwargs)
        if hit and when == "torn":
            path = Path(args[1])  # save_model(model, filename), torch.save(obj, f)
            with open(path, "r+b") as f:
                f.truncate(max(1, path.stat().st_size // 2))
            _die()
        if hit:
            _die()
        return out

    return wrapper


def instrument(target: tuple[str, int, str], counts: dict[str, int], completed: Path | None = None):
    """Patch the file-system kill points in this process (meant for a forked child, or a counting dry run with a
    target that never fires); returns the RL step with its own kill point, to pass to ``train(step=...)``."""
    import shutil

    from stratarl.infra import checkpoint as ckpt
    from stratarl.trainer.step import rl_step

    ckpt.save_model = _counting("save_model", ckpt.save_model, target, counts)
    ckpt.torch.save = _counting("torch.save", torch.save, target, counts)
    ckpt.os.replace = _counting("os.replace", os.replace, target, counts)
    ckpt.os.fsync = _counting("fsync", os.fsync, target, counts)
    ckpt._write_manifest = _counting("write_manifest", ckpt._write_manifest, target, counts)
    ckpt.shutil.rmtree = _counting("rmtree", shutil.rmtree, target, counts)
    real_save = ckpt.save_checkpoint

    def recording_save(ckpt_dir, step, **kwargs):
        path = real_save(ckpt_dir, step, **kwargs)
        if completed is not None:
            with open(completed, "a") as f:
                f.write(f"{step}\n")
        return path

    ckpt.save_checkpoint = recording_save
    return _counting("rl_step", rl_step, target, counts)


def count_calls(cfg, run_dir: Path) -> dict[str, int]:
    """How often each kill point runs in an uninterrupted run (in a forked child, to keep this process
    unpatched)."""
    out = Path(run_dir).with_suffix(".counts.json")
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            from stratarl.trainer.rl import train

            counts: dict[str, int] = {}
            step = instrument(("", 0, "never"), counts)
            train(cfg, run_dir, step=step)
            out.write_text(json.dumps(counts))
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the counting run failed"
    return json.loads(out.read_text())


def run_killed(cfg, run_dir: Path, target: tuple[str, int, str], *, resume: bool = False) -> tuple[bool, list[int]]:
    """Train ``cfg`` in ``run_dir`` in a forked child killed at ``target``. Returns (whether the kill
    happened, steps whose checkpoint write completed before it)."""
    completed = Path(run_dir).with_suffix(".completed")
    completed.unlink(missing_ok=True)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            import sys

            sys.stdout = sys.stderr = open(os.devnull, "w")
            from stratarl.trainer.rl import train

            step = instrument(target, {}, completed)
            train(cfg, run_dir, resume=resume, step=step)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    steps = [int(x) for x in completed.read_text().split()] if completed.is_file() else []
    return killed, steps


def random_targets(counts: dict[str, int], n: int, seed: int) -> list[tuple[str, int, str]]:
    """``n`` seeded kill points: a kill point name drawn uniformly (so the many fsync calls do not
    crowd out the rest), then one of its calls in an uninterrupted run."""
    rng = random.Random(seed)
    names = [name for name in KILL_POINTS if counts.get(name, 0)]
    out = []
    for _ in range(n):
        name = rng.choice(names)
        i = rng.randint(1, counts[name])
        whens = ("before", "after", "torn") if name in WRITERS else ("before", "after")
        out.append((name, i, rng.choice(whens)))
    return out


def final_weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(Path(run_dir) / "checkpoints" / f"step_{step:06d}" / "model.safetensors"))


def compare_runs(straight: Path, resumed: Path, steps: int) -> list[str]:
    """What differs between an uninterrupted and a killed-then-resumed run ([] when bit-exact):
    final weights, and metrics.jsonl holding each step once with the same rewards."""
    problems = []
    a, b = final_weights(straight, steps), final_weights(resumed, steps)
    if a.keys() != b.keys() or any(not torch.equal(a[k], b[k]) for k in a):
        problems.append("final weights differ")
    rows_a = [json.loads(x) for x in (Path(straight) / "metrics.jsonl").read_text().splitlines()]
    rows_b = [json.loads(x) for x in (Path(resumed) / "metrics.jsonl").read_text().splitlines()]
    steps_b = [r["step"] for r in rows_b if "reward/mean" in r]
    if steps_b != list(range(1, steps + 1)):
        problems.append(f"metrics.jsonl training steps are {steps_b}")
    if [r.get("reward/mean") for r in rows_a] != [r.get("reward/mean") for r in rows_b]:
        problems.append("metrics.jsonl rewards differ")
    return problems


# --------------------------------------------------------------------------- bad inputs

HELD_SOCKETS: list = []
"""Listening sockets that make a port busy for the "port in use" case (closed with the process)."""


def bad_input_cases(
    root: Path, tiny_config: Path, kb_dir: Path, run_without_checkpoint: Path, trained_run: Path
) -> list[tuple]:
    """(name, argv, text the one-line error must contain) for every bad input, with the files they
    need written under ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    a_file = root / "a_file"
    a_file.write_text("not a folder\n")
    (root / "bad.jsonl").write_bytes(b'{"id": "0", "contents": "ok"}\n\xff\xfe broken\n')
    (root / "fake.jsonl.gz").write_text('{"id": "0", "contents": "plain text, not gzip"}\n')
    (root / "questions.jsonl").write_text('{"question": "who?", "golden_answers": ["me"]}\n')
    (root / "dup.yaml").write_text("trainer:\n  steps: 2\nalgo:\n  name: grpo\ntrainer:\n  seed: 1\n")
    (root / "binary.yaml").write_bytes(bytes(range(256)))
    corpus_dir = root / "corpus_dir"
    corpus_dir.mkdir(exist_ok=True)
    (corpus_dir / "corpus.jsonl").write_text('{"id": "0", "contents": "\\"T\\"\\nsome text"}\n')
    (root / "wrong_sig.py").write_text("def reward(text):\n    return 0.0\n")
    trained_copy = root / "trained_copy"  # the cases must not touch the run other checks compare with
    shutil.rmtree(trained_copy, ignore_errors=True)
    shutil.copytree(trained_run, trained_copy)
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    HELD_SOCKETS.append(busy)  # kept listening while the cases run
    busy_port = busy.getsockname()[1]
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    dead_url = f"http://127.0.0.1:{dead.getsockname()[1]}/retrieve"
    dead.close()  # nothing listens there now: connection refused
    tiny = [str(tiny_config), f"data.synthetic.cache_dir={kb_dir}"]
    train = ["train", *tiny, f"trainer.output_dir={root / 'runs'}"]
    cases = [
        ("optim.lr=inf", [*train, "optim.lr=.inf"], "optim.lr"),
        ("optim.lr=nan", [*train, "optim.lr=.nan"], "optim.lr"),
        ("algo.critic_lr=-1", [*train, "algo.critic_lr=-1"], "algo.critic_lr"),
        ("algo.value_clip=-1", [*train, "algo.value_clip=-1"], "algo.value_clip"),
        ("rollout.temperature=nan", [*train, "rollout.temperature=.nan"], "rollout.temperature"),
        ("retrieval.step_budget_s=0", [*train, "retrieval.step_budget_s=0"], "retrieval.step_budget_s"),
        (
            "reward with the wrong signature",
            [*train, f"algo.reward={root / 'wrong_sig.py'}:reward"],
            "cannot be called with 2",
        ),
        ("--run-dir under a file", ["train", *tiny, "--run-dir", str(a_file / "run")], "a_file"),
        ("trainer.output_dir is a file", ["train", *tiny, f"trainer.output_dir={a_file}"], "a_file"),
        ("duplicate YAML key", ["train", str(root / "dup.yaml")], "key `trainer` appears twice"),
        ("binary YAML", ["train", str(root / "binary.yaml")], "is not UTF-8 text"),
        ("--resume without a checkpoint", ["train", "--resume", str(run_without_checkpoint)], "no intact checkpoint"),
        ("--start-over without --resume", [*train, "--start-over"], "--start-over only applies"),
        ("eval a run without a checkpoint", ["eval", str(run_without_checkpoint)], "no loadable checkpoint"),
        ("eval --out under a file", ["eval", str(trained_run), "--out", str(a_file / "eval")], "a_file"),
        (
            "serve --port 99999",
            ["serve", "--corpus", str(corpus_dir / "corpus.jsonl"), "--port", "99999"],
            "--port 99999",
        ),
        (
            "index build over its own corpus",
            ["index", "build", "--corpus", str(corpus_dir / "corpus.jsonl"), "--out", str(corpus_dir)],
            f"e.g. --out {corpus_dir / 'corpus_index'}",
        ),
        (
            "serve on a port in use",
            ["serve", "--corpus", str(corpus_dir / "corpus.jsonl"), "--port", str(busy_port)],
            f"--port {busy_port}: 127.0.0.1:{busy_port} is already in use",
        ),
        (
            "--resume with another model size",
            ["train", "--resume", str(trained_copy), "model.tiny_hidden_size=32"],
            (
                f"is [64, 64] there but [32, 32] in this one and 19 more. Fix: use the model settings the run was trained "
                f"with (model.* in {trained_copy / 'config.yaml'})"
            ),
        ),
        (
            "serve --request-timeout 0",
            ["serve", "--corpus", str(corpus_dir / "corpus.jsonl"), "--request-timeout", "0"],
            "--request-timeout 0.0: must be a positive number of seconds. Fix: use e.g. 5",
        ),
        (
            "train against a dead retriever",
            [*train, f"retrieval.spec={dead_url}"],
            f"the probe search to {dead_url} failed (ConnectError: Connection refused)",
        ),
        (
            "eval against a dead retriever",
            ["eval", str(trained_copy), f"retrieval.spec={dead_url}"],
            f"the probe search to {dead_url} failed (ConnectError: Connection refused)",
        ),
        (
            "non-UTF-8 corpus",
            ["index", "build", "--corpus", str(root / "bad.jsonl"), "--out", str(root / "idx")],
            "bad.jsonl, line 2: not UTF-8",
        ),
        (
            "plain file named .jsonl.gz",
            ["index", "build", "--corpus", str(root / "fake.jsonl.gz"), "--out", str(root / "idx")],
            "fake.jsonl.gz: not a readable gzip file",
        ),
        ("data inspect a non-UTF-8 corpus", ["data", "inspect", str(root / "bad.jsonl")], "line 2: not UTF-8"),
        ("data synth --out is a file", ["data", "synth", "--out", str(a_file)], "is a file"),
        (
            "data synth --num-train -1",
            ["data", "synth", "--out", str(root / "synth"), "--num-train", "-1"],
            "--num-train -1",
        ),
        (
            "data convert to a path under a file",
            ["data", "convert", str(root / "questions.jsonl"), str(a_file / "out.jsonl")],
            "a_file",
        ),
    ]
    if not torch.cuda.is_available():
        cases.append(("trainer.device=cuda on a CPU build", [*train, "trainer.device=cuda"], "trainer.device"))
    return cases


def run_cli(argv: list[str]) -> tuple[int, str]:
    """`stratarl ARGV` in this process: (exit code, stderr). An exception escaping main is returned
    as its traceback text (what a user would see)."""
    import contextlib
    import io
    import traceback

    from stratarl.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as error:
            code = error.code if isinstance(error.code, int) else 1
        except Exception:
            return 1, err.getvalue() + traceback.format_exc()
    return code, err.getvalue()


def clear_error(code: int, stderr: str, expected: str) -> bool:
    """A non-zero exit, no traceback, and exactly one error line, which contains ``expected``, no raw
    errno text, and at most one fix."""
    lines = [line for line in stderr.splitlines() if "error:" in line]
    return (
        code != 0
        and "Traceback" not in stderr
        and len(lines) == 1
        and expected in lines[0]
        and lines[0].count("Fix:") <= 1
        and "[Errno" not in lines[0]
    )


# --------------------------------------------------------------------------- retrieval servers that fail


class FlakyServer:
    """A /retrieve server on 127.0.0.1 that answers every query with one passage, or with HTTP 500
    while ``failing`` is true (an outage the test switches on and off)."""

    def __init__(self) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        owner = self
        self.failing = False

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if owner.failing:
                    status, payload = 500, b'{"error": "outage"}'
                else:
                    hits = [
                        [{"document": {"id": "0", "contents": '"T"\nsome text'}, "score": 1.0}] for _ in body["queries"]
                    ]
                    status, payload = 200, json.dumps({"result": hits}).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/retrieve"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class HangingServer:
    """Accepts connections on 127.0.0.1 and never answers; keeps (and counts) them."""

    def __init__(self) -> None:
        import socket
        import threading

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.connections: list = []
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/retrieve"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections.append(conn)

    def close(self) -> None:
        self.sock.close()
        for conn in self.connections:
            conn.close()


class SearchThenAnswerGenerator(Generator):
    """A scripted policy: every first turn searches, every second turn answers with 1 to 3 letters (varied
    call by call, so a group's rewards differ and a healthy update moves the weights)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.calls = 0

    def generate(self, prompts, params, max_new_tokens=None):
        from stratarl.rollout.generation import Generation

        budgets = list(max_new_tokens) if max_new_tokens is not None else [params.max_new_tokens] * len(prompts)
        out = []
        for prompt, budget in zip(prompts, budgets):
            self.calls += 1
            searched = "</information>" in self.tokenizer.decode(prompt[-24:])  # an observation just ended
            text = f"<answer> {'x' * (1 + self.calls % 3)} </answer>" if searched else "<search> who wrote it </search>"
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"][:budget]
            out.append(Generation(ids, [-1.0] * len(ids), "stop", "</answer>" if searched else "</search>"))
        return out


def scripted_parts():
    """Run parts whose rollouts come from `SearchThenAnswerGenerator` (the real model still trains)."""
    from stratarl.trainer.run import RunParts

    return RunParts(
        make_generator=lambda model, tokenizer, backend, seed, **kwargs: SearchThenAnswerGenerator(tokenizer)
    )


def scripted_policy(monkeypatch) -> None:
    """Runs the command line builds (no `parts` of their own) use `scripted_parts`: through the one seam the
    trainer has for that, `stratarl.trainer.run.DEFAULT_PARTS`."""
    from stratarl.trainer import run

    monkeypatch.setattr(run, "DEFAULT_PARTS", scripted_parts())


def remote_spec(url: str, **options) -> str:
    """A `retrieval.spec=` override for the remote retriever at ``url`` (one retry, short backoff)."""
    return "retrieval.spec=" + json.dumps(
        {"kind": "remote", "url": url, "timeout_s": 5, "max_retries": 1, "backoff_s": 0.01, **options}
    )
