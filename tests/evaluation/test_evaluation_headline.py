"""The report's "Did it learn?" section and the demo's summary: per-question eval records, paired
gains with CIs, the verdict, the curves, and one question's transcript before and after RL.

Fake run directories are written with the trainer's own writers (MetricsLogger, save_eval,
eval_metrics, question_record), so they have exactly the files `stratarl train` writes.
"""

from __future__ import annotations

import argparse
import html
import json
import math
import re
from pathlib import Path

import pytest

from stratarl.data.examples import Example
from stratarl.evaluation.greedy import aggregate, eval_metrics, question_record, save_eval
from stratarl.evaluation.headline import eval_points, format_ci, format_headline, headline
from stratarl.evaluation.report import build_report, transcript_pair
from stratarl.evaluation.stats import excludes_zero, paired_gain, rolling_band
from stratarl.infra.metrics import MetricsLogger

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"

# 10 questions. before EM: 3 right; after EM: the same 3 plus 4 more (q1, q4, q7, q9).
BEFORE = [1, 0, 0, 1, 0, 0, 1, 0, 0, 0]
AFTER = [1, 1, 0, 1, 1, 0, 1, 1, 0, 1]


def _examples(n: int) -> list[Example]:
    return [
        Example(
            id=f"q{i}",
            question=f"Where was person {i} born?",
            golden_answers=(f"town{i}",),
            data_source="synthkb",
            metadata={"question_type": "single_hop" if i % 2 else "multi_hop_2"},
        )
        for i in range(n)
    ]


def _eval_result(examples: list[Example], em: list[int], searches: float, answers: list[str]) -> dict:
    """What stratarl.evaluation.greedy.evaluate returns for these per-question scores (F1 = EM here)."""
    scores = [{"em": float(e), "subem": float(e), "f1": float(e), "searches": searches, "answered": 1.0} for e in em]
    transcripts = [
        {
            "example_id": ex.id,
            "question": ex.question,
            "golds": list(ex.golden_answers),
            "turns": [
                {
                    "text": f"<search> {ex.question} </search>",
                    "action": "search",
                    "observation": f"<information>Doc 1: person born in {ans}</information>",
                },
                {"text": f"<answer> {ans} </answer>", "action": "answer"},
            ],
            "answer": ans,
            "reward": float(e),
            "num_searches": int(searches),
        }
        for ex, e, ans in zip(examples, em, answers)
    ][:3]
    return {
        "per_source": aggregate(scores, [ex.data_source for ex in examples]),
        "per_type": {},
        "per_question": [question_record(ex, s) for ex, s in zip(examples, scores)],
        "transcripts": transcripts,
        "seconds": 1.0,
        "num_examples": len(examples),
    }


def fake_run(
    path: Path,
    before: list[int] | None = BEFORE,
    after: list[int] | None = AFTER,
    *,
    steps: int = 6,
    eval_every: int = 3,
    mid: list[int] | None = None,
) -> Path:
    """A run directory as `stratarl train ... eval.before_after=true trainer.eval_every=3` writes it:
    eval rows in metrics.jsonl at step 0, 3 and 6 next to the training rows, eval/<tag>.json + transcripts."""
    examples = _examples(len(before if before is not None else after or []))
    logger = MetricsLogger(path, tensorboard=False)

    def run_eval(tag: str, step: int, em: list[int], searches: float) -> None:
        answers = [f"town{i}" if e else "nowhere" for i, e in enumerate(em)]
        result = _eval_result(examples, em, searches, answers)
        save_eval(result, path, tag)
        logger.log(step, {**eval_metrics(result), "time/eval": result["seconds"]})

    if before is not None:
        run_eval("before", 0, before, 1.0)
    for step in range(1, steps + 1):
        reward = 0.1 * step
        logger.log(
            step,
            {
                "reward/mean": reward,
                "reward/em": reward,
                "rollout/search_calls_mean": 1.0 + 0.1 * step,
                "stratum/0/reward_mean": reward / 2,
                "stratum/1/reward_mean": reward,
                "stratum/0/count": 4.0,
                "stratum/1/count": 12.0,
                "loss/policy": -reward,
            },
        )
        if eval_every and step % eval_every == 0 and step < steps and mid is not None:
            run_eval(f"step_{step:06d}", step, mid, 1.5)
    if after is not None:
        run_eval("after", steps, after, 2.0)
    logger.close()
    return path


