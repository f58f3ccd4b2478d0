"""`stratarl report RUN_DIR [RUN_DIR...]`: one self-contained HTML page of curves.

The page opens with "Did it learn?" (:func:`headline` / :func:`headline_html`): held-out EM and F1
before -> after RL with 95% CIs over questions, the paired gain and a verdict; the training reward
and held-out EM over training; searches per question; reward per stratum; and one question's
transcript before and after RL. With several runs (seeds) the headline is the mean of the per-run
gains with a 95% t-interval over runs. :func:`format_headline` is the same in plain text (the
demo's last lines).

Then the full grid: each metric namespace (reward, rollout, loss, sorl, optim, time, ...) becomes one
PNG with a small plot per metric; every run is one coloured line in every plot,
so algorithms can be compared at a glance. PNGs are written next to the page and
embedded in it as base64, so the HTML file alone can be mailed or archived.
Eval results (``eval/*.json``) become a table per run.
"""

from __future__ import annotations

import base64
import html
import json
import math
import re
from pathlib import Path

from stratarl.trainer.aggregate import steps_ci, train_rows
from stratarl.trainer.metrics import read_metrics
from stratarl.trainer.plots import panel_grid, save_png
from stratarl.trainer.stats import Interval, excludes_zero, mean_ci, paired_gain, rolling_band

# Namespaces shown first, in this order; any other namespace follows alphabetically.
NAMESPACE_ORDER = ("reward", "eval", "rollout", "stratum", "advantage", "loss", "sorl", "optim", "perf", "time")


def _numeric_series(rows: list[dict]) -> dict[str, tuple[list[int], list[float]]]:
    series: dict[str, tuple[list[int], list[float]]] = {}
    for row in rows:
        step = row.get("step")
        if not isinstance(step, (int, float)):
            continue
        for key, value in row.items():
            if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if not math.isfinite(value):
                continue
            xs, ys = series.setdefault(key, ([], []))
            xs.append(int(step))
            ys.append(float(value))
    return series


def _namespace(key: str) -> str:
    return key.split("/", 1)[0] if "/" in key else "other"


def _plot_namespace(namespace: str, keys: list[str], runs: dict[str, dict], out_png: Path) -> bytes:
    plt, fig, panels, colors, _ = panel_grid(keys)
    for ax, key in zip(panels, keys):
        for j, (run_name, series) in enumerate(runs.items()):
            if key in series:
                xs, ys = series[key]
                ax.plot(xs, ys, label=run_name, color=colors[j % len(colors)], marker="." if len(xs) < 30 else None)
    handles, labels = panels[0].get_legend_handles_labels()
    if len(runs) > 1 and handles:
        fig.legend(handles, labels, loc="upper center", ncol=min(4, len(labels)), fontsize=8)
    fig.suptitle(namespace, y=1.0 if len(runs) < 2 else 1.04, fontsize=11)
    fig.tight_layout()
    return save_png(plt, fig, out_png)


def _eval_tables(run_dir: Path) -> str:
    parts = []
    for path in sorted((run_dir / "eval").glob("*.json")):
        try:
            result = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        sources = result.get("per_source", {})
        if not sources:
            continue
        cols = ["em", "subem", "f1", "searches_mean", "answer_rate", "count"]
        head = "".join(f"<th>{c}</th>" for c in ["data_source", *cols])
        body = ""
        rows = list(sources.items()) + [(f"type {t}", m) for t, m in result.get("per_type", {}).items()]
        for name, m in rows:
            cells = "".join(f"<td>{m.get(c, ''):.3f}</td>" if isinstance(m.get(c), float) else f"<td>{m.get(c, '')}</td>" for c in cols)
            body += f"<tr><td>{html.escape(name)}</td>{cells}</tr>"
        parts.append(f"<h4>{html.escape(path.stem)}</h4><table><tr>{head}</tr>{body}</table>")
    return "".join(parts)


