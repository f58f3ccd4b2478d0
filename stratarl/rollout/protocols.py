"""Tool-call protocols as registered parts (``rollout.protocol``): how a turn's text becomes an action, how a
tool's result is rendered back, and how the tools are described in the prompt. docs/agent_loop.md.

- ``search_r1`` (the default): Search-R1's tags. ``<search> q </search>``, results in ``<information>``; every
  other tool is a tag of its own name (``<open> title </open>``), its result in ``<information>`` too.
- ``hermes``: Qwen2.5 / Qwen3's JSON calls, ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``;
  results in Qwen2.5's tool turn (``<|im_start|>user\\n<tool_response>\\n...\\n</tool_response><|im_end|>``), the
  tools' schemas in the system turn's ``# Tools`` block, as Qwen2.5-Instruct's chat template renders them.
- ``llama3_json``: Llama-3.1's JSON calls, ``{"name": ..., "parameters": {...}}`` as the whole turn; results in
  an ``ipython`` turn, the schemas in the first user turn, as Llama-3.1-Instruct's template renders them.

In every protocol the final answer is ``<answer> ... </answer>`` (the rewards read it). The text a protocol
appends after a turn closes the assistant's turn itself (its end-of-turn token is never sampled before a tool
turn: a turn ends at its stop string, or its EOS is dropped), so the token sequence is the chat template's.

A protocol of one's own: a subclass of :class:`ToolProtocol` decorated with ``@register_protocol(name)``.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Sequence
from typing import Any, ClassVar

from stratarl.registry import Registry
from stratarl.rollout.parsing import (
    ANSWER_STOP,
    INFORMATION_PREFIX,
    INFORMATION_SUFFIX,
    INVALID_ACTION_OBSERVATION,
    Action,
)
from stratarl.rollout.prompt import PROMPT_TEMPLATES
from stratarl.rollout.tools import ToolSpec, check_arguments, get_tool

ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def error_text(tool: str, error: BaseException) -> str:
    """``Search failed (TimeoutError: ...). No results.``: a failed call as the model reads it."""
    message = " ".join(str(error).split())[:200]
    return f"{tool.capitalize()} failed ({type(error).__name__}: {message}). No results."


class ToolProtocol:
    """One protocol bound to the run's tools. Subclasses set the class attributes and the methods below."""

    name: ClassVar[str] = ""
    templates: ClassVar[dict[str, str]] = PROMPT_TEMPLATES
    """Named user templates (``rollout.prompt_template``), worded for this protocol's format."""
    call_ends_with_eos: ClassVar[bool] = False
    """A call turn ends with the model's end-of-sequence token (no stop string ends it): the engine drops that
    token and the tool turn writes the end of turn again (llama3_json)."""

    def __init__(self, tools: Sequence[ToolSpec]) -> None:
        self.tools = {t.name: t for t in tools}

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """Strings after which a turn's generation stops."""
        raise NotImplementedError

    def parse(self, text: str) -> Action:
        """The action of one turn's text (its final EOS token decoded in, when it has one)."""
        raise NotImplementedError

    def call_text(self, tool: str, arguments: dict[str, Any]) -> str:
        """A call as the model writes it in this protocol (``parse`` reads it back as that call): what a
        warm start's demonstrations show (stratarl.trainer.warmstart.render)."""
        raise NotImplementedError

    def answer_text(self, answer: str) -> str:
        """The final answer as the model writes it: ``<answer> {answer} </answer>`` in every built-in protocol."""
        return f"<answer> {answer} </answer>"

    def messages(self, messages: list[dict[str, str]]) -> list[dict[str, str]]:
        """The prompt's chat messages with the tools described as the model's template expects."""
        return messages

    def tool_observation(self, tool: str, text: str) -> str:
        """What follows a call of ``tool`` whose result is ``text``."""
        raise NotImplementedError

    def feedback_observation(self, message: str) -> str:
        """What follows a call that did not run (malformed, over budget): ``message`` says why."""
        return self.tool_observation("", f"Error: {message}")

    def invalid_observation(self) -> str:
        """What follows a turn with no complete action."""
        raise NotImplementedError

    @property
    def observation_suffixes(self) -> tuple[str, ...]:
        """Endings an observation keeps when the cap cuts it (so the format stays well formed)."""
        return ()

    def call_action(self, name: object, arguments: object) -> Action:
        """A parsed call checked against the tools: the call, or a malformed action that says what is wrong."""
        if not isinstance(name, str) or name not in self.tools:
            known = ", ".join(self.tools)
            return Action("malformed", str(name), None, f"unknown tool {name!r}; the tools are {known}", "unknown_tool")
        problem = check_arguments(self.tools[name], arguments)
        if problem or not isinstance(arguments, dict):  # (check_arguments refuses anything but an object)
            return Action("malformed", name, None, problem, "bad_arguments")
        main = self.tools[name].main_argument
        return Action(name, str(arguments.get(main, "")).strip(), dict(arguments))


