"""A model on PhantomWiki's held-out universes, greedy, three ways: closed-book, RAG, and searching (the agent loop).

    stratarl data phantomwiki --out runs/phantomwiki --seeds 101-104 --test-seeds 9001-9003
    python benchmarks/external/phantomwiki_baselines.py --data runs/phantomwiki --universes 9001-9003 \\
        --out docs/results/phantomwiki_smollm2_baselines.json
    python benchmarks/external/phantomwiki_baselines.py --data runs/phantomwiki --universes 9001-9003 \\
        --target RUN_DIR --label "after RL" --settings search --out runs/phantomwiki/after_rl.json

Each universe is evaluated over its own articles (as the paper evaluates one universe at a time), each setting one
`stratarl eval` subprocess per universe (the commands are printed and stored in the JSON):

- ``closed_book``: the ``closed_book`` prompt (the answer format, no search engine) and ``rollout.max_turns=0``;
- ``rag``: one retrieval with the question (BM25, top ``--rag-k`` articles, 4 as the paper's RAG baseline), the
  articles in the prompt between ``<information>`` tags, then one answer turn (``rollout.max_turns=0``);
- ``search``: the rows' own ``phantomwiki`` prompt (Search-R1's, plus how to list several answers) and the
  target's rollout budgets (configs/smollm2.yaml: 2 search turns and an answer turn, top-2 passages).

Scores are PhantomWiki's (answer sets; EM and F1: stratarl.rewards.phantomwiki). The JSON holds, per setting, EM
and F1 with 95% Student-t CIs over the questions, the same per difficulty, searches, answer rate, wall time, and
every question's scores (for paired comparisons with a later model on the same questions).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from stratarl.data.phantomwiki import parse_seeds
from stratarl.data.search_r1 import load_examples, write_search_r1_parquet
from stratarl.evaluation.stats import mean_ci
from stratarl.publish import write_atomic
from stratarl.retrieval.bm25 import BM25Retriever
from stratarl.retrieval.corpus import load_corpus
from stratarl.rollout.prompt import CLOSED_BOOK_TEMPLATE, MULTI_ANSWER_NOTE, build_prompt

SETTINGS = ("closed_book", "rag", "search")
RAG_TEMPLATE = (
    "Answer the given question using the documents below. You must conduct reasoning inside <think> and </think> "
    "first. Then provide the answer inside <answer> and </answer>, without detailed illustrations. For example, "
    "<answer> Beijing </answer>. " + MULTI_ANSWER_NOTE + "\n\n<information>{documents}</information>\n\n"
    "Question: {question}\n"
)


def rag_documents(retriever: BM25Retriever, question: str, k: int) -> str:
    """Search-R1's observation text for the top-k passages of one query: ``Doc i(Title: t) text`` per line."""
    [hits] = retriever.search([question], k)
    return "\n".join(f"Doc {i}(Title: {p.title}) {p.text}" for i, p in enumerate(hits, 1))


def setting_files(universe: Path, work: Path, rag_k: int) -> dict[str, Path]:
    """The question file of each setting for one universe (the closed-book and RAG prompts written into rows)."""
    examples = load_examples(str(universe / "questions.parquet"))
    retriever = BM25Retriever.from_passages(load_corpus(universe / "corpus.jsonl"))
    closed = [
        type(e)(
            **{**e.__dict__, "prompt": ({"role": "user", "content": build_prompt(e.question, CLOSED_BOOK_TEMPLATE)},)}
        )
        for e in examples
    ]
    rag = []
    for e in examples:
        template = RAG_TEMPLATE.replace("{documents}", rag_documents(retriever, e.question, rag_k))
        rag.append(
            type(e)(**{**e.__dict__, "prompt": ({"role": "user", "content": build_prompt(e.question, template)},)})
        )
    work.mkdir(parents=True, exist_ok=True)
    write_search_r1_parquet(closed, work / "closed_book.parquet", split="test")
    write_search_r1_parquet(rag, work / "rag.parquet", split="test")
    return {
        "closed_book": work / "closed_book.parquet",
        "rag": work / "rag.parquet",
        "search": universe / "questions.parquet",
    }


