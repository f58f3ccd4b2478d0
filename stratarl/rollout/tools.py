"""The tools an agent calls, as registered parts: ``search`` and ``open`` built in, a user's own by one decorator.

A tool is one function registered with :func:`register_tool`. Its model-facing arguments (what the policy writes
in a call) are described by a JSON schema, rendered into the prompt by the protocol (stratarl.rollout.protocols);
its keyword-only parameters with defaults are set in the config (``rollout.tool_params.<tool>``) and checked
against the signature when the config loads. ``max_calls`` in the same mapping is every tool's budget per rollout.

Two shapes (docs/agent_loop.md)::

    @register_tool("calc")                       # one call at a time; schema from the signature
    def calc(expression: str, *, digits: int = 6) -> str: ...

    @register_tool("search", schema=..., batched=True)   # every pending call of a turn at once
    def search(calls: list[dict], *, context: ToolContext) -> list[ToolOutput]: ...

A tool returns text (or a :class:`ToolOutput`); one that raises becomes an observation that says so and a counted
tool error, never a crash (:func:`run_tool`). A keyword-only ``context`` parameter receives the
:class:`ToolContext` (the retriever, the tokenizer, ``topk``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from stratarl.config_errors import fail
from stratarl.registry import Registry
from stratarl.retrieval.base import Passage, Retriever
from stratarl.retrieval.titles import title_lookup_for
from stratarl.rollout.parsing import NOT_CALLS, TRUNCATION_MARKER, format_documents

JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
}
_PY_TO_JSON = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}
BUDGET_KEY = "max_calls"


@dataclass(frozen=True)
class ToolContext:
    """What a tool may use: the run's retriever (timed, with its fault counter), the policy's tokenizer and
    passages per search (``topk``)."""

    retriever: Retriever
    tokenizer: Any
    topk: int


@dataclass(frozen=True)
class ToolOutput:
    """A tool's result: the text shown to the model and, for the transcript, the passages it read."""

    text: str
    passages: tuple[Passage, ...] = ()


@dataclass(frozen=True)
class ToolCall:
    """One call as the transcript shows it. ``status``: ``ok``, ``error`` (the tool raised), ``malformed`` (the
    call could not run: ``detail`` says why) or ``over_budget`` (``max_calls`` reached, not run)."""

    tool: str
    arguments: dict[str, Any] | None
    status: Literal["ok", "error", "malformed", "over_budget"]
    detail: str = ""
    passage_ids: tuple[str, ...] = ()
    error_kind: str = ""
    """For a malformed call: ``bad_json``, ``unknown_tool`` or ``bad_arguments``."""


