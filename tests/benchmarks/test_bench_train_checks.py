"""bench_train's sanity checks: no utilisation above 100 % printed as a result, no TRL ratio when an arm
did no work."""

from __future__ import annotations

from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_train.py"


@pytest.fixture(scope="module")
def bench(load_script):
    return load_script(PATH, "bench_train_under_test")


def test_utilisation_above_the_peak_is_an_accounting_error(bench):
    assert bench.utilisation(50.0, 100.0) == "50.0% of matmul peak"
    assert bench.utilisation(127.0, 100.0).startswith("ACCOUNTING ERROR: 127%")


def test_no_ratio_without_real_work(bench):
    assert bench.real_work_error("TRL", [0.0, 0.0], [0.5, 0.4]).startswith("TRL: every reward was 0")
    assert bench.real_work_error("ours", [], [0.5]).startswith("ours: every reward was 0")
    assert "gradient norm 0" in bench.real_work_error("ours", [0.2, 0.0], [0.0, 0.0])
    assert bench.real_work_error("ours", [0.2, 0.0], [0.0, 0.3]) is None


def test_partial_credit_reward(bench):
    # A well-formed (think, then answer) wrong answer gets the format credit 0.2; no answer tag gets 0.
    assert bench.format_f1_reward("<think>a</think><answer>xyz</answer>", ["paris"]) == 0.2
    assert bench.format_f1_reward("no tags at all", ["paris"]) == 0.0
    # 'paris france' vs 'paris': precision 1/2, recall 1 -> F1 2/3; without <think> the format is invalid, and a
    # partial score is blended (make_format_reward): (1 - 0.2) * 2/3, never below a wrong answer's 0.
    assert bench.format_f1_reward("<answer>paris france</answer>", ["paris"]) == pytest.approx((1 - 0.2) * 2 / 3)


def test_search_credit(bench):
    # A completed search with no answer gets SEARCH_CREDIT; an unfinished one, or an answer written after a
    # search with nothing retrieved (a malformed turn, wrong here), gets less: rewards differ within a group.
    search = "<think> I need to search for this. </think>\n<search> Where was Duku born? </search>\n"
    assert bench.format_f1_reward(search, ["Quozen"]) == bench.SEARCH_CREDIT
    assert bench.format_f1_reward("<think> x </think>\n<search> Where was Duku", ["Quozen"]) == 0.0
    assert bench.format_f1_reward(search + "<answer> Duku </answer>", ["Quozen"]) < bench.SEARCH_CREDIT
