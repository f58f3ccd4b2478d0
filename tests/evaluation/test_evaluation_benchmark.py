"""A benchmark gain: two evaluations paired by question id (hand-derived means and CIs), the transcripts gained and
lost read from the eval run folders, the one-line refusals, and the report page that shows the numbers."""

from __future__ import annotations

import json
import math

import pytest

from stratarl.config_errors import ConfigError
from stratarl.evaluation.benchmark import benchmark_gain, gain_markdown, load_summary, question_records
from stratarl.evaluation.benchmark_report import benchmark_page, write_benchmark_report

IDS = ("phantomwiki-7-0", "phantomwiki-7-1", "phantomwiki-7-2")


def _row(i, difficulty, em, f1, searches):
    return {
        "example_id": i,
        "data_source": "phantomwiki",
        "question_type": f"difficulty_{difficulty}",
        "em": em,
        "subem": em,
        "f1": f1,
        "searches": searches,
        "answered": 1.0,
        "universe": 7,
    }


def _summary(label, rows, out_root=None, setting="search"):
    """A phantomwiki_baselines.py result of one setting (its summary blocks are not read by the gain)."""
    commands = (
        [] if out_root is None else [["python", "-m", "stratarl.cli", "eval", "--out", f"{out_root}/u7/{setting}"]]
    )
    return {
        "target": "configs/smollm2.yaml",
        "label": label,
        "universes": [{"universe": "phantomwiki-7"}],
        "settings": {setting: {"per_question": rows}},
        "commands": commands,
    }


# before: F1 (0, 0.5, 1), EM (0, 0, 1); after: F1 (1, 0.5, 0.5), EM (1, 0, 0), listed in the REVERSE order, so
# pairing by position would pair q0 with q2: F1 differences (0.5, 0, 0), one up, none down.
BEFORE_ROWS = [_row(IDS[0], 1, 0.0, 0.0, 1.0), _row(IDS[1], 1, 0.0, 0.5, 1.0), _row(IDS[2], 2, 1.0, 1.0, 1.0)]
AFTER_ROWS = [_row(IDS[2], 2, 0.0, 0.5, 1.0), _row(IDS[1], 1, 0.0, 0.5, 1.0), _row(IDS[0], 1, 1.0, 1.0, 2.0)]


def _write(path, summary):
    path.write_text(json.dumps(summary))
    return path


@pytest.fixture
def files(tmp_path):
    before = _write(tmp_path / "warm.json", _summary("warm start", BEFORE_ROWS, tmp_path / "warm"))
    after = _write(tmp_path / "rl.json", _summary("after RL", AFTER_ROWS, tmp_path / "rl"))
    for root, answers in (("warm", ("nobody", "x", "Ada")), ("rl", ("Ada", "x", "nobody"))):
        folder = tmp_path / root / "u7" / "search" / "eval"
        folder.mkdir(parents=True)
        lines = [
            json.dumps(
                {
                    "example_id": i,
                    "question": f"Who is {i}?",
                    "golds": ["Ada"],
                    "answer": a,
                    "num_searches": 1,
                    "turns": [{"text": f"<answer> {a} </answer>", "observation": ""}],
                }
            )
            for i, a in zip(IDS, answers)
        ]
        (folder / "eval_transcripts.jsonl").write_text("\n".join(lines) + "\n{torn")
    return before, after


def _gain(before, after):
    return benchmark_gain(
        load_summary(before), load_summary(after), setting="search", before_path=before, after_path=after
    )


def test_the_gain_pairs_by_question_id_with_the_paired_t_interval(files):
    gain = _gain(*files)
    f1, em = gain["all"]["f1"], gain["all"]["em"]
    # F1 differences by id: q0 +1, q1 0, q2 -0.5. mean 1/6; s² = ((5/6)² + (1/6)² + (2/3)²)/2 = 7/12;
    # half width t_{0.975,2} · s/√3 = 4.303 · √(7/12)/√3 = 1.8974
    assert f1["gain"]["mean"] == pytest.approx(1 / 6)
    assert f1["gain"]["half_width"] == pytest.approx(4.303 * math.sqrt(7 / 12) / math.sqrt(3))
    assert (f1["up"], f1["down"]) == (1, 1)  # by position it would be (1, 0)
    assert f1["gain"]["excludes_zero"] is False
    # EM differences: +1, 0, -1: mean 0, s = 1, half width 4.303/√3
    assert em["gain"]["mean"] == pytest.approx(0.0)
    assert em["gain"]["half_width"] == pytest.approx(4.303 / math.sqrt(3))
    assert f1["before"]["mean"] == pytest.approx(0.5) and f1["after"]["mean"] == pytest.approx(2 / 3)
    assert f1["before"]["low"] == 0.0  # cut to [0, 1]: 0.5 - 4.303 * 0.5 / √3 < 0