@dataclass(frozen=True)
class ToolSpec:
    """A registered tool: its function, the JSON schema of its arguments and its configurable parameters."""

    name: str
    fn: Callable[..., Any]
    description: str
    parameters: dict[str, Any]
    batched: bool = False
    params: dict[str, Any] = field(default_factory=dict)
    wants_context: bool = False

    @property
    def required(self) -> tuple[str, ...]:
        return tuple(self.parameters.get("required", ()))

    @property
    def main_argument(self) -> str:
        """The argument a tag protocol (``search_r1``: ``<open> title </open>``) fills with the tag's text."""
        return (self.required or tuple(self.parameters.get("properties", {})) or ("input",))[0]

    def function_schema(self) -> dict[str, Any]:
        """The OpenAI / Qwen2.5 function description: ``{"type": "function", "function": {...}}``."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


_TOOLS: Registry[ToolSpec] = Registry(
    "tool",
    listed_as="registered tools",
    how_to_add="(a tool of your own: @register_tool in a module loaded with --import)",
    unknown_error=ValueError,
    source=lambda spec: spec.fn,
)


def _schema_from_signature(fn: Callable[..., Any], arguments: list[inspect.Parameter]) -> dict[str, Any]:
    properties = {}
    for p in arguments:
        json_type = _PY_TO_JSON.get(p.annotation if isinstance(p.annotation, type) else str, "string")
        if isinstance(p.annotation, str):  # `from __future__ import annotations`: the annotation's text
            json_type = {"str": "string", "int": "integer", "float": "number", "bool": "boolean"}.get(
                p.annotation, "string"
            )
        properties[p.name] = {"type": json_type}
    required = [p.name for p in arguments if p.default is p.empty]
    return {"type": "object", "properties": properties, "required": required}


def register_tool(
    name: str, *, schema: Mapping[str, Any] | None = None, batched: bool = False
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: register ``fn`` as tool ``name`` (see the module docstring for the two shapes).

    ``schema``: ``{"description": ..., "parameters": <JSON schema of an object>}``; without it (one-call tools
    only) the parameters come from the positional parameters' annotations and the description from the
    docstring's first line. Names ``answer``, ``invalid`` and ``malformed`` are taken by the protocol."""
    _TOOLS.check_name(name)
    if name in NOT_CALLS or not name.replace("_", "").isalnum():
        raise ValueError(f"tool name {name!r} is reserved or not a word; pick a name of letters, digits and _")

    def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(fn).parameters.values()
        positional = [p for p in signature if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        keywords = {p.name: p.default for p in signature if p.kind == p.KEYWORD_ONLY and p.name != "context"}
        if any(default is inspect.Parameter.empty for default in keywords.values()):
            raise ValueError(f"tool {name!r}: every keyword-only parameter needs a default (the config may omit it)")
        if batched and schema is None:
            raise ValueError(f"tool {name!r}: a batched tool needs schema= (its arguments are not in its signature)")
        doc = (inspect.getdoc(fn) or f"The {name} tool.").splitlines()[0]
        given = dict(schema or {})
        parameters = dict(given.get("parameters") or _schema_from_signature(fn, positional))
        if not batched:
            unknown = set(parameters.get("properties", {})) - {p.name for p in positional}
            if unknown:
                raise ValueError(f"tool {name!r}: schema arguments {sorted(unknown)} are not parameters of {fn}")
        spec = ToolSpec(
            name,
            fn,
            str(given.get("description", doc)),
            parameters,
            batched,
            keywords,
            any(p.name == "context" and p.kind == p.KEYWORD_ONLY for p in signature),
        )
        _TOOLS.add(name, spec)
        return fn

    return decorator


def get_tool(name: str) -> ToolSpec:
    """The tool registered as ``name`` (ValueError listing the registered ones)."""
    return _TOOLS.lookup(name)


def tool_names() -> list[str]:
    return _TOOLS.names()


def check_arguments(spec: ToolSpec, arguments: object) -> str:
    """What is wrong with ``arguments`` for ``spec`` ("" when nothing): not an object, a required argument
    missing, an unknown one, or a value of the wrong JSON type."""
    if not isinstance(arguments, dict):
        return f"the arguments of {spec.name} must be a JSON object, got {type(arguments).__name__}"
    properties = spec.parameters.get("properties", {})
    missing = [k for k in spec.required if k not in arguments]
    if missing:
        return f"{spec.name} needs the argument(s) {', '.join(missing)}"
    unknown = [k for k in arguments if k not in properties]
    if unknown:
        return f"{spec.name} has no argument(s) {', '.join(unknown)} (it takes {', '.join(properties) or 'none'})"
    for key, value in arguments.items():
        expected = properties[key].get("type") if isinstance(properties[key], dict) else None
        types = JSON_TYPES.get(expected or "", (object,))
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            return f"argument {key} of {spec.name} must be a JSON {expected}, got {value!r}"
    return ""


def run_tool(
    spec: ToolSpec, calls: Sequence[dict[str, Any]], context: ToolContext, params: Mapping[str, Any]
) -> list[ToolOutput | BaseException]:
    """Run ``calls`` (checked arguments) of one tool: a batched tool once, any other once per call. A raised error
    (or a batched reply of the wrong length) is returned in place of the output, never raised."""
    extra = {**params, **({"context": context} if spec.wants_context else {})}
    if spec.batched:
        try:
            outputs = spec.fn([dict(c) for c in calls], **extra)
        except Exception as error:  # noqa: BLE001 - a failing tool becomes an observation
            return [error] * len(calls)
        if not isinstance(outputs, list) or len(outputs) != len(calls):
            got = len(outputs) if isinstance(outputs, list) else type(outputs).__name__
            return [RuntimeError(f"tool {spec.name} returned {got} results for {len(calls)} calls")] * len(calls)
        return [_as_output(o) for o in outputs]
    results: list[ToolOutput | BaseException] = []
    for call in calls:
        try:
            results.append(_as_output(spec.fn(**call, **extra)))
        except Exception as error:  # noqa: BLE001 - a failing tool becomes an observation
            results.append(error)
    return results


def _as_output(value: object) -> ToolOutput:
    return value if isinstance(value, ToolOutput) else ToolOutput(str(value))


def check_tool_config(tools: Sequence[str], tool_params: Mapping[str, Any], p: str) -> None:
    """``rollout.tools`` and ``rollout.tool_params`` against the registry and each tool's signature (one-line
    ConfigError naming the field)."""
    if not tools:
        fail(f"{p}.tools", list(tools), "an agent needs at least one tool", "use [search], or [search, open]")
    for i, name in enumerate(tools):
        if name not in _TOOLS:
            fail(
                f"{p}.tools[{i}]",
                name,
                "unknown tool",
                f"use one of {', '.join(tool_names())} (a tool of your own: @register_tool, loaded with --import)",
            )
    if len(set(tools)) != len(tools):
        fail(f"{p}.tools", list(tools), "a tool is listed twice", "list each tool once")
    for name, params in tool_params.items():
        if name not in tools:
            fail(f"{p}.tool_params.{name}", params, "not a tool of rollout.tools", f"add it to {p}.tools or drop it")
        if not isinstance(params, dict):
            fail(f"{p}.tool_params.{name}", params, "expected a mapping", "write e.g. {max_calls: 2}")
        spec = get_tool(name)
        for key, value in params.items():
            _check_param(spec, key, value, f"{p}.tool_params.{name}.{key}")


def _check_param(spec: ToolSpec, key: str, value: object, path: str) -> None:
    if key == BUDGET_KEY:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            fail(path, value, "a tool's budget is a whole number of calls per rollout", "use e.g. 2, or null")
        return
    if key not in spec.params:
        known = ", ".join([BUDGET_KEY, *spec.params])
        fail(path, value, f"tool {spec.name!r} has no such parameter", f"use one of {known}")
    default = spec.params[key]
    if (
        default is not None
        and not isinstance(value, type(default))
        and not (isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool))
    ):
        fail(path, value, f"expected {type(default).__name__} (the default is {default!r})", "change the type")
    if isinstance(value, int) and not isinstance(value, bool) and value < 0:
        fail(path, value, "must not be negative", f"use e.g. {default!r}")