# --------------------------------------------------------------------------- stats (hand-computed)


def test_paired_gain_hand_computed():
    # d = after - before = [0,1,0,0,1,0,0,1,0,1]: mean 0.4; s² = (4·0.6² + 6·0.4²)/9 = 2.4/9;
    # half width = t_{0.975,9} · s/√10 = 2.262 · 0.516398/3.162278 = 0.369383 -> [0.030617, 0.769383].
    before = {f"q{i}": float(v) for i, v in enumerate(BEFORE)}
    after = {f"q{i}": float(v) for i, v in enumerate(AFTER)}
    out = paired_gain(after, before)
    assert out["n"] == 10 and out["mean"] == pytest.approx(0.4)
    assert out["std"] == pytest.approx(math.sqrt(2.4 / 9))
    assert out["half_width"] == pytest.approx(2.262 * math.sqrt(2.4 / 9) / math.sqrt(10))
    assert out["low"] == pytest.approx(0.030617, abs=1e-6) and out["high"] == pytest.approx(0.769383, abs=1e-6)
    assert out["excludes_zero"] is True


def test_paired_gain_pairs_by_id_only_on_common_questions():
    # q9 only after, q8 only before: left out. d = [1 - 0, 0 - 1] -> mean 0, s = √2, half = 12.706·√2/√2.
    out = paired_gain({"q0": 1.0, "q1": 0.0, "q9": 1.0}, {"q1": 1.0, "q0": 0.0, "q8": 0.0})
    assert out["ids"] == ["q0", "q1"] and out["differences"] == [1.0, -1.0]
    assert out["mean"] == 0.0 and out["half_width"] == pytest.approx(12.706)
    assert out["excludes_zero"] is False
    assert paired_gain({"a": 1.0}, {"a": 0.0})["excludes_zero"] is None  # one question: no CI
    assert paired_gain({"a": 1.0}, {"b": 0.0})["mean"] is None


def test_excludes_zero():
    assert excludes_zero({"low": 0.01, "high": 0.2}) is True
    assert excludes_zero({"low": -0.3, "high": -0.1}) is True
    assert excludes_zero({"low": -0.01, "high": 0.2}) is False
    assert excludes_zero({"low": 0.0, "high": 0.0}) is False  # no change at all
    assert excludes_zero({"low": None, "high": None}) is None


def test_rolling_band_hand_computed():
    # window 2 over [1, 2, 4]: means 1, 1.5, 3; s = 0.7071 and 1.4142, se = s/√2 = 0.5 and 1.0.
    means, lows, highs = rolling_band([1.0, 2.0, 4.0], window=2)
    assert means == [1.0, 1.5, 3.0]
    assert lows[0] is None and highs[0] is None
    assert lows[1] == pytest.approx(1.5 - 1.959964 * 0.5) and highs[2] == pytest.approx(3.0 + 1.959964 * 1.0)
    # centered, window 3 over [1, 2, 4, 8]: [1,2] [1,2,4] [2,4,8] [4,8] -> means 1.5, 7/3, 14/3, 6.
    means, lows, _ = rolling_band([1.0, 2.0, 4.0, 8.0], window=3, centered=True)
    assert means == pytest.approx([1.5, 7 / 3, 14 / 3, 6.0])
    assert lows[3] == pytest.approx(6.0 - 1.959964 * math.sqrt(8.0) / math.sqrt(2))  # s([4, 8]) = √8
    with pytest.raises(ValueError):
        rolling_band([1.0], window=0)


# --------------------------------------------------------------------------- headline numbers


