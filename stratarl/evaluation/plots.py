"""The report's figures (matplotlib, Agg backend): one panel per metric of a namespace, the "Did it learn?"
curves, and the helpers the arms x seeds aggregate shares."""

from __future__ import annotations

import io
import math
import re
from pathlib import Path

from stratarl.evaluation.headline import SMOOTH_WINDOW
from stratarl.evaluation.rundir import train_rows
from stratarl.evaluation.stats import rolling_band, steps_ci

# Namespaces shown first, in this order; any other namespace follows alphabetically.
NAMESPACE_ORDER = (
    "reward",
    "eval",
    "rollout",
    "stratum",
    "advantage",
    "loss",
    "sorl",
    "offpolicy",
    "optim",
    "perf",
    "time",
)


def panel_grid(keys: list[str]):
    """A figure with one small panel per key (4 columns; unused panels off).

    Returns (pyplot, figure, panels for ``keys`` in order, colour cycle, number of rows).
    """
    import matplotlib  # start-up cost: only when a figure is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after matplotlib.use("Agg")

    cols = min(4, len(keys))
    rows = math.ceil(len(keys) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 2.8 * rows), squeeze=False)
    panels = [axes[i // cols][i % cols] for i in range(rows * cols)]
    for ax, key in zip(panels, keys):
        ax.set_title(key, fontsize=9)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    for ax in panels[len(keys) :]:
        ax.axis("off")
    return plt, fig, panels[: len(keys)], plt.rcParams["axes.prop_cycle"].by_key()["color"], rows


def save_png(plt, fig, out_png: Path) -> bytes:
    """Write ``fig`` to ``out_png`` (90 dpi, tight) and return the PNG bytes."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    data = buf.getvalue()
    out_png.write_bytes(data)
    return data


def numeric_series(rows: list[dict]) -> dict[str, tuple[list[int], list[float]]]:
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


def namespace_of(key: str) -> str:
    return key.split("/", 1)[0] if "/" in key else "other"


def plot_namespace(namespace: str, keys: list[str], runs: dict[str, dict], out_png: Path) -> bytes:
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


def _nan(values: list[float | None]) -> list[float]:
    return [math.nan if v is None else v for v in values]


def _across_steps(
    curves: list[tuple[list[int], list[float]]],
) -> tuple[list[int], list[float], list[float], list[float]]:
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
        steps, means, low_ci, high_ci = _across_steps(curves)
        ax.plot(steps, means, color=color, label=f"mean of {len(curves)} runs")
        ax.fill_between(steps, low_ci, high_ci, color=color, alpha=0.2, label="95% CI over runs")
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
    err = [
        [m - lo if math.isfinite(lo) else 0.0 for m, lo in zip(means, lows)],
        [hi - m if math.isfinite(hi) else 0.0 for m, hi in zip(means, highs)],
    ]
    ax.errorbar(steps, means, yerr=err, fmt="o-", color=color, capsize=3, label=label)
    ax.legend(fontsize=7)


def _figure(titles: list[str]):
    plt, fig, axes, colors, _ = panel_grid(titles)
    fig.set_size_inches(5.5 * len(titles), 3.4)
    for ax in axes:
        ax.set_xlabel("RL step", fontsize=8)
    return plt, fig, axes, colors


STRATUM_KEY = re.compile(r"stratum/(\d+)/reward_mean")


def headline_plots(h: dict, out_dir: Path) -> dict[str, bytes]:
    """The section's figures, {file name: PNG bytes} (also written to ``out_dir``): ``did_it_learn.png``
    (training reward per step, held-out EM per eval), ``did_it_learn_searches.png`` (per training rollout,
    per held-out question) and, when the metrics have ``stratum/<k>/reward_mean``,
    ``did_it_learn_strata.png`` (training reward per stratum k = number of searches)."""
    series = [numeric_series(train_rows(Path(r["run_dir"]))) for r in h["runs"]]
    curves = lambda key: [ser.get(key, ([], [])) for ser in series]  # noqa: E731
    out = {}
    for png, key, metric, color, titles in (
        (
            "did_it_learn.png",
            "reward/mean",
            "em",
            0,
            ["training reward per step (algo.reward)", "held-out EM per eval (greedy)"],
        ),
        (
            "did_it_learn_searches.png",
            "rollout/search_calls_mean",
            "searches",
            2,
            ["searches per rollout (training)", "searches per held-out question"],
        ),
    ):
        plt, fig, (ax_train, ax_eval), colors = _figure(titles)
        _plot_train_curve(ax_train, curves(key), colors[color])
        _plot_eval_curve(ax_eval, h["runs"], metric, colors[color + 1])
        fig.tight_layout()
        out[png] = save_png(plt, fig, out_dir / png)
    strata = sorted({int(m.group(1)) for ser in series for k in ser if (m := STRATUM_KEY.fullmatch(k))})
    if strata:
        plt, fig, (ax,), colors = _figure(
            ["training reward per stratum (k = number of searches)" + (": mean over runs" if len(series) > 1 else "")]
        )
        for j, k in enumerate(strata):
            steps, means, _, _ = _across_steps(curves(f"stratum/{k}/reward_mean"))
            ax.plot(
                steps, means, marker="." if len(steps) < 30 else None, color=colors[j % len(colors)], label=f"k = {k}"
            )
        ax.legend(fontsize=7)
        fig.tight_layout()
        out["did_it_learn_strata.png"] = save_png(plt, fig, out_dir / "did_it_learn_strata.png")
    return out
