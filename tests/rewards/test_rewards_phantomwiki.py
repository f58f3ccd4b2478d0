"""PhantomWiki's set scoring: hand-derived cases, PhantomWiki's own scorer as the reference, invariances, edges."""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path

import pytest

from stratarl.rewards import answer_match, answer_scores, em_reward, f1_reward, reward_for_source, subem_reward
from stratarl.rewards.phantomwiki import (
    normalize_pred,
    phantomwiki_em_reward,
    phantomwiki_f1_reward,
    set_covers,
    set_exact_match,
    set_f1,
    set_precision_recall,
)

REPO = Path(__file__).resolve().parents[2]
PHANTOM_PYTHON = REPO / ".venv-phantom" / "bin" / "python"


class TestHandDerived:
    def test_same_set_in_another_order_and_case_is_exact(self):
        # {"eli smock", "gene smock"} == {"gene smock", "eli smock"}
        assert set_exact_match("eli smock,  Gene Smock", ["Gene Smock", "Eli Smock"]) == 1.0
        assert set_f1("eli smock,  Gene Smock", ["Gene Smock", "Eli Smock"]) == 1.0

    def test_half_the_golds(self):
        # P = 1/1, R = 1/2 -> F1 = 2 * 1 * 0.5 / 1.5 = 2/3; not exact
        assert set_precision_recall("Eli Smock", ["Eli Smock", "Gene Smock"]) == (1.0, 0.5)
        assert set_f1("Eli Smock", ["Eli Smock", "Gene Smock"]) == pytest.approx(2 / 3)
        assert set_exact_match("Eli Smock", ["Eli Smock", "Gene Smock"]) == 0.0
        assert set_covers("Eli Smock", ["Eli Smock", "Gene Smock"]) == 0.0

    def test_one_right_one_wrong(self):
        # P = 1/2, R = 1/2 -> F1 = 1/2; every gold named only when the wrong one is added to both
        assert set_f1("Eli Smock, Bob Ray", ["Eli Smock", "Gene Smock"]) == pytest.approx(0.5)
        assert set_covers("Eli Smock, Gene Smock, Bob Ray", ["Eli Smock", "Gene Smock"]) == 1.0
        assert set_f1("Eli Smock, Gene Smock, Bob Ray", ["Eli Smock", "Gene Smock"]) == pytest.approx(0.8)

    def test_punctuation_and_articles_are_kept(self):
        # unlike Search-R1's normalize_answer: "Eli Smock." != "Eli Smock", "the 5" != "5"
        assert set_exact_match("Eli Smock.", ["Eli Smock"]) == 0.0
        assert set_exact_match("the 5", ["5"]) == 0.0

    def test_duplicates_collapse(self):
        assert normalize_pred("a, A ,a") == {"a"}
        assert set_exact_match("a, a, b", ["b", "a"]) == 1.0

    def test_a_gold_with_the_separator_is_split_as_phantom_eval_splits_it(self):
        # the gold string is ",".join(golds), so "Paris, France" is the set {"paris", "france"}
        assert set_exact_match("France, Paris", ["Paris, France"]) == 1.0

    def test_empty_prediction_is_the_empty_string_set(self):
        assert normalize_pred("") == {""}
        assert set_precision_recall("", ["a"]) == (0.0, 0.0)
        assert set_f1("", ["a"]) == 0.0

    def test_rewards_read_the_last_answer_tag(self):
        response = "<answer> Bob </answer> ... <answer> Gene Smock, Eli Smock </answer>"
        assert phantomwiki_em_reward(response, ["Eli Smock", "Gene Smock"]) == 1.0
        assert phantomwiki_f1_reward("no answer at all", ["Eli Smock"]) == 0.0


class TestInvariances:
    def test_order_of_golds_and_of_predicted_answers_does_not_matter(self):
        rng = random.Random(0)
        names = [f"Name{i} Family" for i in range(8)]
        for _ in range(50):
            golds = rng.sample(names, rng.randint(1, 5))
            predicted = rng.sample(names, rng.randint(1, 5))
            shuffled_golds = rng.sample(golds, len(golds))
            shuffled_predicted = rng.sample(predicted, len(predicted))
            assert set_f1(", ".join(predicted), golds) == set_f1(", ".join(shuffled_predicted), shuffled_golds)

    def test_f1_is_symmetric_in_prediction_and_gold_sets(self):
        assert set_f1("a, b, c", ["a", "d"]) == pytest.approx(set_f1("a, d", ["a", "b", "c"]))


