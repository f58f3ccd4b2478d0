"""A model on the real-Wikipedia slice, greedy, with and without search: EM and F1 with 95% CIs per source.

    stratarl data wikislice --out runs/wikislice
    python benchmarks/external/wikislice_eval.py --slice runs/wikislice --out docs/results/wikislice_smollm2.json
    python benchmarks/external/wikislice_eval.py --slice runs/wikislice --target RUN_DIR --label "after RL" \\
        --out runs/wikislice/after_rl.json        # a trained run: its latest checkpoint
    python benchmarks/external/wikislice_eval.py --slice runs/wikislice --set model.init_from=FOLDER/model \\
        --label "warm start" --out runs/wikislice/warm_start.json   # a saved model folder

Two settings, each one `stratarl eval` subprocess (its command is printed and stored in the JSON; its eval JSON
and transcripts go to ``<slice>/evals/<out stem>/eval/``):

- ``search``: Search-R1's prompt (test.parquet), BM25 over the slice's 10,033 lead sections, the target's own
  rollout budgets (configs/smollm2.yaml: 2 search turns + 1 answer turn, 40 tokens a turn, top-2 passages);
- ``closed_book``: Search-R1's no-search prompt (test_closed_book.parquet) and ``rollout.max_turns=0``: one turn,
  and a search there ends the rollout unanswered.

The target is ``stratarl eval``'s TARGET (a YAML config: its model untrained; a run directory: its latest
checkpoint). The overrides point its data at the slice and switch off what an eval does not use (the warm
start's settings). The result JSON holds, per setting and source, EM and F1 (mean, 95% Student-t CI over the
questions, cut to [0, 1]), searches, ``evidence_shown`` (a search showed the evidence page), answer rate,
``gold_in_response`` (a diagnostic: a gold answer anywhere in the policy's text, tags or not), wall time and every question's EM / F1 (for paired comparisons of two models),
and the slice's counts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from stratarl.data.search_r1 import load_examples
from stratarl.evaluation.greedy import source_intervals
from stratarl.evaluation.stats import paired_gain
from stratarl.publish import write_atomic
from stratarl.rewards.qa import sub_exact_match

SETTINGS = {
    "search": ("test.parquet", []),
    "closed_book": ("test_closed_book.parquet", ["rollout.max_turns=0"]),
}


def eval_command(target: str, slice_dir: Path, setting: str, threads: int, more: list[str]) -> list[str]:
    """The `stratarl eval` command line of one setting."""
    data, extra = SETTINGS[setting]
    overrides = [
        "data.source=files",
        f"data.train_files=[{slice_dir / 'test.parquet'}]",  # required by data.source=files; eval trains nothing
        f"data.corpus={slice_dir / 'corpus.jsonl'}",
        "data.max_eval_examples=null",
        "sft.enabled=false",
        "sft.source=task",
        "sft.probe_every=0",
        f"trainer.num_threads={threads}",
        "logging.progress=false",
        "eval.num_transcripts=1000",
        *extra,
        *more,
    ]
    return [sys.executable, "-m", "stratarl.cli", "eval", target, *overrides, "--data", str(slice_dir / data)]


def run_setting(target: str, slice_dir: Path, setting: str, work: Path, threads: int, more: list[str]) -> dict:
    command = [*eval_command(target, slice_dir, setting, threads, more), "--out", str(work), "--tag", setting]
    print("$ " + " ".join(command), flush=True)
    start = time.perf_counter()
    done = subprocess.run(command, check=False, text=True, capture_output=True, env=os.environ.copy())
    wall = time.perf_counter() - start
    print(done.stdout, end="", flush=True)
    if done.returncode != 0:
        sys.exit(f"error: {setting}: stratarl eval failed ({done.stderr.strip().splitlines()[-1:]})")
    result = json.loads((work / "eval" / f"{setting}.json").read_text())
    intervals = source_intervals(result)
    lenient = gold_in_response(work / "eval" / f"{setting}_transcripts.jsonl")
    titles = {e.id: e.metadata["evidence_title"] for e in load_examples(slice_dir / "test.parquet")}
    shown = evidence_shown(work / "eval" / f"{setting}_transcripts.jsonl", titles)
    return {
        "command": " ".join(command[2:]).replace("stratarl.cli", "stratarl", 1),
        "wall_s": round(wall, 1),
        "eval_s": round(result["seconds"], 1),
        "model": result.get("model"),
        "per_source": {
            source: {
                **intervals[source],
                **{k: m[k] for k in ("searches_mean", "answer_rate", "count")},
                "gold_in_response": _share(lenient, source),
                "evidence_shown": _share(shown, source),
            }
            for source, m in result["per_source"].items()
        },
        "per_question": {r["example_id"]: [r["em"], r["f1"]] for r in result["per_question"]},
    }


def evidence_shown(transcripts: Path, evidence: dict[str, str]) -> dict[str, list[float]]:
    """Per data_source, for each question whether a search showed the policy its evidence page (``evidence``:
    example id -> title; a passage's title is the first line of its contents)."""
    out: dict[str, list[float]] = {}
    for line in transcripts.read_text().splitlines():
        record = json.loads(line)
        titles = {p["contents"].split("\n", 1)[0].strip('"') for s in record["searches"] for p in s["passages"]}
        out.setdefault(record["example_id"].split("-", 1)[0], []).append(
            float(evidence[record["example_id"]] in titles)
        )
    return out


def gold_in_response(transcripts: Path) -> dict[str, list[float]]:
    """A diagnostic beside EM, not a score: per data_source, for each question whether a normalised gold answer
    occurs anywhere in the policy's own text (every turn, tags or not; SubEM of the whole response), so a model
    that answers in prose without ``<answer>`` tags is seen to know (or not) the answer."""
    out: dict[str, list[float]] = {}
    for line in transcripts.read_text().splitlines():
        record = json.loads(line)
        text = " ".join(turn["text"] for turn in record["turns"])
        source = record["example_id"].split("-", 1)[0]  # the slice's ids: fanoutqa-..., freshqa-...
        out.setdefault(source, []).append(sub_exact_match(text, record["golds"]))
    return out


def _share(per_source: dict[str, list[float]], source: str) -> float | None:
    values = [v for values in per_source.values() for v in values] if source == "all" else per_source.get(source)
    return sum(values) / len(values) if values else None


def _cell(interval: dict) -> str:
    if interval["low"] is None:
        return f"{interval['mean']:.3f}"
    return f"{interval['mean']:.3f} [{interval['low']:.3f}, {interval['high']:.3f}]"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def table(summary: dict) -> str:
    """The markdown rows of a summary: one per setting and source."""
    header = "| model | setting | source | n | EM [95% CI] | F1 [95% CI] | searches | evidence shown | answered "
    lines = [header + "| gold in text | wall |", "|---|---|---|---:|---|---|---:|---:|---:|---:|---:|"]
    for setting, block in summary["settings"].items():
        for source, m in block["per_source"].items():
            lines.append(
                f"| {summary['label']} | {setting} | {source} | {m['count']} | {_cell(m['em'])} | {_cell(m['f1'])} "
                f"| {m['searches_mean']:.2f} | {_rate(m.get('evidence_shown'))} | {m['answer_rate']:.2f} "
                f"| {_rate(m.get('gold_in_response'))} "
                f"| {block['wall_s']:.0f} s |"
            )
    return "\n".join(lines)


def search_gain(summary: dict) -> str:
    """Markdown rows: with search minus closed-book, per source, EM and F1 paired over the same questions (mean,
    95% t-interval of the per-question differences; ``stats.paired_gain``). Empty without both settings."""
    settings = summary["settings"]
    if not {"search", "closed_book"} <= set(settings):
        return ""
    lines = ["| model | source | n | EM: search - closed-book [95% CI] | F1: search - closed-book [95% CI] |"]
    lines.append("|---|---|---:|---|---|")
    for source in settings["search"]["per_source"]:
        cells = []
        for position in (0, 1):  # per_question holds [em, f1]
            after, before = (
                {
                    i: v[position]
                    for i, v in settings[s]["per_question"].items()
                    if source in ("all", i.split("-", 1)[0])
                }
                for s in ("search", "closed_book")
            )
            gain = paired_gain(after, before)
            interval = "" if gain["low"] is None else f" [{gain['low']:+.3f}, {gain['high']:+.3f}]"  # n = 1: none
            cells.append(f"{gain['mean']:+.3f}{interval}")
        lines.append(f"| {summary['label']} | {source} | {len(gain['ids'])} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slice", type=Path, help="folder written by `stratarl data wikislice`")
    parser.add_argument("--show", type=Path, metavar="JSON", help="print the tables of a saved summary; run nothing")
    parser.add_argument("--target", default="configs/smollm2.yaml", help="stratarl eval's TARGET (config or run)")
    parser.add_argument(
        "--label", default="SmolLM2-135M-Instruct (shipped, no RL)", help="the model's name in the table"
    )
    parser.add_argument("--out", type=Path, help="summary JSON (the evals go to <slice>/evals/<out stem>/)")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (default 1)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="one more override for both evals, e.g. model.init_from=WARM_START/model (repeatable)",
    )
    parser.add_argument("--settings", default="search,closed_book", help="comma-separated: search, closed_book")
    args = parser.parse_args()
    if args.show is not None:
        summary = json.loads(args.show.read_text())
        print(table(summary) + "\n\n" + search_gain(summary))
        return
    if args.slice is None or args.out is None:
        sys.exit("error: --slice and --out are needed (or --show JSON to print a saved summary)")
    settings = args.settings.split(",")
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        sys.exit(f"error: --settings {args.settings}: unknown {unknown}; use {', '.join(SETTINGS)}")
    if not (args.slice / "stats.json").is_file():
        sys.exit(f"error: --slice {args.slice}: no stats.json. Fix: stratarl data wikislice --out {args.slice}")
    work = args.slice / "evals" / args.out.stem
    stats = json.loads((args.slice / "stats.json").read_text())
    summary = {
        "label": args.label,
        "target": args.target,
        "threads": args.threads,
        "cpu_count": os.cpu_count(),
        "slice": {k: stats[k] for k in ("corpus", "fanoutqa", "freshqa", "test_questions", "packages")},
        "overrides": args.set,
        "settings": {s: run_setting(args.target, args.slice, s, work, args.threads, args.set) for s in settings},
    }
    write_atomic(args.out, json.dumps(summary, indent=1) + "\n")
    print(table(summary) + "\n\n" + search_gain(summary))
    print(f"summary: {args.out}")


if __name__ == "__main__":
    main()
