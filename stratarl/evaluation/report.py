"""`stratarl report RUN_DIR [RUN_DIR...]`: one self-contained HTML page of curves.

The page opens with "Did it learn?" (stratarl.evaluation.headline for the numbers, ``headline_html`` for the
section): held-out EM and F1 before -> after RL with 95% CIs over questions, the paired gain and a verdict;
the training reward and held-out EM over training; searches per question; reward per stratum; and one
question's transcript before and after RL.

Then the full grid: each metric namespace (reward, rollout, loss, sorl, optim, time, ...) becomes one
PNG with a small plot per metric (stratarl.evaluation.plots); every run is one coloured line in every plot,
so algorithms can be compared at a glance. PNGs are written next to the page and
embedded in it as base64, so the HTML file alone can be mailed or archived.
Eval results (``eval/*.json``) become a table per run.
"""

from __future__ import annotations

import base64
import html
import json
from collections import Counter
from pathlib import Path

from stratarl.evaluation.headline import SMOOTH_WINDOW, format_ci, format_number, headline, unique_run_names
from stratarl.evaluation.plots import NAMESPACE_ORDER, headline_plots, namespace_of, numeric_series, plot_namespace
from stratarl.infra.metrics import read_metrics


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
            cells = "".join(
                f"<td>{m.get(c, ''):.3f}</td>" if isinstance(m.get(c), float) else f"<td>{m.get(c, '')}</td>"
                for c in cols
            )
            body += f"<tr><td>{html.escape(name)}</td>{cells}</tr>"
        parts.append(f"<h4>{html.escape(path.stem)}</h4><table><tr>{head}</tr>{body}</table>")
    return "".join(parts)


def _mean_of(series: dict, key: str) -> str:
    ys = series.get(key, ([], []))[1]
    return f"{sum(ys) / len(ys):.4g}" if ys else "-"


def _offpolicy_html(runs: dict[str, dict]) -> str:
    """The off-policy regime of each run that had an off-policy source (``offpolicy/lag`` logged): the lag
    histogram over its steps, the mean sampler/learner mismatch per turn, the ratio's p99, PPO's clip share and
    the share of optimizer steps on which SORL's normaliser engaged. "" when no run had one."""
    rows = []
    for name, series in runs.items():
        lags = series.get("offpolicy/lag", ([], []))[1]
        if not lags:
            continue
        counts = Counter(int(lag) for lag in lags)
        histogram = ", ".join(f"{lag}: {n}" for lag, n in sorted(counts.items()))
        turns = " / ".join(_mean_of(series, f"offpolicy/mismatch_turn{k}") for k in (1, 2, 3))
        rows.append(
            [
                name,
                histogram,
                turns,
                _mean_of(series, "offpolicy/ratio_p99"),
                _mean_of(series, "loss/clip_frac"),
                _mean_of(series, "offpolicy/is_weight_mean"),
                _mean_of(series, "sorl/c_norm"),
                _mean_of(series, "sorl/engaged"),
            ]
        )
    if not rows:
        return ""
    return (
        '<h2 id="offpolicy-regime">Off-policy regime</h2><p class="note">Means over the run\'s steps; the lag '
        "histogram counts steps per lag (docs/training.md, Off-policy training).</p>"
        + _table(
            [
                "run",
                "lag: steps",
                "mismatch turn 1 / 2 / 3",
                "ratio p99",
                "clip share",
                "correction weight",
                "‖C‖",
                "SORL engaged",
            ],
            rows,
        )
    )


def _img(png: bytes, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode("ascii")}">'


def _table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


YES_NO = {True: "yes", False: "no", None: "-"}
METRIC_LABELS = {
    "em": "held-out EM",
    "f1": "held-out F1",
    "searches": "searches / question",
    "answer_rate": "answer rate",
}


