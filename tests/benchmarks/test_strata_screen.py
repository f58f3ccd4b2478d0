"""benchmarks/external/strata_screen.py: the live-strata share of a finished run, counted by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "external" / "strata_screen.py"


@pytest.fixture(scope="module")
def screen_script(load_script):
    return load_script(BENCH, "strata_screen")


def _bins(zero, one, two):
    return {
        "rollout/search_calls_frac/0": zero,
        "rollout/search_calls_frac/1": one,
        "rollout/search_calls_frac/2": two,
        "rollout/search_calls_frac/3": 0.0,
        "rollout/search_calls_frac/4+": 0.0,
    }


def _run(folder: Path, rows: list[dict], prompts: int = 4) -> Path:
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / "config.yaml").write_text(f"trainer:\n  prompts_per_step: {prompts}\n")
    return folder


def test_dynamic_sampling_counts_dropped_groups_as_seen_and_not_live(screen_script, tmp_path, capsys):
    rows = [
        # 8 groups seen, 4 kept, half of the kept live: 2 live groups
        {
            "step": 1,
            "reward/mean": 0.4,
            "stratum/live_groups_frac": 0.5,
            "dynsample/groups_seen": 8,
            "dynsample/kept_groups": 4,
        }
        | _bins(0.0, 0.5, 0.5),
        # every group dropped: no live share logged, 8 groups seen, none live, bins all 0 (not averaged)
        {"step": 2, "reward/mean": 0.0, "dynsample/groups_seen": 8, "dynsample/kept_groups": 0} | _bins(0.0, 0.0, 0.0),
        # 4 seen, 4 kept, all live
        {
            "step": 3,
            "reward/mean": 0.5,
            "stratum/live_groups_frac": 1.0,
            "dynsample/groups_seen": 4,
            "dynsample/kept_groups": 4,
        }
        | _bins(0.5, 0.5, 0.0),
        {"eval": True, "eval/em": 0.5},  # an eval row is not a step
    ]
    run = _run(tmp_path / "run", rows)
    out = tmp_path / "screen.json"
    assert screen_script.main([str(run), "--out", str(out)]) == 0
    result = json.loads(out.read_text())[str(run)]
    assert result["steps"] == 3
    assert (result["groups_seen"], result["groups_kept"], result["live_groups"]) == (20, 8, 6)
    assert result["live_share_of_seen"] == pytest.approx(6 / 20)
    assert result["live_share_of_kept"] == pytest.approx(6 / 8)
    assert result["rollouts_by_searches"]["1"] == pytest.approx(0.5)  # steps 1 and 3 only
    assert result["rollouts_by_searches"]["0"] == pytest.approx(0.25)
    assert result["admitted"] is False
    assert "not admitted" in capsys.readouterr().out
    assert screen_script.main([str(run), "--min-live", "0.3"]) == 0
    assert "admitted (>= 0.3" in capsys.readouterr().out.replace("not admitted", "")


def test_without_dynamic_sampling_a_step_has_its_prompts_as_groups(screen_script, tmp_path):
    rows = [{"step": s, "stratum/live_groups_frac": live} | _bins(0, 0.5, 0.5) for s, live in ((1, 0.75), (2, 0.5))]
    result = screen_script.screen(rows, 4)
    assert (result["groups_seen"], result["live_groups"]) == (8, 5)
    assert result["live_share_of_seen"] == result["live_share_of_kept"] == pytest.approx(5 / 8)
    assert result["admitted"] is True
    with pytest.raises(ValueError, match="prompts_per_step"):
        screen_script.screen(rows, None)


def test_a_missing_folder_is_refused_and_steps_are_read_as_the_run_report_reads_them(screen_script, tmp_path, capsys):
    assert screen_script.main([str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert "metrics.jsonl: no such file" in err and len(err.strip().splitlines()) == 1
    # step 2 ran twice (a resume from step 1's checkpoint): its last row counts, once; a crash tore the last line
    rows = [
        {"step": 1, "reward/mean": 0.5, "stratum/live_groups_frac": 1.0} | _bins(0, 0.5, 0.5),
        {"step": 2, "reward/mean": 0.5, "stratum/live_groups_frac": 1.0} | _bins(0, 0.5, 0.5),
        {"step": 2, "reward/mean": 0.5, "stratum/live_groups_frac": 0.0} | _bins(0, 0.5, 0.5),
    ]
    run = _run(tmp_path / "resumed", rows)
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "stratum/li')
    out = tmp_path / "screen.json"
    assert screen_script.main([str(run), "--out", str(out)]) == 0
    result = json.loads(out.read_text())[str(run)]
    assert (result["steps"], result["groups_seen"], result["live_groups"]) == (2, 8, 4)