def unique_run_names(run_dirs: list[Path]) -> list[str]:
    names = [p.name for p in run_dirs]
    if len(set(names)) == len(names):
        return names
    return [str(p) for p in run_dirs]


# --------------------------------------------------------------------------- "Did it learn?": numbers

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
        stats = {name: _clipped(mean_ci([float(r[key]) for r in records]).to_dict(), name) for name, key in QUESTION_METRICS}
        return {"tag": tag, "step": step, "n": len(records), **stats, "scores": scores}
    per_source = result.get("per_source", {})
    overall = per_source.get("all") or next(iter(per_source.values()), {})
    n = int(overall.get("count", 0))
    stats = {name: Interval(overall.get(key), n).to_dict()
             for name, key in (("em", "em"), ("f1", "f1"), ("searches", "searches_mean"), ("answer_rate", "answer_rate"))}
    return {"tag": tag, "step": step, "n": n, **stats, "scores": None}


def eval_points(run_dir: str | Path) -> list[dict]:
    """A run's held-out evals in step order: before = step 0, step_N = step N, after = the last training step.

    Each point: ``{"tag", "step", "n", "em", "f1", "searches", "answer_rate", "scores"}``; the four metrics are
    :class:`~stratarl.trainer.stats.Interval` dicts (mean, 95% Student-t CI over the n questions);
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
        return (f"no held-out eval in {run_dir / 'eval'}: train with eval.before_after=true (before / after RL) "
                "and trainer.eval_every=N (points during training)")
    if before is None or after is None:
        which = "before" if before is None else "after"
        why = "eval.before_after=false" if before is None else "the run was interrupted, or eval.before_after=false"
        return f"no eval {which} RL ({run_dir / 'eval' / (which + '.json')} is missing: {why}): no before/after gain"
    if before["scores"] is None or after["scores"] is None:
        return ("the eval files have no per-question records (written by an older stratarl): means without CIs "
                "and no paired gain; re-run the evals for them")
    return None


def run_headline(run_dir: str | Path) -> dict:
    """One run's "did it learn?" numbers (JSON-ready).

    ``{"run_dir", "steps" (RL steps logged), "num_questions", "evals" (:func:`eval_points` without scores),
    "before", "after" (those points or None), "gain" ({metric: :func:`~stratarl.trainer.stats.paired_gain`
    of after − before over the common example ids, without the id / difference lists} or None),
    "missing" (what keeps the gain from being computed, or None)}``.
    """
    run_dir = Path(run_dir)
    points = eval_points(run_dir)
    before = next((p for p in points if p["tag"] == "before"), None)
    after = next((p for p in points if p["tag"] == "after"), None)
    missing = _missing(points, before, after, run_dir)
    gain = None
    if missing is None:
        gain = {}
        for name, _ in QUESTION_METRICS:
            paired = paired_gain(after["scores"][name], before["scores"][name])
            gain[name] = {**{k: v for k, v in paired.items() if k not in ("ids", "differences")},
                          "up": sum(d > 0 for d in paired["differences"]), "down": sum(d < 0 for d in paired["differences"])}
    strip = lambda p: None if p is None else {k: v for k, v in p.items() if k != "scores"}  # noqa: E731
    return {"run_dir": str(run_dir), "steps": len(train_rows(run_dir)),
            "num_questions": (after or before or {}).get("n"), "evals": [strip(p) for p in points],
            "before": strip(before), "after": strip(after), "gain": gain, "missing": missing}


def _across(values: list[float]) -> dict:
    interval = mean_ci(values).to_dict()
    return {**interval, "excludes_zero": excludes_zero(interval)}


def headline(run_dirs: list[str | Path]) -> dict:
    """"Did it learn?" over one or several runs (e.g. seeds of one config).

    ``{"runs": [{"run": name, **run_headline}], "across_runs": None | {"n", "gain", "before", "after"},
    "verdict": str}``. ``across_runs`` (two or more runs): over the runs that have a gain, per metric the
    mean of the per-run values with a 95% Student-t CI over runs (``gain`` entries add ``excludes_zero``
    and ``per_run``). The verdict reads the across-run CI when there is one, else the paired CI of the run.
    """
    dirs = [Path(d) for d in run_dirs]
    runs = [{"run": name, **run_headline(d)} for name, d in zip(unique_run_names(dirs), dirs)]
    across = None
    with_gain = [r for r in runs if r["gain"]]
    if len(runs) > 1:
        across = {"n": len(with_gain), "gain": {}, "before": {}, "after": {}}
        for name, _ in QUESTION_METRICS:
            per_run = [r["gain"][name]["mean"] for r in with_gain]
            across["gain"][name] = {**_across(per_run), "per_run": per_run}
            across["before"][name] = mean_ci([r["before"][name]["mean"] for r in with_gain]).to_dict()
            across["after"][name] = mean_ci([r["after"][name]["mean"] for r in with_gain]).to_dict()
    return {"runs": runs, "across_runs": across, "verdict": verdict(runs, across)}


def _num(value: float | None, digits: int = 3, sign: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value:+.{digits}f}" if sign else f"{value:.{digits}f}"


def format_ci(interval: dict | None, *, sign: bool = False, digits: int = 3) -> str:
    """``0.235 [0.18, 0.29]`` (mean with 3 decimals, CI bounds with 2); ``0.235`` without a CI."""
    if not interval or interval.get("mean") is None:
        return "-"
    text = _num(interval["mean"], digits, sign)
    if interval.get("low") is None:
        return text
    return f"{text} [{_num(interval['low'], 2, sign)}, {_num(interval['high'], 2, sign)}]"


def verdict(runs: list[dict], across: dict | None = None) -> str:
    """One sentence: how much RL changed held-out EM, with its 95% CI, and whether the CI excludes 0."""
    if across is not None and across["n"] >= 2:
        gain = across["gain"]["em"]
        steps = sorted({r["steps"] for r in runs if r["gain"]})
        where = (f"over {across['n']} runs of {'/'.join(map(str, steps))} RL steps "
                 "(mean of the per-run gains, 95% t-interval over runs)")
    elif len(runs) == 1 or (across is not None and across["n"] == 1):
        run = next((r for r in runs if r["gain"]), runs[0])
        if run["gain"] is None:
            return f"no verdict: {run['missing']}"
        gain = run["gain"]["em"]
        where = (f"on {gain['n']} questions after {run['steps']} RL steps ({gain['up']} up, {gain['down']} down; "
                 "paired 95% CI over questions)")
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
            gain_text = (f"; gain {format_ci(gain['em'], sign=True)} (paired 95% CI, {_ci_note(gain['em'])}; "
                         f"{gain['em']['up']} questions up, {gain['em']['down']} down)" if gain else "")
            lines.append(f"{prefix}held-out EM (greedy, {run['num_questions']} questions, {run['steps']} RL steps): "
                         f"before RL {format_ci(before['em'])} -> after RL {format_ci(after['em'])}{gain_text}")
            if not many:
                f1_gain = f"; gain {format_ci(gain['f1'], sign=True)} ({_ci_note(gain['f1'])})" if gain else ""
                lines.append(f"held-out F1: before RL {format_ci(before['f1'])} -> after RL {format_ci(after['f1'])}{f1_gain}")
                lines.append(f"searches/question {_num(before['searches']['mean'], 2)} -> {_num(after['searches']['mean'], 2)}; "
                             f"answer rate {_num(before['answer_rate']['mean'], 2)} -> {_num(after['answer_rate']['mean'], 2)}")
        if run["evals"]:
            curve = ", ".join(f"step {p['step']} {_num(p['em']['mean'])}" for p in run["evals"])
            lines.append(f"{prefix}held-out EM over training: {curve}")
        if run["missing"]:
            lines.append(f"{prefix}missing: {run['missing']}")
    across = h.get("across_runs")
    if across and across["n"] >= 2:
        lines.append(f"mean over {across['n']} runs: held-out EM before RL {format_ci(across['before']['em'])} -> "
                     f"after RL {format_ci(across['after']['em'])}; gain {format_ci(across['gain']['em'], sign=True)} "
                     f"(95% t-interval over runs, {_ci_note(across['gain']['em'])})")
    lines.append(f"verdict: {h['verdict']}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- "Did it learn?": page section

def _nan(values: list[float | None]) -> list[float]:
    return [math.nan if v is None else v for v in values]


def _across_steps(curves: list[tuple[list[int], list[float]]]) -> tuple[list[int], list[float], list[float], list[float]]:
    """Per step over the runs that logged it: mean and 95% t-CI over runs (NaN bounds with one run)."""
    steps, cis = steps_ci(curves)
    return steps, [c.mean for c in cis], _nan([c.low for c in cis]), _nan([c.high for c in cis])


def _plot_train_curve(ax, curves: list[tuple[list[int], list[float]]], color: str) -> None:
    curves = [c for c in curves if c[0]]
    if not curves:
        ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
        return
    if len(curves) == 1:
        xs, ys = curves[0]
        means, lows, highs = rolling_band(ys, SMOOTH_WINDOW, centered=True)
        ax.plot(xs, ys, ".", color=color, alpha=0.4, label="per step")
        ax.plot(xs, means, color=color, label=f"centered {SMOOTH_WINDOW}-step mean")
        ax.fill_between(xs, _nan(lows), _nan(highs), color=color, alpha=0.2, label="± 1.96 SE of that mean")
    else:
        for xs, ys in curves:
            ax.plot(xs, ys, color=color, alpha=0.25, lw=0.8)
        steps, means, lows, highs = _across_steps(curves)
        ax.plot(steps, means, color=color, label=f"mean of {len(curves)} runs")
        ax.fill_between(steps, lows, highs, color=color, alpha=0.2, label="95% CI over runs")
    ax.legend(fontsize=7)


def _plot_eval_curve(ax, runs: list[dict], metric: str, color: str) -> None:
    """One run: each eval's mean with its 95% CI over questions. Several: the mean over runs, 95% CI over runs."""
    per_run = [[(p["step"], p[metric]) for p in r["evals"] if p[metric]["mean"] is not None] for r in runs]
    per_run = [pts for pts in per_run if pts]
    if not per_run:
        ax.text(0.5, 0.5, "no held-out eval", ha="center", va="center", transform=ax.transAxes)
        return
    if len(per_run) == 1:
        steps, means = [s for s, _ in per_run[0]], [i["mean"] for _, i in per_run[0]]
        lows, highs = _nan([i["low"] for _, i in per_run[0]]), _nan([i["high"] for _, i in per_run[0]])
        label = "mean, 95% CI over questions"
    else:
        curves = [([s for s, _ in pts], [i["mean"] for _, i in pts]) for pts in per_run]
        for xs, ys in curves:
            ax.plot(xs, ys, "o", color=color, alpha=0.3, ms=3)
        steps, means, lows, highs = _across_steps(curves)
        label = f"mean of {len(curves)} runs, 95% CI over runs"
    err = [[m - lo if math.isfinite(lo) else 0.0 for m, lo in zip(means, lows)],
           [hi - m if math.isfinite(hi) else 0.0 for m, hi in zip(means, highs)]]
    ax.errorbar(steps, means, yerr=err, fmt="o-", color=color, capsize=3, label=label)
    ax.legend(fontsize=7)


