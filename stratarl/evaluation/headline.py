""" "Did it learn?" in numbers: held-out EM and F1 before -> after RL with 95% CIs over questions, the paired
gain, the curve of evals over training, and a verdict (`stratarl report`, the demo's last lines).

With several runs (seeds) the headline is the mean of the per-run gains with a 95% t-interval over runs.
:func:`format_headline` is the plain-text form.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from stratarl.evaluation.rundir import train_rows
from stratarl.evaluation.stats import Interval, excludes_zero, mean_ci, paired_gain


def unique_run_names(run_dirs: list[Path]) -> list[str]:
    names = [p.name for p in run_dirs]
    if len(set(names)) == len(names):
        return names
    return [str(p) for p in run_dirs]


# Per-question columns of eval/<tag>.json -> the names used in the headline.
QUESTION_METRICS = (("em", "em"), ("f1", "f1"), ("searches", "searches"), ("answer_rate", "answered"))
SMOOTH_WINDOW = 5  # centered window (steps) of the smoothed training curves: step i ± 2


def _eval_step(tag: str, last_step: int) -> int | None:
    """The RL step an eval tag was taken at (the trainer's tags: before, step_NNNNNN, after)."""
    if tag == "before":
        return 0
    if tag == "after":
        return last_step
    match = re.fullmatch(r"step_(\d+)", tag)
    return int(match.group(1)) if match else None


def _clipped(interval: dict, metric: str) -> dict:
    """The t-interval cut to the metric's range ([0, 1] for rates, >= 0 for searches): for a rate near 0 or 1
    on few questions, mean ± t·s/√n leaves the range, and what lies outside it cannot happen."""
    if interval["low"] is None:
        return interval
    high = interval["high"] if metric == "searches" else min(1.0, interval["high"])
    return {**interval, "low": max(0.0, interval["low"]), "high": high}


def _eval_point(tag: str, step: int, result: dict) -> dict:
    records = result.get("per_question") or []
    if records:
        scores = {name: {str(r["example_id"]): float(r[key]) for r in records} for name, key in QUESTION_METRICS}
        stats = {
            name: _clipped(mean_ci([float(r[key]) for r in records]).to_dict(), name) for name, key in QUESTION_METRICS
        }
        return {"tag": tag, "step": step, "n": len(records), **stats, "scores": scores}
    per_source = result.get("per_source", {})
    overall: dict[str, Any] = per_source.get("all") or next(iter(per_source.values()), {})
    n = int(overall.get("count", 0))
    stats = {
        name: Interval(overall.get(key), n).to_dict()
        for name, key in (("em", "em"), ("f1", "f1"), ("searches", "searches_mean"), ("answer_rate", "answer_rate"))
    }
    return {"tag": tag, "step": step, "n": n, **stats, "scores": None}


def eval_points(run_dir: str | Path) -> list[dict]:
    """A run's held-out evals in step order: before = step 0, step_N = step N, after = the last training step.

    Each point: ``{"tag", "step", "n", "em", "f1", "searches", "answer_rate", "scores"}``; the four metrics are
    :class:`~stratarl.evaluation.stats.Interval` dicts (mean, 95% Student-t CI over the n questions);
    ``scores`` maps each metric to ``{example_id: value}`` for pairing. Eval files without per-question
    records (written before they existed) give the means with no CI and ``scores`` None. Other tags
    (``stratarl eval --tag NAME``) have no step and are left out.
    """
    run_dir = Path(run_dir)
    last_step = max((int(r["step"]) for r in train_rows(run_dir)), default=0)
    points = []
    for path in sorted((run_dir / "eval").glob("*.json")):
        step = _eval_step(path.stem, last_step)
        if step is None:
            continue
        try:
            result = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        points.append(_eval_point(path.stem, step, result))
    return sorted(points, key=lambda p: (p["step"], {"before": 0, "after": 2}.get(p["tag"], 1)))


def _missing(points: list[dict], before: dict | None, after: dict | None, run_dir: Path) -> str | None:
    if not points:
        return (
            f"no held-out eval in {run_dir / 'eval'}: train with eval.before_after=true (before / after RL) "
            "and trainer.eval_every=N (points during training)"
        )
    if before is None or after is None:
        which = "before" if before is None else "after"
        why = "eval.before_after=false" if before is None else "the run was interrupted, or eval.before_after=false"
        return f"no eval {which} RL ({run_dir / 'eval' / (which + '.json')} is missing: {why}): no before/after gain"
    if before["scores"] is None or after["scores"] is None:
        return (
            "the eval files have no per-question records (written by an older stratarl): means without CIs "
            "and no paired gain; re-run the evals for them"
        )
    return None


def run_headline(run_dir: str | Path) -> dict:
    """One run's "did it learn?" numbers (JSON-ready).

    ``{"run_dir", "steps" (RL steps logged), "num_questions", "evals" (:func:`eval_points` without scores),
    "before", "after" (those points or None), "gain" ({metric: :func:`~stratarl.evaluation.stats.paired_gain`
    of after − before over the common example ids, without the id / difference lists} or None),
    "missing" (what keeps the gain from being computed, or None)}``.
    """
    run_dir = Path(run_dir)
    points = eval_points(run_dir)
    before = next((p for p in points if p["tag"] == "before"), None)
    after = next((p for p in points if p["tag"] == "after"), None)
    missing = _missing(points, before, after, run_dir)
    gain = None
    if missing is None and before is not None and after is not None:  # _missing: both are there
        gain = {}
        for name, _ in QUESTION_METRICS:
            paired = paired_gain(after["scores"][name], before["scores"][name])
            gain[name] = {
                **{k: v for k, v in paired.items() if k not in ("ids", "differences")},
                "up": sum(d > 0 for d in paired["differences"]),
                "down": sum(d < 0 for d in paired["differences"]),
            }
    strip = lambda p: None if p is None else {k: v for k, v in p.items() if k != "scores"}  # noqa: E731
    return {
        "run_dir": str(run_dir),
        "steps": len(train_rows(run_dir)),
        "num_questions": (after or before or {}).get("n"),
        "evals": [strip(p) for p in points],
        "before": strip(before),
        "after": strip(after),
        "gain": gain,
        "missing": missing,
    }


def _across(values: list[float]) -> dict:
    interval = mean_ci(values).to_dict()
    return {**interval, "excludes_zero": excludes_zero(interval)}


def headline(run_dirs: Sequence[str | Path]) -> dict:
    """ "Did it learn?" over one or several runs (e.g. seeds of one config).

    ``{"runs": [{"run": name, **run_headline}], "across_runs": None | {"n", "gain", "before", "after"},
    "verdict": str}``. ``across_runs`` (two or more runs): over the runs that have a gain, per metric the
    mean of the per-run values with a 95% Student-t CI over runs (``gain`` entries add ``excludes_zero``
    and ``per_run``). The verdict reads the across-run CI when there is one, else the paired CI of the run.
    """
    dirs = [Path(d) for d in run_dirs]
    runs = [{"run": name, **run_headline(d)} for name, d in zip(unique_run_names(dirs), dirs)]
    across: dict[str, Any] | None = None
    with_gain = [r for r in runs if r["gain"]]
    if len(runs) > 1:
        gains: dict[str, Any] = {}
        befores: dict[str, Any] = {}
        afters: dict[str, Any] = {}
        for name, _ in QUESTION_METRICS:
            per_run = [r["gain"][name]["mean"] for r in with_gain]
            gains[name] = {**_across(per_run), "per_run": per_run}
            befores[name] = mean_ci([r["before"][name]["mean"] for r in with_gain]).to_dict()
            afters[name] = mean_ci([r["after"][name]["mean"] for r in with_gain]).to_dict()
        across = {"n": len(with_gain), "gain": gains, "before": befores, "after": afters}
    return {"runs": runs, "across_runs": across, "verdict": verdict(runs, across)}


def format_number(value: float | None, digits: int = 3, sign: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value:+.{digits}f}" if sign else f"{value:.{digits}f}"


def format_ci(interval: dict | None, *, sign: bool = False, digits: int = 3) -> str:
    """``0.235 [0.18, 0.29]`` (mean with 3 decimals, CI bounds with 2); ``0.235`` without a CI."""
    if not interval or interval.get("mean") is None:
        return "-"
    text = format_number(interval["mean"], digits, sign)
    if interval.get("low") is None:
        return text
    return f"{text} [{format_number(interval['low'], 2, sign)}, {format_number(interval['high'], 2, sign)}]"


def verdict(runs: list[dict], across: dict | None = None) -> str:
    """One sentence: how much RL changed held-out EM, with its 95% CI, and whether the CI excludes 0."""
    if across is not None and across["n"] >= 2:
        gain = across["gain"]["em"]
        steps = sorted({r["steps"] for r in runs if r["gain"]})
        where = (
            f"over {across['n']} runs of {'/'.join(map(str, steps))} RL steps "
            "(mean of the per-run gains, 95% t-interval over runs)"
        )
    elif len(runs) == 1 or (across is not None and across["n"] == 1):
        run = next((r for r in runs if r["gain"]), runs[0])
        if run["gain"] is None:
            return f"no verdict: {run['missing']}"
        gain = run["gain"]["em"]
        where = (
            f"on {gain['n']} questions after {run['steps']} RL steps ({gain['up']} up, {gain['down']} down; "
            "paired 95% CI over questions)"
        )
        if len(runs) > 1:
            where += f"; only {run['run']} of {len(runs)} runs has before/after evals"
    else:
        return "no verdict: no run has held-out evals before and after RL"
    if gain["mean"] is None:
        return "no verdict: the before and after evals share no question"
    if "up" in gain and gain["up"] == gain["down"] == 0:
        return f"RL did not change held-out EM on any of the {gain['n']} questions (gain {gain['mean']:+.3f})"
    if gain["excludes_zero"] is None:
        return f"RL changed held-out EM by {format_ci(gain, sign=True)} {where}: too few values for a CI"
    if gain["excludes_zero"]:
        verb = "improved" if gain["mean"] > 0 else "lowered"
        return f"RL {verb} held-out EM by {format_ci(gain, sign=True)} {where}: the 95% CI excludes 0"
    return f"RL changed held-out EM by {format_ci(gain, sign=True)} {where}: inside the noise (the 95% CI includes 0)"


def _ci_note(gain: dict) -> str:
    if gain.get("excludes_zero") is None:
        return "no CI"
    return "excludes 0" if gain["excludes_zero"] else "includes 0: inside the noise"


def format_headline(h: dict) -> str:
    """The headline as plain text (the demo prints it). One run: EM, F1, searches and answer rate before ->
    after, the EM at every eval, the verdict. Several runs: EM and its curve per run, then the mean over runs."""
    lines, many = [], len(h["runs"]) > 1
    for run in h["runs"]:
        prefix = f"[{run['run']}] " if many else ""
        before, after, gain = run["before"], run["after"], run["gain"]
        if before is not None and after is not None:
            gain_text = (
                f"; gain {format_ci(gain['em'], sign=True)} (paired 95% CI, {_ci_note(gain['em'])}; "
                f"{gain['em']['up']} questions up, {gain['em']['down']} down)"
                if gain
                else ""
            )
            lines.append(
                f"{prefix}held-out EM (greedy, {run['num_questions']} questions, {run['steps']} RL steps): "
                f"before RL {format_ci(before['em'])} -> after RL {format_ci(after['em'])}{gain_text}"
            )
            if not many:
                f1_gain = f"; gain {format_ci(gain['f1'], sign=True)} ({_ci_note(gain['f1'])})" if gain else ""
                lines.append(
                    f"held-out F1: before RL {format_ci(before['f1'])} -> after RL {format_ci(after['f1'])}{f1_gain}"
                )
                lines.append(
                    f"searches/question {format_number(before['searches']['mean'], 2)} -> {format_number(after['searches']['mean'], 2)}; "
                    f"answer rate {format_number(before['answer_rate']['mean'], 2)} -> {format_number(after['answer_rate']['mean'], 2)}"
                )
        if run["evals"]:
            curve = ", ".join(f"step {p['step']} {format_number(p['em']['mean'])}" for p in run["evals"])
            lines.append(f"{prefix}held-out EM over training: {curve}")
        if run["missing"]:
            lines.append(f"{prefix}missing: {run['missing']}")
    across = h.get("across_runs")
    if across and across["n"] >= 2:
        lines.append(
            f"mean over {across['n']} runs: held-out EM before RL {format_ci(across['before']['em'])} -> "
            f"after RL {format_ci(across['after']['em'])}; gain {format_ci(across['gain']['em'], sign=True)} "
            f"(95% t-interval over runs, {_ci_note(across['gain']['em'])})"
        )
    lines.append(f"verdict: {h['verdict']}")
    return "\n".join(lines)
