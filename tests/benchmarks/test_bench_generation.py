"""The generation benchmark's arithmetic: no division by a near-zero decode time, and a
decode limit that names the bound that binds."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_generation.py"


@pytest.fixture(scope="module")
def bench(load_script):
    return load_script(BENCH, "bench_generation")


def test_decode_rate_is_none_without_a_timeable_decode_phase(bench):
    assert bench.decode_rate(8, 64, 2.0) == pytest.approx(8 * 63 / 2.0)
    assert bench.decode_rate(1, 64, 1e-9) is None  # the old 63000000000.0 tok/s
    assert bench.decode_rate(1, 64, None) is None
    assert bench.decode_rate(8, 1, 2.0) is None  # one token: no decode step at all


def test_step_limit_reads_weights_and_kv_cache_or_is_compute_bound(bench):
    config = SimpleNamespace(num_attention_heads=2, num_key_value_heads=1, hidden_size=8, num_hidden_layers=3)
    # head_dim 4; K and V: 2 * 3 layers * batch 2 * 1 head * 10 tokens * 4 dims * 4 bytes = 1920 bytes,
    # plus 80 weight bytes = 2000 bytes at 1000 B/s.
    seconds, bound = bench.step_limit(
        config, weight_bytes=80, params=100, batch=2, context=10, bandwidth=1000.0, flops=1e9
    )
    assert (seconds, bound) == (pytest.approx(2.0), "memory")
    # FLOPs: 2 * 100 * 2 + attention 4 * 3 * 2 * 2 * 4 * 10 = 400 + 1920 = 2320 at 1000 FLOP/s.
    seconds, bound = bench.step_limit(
        config, weight_bytes=80, params=100, batch=2, context=10, bandwidth=1e9, flops=1000.0
    )
    assert (seconds, bound) == (pytest.approx(2.32), "compute")


def test_rates_above_the_limit_are_flagged(bench):
    assert bench.fmt(12.0, 6, limit=10.0).strip() == "12.0!"
    assert bench.fmt(8.0, 6, limit=10.0).strip() == "8.0"
    assert bench.fmt(None, 6).strip() == "n/a"