def test_headline_of_one_run(tmp_path):
    run = fake_run(tmp_path / "run", mid=[1, 1, 0, 1, 0, 0, 1, 0, 0, 0])
    h = headline([run])
    r = h["runs"][0]
    assert r["steps"] == 6 and r["num_questions"] == 10
    # Before: 3/10, s² = (3·0.7² + 7·0.3²)/9 = 2.1/9, half = 2.262·s/√10 = 0.345527 -> [-0.0455, 0.6455], cut at 0.
    assert r["before"]["em"]["mean"] == pytest.approx(0.3)
    assert r["before"]["em"]["low"] == 0.0 and r["before"]["em"]["high"] == pytest.approx(0.645527, abs=1e-6)
    assert r["after"]["em"]["mean"] == pytest.approx(0.7) and r["after"]["em"]["high"] == 1.0
    gain = r["gain"]["em"]
    assert gain["mean"] == pytest.approx(0.4) and gain["low"] == pytest.approx(0.030617, abs=1e-6)
    assert gain["excludes_zero"] is True and gain["up"] == 4 and gain["down"] == 0
    assert r["gain"]["searches"]["mean"] == pytest.approx(1.0)  # 1.0 -> 2.0 searches per question
    assert [(p["tag"], p["step"]) for p in r["evals"]] == [("before", 0), ("step_000003", 3), ("after", 6)]
    assert [p["em"]["mean"] for p in r["evals"]] == pytest.approx([0.3, 0.4, 0.7])
    assert h["verdict"] == (
        "RL improved held-out EM by +0.400 [+0.03, +0.77] on 10 questions after 6 RL steps (4 up, 0 down; "
        "paired 95% CI over questions): the 95% CI excludes 0"
    )
    assert h["across_runs"] is None


def test_verdict_inside_the_noise_and_no_change(tmp_path):
    # before 3/10, after: q0 lost, q1 gained -> d = [-1, 1, 0...]: mean 0, CI includes 0.
    noisy = fake_run(tmp_path / "noisy", BEFORE, [0, 1, 0, 1, 0, 0, 1, 0, 0, 0])
    assert headline([noisy])["verdict"].startswith("RL changed held-out EM by +0.000 [-0.")
    assert "inside the noise (the 95% CI includes 0)" in headline([noisy])["verdict"]
    same = fake_run(tmp_path / "same", BEFORE, BEFORE)
    assert headline([same])["verdict"] == "RL did not change held-out EM on any of the 10 questions (gain +0.000)"


def test_headline_across_seeds(tmp_path):
    # Per-seed gains 0.4, 0.2, 0.3: mean 0.3, s = 0.1, half = t_{0.975,2}·0.1/√3 = 4.303·0.057735 = 0.248434.
    runs = [
        fake_run(tmp_path / "s0", BEFORE, AFTER),
        fake_run(tmp_path / "s1", BEFORE, [1, 1, 0, 1, 1, 0, 1, 0, 0, 0]),
        fake_run(tmp_path / "s2", BEFORE, [1, 1, 0, 1, 1, 0, 1, 1, 0, 0]),
    ]
    h = headline(runs)
    across = h["across_runs"]
    assert across["n"] == 3 and across["gain"]["em"]["per_run"] == pytest.approx([0.4, 0.2, 0.3])
    assert across["gain"]["em"]["mean"] == pytest.approx(0.3)
    assert across["gain"]["em"]["half_width"] == pytest.approx(0.248434, abs=1e-6)
    assert across["gain"]["em"]["excludes_zero"] is True
    assert h["verdict"].startswith("RL improved held-out EM by +0.300 [+0.05, +0.55] over 3 runs of 6 RL steps")
    text = format_headline(h)
    assert "[s0] held-out EM (greedy, 10 questions, 6 RL steps)" in text
    assert (
        "mean over 3 runs: held-out EM before RL 0.300 [0.30, 0.30] -> after RL 0.600 [0.35, 0.85]; "
        "gain +0.300 [+0.05, +0.55] (95% t-interval over runs, excludes 0)"
    ) in text
    assert "held-out F1" not in text  # several runs: EM per run, the rest in the report


