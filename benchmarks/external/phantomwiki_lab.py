"""The lab on PhantomWiki: held-out F1 before / after GRPO, paired 95% CIs, per difficulty and per number of searches.

    python benchmarks/external/phantomwiki_lab.py --test runs/pwlab/rl/test.parquet \\
        --runs runs/pwlab/grpo_s0 runs/pwlab/grpo_s1 --out docs/results/phantomwiki_lab.json

Reads each run's greedy evaluations (``RUN/eval/before.json``, ``RUN/eval/after.json``: `stratarl train` with
``eval.before_after``) and the held-out questions' metadata (``difficulty``; ``searches_needed``, the number of
searches of the question's solution, None for counting questions). Per run, and pooled over the runs (each
question's gain averaged over the training seeds, then a paired Student-t CI over the questions:
stratarl.evaluation.stats.paired_gain), the gain in PhantomWiki's set F1 and EM, overall, per difficulty and per
number of searches needed (1, 2, 3, 4+; "none": no plan, the counting questions); also the searches the policy made before and after. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path

from stratarl.data.search_r1 import load_examples
from stratarl.evaluation.stats import mean_ci, paired_gain
from stratarl.publish import write_atomic


def _records(run: Path, tag: str) -> dict[str, dict]:
    data = json.loads((run / "eval" / f"{tag}.json").read_text())
    return {r["example_id"]: r for r in data["per_question"]}


def _gain(after: dict[str, float], before: dict[str, float]) -> dict:
    gain = paired_gain(after, before)
    return {
        "n": gain["n"],
        "before": mean_ci([before[i] for i in gain["ids"]]).mean,
        "after": mean_ci([after[i] for i in gain["ids"]]).mean,
        **{k: gain[k] for k in ("mean", "half_width", "low", "high", "excludes_zero")},
    }


def _groups(ids: Sequence[str], key: Callable[[str], str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = defaultdict(list)
    for i in ids:
        out[key(i)].append(i)
    return dict(sorted(out.items()))


def searches_bucket(needed: int | None) -> str:
    """The searches a question's solution needs, as a table row: 1, 2, 3, 4+, or none (no plan: counting
    questions)."""
    if not needed:
        return "none"
    return str(needed) if needed < 4 else "4+"


def table(before: dict[str, dict], after: dict[str, dict], meta: dict[str, dict]) -> dict:
    """F1 / EM gains over all questions, per difficulty and per searches needed; searches made before / after."""
    ids = sorted(set(before) & set(after))

    def block(subset: list[str]) -> dict:
        return {
            metric: _gain({i: after[i][metric] for i in subset}, {i: before[i][metric] for i in subset})
            for metric in ("f1", "em")
        } | {
            "searches_before": mean_ci([before[i]["searches"] for i in subset]).mean,
            "searches_after": mean_ci([after[i]["searches"] for i in subset]).mean,
        }

    needed = _groups(ids, lambda i: searches_bucket(meta[i].get("searches_needed")))
    return {
        "all": block(ids),
        "per_difficulty": {d: block(s) for d, s in _groups(ids, lambda i: str(meta[i]["difficulty"])).items()},
        "per_searches_needed": {k: block(s) for k, s in needed.items()},
    }


def pooled(runs: Sequence[Path]) -> tuple[dict[str, dict], dict[str, dict]]:
    """Each question's before / after scores averaged over the runs (the questions every run scored)."""
    befores, afters = [_records(r, "before") for r in runs], [_records(r, "after") for r in runs]
    ids = set.intersection(*(set(b) & set(a) for b, a in zip(befores, afters)))

    def mean_of(records: list[dict[str, dict]]) -> dict[str, dict]:
        keys = ("f1", "em", "searches")
        return {i: {k: sum(r[i][k] for r in records) / len(records) for k in keys} for i in ids}

    return mean_of(befores), mean_of(afters)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--test", required=True, help="the held-out questions (test.parquet)")
    parser.add_argument("--runs", nargs="+", required=True, help="run folders (eval/before.json, eval/after.json)")
    parser.add_argument("--out", default=None, help="write the JSON summary here")
    args = parser.parse_args(argv)
    meta = {e.id: e.metadata for e in load_examples(args.test)}
    runs = [Path(r) for r in args.runs]
    summary: dict = {"test": args.test, "runs": {}}
    for run in runs:
        summary["runs"][str(run)] = table(_records(run, "before"), _records(run, "after"), meta)
    summary["pooled"] = table(*pooled(runs), meta)
    for name, result in [*summary["runs"].items(), ("pooled over runs", summary["pooled"])]:
        print(f"\n{name}\n| questions | n | F1 before | F1 after | gain (95% CI) | searches before -> after |")
        print("|---|---|---|---|---|---|")
        rows = [("all", result["all"])]
        rows += [(f"difficulty {d}", b) for d, b in result["per_difficulty"].items()]
        rows += [(f"{k} searches needed", b) for k, b in result["per_searches_needed"].items()]
        for label, b in rows:
            f1 = b["f1"]
            ci = "-" if f1["low"] is None else f"[{f1['low']:+.3f}, {f1['high']:+.3f}]"
            print(
                f"| {label} | {f1['n']} | {f1['before']:.3f} | {f1['after']:.3f} | {f1['mean']:+.3f} {ci} | "
                f"{b['searches_before']:.2f} -> {b['searches_after']:.2f} |"
            )
    if args.out:
        write_atomic(Path(args.out), json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
