"""Planning an evidence experiment: its YAML, and the warm starts and runs it asks for, with their overrides in the
documented order (no process is started here; standard library and PyYAML only, no torch).

``load_experiment`` reads ``<name>.yaml``; ``plan`` turns it into the warm starts (task -> SFT overrides) and the
``RunSpec`` of every arm x condition x seed, whose ``config_hash`` names what a run is in the design.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
WARMSTART = HERE / "warmstart.yaml"
# Committed per-run summaries (small JSON): a sweep finished in parts, on several machines, regenerates its
# tables from these alone (benchmarks/evidence/tables.py).
RESULTS = HERE / "results"
# Overrides that name paths of this machine: not part of what a run *is* (its config hash).
MACHINE_KEYS = ("model.init_from=", "data.synthetic.cache_dir=")


@dataclass
class RunSpec:
    """One `stratarl train` invocation of the sweep."""

    condition: str
    arm: str
    seed: int
    task: str
    run_dir: Path
    overrides: list[str] = field(default_factory=list)
    base: str = ""
    steps: int = 0  # RL steps of this run (rl_steps: the budget over the condition's steps_per_batch)

    def config_hash(self) -> str:
        """sha256 (16 hex digits) of what the run is in the design: its base config's name and its overrides
        without this machine's paths. Equal on every machine; it changes when the experiment's YAML changes
        this run, not when stratarl gains a config field or the base config's contents change: the summary's
        ``provenance`` records those (commit, dirty tree, sha256 of the base config's contents, the warm
        start's digest, torch, threads, CPU)."""
        portable = [o for o in self.overrides if not o.startswith(MACHINE_KEYS)]
        design = {"base": Path(self.base).name, "overrides": portable}
        return hashlib.sha256(json.dumps(design, sort_keys=True).encode()).hexdigest()[:16]


def _value(value) -> str:
    """A YAML value as one command-line token (flow style: dicts and lists stay on one line)."""
    if isinstance(value, str):
        return value
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("...").strip()


def flatten(mapping: dict, prefix: str = "") -> dict:
    """Nested config sections -> dotted keys; ``options`` mappings stay whole (they are one field)."""
    out = {}
    for key, value in (mapping or {}).items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and key != "options" and "." not in key:
            out.update(flatten(value, f"{path}."))
        else:
            out[path] = value
    return out


def as_overrides(mapping: dict) -> list[str]:
    return [f"{k}={_value(v)}" for k, v in flatten(mapping).items()]


def load_experiment(name: str) -> dict:
    path = Path(name) if name.endswith((".yaml", ".yml")) else HERE / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in HERE.glob("*.yaml") if p.stem not in ("base", "warmstart"))
        sys.exit(f"error: no experiment {name!r} ({path}). Fix: use one of {', '.join(known)}")
    try:
        exp = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        from stratarl.config_errors import yaml_syntax_error

        sys.exit(f"error: experiment file {yaml_syntax_error(path, error)}")
    exp["name"] = path.stem
    exp["base_path"] = str((path.parent / exp.get("base", "base.yaml")).resolve())
    # The warm-start fragment layered over the base (v1 experiments: warmstart.yaml); null: the base's own sft.
    fragment = exp.get("warmstart", "warmstart.yaml")
    exp["warmstart_path"] = None if fragment is None else (path.parent / fragment).resolve()
    for cond, spec in exp["conditions"].items():
        if spec["task"] not in exp["tasks"]:
            sys.exit(f"error: {path}: condition {cond!r} names task {spec['task']!r}; tasks: {sorted(exp['tasks'])}")
    return exp


# What warmstart.yaml contributes: everything that shapes the warm-start checkpoint and must match it in RL
# (model, task data, retrieval, rollout format, the SFT itself). The RL settings (algo, optim, trainer,
# eval, logging, data.max_*, rollout.group_size) stay the experiment's, so it cannot resize the sweeps.
WARMSTART_KEYS = ("model.", "data.source", "data.synthetic.", "retrieval.", "rollout.", "sft.")


def warmstart_overrides(path: Path | None = None) -> list[str]:
    """SFT settings from the warm-start fragment ``path`` (default: warmstart.yaml; owned by the warm-start
    tuning: a config fragment or a complete config, nested sections or dotted keys), restricted to
    WARMSTART_KEYS; [] while it does not exist (the base config's own sft section applies)."""
    path = WARMSTART if path is None else path
    if not path.is_file():
        return []
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        sys.exit(f"error: {path} must be a mapping of config sections, got {type(data).__name__}")
    flat = flatten(data)
    return [
        f"{k}={_value(v)}"
        for k, v in flat.items()
        if k.startswith(WARMSTART_KEYS) and k not in ("sft.enabled", "rollout.group_size")
    ]


def in_condition(spec: dict, arm: str) -> bool:
    """A condition may list the arms it runs (``arms: [...]``); default: every arm."""
    return not spec.get("arms") or arm in spec["arms"]