def _figure(titles: list[str]):
    plt, fig, axes, colors, _ = panel_grid(titles)
    fig.set_size_inches(5.5 * len(titles), 3.4)
    for ax in axes:
        ax.set_xlabel("RL step", fontsize=8)
    return plt, fig, axes, colors


def _img(png: bytes, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode("ascii")}">'


STRATUM_KEY = re.compile(r"stratum/(\d+)/reward_mean")


def headline_plots(h: dict, out_dir: Path) -> dict[str, bytes]:
    """The section's figures, {file name: PNG bytes} (also written to ``out_dir``): ``did_it_learn.png``
    (training reward per step, held-out EM per eval), ``did_it_learn_searches.png`` (per training rollout,
    per held-out question) and, when the metrics have ``stratum/<k>/reward_mean``,
    ``did_it_learn_strata.png`` (training reward per stratum k = number of searches)."""
    series = [_numeric_series(train_rows(Path(r["run_dir"]))) for r in h["runs"]]
    curves = lambda key: [ser.get(key, ([], [])) for ser in series]  # noqa: E731
    out = {}
    for png, key, metric, color, titles in (
            ("did_it_learn.png", "reward/mean", "em", 0,
             ["training reward per step (algo.reward)", "held-out EM per eval (greedy)"]),
            ("did_it_learn_searches.png", "rollout/search_calls_mean", "searches", 2,
             ["searches per rollout (training)", "searches per held-out question"])):
        plt, fig, (ax_train, ax_eval), colors = _figure(titles)
        _plot_train_curve(ax_train, curves(key), colors[color])
        _plot_eval_curve(ax_eval, h["runs"], metric, colors[color + 1])
        fig.tight_layout()
        out[png] = save_png(plt, fig, out_dir / png)
    strata = sorted({int(m.group(1)) for ser in series for k in ser if (m := STRATUM_KEY.fullmatch(k))})
    if strata:
        plt, fig, (ax,), colors = _figure(["training reward per stratum (k = number of searches)"
                                           + (": mean over runs" if len(series) > 1 else "")])
        for j, k in enumerate(strata):
            steps, means, _, _ = _across_steps(curves(f"stratum/{k}/reward_mean"))
            ax.plot(steps, means, marker="." if len(steps) < 30 else None, color=colors[j % len(colors)], label=f"k = {k}")
        ax.legend(fontsize=7)
        fig.tight_layout()
        out["did_it_learn_strata.png"] = save_png(plt, fig, out_dir / "did_it_learn_strata.png")
    return out