_PROTOCOLS: Registry[type[ToolProtocol]] = Registry(
    "tool-call protocol",
    listed_as="registered protocols",
    how_to_add="(a protocol of your own: @register_protocol in a module loaded with --import)",
    unknown_error=ValueError,
)


def register_protocol(name: str):
    """Class decorator: register a :class:`ToolProtocol` subclass as ``rollout.protocol: name``."""

    def decorator(cls: type[ToolProtocol]) -> type[ToolProtocol]:
        cls.name = name
        return _PROTOCOLS.add(name, cls)

    return decorator


def protocol_names() -> list[str]:
    return _PROTOCOLS.names()


def make_protocol(name: str, tools: Sequence[str]) -> ToolProtocol:
    """Protocol ``name`` bound to the tools named (ValueError listing the registered names)."""
    return _PROTOCOLS.lookup(name)([get_tool(t) for t in tools])


@register_protocol("search_r1")
class SearchR1Protocol(ToolProtocol):
    """Search-R1's tags (stratarl.rollout.parsing): with ``tools: [search]`` byte for byte today's protocol.
    A tool ``t`` is the tag ``<t> text </t>``, its text the tool's main argument; results in ``<information>``."""

    def __init__(self, tools: Sequence[ToolSpec]) -> None:
        super().__init__(tools)
        self.tags = [*self.tools, "answer"]
        self.action_re = re.compile(r"<({})>(.*?)</\1>".format("|".join(map(re.escape, self.tags))), re.DOTALL)

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return tuple(f"</{tag}>" for tag in self.tags)

    def parse(self, text: str) -> Action:
        match = self.action_re.search(text)
        if match is None:
            return Action("invalid")
        kind, content = match.group(1), match.group(2).strip()
        if kind == "answer":
            return Action("answer", content)
        return Action(kind, content, {self.tools[kind].main_argument: content})

    def call_text(self, tool: str, arguments: dict[str, Any]) -> str:
        return f"<{tool}> {arguments[self.tools[tool].main_argument]} </{tool}>"

    def messages(self, messages: list[dict[str, str]]) -> list[dict[str, str]]:
        if list(self.tools) == ["search"]:
            return messages  # the templates describe search already
        help_text = " ".join(f"<{t.name}> {t.main_argument} </{t.name}>: {t.description}" for t in self.tools.values())
        out = [dict(m) for m in messages]
        last_user = max(i for i, m in enumerate(out) if m.get("role") == "user")
        out[last_user]["content"] = (
            f"Tools (results come between <information> and </information>): {help_text}\n\n"
            + (out[last_user]["content"])
        )
        return out

    def tool_observation(self, tool: str, text: str) -> str:
        return f"{INFORMATION_PREFIX}{text}{INFORMATION_SUFFIX}"

    def invalid_observation(self) -> str:
        if list(self.tools) == ["search"]:
            return INVALID_ACTION_OBSERVATION
        uses = " ".join(
            "If I want to search, I should put the query between <search> and </search>."
            if t == "search"
            else f"If I want to use {t}, I should put the {spec.main_argument} between <{t}> and </{t}>."
            for t, spec in self.tools.items()
        )
        return (
            f"\nMy previous action is invalid. {uses} If I want to give the final answer, I should put the answer "
            "between <answer> and </answer>. Let me try again.\n"
        )

    @property
    def observation_suffixes(self) -> tuple[str, ...]:
        return (INFORMATION_SUFFIX,)


