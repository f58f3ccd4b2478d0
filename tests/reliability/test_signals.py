"""SIGTERM and SIGHUP stop `stratarl train` like Ctrl-C: the step in flight finishes, a checkpoint is
written, the exit code is 128 + the signal number, and the printed resume command, run exactly as
printed, finishes the run."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fault_injection import TINY

pytestmark = [pytest.mark.slow, pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")]

# The reward blocks at the first rollout of step 2 until the test has sent its signal: the signal
# always lands inside a step, whatever the machine's speed.
GATED_REWARD = """
import os, pathlib, time
CALLS = [0]

def reward(response_text, golds):
    CALLS[0] += 1
    sync = pathlib.Path(os.environ["STRATARL_TEST_SYNC"])
    if CALLS[0] == 5 and not (sync / "go").exists():  # 2 prompts x 2 rollouts per step
        (sync / "ready").touch()
        deadline = time.monotonic() + 120
        while not (sync / "go").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
    return float(len(response_text) % 2 == 0)
"""


def _wait_for(path: Path, proc: subprocess.Popen, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"train exited early ({proc.returncode}): {proc.stderr.read()}")
        assert time.monotonic() < deadline, "the run never reached step 2 (hang)"
        time.sleep(0.02)


def _start(tmp_path, run_dir, kb_override):
    sync = tmp_path / "sync"
    sync.mkdir(exist_ok=True)
    (tmp_path / "gated.py").write_text(GATED_REWARD)
    env = {**os.environ, "STRATARL_TEST_SYNC": str(sync)}
    overrides = [
        kb_override,
        f"algo.reward={tmp_path / 'gated.py'}:reward",
        "trainer.steps=4",
        "trainer.epochs=1",
        "rollout.group_size=2",
        "logging.tensorboard=false",
        "data.synthetic.options.num_train=8",
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "stratarl.cli", "train", str(TINY), *overrides, "--run-dir", str(run_dir)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return proc, sync, env


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_each_stop_signal_is_caught_once_then_aborts(signum, capsys):
    from stratarl.trainer.stops import GracefulInterrupt

    with GracefulInterrupt() as interrupt:
        signal.raise_signal(signum)
        assert interrupt.requested and interrupt.exit_code == 128 + signum
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signum)
    assert signal.getsignal(signum) is not interrupt._handle
    shown = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
    assert f"{shown}: finishing this step" in capsys.readouterr().err


def test_sigterm_checkpoints_and_the_printed_resume_command_works(tmp_path, base_overrides, straight_run):
    signum = signal.SIGTERM
    run_dir = tmp_path / "run dir"  # a space: the printed command must quote it
    # straight_run has generated the shared knowledge base already: the subprocesses only read it.
    proc, sync, env = _start(
        tmp_path, run_dir, next(o for o in base_overrides if o.startswith("data.synthetic.cache_dir"))
    )
    _wait_for(sync / "ready", proc)
    proc.send_signal(signum)
    (sync / "go").touch()
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 128 + signum, err
    assert f"{signal.Signals(signum).name}: finishing this step" in err
    assert (run_dir / "checkpoints" / "step_000002" / "manifest.json").is_file()
    line = next(x for x in out.splitlines() if "resume with `" in x)
    command = shlex.split(line.split("`")[1])
    assert command[:3] == ["stratarl", "train", "--resume"]
    resumed = subprocess.run(
        [sys.executable, "-m", "stratarl.cli", *command[1:]], env=env, capture_output=True, text=True, timeout=180
    )
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout and "(step 2)" in resumed.stdout
    steps = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]


def test_a_second_ctrl_c_aborts_in_one_line_without_a_traceback(tmp_path, base_overrides):
    from fault_injection import run_cli

    # The config's own reward function (algo.reward) is where the two Ctrl-C arrive, inside the first step.
    reward = tmp_path / "interrupting_reward.py"
    reward.write_text(
        "import signal\n\n\ndef reward(response_text, golds):\n"
        "    signal.raise_signal(signal.SIGINT)  # the first: finish the step and save\n"
        "    signal.raise_signal(signal.SIGINT)  # the second: abort now\n"
        "    raise AssertionError('the second Ctrl-C did not abort')\n"
    )
    code, err = run_cli(
        ["train", str(TINY), *base_overrides, f"algo.reward={reward}:reward", "--run-dir", str(tmp_path / "run")]
    )
    assert code == 130 and "Traceback" not in err and "KeyboardInterrupt" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[-1] == (
        "stratarl train: aborted without saving this step; `stratarl train --resume RUN_DIR` "
        "continues from the newest checkpoint"
    )
    assert lines[-2].startswith("Ctrl-C: finishing this step")