def tool_budget(tool_params: Mapping[str, Any], name: str) -> int | None:
    """``rollout.tool_params.<name>.max_calls`` (None: no budget but the turns)."""
    return dict(tool_params.get(name) or {}).get(BUDGET_KEY)


def tool_kwargs(tool_params: Mapping[str, Any], name: str) -> dict[str, Any]:
    """The tool's own parameters from the config (its budget removed)."""
    return {k: v for k, v in dict(tool_params.get(name) or {}).items() if k != BUDGET_KEY}


def cut_to_tokens(tokenizer, text: str, max_tokens: int) -> str:
    """``text`` cut to at most ``max_tokens`` tokens of ``tokenizer``, ending in the truncation marker when cut."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) <= max_tokens:
        return text
    marker = len(tokenizer(TRUNCATION_MARKER, add_special_tokens=False)["input_ids"])
    return tokenizer.decode(ids[: max(0, max_tokens - marker)], skip_special_tokens=True) + TRUNCATION_MARKER


SEARCH_SCHEMA = {
    "description": "Search the corpus; returns the top passages, each with its title.",
    "parameters": {
        "type": "object",
        "properties": {"query": {"type": "string", "description": "what to search for"}},
        "required": ["query"],
    },
}
OPEN_SCHEMA = {
    "description": "Open the document with this exact title; returns its whole text (cut to a token budget).",
    "parameters": {
        "type": "object",
        "properties": {"title": {"type": "string", "description": "the document's title, as a search showed it"}},
        "required": ["title"],
    },
}


def search_text(hits: Sequence[Passage]) -> str:
    """The text of one search's result, as the model reads it: ``Doc {i}(Title: {title}) {text}`` per hit,
    stripped (stratarl.rollout.parsing.format_documents)."""
    return format_documents(list(hits)).strip()


@register_tool("search", schema=SEARCH_SCHEMA, batched=True)
def search_tool(calls: list[dict[str, Any]], *, context: ToolContext) -> list[ToolOutput]:
    """Search-R1's search: one retriever call for the whole turn, ``topk`` passages per query, each shown as
    ``Doc {i}(Title: {title}) {text}`` (stratarl.rollout.parsing.format_documents)."""
    queries = [call["query"] for call in calls]
    results = context.retriever.search(queries, context.topk)
    if not isinstance(results, list) or len(results) != len(queries):
        got = len(results) if isinstance(results, list) else type(results).__name__
        raise RuntimeError(f"retriever returned {got} result lists for {len(queries)} queries")
    # Every hit is kept: Search-R1 shows all the server returns (its SerpAPI server may return more than topk).
    return [ToolOutput(search_text(hits), tuple(hits)) for hits in results]


@register_tool("open", schema=OPEN_SCHEMA, batched=True)
def open_tool(calls: list[dict[str, Any]], *, context: ToolContext, max_tokens: int = 400) -> list[ToolOutput]:
    """A whole document by title (every passage of that title, in corpus order: stratarl.retrieval.titles), as
    ``Title: {title}`` then its text, cut to ``max_tokens`` tokens with a visible marker."""
    titles = [call["title"] for call in calls]
    documents = title_lookup_for(context.retriever).documents(titles)
    outputs = []
    for title, passages in zip(titles, documents):
        if not passages:
            outputs.append(ToolOutput(f"No document is titled {title.strip()!r}. Search to find a title."))
            continue
        text = f"Title: {passages[0].title}\n" + "\n".join(p.text.strip() for p in passages)
        outputs.append(ToolOutput(cut_to_tokens(context.tokenizer, text, max_tokens), tuple(passages)))
    return outputs
