"""Tables and figures of an evidence experiment, regenerated from its committed run summaries alone.

    python benchmarks/evidence/tables.py lab_stratified          # -> docs/results/lab_stratified.md + .png
    python benchmarks/evidence/tables.py lab_sorl --results DIR --out DIR

Reads ``benchmarks/evidence/results/<experiment>/<condition>/<arm>-s<seed>.json`` (written by run.py when a
run finishes; see summarize_run there) and the experiment's YAML (arms, conditions, baseline and the
pre-registered ``metrics``). Per condition and arm: mean ± 95% Student-t CI over seeds of every metric;
per arm vs the baseline: the paired difference over the seeds both have (mean ± 95% CI), whether the CI
excludes 0, and the smallest difference the design detects with 80% power (``detectable_difference``).
Figures: the training reward (centered 11-step moving mean per run), mean ± 95% CI band over seeds, per arm.
Nothing is rerun; a sweep finished in parts (on several machines) regenerates the same tables.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from run import RESULTS, load_experiment  # noqa: E402  (the runner's own experiment loader)

from stratarl.trainer.stats import (  # noqa: E402
    Interval,
    collapse_step,
    detectable_difference,
    excludes_zero,
    mean_ci,
    paired_difference,
    rolling_band,
)

DOCS = HERE.parents[1] / "docs" / "results"
SMOOTH = 11  # steps in the centered moving mean of the figures
PLOT_EVERY = 5  # plot every 5th step of the smoothed curve


def _mean(values) -> float | None:
    xs = [float(v) for v in values if v is not None]
    return sum(xs) / len(xs) if xs else None


def _eval(run: dict, tag: str, key: str) -> float | None:
    return (run.get("eval", {}).get(tag) or {}).get(key)


def _binned(run: dict, key: str) -> float | None:
    return _mean(run.get("binned", {}).get("metrics", {}).get(key, []))


def _reward(run: dict) -> list[float]:
    return [float(v) for v in run["per_step"]["reward/mean"] if v is not None]


def _collapsed(run: dict) -> float:
    reward = _reward(run)
    return float(collapse_step(list(range(1, len(reward) + 1)), reward)["step"] is not None)


# name -> (description, function of one run summary); the experiment YAML's `metrics` picks from these.
METRICS = {
    "em_after": ("held-out greedy EM after training", lambda r: _eval(r, "after", "em")),
    "em_before": ("held-out greedy EM of the warm start", lambda r: _eval(r, "before", "em")),
    "em_gain": ("held-out EM after - before", lambda r: None if _eval(r, "after", "em") is None
                else _eval(r, "after", "em") - _eval(r, "before", "em")),
    "searches_after": ("held-out searches per question after training", lambda r: _eval(r, "after", "searches")),
    "reward_1_100": ("training reward, mean over steps 1-100", lambda r: _mean(_reward(r)[:100])),
    "reward_all": ("training reward, mean over all steps", lambda r: _mean(_reward(r))),
    "reward_last_50": ("training reward, mean over the last 50 steps", lambda r: _mean(_reward(r)[-50:])),
    "collapsed": ("share of runs that collapsed (CollapseRule on the training reward)", _collapsed),
    "cross_var": ("cross-stratum variance of the reward, mean over training", lambda r: _binned(r, "stratum/cross_var")),
    "zero_san": ("share of rollouts with SAN advantage 0, mean over training",
                 lambda r: _binned(r, "stratum/zero_san_frac")),
    "clip_frac": ("clipped token share, mean over training", lambda r: _binned(r, "loss/clip_frac")),
    "approx_kl": ("KL(new || behaviour), mean over training", lambda r: _binned(r, "loss/approx_kl")),
    "c_norm": ("||C||, mean over training", lambda r: _binned(r, "sorl/c_norm")),
    "engaged": ("share of optimizer steps where ||C|| > delta", lambda r: _binned(r, "sorl/engaged")),
}


def load_runs(exp: dict, results: Path) -> dict[str, dict[str, dict[int, dict]]]:
    """condition -> arm -> seed -> run summary (only arms and conditions the experiment still has)."""
    runs: dict = defaultdict(lambda: defaultdict(dict))
    for path in sorted((results / exp["name"]).glob("*/*.json")):
        run = json.loads(path.read_text())
        if run.get("condition") in exp["conditions"] and run.get("arm") in exp["arms"]:
            runs[run["condition"]][run["arm"]][int(run["seed"])] = run
    return runs


def _fmt(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _interval(iv: dict) -> str:
    return Interval(**iv).format()


def _diff(d: dict, digits: int = 3) -> str:
    if d.get("mean") is None:
        return "-"
    if d.get("half_width") is None:
        return f"{d['mean']:+.{digits}f} (n={d['n']})"
    return f"{d['mean']:+.{digits}f} [{d['low']:+.{digits}f}, {d['high']:+.{digits}f}]"


def condition_tables(exp: dict, condition: str, arms: dict[str, dict[int, dict]]) -> dict:
    """Per-arm intervals and paired differences vs the baseline for every metric of the design."""
    design = exp.get("metrics", {})
    names = [design.get("primary", "em_after"), *design.get("secondary", []), *design.get("diagnostics", [])]
    per_arm, paired = {}, {}
    base = exp["baseline"]
    values = {arm: {m: {s: METRICS[m][1](r) for s, r in seeds.items()} for m in names} for arm, seeds in arms.items()}
    for arm in exp["arms"]:
        if arm not in values:
            continue
        per_arm[arm] = {m: mean_ci([v for v in values[arm][m].values() if v is not None]).to_dict() for m in names}
        per_arm[arm]["seeds"] = sorted(arms[arm])
        if arm != base and base in values:
            paired[arm] = {}
            for m in names[:1 + len(design.get("secondary", []))]:
                a = {s: v for s, v in values[arm][m].items() if v is not None}
                b = {s: v for s, v in values[base][m].items() if v is not None}
                d = paired_difference(a, b)
                d["excludes_zero"] = excludes_zero(d)
                d["detectable"] = detectable_difference(d.get("std"), d["n"])
                paired[arm][m] = d
    return {"condition": condition, "metrics": names, "per_arm": per_arm, "paired": paired}


def verdict(exp: dict, table: dict) -> str:
    """One mechanical sentence per condition on the primary metric (no judgement added)."""
    primary = table["metrics"][0]
    parts = []
    for arm, by_metric in table["paired"].items():
        d = by_metric[primary]
        if d.get("mean") is None:
            continue
        if d["excludes_zero"] is None:
            parts.append(f"{arm} {d['mean']:+.3f} (1 seed, no CI)")
        elif d["excludes_zero"]:
            word = "above" if d["mean"] > 0 else "below"
            parts.append(f"**{arm} {word} {exp['baseline']}: {_diff(d)}**")
        else:
            parts.append(f"{arm} {_diff(d)} (CI includes 0; detectable: {d['detectable']:.3f})")
    return f"{primary} vs {exp['baseline']}: " + "; ".join(parts) if parts else "no paired runs yet"


def _band(curves: list[list[float]]) -> tuple[list[float], list[float | None], list[float | None]]:
    """Per index: mean and 95% CI over the curves (cut to the shortest)."""
    length = min(len(c) for c in curves)
    ivs = [mean_ci([c[i] for c in curves]) for i in range(length)]
    return [iv.mean for iv in ivs], [iv.low for iv in ivs], [iv.high for iv in ivs]


def figure(exp: dict, condition: str, arms: dict[str, dict[int, dict]], path: Path) -> None:
    """Training reward per arm (mean ± 95% CI over seeds), plus one panel per binned metric the experiment's
    ``metrics.figure`` lists (e.g. stratum/cross_var), on the same step axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    extra = list(exp.get("metrics", {}).get("figure", []))
    fig, axes = plt.subplots(1, 1 + len(extra), figsize=(6.5 * (1 + len(extra)), 4), squeeze=False)
    for arm in exp["arms"]:
        if arm not in arms:
            continue
        runs = list(arms[arm].values())
        mean, low, high = _band([rolling_band(_reward(r), SMOOTH, centered=True)[0] for r in runs])
        xs = list(range(1, len(mean) + 1))[::PLOT_EVERY]  # every few steps of the smoothed curve: a small file
        mean, low, high = mean[::PLOT_EVERY], low[::PLOT_EVERY], high[::PLOT_EVERY]
        line = axes[0][0].plot(xs, mean, label=f"{arm} (n={len(runs)})", lw=1.2)[0]
        if len(runs) > 1:
            axes[0][0].fill_between(xs, low, high, color=line.get_color(), alpha=0.15)
        for ax, key in zip(axes[0][1:], extra):
            curves = [r["binned"]["metrics"].get(key) for r in runs]
            curves = [[v for v in c if v is not None] for c in curves if c]
            if not curves or not all(curves):
                continue
            bin_steps = runs[0]["binned"]["bin_steps"]
            mean, low, high = _band(curves)
            xs = [bin_steps * (i + 0.5) for i in range(len(mean))]
            ax.plot(xs, mean, color=line.get_color(), lw=1.2)
            if len(curves) > 1:
                ax.fill_between(xs, low, high, color=line.get_color(), alpha=0.15)
    axes[0][0].set_ylabel(f"training reward ({SMOOTH}-step centered mean)")
    axes[0][0].legend(fontsize=8)
    for ax, key in zip(axes[0][1:], extra):
        ax.set_ylabel(f"{key} (10-step bins)")
    for ax in axes[0]:
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
    fig.suptitle(f"{exp['name']} / {condition}: mean ± 95% CI over seeds")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=70)
    plt.close(fig)
    from PIL import Image  # matplotlib's own dependency

    with Image.open(path) as image:  # a 64-colour palette: a few tens of KB to commit instead of ~200
        quantized = image.convert("RGB").quantize(64)
    quantized.save(path, optimize=True)