def _headline_tables(h: dict) -> str:
    runs, across = h["runs"], h["across_runs"]
    if len(runs) == 1:
        run = runs[0]
        if run["before"] is None and run["after"] is None:
            return ""
        rows = [
            [
                label,
                format_ci((run["before"] or {}).get(m)),
                format_ci((run["after"] or {}).get(m)),
                format_ci((run["gain"] or {}).get(m), sign=True),
                YES_NO[(run["gain"] or {}).get(m, {}).get("excludes_zero")],
            ]
            for m, label in METRIC_LABELS.items()
        ]
        return _table(
            ["", "before RL [95% CI]", "after RL [95% CI]", "gain after − before [paired 95% CI]", "CI excludes 0"],
            rows,
        )
    rows = [
        [
            r["run"],
            str(r["steps"]),
            str(r["num_questions"] or "-"),
            format_ci((r["before"] or {}).get("em")),
            format_ci((r["after"] or {}).get("em")),
            format_ci((r["gain"] or {}).get("em"), sign=True),
            YES_NO[(r["gain"] or {}).get("em", {}).get("excludes_zero")],
        ]
        for r in runs
    ]
    if across and across["n"]:
        rows.append(
            [
                f"mean of {across['n']} runs [95% CI over runs]",
                "",
                "",
                format_ci(across["before"]["em"]),
                format_ci(across["after"]["em"]),
                format_ci(across["gain"]["em"], sign=True),
                YES_NO[across["gain"]["em"]["excludes_zero"]],
            ]
        )
    return _table(
        ["run", "RL steps", "questions", "held-out EM before RL", "after RL", "gain [95% CI]", "CI excludes 0"], rows
    )


def _turns_html(record: dict) -> str:
    parts = []
    for turn in record.get("turns", []):
        parts.append(f'<pre class="model">{html.escape(turn.get("text", ""))}</pre>')
        if turn.get("observation"):
            obs = turn["observation"]
            obs = obs if len(obs) <= 800 else obs[:800] + " …"
            parts.append(f'<pre class="obs">{html.escape(obs)}</pre>')
    calls = [
        f"{c.get('tool')}({html.escape(json.dumps(c.get('arguments'), ensure_ascii=False))}): {c.get('status')}"
        + (f" ({html.escape(str(c['detail']))})" if c.get("detail") else "")
        for c in record.get("calls") or []
    ]
    if calls:  # every tool call of the rollout (docs/agent_loop.md), malformed and over-budget ones included
        parts.append("<p>Tool calls: " + "; ".join(calls) + "</p>")
    return "".join(parts)


def transcript_pair(run_dir: str | Path) -> tuple[dict, dict] | None:
    """The before and after RL transcripts of one question (same example id): the first question of
    the transcript files whose EM changed, else the first one both have; None without both files."""

    def load(tag: str) -> dict[str, dict]:  # JSONL, torn lines skipped, as metrics.jsonl
        return {
            str(r["example_id"]): r
            for r in read_metrics(Path(run_dir) / "eval", f"{tag}_transcripts.jsonl")
            if "example_id" in r
        }

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
            f'<div class="col"><h4>{label}: EM {format_number(r.get("reward"), 0)}, {r.get("num_searches", "?")} searches, '
            f"answer {html.escape(repr(r.get('answer')))}</h4>{_turns_html(r)}</div>"
            for label, r in (("before RL", before), ("after RL", after))
        )
        source = f" (run {html.escape(run['run'])})" if len(h["runs"]) > 1 else ""
        return (
            f"<p>Question <code>{html.escape(str(before['example_id']))}</code>{source}: "
            f"{html.escape(str(before.get('question', '')))} Gold: {html.escape(', '.join(before.get('golds') or []))}. "
            "Shown: the first question of the eval transcripts whose EM changed, else the first one. "
            "Model text in grey boxes, retrieved passages in blue.</p>"
            f'<div class="pair">{columns}</div>'
        )
    return (
        "<p>No question has transcripts both before and after RL "
        "(<code>eval/before_transcripts.jsonl</code> and <code>eval/after_transcripts.jsonl</code>).</p>"
    )