def eval_command(
    target: str, universe: Path, data: Path, setting: str, threads: int, out: Path, extra: Sequence[str] = ()
) -> list[str]:
    """`stratarl eval` of one setting on one universe (its own corpus); ``extra``: the user's overrides."""
    overrides = [
        "data.source=files",
        f"data.train_files=[{data}]",  # data.source=files needs a training file; eval trains nothing
        f"data.corpus={universe / 'corpus.jsonl'}",
        "data.max_eval_examples=null",
        "sft.enabled=false",
        "sft.source=task",
        "sft.probe_every=0",
        f"trainer.num_threads={threads}",
        "logging.progress=false",
        "eval.num_transcripts=1000",
        *extra,
        *(["rollout.max_turns=0"] if setting in ("closed_book", "rag") else []),
    ]
    return [sys.executable, "-m", "stratarl.cli", "eval", target, *overrides, "--data", str(data), "--out", str(out)]


def summarise(records: list[dict]) -> dict:
    """EM / F1 with 95% CIs over questions, searches and answer rate, overall and per difficulty."""

    def block(rows: list[dict]) -> dict:
        return {
            "n": len(rows),
            "em": mean_ci([r["em"] for r in rows]).to_dict(),
            "f1": mean_ci([r["f1"] for r in rows]).to_dict(),
            "searches_mean": sum(r["searches"] for r in rows) / len(rows),
            "answer_rate": sum(r["answered"] for r in rows) / len(rows),
        }

    by_difficulty: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        by_difficulty[str(r["question_type"])].append(r)
    return {"all": block(records), "per_difficulty": {k: block(v) for k, v in sorted(by_difficulty.items())}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="the folder `stratarl data phantomwiki --out` wrote")
    parser.add_argument("--universes", required=True, help="held-out universe seeds, e.g. 9001-9003")
    parser.add_argument("--target", default="configs/smollm2.yaml", help="a YAML config or a run directory")
    parser.add_argument("--label", default="shipped SmolLM2-135M-Instruct")
    parser.add_argument(
        "--settings", default=",".join(SETTINGS), help="comma-separated subset of " + ",".join(SETTINGS)
    )
    parser.add_argument("--rag-k", type=int, default=4)
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an override for every eval, e.g. model.init_from=runs/phantomwiki_ws/sft/model (repeatable)",
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", required=True, help="result JSON")
    args = parser.parse_args(argv)
    settings = [s for s in args.settings.split(",") if s]
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        parser.error(f"--settings: unknown {unknown}; valid: {list(SETTINGS)}")
    data, out = Path(args.data), Path(args.out)
    work = out.with_suffix("")
    result: dict = {
        "target": args.target,
        "label": args.label,
        "overrides": args.set,
        "universes": [],
        "settings": {},
        "commands": [],
    }
    records: dict[str, list[dict]] = defaultdict(list)
    seconds: dict[str, float] = defaultdict(float)
    for seed in parse_seeds(args.universes):
        universe = data / f"u{seed}"
        if not (universe / "questions.parquet").is_file():
            parser.error(f"{universe}: no questions.parquet. Fix: generate it with `stratarl data phantomwiki`")
        result["universes"].append(json.loads((universe / "universe.json").read_text()))
        files = setting_files(universe, work / f"u{seed}", args.rag_k)
        for setting in settings:
            run_out = work / f"u{seed}" / setting
            command = eval_command(args.target, universe, files[setting], setting, args.threads, run_out, args.set)
            print("$", " ".join(command), flush=True)
            start = time.perf_counter()
            done = subprocess.run(command, capture_output=True, text=True)
            seconds[setting] += time.perf_counter() - start
            if done.returncode != 0:
                print(done.stderr[-2000:], file=sys.stderr)
                return done.returncode
            evaluated = json.loads((run_out / "eval" / "eval.json").read_text())
            records[setting] += [dict(r, universe=seed) for r in evaluated["per_question"]]
            result["commands"].append(command)
    for setting in settings:
        result["settings"][setting] = {
            **summarise(records[setting]),
            "seconds": round(seconds[setting], 1),
            "per_question": records[setting],
        }
        line = result["settings"][setting]["all"]
        print(
            f"{setting:12s} n={line['n']}  EM {line['em']['mean']:.3f} [{line['em']['low']:.3f}, {line['em']['high']:.3f}]"
            f"  F1 {line['f1']['mean']:.3f} [{line['f1']['low']:.3f}, {line['f1']['high']:.3f}]"
            f"  searches {line['searches_mean']:.2f}  answered {line['answer_rate']:.2f}  {seconds[setting]:.0f}s",
            flush=True,
        )
    write_atomic(out, json.dumps(result, indent=1) + "\n")
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