def _table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


YES_NO = {True: "yes", False: "no", None: "-"}
METRIC_LABELS = {"em": "held-out EM", "f1": "held-out F1", "searches": "searches / question", "answer_rate": "answer rate"}


def _headline_tables(h: dict) -> str:
    runs, across = h["runs"], h["across_runs"]
    if len(runs) == 1:
        run = runs[0]
        if run["before"] is None and run["after"] is None:
            return ""
        rows = [[label, format_ci((run["before"] or {}).get(m)), format_ci((run["after"] or {}).get(m)),
                 format_ci((run["gain"] or {}).get(m), sign=True), YES_NO[(run["gain"] or {}).get(m, {}).get("excludes_zero")]]
                for m, label in METRIC_LABELS.items()]
        return _table(["", "before RL [95% CI]", "after RL [95% CI]", "gain after − before [paired 95% CI]",
                       "CI excludes 0"], rows)
    rows = [[r["run"], str(r["steps"]), str(r["num_questions"] or "-"), format_ci((r["before"] or {}).get("em")),
             format_ci((r["after"] or {}).get("em")), format_ci((r["gain"] or {}).get("em"), sign=True),
             YES_NO[(r["gain"] or {}).get("em", {}).get("excludes_zero")]] for r in runs]
    if across and across["n"]:
        rows.append([f"mean of {across['n']} runs [95% CI over runs]", "", "", format_ci(across["before"]["em"]),
                     format_ci(across["after"]["em"]), format_ci(across["gain"]["em"], sign=True),
                     YES_NO[across["gain"]["em"]["excludes_zero"]]])
    return _table(["run", "RL steps", "questions", "held-out EM before RL", "after RL", "gain [95% CI]", "CI excludes 0"], rows)