def headline_html(h: dict, out_dir: Path) -> str:
    """The "Did it learn?" section of the report page (PNGs written to ``out_dir`` and embedded)."""
    plots = headline_plots(h, out_dir)
    missing = "".join(
        f'<p class="missing">{html.escape(r["run"])}: {html.escape(r["missing"])}</p>'
        for r in h["runs"]
        if r["missing"]
    )
    steps = ", ".join(str(r["steps"]) for r in h["runs"])
    stats_note = (
        "95% CIs of each eval: Student-t over the held-out questions (greedy decoding, one rollout per "
        "question). Gain: paired over the same questions (by example id), Student-t on the per-question "
        "differences. These CIs cover question sampling only, not training-seed variance."
    )
    if len(h["runs"]) > 1:
        stats_note += (
            " Across runs: mean of the per-run values, Student-t 95% CI over runs (this one includes seed variance)."
        )
    strata = (
        _img(plots["did_it_learn_strata.png"], "reward per stratum")
        if "did_it_learn_strata.png" in plots
        else "<p>No per-stratum metrics (<code>stratum/&lt;k&gt;/reward_mean</code>) in metrics.jsonl.</p>"
    )
    band = (
        f"centered {SMOOTH_WINDOW}-step moving mean ± 1.96 standard errors of that mean"
        if len(h["runs"]) == 1
        else "mean over runs ± 95% t-CI over runs"
    )
    return f"""<h2 id="did-it-learn">Did it learn?</h2>
<p class="verdict"><b>{html.escape(h["verdict"])}</b></p>{missing}
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

PAGE_STYLE = """<style>body{font-family:sans-serif;margin:2em;max-width:1400px} img{max-width:100%}
table{border-collapse:collapse;margin:.5em 0} td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}
.verdict{font-size:1.15em} .missing{color:#a40} .note{color:#444;font-size:.9em}
.pair{display:flex;gap:1em} .pair .col{flex:1;min-width:0}
pre{white-space:pre-wrap;word-break:break-word;margin:.2em 0;padding:.3em;font-size:.85em}
pre.model{background:#f2f2f2} pre.obs{background:#eaf2fb}</style>"""  # the report's pages (this one and evaluation.benchmark_report's)


def build_report(
    run_dirs: list[str | Path], output: str | Path | None = None, *, title: str = "stratarl report"
) -> Path:
    """Write ``report.html`` comparing ``run_dirs``: "Did it learn?" (:func:`headline_html`), the eval tables,
    then one PNG per metric namespace (PNGs next to the page and embedded); return the HTML path.

    Default output: ``<first run>/report/report.html``.
    """
    dirs = [Path(d) for d in run_dirs]
    if not dirs:
        raise ValueError("give at least one run directory")
    for d in dirs:
        if not (d / "metrics.jsonl").is_file():
            raise FileNotFoundError(
                f"{d} has no metrics.jsonl: pass run directories written by `stratarl train` (e.g. runs/<name>)"
            )
    out_html = Path(output) if output is not None else dirs[0] / "report" / "report.html"
    out_html.parent.mkdir(parents=True, exist_ok=True)
    runs = {name: numeric_series(read_metrics(d)) for name, d in zip(unique_run_names(dirs), dirs)}
    keys_by_ns: dict[str, set[str]] = {}
    for series in runs.values():
        for key in series:
            keys_by_ns.setdefault(namespace_of(key), set()).add(key)
    order = [ns for ns in NAMESPACE_ORDER if ns in keys_by_ns] + sorted(
        ns for ns in keys_by_ns if ns not in NAMESPACE_ORDER
    )
    sections = []
    for ns in order:
        keys = sorted(keys_by_ns[ns])
        png = plot_namespace(ns, keys, runs, out_html.parent / f"{ns}.png")
        b64 = base64.b64encode(png).decode("ascii")
        sections.append(
            f'<h2 id="{html.escape(ns)}">{html.escape(ns)}</h2><img alt="{html.escape(ns)} curves" src="data:image/png;base64,{b64}">'
        )
    evals = "".join(
        f"<h3>{html.escape(name)}</h3>{_eval_tables(d) or '<p>no eval results</p>'}" for name, d in zip(runs, dirs)
    )
    nav = " · ".join(
        ['<a href="#did-it-learn">Did it learn?</a>', '<a href="#eval">eval</a>']
        + [f'<a href="#{html.escape(ns)}">{html.escape(ns)}</a>' for ns in order]
    )
    summary = headline(dirs)
    learned = headline_html(summary, out_html.parent)
    # RL steps = training rows (eval rows of metrics.jsonl share step numbers and are not steps).
    run_list = "".join(
        f"<li><code>{html.escape(str(d))}</code>: {r['steps']} RL steps, {len(r['evals'])} held-out evals</li>"
        for d, r in zip(dirs, summary["runs"])
    )
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
{PAGE_STYLE}
</head><body><h1>{html.escape(title)}</h1><ul>{run_list}</ul><p>{nav}</p>
{learned}
{_offpolicy_html(runs)}<h2 id="eval">eval</h2>{evals}{"".join(sections)}</body></html>"""
    out_html.write_text(page)
    return out_html
