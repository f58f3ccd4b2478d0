"""`stratarl report RUN_DIR [RUN_DIR...]`: one self-contained HTML page of curves.

Each metric namespace (reward, rollout, loss, sorl, optim, time, ...) becomes one
PNG with a small plot per metric; every run is one coloured line in every plot,
so algorithms can be compared at a glance. PNGs are written next to the page and
embedded in it as base64, so the HTML file alone can be mailed or archived.
Eval results (``eval/*.json``) become a table per run.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
from pathlib import Path

from stratarl.trainer.metrics import read_metrics

# Namespaces shown first, in this order; any other namespace follows alphabetically.
NAMESPACE_ORDER = ("reward", "eval", "rollout", "stratum", "advantage", "loss", "sorl", "optim", "perf", "time")
# Skip per-stratum count series in the overview plots? No: they show how search behaviour shifts.


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


def panel_grid(keys: list[str]):
    """A figure with one small panel per key (4 columns; unused panels off).

    Returns (pyplot, figure, panels for ``keys`` in order, colour cycle, number of rows).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(4, len(keys))
    rows = math.ceil(len(keys) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 2.8 * rows), squeeze=False)
    panels = [axes[i // cols][i % cols] for i in range(rows * cols)]
    for ax, key in zip(panels, keys):
        ax.set_title(key, fontsize=9)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    for ax in panels[len(keys):]:
        ax.axis("off")
    return plt, fig, panels[:len(keys)], plt.rcParams["axes.prop_cycle"].by_key()["color"], rows


def save_png(plt, fig, out_png: Path) -> bytes:
    """Write ``fig`` to ``out_png`` (90 dpi, tight) and return the PNG bytes."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    data = buf.getvalue()
    out_png.write_bytes(data)
    return data


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


def build_report(run_dirs: list[str | Path], output: str | Path | None = None, *, title: str = "stratarl report") -> Path:
    """Write ``report.html`` (+ one PNG per metric namespace) comparing ``run_dirs``; return the HTML path.

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
    nav = " · ".join(f'<a href="#{html.escape(ns)}">{html.escape(ns)}</a>' for ns in order)
    run_list = "".join(f"<li><code>{html.escape(str(d))}</code>: {len(read_metrics(d))} steps</li>" for d in dirs)
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1400px}} img{{max-width:100%}}
table{{border-collapse:collapse;margin:.5em 0}} td,th{{border:1px solid #ccc;padding:2px 8px;text-align:right}}</style>
</head><body><h1>{html.escape(title)}</h1><ul>{run_list}</ul><p>{nav}</p>
<h2>eval</h2>{evals}{''.join(sections)}</body></html>"""
    out_html.write_text(page)
    return out_html
