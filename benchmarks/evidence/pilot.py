"""The mechanism admission of an experiment: pilot worlds on which each paper's mechanism must be shown to
operate before any arm of the sweep runs.

The warm-start admission (admission.py) checks the first step's rollouts. This check asks more: over a whole
budget on worlds the sweep never uses, does the task leave headroom, does it keep two live strata for
Stratified GRPO, does PPO clip and does SORL's normaliser engage? A null where the mechanism had nothing to
act on says nothing about the method, so a design with a ``pilot`` section does not run its sweep until
`run.py EXP --pilot` has written an admitted record, the design it admitted is still the one on file, and every
check of the record re-derives from the committed pilot summaries (``gate`` judges them again and compares).

    pilot:
      world_from: 4101          # pilot seed s runs on world 4101 + s; the sweep's world_from must not overlap
      seeds: 3
      arms: [grpo, so_grpo]     # arms of the experiment run on the pilot worlds (default: the baseline)
      conditions: [lag32]       # default: every condition
      checks:                   # name -> a tables.py metric of one arm, and a bound on its mean over pilot runs
        headroom_after:  {metric: em_after, arm: grpo, max: 0.85}
        headroom_before: {metric: em_before, arm: grpo, max: 0.6}
        live_strata:     {metric: live_strata_1_50, arm: grpo, min: 0.6}
        escapes_some:    {metric: em_after, arm: grpo, above: 0.5, share: [0.01, 0.99]}   # share of pilot runs

A check holds in every condition it is read in. The pilot runs are ordinary runs of the experiment under the
name ``<experiment>-pilot`` (their summaries sit in results/<experiment>-pilot/, committed), and the record is
``pilots/<experiment>.json`` next to this file, committed too. Standard library only.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

HERE = Path(__file__).resolve().parent
PILOTS = HERE / "pilots"
# The parts of an experiment a pilot record vouches for: changing any of them, or the settings of an arm the
# pilot ran, needs a new pilot. Arms the pilot did not run are not vouched for by it, so they may be added or
# set from the pilot's measurements (e.g. SORL's delta from the pilot's gradient scale) without a new one.
DESIGN_KEYS = ("base", "warmstart", "tasks", "conditions", "common", "steps", "world_from", "shared_warmstart", "pilot")
CHECK_KEYS = {"metric", "arm", "min", "max", "above", "below", "share"}


def design_hash(exp: dict) -> str:
    """sha256 (16 hex digits) of the design the pilot admits: ``DESIGN_KEYS`` of the experiment's YAML and the
    settings of the arms the pilot runs."""
    pilot = exp.get("pilot") or {}
    design = {k: exp.get(k) for k in DESIGN_KEYS}
    design["pilot_arms"] = {a: exp["arms"].get(a) for a in pilot.get("arms", [exp.get("baseline")])}
    return hashlib.sha256(json.dumps(design, sort_keys=True, default=str).encode()).hexdigest()[:16]


def validate(exp: dict, metrics: dict) -> dict:
    """The experiment's ``pilot`` section, checked (a clear error naming the field otherwise)."""
    where = f"{exp['name']}.yaml: pilot"
    pilot = exp.get("pilot")
    if not isinstance(pilot, dict):
        raise ValueError(
            f"{where} must be a mapping (world_from, seeds, arms, checks). Fix: see benchmarks/evidence/pilot.py"
        )
    start, seeds = pilot.get("world_from"), pilot.get("seeds", 3)
    if not isinstance(start, int) or isinstance(start, bool) or start < 0:
        raise ValueError(f"{where}.world_from = {start!r}. Fix: a knowledge-base seed >= 0 that the sweep never uses")
    if not isinstance(seeds, int) or seeds < 1:
        raise ValueError(f"{where}.seeds = {seeds!r}. Fix: an integer >= 1")
    sweep_from = exp.get("world_from")
    if sweep_from is not None and sweep_from < start + seeds and start < sweep_from + int(exp.get("seeds", 1)):
        raise ValueError(
            f"{where}: pilot worlds {start}..{start + seeds - 1} overlap the sweep's worlds from "
            f"{sweep_from}. Fix: tune on worlds the sweep never sees (move pilot.world_from)"
        )
    arms = pilot.get("arms", [exp["baseline"]])
    unknown = [a for a in arms if a not in exp["arms"]]
    if unknown:
        raise ValueError(f"{where}.arms names {unknown}; the experiment's arms: {sorted(exp['arms'])}")
    checks = pilot.get("checks")
    if not isinstance(checks, dict) or not checks:
        raise ValueError(
            f"{where}.checks must name at least one check. Fix: e.g. "
            "headroom: {metric: em_after, arm: grpo, max: 0.85}"
        )
    for name, check in checks.items():
        if not isinstance(check, dict) or set(check) - CHECK_KEYS or "metric" not in check:
            raise ValueError(f"{where}.checks.{name} = {check!r}. Fix: keys {sorted(CHECK_KEYS)}, metric required")
        if check["metric"] not in metrics:
            raise ValueError(
                f"{where}.checks.{name}.metric {check['metric']!r} is unknown. Fix: one of {', '.join(sorted(metrics))}"
            )
        if check.get("arm", arms[0]) not in arms:
            raise ValueError(f"{where}.checks.{name}.arm {check.get('arm')!r} is not a pilot arm ({arms})")
        per_run = "above" in check or "below" in check
        if per_run != ("share" in check):
            raise ValueError(
                f"{where}.checks.{name}: `share: [low, high]` goes with `above` or `below` (a share of "
                "pilot runs), `min` / `max` with the mean. Fix: use one form"
            )
        if not per_run and "min" not in check and "max" not in check:
            raise ValueError(f"{where}.checks.{name}: give min, max, or above/below with share")
    return {**pilot, "seeds": seeds, "arms": arms}


