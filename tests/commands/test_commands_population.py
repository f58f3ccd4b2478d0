"""`stratarl population` (stratarl.commands.population): each member's outcome (done / stopped / dropped) in the
exit code, the printed lines and the summary; specs checked like configs (unknown keys with the nearest valid
name, every message naming the member); the start-up checks of `stratarl train` for every member."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

import stratarl.commands.train as train_command
from stratarl.commands.population import load_spec, members_of, run_population_command

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"


def _args(spec: Path, **extra) -> argparse.Namespace:
    defaults = {"summary": None, "no_logs": True, "no_retriever_check": False}
    return argparse.Namespace(spec=str(spec), **{**defaults, **extra})


def _spec(tmp_path: Path, runs, name: str = "spec.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(runs))
    return path


def _run(tmp_path, name, **extra):
    return {"name": name, "run_dir": str(tmp_path / name), "config": str(TINY), **extra}


def _fake_pipeline(outcomes: dict):
    """A pipeline that trains nothing: each member's run returns the summary (or raises the error) given."""

    def pipeline(cfg, run_dir, *, resume, start_over, parts, **_):
        outcome = outcomes[Path(run_dir).name]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    return pipeline


def test_a_member_stopped_by_retrieval_failures_is_reported_and_the_population_exits_non_zero(
    tmp_path, monkeypatch, capsys
):
    """Before: a member whose summary said exit code 3 printed `done: 3 steps`, "2 of 2 runs ok", exit 0."""
    outcomes = {
        "good": {"steps": 3, "exit_code": 0},
        "cut": {"steps": 3, "exit_code": 3, "stop_reason": "retriever http://x failed on 3 steps in a row"},
    }
    monkeypatch.setattr(train_command, "run_pipeline", _fake_pipeline(outcomes))
    spec = _spec(tmp_path, {"runs": [_run(tmp_path, "good"), _run(tmp_path, "cut")]})
    summary = tmp_path / "out.json"
    code = run_population_command(_args(spec, summary=str(summary)))
    out = capsys.readouterr().out
    assert code == 3
    assert "good: done: 3 steps" in out
    assert "cut: STOPPED at step 3 (exit code 3): retriever http://x failed on 3 steps in a row" in out
    assert "1 of 2 runs done, 1 stopped, 0 dropped (exit code 3)" in out
    members = {m["name"]: m for m in json.loads(summary.read_text())["members"]}
    assert members["good"]["status"] == "done" and members["good"]["ok"]
    assert members["cut"]["status"] == "stopped" and members["cut"]["exit_code"] == 3 and not members["cut"]["ok"]
    assert "retriever" in members["cut"]["reason"]


def test_a_dropped_member_makes_the_population_exit_1(tmp_path, monkeypatch, capsys):
    outcomes = {"good": {"steps": 3, "exit_code": 0}, "broken": RuntimeError("weights exploded")}
    monkeypatch.setattr(train_command, "run_pipeline", _fake_pipeline(outcomes))
    spec = _spec(tmp_path, [_run(tmp_path, "good"), _run(tmp_path, "broken")])
    assert run_population_command(_args(spec)) == 1
    out = capsys.readouterr().out
    assert "broken: DROPPED (exit code 1): RuntimeError: weights exploded" in out
    assert "1 of 2 runs done, 0 stopped, 1 dropped" in out


