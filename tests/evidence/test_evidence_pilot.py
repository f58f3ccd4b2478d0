"""The mechanism admission on pilot worlds (benchmarks/evidence/pilot.py): checks, record, and the gate that keeps
a sweep from running before its pilot admitted the very design on file."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

EVIDENCE = Path(__file__).resolve().parents[2] / "benchmarks" / "evidence"


def _load(name: str, file: str):
    spec = importlib.util.spec_from_file_location(name, EVIDENCE / file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def pilot():
    sys.path.insert(0, str(EVIDENCE))
    try:
        yield _load("evidence_pilot", "pilot.py")
    finally:
        sys.modules.pop("evidence_pilot", None)


METRICS = {"em_after": ("", lambda r: r.get("em_after")), "clip_frac": ("", lambda r: r.get("clip"))}


def _exp(**pilot_fields):
    pilot = {
        "world_from": 4101,
        "seeds": 3,
        "arms": ["grpo"],
        "checks": {"headroom": {"metric": "em_after", "arm": "grpo", "max": 0.85}},
    }
    pilot.update(pilot_fields)
    return {
        "name": "demo_exp",
        "baseline": "grpo",
        "arms": {"grpo": {}, "ppo": {}},
        "conditions": {"c": {"task": "t"}},
        "tasks": {"t": {}},
        "world_from": 5001,
        "seeds": 8,
        "pilot": pilot,
    }


def test_mean_and_share_checks(pilot):
    assert pilot.evaluate({"max": 0.85}, [0.5, 0.9, 0.7]) == {
        "n": 3,
        "values": [0.5, 0.9, 0.7],
        "mean": 0.7,
        "passed": True,
        "why": "mean 0.7000, wanted <= 0.85",
    }
    assert not pilot.evaluate({"min": 0.01}, [0.002, 0.004])["passed"]
    assert pilot.evaluate({"min": 0.01, "max": 1}, [0.02])["passed"]
    # "escapes on some worlds, not all, and not none"
    some = {"above": 0.5, "share": [0.01, 0.99]}
    assert pilot.evaluate(some, [0.2, 0.8, 0.3])["passed"]
    assert not pilot.evaluate(some, [0.6, 0.8, 0.9])["passed"] and not pilot.evaluate(some, [0.1, 0.2, 0.3])["passed"]
    assert pilot.evaluate({"below": 0.3, "share": [0.5, 1]}, [0.1, 0.2, 0.9])["share"] == pytest.approx(2 / 3, abs=1e-4)
    # a run without the metric fails the check rather than shrinking the sample
    missing = pilot.evaluate({"min": 0.0}, [0.5, None])
    assert not missing["passed"] and "1 of 2" in missing["why"]


def test_a_share_check_counts_the_runs_on_the_side_its_bound_names(pilot):
    """A window where the two readings differ: with values [0.2, 0.6, 0.7], 2 of 3 runs lie above 0.5 and 1 of 3
    below it, so `share: [0.5, 1.0]` admits the `above` check and refuses the `below` one. A gate that counted
    the wrong side (or counted ties) would give the opposite verdicts here; a window like [0.01, 0.99] would not
    tell them apart."""
    values = [0.2, 0.6, 0.7]
    above = pilot.evaluate({"above": 0.5, "share": [0.5, 1.0]}, values)
    assert above["share"] == pytest.approx(2 / 3, abs=1e-4) and above["passed"]
    below = pilot.evaluate({"below": 0.5, "share": [0.5, 1.0]}, values)
    assert below["share"] == pytest.approx(1 / 3, abs=1e-4) and not below["passed"]
    # strict bounds: a run at the bound is on neither side
    assert pilot.evaluate({"above": 0.6, "share": [0.5, 1.0]}, [0.6, 0.6, 0.7])["share"] == pytest.approx(
        1 / 3, abs=1e-4
    )
    assert not pilot.evaluate({"above": 0.6, "share": [0.5, 1.0]}, [0.6, 0.6, 0.7])["passed"]


def _admitted(pilot, tmp_path):
    exp = _exp(checks={"escapes": {"metric": "em_after", "arm": "grpo", "above": 0.5, "share": [0.5, 1.0]}})
    runs = {"c": {"grpo": {0: {"em_after": 0.2}, 1: {"em_after": 0.6}, 2: {"em_after": 0.7}}}}
    record = pilot.judge(exp, pilot.validate(exp, METRICS), runs, METRICS)
    assert record["admitted"]
    pilot.record_path(exp, tmp_path).write_text(json.dumps(record))
    return exp, runs, record


def test_the_gate_re_derives_every_check_and_refuses_a_record_that_disagrees(pilot, tmp_path):
    exp, runs, record = _admitted(pilot, tmp_path)
    assert pilot.gate(exp, tmp_path, runs, METRICS) is None
    path = pilot.record_path(exp, tmp_path)
    # an edited record: another value, another verdict, an admitted flag its checks do not give, a dropped check
    edits = {
        "values": lambda r: r["checks"]["c/escapes"].update(values=[0.9, 0.9, 0.9]),
        "share": lambda r: r["checks"]["c/escapes"].update(share=1.0),
        "passed": lambda r: r["checks"]["c/escapes"].update(passed=False),
        "lacks it": lambda r: r["checks"].update({"c/other": r["checks"].pop("c/escapes")}),
    }
    for word, edit in edits.items():
        edited = json.loads(json.dumps(record))
        edit(edited)
        path.write_text(json.dumps(edited))
        why = pilot.gate(exp, tmp_path, runs, METRICS)
        assert why is not None and "disagrees" in why and "check c/" in why and word in why, (word, why)
        assert "\n" not in why
    # the summaries changed under an intact record (a run's value edited): the verdict is re-derived and refused
    path.write_text(json.dumps(record))
    worse = {"c": {"grpo": {0: {"em_after": 0.2}, 1: {"em_after": 0.3}, 2: {"em_after": 0.7}}}}
    assert "check c/escapes" in pilot.gate(exp, tmp_path, worse, METRICS)


def test_a_record_edited_to_admitted_while_its_checks_failed_is_refused(pilot, tmp_path):
    exp = _exp()
    runs = {"c": {"grpo": {s: {"em_after": 0.95} for s in range(3)}}}
    record = pilot.judge(exp, pilot.validate(exp, METRICS), runs, METRICS)
    assert not record["admitted"]
    pilot.record_path(exp, tmp_path).write_text(json.dumps({**record, "admitted": True}))
    why = pilot.gate(exp, tmp_path, runs, METRICS)
    assert "`admitted`: the record says True" in why and "\n" not in why


@pytest.mark.parametrize(
    "text, words",
    [
        ("{not json", "is not JSON"),
        ("[1, 2]", "is a JSON list"),
        ('{"design_hash": "x", "admitted": true}', "lacks `checks`"),
        ('{"checks": []}', "lacks `checks`"),
        ('{"checks": {"c/x": {"values": []}}}', "check c/x has no verdict"),
    ],
)
def test_an_unreadable_record_refuses_the_sweep_in_one_line(pilot, tmp_path, text, words):
    exp = _exp()
    pilot.record_path(exp, tmp_path).write_text(text)
    why = pilot.gate(exp, tmp_path, {}, METRICS)
    assert words in why and str(pilot.record_path(exp, tmp_path)) in why and "\n" not in why


def test_the_committed_pilot_records_re_derive_from_the_committed_summaries():
    """Each committed record agrees, check by check, with its committed <experiment>-pilot summaries: an admitting
    record opens the gate; a record that did not admit (a verdict worth keeping) closes it for that reason alone,
    the gate's last test, reached only after the design hash and every check re-derived."""
    sys.path.insert(0, str(EVIDENCE))
    runner = _load("evidence_run_for_gate", "run.py")
    records = sorted((EVIDENCE / "pilots").glob("*.json"))
    assert records
    for record in records:
        exp = runner.load_experiment(record.stem)
        why = runner.admission.pilot_gate(exp, runner.pilots.PILOTS, runner.RESULTS)
        if json.loads(record.read_text())["admitted"]:
            assert why is None, record.stem
        else:
            assert why is not None and why.startswith(f"{record.stem}'s pilot did not admit the regime"), why