def test_per_difficulty_and_per_searches_of_the_later_model(files):
    gain = _gain(*files)
    d1, d2 = gain["per_group"]["1"], gain["per_group"]["2"]
    # difficulty 1: q0, q1 with F1 differences (+1, 0): mean 0.5, s = √0.5, half width 12.706 · √0.5 / √2 = 6.353
    assert d1["n"] == 2 and d1["f1"]["gain"]["mean"] == pytest.approx(0.5)
    assert d1["f1"]["gain"]["half_width"] == pytest.approx(12.706 * 0.5)
    assert d2["n"] == 1 and d2["f1"]["gain"]["mean"] == pytest.approx(-0.5) and d2["f1"]["gain"]["low"] is None
    # the later model searched twice on q0, once on q1 and q2 (the earlier one once on all)
    assert set(gain["per_searches"]) == {"1", "2"}
    assert gain["per_searches"]["2"]["f1"]["gain"]["mean"] == pytest.approx(1.0)
    assert gain["per_searches"]["1"]["f1"]["gain"]["mean"] == pytest.approx(-0.25)


def test_the_transcripts_gained_and_lost_come_from_the_run_folders(files):
    shown = _gain(*files)["transcripts"]
    assert shown["gained"]["id"] == IDS[0] and shown["lost"]["id"] == IDS[2]
    assert shown["gained"]["before"]["answer"] == "nobody" and shown["gained"]["after"]["answer"] == "Ada"
    assert shown["lost"]["before"]["answer"] == "Ada" and shown["lost"]["after"]["answer"] == "nobody"
    assert (shown["lost"]["f1_before"], shown["lost"]["f1_after"]) == (1.0, 0.5)


def test_transcripts_are_found_beside_the_json_when_the_run_folder_moved(files, tmp_path):
    before, after = files
    moved = tmp_path / "rl"
    moved.rename(tmp_path / "elsewhere")
    (tmp_path / "elsewhere").rename(after.with_suffix(""))  # rl.json's own folder is rl/: the same path here
    summary = json.loads(after.read_text())
    summary["commands"] = [["stratarl", "eval", "--out", "gone/u7/search"]]
    _write(after, summary)
    assert _gain(before, after)["transcripts"]["gained"]["after"]["answer"] == "Ada"


def test_ties_go_to_the_smallest_id(tmp_path):
    before = _write(tmp_path / "a.json", _summary("a", [_row("q-b", 1, 0, 0, 1), _row("q-a", 1, 0, 0, 1)]))
    after = _write(tmp_path / "b.json", _summary("b", [_row("q-a", 1, 1, 1, 1), _row("q-b", 1, 1, 1, 1)]))
    shown = _gain(before, after)["transcripts"]
    assert shown["gained"]["id"] == "q-a" and shown["gained"]["after"] is None and shown["lost"] is None


def test_files_over_other_questions_are_refused_in_one_line(files, tmp_path):
    before, _ = files
    other = _write(tmp_path / "other.json", _summary("x", [*AFTER_ROWS[1:], _row("phantomwiki-8-0", 1, 0, 0, 1)]))
    with pytest.raises(ConfigError, match="do not cover the same questions: 1 only in the first") as error:
        _gain(before, other)
    assert "\n" not in str(error.value) and "phantomwiki-7-2" in str(error.value)


def test_bad_files_and_settings_are_refused_in_one_line(files, tmp_path):
    _, after = files
    with pytest.raises(ConfigError, match="no setting 'rag'"):
        question_records(load_summary(after), "rag", after)
    with pytest.raises(ConfigError, match="not a benchmark result"):
        load_summary(_write(tmp_path / "x.json", {"steps": 3}))
    with pytest.raises(ConfigError, match="no such file"):
        load_summary(tmp_path / "missing.json")
    twice = _write(tmp_path / "twice.json", _summary("t", [BEFORE_ROWS[0], BEFORE_ROWS[0]]))
    with pytest.raises(ConfigError, match="twice"):
        question_records(load_summary(twice), "search", twice)


def test_the_slice_groups_by_source(tmp_path):
    def slice_summary(label, scores):
        return {
            "label": label,
            "slice": {},
            "settings": {"search": {"command": "stratarl eval x", "per_question": scores}},
        }

    before = _write(
        tmp_path / "a.json", slice_summary("a", {"fanoutqa-1": [0, 0], "freshqa-1": [1, 1], "fanoutqa-2": [0, 0.5]})
    )
    after = _write(
        tmp_path / "b.json", slice_summary("b", {"fanoutqa-2": [1, 1], "fanoutqa-1": [0, 0], "freshqa-1": [1, 1]})
    )
    gain = _gain(before, after)
    assert gain["group_by"] == "source" and gain["per_searches"] == {}
    assert set(gain["per_group"]) == {"fanoutqa", "freshqa"}
    assert gain["per_group"]["fanoutqa"]["f1"]["gain"]["mean"] == pytest.approx(0.25)  # (0 + 0.5) / 2
    assert gain["per_group"]["freshqa"]["f1"]["up"] == 0


