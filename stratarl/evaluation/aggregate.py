"""`stratarl report --aggregate`: arms x seeds -> mean ± 95% CI tables, paired comparisons, bands.

Each run directory belongs to an arm. The arm (and its condition, e.g. a task or an off-policy
degree, and its seed) is read from ``<run>/arm.json`` (``{"arm": ..., "condition": ..., "seed": ...}``,
written by ``benchmarks/evidence/run.py``); without it the arm is ``algo.name`` and the seed
``trainer.seed`` of the run's config.yaml. Arms are compared inside a condition only.

Per run (definitions, also written into aggregate.json):

- ``final/<m>``: mean of metric m over the last ``final_window`` logged steps;
- ``auc/<m>``: mean of m over all logged steps (area under the curve / number of steps);
- ``mean/<m>``: the same run mean, for diagnostics (clip fractions, ‖C‖, grad norm, KL, ...);
- ``eval_after/em`` (and per question type): held-out greedy EM after training, when evaluated;
- ``collapse``: step and reason from :func:`stratarl.evaluation.stats.collapse_step`.

Per arm: mean ± 95% Student-t CI over seeds. Per arm ≠ baseline: the paired difference over the
seeds both have (same seed = same data order and initial weights), mean ± 95% CI.
"""

from __future__ import annotations

import base64
import html
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from stratarl.evaluation.plots import panel_grid, save_png
from stratarl.evaluation.rundir import metric_series, run_info, train_rows
from stratarl.evaluation.stats import CollapseRule, collapse_step, mean_ci, paired_difference, steps_ci

HEADLINE = ("reward/mean", "reward/em")
DIAGNOSTICS = (
    "rollout/valid_action_rate",
    "rollout/search_calls_mean",
    "loss/clip_frac",
    "loss/clip_frac_turn",
    "sorl/c_norm",
    "sorl/scale",
    "optim/grad_norm",
    "loss/approx_kl",
    "loss/kl",
    "stratum/cross_var",
    "stratum/zero_san_frac",
)
CURVES = HEADLINE + DIAGNOSTICS
# Curves also plotted when present: per-type EM and the search-count distribution.
CURVE_PREFIXES = ("reward/em_by_type/", "rollout/search_calls_frac/")


def run_scalars(run_dir: Path, final_window: int = 5, rule: CollapseRule = CollapseRule()) -> dict:
    """The per-run numbers every arm statistic is built from (see the module docstring)."""
    rows = train_rows(run_dir)
    out: dict = {"steps": len(rows)}
    keys = set(CURVES) | {k for r in rows for k in r if k.startswith("reward/em_by_type/")}
    for key in sorted(keys):
        _, values = metric_series(rows, key)
        if not values:
            continue
        out[f"mean/{key}"] = sum(values) / len(values)
        if key in HEADLINE or key.startswith("reward/em_by_type/"):
            tail = values[-final_window:]
            out[f"final/{key}"] = sum(tail) / len(tail)
            out[f"auc/{key}"] = sum(values) / len(values)
    for tag in ("before", "after"):
        path = run_dir / "eval" / f"{tag}.json"
        if path.is_file():
            result = json.loads(path.read_text())
            per_source = result.get("per_source", {})
            overall: dict[str, Any] = per_source.get("all") or next(iter(per_source.values()), {})
            if "em" in overall:
                out[f"eval_{tag}/em"] = overall["em"]
            for question_type, m in result.get("per_type", {}).items():
                out[f"eval_{tag}/em_by_type/{question_type}"] = m["em"]
    steps, reward = metric_series(rows, "reward/mean")
    valid_steps, valid = metric_series(rows, "rollout/valid_action_rate")
    out["collapse"] = collapse_step(steps, reward, valid if valid_steps == steps and valid else None, rule)
    return out


def _comparable(name: str) -> bool:
    return name.startswith(("final/", "auc/", "eval_after/", "eval_before/"))


