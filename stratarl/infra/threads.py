"""How many intra-op threads a forward / backward pass uses."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch


def set_threads(num_threads: int) -> int:
    n = num_threads or os.cpu_count() or 1
    torch.set_num_threads(n)
    return n


# Policies below this many parameters run their RL step (and warm start, eval) on one intra-op thread, whatever
# trainer.num_threads says: each of the step's ~10^4 ops takes microseconds, too little to split,
# and on a machine whose other core is busy every parallel op waits for a descheduled thread
# (lab config, 0.3 M parameters, a loaded 2-core machine: 11.9 s a step on 2 threads, 0.82 s on 1).
SINGLE_THREAD_MAX_PARAMS = 5_000_000


@contextmanager
def step_threads(model: torch.nn.Module) -> Iterator[None]:
    """One intra-op thread for a policy under ``SINGLE_THREAD_MAX_PARAMS`` parameters, restored after."""
    before = torch.get_num_threads()
    small = sum(p.numel() for p in model.parameters()) < SINGLE_THREAD_MAX_PARAMS
    if small and before > 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)