def test_every_member_done_exits_0(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(train_command, "run_pipeline", _fake_pipeline({"a": {"steps": 2}, "b": {"steps": 2}}))
    assert run_population_command(_args(_spec(tmp_path, [_run(tmp_path, "a"), _run(tmp_path, "b")]))) == 0
    assert "2 of 2 runs done" in capsys.readouterr().out


def test_members_get_the_retriever_probe_of_stratarl_train(tmp_path, monkeypatch, capsys):
    """A member whose remote retriever does not answer stops the population before any training, exit code 3,
    naming the member (as `stratarl train` exits 3); --no-retriever-check skips the probe."""
    trained = []

    def pipeline(cfg, run_dir, **_):
        trained.append(run_dir)
        return {"steps": 1}

    monkeypatch.setattr(train_command, "run_pipeline", pipeline)
    remote = _run(tmp_path, "remote", overrides=["retrieval.spec=http://127.0.0.1:9/retrieve"])
    spec = _spec(tmp_path, [_run(tmp_path, "local"), remote])
    assert run_population_command(_args(spec)) == 3
    err = capsys.readouterr().err
    assert "member remote:" in err and "127.0.0.1:9" in err and len(err.strip().splitlines()) == 1
    assert trained == []
    assert run_population_command(_args(spec, no_retriever_check=True)) == 0
    assert len(trained) == 2


@pytest.mark.parametrize(
    "runs, words",
    [
        ({"runs": [{"run_dir": "a", "config": "c.yaml", "overides": ["x=1"]}]}, ["run 0 (a).overides", "'overrides'"]),
        (
            {"runz": [{"run_dir": "a", "config": "c.yaml"}], "runs": [{"run_dir": "a", "config": "c.yaml"}]},
            ["spec.runz", "did you mean 'runs'"],
        ),
        (
            [{"name": "m1", "run_dir": "a", "config": "c.yaml", "runz": True}],
            ["run 0 (m1).runz", "did you mean 'runs', a key of the spec itself"],
        ),
        (7, ["the file = 7", "not a mapping or a list"]),
        ([7], ["run 0 = 7", "not a mapping"]),
        ([{"name": "m", "run_dir": "a", "config": "c.yaml", "overrides": "x=1"}], ["run 0 (m).overrides", "list"]),
        ([{"name": "m", "run_dir": "a", "config": "c.yaml", "resume": "yes"}], ["run 0 (m).resume", "true or false"]),
        ([{"name": "m", "run_dir": "a"}], ["run 0 (m)", "neither config nor resume"]),
        ([{"name": "m", "config": "c.yaml"}], ["run 0 (m)", "no run_dir"]),
        ([{"name": "m", "run_dir": "a", "config": "c.yaml", "start_over": True}], ["run 0 (m).start_over"]),
        # the stacked mode (and its threads) is gone: a spec that still asks for it is refused, not ignored
        ({"runs": [{"run_dir": "a", "config": "c.yaml"}], "stack": True}, ["spec.stack", "unknown key"]),
        ({"runs": [{"run_dir": "a", "config": "c.yaml"}], "threads": 2}, ["spec.threads", "unknown key"]),
    ],
)
def test_a_bad_spec_is_one_line_naming_the_member_and_the_key(tmp_path, runs, words):
    """Before: misspelt keys were ignored (the member trained without its overrides), a bare number was a
    traceback, and no message named the member."""
    from stratarl.config_errors import ConfigError

    with pytest.raises(ConfigError) as error:
        load_spec(_spec(tmp_path, runs))
    message = str(error.value)
    assert "\n" not in message and "Fix:" in message and str(tmp_path / "spec.json") in message
    for word in words:
        assert word in message, (word, message)


def test_a_members_bad_config_is_refused_naming_the_member(tmp_path):
    from stratarl.config_errors import ConfigError

    runs = [_run(tmp_path, "fine"), _run(tmp_path, "typo", overrides=["algo.nme=grpo"])]
    with pytest.raises(ConfigError, match=r"run 1 \(typo\): .*algo.nme") as error:
        members_of(load_spec(_spec(tmp_path, runs)), "spec.json")
    assert "\n" not in str(error.value)
    same = [_run(tmp_path, "a"), {**_run(tmp_path, "b"), "run_dir": str(tmp_path / "a")}]
    with pytest.raises(ConfigError, match=r"run 1 \(b\) has the run_dir of run 0 \(a\)"):
        members_of(load_spec(_spec(tmp_path, same)), "spec.json")


def test_the_command_line_refuses_a_bare_number_in_one_line(tmp_path):
    import subprocess
    import sys

    spec = tmp_path / "spec.yaml"
    spec.write_text("3\n")
    out = subprocess.run(
        [sys.executable, "-m", "stratarl.cli", "population", str(spec)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2
    assert out.stderr.startswith("error: population spec") and len(out.stderr.strip().splitlines()) == 1


def test_members_run_one_after_another_and_a_signal_stops_the_ones_after(tmp_path):
    """Members run in spec order, each to its end before the next starts; a member that a signal stopped (its
    summary says ``interrupted``, exit code 130) is the last to run: the ones after it are reported, not started."""
    from stratarl.trainer.population import NOT_STARTED, Member, run_population

    order = []

    def pipeline(cfg, run_dir, *, resume, start_over, parts, **_):
        order.append(run_dir.name)
        if run_dir.name == "b":
            return {"steps": 1, "exit_code": 130, "interrupted": True, "stop_reason": "stopped by a signal"}
        return {"steps": 2, "exit_code": 0}

    members = [Member(name, None, tmp_path / name) for name in ("a", "b", "c")]  # type: ignore[arg-type]
    report = run_population(members, pipeline=pipeline, logs=False)
    assert order == ["a", "b"]
    assert [r.status for r in report.members] == ["done", "stopped", "dropped"]
    assert report.members[2].error == NOT_STARTED
    from stratarl.commands.population import population_exit_code

    assert population_exit_code(report.members) == 130
