"""Figure helpers shared by the run report and the arms x seeds aggregate (matplotlib, Agg backend)."""

from __future__ import annotations

import io
import math
from pathlib import Path


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