def render(exp: dict, tables: list[dict], figures: dict[str, str], counts: dict[str, int]) -> str:
    design = exp.get("metrics", {})
    lines = [f"# {exp['name']}: {exp.get('description', '')}", "",
             f"Regenerated by `python benchmarks/evidence/tables.py {exp['name']}` from the run summaries under "
             f"`benchmarks/evidence/results/{exp['name']}/`; do not edit by hand.", "",
             f"Primary metric: `{design.get('primary', 'em_after')}`; secondary: "
             f"{', '.join(f'`{m}`' for m in design.get('secondary', [])) or '-'}. Mean ± 95% t-interval over seeds; "
             f"paired differences vs `{exp['baseline']}` over the seeds both arms have, [95% CI]; *detectable* is "
             "the smallest true difference this many seeds detect with 80% power, given the observed spread of "
             "the differences.", ""]
    for m in tables[0]["metrics"] if tables else []:
        lines.append(f"- `{m}`: {METRICS[m][0]}")
    for table in tables:
        cond = table["condition"]
        lines += ["", f"## {cond} ({counts[cond]} runs)", "", f"Verdict: {verdict(exp, table)}", ""]
        lines.append("| arm | seeds | " + " | ".join(table["metrics"]) + " |")
        lines.append("|---|---|" + "---|" * len(table["metrics"]))
        for arm, row in table["per_arm"].items():
            lines.append(f"| {arm} | {len(row['seeds'])} | " + " | ".join(_interval(row[m]) for m in table["metrics"]) + " |")
        if table["paired"]:
            lines += ["", f"| arm − {exp['baseline']} | metric | difference [95% CI] | excludes 0 | detectable (80% power) |",
                      "|---|---|---|---|---|"]
            for arm, by_metric in table["paired"].items():
                for m, d in by_metric.items():
                    ez = {True: "yes", False: "no", None: "-"}[d["excludes_zero"]]
                    lines.append(f"| {arm} | {m} | {_diff(d)} | {ez} | {_fmt(d['detectable'])} |")
        if cond in figures:
            lines += ["", f"![{cond}]({figures[cond]})"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("experiment", help="an experiment name (lab_stratified, lab_sorl, ...) or its YAML path")
    p.add_argument("--results", type=Path, default=RESULTS, help="run summaries root (default: the committed ones)")
    p.add_argument("--out", type=Path, default=DOCS, help="folder for <experiment>.md / .json / figures (default docs/results)")
    p.add_argument("--no-figures", action="store_true", help="tables only (no matplotlib)")
    args = p.parse_args(argv)
    exp = load_experiment(args.experiment)
    runs = load_runs(exp, args.results)
    if not runs:
        print(f"no run summaries for {exp['name']} under {args.results / exp['name']}", flush=True)
        return 1
    unknown = {m for m in [exp.get("metrics", {}).get("primary", "em_after"), *exp.get("metrics", {}).get("secondary", []),
                           *exp.get("metrics", {}).get("diagnostics", [])] if m not in METRICS}
    if unknown:
        sys.exit(f"error: {exp['name']}: unknown metrics {sorted(unknown)}. Fix: use some of {', '.join(METRICS)}")
    tables, figures, counts = [], {}, {}
    for cond in exp["conditions"]:
        if cond not in runs:
            continue
        tables.append(condition_tables(exp, cond, runs[cond]))
        counts[cond] = sum(len(s) for s in runs[cond].values())
        if not args.no_figures:
            name = f"{exp['name']}_{cond}.png"
            figure(exp, cond, runs[cond], args.out / name)
            figures[cond] = name
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{exp['name']}.md").write_text(render(exp, tables, figures, counts))
    (args.out / f"{exp['name']}.json").write_text(json.dumps(tables, indent=1, default=str) + "\n")
    for table in tables:
        print(f"{table['condition']}: {verdict(exp, table)}", flush=True)
    print(f"wrote {args.out / (exp['name'] + '.md')}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