def evaluate(check: dict, values: list[float | None]) -> dict:
    """One check on the pilot runs' values of its metric (None: the run lacks it, which fails the check)."""
    have = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    out: dict = {"n": len(values), "values": [None if v is None else round(float(v), 4) for v in values]}
    if not have or len(have) < len(values):
        return {**out, "passed": False, "why": f"{len(values) - len(have)} of {len(values)} pilot runs lack the metric"}
    if "share" in check:
        if "above" in check:
            hits, bound = [v > check["above"] for v in have], f"> {check['above']}"
        else:
            hits, bound = [v < check["below"] for v in have], f"< {check['below']}"
        share = sum(hits) / len(hits)
        low, high = check["share"]
        return {
            **out,
            "share": round(share, 4),
            "passed": low <= share <= high,
            "why": f"share of runs {bound}: {share:.3f}, wanted in [{low}, {high}]",
        }
    mean = sum(have) / len(have)
    ok = check.get("min", -math.inf) <= mean <= check.get("max", math.inf)
    bound = " and ".join(
        s for s in (f">= {check['min']}" if "min" in check else "", f"<= {check['max']}" if "max" in check else "") if s
    )
    return {**out, "mean": round(mean, 4), "passed": ok, "why": f"mean {mean:.4f}, wanted {bound}"}


def judge(exp: dict, pilot: dict, runs: dict, metrics: dict) -> dict:
    """The record: every check in every pilot condition on ``runs`` (condition -> arm -> seed -> summary)."""
    conditions = pilot.get("conditions") or list(exp["conditions"])
    results = {}
    for condition in conditions:
        for name, check in pilot["checks"].items():
            arm = check.get("arm", pilot["arms"][0])
            seeds = runs.get(condition, {}).get(arm, {})
            values = [metrics[check["metric"]][1](seeds[s]) if s in seeds else None for s in range(pilot["seeds"])]
            results[f"{condition}/{name}"] = {"metric": check["metric"], "arm": arm, **evaluate(check, values)}
    return {
        "experiment": exp["name"],
        "design_hash": design_hash(exp),
        "worlds": list(range(pilot["world_from"], pilot["world_from"] + pilot["seeds"])),
        "conditions": conditions,
        "admitted": all(r["passed"] for r in results.values()),
        "checks": results,
    }


def keep_history(record: dict, previous: dict | None) -> dict:
    """``record`` with the records of earlier designs kept under ``earlier`` (oldest first): a design amended after
    a pilot that did not admit it keeps that pilot's verdict on file. A re-judged same design replaces its own, and
    keeps the ``replaced_checks`` lines written into it (they say how this design weakened a check; the judge does
    not write them)."""
    if previous is None:
        return record
    earlier = list(previous.get("earlier", []))
    if previous.get("design_hash") != record["design_hash"]:
        earlier.append({k: v for k, v in previous.items() if k != "earlier"})
    elif "replaced_checks" in previous and "replaced_checks" not in record:
        record = {**record, "replaced_checks": previous["replaced_checks"]}
    return {**record, "earlier": earlier} if earlier else record


def pilot_experiment(exp: dict, pilot: dict) -> dict:
    """The pilot as an experiment of its own: the same design on the pilot worlds, under ``<name>-pilot``."""
    return {
        **exp,
        "name": f"{exp['name']}-pilot",
        "world_from": pilot["world_from"],
        "seeds": pilot["seeds"],
        "admission": exp.get("admission"),
        "pilot": None,
    }


