"""Question files in veRL's Search-R1 variant (``examples/data_preprocess/preprocess_search_r1_dataset.py``).

veRL's multi-turn agent loop calls tools through the chat template's tool-call format, so its
variant of a Search-R1 row differs from the original (docs/compatibility.md, Data):

    data_source: "searchR1_<source>"
    prompt: [{"role": "system", "content": VERL_SYSTEM_PROMPT},
             {"role": "user", "content": VERL_USER_TEMPLATE with the question}]
    ability: "fact-reasoning"
    reward_model: {"style": "rule", "ground_truth": {"target": [<gold answers>]}}
    extra_info: {"index", "split", "question", "need_tools_kwargs": true,
                 "tools_kwargs": {"search": {"create_kwargs": {"ground_truth", "question", "data_source"}}}}
    agent_name: "tool_agent"        (veRL's tool-calling agent loop)
    plus id / question / golden_answers, so stratarl's loaders read the file back unchanged.

Pure functions of :class:`~stratarl.data.examples.Example`; no veRL import.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from stratarl.data.examples import Example
from stratarl.data.search_r1 import VERL_PREFIX
from stratarl.rollout.prompt import normalize_question

VERL_AGENT_NAME = "tool_agent"
VERL_SYSTEM_PROMPT = "You are a helpful and harmless assistant."
# Search-R1's base template with veRL's tool calls in place of <search>/<information>. veRL's
# `hermes` parser (multi_turn.format) json-decodes the text between the tags and needs a name and
# arguments: a plain `<tool_call> query </tool_call>` is dropped and silently ends the rollout with
# no search. So the prompt shows the JSON form, with the recipe's tool `search(query_list)`.
VERL_TOOL_CALL_EXAMPLE = '<tool_call> {"name": "search", "arguments": {"query_list": ["your query"]}} </tool_call>'
VERL_USER_TEMPLATE = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every time "
    "you get new information. After reasoning, if you find you lack some knowledge, you can call a search "
    "engine by " + VERL_TOOL_CALL_EXAMPLE.replace("{", "{{").replace("}", "}}") + " and it will return the "
    "top searched results between <tool_response> and </tool_response>. You can search as many times as "
    "your want. If you find no "
    "further external knowledge needed, you can directly provide the answer inside <answer> and </answer>, "
    "without detailed illustrations. For example, <answer> Beijing </answer>. Question: {question}"
)


def verl_search_row(example: Example, index: int, *, split: str | None = None) -> dict:
    """One Example as a row of veRL's Search-R1 variant (see the module docstring)."""
    question = normalize_question(example.question)
    source = example.data_source
    tagged = source if source.startswith(VERL_PREFIX) else VERL_PREFIX + source
    golds = list(example.golden_answers)
    if not golds:
        raise ValueError(f"example {example.id!r} has no gold answers; every training row needs at least one")
    row_split = split or str(example.metadata.get("split", "train"))
    return {
        "id": example.id,
        "question": question,
        "golden_answers": golds,
        "data_source": tagged,
        "prompt": [
            {"role": "system", "content": VERL_SYSTEM_PROMPT},
            {"role": "user", "content": VERL_USER_TEMPLATE.format(question=question)},
        ],
        "ability": "fact-reasoning",
        "reward_model": {"style": "rule", "ground_truth": {"target": golds}},
        "extra_info": {
            "index": index,
            "split": row_split,
            "question": question,
            "need_tools_kwargs": True,
            "tools_kwargs": {
                "search": {
                    "create_kwargs": {"ground_truth": {"target": golds}, "question": question, "data_source": tagged}
                }
            },
        },
        "agent_name": VERL_AGENT_NAME,
    }


def verl_search_rows(examples: Iterable[Example], *, split: str | None = None) -> list[dict]:
    """Rows for a whole file; ``extra_info.index`` is the row number (never used as a group key)."""
    return [verl_search_row(example, index, split=split) for index, example in enumerate(examples)]


def write_verl_parquet(examples: Iterable[Example], path: str | Path, *, split: str | None = None) -> Path:
    """Write veRL's Search-R1 parquet (``data.train_files`` / ``data.val_files`` of the recipes)."""
    import pyarrow as pa  # start-up cost: only when a data file is written
    import pyarrow.parquet as pq  # start-up cost: only when a data file is written

    path = Path(path)
    if path.suffix != ".parquet":
        raise ValueError(f"{path}: veRL reads parquet; name the output *.parquet")
    rows = verl_search_rows(examples, split=split)
    if not rows:
        raise ValueError(f"{path}: no examples to write (the input had no rows, or --split/--limit kept none)")
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path