def rl_steps(exp: dict, condition: str, steps: int) -> int:
    """RL steps of a run of ``condition``: ``steps``, or with the condition's ``steps_per_batch: d`` (d optimizer
    steps per RL step) ``steps`` optimizer steps, i.e. steps // d RL steps (at least 1), so every degree gets
    the same number of optimizer steps and, with a fixed mini-batch, consumes the same rollouts."""
    d = int(exp["conditions"][condition].get("steps_per_batch", 1))
    if d < 1:
        sys.exit(f"error: {exp['name']}: condition {condition!r} has steps_per_batch {d}. Fix: use an integer >= 1")
    return max(1, steps // d)


def _select(kind: str, all_names: list[str], wanted: list[str] | None) -> list[str]:
    if not wanted:
        return all_names
    unknown = sorted(set(wanted) - set(all_names))
    if unknown:
        sys.exit(f"error: unknown {kind} {unknown}; the experiment has {all_names}")
    return [n for n in all_names if n in wanted]


def _world_from(exp: dict) -> int | None:
    """The experiment's ``world_from`` (None: one world): seed s then trains on world world_from + s."""
    world_from = exp.get("world_from")
    if world_from is not None and (not isinstance(world_from, int) or isinstance(world_from, bool) or world_from < 0):
        sys.exit(
            f"error: {exp['name']}.yaml: world_from {world_from!r} must be a knowledge-base seed (an integer "
            ">= 0): seed s then runs on world world_from + s. Fix: use e.g. 3001, or drop it (one world)"
        )
    return world_from


@dataclass(frozen=True)
class _Layout:
    """What every override list of a plan shares: the common head, the tail (reduced section, ``--set``, cache),
    the worlds and the warm starts' names."""

    exp: dict
    common: list[str]
    tail: list[str]
    world_from: int | None
    shared: bool  # ``shared_warmstart: true``: one warm start per task for every world
    groups: tuple[int, ...] = ()  # ``warmstart_groups``: with ``shared``, the seeds of one warm start per world group

    def world(self, seed: int) -> list[str]:
        """With ``world_from``: seed s trains on its own world (data.synthetic.seed = world_from + s) and its own
        warm start, so the CIs over seeds cover worlds and warm starts, not only RL seeds."""
        return [] if self.world_from is None else [f"data.synthetic.seed={self.world_from + seed}"]

    def group_seed(self, seed: int) -> int | None:
        """With ``warmstart_groups`` (and a shared warm start), the seed of the warm start world seed ``seed``
        starts from (``warmstart_group``); else None."""
        return warmstart_group(self.groups, seed) if self.shared and self.groups else None

    def key(self, task: str, seed: int) -> str:
        """The name of the warm start a run of ``task`` and ``seed`` starts from (one warm start per key): with
        ``warmstart_groups`` ``<task>-g<the group's seed>``."""
        g = self.group_seed(seed)
        if g is not None:
            return f"{task}-g{g}"
        return task if self.world_from is None or self.shared else f"{task}-w{self.world_from + seed}"

    def group(self, seed: int) -> list[str]:
        """The overrides that make a world group's warm start its own: its seed seeds the demonstration worlds
        (``data.synthetic.seed``, from which every demonstration world's seed derives) and the demonstrations'
        choice, order and the initial weights (``sft.seed``)."""
        g = self.group_seed(seed)
        return [] if g is None else [f"data.synthetic.seed={g}", f"sft.seed={g}"]

    def task_head(self, task: str) -> list[str]:
        return self.common + as_overrides(self.exp["tasks"][task])

    def task_tail(self, task: str) -> list[str]:
        return [x.replace("{task}", task) for x in self.tail]


def warmstart_group(groups, seed: int) -> int:
    """The warm start (its seed, from ``warmstart_groups``) that world seed ``seed`` starts from: group s mod G, so
    that consecutive seeds, and a sweep cut short, cover every warm start."""
    return groups[seed % len(groups)]


def _warmstart_groups(exp: dict) -> tuple[int, ...]:
    """The experiment's ``warmstart_groups`` (a list of distinct warm-start seeds, with ``shared_warmstart``):
    seed s starts from the warm start of group s mod G, so the CI over worlds covers the warm start too."""
    groups = exp.get("warmstart_groups")
    if groups is None:
        return ()
    ok = (
        isinstance(groups, list)
        and groups
        and all(isinstance(g, int) and not isinstance(g, bool) and g >= 0 for g in groups)
        and len(set(groups)) == len(groups)
    )
    if not ok or not exp.get("shared_warmstart"):
        sys.exit(
            f"error: {exp['name']}.yaml: warmstart_groups {groups!r} must be a list of distinct warm-start seeds "
            "(integers >= 0) beside shared_warmstart: true. Fix: e.g. warmstart_groups: [8101, 8102, 8103]"
        )
    return tuple(groups)


def _seeds_of(exp: dict, cond: str, seeds: int, condition_seeds: bool) -> int:
    own = exp["conditions"][cond].get("seeds") if condition_seeds else None
    if own is not None and (not isinstance(own, int) or isinstance(own, bool) or own < 1):
        sys.exit(f"error: {exp['name']}.yaml: condition {cond!r} has seeds {own!r}. Fix: use an integer >= 1")
    return seeds if own is None else own


def _warm_starts(layout: _Layout, conditions: list[str], seeds_of) -> dict[str, list[str]]:
    """Warm start name -> its SFT overrides: one per task, with ``world_from`` (and no shared warm start) one
    per task and world, with a shared warm start and ``warmstart_groups`` one per task and world group."""
    exp, sft = layout.exp, {}
    for t in sorted({exp["conditions"][c]["task"] for c in conditions}):
        task_seeds = max(seeds_of(c) for c in conditions if exp["conditions"][c]["task"] == t)
        own = layout.world_from is not None and not layout.shared
        for seed in range(task_seeds if own else min(task_seeds, len(layout.groups)) or 1):
            sft[layout.key(t, seed)] = (
                layout.task_head(t) + layout.task_tail(t) + (layout.world(seed) if own else layout.group(seed))
            )
    return sft


def _run_spec(layout: _Layout, out: Path, cond: str, arm: str, seed: int, n_steps: int) -> RunSpec:
    """One run: overrides common, task, condition, arm, tail, world, then the run's own (seed, steps, one thread,
    no SFT, the warm start it loads). The order is part of the config hash."""
    exp, spec = layout.exp, layout.exp["conditions"][cond]
    task, group = spec["task"], layout.group_seed(seed)
    overrides = (
        layout.task_head(task)
        + as_overrides(spec.get("overrides", {}))
        + as_overrides(exp["arms"][arm])
        + layout.task_tail(task)
        + layout.world(seed)
        # with warmstart_groups, the group's seed (sft.seed does nothing in RL): which warm start a run starts from
        # is then part of its config hash, not only of its machine path
        + ([] if group is None else [f"sft.seed={group}"])
        + [
            f"trainer.seed={seed}",
            f"trainer.steps={n_steps}",
            "trainer.num_threads=1",
            "sft.enabled=false",
            f"model.init_from={out / 'warmstart' / layout.key(task, seed) / 'model'}",
        ]
    )
    run_dir = out / exp["name"] / cond / f"{arm}-s{seed}"
    return RunSpec(cond, arm, seed, layout.key(task, seed), run_dir, overrides, exp["base_path"], n_steps)


def plan(
    exp: dict,
    out: Path,
    *,
    seeds: int,
    steps: int,
    reduced: bool,
    extra: list[str],
    arms: list[str] | None = None,
    conditions: list[str] | None = None,
    cache: Path | None = None,
    condition_seeds: bool = False,
) -> tuple[dict, list[RunSpec]]:
    """(warm start -> SFT overrides, run specs ordered seed-major so early results cover whole seeds). A warm start
    is named by its task, or with the experiment's ``world_from`` by task and world (``multihop-w3001``); a
    RunSpec's ``task`` is the name of the warm start it starts from. With ``condition_seeds`` a condition's own
    ``seeds: N`` replaces ``seeds`` for its runs (e.g. more seeds at the degree where a collapse is expected)."""
    red = exp.get("reduced", {}) if reduced else {}
    arms = _select("arms", list(exp["arms"]), arms or red.get("arms"))
    conditions = _select("conditions", list(exp["conditions"]), conditions or red.get("conditions"))
    tail = as_overrides(red.get("overrides", {})) + list(extra)
    common = (warmstart_overrides(exp["warmstart_path"]) if exp["warmstart_path"] is not None else []) + as_overrides(
        exp.get("common", {})
    )
    if cache is not None:  # one KB folder per task (an explicit cache_dir is the KB folder itself)
        tail += [f"data.synthetic.cache_dir={cache / '{task}'}"]
    # ``shared_warmstart: true``: one warm start per task for every world (a warm start that never sees the task's
    # world, as the lab's: its demonstrations come from fresh worlds), so the worlds differ only in the RL task.
    layout = _Layout(
        exp, common, tail, _world_from(exp), bool(exp.get("shared_warmstart", False)), _warmstart_groups(exp)
    )

    def seeds_of(cond: str) -> int:
        return _seeds_of(exp, cond, seeds, condition_seeds)

    sft = _warm_starts(layout, conditions, seeds_of)
    runs = []
    for seed in range(max(seeds_of(c) for c in conditions)):
        for cond in conditions:
            if seed >= seeds_of(cond):
                continue
            n_steps = rl_steps(exp, cond, steps)
            runs.extend(
                _run_spec(layout, out, cond, arm, seed, n_steps)
                for arm in arms
                if in_condition(exp["conditions"][cond], arm)
            )
    return sft, runs
