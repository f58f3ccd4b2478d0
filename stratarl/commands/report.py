"""`stratarl report RUN_DIR [RUN_DIR...]`: one self-contained HTML page comparing runs;
with ``--aggregate``, arms x seeds statistics (mean ± 95% CI, paired differences vs a baseline);
with ``--benchmark RESULT.json [--before EARLIER.json]``, an external benchmark's result page
(stratarl.evaluation.benchmark_report)."""

from __future__ import annotations

import argparse


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "report",
        help="HTML page (+ PNGs) of training curves, several runs overlaid; "
        "--aggregate: mean ± 95%% CI per arm over seeds and paired comparisons",
        description="Plots every metric of metrics.jsonl, one line per run, grouped by "
        "namespace (reward, rollout, stratum, loss, sorl, time, ...), plus eval "
        "tables. PNGs are embedded, so the HTML file stands alone. With --aggregate, "
        "runs are grouped into arms (arm.json in the run directory, else algo.name) "
        "and conditions; writes aggregate.json, aggregate.md, mean ± CI band plots "
        "and the HTML page.",
    )
    p.add_argument("run_dirs", nargs="*", help="run directories written by `stratarl train`")
    p.add_argument(
        "--out",
        help="HTML path (default: <first run>/report/report.html; with --aggregate "
        "<parent of first run>/aggregate/report.html); other outputs go next to it",
    )
    p.add_argument("--title", default=None)
    p.add_argument("--aggregate", action="store_true", help="statistics over seeds per arm instead of one line per run")
    p.add_argument("--baseline", help="with --aggregate: the arm every other arm is compared with (paired by seed)")
    p.add_argument("--final-window", type=int, default=5, help="with --aggregate: `final` = mean of the last N steps")
    p.add_argument(
        "--benchmark",
        metavar="JSON",
        help="instead of runs: a benchmark result (benchmarks/external/phantomwiki_baselines.py, wikislice_eval.py "
        'or phantomwiki_gain.py) as a page that opens with "Did it learn?" (default --out: the JSON with .html)',
    )
    p.add_argument(
        "--before",
        metavar="JSON",
        help="with --benchmark: the earlier model's result on the same questions (the gain is after - before)",
    )
    p.add_argument("--setting", default="search", help="with --benchmark: the setting compared (default: search)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from stratarl.commands import guard

    def body() -> int:
        from pathlib import Path

        if args.benchmark:
            from stratarl.evaluation.benchmark_report import write_benchmark_report

            if args.run_dirs or args.aggregate:
                raise ValueError("--benchmark renders one result file: drop the run directories and --aggregate")
            path = write_benchmark_report(args.benchmark, args.before, args.out, setting=args.setting, title=args.title)
            print(f"report: {path}")
            return 0
        if args.before:
            raise ValueError("--before goes with --benchmark JSON (the later model's result)")
        if not args.run_dirs:
            raise ValueError("give run directories (`stratarl report runs/NAME`) or --benchmark RESULT.json")
        if args.aggregate:
            from stratarl.evaluation.aggregate import write_aggregate

            if args.final_window < 1:
                raise ValueError(f"--final-window {args.final_window}: must be >= 1")
            out = Path(args.out) if args.out else Path(args.run_dirs[0]).parent / "aggregate" / "report.html"
            path = write_aggregate(
                args.run_dirs,
                out,
                baseline=args.baseline,
                final_window=args.final_window,
                title=args.title or "stratarl aggregate",
            )
            print(f"aggregate: {path.parent / 'aggregate.json'}, {path.parent / 'aggregate.md'}")
            print(f"report: {path}")
            return 0
        from stratarl.evaluation.report import build_report

        path = build_report(args.run_dirs, args.out, title=args.title or "stratarl report")
        print(f"report: {path}")
        return 0

    return guard(body)
