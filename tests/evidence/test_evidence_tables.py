"""benchmarks/evidence/tables.py: the committed tables (docs/results.md's marked table, docs/results/<exp>.md and
.json) are what the committed run summaries give, and the script runs where torch cannot be imported."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TABLES = REPO / "benchmarks" / "evidence" / "tables.py"
# A finder in front of every other one that refuses torch, as on a machine without it.
NO_TORCH = f"""
import runpy, sys
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "torch":
            raise ModuleNotFoundError("No module named 'torch' (blocked by the test)")
        return None
sys.meta_path.insert(0, NoTorch())
try:
    import torch
except ModuleNotFoundError:
    pass
else:
    raise SystemExit("the blocker let torch through")
sys.argv = [{str(TABLES)!r}, *sys.argv[1:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.fixture(scope="module")
def tables(load_script):
    sys.path.insert(0, str(TABLES.parent))  # tables.py imports the experiment loader (planning.py)
    try:
        yield load_script(TABLES, "evidence_tables_check")
    finally:
        sys.path.remove(str(TABLES.parent))


COMMITTED = sorted(d.name for d in (REPO / "benchmarks" / "evidence" / "results").iterdir() if d.is_dir())


@pytest.mark.parametrize("experiment", COMMITTED)
def test_committed_tables_equal_what_the_committed_summaries_give(tables, experiment, capsys):
    assert tables.main([experiment, "--check"]) == 0, capsys.readouterr().out


def test_one_command_checks_every_experiment_with_summaries(tables, capsys):
    assert {"lab_stratified", "lab_sorl"} <= set(COMMITTED)
    assert tables.main(["--check"]) == 0
    out = capsys.readouterr().out
    assert all(f"{name}: " in out for name in COMMITTED), out


def _summary(arm: str, seed: int, em: float) -> dict:
    return {
        "arm": arm,
        "condition": "c",
        "seed": seed,
        "eval": {"after": {"em": em}, "before": {"em": 0.1}},
        "per_step": {"reward/mean": [em]},
    }


def test_contrasts_pair_arms_by_seed_and_the_headline_shows_them_per_metric(tables):
    """A contrast 'a - b' is the paired difference over the seeds both arms have (hand-computed here), and a
    headline with `metrics` has one row per metric with the contrast's column."""
    exp = {
        "name": "x",
        "baseline": "grpo",
        "arms": {"grpo": {}, "ppo": {}, "so_ppo": {}},
        "conditions": {"c": {}},
        "metrics": {"primary": "em_after", "secondary": ["em_gain"], "diagnostics": ["em_before"]},
        "contrasts": ["so_ppo - ppo"],
        "headline": {
            "label": "degree",
            "metrics": ["em_after", "em_gain"],
            "columns": {"so_ppo - ppo": "SO-PPO − PPO"},
        },
    }
    ems = {"grpo": [0.5, 0.5, 0.5], "ppo": [0.4, 0.6, 0.5], "so_ppo": [0.5, 0.8, 0.6]}  # so_ppo - ppo: 0.1, 0.2, 0.1
    arms = {arm: {s: _summary(arm, s, em) for s, em in enumerate(v)} for arm, v in ems.items()}
    table = tables.condition_tables(exp, "c", arms)
    d = table["contrasts"]["so_ppo - ppo"]["em_after"]
    assert d["n"] == 3 and d["mean"] == pytest.approx(0.4 / 3)
    assert table["contrasts"]["so_ppo - ppo"]["em_gain"]["mean"] == pytest.approx(0.4 / 3)  # before is equal
    del arms["so_ppo"][2]  # an unpaired seed drops out of the contrast
    assert tables.condition_tables(exp, "c", arms)["contrasts"]["so_ppo - ppo"]["em_after"]["mean"] == pytest.approx(
        0.15
    )
    rows = tables.headline_table(exp, [table]).splitlines()
    assert rows[0].startswith("| degree | metric | warm start | grpo | SO-PPO − PPO |")
    assert [r.split(" | ")[1] for r in rows[2:]] == ["em_after", "em_gain"]
    assert "+0.133" in rows[2] and "0.500 ± 0.000" in rows[2]
    assert rows[2].split(" | ")[2] == "0.100" and rows[3].split(" | ")[2] == ""  # the warm start once per condition
    no_warm = tables.headline_table({**exp, "headline": {**exp["headline"], "before": None}}, [table]).splitlines()
    assert no_warm[0].startswith("| degree | metric | grpo | SO-PPO − PPO |") and no_warm[1] == "|---|---|---|---|---|"
    assert no_warm[2].startswith("| c | em_after | 0.500 ± 0.000 | +0.133")
    # A single-arm pilot (no columns): the baseline's values, and as many headings as cells in every row.
    alone = tables.headline_table(
        {**exp, "headline": {"label": "candidate", "before": None, "columns": {}, "metrics": ["em_after"]}}, [table]
    ).splitlines()
    assert alone == ["| candidate | metric | grpo |", "|---|---|---|", "| c | em_after | 0.500 ± 0.000 |"]
    # without `contrasts` the table has no such key, so older committed tables stay byte-identical
    assert "contrasts" not in tables.condition_tables({**exp, "contrasts": []}, "c", arms)


def test_warm_start_groups_are_broken_down_by_the_warm_start_each_seed_started_from(tables):
    """With warmstart_groups [a, b], seeds 0 and 2 started from a, 1 and 3 from b: each group's mean, its
    difference to the baseline over its own seeds, and how many of its worlds ended above em_before (hand-computed)."""
    exp = {
        "name": "x",
        "baseline": "grpo",
        "arms": {"grpo": {}, "so_grpo": {}},
        "conditions": {"c": {}},
        "metrics": {"primary": "em_after", "diagnostics": ["em_before"]},
        "warmstart_groups": [8101, 8102],
    }
    ems = {"grpo": [0.0, 0.3, 0.2, 0.5], "so_grpo": [0.6, 0.3, 0.8, 0.9]}  # em_before is 0.1 on every world
    arms = {arm: {s: _summary(arm, s, em) for s, em in enumerate(v)} for arm, v in ems.items()}
    table = tables.condition_tables(exp, "c", arms)
    a, b = table["warmstart_groups"]["8101"], table["warmstart_groups"]["8102"]
    assert a["grpo"]["seeds"] == [0, 2] and b["grpo"]["seeds"] == [1, 3]
    assert a["so_grpo"]["em_after"]["mean"] == pytest.approx(0.7) and b["so_grpo"]["em_after"]["mean"] == 0.6
    assert a["so_grpo"]["paired"]["mean"] == pytest.approx(0.6) and b["so_grpo"]["paired"]["mean"] == 0.2
    assert (a["grpo"]["above_before"], b["grpo"]["above_before"]) == (1, 2)
    assert (a["so_grpo"]["above_before"], b["so_grpo"]["above_before"]) == (2, 2)
    assert "paired" not in a["grpo"]
    page = tables.render(exp, [table], {}, {"c": 8})
    assert "| 8101 | so_grpo | 2 | 0.700 ± " in page and "| 2 of 2 | +0.600 [" in page
    assert "warmstart_groups" not in tables.condition_tables({**exp, "warmstart_groups": None}, "c", arms)


def test_the_results_page_table_is_generated_between_its_markers(tables):
    page = tables.RESULTS_PAGE.read_text()
    assert page.count("<!-- tables:lab_stratified begin -->") == 1
    exp = tables.load_experiment("lab_stratified")
    texts, _ = tables.outputs(
        exp, tables.load_runs(exp, tables.RESULTS), tables.DOCS, tables.RESULTS_PAGE, figures=False
    )
    generated = texts[tables.RESULTS_PAGE]
    assert "| guessable | 0.110 | 0.112 ± 0.022 |" in generated and "**−0.467 [−0.490, −0.444]**" in generated
    assert "| 0.031-0.046 |" in generated  # the detectable range over every arm, SAN only included
    # A hand edit inside the markers is what --check catches: the generated page puts the table back.
    edited = page.replace("| multihop | 0.285 | 0.769 ± 0.010 |", "| multihop | 0.285 | 0.800 ± 0.010 |")
    assert edited != page
    assert tables.replace_marked(edited, "lab_stratified", tables.headline_table(exp, _tables(tables, exp))) == page


def _tables(tables, exp):
    runs = tables.load_runs(exp, tables.RESULTS)
    return [tables.condition_tables(exp, c, runs[c]) for c in exp["conditions"] if c in runs]


def test_replace_marked_needs_one_pair_of_markers(tables):
    text = "a\n<!-- tables:x begin -->\nold\n<!-- tables:x end -->\nb\n"
    assert tables.replace_marked(text, "x", "new\n") == "a\n<!-- tables:x begin -->\nnew\n<!-- tables:x end -->\nb\n"
    for broken in ("no markers", "<!-- tables:x end -->\n<!-- tables:x begin -->\n"):
        with pytest.raises(ValueError, match="tables:x begin"):
            tables.replace_marked(broken, "x", "new\n")


def test_tables_run_without_torch(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", NO_TORCH, "lab_stratified", "--check"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "lab_stratified: 3 files match the summaries" in result.stdout
