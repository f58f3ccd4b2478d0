"""The README's evidence figure: each headline claim's paired difference with its 95% CI over worlds, one row per
claim, regenerated from the committed run summaries alone (as tables.py's tables are).

    python benchmarks/evidence/headline.py            # -> docs/evidence.png, and the rows on stdout
    python benchmarks/evidence/headline.py --no-figure

Each row is "arm a − arm b" on one metric of one experiment's condition, paired over the worlds both arms ran
(tables.py's ``_paired``: mean, t-interval, whether it excludes 0). A row whose arms have no summaries yet is
skipped. Standard library, PyYAML and matplotlib only.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import tables  # noqa: E402  (benchmarks/evidence/tables.py)

FIGURE = HERE.parents[1] / "docs" / "evidence.png"

# (label, experiment, condition, "a - b", metric): the README's table, in its order.
ROWS = [
    ("B-2 stale weights: SO-GRPO − GRPO", "lab_offpolicy_lag", "lag32", "so_grpo_sf - grpo", "em_after"),
    ("B-2: turn ratio alone − GRPO", "lab_offpolicy_lag", "lag32", "turn_ratio - grpo", "em_after"),
    ("B-2: normaliser alone − GRPO", "lab_offpolicy_lag", "lag32", "normaliser_sf - grpo", "em_after"),
    ("B-2: PPO − GRPO", "lab_offpolicy_lag", "lag32", "ppo - grpo", "em_after"),
    ("B-2: Dr. GRPO − GRPO", "lab_offpolicy_lag", "lag32", "drgrpo - grpo", "em_after"),
    ("B-2: REINFORCE (A = R) − GRPO", "lab_offpolicy_lag", "lag32", "reinforce - grpo", "em_after"),
    ("B-2: GRPO with A ≥ 0 − GRPO", "lab_offpolicy_lag", "lag32", "grpo_pos - grpo", "em_after"),
    ("B-2: PPO, learning critic − PPO", "lab_offpolicy_lag", "lag32", "ppo_critic - ppo", "em_after"),
    ("B-2, 3 warm starts: SO-GRPO − GRPO", "lab_offpolicy_lag_warmstarts", "lag32", "so_grpo_sf - grpo", "em_after"),
    (
        "B-2, 3 warm starts: turn ratio alone − GRPO",
        "lab_offpolicy_lag_warmstarts",
        "lag32",
        "turn_ratio - grpo",
        "em_after",
    ),
    ("B-2, 3 warm starts: PPO − GRPO", "lab_offpolicy_lag_warmstarts", "lag32", "ppo - grpo", "em_after"),
    ("B-1 batch reuse: SO-GRPO − GRPO", "lab_sorl_clip", "reuse16", "so_grpo_sf - grpo", "em_after"),
    ("A shortcut: α 0.6 − GRPO", "lab_shortcut", "g16", "strat_a0.6 - grpo", "em_after"),
    ("A shortcut: GiGPO − GRPO", "lab_shortcut", "g16", "gigpo - grpo", "em_after"),
    ("A sign test: α 0.6 − GRPO", "lab_search_pays", "g16", "strat_a0.6 - grpo", "em_after"),
]


def rows(results: Path = tables.RESULTS) -> list[dict]:
    """Every row of ``ROWS`` whose two arms have summaries: label, experiment, metric, n and the paired difference."""
    out, loaded = [], {}
    for label, name, condition, contrast, metric in ROWS:
        if name not in loaded:
            exp = tables.experiment(name)
            loaded[name] = (exp, tables.load_runs(exp, results))
        exp, runs = loaded[name]
        arms = runs.get(condition, {})
        a, b = contrast.split(" - ")
        if a not in arms or b not in arms:
            continue
        value = tables.METRICS[metric][1]
        d = tables._paired(
            {s: value(r) for s, r in arms[a].items()},
            {s: value(r) for s, r in arms[b].items()},
        )
        out.append({"label": label, "experiment": name, "metric": metric, **d})
    return out


def figure(found: list[dict], path: Path = FIGURE) -> None:
    """A forest plot of ``found``: one row per claim, the paired mean and its 95% CI; filled where the CI excludes 0."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 0.34 * len(found) + 1.1))
    for y, row in enumerate(reversed(found)):
        low, high = row["low"], row["high"]
        colour = "C0" if row["label"].startswith("B") else "C1"
        ax.plot([low, high], [y, y], color=colour, lw=2)
        filled = bool(row["excludes_zero"])
        ax.plot(row["mean"], y, "o", color=colour, mfc=colour if filled else "white", ms=6)
        ax.text(
            1.02,
            y,
            f"{row['mean']:+.2f}  (n={row['n']})",
            va="center",
            fontsize=7.5,
            transform=ax.get_yaxis_transform(),
        )
    ax.set_yticks(range(len(found)), [row["label"] for row in reversed(found)], fontsize=8)
    ax.axvline(0, color="grey", lw=0.8)
    ax.set_xlabel("paired difference in held-out EM, 95% CI over worlds (filled: CI excludes 0)", fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    from PIL import Image  # matplotlib's own dependency

    with Image.open(path) as image:  # a small palette PNG to commit
        quantized = image.convert("RGB").quantize(32)
    quantized.save(path, optimize=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=FIGURE, help="the figure's path (default docs/evidence.png)")
    p.add_argument("--no-figure", action="store_true", help="print the rows only")
    args = p.parse_args(argv)
    found = rows()
    for row in found:
        print(f"{row['label']}: {tables._diff(row)} ({row['experiment']}, {row['metric']}, n={row['n']})")
    if not args.no_figure:
        figure(found, args.out)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
