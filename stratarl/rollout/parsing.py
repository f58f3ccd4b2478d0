"""The Search-R1 turn protocol as pure functions over text (no model, no tokenizer).

Source: Search-R1 ``search_r1/llm_agent/generation.py`` (``postprocess_predictions``,
``execute_predictions``, ``_passages2string``); docs/compatibility.md describes the turn loop.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from stratarl.retrieval.base import Passage

SEARCH_STOP = "</search>"
ANSWER_STOP = "</answer>"
STOP_STRINGS: tuple[str, ...] = (SEARCH_STOP, ANSWER_STOP)

# The action of a turn: the first match, dot matches newline, content stripped.
ACTION_RE = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)

INVALID_ACTION_OBSERVATION = (
    "\nMy previous action is invalid. If I want to search, I should put the query between "
    "<search> and </search>. If I want to give the final answer, I should put the answer between "
    "<answer> and </answer>. Let me try again.\n"
)
INFORMATION_PREFIX = "\n\n<information>"
INFORMATION_SUFFIX = "</information>\n\n"
TRUNCATION_MARKER = " ...[truncated]"

ActionKind = str
"""``answer``, ``invalid`` (no complete action), ``malformed`` (a tool call that cannot run), or the name of the tool
called (``search``, ``open``, a user's tool): stratarl.rollout.protocols parses it, stratarl.rollout.tools names
the tools."""
NOT_CALLS = frozenset({"answer", "invalid", "malformed"})


@dataclass(frozen=True)
class Action:
    """What a turn asked for: a tool call (``kind`` is the tool's name, ``content`` its main argument as text,
    ``arguments`` all of them), a final answer, a malformed call (``content``: the tool it named, if any; ``error``
    says what is wrong, ``error_kind`` is ``bad_json``, ``unknown_tool`` or ``bad_arguments``) or nothing valid."""

    kind: ActionKind
    content: str = ""
    arguments: dict[str, Any] | None = field(default=None, compare=False)
    error: str = ""
    error_kind: str = ""

    @property
    def is_call(self) -> bool:
        """A well-formed call of a tool (to be run)."""
        return self.kind not in NOT_CALLS


def parse_action(turn_text: str) -> Action:
    """The action of one turn: first match of ``<(search|answer)>(.*?)</\\1>`` (DOTALL).

    The content is stripped. An empty query (``<search> </search>``) is still a
    search with content "" (Search-R1 sends it to the retriever as is). Text with
    no complete tag pair is ``invalid``.
    """
    match = ACTION_RE.search(turn_text)
    if match is None:
        return Action("invalid")
    content = match.group(2).strip()
    return Action(match.group(1), content, {"query": content} if match.group(1) == "search" else None)


def find_stop(text: str, stop_strings: Sequence[str] = STOP_STRINGS) -> tuple[int, str] | None:
    """(end index, stop string) of the earliest-ending stop string in ``text``, or None.

    "Earliest" means the stop whose last character comes first: that is the one a
    left-to-right generator meets first.
    """
    best: tuple[int, str] | None = None
    for stop in stop_strings:
        index = text.find(stop)
        if index >= 0:
            end = index + len(stop)
            if best is None or end < best[0]:
                best = (end, stop)
    return best


def format_documents(passages: Sequence[Passage]) -> str:
    """Search-R1's ``_passages2string``: ``Doc {i}(Title: {title}) {text}`` one line per hit.

    title = the first line of ``contents`` as is (Search-R1 keeps its quotes), text =
    the remaining lines joined by newlines. Each hit ends with a newline; the caller
    strips the whole string (as Search-R1 does) when building the observation.
    """
    lines = []
    for i, passage in enumerate(passages, start=1):
        title, _, text = passage.contents.partition("\n")
        lines.append(f"Doc {i}(Title: {title}) {text}\n")
    return "".join(lines)


def information_observation(passages: Sequence[Passage]) -> str:
    """``\\n\\n<information>{docs}</information>\\n\\n`` with docs stripped (byte-exact Search-R1)."""
    return f"{INFORMATION_PREFIX}{format_documents(passages).strip()}{INFORMATION_SUFFIX}"


def tool_error_observation(error: BaseException) -> str:
    """The observation a failed search produces: an information block that says so.

    Kept short and in the information block so the model sees it where results go.
    """
    message = " ".join(str(error).split())[:200]
    return f"{INFORMATION_PREFIX}Search failed ({type(error).__name__}: {message}). No results.{INFORMATION_SUFFIX}"
