"""Small-sample statistics for comparing training runs over seeds (no scipy).

- :func:`t_quantile_975`: the two-sided 95% Student-t critical value t_{0.975, df}.
- :func:`mean_ci`: mean with a 95% Student-t confidence interval over seeds.
- :func:`paired_difference`: arm minus baseline on the same seeds (same data order), with the
  95% CI of the paired differences.
- :func:`paired_gain`: after minus before on the same held-out questions (paired by example id),
  paired Student-t 95% CI, and whether that CI excludes 0 (:func:`excludes_zero`).
- :func:`rolling_band`: a moving mean (trailing or centered) of a per-step curve ± 1.96 standard errors.
- :func:`collapse_step`: the step at which a run collapsed (reward falls far below its running
  peak, or the valid-action rate drops), the SORL paper's failure mode, made a number.

With one seed there is no spread to estimate: CIs are ``None`` (JSON null), never a fake 0.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

_Id = TypeVar("_Id", int, str)  # a pairing key: a seed or a question id

# t_{0.975, df} for df = 1..30, to 3 decimals: the standard Student-t table (NIST/SEMATECH
# e-Handbook of Statistical Methods, §1.3.6.7.2 "Critical values of the Student's t distribution",
# column 0.975). Beyond 30 the Cornish-Fisher expansion below is accurate to better than 1e-3.
T_975 = (
    12.706,
    4.303,
    3.182,
    2.776,
    2.571,
    2.447,
    2.365,
    2.306,
    2.262,
    2.228,
    2.201,
    2.179,
    2.160,
    2.145,
    2.131,
    2.120,
    2.110,
    2.101,
    2.093,
    2.086,
    2.080,
    2.074,
    2.069,
    2.064,
    2.060,
    2.056,
    2.052,
    2.048,
    2.045,
    2.042,
)
Z_975 = 1.959963984540054
# t_{0.80, df} for df = 1..30 (one-sided 80% power), to 3 decimals: the same table's column 0.80.
T_80 = (
    1.376,
    1.061,
    0.978,
    0.941,
    0.920,
    0.906,
    0.896,
    0.889,
    0.883,
    0.879,
    0.876,
    0.873,
    0.870,
    0.868,
    0.866,
    0.865,
    0.863,
    0.862,
    0.861,
    0.860,
    0.859,
    0.858,
    0.858,
    0.857,
    0.856,
    0.856,
    0.855,
    0.855,
    0.854,
    0.854,
)
Z_80 = 0.8416212335729143


def t_quantile_975(df: int) -> float:
    """t_{0.975, df}: table for df <= 30, else z + (z³+z)/(4df) + (5z⁵+16z³+3z)/(96df²) + (3z⁷+19z⁵+17z³−15z)/(384df³)
    (Cornish-Fisher expansion of the t quantile; Abramowitz & Stegun 26.7.5)."""
    return _t_quantile(df, T_975, Z_975)


def t_quantile_80(df: int) -> float:
    """t_{0.80, df}: table for df <= 30, else the Cornish-Fisher expansion of :func:`t_quantile_975` at z_{0.80}."""
    return _t_quantile(df, T_80, Z_80)


def _t_quantile(df: int, table: Sequence[float], z: float) -> float:
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if df <= len(table):
        return table[df - 1]
    return (
        z
        + (z**3 + z) / (4 * df)
        + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
        + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3)
    )


def detectable_difference(std: float | None, n: int) -> float | None:
    """Smallest true mean difference a paired design of ``n`` pairs with difference spread ``std`` detects
    with 80% power at two-sided 5%: (t_{0.975, n−1} + t_{0.80, n−1}) · std / √n (the standard
    minimum-detectable-effect formula for a one-sample t-test on the differences, treating ``std`` as
    known). None when it cannot be computed (n < 2 or no std)."""
    if std is None or n < 2:
        return None
    if not math.isfinite(std) or std < 0:
        raise ValueError(f"std must be finite and >= 0, got {std}")
    return (t_quantile_975(n - 1) + t_quantile_80(n - 1)) * std / math.sqrt(n)


@dataclass
class Interval:
    """Mean of n values with its 95% CI (``low`` / ``high`` / ``half_width`` are None when n < 2)."""

    mean: float | None
    n: int
    std: float | None = None
    half_width: float | None = None
    low: float | None = None
    high: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    def format(self, digits: int = 3) -> str:
        if self.mean is None:
            return "-"
        if self.half_width is None:
            return f"{self.mean:.{digits}f} (n={self.n})"
        return f"{self.mean:.{digits}f} ± {self.half_width:.{digits}f}"


def mean_ci(values: Sequence[float]) -> Interval:
    """Mean and 95% Student-t CI: mean ± t_{0.975, n−1} · s / √n, s the sample std (ddof 1).

    Empty input gives mean None; n = 1 gives the value with no interval; non-finite values
    are rejected (a NaN metric should be noticed, not averaged away).
    """
    xs = [float(v) for v in values]
    if any(not math.isfinite(v) for v in xs):
        raise ValueError(f"mean_ci got non-finite values {xs}")
    n = len(xs)
    if n == 0:
        return Interval(None, 0)
    mean = sum(xs) / n
    if n == 1:
        return Interval(mean, 1)
    std = math.sqrt(sum((v - mean) ** 2 for v in xs) / (n - 1))
    half = t_quantile_975(n - 1) * std / math.sqrt(n)
    return Interval(mean, n, std, half, mean - half, mean + half)


def paired_difference(arm: dict[_Id, float], baseline: dict[_Id, float]) -> dict[str, Any]:
    """Arm − baseline over the seeds both have: mean difference and the 95% CI of the differences.

    Pairing removes the seed-to-seed spread both runs share (same data order, same initial
    weights), so it is tighter than comparing two independent CIs. Returns
    ``{"seeds": [...], "differences": [...], **Interval}``; with no common seed, mean None.
    """
    seeds = sorted(set(arm) & set(baseline))
    diffs = [arm[s] - baseline[s] for s in seeds]
    return {"seeds": seeds, "differences": diffs, **mean_ci(diffs).to_dict()}


def excludes_zero(interval: Mapping) -> bool | None:
    """Whether a 95% CI (``low`` / ``high`` keys, as in :meth:`Interval.to_dict`) lies strictly on one
    side of 0; None when there is no interval (n < 2). A CI of [0, 0] (no change at all) includes 0."""
    low, high = interval.get("low"), interval.get("high")
    if low is None or high is None:
        return None
    return bool(low > 0 or high < 0)


def paired_gain(after: Mapping[str, float], before: Mapping[str, float]) -> dict:
    """After − before on the questions both evals scored (keys: example ids), with a paired 95% CI.

    Paired Student-t: d_i = after_i − before_i over the n common ids, mean d̄ ± t_{0.975, n−1} · s_d / √n
    (s_d the sample std of the d_i, ddof 1). Pairing removes the question-to-question spread both
    evals share (a hard question is hard before and after), so the CI is tighter than comparing the
    two independent CIs. For 0/1 metrics (EM) the d_i lie in {−1, 0, 1}; the t interval is the usual
    large-sample approximation (it is the paired t test's interval; with few changed questions it is
    rough). The CI is over questions: it says how much the gain would move on another draw of
    held-out questions, not how much it would move with another training seed.

    Returns ``{"ids": [...], "differences": [...], **Interval.to_dict(), "excludes_zero": bool | None}``;
    with no common id, mean None.
    """
    out = paired_difference(dict(after), dict(before))
    out["ids"] = out.pop("seeds")
    return {**out, "excludes_zero": excludes_zero(out)}


def rolling_band(
    values: Sequence[float], window: int = 5, *, centered: bool = False
) -> tuple[list[float], list[float | None], list[float | None]]:
    """Moving mean of a per-step curve with a ±1.96 standard-error band.

    At step i over a window of k values (trailing: the last min(window, i + 1) values; centered: the
    values within window // 2 steps on either side, fewer at the ends): mean m_i, band
    m_i ± 1.96 · s_i / √k (s_i the sample std of those k values, ddof 1). Returns (means, lows, highs);
    lows / highs are None where k < 2. The band treats the k steps as independent draws around a
    locally flat curve: it shows step-to-step noise, not a formal CI of a trend. A trailing mean lags a
    rising curve; a centered one does not (but uses later steps).
    """
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    xs = [float(v) for v in values]
    means: list[float] = []
    lows: list[float | None] = []
    highs: list[float | None] = []
    for i in range(len(xs)):
        if centered:
            chunk = xs[max(0, i - window // 2) : i + window // 2 + 1]
        else:
            chunk = xs[max(0, i - window + 1) : i + 1]
        k = len(chunk)
        m = sum(chunk) / k
        means.append(m)
        if k < 2:
            lows.append(None)
            highs.append(None)
            continue
        se = math.sqrt(sum((v - m) ** 2 for v in chunk) / (k - 1)) / math.sqrt(k)
        lows.append(m - Z_975 * se)
        highs.append(m + Z_975 * se)
    return means, lows, highs


@dataclass(frozen=True)
class CollapseRule:
    """When a run counts as collapsed (defaults documented in benchmarks/evidence/README.md).

    Reward collapse: the trailing mean of ``reward/mean`` over ``window`` steps stays below
    ``drop_fraction`` x its running maximum for ``patience`` consecutive steps, once that running
    maximum has reached ``min_peak`` (a run that never learned cannot collapse). Action collapse:
    ``rollout/valid_action_rate`` falls below ``min_valid_action_rate`` (after having been at or above
    it) and stays there for ``patience`` consecutive steps. The collapse step is the first step of the
    first such streak.
    """

    # 5-step windows: with 32 rollouts per step a 3-step mean halves by chance (seen in the evidence runs).
    window: int = 5
    drop_fraction: float = 0.5
    patience: int = 5
    min_peak: float = 0.05
    min_valid_action_rate: float = 0.5


def _trailing_mean(values: Sequence[float], window: int) -> list[float]:
    out = []
    for i in range(len(values)):
        chunk = values[max(0, i - window + 1) : i + 1]
        out.append(sum(chunk) / len(chunk))
    return out


def _first_streak(flags: Sequence[bool], steps: Sequence[int], patience: int) -> int | None:
    run = 0
    for i, flag in enumerate(flags):
        run = run + 1 if flag else 0
        if run >= patience:
            return steps[i - patience + 1]
    return None


def collapse_step(
    steps: Sequence[int],
    reward: Sequence[float],
    valid_action_rate: Sequence[float] | None = None,
    rule: CollapseRule = CollapseRule(),
) -> dict:
    """``{"step": first collapsed step or None, "reason": "reward" | "valid_action" | None}`` (see CollapseRule)."""
    if len(steps) != len(reward) or (valid_action_rate is not None and len(valid_action_rate) != len(steps)):
        raise ValueError("steps, reward and valid_action_rate must have one entry per step")
    smooth = _trailing_mean(list(reward), rule.window)
    flags, peak = [], float("-inf")
    for value in smooth:
        peak = max(peak, value)
        flags.append(peak >= rule.min_peak and value < rule.drop_fraction * peak)
    candidates = []
    by_reward = _first_streak(flags, steps, rule.patience)
    if by_reward is not None:
        candidates.append((by_reward, "reward"))
    if valid_action_rate is not None:
        # Only a fall counts: a run that starts below the threshold (a weak warm start) has not collapsed.
        reached, low = False, []
        for v in valid_action_rate:
            reached = reached or v >= rule.min_valid_action_rate
            low.append(reached and v < rule.min_valid_action_rate)
        by_action = _first_streak(low, steps, rule.patience)
        if by_action is not None:
            candidates.append((by_action, "valid_action"))
    if not candidates:
        return {"step": None, "reason": None}
    step, reason = min(candidates)
    return {"step": step, "reason": reason}


def steps_ci(curves: list[tuple[list[int], list[float]]]) -> tuple[list[int], list]:
    """Per step over the curves (steps, values) that logged it: the steps in order and the mean with
    its 95% t-CI over those curves (``mean_ci``; no bounds with one curve)."""
    per_step: dict[int, list[float]] = {}
    for steps, values in curves:
        for s, v in zip(steps, values):
            per_step.setdefault(s, []).append(v)
    xs = sorted(per_step)
    return xs, [mean_ci(per_step[s]) for s in xs]