def _random_cases(n: int, seed: int) -> list[tuple[str, list[str]]]:
    rng = random.Random(seed)
    words = ["Eli Smock", "gene smock", "GENE SMOCK", "5", "0", "trainspotting", "Eli Smock.", " x ", ""]
    cases = []
    for _ in range(n):
        golds = [w for w in rng.sample(words[:-1], rng.randint(1, 4)) if w.strip()] or ["5"]
        predicted = rng.sample(words, rng.randint(0, 4))
        cases.append((rng.choice([", ", ",", " ,"]).join(predicted), golds))
    return cases


# PhantomWiki's own scorer, run in the generator's environment: score.py as published, with the published
# normalize_pred taken from utils.py (importing phantom_eval itself pulls in its LLM agents and their clients).
_REFERENCE = r"""
import ast, importlib, json, os, sys, sysconfig, types
root = os.path.join(sysconfig.get_paths()["purelib"], "phantom_eval")
package = types.ModuleType("phantom_eval"); package.__path__ = [root]; sys.modules["phantom_eval"] = package
tree = ast.parse(open(os.path.join(root, "utils.py")).read())
function = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "normalize_pred")
utils = types.ModuleType("phantom_eval.utils"); sys.modules["phantom_eval.utils"] = utils
exec(compile(ast.Module(body=[function], type_ignores=[]), "utils.py", "exec"), utils.__dict__)
score = importlib.import_module("phantom_eval.score")
rows = []
for prediction, golds in json.load(sys.stdin):
    true = ",".join(golds)
    rows.append([float(score.exact_match(prediction, true)), score.precision(prediction, true),
                 score.recall(prediction, true), float(score.f1(prediction, true))])
print(json.dumps(rows))
"""


@pytest.mark.skipif(not PHANTOM_PYTHON.exists(), reason="needs .venv-phantom (make phantomwiki; make test builds it)")
def test_matches_phantomwikis_own_scorer():
    cases = [*_random_cases(300, seed=1), ("Eli Smock, Gene Smock", ["Gene Smock", "Eli Smock"]), ("", ["a"])]
    done = subprocess.run(
        [str(PHANTOM_PYTHON), "-c", _REFERENCE], input=json.dumps(cases), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    reference = json.loads(done.stdout)
    ours = [[set_exact_match(p, g), *set_precision_recall(p, g), set_f1(p, g)] for p, g in cases]
    assert len({tuple(r) for r in reference}) > 5  # the cases exercise several outcomes
    for case, mine, theirs in zip(cases, ours, reference):
        assert mine == pytest.approx(theirs), case


class TestBySource:
    def test_builtin_rewards_become_set_rewards_for_phantomwiki_and_stay_for_others(self):
        response = "<answer> Gene Smock, Eli Smock </answer>"
        golds = ["Eli Smock", "Gene Smock"]
        # Search-R1's EM compares the whole normalised string with each gold: 0 here; the set EM: 1
        assert em_reward(response, golds) == 0.0
        assert reward_for_source("phantomwiki", em_reward)(response, golds) == 1.0
        assert reward_for_source("phantomwiki", f1_reward)("<answer> Eli Smock </answer>", golds) == pytest.approx(
            2 / 3
        )
        assert reward_for_source("phantomwiki", subem_reward)(response, golds) == 1.0
        assert reward_for_source("nq", em_reward) is em_reward

    def test_a_users_own_reward_is_kept(self):
        def own(response_text, golds):
            return 0.25

        assert reward_for_source("phantomwiki", own) is own

    def test_answer_scores_and_answer_match(self):
        golds = ["Eli Smock", "Gene Smock"]
        assert answer_scores("phantomwiki", "Gene Smock, Eli Smock", golds) == {"em": 1.0, "subem": 1.0, "f1": 1.0}
        assert answer_scores("phantomwiki", "Eli Smock", golds)["f1"] == pytest.approx(2 / 3)
        assert answer_scores("phantomwiki", None, golds) == {"em": 0.0, "subem": 0.0, "f1": 0.0}
        assert answer_match("phantomwiki", "gene smock, eli smock", golds) == 1.0
        # other sources keep Search-R1's scoring: "Eli Smock" matches one gold exactly
        assert answer_scores("nq", "Eli Smock", golds) == {"em": 1.0, "subem": 1.0, "f1": 1.0}
