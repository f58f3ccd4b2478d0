"""The synthetic knowledge base: determinism, answerability, retrievability, files."""

from __future__ import annotations

import importlib.util
import itertools
import random
from collections import Counter

import pytest

from stratarl.data.retrievability import format_recall_table, hop_recall
from stratarl.data.search_r1 import load_examples
from stratarl.data.synth import FAMILIES, OCCUPATIONS, generate_knowledge_base, write_synthetic_kb
from stratarl.data.synth.names import _RESERVED, _unique_words
from stratarl.retrieval.base import Passage
from stratarl.rewards import normalize_answer

HAS_BM25 = importlib.util.find_spec("bm25s") is not None


@pytest.fixture(scope="module")
def kb():
    return generate_knowledge_base(seed=0, size="small")


def test_same_seed_same_world_other_seed_other_world(kb):
    again = generate_knowledge_base(seed=0, size="small")
    assert again.passages == kb.passages
    assert [(e.id, e.question, e.golden_answers, e.metadata) for e in again.train + again.test] == [
        (e.id, e.question, e.golden_answers, e.metadata) for e in kb.train + kb.test
    ]
    other = generate_knowledge_base(seed=1, size="small")
    assert [p.contents for p in other.passages] != [p.contents for p in kb.passages]


def test_sizes_and_counts(kb):
    assert len(kb.passages) == 500 and kb.stats["passages"] == 500
    assert [p.id for p in kb.passages] == [str(i) for i in range(500)]
    assert len({p.title for p in kb.passages}) == 500  # unique titles
    assert kb.stats["distractor_passages"] > 0
    assert (len(kb.train), len(kb.test)) == (100, 50)
    assert len(generate_knowledge_base(seed=0, size=2000, num_train=10, num_test=5).passages) == 2000


def test_generated_names_are_unique_and_never_reserved_words():
    words = _unique_words(random.Random(0), 20_000)
    assert len(set(words)) == 20_000
    assert all(w.isalpha() and w[0].isupper() and w.lower() not in _RESERVED for w in words)


def test_every_hop_is_answered_by_its_passage(kb):
    by_id = {p.id: p for p in kb.passages}
    for example in kb.train + kb.test:
        hops = example.metadata["hops"]
        expected_hops = {"single_hop": 1, "multi_hop_2": 2, "multi_hop_3": 3}[example.metadata["question_type"]]
        assert len(hops) == expected_hops == len(FAMILIES[example.metadata["family"]].relations)
        for hop in hops:
            assert normalize_answer(hop["answer"]) in normalize_answer(by_id[hop["passage_id"]].contents)
        for previous, following in itertools.pairwise(hops):  # the chain: each hop searches the last answer
            assert previous["answer"] in following["query"]
            assert previous["answer"] == by_id[following["passage_id"]].title
        assert example.golden_answers == (hops[-1]["answer"],)


def test_questions_are_unique_and_splits_disjoint(kb):
    train, test = {e.question for e in kb.train}, {e.question for e in kb.test}
    assert len(train) == len(kb.train) and len(test) == len(kb.test)
    assert not train & test
    assert all(e.metadata["split"] == "train" for e in kb.train)
    assert len({e.id for e in kb.train + kb.test}) == 150


def test_all_question_types_present(kb):
    types = {e.metadata["question_type"] for e in kb.train}
    assert types == {"single_hop", "multi_hop_2", "multi_hop_3"}


def test_guessable_families_have_small_answer_sets():
    only = generate_knowledge_base(seed=0, size="small", guessable="only", num_countries=4)
    none = generate_knowledge_base(seed=0, size="small", guessable="none")
    assert all(e.metadata["guessable"] for e in only.train) and not any(e.metadata["guessable"] for e in none.train)
    answers = {e.golden_answers[0] for e in only.train + only.test}
    countries = {p.title for p in only.passages if " is a country." in p.contents}
    assert len(countries) == 4
    assert answers <= countries | set(OCCUPATIONS)
    assert {e.metadata["answer_set_size"] for e in only.train} <= {4, len(OCCUPATIONS)}
    # Unguessable: the best constant guess (the most common answer) is right <= 10% of the time.
    assert Counter(e.golden_answers[0] for e in none.train).most_common(1)[0][1] <= 0.1 * len(none.train)


