"""Tables and figures of an evidence experiment, regenerated from its committed run summaries alone.

    python benchmarks/evidence/tables.py lab_stratified          # -> docs/results/lab_stratified.md + .png
    python benchmarks/evidence/tables.py lab_sorl --results DIR --out DIR
    python benchmarks/evidence/tables.py                         # every experiment with committed summaries

Reads ``benchmarks/evidence/results/<experiment>/<condition>/<arm>-s<seed>.json`` (written by run.py when a
run finishes; see summaries.summarize_run) and the experiment's YAML (arms, conditions, baseline and the
pre-registered ``metrics``). Per condition and arm: mean ± 95% Student-t CI over seeds of every metric;
per arm vs the baseline: the paired difference over the seeds both have (mean ± 95% CI), whether the CI
excludes 0, and the smallest difference the design detects with 80% power (``detectable_difference``).
Figures: the training reward (centered 11-step moving mean per run), mean ± 95% CI band over seeds, per arm.
Nothing is rerun; a sweep finished in parts (on several machines) regenerates the same tables.

The experiment's headline table in docs/results.md (its YAML's ``headline`` section) is written between
``<!-- tables:<experiment> begin -->`` and ``<!-- tables:<experiment> end -->``; the page's tables are
generated, never transcribed. ``--check`` writes nothing and fails when a committed file differs from what
the committed summaries give. Needs only the standard library, PyYAML and the pure-Python stats module
(no torch); matplotlib only for the figures.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from planning import RESULTS, load_experiment, warmstart_group  # noqa: E402  (the runner's own experiment loader)

from stratarl.evaluation.stats import (  # noqa: E402
    Interval,
    collapse_step,
    detectable_difference,
    excludes_zero,
    mean_ci,
    paired_difference,
    rolling_band,
)

DOCS = HERE.parents[1] / "docs" / "results"
RESULTS_PAGE = HERE.parents[1] / "docs" / "results.md"
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


def _bins(run: dict, key: str) -> list:
    return run.get("binned", {}).get("metrics", {}).get(key) or []


def _success_given(run: dict, k: int, first: int, last: int) -> float | None:
    """Mean reward of the rollouts with k searches over the 10-step bins first..last (0-based, inclusive),
    weighted by their count (summaries.py: the summary_strata bins); None without any such rollout."""
    rewards, counts = _bins(run, f"stratum/{k}/reward_mean"), _bins(run, f"stratum/{k}/count_per_group")
    pairs = [(r, c) for r, c in list(zip(rewards, counts))[first : last + 1] if r is not None and c]
    total = sum(c for _, c in pairs)
    return sum(r * c for r, c in pairs) / total if total else None


def _gap(run: dict, k: int, j: int, first: int, last: int) -> float | None:
    """Success given k searches minus success given j searches over the same bins (None if either is absent)."""
    a, b = _success_given(run, k, first, last), _success_given(run, j, first, last)
    return None if a is None or b is None else a - b


def _share(run: dict, k: int, first: int, last: int) -> float | None:
    return _mean(_bins(run, f"rollout/search_calls_frac/{k}")[first : last + 1])


# name -> (description, function of one run summary); the experiment YAML's `metrics` picks from these.
METRICS = {
    "em_after": ("held-out greedy EM after training", lambda r: _eval(r, "after", "em")),
    "em_before": ("held-out greedy EM of the warm start", lambda r: _eval(r, "before", "em")),
    "em_gain": (
        "held-out EM after - before",
        lambda r: None if _eval(r, "after", "em") is None else _eval(r, "after", "em") - _eval(r, "before", "em"),
    ),
    "searches_after": ("held-out searches per question after training", lambda r: _eval(r, "after", "searches")),
    "reward_1_100": ("training reward, mean over steps 1-100", lambda r: _mean(_reward(r)[:100])),
    "reward_all": ("training reward, mean over all steps", lambda r: _mean(_reward(r))),
    "reward_last_50": ("training reward, mean over the last 50 steps", lambda r: _mean(_reward(r)[-50:])),
    "collapsed": ("share of runs that collapsed (CollapseRule on the training reward)", _collapsed),
    "cross_var": (
        "cross-stratum variance of the reward, mean over training",
        lambda r: _binned(r, "stratum/cross_var"),
    ),
    "zero_san": (
        "share of rollouts with SAN advantage 0, mean over training",
        lambda r: _binned(r, "stratum/zero_san_frac"),
    ),
    "clip_frac": ("clipped token share, mean over training", lambda r: _binned(r, "loss/clip_frac")),
    "approx_kl": ("KL(new || behaviour), mean over training", lambda r: _binned(r, "loss/approx_kl")),
    "c_norm": ("||C||, mean over training", lambda r: _binned(r, "sorl/c_norm")),
    "engaged": ("share of optimizer steps where ||C|| > delta", lambda r: _binned(r, "sorl/engaged")),
    "neg_adv_mass": (
        "share of the |advantage| mass on policy tokens with A < 0, mean over training",
        lambda r: _binned(r, "advantage/negative_mass_share"),
    ),
    # Bins below -100 are left out: before stratarl skipped steps with flat returns, such a step logged ~-1e13.
    "critic_ev": (
        "the critic's explained variance of the returns, mean over steps 51-150 (bins below -100 left out)",
        lambda r: _mean([v for v in _bins(r, "critic/explained_variance")[5:] if v is not None and v > -100]),
    ),
    "critic_v_last": (
        "the critic's mean value V(s) on policy tokens, steps 101-150",
        lambda r: _mean(_bins(r, "critic/vpred_mean")[10:]),
    ),
    "effective_scale": (
        "what reached the optimizer over the raw policy gradient (SORL's factor after clipping)",
        lambda r: _binned(r, "sorl/effective_scale"),
    ),
    "valid_action": (
        "valid-action rate of the training rollouts, mean over training",
        lambda r: _binned(r, "rollout/valid_action_rate"),
    ),
    "success_2s_1_100": (
        "training reward of rollouts with 2 searches, steps 1-100 (count-weighted)",
        lambda r: _success_given(r, 2, 0, 9),
    ),
    "success_2s_at_100": (
        "training reward of rollouts with 2 searches, steps 91-100",
        lambda r: _success_given(r, 2, 9, 9),
    ),
    "success_0s_1_50": (
        "training reward of rollouts with no search, steps 1-50 (count-weighted)",
        lambda r: _success_given(r, 0, 0, 4),
    ),
    "success_2s_1_50": (
        "training reward of rollouts with 2 searches, steps 1-50 (count-weighted)",
        lambda r: _success_given(r, 2, 0, 4),
    ),
    "gap_2s_0s_1_50": (
        (
            "the between-stratum gap: training reward of the 2-search rollouts minus that of the no-search ones, "
            "steps 1-50 (its sign says which stratum GRPO's shared baseline favours)"
        ),
        lambda r: _gap(r, 2, 0, 0, 4),
    ),
    "share_2s_first": ("share of rollouts with 2 searches, steps 1-10", lambda r: _share(r, 2, 0, 0)),
    "share_2s_1_100": ("share of rollouts with 2 searches, steps 1-100", lambda r: _share(r, 2, 0, 9)),
    "share_2s_at_100": ("share of rollouts with 2 searches, steps 91-100", lambda r: _share(r, 2, 9, 9)),
    "success_2s_all": (
        "training reward of rollouts with 2 searches, all steps (count-weighted)",
        lambda r: _success_given(r, 2, 0, len(_bins(r, "stratum/2/reward_mean")) - 1),
    ),
    "success_2s_last": (
        "training reward of rollouts with 2 searches, the last 10-step bin",
        lambda r: _success_given(
            r, 2, len(_bins(r, "stratum/2/reward_mean")) - 1, len(_bins(r, "stratum/2/reward_mean")) - 1
        ),
    ),
    "share_2s_all": (
        "share of rollouts with 2 searches, all steps",
        lambda r: _share(r, 2, 0, len(_bins(r, "rollout/search_calls_frac/2")) - 1),
    ),
    "share_2s_last": (
        "share of rollouts with 2 searches, the last 10-step bin",
        lambda r: _share(
            r, 2, len(_bins(r, "rollout/search_calls_frac/2")) - 1, len(_bins(r, "rollout/search_calls_frac/2")) - 1
        ),
    ),
    "escaped": (
        (
            "1 when the policy escaped the guessing shortcut: held-out EM >= 0.6 (above any one-country guess) "
            "with >= 1.5 searches per question, else 0 (its mean is the share of worlds that escaped)"
        ),
        lambda r: (
            None
            if _eval(r, "after", "em") is None or _eval(r, "after", "searches") is None
            else float(_eval(r, "after", "em") >= 0.6 and _eval(r, "after", "searches") >= 1.5)
        ),
    ),
    "live_strata_1_50": (
        "share of prompt groups with >= 2 live strata (mean reward in [0.05, 0.95]), steps 1-50",
        lambda r: _mean(_bins(r, "stratum/live_groups_frac")[:5]),
    ),
    "live_strata_at_100": (
        "share of prompt groups with >= 2 live strata, steps 91-100",
        lambda r: _mean(_bins(r, "stratum/live_groups_frac")[9:10]),
    ),
    "valid_action_last": (
        "valid-action rate of the training rollouts, the last 10-step bin",
        lambda r: _mean(_bins(r, "rollout/valid_action_rate")[-1:]),
    ),
    "lag": ("policy lag of the sampled batches (RL steps), mean over training", lambda r: _binned(r, "offpolicy/lag")),
    "reward_last_fifth": (
        (
            "training reward, mean over the last 20% of the RL steps (the same rollouts consumed at "
            "every degree when the mini-batch is fixed)"
        ),
        lambda r: _mean(_reward(r)[-max(1, len(_reward(r)) // 5) :]),
    ),
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
            for m in names[: 1 + len(design.get("secondary", []))]:
                paired[arm][m] = _paired(values[arm][m], values[base][m])
    contrasts = {}
    for a, b in (c.split(" - ") for c in exp.get("contrasts", [])):
        if a in values and b in values:  # an arm pair of the design (e.g. so_ppo - ppo), both run here
            contrasts[f"{a} - {b}"] = {m: _paired(values[a][m], values[b][m]) for m in names}
    table = {"condition": condition, "metrics": names, "per_arm": per_arm, "paired": paired}
    if exp.get("contrasts"):
        table["contrasts"] = contrasts
    if exp.get("warmstart_groups"):
        table["warmstart_groups"] = warmstart_group_table(exp, values, names[0])
    return table


def warmstart_group_table(exp: dict, values: dict, primary: str) -> dict:
    """With ``warmstart_groups`` (planning.warmstart_group: seed s starts from warm start s mod G): per warm start,
    each arm's mean of the primary metric, its paired difference to the baseline within the group, and on how many
    of the group's worlds the arm ended above its warm start's own em_before."""
    groups, base = exp["warmstart_groups"], exp["baseline"]
    out: dict = {}
    for g in groups:
        after = {
            arm: {s: v for s, v in by_metric.get(primary, {}).items() if warmstart_group(groups, s) == g}
            for arm, by_metric in values.items()
        }
        rows = {}
        for arm, by_seed in after.items():
            before = values[arm].get("em_before", {})
            finished = [s for s, v in by_seed.items() if v is not None]
            above = [s for s in finished if before.get(s) is not None and by_seed[s] > before[s]]
            rows[arm] = {
                "seeds": sorted(finished),
                primary: mean_ci([by_seed[s] for s in finished]).to_dict(),
                "above_before": len(above),
            }
            if arm != base and base in after:
                rows[arm]["paired"] = _paired(by_seed, after[base])
        out[str(g)] = rows
    return out


def _paired(a: dict[int, float | None], b: dict[int, float | None]) -> dict:
    """Paired difference a - b over the seeds both have (mean, 95% CI, whether it excludes 0, detectable)."""
    d = paired_difference({s: v for s, v in a.items() if v is not None}, {s: v for s, v in b.items() if v is not None})
    d["excludes_zero"] = excludes_zero(d)
    d["detectable"] = detectable_difference(d.get("std"), d["n"])
    return d


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
    for index, arm in enumerate(exp["arms"]):
        if arm not in arms:
            continue
        style = {"color": f"C{index % 10}", "ls": ("-", "--", "-.", ":")[index % 4]}  # apart in a 64-colour PNG too
        runs = list(arms[arm].values())
        mean, low, high = _band([rolling_band(_reward(r), SMOOTH, centered=True)[0] for r in runs])
        xs = list(range(1, len(mean) + 1))[::PLOT_EVERY]  # every few steps of the smoothed curve: a small file
        mean, low, high = mean[::PLOT_EVERY], low[::PLOT_EVERY], high[::PLOT_EVERY]
        line = axes[0][0].plot(xs, mean, label=f"{arm} (n={len(runs)})", lw=1.2, **style)[0]
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
            ax.plot(xs, mean, lw=1.2, **style)
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
    lines = [
        f"# {exp['name']}: {exp.get('description', '')}",
        "",
        (
            f"Regenerated by `python benchmarks/evidence/tables.py {exp['name']}` from the run summaries under "
            f"`benchmarks/evidence/results/{exp['name']}/`; do not edit by hand."
        ),
        "",
        (
            f"Primary metric: `{design.get('primary', 'em_after')}`; secondary: "
            f"{', '.join(f'`{m}`' for m in design.get('secondary', [])) or '-'}. Mean ± 95% t-interval over seeds; "
            f"paired differences vs `{exp['baseline']}` over the seeds both arms have, [95% CI]; *detectable* is "
            "the smallest true difference this many seeds detect with 80% power, given the observed spread of "
            "the differences."
        ),
        "",
    ]
    for m in tables[0]["metrics"] if tables else []:
        lines.append(f"- `{m}`: {METRICS[m][0]}")
    for table in tables:
        cond = table["condition"]
        lines += ["", f"## {cond} ({counts[cond]} runs)", "", f"Verdict: {verdict(exp, table)}", ""]
        lines.append("| arm | seeds | " + " | ".join(table["metrics"]) + " |")
        lines.append("|---|---|" + "---|" * len(table["metrics"]))
        for arm, row in table["per_arm"].items():
            lines.append(
                f"| {arm} | {len(row['seeds'])} | " + " | ".join(_interval(row[m]) for m in table["metrics"]) + " |"
            )
        if table["paired"]:
            lines += _difference_rows(f"arm − {exp['baseline']}", table["paired"])
        if table.get("contrasts"):
            lines += _difference_rows(
                "contrast", {pair.replace(" - ", " − "): by_metric for pair, by_metric in table["contrasts"].items()}
            )
        if table.get("warmstart_groups"):
            lines += _group_rows(exp, table)
        if cond in figures:
            lines += ["", f"![{cond}]({figures[cond]})"]
    return "\n".join(lines) + "\n"


def _group_rows(exp: dict, table: dict) -> list[str]:
    """Per warm start (``warmstart_groups``): the primary metric, the worlds above the warm start's em_before,
    and the paired difference to the baseline within the group."""
    primary, base = table["metrics"][0], exp["baseline"]
    lines = [
        "",
        (
            f"Per warm start (world seed s starts from warm start s mod {len(table['warmstart_groups'])}): "
            f"{primary}, worlds where the run ended above its warm start's em_before, and the difference to "
            f"{base} within the group."
        ),
        "",
        f"| warm start | arm | worlds | {primary} | above em_before | − {base} |",
        "|---|---|---|---|---|---|",
    ]
    for g, rows in table["warmstart_groups"].items():
        for arm, row in rows.items():
            if not row["seeds"]:  # no run of this group yet
                continue
            diff = _diff(row["paired"]) if "paired" in row else "-"
            lines.append(
                f"| {g} | {arm} | {len(row['seeds'])} | {_interval(row[primary])} | "
                f"{row['above_before']} of {len(row['seeds'])} | {diff} |"
            )
    return lines


def _plain(x: float) -> str:
    return f"{x:.3f}".replace("-", "−")


def _difference_rows(heading: str, differences: dict[str, dict[str, dict]]) -> list[str]:
    """A markdown table of paired differences: one row per (name, metric) of ``differences``."""
    lines = [
        "",
        f"| {heading} | metric | difference [95% CI] | excludes 0 | detectable (80% power) |",
        "|---|---|---|---|---|",
    ]
    for name, by_metric in differences.items():
        for m, d in by_metric.items():
            ez = {True: "yes", False: "no", None: "-"}[d["excludes_zero"]]
            lines.append(f"| {name} | {m} | {_diff(d)} | {ez} | {_fmt(d['detectable'])} |")
    return lines


def _headline_cell(d: dict | None) -> str:
    """A paired difference as the results page writes it: mean [95% CI], bold when the CI excludes 0."""
    if d is None or d.get("mean") is None:
        return "-"
    text = _diff(d).replace("-", "−")  # the page's typography: a true minus sign
    return f"**{text}**" if d.get("half_width") is not None and d["excludes_zero"] else text


def headline_table(exp: dict, tables: list[dict]) -> str:
    """The results page's table of an experiment (its YAML's ``headline``): ``label`` of the row column;
    ``columns``: arm -> heading (the arm's paired difference vs the baseline) or ``"a - b"`` -> heading (a
    contrast the YAML's ``contrasts`` lists; default every arm but the baseline; none: the baseline's values
    alone); ``metrics``: the metrics, one row each per condition (default:
    the primary only). Per row: the warm start's mean of ``before`` (a metric, default em_before; null: no such
    column), the baseline's mean ± 95% CI, each column's paired difference [95% CI] (bold when it excludes 0),
    and the range of the design's detectable differences."""
    head = exp.get("headline") or {}
    columns = (
        head["columns"] if head.get("columns") is not None else {a: a for a in exp["arms"] if a != exp["baseline"]}
    )
    before = head.get("before", "em_before")  # null: no warm-start column
    base = exp["baseline"]
    base_name = head.get("baseline", base)
    metrics = head.get("metrics")
    # Without columns (a single-arm pilot) the table is the baseline's values alone: no differences to detect.
    headings = [
        head.get("label", "condition"),
        *(["metric"] if metrics else []),
        *(["warm start"] if before else []),
        base_name,
        *(name if " - " in key else f"{name} − {base_name}" for key, name in columns.items()),
        *(["detectable"] if columns else []),
    ]
    lines = ["| " + " | ".join(headings) + " |", "|" + "---|" * len(headings)]
    for table in tables:
        row = table["per_arm"].get(base, {})
        warm = (row.get(before) or {}).get("mean") if before else None
        for k, metric in enumerate(metrics or table["metrics"][:1]):
            base_iv = row.get(metric) or {}
            warm_cell = "" if k else "-" if warm is None else _plain(warm)  # once per condition
            cells = [
                table["condition"],
                *([metric] if metrics else []),
                *([warm_cell] if before else []),
                "-"
                if base_iv.get("mean") is None
                else _plain(base_iv["mean"])
                + ("" if base_iv.get("half_width") is None else f" ± {_plain(base_iv['half_width'])}"),
            ]
            found = [
                (table.get("contrasts", {}) if " - " in key else table["paired"]).get(key, {}).get(metric)
                for key in columns
            ]
            cells += [_headline_cell(d) for d in found]
            detectable = [
                d["detectable"] for d in found if d and d.get("mean") is not None and d.get("half_width") is not None
            ]
            if columns:
                cells.append(f"{min(detectable):.3f}-{max(detectable):.3f}" if detectable else "-")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def replace_marked(text: str, name: str, block: str, where: str = "docs/results.md") -> str:
    """``text`` with what lies between ``<!-- tables:<name> begin -->`` and ``... end -->`` replaced by
    ``block``; a clear error when the markers are missing or out of order."""
    begin, end = f"<!-- tables:{name} begin -->", f"<!-- tables:{name} end -->"
    i, j = text.find(begin), text.find(end)
    if i < 0 or j < i or text.count(begin) != 1 or text.count(end) != 1:
        raise ValueError(
            f"{where}: needs exactly one {begin!r} followed by one {end!r} around the generated "
            f"table of {name}. Fix: add the two marker lines where the table goes"
        )
    return text[: i + len(begin)] + "\n" + block + text[j:]


