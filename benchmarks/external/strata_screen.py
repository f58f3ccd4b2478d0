"""Does a finished training run give Stratified GRPO anything to act on? Live strata, read from its metrics.

    python benchmarks/external/strata_screen.py runs/pwem/rl runs/pwe/rl --out docs/results/phantomwiki_strata_screen.json

Paper A's admission asks for two live strata (``stratum/live_groups_frac``: a group with >= 2 search-count strata
whose mean reward lies in [0.05, 0.95]) in at least ``--min-live`` of the groups. Every training step logs that
share over the groups it trained on, so a run already made on a candidate task answers the question without a
new run. With dynamic sampling (``trainer.dynamic_sampling``) the step trains only the groups it kept; the groups
it dropped had one outcome in every rollout. This prints, per run:

- the groups the sampler saw and kept (``dynsample/groups_seen``, ``dynsample/kept_groups``; without dynamic
  sampling both are the step's prompts);
- the live groups (the step's share times its kept groups), as a share of the kept groups and of all groups seen.
  Of all groups seen, a dropped group counts as not live. That is exact for a 0/1 reward (a flat group's strata
  all have mean 0 or 1); with a graded reward (F1) a flat group at a value inside [0.05, 0.95] and two strata
  would be live, so the share of seen is then a lower bound and the share of kept an upper one;
- the trained rollouts by number of searches (the strata themselves), averaged over the steps that trained any;
- a verdict against ``--min-live`` on the share of all groups seen.

Writes the same as JSON with ``--out``. A run folder without metrics.jsonl is refused in one line naming the file;
the steps are read as the trainer's own report reads them (a resumed step once, a torn last line skipped).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

from stratarl.evaluation.rundir import train_rows

SEARCH_BINS = ("0", "1", "2", "3", "4+")


def read_steps(run: Path) -> list[dict]:
    """The training steps of ``run``/metrics.jsonl, as every reader of a run has them (``rundir.train_rows``: step
    order, a step re-run after a resume counted once, a torn last line of a crash skipped). A step whose groups
    were all dropped logs only dynamic sampling's counts: its groups count as seen, none live."""
    path = run / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{path}: no such file (give the folder of a training run)")
    return train_rows(run)


def prompts_per_step(run: Path) -> int | None:
    """trainer.prompts_per_step from the run's config.yaml (the groups of a step without dynamic sampling)."""
    path = run / "config.yaml"
    if not path.is_file():
        return None
    config = yaml.safe_load(path.read_text()) or {}
    value = (config.get("trainer") or {}).get("prompts_per_step")
    return int(value) if value is not None else None


def screen(rows: list[dict], groups_per_step: int | None, *, min_live: float = 0.6) -> dict:
    """Live-strata shares over a run's steps (see the module docstring); ``rows`` are its step metrics."""
    if not any("stratum/live_groups_frac" in row for row in rows):
        raise ValueError("no step logged stratum/live_groups_frac (a run of an older stratarl?)")
    seen = kept = live = 0.0
    for row in rows:
        if "dynsample/groups_seen" in row:
            step_seen, step_kept = row["dynsample/groups_seen"], row["dynsample/kept_groups"]
        elif groups_per_step is not None:
            step_seen = step_kept = float(groups_per_step)
        else:
            raise ValueError("a step has no dynsample/ counts and the run's config gives no trainer.prompts_per_step")
        seen += step_seen
        kept += step_kept
        live += row.get("stratum/live_groups_frac", 0.0) * step_kept
    # Over the steps that trained rollouts (a step that dropped every group logs its bins as 0).
    trained = [row for row in rows if sum(row.get(f"rollout/search_calls_frac/{key}", 0.0) for key in SEARCH_BINS) > 0]
    searches = {
        key: sum(row.get(f"rollout/search_calls_frac/{key}", 0.0) for row in trained) / max(1, len(trained))
        for key in SEARCH_BINS
    }
    share_seen = live / seen if seen else 0.0
    return {
        "steps": len(rows),
        "groups_seen": seen,
        "groups_kept": kept,
        "live_groups": round(live, 6),
        "live_share_of_seen": share_seen,
        "live_share_of_kept": live / kept if kept else 0.0,
        "rollouts_by_searches": searches,
        "min_live": min_live,
        "admitted": share_seen >= min_live,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="training run folders (each with metrics.jsonl)")
    parser.add_argument("--min-live", type=float, default=0.6, help="the admission's share of live groups (0.6)")
    parser.add_argument("--out", type=Path, help="write the screen as JSON here")
    args = parser.parse_args(argv)
    out = {}
    for run in args.runs:
        try:
            result = screen(read_steps(run), prompts_per_step(run), min_live=args.min_live)
        except ValueError as error:
            print(f"error: {run}: {error}", file=sys.stderr)
            return 2
        out[str(run)] = result
        bins = ", ".join(f"{k}: {v:.3f}" for k, v in result["rollouts_by_searches"].items())
        print(
            f"{run}: {result['steps']} steps, {result['groups_seen']:.0f} groups seen, {result['groups_kept']:.0f} kept; "
            f"live strata in {result['live_groups']:.0f} groups = {result['live_share_of_seen']:.3f} of seen "
            f"({result['live_share_of_kept']:.3f} of kept); rollouts by searches {bins}; "
            f"{'admitted' if result['admitted'] else 'not admitted'} (>= {args.min_live} of seen)"
        )
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