def test_validate_refuses_bad_sections_with_the_field_named(pilot):
    assert pilot.validate(_exp(), METRICS)["arms"] == ["grpo"]
    cases = [
        ({"world_from": 5003}, "overlap the sweep's worlds"),
        ({"world_from": -1}, "world_from = -1"),
        ({"arms": ["so_ppo"]}, "pilot.arms names ['so_ppo']"),
        ({"checks": {}}, "at least one check"),
        ({"checks": {"x": {"metric": "nope", "max": 1}}}, "checks.x.metric 'nope' is unknown"),
        ({"checks": {"x": {"metric": "em_after", "above": 0.5}}}, "share: [low, high]"),
        ({"checks": {"x": {"metric": "em_after"}}}, "give min, max"),
        ({"checks": {"x": {"metric": "em_after", "arm": "ppo", "max": 1}}}, "not a pilot arm"),
        ({"checks": {"x": {"metric": "em_after", "maximum": 1}}}, "checks.x"),
    ]
    for fields, message in cases:
        with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
            pilot.validate(_exp(**fields), METRICS)


def test_judge_reads_every_condition_and_each_checks_own_arm(pilot):
    exp = _exp(
        arms=["grpo", "ppo"],
        checks={
            "headroom": {"metric": "em_after", "arm": "grpo", "max": 0.85},
            "clipping": {"metric": "clip_frac", "arm": "ppo", "min": 0.01},
        },
    )
    exp["conditions"]["d"] = {"task": "t"}
    section = pilot.validate(exp, METRICS)
    runs = {
        "c": {"grpo": {s: {"em_after": 0.5} for s in range(3)}, "ppo": {s: {"clip": 0.02} for s in range(3)}},
        "d": {"grpo": {s: {"em_after": 0.5} for s in range(3)}, "ppo": {s: {"clip": 0.002} for s in range(3)}},
    }
    record = pilot.judge(exp, section, runs, METRICS)
    assert record["worlds"] == [4101, 4102, 4103] and record["conditions"] == ["c", "d"]
    assert {k: v["passed"] for k, v in record["checks"].items()} == {
        "c/headroom": True,
        "c/clipping": True,
        "d/headroom": True,
        "d/clipping": False,
    }
    assert not record["admitted"]
    # a pilot seed that never ran counts against the check
    del runs["d"]["ppo"][2]
    runs["d"]["ppo"][0] = runs["d"]["ppo"][1] = {"clip": 0.05}
    assert not pilot.judge(exp, section, runs, METRICS)["checks"]["d/clipping"]["passed"]


