"""Two evaluations of one external benchmark on the same questions, paired by question id: the gain in F1 and EM
with a paired 95% CI, overall and per group, the questions that went up and down, and one transcript gained and
one lost (docs/benchmarks.md, "Did it learn?" on a benchmark).

It reads the result JSONs of ``benchmarks/external/phantomwiki_baselines.py`` (``settings.<s>.per_question``: a
list of records with ``example_id``, ``em``, ``f1``, ``searches``, ``question_type`` = ``difficulty_<d>``) and of
``benchmarks/external/wikislice_eval.py`` (``settings.<s>.per_question``: ``{example_id: [em, f1]}``, the source
the id's prefix). The gain is :func:`~stratarl.evaluation.stats.paired_gain`, the paired Student-t interval the
trainer's "Did it learn?" uses: d_i = after_i − before_i over the questions, d̄ ± t_{0.975, n−1} · s_d / √n.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from stratarl.config_errors import ConfigError
from stratarl.evaluation.headline import format_ci
from stratarl.evaluation.stats import mean_ci, paired_gain

GAIN_KIND = "benchmark_gain"  # the "kind" of a gain JSON
METRICS = ("f1", "em")  # F1 first: PhantomWiki's headline metric (the paper reports F1) and the RL reward
OBSERVATION_CHARS = 800  # an observation kept in a gain JSON's transcripts (the report page shows as much)


def load_summary(path: str | Path) -> dict:
    """A benchmark result JSON, or a one-line error naming the file."""
    path = Path(path)
    try:
        summary = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file. Fix: pass a JSON written by benchmarks/external/*.py") from None
    except json.JSONDecodeError as error:
        raise ConfigError(f"{path}: not JSON ({error}). Fix: pass a JSON written by benchmarks/external/*.py") from None
    benchmark_kind(summary, path)
    return summary


def benchmark_kind(summary: Mapping, path: str | Path = "<summary>") -> str:
    """``"gain"`` (this module's output), ``"wikislice"`` (wikislice_eval.py) or ``"phantomwiki"``
    (phantomwiki_baselines.py); anything else is a one-line error."""
    if not isinstance(summary, Mapping):
        raise ConfigError(f"{path}: not a benchmark result (a JSON object is expected)")
    if summary.get("kind") == GAIN_KIND:
        return "gain"
    if isinstance(summary.get("settings"), Mapping) and "slice" in summary:
        return "wikislice"
    if isinstance(summary.get("settings"), Mapping) and "universes" in summary:
        return "phantomwiki"
    raise ConfigError(
        f"{path}: not a benchmark result (no `settings` with `universes` or `slice`). Fix: pass a JSON written by "
        "benchmarks/external/phantomwiki_baselines.py, wikislice_eval.py or phantomwiki_gain.py"
    )


def question_records(summary: Mapping, setting: str, path: str | Path = "<summary>") -> dict[str, dict]:
    """One setting's questions: ``{example_id: {"em", "f1", "searches" (None when not recorded), "group"}}``; the
    group is the difficulty (PhantomWiki, ``"1"``, ``"2"``, ...) or the source (the slice: ``fanoutqa``, ...)."""
    kind = benchmark_kind(summary, path)
    settings = summary["settings"]
    if kind == "gain" or setting not in settings:
        have = sorted(settings) if kind != "gain" else []
        raise ConfigError(
            f"{path}: no setting {setting!r} (it has {have}). Fix: pass --setting one of them, or evaluate that "
            "setting (phantomwiki_baselines.py --settings)"
        )
    rows = settings[setting].get("per_question")
    if not rows:
        raise ConfigError(f"{path}: setting {setting!r} has no per_question scores. Fix: re-run its evaluation")
    if kind == "wikislice":
        pairs = [
            (str(i), {"em": v[0], "f1": v[1], "searches": None, "group": str(i).split("-", 1)[0]})
            for i, v in rows.items()
        ]
    else:
        pairs = [
            (
                str(r["example_id"]),
                {
                    "em": float(r["em"]),
                    "f1": float(r["f1"]),
                    "searches": None if r.get("searches") is None else float(r["searches"]),
                    "group": str(r.get("question_type", "all")).removeprefix("difficulty_"),
                },
            )
            for r in rows
        ]
    records = dict(pairs)
    if len(records) != len(pairs):
        raise ConfigError(f"{path}: setting {setting!r} scores a question id twice. Fix: re-run its evaluation")
    return records


def same_questions(before: Mapping[str, Any], after: Mapping[str, Any], before_name: str, after_name: str) -> list[str]:
    """The common question ids, sorted; a one-line error when the two evaluations do not cover the same questions."""
    only_before, only_after = sorted(set(before) - set(after)), sorted(set(after) - set(before))
    if only_before or only_after:
        raise ConfigError(
            f"{before_name} and {after_name} do not cover the same questions: {len(only_before)} only in the first "
            f"(e.g. {only_before[:2]}), {len(only_after)} only in the second (e.g. {only_after[:2]}). Fix: evaluate "
            "both on the same universes (or slice) and setting"
        )
    return sorted(before)


def paired_block(before: Mapping[str, dict], after: Mapping[str, dict], ids: Sequence[str]) -> dict:
    """Over ``ids``: per metric the before and after means (95% t-CI over the questions), the paired gain after −
    before (:func:`paired_gain`, without its id lists) and how many questions went up and down."""
    block: dict[str, Any] = {"n": len(ids)}
    for metric in METRICS:
        after_scores = {i: float(after[i][metric]) for i in ids}
        before_scores = {i: float(before[i][metric]) for i in ids}
        gain = paired_gain(after_scores, before_scores)
        block[metric] = {
            "before": in_unit(mean_ci(list(before_scores.values())).to_dict()),
            "after": in_unit(mean_ci(list(after_scores.values())).to_dict()),
            "gain": {k: v for k, v in gain.items() if k not in ("ids", "differences")},
            "up": sum(d > 0 for d in gain["differences"]),
            "down": sum(d < 0 for d in gain["differences"]),
        }
    return block


def in_unit(interval: dict) -> dict:
    """A score's t-interval cut to [0, 1] (EM and F1 cannot leave it; near 0 on few questions mean ± t·s/√n
    does), as the run report cuts its evals."""
    if interval["low"] is None:
        return interval
    return {**interval, "low": max(0.0, interval["low"]), "high": min(1.0, interval["high"])}


def _group_order(key: str) -> tuple[int, float | str]:
    try:
        return (0, float(key))
    except ValueError:
        return (1, key)


def grouped(before: Mapping[str, dict], after: Mapping[str, dict], ids: Sequence[str], key) -> dict[str, dict]:
    """:func:`paired_block` per group of questions (``key(question_id) -> group``), groups in numeric order."""
    groups: dict[str, list[str]] = {}
    for i in ids:
        groups.setdefault(key(i), []).append(i)
    return {g: paired_block(before, after, groups[g]) for g in sorted(groups, key=_group_order)}


def changed_questions(before: Mapping[str, dict], after: Mapping[str, dict], ids: Sequence[str]) -> dict:
    """``{"gained": id | None, "lost": id | None}``: the question whose F1 rose most (ties: the smallest id) and
    the one whose F1 fell most; None when no question moved that way."""
    delta = {i: float(after[i]["f1"]) - float(before[i]["f1"]) for i in ids}
    up = [i for i in ids if delta[i] > 0]
    down = [i for i in ids if delta[i] < 0]
    return {
        "gained": min(up, key=lambda i: (-delta[i], i)) if up else None,
        "lost": min(down, key=lambda i: (delta[i], i)) if down else None,
    }


def compare(
    before: Mapping[str, dict], after: Mapping[str, dict], *, before_name: str = "before", after_name: str = "after"
) -> dict:
    """The paired comparison of two evaluations of the same questions (:func:`question_records` of each).

    ``{"n", "all", "per_group" (difficulty or source), "per_searches" (by the later model's number of searches;
    empty when not recorded), "changed" (:func:`changed_questions`)}``; every block is :func:`paired_block`.
    """
    ids = same_questions(before, after, before_name, after_name)
    searched = all(after[i]["searches"] is not None for i in ids)
    return {
        "n": len(ids),
        "all": paired_block(before, after, ids),
        "per_group": grouped(before, after, ids, lambda i: before[i]["group"]),
        "per_searches": grouped(before, after, ids, lambda i: str(int(after[i]["searches"]))) if searched else {},
        "changed": changed_questions(before, after, ids),
    }


def transcript_files(summary: Mapping, setting: str, path: str | Path) -> list[Path]:
    """Where one setting's eval transcripts are, from the eval commands the summary records (``--out DIR`` and
    ``--tag T``: ``DIR/eval/T_transcripts.jsonl``, T ``eval`` by default); when that file is not there (the run
    moved), the same folder under the summary's own run folder (``<json without .json>/u<seed>/<setting>``)."""
    kind = benchmark_kind(summary, path)
    if kind == "wikislice":
        commands = [shlex.split(summary["settings"][setting].get("command", ""))]
    else:
        commands = [list(c) for c in summary.get("commands", [])]
    files = []
    for command in commands:
        out = _flag(command, "--out")
        tag = _flag(command, "--tag") or "eval"
        if out is None or (kind == "phantomwiki" and Path(out).name != setting):
            continue
        name = f"{tag}_transcripts.jsonl"
        primary = Path(out) / "eval" / name
        moved = Path(path).with_suffix("") / Path(out).parent.name / Path(out).name / "eval" / name
        files.append(primary if primary.is_file() or not moved.is_file() else moved)
    return files