def outputs(exp: dict, runs: dict, out: Path, page: Path | None, figures: bool) -> tuple[dict[Path, str], list]:
    """{path: text} of every text file the summaries give (the experiment's .md and .json, and the results
    page when ``page`` has the experiment's markers), and the tables; figures are drawn when asked."""
    tables, names, counts = [], {}, {}
    for cond in exp["conditions"]:
        if cond not in runs:
            continue
        tables.append(condition_tables(exp, cond, runs[cond]))
        counts[cond] = sum(len(s) for s in runs[cond].values())
        name = f"{exp['name']}_{cond}.png"
        if figures:
            figure(exp, cond, runs[cond], out / name)
        if figures or (out / name).is_file():
            names[cond] = name
    texts = {
        out / f"{exp['name']}.md": render(exp, tables, names, counts),
        out / f"{exp['name']}.json": json.dumps(tables, indent=1, default=str) + "\n",
    }
    if page is not None and page.is_file() and f"<!-- tables:{exp['name']} begin -->" in page.read_text():
        texts[page] = replace_marked(page.read_text(), exp["name"], headline_table(exp, tables), str(page))
    return texts, tables


def experiment(name: str) -> dict:
    """An experiment by name or path; ``<name>-pilot`` is the pilot of ``<name>`` (its design on the pilot worlds,
    pilot.py), whose committed summaries regenerate their own tables."""
    if name.endswith("-pilot") and not name.endswith((".yaml", ".yml")):
        import pilot as pilots  # benchmarks/evidence/pilot.py

        exp = load_experiment(name.removesuffix("-pilot"))
        return pilots.pilot_experiment(exp, pilots.validate(exp, METRICS))
    return load_experiment(name)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "experiment",
        nargs="?",
        help="an experiment name (lab_stratified, lab_sorl, ...) or its YAML "
        "path; omitted: every experiment with committed summaries",
    )
    p.add_argument("--results", type=Path, default=RESULTS, help="run summaries root (default: the committed ones)")
    p.add_argument(
        "--out", type=Path, default=DOCS, help="folder for <experiment>.md / .json / figures (default docs/results)"
    )
    p.add_argument("--no-figures", action="store_true", help="tables only (no matplotlib)")
    p.add_argument(
        "--page",
        type=Path,
        help="the results page whose marked table of this experiment is rewritten "
        "(default: docs/results.md with the committed summaries, none with --results; skipped when it "
        "has no markers)",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 when a committed file differs from what the summaries give",
    )
    args = p.parse_args(argv)
    if args.experiment is None:  # the whole results page, from the committed summaries, in one command
        if args.results != RESULTS or args.page:
            p.error("--results / --page need an experiment")
        names = sorted(
            d.name
            for d in RESULTS.iterdir()
            if d.is_dir() and (HERE / f"{d.name.removesuffix('-pilot')}.yaml").is_file()
        )
        flags = [f for f, on in (("--no-figures", args.no_figures), ("--check", args.check)) if on]
        return max([main([name, "--out", str(args.out), *flags]) for name in names], default=0)
    exp = experiment(args.experiment)
    runs = load_runs(exp, args.results)
    if not runs:
        print(f"no run summaries for {exp['name']} under {args.results / exp['name']}", flush=True)
        return 1
    unknown = {
        m
        for m in [
            exp.get("metrics", {}).get("primary", "em_after"),
            *exp.get("metrics", {}).get("secondary", []),
            *exp.get("metrics", {}).get("diagnostics", []),
        ]
        if m not in METRICS
    }
    if unknown:
        sys.exit(f"error: {exp['name']}: unknown metrics {sorted(unknown)}. Fix: use some of {', '.join(METRICS)}")
    page = args.page or (RESULTS_PAGE if args.results == RESULTS else None)
    texts, tables = outputs(exp, runs, args.out, page, figures=not (args.no_figures or args.check))
    if args.check:
        stale = [str(path) for path, text in texts.items() if not path.is_file() or path.read_text() != text]
        if stale:
            print(
                f"out of date with the summaries: {', '.join(stale)}. Fix: python benchmarks/evidence/tables.py "
                f"{exp['name']}",
                flush=True,
            )
            return 1
        print(f"{exp['name']}: {len(texts)} files match the summaries", flush=True)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    for path, text in texts.items():
        path.write_text(text)
    for table in tables:
        print(f"{table['condition']}: {verdict(exp, table)}", flush=True)
    print(f"wrote {', '.join(str(p) for p in texts)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
