"""The runner's plan: every arm x condition x seed, overrides in the documented order, valid configs."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from stratarl.trainer.config import load_config

EVIDENCE = Path(__file__).resolve().parents[2] / "benchmarks" / "evidence"


@pytest.fixture(scope="module")
def ev():
    """The runner's modules by job: planning, running, summaries, admission (benchmarks/evidence/)."""
    sys.path.insert(0, str(EVIDENCE))
    try:
        import admission
        import planning
        import running
        import summaries

        yield SimpleNamespace(planning=planning, running=running, summaries=summaries, admission=admission)
    finally:
        sys.path.remove(str(EVIDENCE))


def test_override_values_round_trip_through_the_config_parser(ev):
    assert ev.planning.flatten(
        {"algo": {"name": "grpo", "alpha": 0.5}, "data": {"synthetic": {"options": {"size": 1}}}}
    ) == {"algo.name": "grpo", "algo.alpha": 0.5, "data.synthetic.options": {"size": 1}}
    overrides = ev.planning.as_overrides(
        {
            "optim.lr": 3.0e-4,
            "algo.sorl_normalize": False,
            "algo.stratum_cap": None,
            "data.synthetic.options": {"size": "small", "hop_mix": [0.2, 0.8, 0.0]},
        }
    )
    cfg = load_config(None, ["model.name=tiny-random", *overrides])
    assert cfg.optim.lr == 3.0e-4 and cfg.algo.normalizer == "none" and cfg.algo.stratum_cap is None
    assert cfg.data.synthetic.options == {"size": "small", "hop_mix": [0.2, 0.8, 0.0]}


@pytest.mark.parametrize("name, runs", [("stratified", 4 * 2 * 3), ("sorl", (3 + 6) * 3)])
def test_full_plan_covers_every_arm_condition_seed_with_valid_configs(ev, tmp_path, name, runs):
    exp = ev.planning.load_experiment(name)
    sft, specs = ev.planning.plan(exp, tmp_path, seeds=3, steps=7, reduced=False, extra=[])
    assert len(specs) == runs
    assert len({s.run_dir for s in specs}) == runs
    assert [s.seed for s in specs] == sorted(s.seed for s in specs)  # seed-major
    for spec in specs:
        # The arm's settings come after the condition's and the task's; seed / steps / init_from last.
        assert spec.overrides[-5:-1] == [
            f"trainer.seed={spec.seed:d}",
            "trainer.steps=7",
            "trainer.num_threads=1",
            "sft.enabled=false",
        ]
        assert spec.overrides[-1] == f"model.init_from={tmp_path / 'warmstart' / spec.task / 'model'}"
        cfg = load_config(exp["base_path"], spec.overrides[:-1])  # init_from does not exist yet
        assert cfg.trainer.seed == spec.seed
    by_arm = {(s.condition, s.arm): load_config(exp["base_path"], s.overrides[:-1]) for s in specs if s.seed == 0}
    if name == "stratified":
        assert by_arm[("guessable", "random_strata")].algo.stratum_key == "random"
        assert by_arm[("nonguessable", "san_only")].algo.alpha == 1.0
        assert by_arm[("guessable", "grpo")].data.synthetic.options["guessable"] == "only"
        assert set(sft) == {"guessable", "nonguessable"}
    else:
        normalize_only = by_arm[("high", "normalize_only")].algorithm
        turn_only = by_arm[("high", "turn_ratio_only")].algorithm
        assert normalize_only.uses_normalizer and normalize_only.ratio_level == "token"
        assert turn_only.ratio_level == "turn" and not turn_only.uses_normalizer
        assert ("low", "turn_ratio_only") not in by_arm and ("low", "so_grpo") in by_arm  # low lists its arms
        high = by_arm[("high", "grpo")].trainer
        assert high.epochs * high.mini_batches >= 8 and by_arm[("low", "grpo")].trainer.mini_batches == 1
        assert set(sft) == {"guessable"}