def record_path(exp: dict, root: Path = PILOTS) -> Path:
    return root / f"{exp['name']}.json"


def read_record(path: Path) -> dict:
    """The pilot record at ``path``, or a ``ValueError`` of one line saying why it cannot be read (not JSON, not a
    mapping, no ``checks`` mapping of check -> {passed, ...})."""
    fix = "Fix: restore it from git, or write it again with `run.py EXP --pilot`"
    try:
        record = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"the pilot record {path} is not JSON ({error.msg} at line {error.lineno}). {fix}") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"the pilot record {path} cannot be read ({error}). {fix}") from None
    if not isinstance(record, dict):
        raise ValueError(f"the pilot record {path} is a JSON {type(record).__name__}, not a record (a mapping). {fix}")
    checks = record.get("checks")
    if not isinstance(checks, dict) or not checks:
        raise ValueError(f"the pilot record {path} lacks `checks` (the verdict of each check). {fix}")
    for name, check in checks.items():
        if not isinstance(check, dict) or not isinstance(check.get("passed"), bool):
            raise ValueError(f"the pilot record {path}: check {name} has no verdict (`passed`). {fix}")
    return record


# What a record's check must agree on with the same check re-derived from the pilot summaries.
COMPARED = ("metric", "arm", "n", "values", "mean", "share", "passed", "why")


def disagreement(record: dict, fresh: dict) -> str | None:
    """Where ``record`` (as committed) differs from ``fresh`` (``judge`` on the committed pilot summaries): the
    first check whose metric, arm, values, mean, share or verdict differ, a check one has and the other lacks, or
    the overall verdict; None when they agree."""
    have, want = record["checks"], fresh["checks"]
    for name in [*want, *(k for k in have if k not in want)]:
        if name not in have:
            return f"check {name}: the record lacks it"
        if name not in want:
            return f"check {name}: the design has no such check"
        for key in COMPARED:
            if have[name].get(key) != want[name].get(key):
                return (
                    f"check {name}: the record says {key} = {have[name].get(key)!r}, the pilot summaries give "
                    f"{want[name].get(key)!r}"
                )
    for key in ("admitted", "worlds", "conditions"):
        if record.get(key) != fresh[key]:
            return f"`{key}`: the record says {record.get(key)!r}, the pilot summaries give {fresh[key]!r}"
    return None


def gate(exp: dict, root: Path, runs: dict, metrics: dict) -> str | None:
    """None when the sweep may run (no pilot section, or an admitted record of this very design whose every check
    re-derives from the pilot runs ``runs``: condition -> arm -> seed -> summary, as ``tables.load_runs`` reads
    the committed ``<experiment>-pilot`` summaries); else the one-line reason it may not."""
    if not exp.get("pilot"):
        return None
    path = record_path(exp, root)
    fix = f"Fix: python benchmarks/evidence/run.py {exp['name']} --pilot"
    if not path.is_file():
        return f"{exp['name']} has a pilot section but no pilot record ({path}). {fix}"
    try:
        record = read_record(path)
        section = validate(exp, metrics)
    except ValueError as error:
        return str(error)
    if record.get("design_hash") != design_hash(exp):
        return (
            f"the pilot record {path} admitted another design (hash {record.get('design_hash')}, this one "
            f"{design_hash(exp)}): the design changed after its pilot. {fix}"
        )
    differs = disagreement(record, judge(exp, section, runs, metrics))
    if differs is not None:
        return (
            f"the pilot record {path} disagrees with the pilot summaries ({differs}). Fix: restore the record "
            f"and the summaries from git, or run the pilot again ({fix[5:]})"
        )
    if not record.get("admitted"):
        failed = [f"{k}: {v.get('why', 'failed')}" for k, v in record["checks"].items() if not v["passed"]]
        return (
            f"{exp['name']}'s pilot did not admit the regime ({'; '.join(failed)}). Fix: change the design "
            "and run its pilot again; the sweep never runs in a regime where the mechanism had nothing to act on"
        )
    return None


def describe(record: dict) -> str:
    """The record as lines for the console."""
    lines = [
        (
            f"pilot of {record['experiment']} on worlds {record['worlds']}: "
            f"{'ADMITTED' if record['admitted'] else 'NOT ADMITTED'}"
        )
    ]
    for name, r in record["checks"].items():
        lines.append(
            f"  [{'pass' if r['passed'] else 'FAIL'}] {name} ({r['arm']} {r['metric']}): {r['why']}; runs {r['values']}"
        )
    return "\n".join(lines)