def test_hop_mix_selects_question_types():
    kb = generate_knowledge_base(seed=0, size="small", hop_mix=(0, 0, 1))
    assert {e.metadata["question_type"] for e in kb.train + kb.test} == {"multi_hop_3"}


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"size": "huge"}, "unknown size 'huge'"),
        ({"size": 10}, "at least 50"),
        ({"guessable": "maybe"}, "guessable must be"),
        ({"hop_mix": (1, 1)}, "hop_mix must be 3"),
        ({"num_countries": 1}, "num_countries must be >= 2"),
        ({"num_train": 10_000}, "supports about"),
        ({"num_orgs": 3}, "num_orgs=3 is too small"),
    ],
)
def test_bad_arguments_are_explained(kwargs, match):
    with pytest.raises(ValueError, match=match):
        generate_knowledge_base(seed=0, **kwargs)


@pytest.mark.skipif(not HAS_BM25, reason="bm25s is not installed")
def test_bm25_top3_finds_at_least_90_percent_of_hops(kb):
    from stratarl.retrieval.bm25 import BM25Retriever

    table = hop_recall(kb.train + kb.test, BM25Retriever.from_passages(kb.passages), ks=(1, 3))
    assert table["all"]["hops"] == sum(len(e.metadata["hops"]) for e in kb.train + kb.test)
    for group, row in table.items():
        assert row["top3"] >= 0.9, f"{group}: {row}\n{format_recall_table(table)}"


class _FixedRetriever:
    """Returns the same passages for every query: a hand-checkable recall."""

    def __init__(self, ids):
        self.ids = ids

    def search(self, queries, k):
        return [[Passage(i, '"t"\nx') for i in self.ids[:k]] for _ in queries]


def test_hop_recall_hand_case(kb):
    # Retriever always answers ["7", "3", "9"]. Hops needing 7 rank 1st, 3 rank 2nd, 5 absent.
    # all: 3 hops; top1 = 1/3 (only "7"), top3 = 2/3 ("7" and "3").
    from stratarl.data.examples import Example

    examples = [
        Example(
            "a", "q", ("x",), metadata={"question_type": "single_hop", "hops": [{"query": "q", "passage_id": "7"}]}
        ),
        Example(
            "b",
            "q",
            ("x",),
            metadata={
                "question_type": "multi_hop_2",
                "hops": [{"query": "q", "passage_id": "3"}, {"query": "q", "passage_id": "5"}],
            },
        ),
    ]
    table = hop_recall(examples, _FixedRetriever(["7", "3", "9"]), ks=(1, 3))
    assert table["all"] == {"hops": 3, "top1": 1 / 3, "top3": 2 / 3}
    assert table["multi_hop_2/hop1"] == {"hops": 1, "top1": 0.0, "top3": 1.0}
    assert table["multi_hop_2/hop2"] == {"hops": 1, "top1": 0.0, "top3": 0.0}
    with pytest.raises(ValueError, match="no metadata\\['hops'\\]"):
        hop_recall([Example("c", "q", ("x",))], _FixedRetriever([]))


def test_written_files_load_back(kb, tmp_path):
    from stratarl.retrieval.corpus import load_corpus

    paths = write_synthetic_kb(kb, tmp_path / "kb")
    assert load_corpus(paths["corpus"]) == kb.passages
    test = load_examples(paths["test"])
    assert [(e.id, e.question, e.golden_answers) for e in test] == [
        (e.id, e.question, e.golden_answers) for e in kb.test
    ]
    assert test[0].metadata["hops"] == kb.test[0].metadata["hops"]
    assert load_examples(tmp_path / "kb", split="train")[0].metadata["split"] == "train"
    assert '"seed": 0' in paths["stats"].read_text()