def test_arm_and_condition_filters(ev, tmp_path):
    exp = ev.planning.load_experiment("sorl")
    _, specs = ev.planning.plan(
        exp, tmp_path, seeds=1, steps=2, reduced=False, extra=["trainer.save_every=1"], arms=["ppo"], conditions=["low"]
    )
    assert [(s.condition, s.arm) for s in specs] == [("low", "ppo")]
    assert "trainer.save_every=1" in specs[0].overrides
    with pytest.raises(SystemExit, match="unknown arms"):
        ev.planning.plan(exp, tmp_path, seeds=1, steps=2, reduced=False, extra=[], arms=["nope"])


def test_unknown_experiment_names_the_known_ones(ev):
    with pytest.raises(SystemExit, match="sorl, stratified"):
        ev.planning.load_experiment("nope")


def test_an_experiment_file_with_a_yaml_syntax_error_is_one_line_naming_it(ev, tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("conditions:\n  a: {task: x\n")
    with pytest.raises(SystemExit) as info:
        ev.planning.load_experiment(str(path))
    assert str(info.value) == (
        f"error: experiment file {path} is not valid YAML at line 3, column 1: expected ',' or "
        "'}', but got '<stream end>' (while parsing a flow mapping that starts at line 2, "
        "column 6). Fix: correct the YAML syntax there"
    )


def test_finished_requires_all_steps(ev, tmp_path):
    assert not ev.summaries.finished(tmp_path, 3)
    (tmp_path / "summary.json").write_text('{"steps": 2, "interrupted": false}')
    assert not ev.summaries.finished(tmp_path, 3) and ev.summaries.finished(tmp_path, 2)
    (tmp_path / "summary.json").write_text('{"steps": 3, "interrupted": true}')
    assert not ev.summaries.finished(tmp_path, 3)


def test_warmstart_file_contributes_only_the_warm_start_settings(ev, tmp_path, monkeypatch):
    path = tmp_path / "warmstart.yaml"
    path.write_text(
        "model: {name: word-tiny, tiny_hidden_size: 64}\n"
        "data: {max_eval_examples: 7, synthetic: {options: {size: 2500, num_train: 1200}}}\n"
        "rollout: {group_size: 3, max_obs_tokens: 99}\n"
        "trainer: {prompts_per_step: 99}\noptim: {lr: 1.0}\n"
        "sft: {enabled: true, num_demos: 1200, lr: 3.0e-3}\n"
    )
    monkeypatch.setattr(ev.planning, "WARMSTART", path)
    assert ev.planning.warmstart_overrides() == [
        "model.name=word-tiny",
        "model.tiny_hidden_size=64",
        "data.synthetic.options={num_train: 1200, size: 2500}",
        "rollout.max_obs_tokens=99",
        "sft.num_demos=1200",
        "sft.lr=0.003",
    ]
    monkeypatch.setattr(ev.planning, "WARMSTART", tmp_path / "missing.yaml")
    assert ev.planning.warmstart_overrides() == []


def test_a_run_locked_by_a_live_runner_is_left_to_it(ev, tmp_path):
    exp = ev.planning.load_experiment("sorl")
    _, (spec, *_) = ev.planning.plan(exp, tmp_path, seeds=1, steps=2, reduced=True, extra=[])
    lock = spec.run_dir.parent / f".{spec.run_dir.name}.lock"
    lock.parent.mkdir(parents=True)
    lock.write_text(str(os.getpid()))  # this process is alive: the lock is held
    assert ev.running.run_one(spec, exp, 2).startswith("busy")
    assert not spec.run_dir.exists()
    lock.write_text("999999999")  # no such process: a stale lock is taken over (the run then starts)
    fd = ev.running.try_lock(lock)
    assert fd is not None and lock.read_text() == str(os.getpid())
    os.close(fd)


def test_an_admission_check_another_runner_holds_is_waited_for_and_its_record_taken(ev, tmp_path, monkeypatch):
    exp = ev.planning.load_experiment("lab_stratified_twohop")
    _, (spec, *_) = ev.planning.plan(exp, tmp_path, seeds=1, steps=2, reduced=True, extra=[])
    folder = tmp_path / exp["name"] / "admission"
    record, lock = folder / f"{spec.task}.json", folder / f".{spec.task}.lock"
    folder.mkdir(parents=True)
    record.write_text(json.dumps({"admitted": False, "failures": ["an earlier refusal"]}))
    os.utime(record, (0, 0))  # written before this runner asked: a refusal of an older warm start
    lock.write_text(str(os.getpid()))  # a live runner is checking this warm start now

    def other_runner_finishes():
        time.sleep(1.5)
        record.write_text(json.dumps({"admitted": False, "failures": ["share 0.4 outside [0.5, 1.0]"]}))
        lock.unlink()

    monkeypatch.setattr(ev.running, "call", lambda *a, **k: pytest.fail("a second admission run started"))
    threading.Thread(target=other_runner_finishes).start()
    assert ev.admission.admit(exp, spec, tmp_path) == [
        "share 0.4 outside [0.5, 1.0]"
    ]  # the other's verdict, not a rerun
    assert not lock.exists()
    os.utime(record, (0, 0))  # the same refusal, now older than the next request: it is checked again
    monkeypatch.setattr(ev.running, "call", lambda *a, **k: 1)
    assert ev.admission.admit(exp, spec, tmp_path) == ["the admission run failed (rc=1)"]


def test_world_from_gives_each_seed_its_own_world_and_warm_start(ev, tmp_path):
    exp = ev.planning.load_experiment("stratified")
    one_world_sft, one_world = ev.planning.plan(exp, tmp_path, seeds=2, steps=3, reduced=False, extra=[])
    exp["world_from"] = 3001
    sft, specs = ev.planning.plan(exp, tmp_path, seeds=2, steps=3, reduced=False, extra=[])
    assert set(sft) == {f"{t}-w{w}" for t in one_world_sft for w in (3001, 3002)}
    for name, overrides in sft.items():
        cfg = load_config(exp["base_path"], overrides)
        assert cfg.data.synthetic.seed == int(name.rsplit("-w", 1)[1])  # the warm start is built on that world
    for spec, same in zip(specs, one_world):
        world = 3001 + spec.seed
        assert spec.task == f"{same.task}-w{world}"
        assert spec.overrides[-1] == f"model.init_from={tmp_path / 'warmstart' / spec.task / 'model'}"
        cfg = load_config(exp["base_path"], spec.overrides[:-1])
        assert cfg.data.synthetic.seed == world and cfg.trainer.seed == spec.seed
        assert spec.config_hash() != same.config_hash()  # another design: its summaries are not reused
    # seeds of one arm and condition run on different worlds
    assert len({s.task for s in specs if (s.condition, s.arm) == (specs[0].condition, specs[0].arm)}) == 2
    exp["world_from"] = "3001"
    with pytest.raises(SystemExit, match="world_from"):
        ev.planning.plan(exp, tmp_path, seeds=1, steps=3, reduced=False, extra=[])


def test_a_condition_may_run_more_seeds_with_their_own_worlds(ev, tmp_path):
    exp = ev.planning.load_experiment("lab_sorl_reuse")
    sft, specs = ev.planning.plan(exp, tmp_path, seeds=3, steps=512, reduced=False, extra=[], condition_seeds=True)
    seeds = {c: {s.seed for s in specs if s.condition == c} for c in exp["conditions"]}
    assert seeds == {"d1": {0, 1, 2}, "d4": {0, 1, 2}, "d16": {0, 1, 2, 3, 4}}
    assert set(sft) == {f"multihop-w{4001 + s}" for s in range(5)}  # seeds 3-4 get their own worlds
    assert [s.seed for s in specs] == sorted(s.seed for s in specs)  # still seed-major
    controls = {s.arm for s in specs if s.arm.endswith(("_sgd", "before_clip"))}
    assert controls and {s.condition for s in specs if s.arm in controls} == {"d16"}
    # Without condition_seeds (a --seeds on the command line, or the reduced section) one count holds for all.
    _, same = ev.planning.plan(exp, tmp_path, seeds=2, steps=512, reduced=False, extra=[])
    assert {s.seed for s in same} == {0, 1}
    exp["conditions"]["d16"]["seeds"] = 0
    with pytest.raises(SystemExit, match="seeds"):
        ev.planning.plan(exp, tmp_path, seeds=3, steps=512, reduced=False, extra=[], condition_seeds=True)


def test_shared_warmstart_trains_one_warm_start_for_every_world(ev, tmp_path):
    """lab_offpolicy_lag: each seed on its own world (world_from), one warm start for all (it never sees a task
    world), so the worlds differ only in the RL task."""
    exp = ev.planning.load_experiment("lab_offpolicy_lag")
    sft, specs = ev.planning.plan(exp, tmp_path, seeds=3, steps=5, reduced=False, extra=[], arms=["grpo"])
    assert list(sft) == ["lab"] and not any(o.startswith("data.synthetic.seed=") for o in sft["lab"])
    assert [s.task for s in specs] == ["lab"] * 3
    assert [next(o for o in s.overrides if o.startswith("data.synthetic.seed=")) for s in specs] == [
        "data.synthetic.seed=5101",
        "data.synthetic.seed=5102",
        "data.synthetic.seed=5103",
    ]
    assert {s.overrides[-1] for s in specs} == {f"model.init_from={tmp_path / 'warmstart' / 'lab' / 'model'}"}
    # without it, one warm start per world (v3's lab_stratified_twohop)
    exp.pop("shared_warmstart")
    sft, specs = ev.planning.plan(exp, tmp_path, seeds=2, steps=5, reduced=False, extra=[], arms=["grpo"])
    assert list(sft) == ["lab-w5101", "lab-w5102"] and [s.task for s in specs] == ["lab-w5101", "lab-w5102"]


def test_warm_start_record_matches_on_what_the_warm_start_reads(ev, tmp_path):
    """A finished warm start is reused when only RL settings differ (optim.lr: each lr amendment of a design
    used to rebuild an identical checkpoint) and refused when a setting it trains with differs (sft.steps)."""
    exp = ev.planning.load_experiment("lab_sorl_clip")
    sft, _ = ev.planning.plan(exp, tmp_path, seeds=1, steps=5, reduced=False, extra=[], arms=["grpo"])
    (overrides,) = sft.values()
    assert "optim.lr=0.0003" in overrides  # the design's common lr reaches the warm start's overrides
    folder = tmp_path / "warmstart" / "threehop"
    (folder / "model").mkdir(parents=True)
    (folder / "model" / "config.json").write_text("{}")
    record = tmp_path / "warmstart" / "threehop.json"
    base = Path(exp["base_path"]).name
    record.write_text(
        json.dumps({"base": base, "overrides": overrides, "key": ev.running.warmstart_key(exp, overrides)})
    )

    other_lr = [o for o in overrides if not o.startswith("optim.lr=")] + ["optim.lr=1e-4"]
    assert ev.running.run_warmstart(exp, "threehop", other_lr, tmp_path) is True  # reused, nothing trained
    with pytest.raises(SystemExit, match="trained with other settings"):
        ev.running.run_warmstart(exp, "threehop", [*overrides, "sft.steps=7"], tmp_path)
    # a record from before keys were recorded matches only its own overrides
    record.write_text(json.dumps({"base": base, "overrides": overrides}))
    assert ev.running.run_warmstart(exp, "threehop", overrides, tmp_path) is True
    with pytest.raises(SystemExit, match="trained with other settings"):
        ev.running.run_warmstart(exp, "threehop", other_lr, tmp_path)


def test_every_committed_summary_has_the_config_hash_its_design_plans(ev):
    """Each summary under results/ (pilots' too) names a run the experiment's YAML still plans, with the same
    config hash: a change of the plan's overrides or their order would orphan them (they would be run again)."""
    import pilot as pilots
    import tables

    checked = 0
    for folder in sorted(d for d in ev.planning.RESULTS.iterdir() if d.is_dir() and d.name != "pilots"):
        exp = ev.planning.load_experiment(folder.name.removesuffix("-pilot"))
        seeds, arms, conditions, own_seeds = exp.get("seeds", 3), None, None, True
        if folder.name.endswith("-pilot"):
            section = pilots.validate(exp, tables.METRICS)
            exp = pilots.pilot_experiment(exp, section)
            seeds, arms, conditions, own_seeds = section["seeds"], section["arms"], section.get("conditions"), False
        _, specs = ev.planning.plan(
            exp,
            Path("/out"),
            seeds=seeds,
            steps=exp.get("steps", 30),
            reduced=False,
            extra=[],
            arms=arms,
            conditions=conditions,
            condition_seeds=own_seeds,
        )
        planned = {(s.condition, s.arm, s.seed): s.config_hash() for s in specs}
        for path in sorted(folder.glob("*/*.json")):
            summary = json.loads(path.read_text())
            key = (summary["condition"], summary["arm"], summary["seed"])
            assert planned.get(key) == summary["config_hash"], path
            checked += 1
    assert checked > 600  # every experiment's summaries, not a folder that moved


def test_warmstart_groups_give_each_world_group_its_own_seeded_warm_start(ev, tmp_path):
    """lab_offpolicy_lag_warmstarts: seed s starts from warm start s mod 3, each seeded on its own (demonstration
    worlds and sft.seed), and which warm start a run starts from is part of its config hash."""
    exp = ev.planning.load_experiment("lab_offpolicy_lag_warmstarts")
    sft, specs = ev.planning.plan(exp, tmp_path, seeds=5, steps=5, reduced=False, extra=[], arms=["grpo"])
    assert list(sft) == ["lab-g8101", "lab-g8102", "lab-g8103"]
    for g, overrides in zip((8101, 8102, 8103), sft.values(), strict=True):
        assert overrides[-2:] == [f"data.synthetic.seed={g}", f"sft.seed={g}"]
    assert [s.task for s in specs] == ["lab-g8101", "lab-g8102", "lab-g8103", "lab-g8101", "lab-g8102"]
    assert [next(o for o in s.overrides if o.startswith("data.synthetic.seed=")) for s in specs] == [
        f"data.synthetic.seed={5301 + s}" for s in range(5)
    ]
    assert specs[0].overrides[-1] == f"model.init_from={tmp_path / 'warmstart' / 'lab-g8101' / 'model'}"
    # the same world and seed from another warm start is another run
    exp["warmstart_groups"] = [8104, 8102, 8103]
    _, moved = ev.planning.plan(exp, tmp_path, seeds=1, steps=5, reduced=False, extra=[], arms=["grpo"])
    assert moved[0].config_hash() != specs[0].config_hash()
    # fewer seeds than groups: only the warm starts some run needs
    sft, _ = ev.planning.plan(exp, tmp_path, seeds=2, steps=5, reduced=False, extra=[], arms=["grpo"])
    assert list(sft) == ["lab-g8104", "lab-g8102"]


@pytest.mark.parametrize("groups", [[8101, 8101], [], "8101", [True], [-1]])
def test_warmstart_groups_refuse_what_is_not_a_list_of_distinct_seeds(ev, tmp_path, groups):
    exp = ev.planning.load_experiment("lab_offpolicy_lag_warmstarts")
    exp["warmstart_groups"] = groups
    with pytest.raises(SystemExit, match="warmstart_groups"):
        ev.planning.plan(exp, tmp_path, seeds=1, steps=5, reduced=False, extra=[], arms=["grpo"])


def test_warmstart_groups_need_a_shared_warm_start(ev, tmp_path):
    exp = ev.planning.load_experiment("lab_offpolicy_lag_warmstarts")
    exp.pop("shared_warmstart")
    with pytest.raises(SystemExit, match="shared_warmstart: true"):
        ev.planning.plan(exp, tmp_path, seeds=1, steps=5, reduced=False, extra=[], arms=["grpo"])