def _turns_html(record: dict) -> str:
    parts = []
    for turn in record.get("turns", []):
        parts.append(f'<pre class="model">{html.escape(turn.get("text", ""))}</pre>')
        if turn.get("observation"):
            obs = turn["observation"]
            obs = obs if len(obs) <= 800 else obs[:800] + " …"
            parts.append(f'<pre class="obs">{html.escape(obs)}</pre>')
    return "".join(parts)


def transcript_pair(run_dir: str | Path) -> tuple[dict, dict] | None:
    """The before and after RL transcripts of one question (same example id): the first question of
    the transcript files whose EM changed, else the first one both have; None without both files."""
    def load(tag: str) -> dict[str, dict]:  # JSONL, torn lines skipped, as metrics.jsonl
        return {str(r["example_id"]): r for r in read_metrics(Path(run_dir) / "eval", f"{tag}_transcripts.jsonl")
                if "example_id" in r}

    before, after = load("before"), load("after")
    common = [i for i in before if i in after]
    if not common:
        return None
    changed = [i for i in common if before[i].get("reward") != after[i].get("reward")]
    chosen = (changed or common)[0]
    return before[chosen], after[chosen]


def _transcript_html(h: dict) -> str:
    for run in h["runs"]:
        pair = transcript_pair(run["run_dir"])
        if pair is None:
            continue
        before, after = pair
        columns = "".join(
            f'<div class="col"><h4>{label}: EM {_num(r.get("reward"), 0)}, {r.get("num_searches", "?")} searches, '
            f'answer {html.escape(repr(r.get("answer")))}</h4>{_turns_html(r)}</div>'
            for label, r in (("before RL", before), ("after RL", after)))
        source = f" (run {html.escape(run['run'])})" if len(h["runs"]) > 1 else ""
        return (f"<p>Question <code>{html.escape(str(before['example_id']))}</code>{source}: "
                f"{html.escape(str(before.get('question', '')))} Gold: {html.escape(', '.join(before.get('golds') or []))}. "
                "Shown: the first question of the eval transcripts whose EM changed, else the first one. "
                "Model text in grey boxes, retrieved passages in blue.</p>"
                f'<div class="pair">{columns}</div>')
    return ("<p>No question has transcripts both before and after RL "
            "(<code>eval/before_transcripts.jsonl</code> and <code>eval/after_transcripts.jsonl</code>).</p>")


