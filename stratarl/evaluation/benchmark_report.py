"""A benchmark result as a report page: ``stratarl report --benchmark AFTER.json [--before BEFORE.json]``.

The page opens as the run report does, with "Did it learn?" (the numbers: stratarl.evaluation.benchmark): the F1
gain with its paired 95% CI in one sentence, the table per difficulty (PhantomWiki) or source (the Wikipedia
slice) and per number of searches, then the transcript of the question gained most and of the one lost most,
before and after. Given one result file of several settings, the opening compares searching with closed-book
(same model, same questions: "Does searching help?"). Then every setting of each file (EM and F1 with 95% CIs per
difficulty or source) and the commands that produced them. The page stands alone (no images).
"""

from __future__ import annotations

import html
from collections.abc import Mapping
from pathlib import Path

from stratarl.config_errors import ConfigError
from stratarl.evaluation.benchmark import (
    GAIN_HEADER,
    benchmark_gain,
    benchmark_kind,
    gain_rows,
    in_unit,
    load_summary,
)
from stratarl.evaluation.headline import format_ci, format_number
from stratarl.evaluation.report import PAGE_STYLE, _table, _turns_html


def _side_html(label: str, f1: float, record: dict | None) -> str:
    if record is None:
        return (
            f"<h4>{html.escape(label)}: F1 {format_number(f1, 2)}</h4><p>(no transcript found in the eval run "
            "folder: the --out of its eval command, or the folder beside its JSON)</p>"
        )
    return (
        f"<h4>{html.escape(label)}: F1 {format_number(f1, 2)}, {record.get('num_searches', '?')} searches, answer "
        f"{html.escape(repr(record.get('answer')))}</h4>{_turns_html(record)}"
    )


def _transcript_html(gain: Mapping) -> str:
    parts = []
    for which, title in (("gained", "The question gained most"), ("lost", "The question lost most")):
        shown = gain["transcripts"].get(which)
        if shown is None:
            parts.append(f"<h4>{title}</h4><p>No question's F1 {'rose' if which == 'gained' else 'fell'}.</p>")
            continue
        first = shown["before"] or shown["after"]
        columns = "".join(
            f'<div class="col">{_side_html(side, shown["f1_" + key], record)}</div>'
            for side, key, record in (
                (gain["before"]["label"], "before", shown["before"]),
                (gain["after"]["label"], "after", shown["after"]),
            )
        )
        asked = (
            f"<p>{html.escape(str(first.get('question', '')))} Gold: {html.escape(', '.join(first.get('golds') or []))}.</p>"
            if first
            else ""
        )
        parts.append(
            f'<h4>{title}: <code>{html.escape(shown["id"])}</code></h4>{asked}<div class="pair">{columns}</div>'
        )
    return (
        '<p class="note">The largest F1 rise and the largest F1 fall (ties: the smallest question id). Model text in '
        "grey boxes, retrieved passages in blue.</p>" + "".join(parts)
    )


def opening_html(gain: Mapping, heading: str = "Did it learn?") -> str:
    """The opening section: verdict, the table per group, the transcripts gained and lost."""
    note = (
        "Paired over the same questions (by question id): mean of the per-question differences after − before with "
        "a Student-t 95% CI; the CIs cover question sampling, not training-seed variance. Scores: "
        + ("PhantomWiki's set EM and F1." if gain["benchmark"] == "phantomwiki" else "Search-R1's EM and F1.")
    )
    return f"""<h2 id="did-it-learn">{html.escape(heading)}</h2>
<p class="verdict"><b>{html.escape(gain["verdict"])}</b></p>
<p>before: {html.escape(gain["before"]["label"])} (<code>{html.escape(gain["before"]["file"])}</code>, setting
{html.escape(gain["before"]["setting"])}); after: {html.escape(gain["after"]["label"])}
(<code>{html.escape(gain["after"]["file"])}</code>, setting {html.escape(gain["after"]["setting"])})</p>
{_table(GAIN_HEADER, gain_rows(gain))}
<p class="note">{html.escape(note)}</p>
<h3>Transcripts gained and lost</h3>{_transcript_html(gain)}"""