JSON_TEMPLATE = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every time you get "
    "new information. After reasoning, if you find you lack some knowledge, you can call the tools you are given; "
    "their results come back to you. You can call them as many times as you want. If you find no further external "
    "knowledge needed, you can directly provide the answer inside <answer> and </answer>, without detailed "
    "illustrations. For example, <answer> Beijing </answer>. Question: {question}\n"
)
JSON_SHORT_TEMPLATE = (
    "Answer the question. Call the tools as often as you need. Answer with <answer> name </answer>. "
    "Question: {question}\n"
)
JSON_TEMPLATES = {"search_r1": JSON_TEMPLATE, "short": JSON_SHORT_TEMPLATE}

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
HERMES_SYSTEM = "You are a helpful assistant."
HERMES_TOOLS_HEADER = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
HERMES_TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call>"
)
TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def _first(text: str, *patterns: re.Pattern[str]) -> tuple[int, re.Match[str] | None]:
    """(index of the pattern whose match starts first, the match); (-1, None) when none matches."""
    found = [(m.start(), i, m) for i, p in enumerate(patterns) if (m := p.search(text)) is not None]
    if not found:
        return -1, None
    _, i, match = min(found, key=lambda f: (f[0], f[1]))
    return i, match


def _json_call(protocol: ToolProtocol, raw: str, arguments_key: str) -> Action:
    """A JSON call ``{"name": ..., <arguments_key>: {...}}`` checked against the tools; ``arguments`` given as a
    JSON string is read too, as vLLM's hermes parser does. A malformed call names the tool it tried in
    ``content`` ("" when it named none)."""
    try:
        call = json.loads(raw)
    except json.JSONDecodeError as error:
        return Action("malformed", "", None, f"the call is not valid JSON ({error.msg})", "bad_json")
    if not isinstance(call, dict) or "name" not in call:
        shape = f'{{"name": <tool>, "{arguments_key}": {{...}}}}'
        return Action("malformed", "", None, f"a call is a JSON object {shape}", "bad_json")
    arguments: Any = call.get(arguments_key, call.get("arguments", {}))
    if isinstance(arguments, str):
        with contextlib.suppress(json.JSONDecodeError):  # check_arguments names the wrong type
            arguments = json.loads(arguments)
    return protocol.call_action(call["name"], arguments)


@register_protocol("hermes")
class HermesProtocol(ToolProtocol):
    """Qwen2.5's tool format in ChatML tokens (Qwen2.5 / Qwen3 / SmolLM2): one call per turn (the turn stops at
    the first ``</tool_call>``); a turn whose first complete action is ``<answer>`` ends the rollout."""

    templates = JSON_TEMPLATES
    response_prefix = f"{IM_END}\n{IM_START}user\n<tool_response>\n"
    response_suffix = f"\n</tool_response>{IM_END}\n{IM_START}assistant\n"

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return ("</tool_call>", ANSWER_STOP)

    def parse(self, text: str) -> Action:
        which, match = _first(text, TOOL_CALL_RE, ANSWER_RE)
        if match is None:
            return Action("invalid")
        if which == 1:
            return Action("answer", match.group(1).strip())
        return _json_call(self, match.group(1), "arguments")

    def call_text(self, tool: str, arguments: dict[str, Any]) -> str:
        """Qwen2.5's template writes a call as ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``
        (``arguments | tojson``: json.dumps with its default separators, key order kept)."""
        call = json.dumps({"name": tool, "arguments": arguments}, ensure_ascii=False)
        return f"<tool_call>\n{call}\n</tool_call>"

    def tools_block(self) -> str:
        """Qwen2.5's ``# Tools`` block (``tool | tojson``: json.dumps with its default separators, key order kept)."""
        schemas = "".join("\n" + json.dumps(t.function_schema(), ensure_ascii=False) for t in self.tools.values())
        return f"{HERMES_TOOLS_HEADER}{schemas}{HERMES_TOOLS_FOOTER}"

    def messages(self, messages: list[dict[str, str]]) -> list[dict[str, str]]:
        out = [dict(m) for m in messages]
        if out and out[0].get("role") == "system":
            out[0]["content"] = out[0]["content"] + self.tools_block()
        else:
            out.insert(0, {"role": "system", "content": HERMES_SYSTEM + self.tools_block()})
        return out

    def tool_observation(self, tool: str, text: str) -> str:
        return f"{self.response_prefix}{text}{self.response_suffix}"

    def invalid_observation(self) -> str:
        return (
            f"{IM_END}\n{IM_START}user\nMy previous action is invalid. If I want to call a tool, I should write "
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>. If I want to '
            f"give the final answer, I should put the answer between <answer> and </answer>. Let me try again."
            f"{IM_END}\n{IM_START}assistant\n"
        )

    @property
    def observation_suffixes(self) -> tuple[str, ...]:
        return (self.response_suffix, f"{IM_END}\n{IM_START}assistant\n")


