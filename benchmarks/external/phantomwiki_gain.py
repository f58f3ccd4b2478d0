"""The paired gain of a later model over an earlier one on the same PhantomWiki (or Wikipedia-slice) questions.

    python benchmarks/external/phantomwiki_gain.py \\
        --before runs/phantomwiki/warm_start.json --after runs/phantomwiki/after_rl.json --setting search \\
        --out runs/phantomwiki/gain.json        # also gain.md and gain.html beside it

BEFORE and AFTER are result JSONs of ``phantomwiki_baselines.py`` (or both of ``wikislice_eval.py``) over the
same questions. The gain is after − before in F1 and EM, paired by question id, with a paired Student-t 95% CI
(stratarl.evaluation.stats.paired_gain, the interval of the trainer's "Did it learn?"), overall, per difficulty
(the slice: per source) and per number of searches of the later model; with the counts of questions up and down,
and the transcripts of the question gained most and of the one lost most (largest F1 change, ties by id), read from
the two evaluations' run folders (the ``--out`` of each eval command the JSON records, or the folder beside the
JSON). Writes the gain JSON, a markdown table and the report page (``stratarl report --benchmark GAIN.json``
renders the same page again). Two files that do not cover the same questions are refused in one line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from stratarl.config_errors import ConfigError
from stratarl.evaluation.benchmark import benchmark_gain, gain_markdown, load_summary
from stratarl.evaluation.benchmark_report import write_benchmark_report
from stratarl.publish import write_atomic


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, type=Path, help="the earlier model's result JSON")
    parser.add_argument("--after", required=True, type=Path, help="the later model's result JSON (same questions)")
    parser.add_argument("--setting", default="search", help="the setting compared (default: search)")
    parser.add_argument("--out", required=True, type=Path, help="gain JSON (the .md and .html go beside it)")
    args = parser.parse_args(argv)
    try:
        gain = benchmark_gain(
            load_summary(args.before),
            load_summary(args.after),
            setting=args.setting,
            before_path=args.before,
            after_path=args.after,
        )
        write_atomic(args.out, json.dumps(gain, indent=1) + "\n")
        markdown = gain_markdown(gain)
        write_atomic(args.out.with_suffix(".md"), markdown)
        page = write_benchmark_report(args.out, out=args.out.with_suffix(".html"))
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(markdown)
    for which, shown in gain["transcripts"].items():
        if shown is not None:
            found = "transcripts found" if shown["before"] and shown["after"] else "transcript missing"
            print(f"{which}: {shown['id']} F1 {shown['f1_before']:.2f} -> {shown['f1_after']:.2f} ({found})")
    print(f"gain: {args.out}, {args.out.with_suffix('.md')}; report: {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