def test_gate_needs_an_admitted_record_of_this_very_design(pilot, tmp_path):
    exp = _exp()
    failing = {"c": {"grpo": {s: {"em_after": 0.95} for s in range(3)}}}
    runs = {"c": {"grpo": {s: {"em_after": 0.5} for s in range(3)}}}
    assert pilot.gate({**exp, "pilot": None}, tmp_path, runs, METRICS) is None  # no pilot section: nothing to gate
    assert "no pilot record" in pilot.gate(exp, tmp_path, runs, METRICS)
    assert "--pilot" in pilot.gate(exp, tmp_path, runs, METRICS)
    section = pilot.validate(exp, METRICS)
    record = pilot.judge(exp, section, failing, METRICS)
    pilot.record_path(exp, tmp_path).write_text(json.dumps(record))
    assert "did not admit" in pilot.gate(exp, tmp_path, failing, METRICS)
    assert "mean 0.9500" in pilot.gate(exp, tmp_path, failing, METRICS)
    record = pilot.judge(exp, section, runs, METRICS)
    pilot.record_path(exp, tmp_path).write_text(json.dumps(record))
    assert pilot.gate(exp, tmp_path, runs, METRICS) is None
    gate = pilot.gate

    def gate_of(design, root):
        return gate(design, root, runs, METRICS)

    # any change of the regime after its pilot (a pilot arm's settings, a task setting, the steps) needs a new pilot
    for changed in (
        {**exp, "arms": {**exp["arms"], "grpo": {"optim.lr": 1e-3}}},
        {**exp, "steps": 50},
        {**exp, "tasks": {"t": {"sft.wrong_hop_fraction": 0.3}}},
    ):
        assert "admitted another design" in gate_of(changed, tmp_path)
    # ... but not what the pilot does not vouch for: an arm it did not run (added, or set from its measurements),
    # the description, the tables' metrics
    assert (
        gate_of(
            {
                **exp,
                "arms": {**exp["arms"], "so_ppo": {"algo.sorl_delta": 0.4}},
                "description": "new",
                "metrics": {"primary": "em_after"},
            },
            tmp_path,
        )
        is None
    )


def test_pilot_experiment_runs_the_design_on_the_pilot_worlds(pilot):
    exp = _exp()
    as_pilot = pilot.pilot_experiment(exp, pilot.validate(exp, METRICS))
    assert as_pilot["name"] == "demo_exp-pilot" and as_pilot["world_from"] == 4101 and as_pilot["seeds"] == 3
    assert as_pilot["arms"] == exp["arms"] and as_pilot["pilot"] is None


def test_committed_designs_with_a_pilot_validate_and_never_tune_on_sweep_worlds(pilot):
    import yaml

    tables = _load("evidence_tables_for_pilot", "tables.py")
    for path in sorted(EVIDENCE.glob("*.yaml")):
        exp = yaml.safe_load(path.read_text())
        if not isinstance(exp, dict) or not exp.get("pilot"):
            continue
        exp["name"] = path.stem
        section = pilot.validate(exp, tables.METRICS)
        record = pilot.record_path(exp)
        if record.is_file():  # a committed record names the worlds it ran on: the pilot's, never the sweep's
            have = json.loads(record.read_text())
            assert have["worlds"] == list(range(section["world_from"], section["world_from"] + section["seeds"]))


