"""CI and paired-difference math against hand computations, and the collapse detector."""

from __future__ import annotations

import itertools
import math

import pytest

from stratarl.evaluation.stats import (
    CollapseRule,
    collapse_step,
    detectable_difference,
    mean_ci,
    paired_difference,
    t_quantile_80,
    t_quantile_975,
)


@pytest.mark.parametrize("df, expected", [(1, 12.706), (2, 4.303), (4, 2.776), (10, 2.228), (29, 2.045), (30, 2.042)])
def test_t_table_values(df, expected):
    assert t_quantile_975(df) == expected


@pytest.mark.parametrize("df, expected", [(40, 2.021), (60, 2.000), (120, 1.980), (10_000, 1.960)])
def test_t_quantile_beyond_the_table_matches_published_values(df, expected):
    # Published t_{0.975} values (same NIST table, rows 40 / 60 / 120 / infinity), 3 decimals.
    assert abs(t_quantile_975(df) - expected) < 1.5e-3


def test_t_quantile_is_continuous_at_the_table_edge_and_decreasing():
    values = [t_quantile_975(df) for df in range(1, 200)]
    assert all(a >= b for a, b in itertools.pairwise(values))
    assert abs(t_quantile_975(31) - 2.040) < 1e-3  # published: 2.0395


def test_t_quantile_rejects_zero_df():
    with pytest.raises(ValueError, match="degrees of freedom"):
        t_quantile_975(0)


def test_mean_ci_hand_computation():
    # [1, 2, 3]: mean 2, sample std 1, half-width t_{0.975,2} * 1 / sqrt(3) = 4.303 / 1.7320508 = 2.484338
    ci = mean_ci([1.0, 2.0, 3.0])
    assert ci.mean == 2.0 and ci.n == 3
    assert math.isclose(ci.std, 1.0)
    assert math.isclose(ci.half_width, 4.303 / math.sqrt(3), rel_tol=1e-12)
    assert math.isclose(ci.low, 2.0 - 2.4843377, abs_tol=1e-6) and math.isclose(ci.high, 2.0 + 2.4843377, abs_tol=1e-6)


def test_mean_ci_single_value_has_no_interval_and_empty_has_no_mean():
    one = mean_ci([0.7])
    assert one.mean == 0.7 and one.n == 1 and one.half_width is None and one.low is None
    assert one.format() == "0.700 (n=1)"
    empty = mean_ci([])
    assert empty.mean is None and empty.n == 0 and empty.format() == "-"


def test_mean_ci_of_identical_values_has_zero_width():
    ci = mean_ci([0.5, 0.5, 0.5, 0.5])
    assert ci.half_width == 0.0 and ci.low == ci.high == 0.5


def test_mean_ci_rejects_nan():
    with pytest.raises(ValueError, match="non-finite"):
        mean_ci([1.0, float("nan")])


def test_paired_difference_hand_computation():
    arm = {0: 1.0, 1: 2.0, 2: 4.0}
    base = {0: 0.5, 1: 1.0, 2: 3.0, 3: 9.0}  # seed 3 has no partner: left out
    out = paired_difference(arm, base)
    assert out["seeds"] == [0, 1, 2] and out["differences"] == [0.5, 1.0, 1.0]
    # mean 5/6; deviations -1/3, 1/6, 1/6 -> s^2 = (1/9 + 1/36 + 1/36) / 2 = 1/12; half = 4.303 * sqrt(1/12) / sqrt(3)
    assert math.isclose(out["mean"], 5 / 6)
    assert math.isclose(out["std"], math.sqrt(1 / 12))
    assert math.isclose(out["half_width"], 4.303 * math.sqrt(1 / 12) / math.sqrt(3))


def test_pairing_removes_the_shared_seed_effect():
    # Seeds differ a lot, the arm is always exactly 0.1 better: the paired CI is 0 wide, the unpaired ones are not.
    base = {0: 0.1, 1: 0.5, 2: 0.9}
    arm = {s: v + 0.1 for s, v in base.items()}
    out = paired_difference(arm, base)
    assert math.isclose(out["mean"], 0.1) and out["half_width"] < 1e-12
    assert mean_ci(list(arm.values())).half_width > 0.5


def test_paired_difference_without_common_seeds():
    out = paired_difference({0: 1.0}, {1: 1.0})
    assert out["seeds"] == [] and out["mean"] is None


def test_collapse_by_reward_drop():
    rule = CollapseRule(window=1, drop_fraction=0.5, patience=2, min_peak=0.1)
    steps = [1, 2, 3, 4, 5, 6]
    reward = [0.2, 0.4, 0.3, 0.1, 0.1, 0.1]  # peak 0.4; below 0.2 from step 4 on, 2 in a row at step 5
    assert collapse_step(steps, reward, rule=rule) == {"step": 4, "reason": "reward"}


def test_no_collapse_when_the_drop_is_short_or_never_learned():
    rule = CollapseRule(window=1, drop_fraction=0.5, patience=3, min_peak=0.1)
    assert collapse_step([1, 2, 3, 4], [0.4, 0.1, 0.1, 0.4], rule=rule)["step"] is None  # 2-step dip < patience 3
    assert collapse_step([1, 2, 3, 4], [0.05, 0.0, 0.0, 0.0], rule=rule)["step"] is None  # peak below min_peak


def test_collapse_by_valid_action_rate_and_earliest_reason_wins():
    rule = CollapseRule(window=1, patience=2, min_valid_action_rate=0.5)
    out = collapse_step([1, 2, 3, 4, 5], [0.3, 0.3, 0.3, 0.0, 0.0], [0.9, 0.4, 0.3, 0.2, 0.1], rule=rule)
    assert out == {"step": 2, "reason": "valid_action"}


def test_collapse_smoothing_window():
    # One bad step inside a window of 3 does not pull the trailing mean below half the peak.
    rule = CollapseRule(window=3, drop_fraction=0.5, patience=1, min_peak=0.1)
    assert collapse_step([1, 2, 3, 4], [0.6, 0.6, 0.6, 0.0], rule=rule)["step"] is None


def test_a_run_that_never_had_valid_actions_has_not_collapsed():
    rule = CollapseRule(window=1, patience=2, min_valid_action_rate=0.5)
    assert collapse_step([1, 2, 3], [0.0, 0.0, 0.0], [0.2, 0.3, 0.1], rule=rule)["step"] is None


def test_collapse_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="one entry per step"):
        collapse_step([1, 2], [0.1])


@pytest.mark.parametrize("df, expected", [(1, 1.376), (4, 0.941), (30, 0.854), (40, 0.851), (60, 0.848), (120, 0.845)])
def test_t_80_quantiles_match_published_values(df, expected):
    # NIST table column 0.80 (rows 1, 4, 30 from the table; 40 / 60 / 120 through the expansion).
    assert abs(t_quantile_80(df) - expected) < 1.5e-3


def test_detectable_difference_by_hand():
    # 5 pairs, differences with std 0.1: (t_.975,4 + t_.80,4) * 0.1 / sqrt 5 = (2.776 + 0.941) * 0.0447214
    assert math.isclose(detectable_difference(0.1, 5), 3.717 * 0.1 / math.sqrt(5), rel_tol=1e-9)
    # four times the pairs: a smaller detectable effect (by more than half, as the t quantiles shrink too)
    assert detectable_difference(0.1, 20) < detectable_difference(0.1, 5) / 2
    assert detectable_difference(0.0, 5) == 0.0
    assert detectable_difference(None, 5) is None and detectable_difference(0.1, 1) is None
    with pytest.raises(ValueError, match="std"):
        detectable_difference(float("nan"), 5)