def headline_html(h: dict, out_dir: Path) -> str:
    """The "Did it learn?" section of the report page (PNGs written to ``out_dir`` and embedded)."""
    plots = headline_plots(h, out_dir)
    missing = "".join(f'<p class="missing">{html.escape(r["run"])}: {html.escape(r["missing"])}</p>'
                      for r in h["runs"] if r["missing"])
    steps = ", ".join(str(r["steps"]) for r in h["runs"])
    stats_note = ("95% CIs of each eval: Student-t over the held-out questions (greedy decoding, one rollout per "
                  "question). Gain: paired over the same questions (by example id), Student-t on the per-question "
                  "differences. These CIs cover question sampling only, not training-seed variance.")
    if len(h["runs"]) > 1:
        stats_note += (" Across runs: mean of the per-run values, Student-t 95% CI over runs (this one includes "
                       "seed variance).")
    strata = (_img(plots["did_it_learn_strata.png"], "reward per stratum") if "did_it_learn_strata.png" in plots
              else "<p>No per-stratum metrics (<code>stratum/&lt;k&gt;/reward_mean</code>) in metrics.jsonl.</p>")
    band = (f"centered {SMOOTH_WINDOW}-step moving mean ± 1.96 standard errors of that mean" if len(h["runs"]) == 1
            else "mean over runs ± 95% t-CI over runs")
    return f"""<h2 id="did-it-learn">Did it learn?</h2>
<p class="verdict"><b>{html.escape(h['verdict'])}</b></p>{missing}
{_headline_tables(h)}
<p class="note">RL steps: {html.escape(steps)}. {html.escape(stats_note)}</p>
<h3>Training reward and held-out EM over training</h3>
<p class="note">Left: the training reward of each step (band: {band}). Right: held-out EM at every eval
(before RL = step 0, every <code>trainer.eval_every</code> steps, after RL), error bars 95% CI.</p>
{_img(plots["did_it_learn.png"], "reward and held-out EM")}
<h3>Searches per question</h3>{_img(plots["did_it_learn_searches.png"], "searches per question")}
<h3>Reward per stratum</h3>{strata}
<h3>The same question before and after RL</h3>{_transcript_html(h)}"""


