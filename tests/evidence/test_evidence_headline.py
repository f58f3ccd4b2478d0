"""benchmarks/evidence/headline.py: the README's evidence table quotes each headline row as the committed summaries
give it, and the pilot records that replaced a check say which."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks" / "evidence"))

import headline  # noqa: E402  (benchmarks/evidence/headline.py)


def _ci(row: dict) -> str:
    return f"{row['mean']:+.3f} [{row['low']:+.3f}, {row['high']:+.3f}]"


def test_every_headline_row_is_quoted_in_the_readme_as_the_summaries_give_it():
    rows = headline.rows()
    labels = {row["label"] for row in rows}
    # The rows whose summaries are committed are there (a row is skipped only while its arms have not run).
    assert "B-2 stale weights: SO-GRPO − GRPO" in labels and "A shortcut: GiGPO − GRPO" in labels
    so_grpo = next(row for row in rows if row["label"] == "B-2 stale weights: SO-GRPO − GRPO")
    assert so_grpo["n"] == 8 and _ci(so_grpo) == "+0.599 [+0.417, +0.782]"
    readme = (REPO / "README.md").read_text().replace("−", "-")
    missing = [f"{row['label']}: {_ci(row)}" for row in rows if _ci(row) not in readme]
    assert not missing, f"README.md does not quote these rows as the summaries give them: {missing}"


def test_pilot_records_that_replaced_a_check_say_which():
    for name in ("lab_offpolicy_lag", "lab_sorl_clip", "lab_search_pays"):
        record = json.loads((REPO / "benchmarks" / "evidence" / "pilots" / f"{name}.json").read_text())
        earlier = {k.split("/")[-1] for e in record["earlier"] for k, v in e["checks"].items() if not v["passed"]}
        now = {k.split("/")[-1] for k in record["checks"]}
        dropped = earlier - now
        lines = record["replaced_checks"]
        assert dropped and all(isinstance(line, str) and "\n" not in line for line in lines)
        for check in dropped:  # every failing check that is gone from the admitted design is named
            assert any(line.startswith(check) or f" {check} " in line for line in lines), (name, check)