def test_format_headline_is_the_demo_summary(tmp_path):
    run = fake_run(tmp_path / "run", mid=[1, 1, 0, 1, 0, 0, 1, 0, 0, 0])
    text = format_headline(headline([run]))
    lines = text.splitlines()
    assert lines[0] == (
        "held-out EM (greedy, 10 questions, 6 RL steps): before RL 0.300 [0.00, 0.65] -> "
        "after RL 0.700 [0.35, 1.00]; gain +0.400 [+0.03, +0.77] (paired 95% CI, excludes 0; "
        "4 questions up, 0 down)"
    )
    assert "held-out EM over training: step 0 0.300, step 3 0.400, step 6 0.700" in lines
    assert "searches/question 1.00 -> 2.00; answer rate 1.00 -> 1.00" in lines
    assert lines[-1].startswith("verdict: RL improved held-out EM by +0.400")


def test_run_without_evals_says_what_is_missing(tmp_path):
    run = fake_run(tmp_path / "run", None, None)
    h = headline([run])
    assert h["runs"][0]["evals"] == [] and h["runs"][0]["gain"] is None
    assert h["verdict"].startswith("no verdict: no held-out eval in") and "eval.before_after=true" in h["verdict"]
    page = build_report([run]).read_text()
    assert "Did it learn?" in page and "no held-out eval in" in page and "6 RL steps" in page
    only_before = fake_run(tmp_path / "interrupted", BEFORE, None)
    assert "no eval after RL" in headline([only_before])["verdict"]


def test_old_eval_files_without_per_question_records(tmp_path):
    run = fake_run(tmp_path / "run")
    for path in (run / "eval").glob("*.json"):
        result = json.loads(path.read_text())
        del result["per_question"]
        path.write_text(json.dumps(result))
    r = headline([run])["runs"][0]
    assert r["before"]["em"]["mean"] == pytest.approx(0.3) and r["before"]["em"]["low"] is None
    assert r["gain"] is None and "no per-question records" in r["missing"]


def test_format_ci():
    assert format_ci({"mean": 0.235, "low": 0.18, "high": 0.29}) == "0.235 [0.18, 0.29]"
    assert format_ci({"mean": 0.22, "low": 0.16, "high": 0.28}, sign=True) == "+0.220 [+0.16, +0.28]"
    assert format_ci({"mean": 0.5, "low": None, "high": None}) == "0.500"
    assert format_ci(None) == "-"


# --------------------------------------------------------------------------- the HTML section


def _section(page: str) -> str:
    start = page.index('<h2 id="did-it-learn">')
    return page[start : page.index('<h2 id="eval">')]


def test_report_opens_with_did_it_learn(tmp_path):
    run = fake_run(tmp_path / "run", mid=[1, 1, 0, 1, 0, 0, 1, 0, 0, 0])
    out = build_report([run], tmp_path / "r" / "report.html")
    page = out.read_text()
    assert page.index("Did it learn?") < page.index('<h2 id="reward">')  # before the full grid, which stays
    section = _section(page)
    assert "RL improved held-out EM by +0.400 [+0.03, +0.77] on 10 questions after 6 RL steps" in section
    assert (
        "<td>held-out EM</td><td>0.300 [0.00, 0.65]</td><td>0.700 [0.35, 1.00]</td><td>+0.400 [+0.03, +0.77]</td><td>yes</td>"
        in section
    )
    assert "<td>searches / question</td><td>1.000 [1.00, 1.00]</td><td>2.000 [2.00, 2.00]</td>" in section
    assert "RL steps: 6." in section and "6 RL steps, 3 held-out evals" in page
    assert section.count("data:image/png;base64,") == 3  # learning, searches, strata
    assert {p.name for p in (tmp_path / "r").glob("did_it_learn*.png")} == {
        "did_it_learn.png",
        "did_it_learn_searches.png",
        "did_it_learn_strata.png",
    }
    # The same question before and after: q1 is the first transcript whose EM changed (0 -> 1).
    assert "Question <code>q1</code>" in section
    before_col, after_col = re.findall(r'<div class="col">(.*?)</div>', section)
    assert before_col.startswith("<h4>before RL: EM 0, 1 searches, answer &#x27;nowhere&#x27;</h4>")
    assert after_col.startswith("<h4>after RL: EM 1, 2 searches, answer &#x27;town1&#x27;</h4>")
    assert "person born in town1" in after_col