EOT = "<|eot_id|>"
LLAMA_CALL_START = re.compile(r'\{\s*"name"\s*:')


def _header(role: str) -> str:
    return f"<|start_header_id|>{role}<|end_header_id|>\n\n"


@register_protocol("llama3_json")
class Llama3JsonProtocol(ToolProtocol):
    """Llama-3.1's JSON tool calls: the turn is ``{"name": ..., "parameters": {...}}`` and ends with its
    end-of-turn token (no stop string); the result comes back in an ``ipython`` turn."""

    templates = JSON_TEMPLATES
    call_ends_with_eos = True
    intro = (
        "Given the following functions, please respond with a JSON for a function call with its proper arguments "
        "that best answers the given prompt.\n\n"
        'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.'
        "Do not use variables.\n\n"
    )

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (ANSWER_STOP,)

    def parse(self, text: str) -> Action:
        which, match = _first(text, LLAMA_CALL_START, ANSWER_RE)
        if match is None:
            return Action("invalid")
        if which == 1:
            return Action("answer", match.group(1).strip())
        try:
            call, _ = json.JSONDecoder().raw_decode(text[match.start() :])
        except json.JSONDecodeError as error:
            return Action("malformed", "", None, f"the call is not valid JSON ({error.msg})", "bad_json")
        return _json_call(self, json.dumps(call), "parameters")

    def call_text(self, tool: str, arguments: dict[str, Any]) -> str:
        """``{"name": ..., "parameters": {...}}``, as Llama-3.1's template writes a call (its end-of-turn token
        follows: ``call_ends_with_eos``)."""
        return json.dumps({"name": tool, "parameters": arguments}, ensure_ascii=False)

    def messages(self, messages: list[dict[str, str]]) -> list[dict[str, str]]:
        out = [dict(m) for m in messages]
        first_user = min(i for i, m in enumerate(out) if m.get("role") == "user")
        schemas = "".join(json.dumps(t.function_schema(), indent=4) + "\n\n" for t in self.tools.values())
        out[first_user]["content"] = self.intro + schemas + out[first_user]["content"]
        return out

    def tool_observation(self, tool: str, text: str) -> str:
        return f"{EOT}{_header('ipython')}{text}{EOT}{_header('assistant')}"

    def invalid_observation(self) -> str:
        return (
            f"{EOT}{_header('user')}My previous action is invalid. If I want to call a function, I should respond "
            'with {"name": function name, "parameters": dictionary of argument name and its value} alone. If I '
            "want to give the final answer, I should put the answer between <answer> and </answer>. Let me try "
            f"again.{EOT}{_header('assistant')}"
        )

    @property
    def observation_suffixes(self) -> tuple[str, ...]:
        return (f"{EOT}{_header('assistant')}",)