def _flag(command: Sequence[str], flag: str) -> str | None:
    return command[command.index(flag) + 1] if flag in command[:-1] else None


def load_transcripts(files: Sequence[Path], ids: set[str]) -> dict[str, dict]:
    """The transcripts of the questions ``ids`` in ``files`` (JSONL; missing files and torn lines skipped), each
    cut to what a report shows (question, golds, answer, reward, searches, turns with observations cut)."""
    found: dict[str, dict] = {}
    for file in files:
        if not file.is_file():
            continue
        for line in file.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if str(record.get("example_id")) in ids:
                found[str(record["example_id"])] = _short(record)
    return found


def _short(record: dict) -> dict:
    keep = ("example_id", "question", "golds", "answer", "reward", "num_searches", "end_reason", "calls")
    turns = [
        {"text": t.get("text", ""), "observation": (t.get("observation") or "")[:OBSERVATION_CHARS]}
        for t in record.get("turns", [])
    ]
    return {**{k: record.get(k) for k in keep}, "turns": turns}


def verdict(gain: Mapping) -> str:
    """One sentence: the change in F1 with its paired 95% CI, whether that CI excludes 0, and the EM change."""
    f1, em, n = gain["all"]["f1"], gain["all"]["em"], gain["all"]["n"]
    before, after = gain["before"]["label"], gain["after"]["label"]
    who = f"{after} ({gain['setting']})" if before == after else f"{after} vs {before} ({gain['setting']})"
    if f1["up"] == f1["down"] == 0:
        return f"{who}: F1 did not change on any of the {n} questions (EM gain {format_ci(em['gain'], sign=True)})"
    ci = f1["gain"]
    if ci.get("excludes_zero") is None:
        note = "too few questions for a CI"
    elif ci["excludes_zero"]:
        note = "the 95% CI excludes 0"
    else:
        note = "inside the noise (the 95% CI includes 0)"
    return (
        f"{who}: F1 {format_ci(ci, sign=True)} on {n} questions ({f1['up']} up, {f1['down']} down; paired 95% CI "
        f"over questions): {note}; EM {format_ci(em['gain'], sign=True)}"
    )


