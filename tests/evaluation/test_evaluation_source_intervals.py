"""`source_intervals`: per-source means of an eval's per-question scores with 95% t-intervals cut to [0, 1]."""

from __future__ import annotations

import pytest

from stratarl.evaluation.greedy import source_intervals


def _record(source: str, em: float, f1: float) -> dict:
    return {"example_id": f"{source}-{em}-{f1}", "data_source": source, "em": em, "f1": f1}


def test_source_intervals_hand_derived():
    result = {
        "per_question": [
            _record("fanoutqa", 1.0, 0.4),
            _record("fanoutqa", 0.0, 0.6),
            _record("fanoutqa", 0.0, 0.5),
            _record("fanoutqa", 0.0, 0.5),
            _record("freshqa", 1.0, 1.0),
        ]
    }
    out = source_intervals(result)
    assert set(out) == {"fanoutqa", "freshqa", "all"}
    # F1 0.4, 0.6, 0.5, 0.5: mean 0.5, s = sqrt(0.02 / 3) = 0.0816497, t(0.975, 3) = 3.182 (the table of stats),
    # half-width = 3.182 * 0.0816497 / 2 = 0.129905
    f1 = out["fanoutqa"]["f1"]
    assert f1["mean"] == pytest.approx(0.5) and f1["half_width"] == pytest.approx(0.129905, abs=1e-6)
    assert (f1["low"], f1["high"]) == pytest.approx((0.370095, 0.629905), abs=1e-6)
    # EM 1, 0, 0, 0: mean 0.25, s = 0.5, half-width 3.182 * 0.5 / 2 = 0.7955: cut to [0, 1]
    em = out["fanoutqa"]["em"]
    assert em["mean"] == pytest.approx(0.25) and (em["low"], em["high"]) == (0.0, 1.0)
    assert out["freshqa"]["em"]["mean"] == 1.0 and out["freshqa"]["em"]["low"] is None  # one question: no interval
    assert out["all"]["em"]["n"] == 5 and out["all"]["em"]["mean"] == pytest.approx(0.4)


def test_one_source_has_no_all_group():
    assert set(source_intervals({"per_question": [_record("nq", 1.0, 1.0), _record("nq", 0.0, 0.0)]})) == {"nq"}