def settings_html(summary: Mapping, path: str | Path) -> str:
    """Every setting of a baselines / slice result: EM and F1 with 95% CIs per difficulty (or source)."""
    kind = benchmark_kind(summary, path)
    rows = []
    for setting, block in summary["settings"].items():
        if kind == "wikislice":
            groups = [(f"source {s}", m, m.get("count")) for s, m in block["per_source"].items()]
        elif "all" in block:
            groups = [("all", block["all"], block["all"]["n"])]
            per_difficulty = block.get("per_difficulty", {}).items()
            groups += [(f"difficulty {d.removeprefix('difficulty_')}", m, m["n"]) for d, m in per_difficulty]
        else:  # per-question scores only
            groups = []
        for name, m, n in groups:
            rows.append(
                [
                    setting,
                    name,
                    str(n),
                    format_ci(in_unit(m["em"])),
                    format_ci(in_unit(m["f1"])),
                    format_number(m.get("searches_mean"), 2),
                    format_number(m.get("answer_rate"), 2),
                ]
            )
    header = ["setting", "questions", "n", "EM [95% CI]", "F1 [95% CI]", "searches", "answered"]
    return f"<h3>{html.escape(str(summary.get('label', path)))} (<code>{html.escape(str(path))}</code>)</h3>" + _table(
        header, rows
    )


def _commands_html(summary: Mapping) -> str:
    if benchmark_kind(summary) == "wikislice":
        commands = [str(block.get("command", "")) for block in summary["settings"].values()]
    else:
        commands = [" ".join(map(str, c)) for c in summary.get("commands", [])]
    return "".join(f"<pre>{html.escape(c)}</pre>" for c in commands if c)


def benchmark_page(
    after_path: str | Path, before_path: str | Path | None = None, *, setting: str = "search", title: str | None = None
) -> tuple[str, dict | None]:
    """The page (HTML text) and the gain it opens with (None when there is nothing to pair)."""
    after = load_summary(after_path)
    summaries: list[tuple[str | Path, dict]] = [(after_path, after)]
    heading = "Did it learn?"
    gain: dict | None = None
    if benchmark_kind(after, after_path) == "gain":
        if before_path is not None:
            raise ConfigError(f"{after_path} is already a gain. Fix: drop --before, or pass two result files")
        gain, summaries = after, []
    elif before_path is not None:
        before = load_summary(before_path)
        gain = benchmark_gain(before, after, setting=setting, before_path=before_path, after_path=after_path)
        summaries.insert(0, (before_path, before))
    elif setting in after["settings"] and "closed_book" in after["settings"] and setting != "closed_book":
        gain = benchmark_gain(
            after, after, setting=setting, before_path=after_path, after_path=after_path, before_setting="closed_book"
        )
        heading = "Does searching help?"
    opening = (
        opening_html(gain, heading)
        if gain is not None
        else '<h2 id="did-it-learn">Did it learn?</h2><p class="missing">One result file with no closed-book setting '
        "to compare with: pass --before EARLIER.json (the same questions evaluated by the earlier model).</p>"
    )
    results = "".join(settings_html(s, p) + _commands_html(s) for p, s in summaries)
    name = title or f"stratarl benchmark: {Path(after_path).name}"
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(name)}</title>
{PAGE_STYLE}
</head><body><h1>{html.escape(name)}</h1>
{opening}
{'<h2 id="settings">Every setting</h2>' + results if results else ""}</body></html>"""
    return page, gain


def write_benchmark_report(
    after_path: str | Path,
    before_path: str | Path | None = None,
    out: str | Path | None = None,
    *,
    setting: str = "search",
    title: str | None = None,
) -> Path:
    """Write :func:`benchmark_page` to ``out`` (default: the after JSON with ``.html``); return the path."""
    page, _ = benchmark_page(after_path, before_path, setting=setting, title=title)
    path = Path(out) if out is not None else Path(after_path).with_suffix(".html")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page)
    return path