def _side(summary: Mapping, path: str | Path, setting: str) -> dict:
    return {
        "label": summary.get("label", str(path)),
        "file": str(path),
        "target": summary.get("target"),
        "setting": setting,
    }


def benchmark_gain(
    before: Mapping,
    after: Mapping,
    *,
    setting: str,
    before_path: str | Path,
    after_path: str | Path,
    before_setting: str | None = None,
) -> dict:
    """The gain JSON: after − before on one setting (``before_setting``: the earlier side's, default the same),
    paired by question id, with the two transcripts (gained, lost) read from the eval run folders."""
    first = before_setting or setting
    old = question_records(before, first, before_path)
    new = question_records(after, setting, after_path)
    result = compare(old, new, before_name=str(before_path), after_name=str(after_path))
    wanted = {i for i in result["changed"].values() if i is not None}
    shown_before = load_transcripts(transcript_files(before, first, before_path), wanted)
    shown_after = load_transcripts(transcript_files(after, setting, after_path), wanted)
    transcripts = {
        which: None
        if i is None
        else {
            "id": i,
            "f1_before": old[i]["f1"],
            "f1_after": new[i]["f1"],
            "before": shown_before.get(i),
            "after": shown_after.get(i),
        }
        for which, i in result.pop("changed").items()
    }
    benchmark = benchmark_kind(after, after_path)
    gain = {
        "kind": GAIN_KIND,
        "benchmark": benchmark,
        "group_by": "source" if benchmark == "wikislice" else "difficulty",
        "setting": setting if first == setting else f"{first} -> {setting}",
        "before": _side(before, before_path, first),
        "after": _side(after, after_path, setting),
        **result,
        "transcripts": transcripts,
    }
    return {**gain, "verdict": verdict(gain)}


