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
NO_TORCH = f'''
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
'''


@pytest.fixture(scope="module")
def tables(load_script):
    sys.path.insert(0, str(TABLES.parent))  # tables.py imports the runner as `run`
    try:
        yield load_script(TABLES, "evidence_tables_check")
    finally:
        sys.path.remove(str(TABLES.parent))


@pytest.mark.parametrize("experiment", ["lab_stratified", "lab_sorl"])
def test_committed_tables_equal_what_the_committed_summaries_give(tables, experiment, capsys):
    assert tables.main([experiment, "--check"]) == 0, capsys.readouterr().out


def test_the_results_page_table_is_generated_between_its_markers(tables):
    page = tables.RESULTS_PAGE.read_text()
    assert page.count("<!-- tables:lab_stratified begin -->") == 1
    exp = tables.load_experiment("lab_stratified")
    texts, _ = tables.outputs(exp, tables.load_runs(exp, tables.RESULTS), tables.DOCS, tables.RESULTS_PAGE, figures=False)
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
    result = subprocess.run([sys.executable, "-c", NO_TORCH, "lab_stratified", "--check"], capture_output=True,
                            text=True, timeout=120, cwd=tmp_path, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "lab_stratified: 3 files match the summaries" in result.stdout