def aggregate_runs(
    run_dirs: list[str | Path],
    baseline: str | None = None,
    *,
    final_window: int = 5,
    rule: CollapseRule = CollapseRule(),
) -> dict:
    """Group runs by (condition, arm) and compute per-arm CIs and paired differences vs ``baseline``."""
    conditions: dict[str, dict[str, dict]] = {}
    for d in map(Path, run_dirs):
        if not (d / "metrics.jsonl").is_file():
            raise FileNotFoundError(f"{d} has no metrics.jsonl: pass run directories written by `stratarl train`")
        info = run_info(d)
        arm = conditions.setdefault(str(info["condition"]), {}).setdefault(str(info["arm"]), {"runs": {}})
        seed = int(info["seed"])
        if seed in arm["runs"]:
            raise ValueError(
                f"two runs of arm {info['arm']!r} (condition {info['condition']!r}) have seed {seed}: "
                f"{arm['runs'][seed]['run_dir']} and {d}. Fix: pass each run once"
            )
        arm["runs"][seed] = {"run_dir": str(d), **run_scalars(d, final_window, rule)}
    result: dict = {"baseline": baseline, "final_window": final_window, "collapse_rule": asdict(rule), "conditions": {}}
    for condition, arms in sorted(conditions.items()):
        block: dict = {"arms": {}, "paired": {}}
        for name, arm in arms.items():
            runs = arm["runs"]
            names = sorted(
                {k for r in runs.values() for k, v in r.items() if isinstance(v, (int, float)) and k != "steps"}
            )
            collapsed = {s: r["collapse"] for s, r in runs.items()}
            block["arms"][name] = {
                "n": len(runs),
                "seeds": sorted(runs),
                "runs": {str(s): r for s, r in sorted(runs.items())},
                "metrics": {k: mean_ci([r[k] for r in runs.values() if k in r]).to_dict() for k in names},
                "collapsed_runs": sum(c["step"] is not None for c in collapsed.values()),
                "collapse_steps": {str(s): c["step"] for s, c in sorted(collapsed.items())},
            }
        if baseline is not None and baseline in arms:
            base_runs = arms[baseline]["runs"]
            for name, arm in arms.items():
                if name == baseline:
                    continue
                metrics = sorted({k for r in arm["runs"].values() for k in r if _comparable(k)})
                block["paired"][name] = {
                    k: paired_difference(
                        {s: r[k] for s, r in arm["runs"].items() if k in r},
                        {s: r[k] for s, r in base_runs.items() if k in r},
                    )
                    for k in metrics
                }
        elif baseline is not None:
            block["baseline_missing"] = f"no arm named {baseline!r} in condition {condition!r}; arms: {sorted(arms)}"
        result["conditions"][condition] = block
    return result


# --------------------------------------------------------------------------- tables


def _fmt(d: dict | None, digits: int = 3) -> str:
    if not d or d.get("mean") is None:
        return "-"
    if d.get("half_width") is None:
        return f"{d['mean']:.{digits}f} (n={d['n']})"
    return f"{d['mean']:.{digits}f} ± {d['half_width']:.{digits}f}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def markdown_tables(result: dict) -> str:
    """aggregate.md: per condition, a headline table (mean ± 95% CI over seeds), the paired
    differences vs the baseline, diagnostics and collapse steps."""
    out = [
        "# Aggregate over seeds",
        "",
        (
            f"Mean ± 95% Student-t CI half-width over seeds (n = seeds; no CI with one seed). final = mean of the last "
            f"{result['final_window']} steps; auc = mean over all steps. Baseline: `{result['baseline']}`."
        ),
        "",
    ]
    for condition, block in result["conditions"].items():
        arms = block["arms"]
        out += [f"## {condition or 'all runs'}", ""]
        headline = [
            k
            for k in ("final/reward/mean", "auc/reward/mean", "final/reward/em", "auc/reward/em", "eval_after/em")
            if any(k in a["metrics"] for a in arms.values())
        ]
        types = sorted(
            {
                k
                for a in arms.values()
                for k in a["metrics"]
                if k.startswith(("final/reward/em_by_type/", "eval_after/em_by_type/"))
            }
        )
        rows = [
            [
                name,
                str(a["n"]),
                *(_fmt(a["metrics"].get(k)) for k in headline + types),
                f"{a['collapsed_runs']}/{a['n']}",
            ]
            for name, a in arms.items()
        ]
        out += [_table(["arm", "n", *headline, *types, "collapsed"], rows), ""]
        if block.get("paired"):
            keys = sorted({k for p in block["paired"].values() for k in p})
            keys = [k for k in headline + types if k in keys]
            rows = [[name, *(_fmt(p.get(k)) for k in keys)] for name, p in block["paired"].items()]
            out += [
                f"Paired difference arm − `{result['baseline']}` (same seeds), mean ± 95% CI:",
                "",
                _table(["arm", *keys], rows),
                "",
            ]
        if block.get("baseline_missing"):
            out += [f"(no paired comparison: {block['baseline_missing']})", ""]
        diag = [k for k in DIAGNOSTICS if any(f"mean/{k}" in a["metrics"] for a in arms.values())]
        if diag:
            rows = [[name, *(_fmt(a["metrics"].get(f"mean/{k}")) for k in diag)] for name, a in arms.items()]
            out += ["Run means of the diagnostics:", "", _table(["arm", *diag], rows), ""]
        rows = [
            [name, ", ".join(f"seed {s}: {v if v is not None else '-'}" for s, v in a["collapse_steps"].items())]
            for name, a in arms.items()
        ]
        out += ["Collapse step per run (- = no collapse):", "", _table(["arm", "collapse steps"], rows), ""]
    return "\n".join(out)


