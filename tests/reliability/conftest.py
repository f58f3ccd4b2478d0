"""A tiny run (3 steps, a checkpoint every step, so the last one is saved twice) shared by the
reliability tests, and a reward with variance written to a file (named by path, as a user would)."""

from __future__ import annotations

import pytest
from fault_injection import STEPS, TINY, FlakyServer, HangingServer

REWARD = """
def length_parity_reward(response_text, golds):
    return float(len(response_text) % 2 == 0)
"""


@pytest.fixture(scope="session")
def base_overrides(tmp_path_factory):
    root = tmp_path_factory.mktemp("reliability")
    (root / "reward.py").write_text(REWARD)
    return [
        f"data.synthetic.cache_dir={root / 'kb'}",
        f"algo.reward={root / 'reward.py'}:length_parity_reward",
        f"trainer.steps={STEPS}",
        "trainer.save_every=1",
        "trainer.keep_last=2",
        "logging.tensorboard=false",
        "logging.num_transcripts=0",
        "data.synthetic.options.num_train=8",
        "rollout.group_size=2",
        "trainer.epochs=1",
    ]


@pytest.fixture(scope="session")
def tiny_cfg(base_overrides):
    from stratarl.trainer.config import load_config

    return load_config(TINY, base_overrides)


@pytest.fixture(scope="session")
def straight_run(tiny_cfg, tmp_path_factory):
    """The uninterrupted run every resumed run must match bit for bit."""
    from stratarl.trainer.rl import train

    run_dir = tmp_path_factory.mktemp("straight") / "run"
    train(tiny_cfg, run_dir)
    return run_dir


@pytest.fixture
def flaky_server():
    """A /retrieve server that fails for a set number of requests, then answers (fault_injection.FlakyServer)."""
    server = FlakyServer()
    yield server
    server.close()


@pytest.fixture
def hanging_server():
    """A server that accepts connections and never answers (fault_injection.HangingServer)."""
    server = HangingServer()
    yield server
    server.close()


@pytest.fixture
def dead_url():
    """A loopback URL where nothing listens: connection refused."""
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return f"http://127.0.0.1:{port}/retrieve"