def test_report_header_counts_rl_steps_not_metric_rows(tmp_path):
    # 6 training rows + 3 eval rows (before, step 3, after) in metrics.jsonl: the header said "9 steps".
    run = fake_run(tmp_path / "run", mid=BEFORE)
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 9
    page = build_report([run]).read_text()
    assert "6 RL steps" in page and "9 steps" not in page


def test_report_of_several_seeds(tmp_path):
    runs = [fake_run(tmp_path / "s0", BEFORE, AFTER), fake_run(tmp_path / "s1", BEFORE, [1, 1, 0, 1, 1, 0, 1, 0, 0, 0])]
    section = _section(build_report(runs, tmp_path / "r.html").read_text())
    # Gains 0.4 and 0.2: mean 0.3, s = 0.1414, half = 12.706·0.1414/√2 = 1.2706.
    assert "<td>mean of 2 runs [95% CI over runs]</td><td></td><td></td><td>0.300 [0.30, 0.30]</td>" in section
    assert "+0.300 [-0.97, +1.57]</td><td>no</td>" in section
    assert "inside the noise" in section and "95% CI over runs" in section


# --------------------------------------------------------------------------- the real trainer and the demo


@pytest.mark.slow
def test_real_tiny_run_gets_a_headline(tmp_path, tiny_overrides):
    from stratarl.trainer.config import load_config
    from stratarl.trainer.rl import train

    cfg = load_config(TINY, [*tiny_overrides, "trainer.steps=2", "eval.before_after=true", "trainer.eval_every=1"])
    run = tmp_path / "run"
    train(cfg, run)
    before = json.loads((run / "eval" / "before.json").read_text())
    after = json.loads((run / "eval" / "after.json").read_text())
    ids = [r["example_id"] for r in before["per_question"]]
    assert len(ids) == 4 and ids == [r["example_id"] for r in after["per_question"]]
    assert set(before["per_question"][0]) >= {"example_id", "question_type", "em", "f1", "searches", "answered"}
    assert before["per_source"]["synthkb"]["count"] == 4  # the existing keys stay
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "eval/synthkb/em" in r] == [0, 1, 2]

    points = eval_points(run)
    assert [(p["tag"], p["step"], p["n"]) for p in points] == [("before", 0, 4), ("step_000001", 1, 4), ("after", 2, 4)]
    pair = transcript_pair(run)
    assert pair is not None and pair[0]["example_id"] == pair[1]["example_id"] == ids[0]

    h = headline([run])
    r = h["runs"][0]
    assert r["steps"] == 2 and r["gain"]["em"]["n"] == 4
    assert r["gain"]["em"]["mean"] == pytest.approx(r["after"]["em"]["mean"] - r["before"]["em"]["mean"])
    section = _section(build_report([run]).read_text())
    assert html.escape(h["verdict"]) in section
    assert f"Question <code>{ids[0]}</code>" in section
    assert "RL steps: 2." in section


@pytest.mark.slow
def test_demo_prints_the_headline(tmp_path, tiny_overrides, capsys):
    from stratarl.commands.demo import run_demo

    args = argparse.Namespace(
        config=str(TINY),
        run_dir=str(tmp_path / "demo"),
        overrides=[*tiny_overrides, "trainer.steps=2", "eval.before_after=true", "trainer.eval_every=1"],
    )
    assert run_demo(args) == 0
    out = capsys.readouterr().out
    summary = out[out.index("=== stratarl demo ===") :]
    assert re.search(
        r"held-out EM \(greedy, 4 questions, 2 RL steps\): before RL \d\.\d{3}( \[\d\.\d\d, \d\.\d\d\])? -> "
        r"after RL \d\.\d{3}",
        summary,
    )
    assert re.search(r"held-out EM over training: step 0 \d\.\d{3}, step 1 \d\.\d{3}, step 2 \d\.\d{3}", summary)
    assert "verdict: " in summary and f"report: {tmp_path / 'demo' / 'report' / 'report.html'}" in summary