def test_the_page_and_the_markdown_show_the_numbers(files, tmp_path):
    before, after = files
    gain = _gain(before, after)
    markdown = gain_markdown(gain)
    assert "| all | 3 | 0.500 [0.00, 1.00] | 0.667 [0.00, 1.00] | +0.167 [-1.73, +2.06] | 1 / 1 |" in markdown
    assert "| difficulty 1 | 2 |" in markdown and "| 2 searches (after) | 1 |" in markdown
    page = write_benchmark_report(after, before, tmp_path / "page.html").read_text()
    assert "Did it learn?" in page and "after RL vs warm start (search): F1 +0.167 [-1.73, +2.06]" in page
    assert "1 up, 1 down" in page and "<td>+0.500 [-5.85, +6.85]</td>" in page  # difficulty 1: 0.5 ± 6.353
    assert "&lt;answer&gt; Ada &lt;/answer&gt;" in page and "phantomwiki-7-2" in page
    # the saved gain renders the same opening
    gain_json = _write(tmp_path / "gain.json", gain)
    assert gain["verdict"] in benchmark_page(gain_json)[0]


def test_one_result_file_compares_searching_with_closed_book(tmp_path):
    summary = _summary("warm start", AFTER_ROWS)
    summary["settings"]["closed_book"] = {"per_question": BEFORE_ROWS}
    summary["settings"]["search"].update(
        all={
            "n": 3,
            "em": {"mean": 1 / 3, "low": -0.1, "high": 0.9},
            "f1": {"mean": 2 / 3, "low": 0.1, "high": 1.2},
            "searches_mean": 1.33,
            "answer_rate": 1.0,
        },
        per_difficulty={},
    )
    summary["settings"]["closed_book"].update(
        all={"n": 3, "em": {"mean": 1 / 3, "low": None}, "f1": {"mean": 0.5, "low": None}}, per_difficulty={}
    )
    page, gain = benchmark_page(_write(tmp_path / "w.json", summary))
    assert "Does searching help?" in page and gain["setting"] == "closed_book -> search"
    assert "warm start (closed_book -&gt; search): F1 +0.167" in page
    assert "<td>0.667 [0.10, 1.00]</td>" in page  # the setting's own F1, its CI cut to [0, 1]


def test_the_committed_slice_result_gives_the_gain_its_script_printed():
    """docs/results/wikislice_smollm2_warm40.json: wikislice_eval.py printed search - closed-book F1 +0.054
    [-0.021, +0.129] and EM +0.031 on 98 questions (docs/benchmarks.md); the page pairs the same questions."""
    from pathlib import Path

    result = Path(__file__).resolve().parents[2] / "docs" / "results" / "wikislice_smollm2_warm40.json"
    page, gain = benchmark_page(result)
    assert gain["all"]["n"] == 98 and gain["group_by"] == "source"
    assert gain["all"]["f1"]["gain"]["low"] == pytest.approx(-0.021, abs=5e-4)
    assert gain["all"]["em"]["gain"]["mean"] == pytest.approx(0.031, abs=5e-4)
    assert "(closed_book -&gt; search): F1 +0.054 [-0.02, +0.13] on 98 questions" in page
    assert "<td>search</td><td>source all</td><td>98</td><td>0.082 [0.03, 0.14]</td><td>0.119 [0.06, 0.18]</td>" in page


def test_the_committed_phantomwiki_em_run_gives_the_gain_the_docs_report():
    """docs/results/phantomwiki_easy_smollm2_rl_em.json against the warm start's baselines: searching F1 +0.142
    [+0.08, +0.20] on 160 questions, 29 up and 5 down, d2 +0.155 (docs/benchmarks.md, README), paired by id."""
    from pathlib import Path

    results = Path(__file__).resolve().parents[2] / "docs" / "results"
    page, gain = benchmark_page(
        results / "phantomwiki_easy_smollm2_rl_em.json", results / "phantomwiki_easy_smollm2_warmstart_baselines.json"
    )
    assert gain["all"]["n"] == 160
    assert gain["all"]["f1"]["gain"]["mean"] == pytest.approx(0.142, abs=5e-4)
    assert gain["all"]["f1"]["gain"]["low"] == pytest.approx(0.08, abs=5e-3)
    assert (gain["all"]["f1"]["up"], gain["all"]["f1"]["down"]) == (29, 5)
    assert gain["per_group"]["2"]["f1"]["gain"]["mean"] == pytest.approx(0.155, abs=5e-4)
    assert "F1 +0.142 [+0.08, +0.20] on 160 questions" in page