# --------------------------------------------------------------------------- plots and page


def _band_series(run_dirs: list[str], key: str) -> tuple[list[int], list[float], list[float | None]]:
    xs, cis = steps_ci([metric_series(train_rows(Path(d)), key) for d in run_dirs])
    return xs, [c.mean for c in cis], [c.half_width for c in cis]


def plot_condition(condition: str, block: dict, out_png: Path) -> bytes | None:
    """One PNG per condition: a panel per curve metric, mean over seeds ± 95% CI band per arm."""
    arms = {name: [r["run_dir"] for r in a["runs"].values()] for name, a in block["arms"].items()}
    present: set[str] = set()
    for dirs in arms.values():
        for d in dirs:
            for row in train_rows(Path(d)):
                present.update(k for k in row if k in CURVES or k.startswith(CURVE_PREFIXES))
    keys = [k for k in CURVES if k in present] + sorted(k for k in present if k not in CURVES)
    if not keys:
        return None
    plt, fig, panels, colors, nrows = panel_grid(keys)
    for ax, key in zip(panels, keys):
        for j, (name, dirs) in enumerate(arms.items()):
            xs, means, halves = _band_series(dirs, key)
            if not xs:
                continue
            color = colors[j % len(colors)]
            ax.plot(xs, means, label=name, color=color, marker="." if len(xs) < 30 else None)
            low = [m - h if h is not None else m for m, h in zip(means, halves)]
            high = [m + h if h is not None else m for m, h in zip(means, halves)]
            ax.fill_between(xs, low, high, color=color, alpha=0.2)
    handles, labels = panels[0].get_legend_handles_labels()
    fig.tight_layout()
    if handles:
        fig.legend(handles, labels, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=min(6, len(labels)), fontsize=9)
    fig.suptitle(f"{condition or 'all runs'}: mean over seeds ± 95% CI", y=1.0 + 0.35 / nrows, fontsize=11)
    return save_png(plt, fig, out_png)


def _md_to_html(md: str) -> str:
    """The tiny markdown subset markdown_tables writes: headings, paragraphs, pipe tables."""
    parts: list[str] = []
    table: list[str] = []

    def flush() -> None:
        if table:
            head, *body = [
                [html.escape(c.strip()) for c in r.strip("|").split("|")] for r in table if not r.startswith("|---")
            ]
            parts.append(
                "<table><tr>"
                + "".join(f"<th>{c}</th>" for c in head)
                + "</tr>"
                + "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in body)
                + "</table>"
            )
            table.clear()

    for line in md.splitlines():
        if line.startswith("|"):
            table.append(line)
            continue
        flush()
        if line.startswith("## "):
            parts.append(f"<h2>{html.escape(line[3:])}</h2>")
        elif line.startswith("# "):
            parts.append(f"<h1>{html.escape(line[2:])}</h1>")
        elif line.strip():
            parts.append(f"<p>{html.escape(line)}</p>")
    flush()
    return "\n".join(parts)


def write_aggregate(
    run_dirs: list[str | Path],
    out_html: str | Path,
    *,
    baseline: str | None = None,
    final_window: int = 5,
    title: str = "stratarl aggregate",
    rule: CollapseRule = CollapseRule(),
) -> Path:
    """Write aggregate.json, aggregate.md, one PNG per condition and the HTML page next to ``out_html``."""
    out_html = Path(out_html)
    out = out_html.parent
    out.mkdir(parents=True, exist_ok=True)
    result = aggregate_runs(run_dirs, baseline, final_window=final_window, rule=rule)
    (out / "aggregate.json").write_text(json.dumps(result, indent=2) + "\n")
    md = markdown_tables(result)
    (out / "aggregate.md").write_text(md + "\n")
    figures = []
    for i, (condition, block) in enumerate(result["conditions"].items()):
        slug = "".join(c if c.isalnum() or c in "-_" else "_" for c in condition) or f"condition{i}"
        png = plot_condition(condition, block, out / f"curves_{slug}.png")
        if png is not None:
            b64 = base64.b64encode(png).decode("ascii")
            figures.append(
                f"<h2>{html.escape(condition or 'all runs')}: curves</h2>"
                f'<img alt="curves {html.escape(condition)}" src="data:image/png;base64,{b64}">'
            )
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1400px}} img{{max-width:100%}}
table{{border-collapse:collapse;margin:.5em 0}} td,th{{border:1px solid #ccc;padding:2px 8px;text-align:right}}</style>
</head><body><h1>{html.escape(title)}</h1>{_md_to_html(md)}{"".join(figures)}</body></html>"""
    out_html.write_text(page)
    return out_html