def test_the_runner_refuses_a_sweep_before_its_pilot_then_runs_the_pilot_and_writes_its_record(tmp_path, capsys):
    """End to end at CI sizes: the sweep is refused without a record; `--pilot` trains the pilot arms on the pilot
    worlds only (under <name>-pilot) and writes the record from their summaries."""
    import yaml

    runner = _load("evidence_run_for_pilot", "run.py")
    exp = yaml.safe_load((EVIDENCE / "lab_offpolicy_lag.yaml").read_text())
    exp["base"] = str((EVIDENCE / exp["base"]).resolve())
    exp["pilot"].update(
        seeds=1,
        arms=["grpo"],
        checks={
            "headroom": {"metric": "em_after", "arm": "grpo", "max": 0.85},
            "clipping": {"metric": "clip_frac", "arm": "grpo", "min": 0.5},
        },
    )
    path = tmp_path / "offpolicy_small.yaml"
    path.write_text(yaml.safe_dump(exp))
    results = tmp_path / "results"
    with pytest.raises(SystemExit, match="no pilot record"):
        runner.main([str(path), "--out", str(tmp_path / "runs"), "--results", str(results)])
    rc = runner.main(
        [str(path), "--pilot", "--reduced", "--out", str(tmp_path / "runs"), "--results", str(results), "--jobs", "1"]
    )
    out = capsys.readouterr().out
    assert rc == 2 and "NOT ADMITTED" in out  # 3 steps at policy lag 2 clip nothing: the clipping check fails
    summaries = sorted(p.relative_to(results).as_posix() for p in results.glob("*/*/*.json"))
    assert summaries == ["offpolicy_small-pilot/lag32/grpo-s0.json"]
    summary = json.loads((results / summaries[0]).read_text())
    assert "data.synthetic.seed=4101" in summary["overrides"]  # the pilot world, not the sweep's 5101
    record = json.loads((results / "pilots" / "offpolicy_small.json").read_text())
    assert record["worlds"] == [4101] and record["checks"]["lag32/headroom"]["passed"]
    assert not record["checks"]["lag32/clipping"]["passed"] and not record["admitted"]
    with pytest.raises(SystemExit, match="did not admit"):
        runner.main([str(path), "--out", str(tmp_path / "runs"), "--results", str(results)])


def test_an_amended_design_keeps_the_verdicts_of_earlier_pilots(pilot):
    first = {"design_hash": "aaa", "admitted": False, "checks": {"c/x": {"passed": False}}}
    rejudged = {"design_hash": "aaa", "admitted": False, "checks": {}}
    assert pilot.keep_history(rejudged, first) == rejudged  # the same design re-judged replaces its own record
    amended = {"design_hash": "bbb", "admitted": True, "checks": {}}
    kept = pilot.keep_history(amended, first)
    assert kept["earlier"] == [first] and kept["admitted"]
    again = pilot.keep_history({"design_hash": "ccc", "admitted": True, "checks": {}}, kept)
    assert [r["design_hash"] for r in again["earlier"]] == ["aaa", "bbb"]
    assert pilot.keep_history(amended, None) == amended
    # the lines saying which failing check an amendment replaced survive a re-judging of that design, not a new one
    said = {**amended, "replaced_checks": ["clipping (0.56%) replaced by GRPO's clipping"]}
    assert pilot.keep_history(amended, said)["replaced_checks"] == said["replaced_checks"]
    assert "replaced_checks" not in pilot.keep_history({"design_hash": "ddd", "admitted": True, "checks": {}}, said)


def test_a_damaged_pilot_summary_refuses_the_sweep_in_one_line(tmp_path):
    import shutil

    sys.path.insert(0, str(EVIDENCE))
    runner = _load("evidence_run_for_damage", "run.py")
    exp = runner.load_experiment("lab_shortcut")
    results, pilots = tmp_path / "results", tmp_path / "pilots"
    shutil.copytree(runner.RESULTS / "lab_shortcut-pilot", results / "lab_shortcut-pilot")
    pilots.mkdir()
    shutil.copy(EVIDENCE / "pilots" / "lab_shortcut.json", pilots / "lab_shortcut.json")
    assert runner.admission.pilot_gate(exp, pilots, results) is None  # the copies agree
    summary = sorted((results / "lab_shortcut-pilot").glob("*/*.json"))[0]
    summary.write_text("{truncated")
    why = runner.admission.pilot_gate(exp, pilots, results)
    assert "a pilot summary under" in why and "cannot be read" in why and "\n" not in why
    summary.unlink()  # a summary gone: its run lacks the metric, which the record does not say
    why = runner.admission.pilot_gate(exp, pilots, results)
    assert "disagrees with the pilot summaries (check g16/" in why
