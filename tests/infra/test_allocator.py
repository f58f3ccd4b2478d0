"""The glibc allocator setting: applied once, nothing computed changes, and the user can opt out."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = """
import ctypes, sys
from stratarl.infra import allocator
first = allocator.reuse_large_allocations()
print(first, allocator.reuse_large_allocations())
"""


def _run(env_value: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "STRATARL_SYSTEM_MALLOC"}
    if env_value is not None:
        env["STRATARL_SYSTEM_MALLOC"] = env_value
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt is a Linux setting")
def test_the_thresholds_are_set_once_and_the_environment_can_leave_them_alone():
    import platform

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("not glibc")
    assert _run(None) == "True True"
    assert _run("1") == "False False"  # opted out: nothing set, and it stays so
    assert _run("0") == "True True"


def test_tensors_allocated_after_the_setting_hold_what_was_written():
    # The setting changes where memory comes from, never what it holds: a large tensor freed and a new one
    # allocated in its place are written and read as any other.
    import torch

    from stratarl.infra.allocator import reuse_large_allocations

    reuse_large_allocations()
    for _ in range(3):
        zeros = torch.zeros(40 * 2**20 // 4)  # 40 MiB: above glibc's default mmap threshold
        assert int(zeros.count_nonzero()) == 0
        filled = torch.full((40 * 2**20 // 4,), 2.0)
        assert float(filled.sum()) == 2.0 * filled.numel()
        del zeros, filled