def gain_rows(gain: Mapping) -> list[list[str]]:
    """The table of a gain: overall, per difficulty (or source), per number of searches of the later model. Cells:
    group, n, F1 before, F1 after, F1 gain [CI], F1 up / down, EM before, EM after, EM gain [CI]."""
    label = "source" if gain.get("group_by") == "source" else "difficulty"
    blocks = [("all", gain["all"])]
    blocks += [(f"{label} {g}", b) for g, b in gain["per_group"].items()]
    blocks += [(f"{s} search{'' if s == '1' else 'es'} (after)", b) for s, b in gain["per_searches"].items()]
    rows = []
    for name, b in blocks:
        f1, em = b["f1"], b["em"]
        rows.append(
            [
                name,
                str(b["n"]),
                format_ci(f1["before"]),
                format_ci(f1["after"]),
                format_ci(f1["gain"], sign=True),
                f"{f1['up']} / {f1['down']}",
                format_ci(em["before"]),
                format_ci(em["after"]),
                format_ci(em["gain"], sign=True),
            ]
        )
    return rows


GAIN_HEADER = [
    "questions",
    "n",
    "F1 before",
    "F1 after",
    "F1 gain [paired 95% CI]",
    "F1 up / down",
    "EM before",
    "EM after",
    "EM gain [paired 95% CI]",
]


def gain_markdown(gain: Mapping) -> str:
    """The gain as markdown: the verdict, then :func:`gain_rows` as a table."""
    lines = [
        f"**{gain['verdict']}**",
        "",
        (
            f"before: {gain['before']['label']} (`{gain['before']['file']}`); after: {gain['after']['label']} "
            f"(`{gain['after']['file']}`)"
        ),
        "",
        "| " + " | ".join(GAIN_HEADER) + " |",
        "|---|---:|---|---|---|---:|---|---|---|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in gain_rows(gain)]
    return "\n".join(lines) + "\n"
