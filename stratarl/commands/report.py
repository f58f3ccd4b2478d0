"""`stratarl report RUN_DIR [RUN_DIR...]`: one self-contained HTML page comparing runs."""

from __future__ import annotations

import argparse


def register(subparsers) -> None:
    p = subparsers.add_parser("report", help="HTML page (+ PNGs) of training curves, several runs overlaid",
                              description="Plots every metric of metrics.jsonl, one line per run, grouped by "
                                          "namespace (reward, rollout, stratum, loss, sorl, time, ...), plus eval "
                                          "tables. PNGs are embedded, so the HTML file stands alone.")
    p.add_argument("run_dirs", nargs="+", help="run directories written by `stratarl train`")
    p.add_argument("--out", help="HTML path (default: <first run>/report/report.html)")
    p.add_argument("--title", default="stratarl report")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from stratarl.commands.train import _guard

    def body() -> int:
        from stratarl.trainer.report import build_report

        path = build_report(args.run_dirs, args.out, title=args.title)
        print(f"report: {path}")
        return 0

    return _guard(body)