# --------------------------------------------------------------------------- the page


def build_report(run_dirs: list[str | Path], output: str | Path | None = None, *, title: str = "stratarl report") -> Path:
    """Write ``report.html`` comparing ``run_dirs``: "Did it learn?" (:func:`headline_html`), the eval tables,
    then one PNG per metric namespace (PNGs next to the page and embedded); return the HTML path.

    Default output: ``<first run>/report/report.html``.
    """
    dirs = [Path(d) for d in run_dirs]
    if not dirs:
        raise ValueError("give at least one run directory")
    for d in dirs:
        if not (d / "metrics.jsonl").is_file():
            raise FileNotFoundError(f"{d} has no metrics.jsonl: pass run directories written by `stratarl train` "
                                    "(e.g. runs/<name>)")
    out_html = Path(output) if output is not None else dirs[0] / "report" / "report.html"
    out_html.parent.mkdir(parents=True, exist_ok=True)
    runs = {name: _numeric_series(read_metrics(d)) for name, d in zip(unique_run_names(dirs), dirs)}
    keys_by_ns: dict[str, set[str]] = {}
    for series in runs.values():
        for key in series:
            keys_by_ns.setdefault(_namespace(key), set()).add(key)
    order = [ns for ns in NAMESPACE_ORDER if ns in keys_by_ns] + sorted(ns for ns in keys_by_ns if ns not in NAMESPACE_ORDER)
    sections = []
    for ns in order:
        keys = sorted(keys_by_ns[ns])
        png = _plot_namespace(ns, keys, runs, out_html.parent / f"{ns}.png")
        b64 = base64.b64encode(png).decode("ascii")
        sections.append(f'<h2 id="{html.escape(ns)}">{html.escape(ns)}</h2><img alt="{html.escape(ns)} curves" src="data:image/png;base64,{b64}">')
    evals = "".join(f"<h3>{html.escape(name)}</h3>{_eval_tables(d) or '<p>no eval results</p>'}"
                    for name, d in zip(runs, dirs))
    nav = " · ".join(['<a href="#did-it-learn">Did it learn?</a>', '<a href="#eval">eval</a>']
                     + [f'<a href="#{html.escape(ns)}">{html.escape(ns)}</a>' for ns in order])
    summary = headline(dirs)
    learned = headline_html(summary, out_html.parent)
    # RL steps = training rows (eval rows of metrics.jsonl share step numbers and are not steps).
    run_list = "".join(f"<li><code>{html.escape(str(d))}</code>: {r['steps']} RL steps, {len(r['evals'])} held-out evals</li>"
                       for d, r in zip(dirs, summary["runs"]))
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1400px}} img{{max-width:100%}}
table{{border-collapse:collapse;margin:.5em 0}} td,th{{border:1px solid #ccc;padding:2px 8px;text-align:right}}
.verdict{{font-size:1.15em}} .missing{{color:#a40}} .note{{color:#444;font-size:.9em}}
.pair{{display:flex;gap:1em}} .pair .col{{flex:1;min-width:0}}
pre{{white-space:pre-wrap;word-break:break-word;margin:.2em 0;padding:.3em;font-size:.85em}}
pre.model{{background:#f2f2f2}} pre.obs{{background:#eaf2fb}}</style>
</head><body><h1>{html.escape(title)}</h1><ul>{run_list}</ul><p>{nav}</p>
{learned}
<h2 id="eval">eval</h2>{evals}{''.join(sections)}</body></html>"""
    out_html.write_text(page)
    return out_html