class TestMultipleChoiceFamily:
    @pytest.fixture(scope="class")
    def mc(self):
        return generate_knowledge_base(seed=0, size="small", multiple_choice=4)

    def test_same_world_and_questions_as_without_options(self, kb, mc):
        assert mc.passages == kb.passages
        assert [(e.question, e.metadata["hops"]) for e in mc.train] == [
            (e.question, e.metadata["hops"]) for e in kb.train
        ]
        assert "options" not in kb.train[0].metadata and kb.train[0].data_source == "synthkb"

    def test_options_hold_the_answer_once_among_wrong_answers_of_its_type(self, kb, mc):
        from stratarl.data.synth import ANSWER_KINDS

        for plain, e in zip(kb.train + kb.test, mc.train + mc.test):
            options = e.metadata["options"]
            answer = plain.golden_answers[0]
            assert e.data_source == "synthetic_mc" and list(options) == ["A", "B", "C", "D"]
            assert len(set(options.values())) == 4 and list(options.values()).count(answer) == 1
            assert e.golden_answers == (e.metadata["answer_letter"], answer) and options[e.golden_answers[0]] == answer
            kind = ANSWER_KINDS[FAMILIES[e.metadata["family"]].relations[-1]]
            pool = set(_answer_pool_of(mc, kind))
            assert set(options.values()) <= pool  # every option is a name of the answer's type

    def test_the_right_letter_is_spread_over_the_options(self, mc):
        letters = Counter(e.metadata["answer_letter"] for e in mc.train)
        assert set(letters) == {"A", "B", "C", "D"} and min(letters.values()) > len(mc.train) / 8

    def test_too_many_options_for_the_countries_is_explained(self):
        with pytest.raises(ValueError, match=r"multiple_choice=6: only 5 distinct country names"):
            generate_knowledge_base(seed=0, size=200, num_train=30, num_test=5, multiple_choice=6, guessable="only")
        with pytest.raises(ValueError, match="2 to 10 options"):
            generate_knowledge_base(seed=0, size=200, num_train=30, num_test=5, multiple_choice=1)

    def test_written_and_loaded_back_with_options(self, mc, tmp_path):
        paths = write_synthetic_kb(mc, tmp_path)
        loaded = load_examples(paths["test"])
        assert [(e.golden_answers, e.metadata["options"]) for e in loaded] == [
            (e.golden_answers, e.metadata["options"]) for e in mc.test
        ]


def _answer_pool_of(kb, kind):
    """Every name of ``kind`` in ``kb``'s world (the world rebuilt from the generator's seeded RNG)."""
    from stratarl.data.synth import build_world
    from stratarl.data.synth.options import _answer_pools

    world = build_world(
        random.Random(0),
        num_countries=kb.config["num_countries"],
        **{k: kb.config[k] for k in ("num_people", "num_works", "num_orgs", "num_cities")},
    )
    return _answer_pools(world)[kind]


def test_shared_countries_are_the_same_words_in_every_world_and_nothing_else_is():
    from stratarl.data.synth.knowledge_base import generate_knowledge_base
    from stratarl.data.synth.names import name_pool_words

    options = {
        "size": 300,
        "num_countries": 3,
        "num_train": 60,
        "num_test": 10,
        "hop_mix": (0.0, 1.0, 0.0),
        "guessable": "only",
        "name_pool": 1000,
    }
    a = generate_knowledge_base(seed=1, shared_countries=True, **options)
    b = generate_knowledge_base(seed=2, shared_countries=True, **options)
    countries = set(name_pool_words(1000)[:3])
    # every country answer of both worlds is one of the pool's first three words: a guess learned in one world
    # can be right in the other
    assert {e.golden_answers[0] for e in a.train + b.train} <= countries
    assert a.config["shared_countries"] is True
    # the other names still differ between worlds, and no other entity takes a country's name
    text_a, text_b = " ".join(p.text for p in a.passages), " ".join(p.text for p in b.passages)
    assert a.passages[5].text != b.passages[5].text and text_a != text_b
    # the default is unchanged: countries differ between worlds, and the config does not name the option
    plain_a, plain_b = (generate_knowledge_base(seed=s, **options) for s in (1, 2))
    assert {e.golden_answers[0] for e in plain_a.train}.isdisjoint({e.golden_answers[0] for e in plain_b.train}) or {
        e.golden_answers[0] for e in plain_a.train
    } != {e.golden_answers[0] for e in plain_b.train}
    assert "shared_countries" not in plain_a.config
    import pytest

    with pytest.raises(ValueError, match="shared_countries needs name_pool"):
        generate_knowledge_base(seed=1, shared_countries=True, **{**options, "name_pool": None})
