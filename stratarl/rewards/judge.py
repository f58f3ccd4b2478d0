"""The ``judge`` reward: an LLM behind an OpenAI-compatible endpoint grades the final answer (standard library
only).

Each answered rollout is one ``POST <url>/v1/chat/completions`` request (``model``, one user message: the
question, the gold answers and the predicted answer, asking for 1 or 0; temperature 0). The reply's first word
is the score: ``1`` / ``yes`` / ``correct`` -> 1, ``0`` / ``no`` / ``incorrect`` -> 0, or a number in [0, 1].
A rollout without an answer scores 0 without a request.

A request that times out (``timeout_s``), is refused, returns an HTTP error or a reply without a score raises
:class:`~stratarl.rewards.registry.RewardFault`: the trainer keeps that rollout out of the update, and a step
where too many rollouts are such takes no update at all, as it does for failed searches (docs/training.md).
"""

from __future__ import annotations

import json
import os
import re
import urllib.error
import urllib.request
from typing import Any

from stratarl.rewards.builtin import SHAPING_CHECKS, shaped
from stratarl.rewards.registry import RewardFault, RewardResult, Trajectory, register_reward

JUDGE_PROMPT = (
    "You grade answers to questions.\n"
    "Question: {question}\n"
    "Gold answers: {golds}\n"
    "Predicted answer: {answer}\n"
    "Does the predicted answer mean the same as one of the gold answers? "
    "Reply with 1 if it does and 0 if it does not, and nothing else."
)
_SCORE_RE = re.compile(r"^\s*[\"'`*(\[]*\s*(yes|no|correct|incorrect|true|false|[01](?:\.\d+)?)\b", re.IGNORECASE)
_WORDS = {"yes": 1.0, "correct": 1.0, "true": 1.0, "no": 0.0, "incorrect": 0.0, "false": 0.0}


def endpoint(url: str) -> str:
    """The chat-completions endpoint of ``url``: a full ``.../chat/completions`` URL as it is, a ``.../v1`` base
    with ``/chat/completions`` added, any other base with ``/v1/chat/completions`` added."""
    url = url.rstrip("/")
    if url.endswith("/chat/completions"):
        return url
    return url + ("/chat/completions" if url.endswith("/v1") else "/v1/chat/completions")


def parse_score(text: str) -> float | None:
    """The score a judge's reply starts with (module docstring), or None when it starts with none."""
    match = _SCORE_RE.match(text or "")
    if match is None:
        return None
    word = match.group(1).lower()
    value = _WORDS.get(word)
    if value is None:
        value = float(word)
    return value if 0.0 <= value <= 1.0 else None


def ask_judge(url: str, model: str, prompt: str, *, timeout_s: float, api_key: str = "") -> float:
    """One chat-completions request; the reply's score. Raises RewardFault on any failure."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "temperature": 0, "max_tokens": 8}
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    if not _is_http_url(url):
        raise RewardFault(f"judge {url!r}: not an http(s) URL")
    data = json.dumps(body).encode()
    request = urllib.request.Request(endpoint(url), data=data, headers=headers, method="POST")  # noqa: S310  http(s)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:  # noqa: S310  an http(s) URL (checked)
            reply: Any = json.loads(response.read().decode("utf-8"))
        content = reply["choices"][0]["message"]["content"]
    except urllib.error.HTTPError as error:
        raise RewardFault(f"judge {endpoint(url)}: HTTP {error.code} {error.reason}") from None
    except (urllib.error.URLError, TimeoutError, OSError) as error:
        reason = getattr(error, "reason", error)
        raise RewardFault(f"judge {endpoint(url)}: {type(error).__name__}: {reason}") from None
    except (ValueError, KeyError, IndexError, TypeError) as error:
        raise RewardFault(f"judge {endpoint(url)}: malformed reply ({type(error).__name__}: {error})") from None
    score = parse_score(str(content))
    if score is None:
        raise RewardFault(f"judge {endpoint(url)}: the reply {str(content)[:80]!r} does not start with 1 or 0")
    return score


def _is_http_url(value: str) -> bool:
    return value.startswith(("http://", "https://")) and len(value) > len("https://")


@register_reward(
    "judge",
    checks={
        **SHAPING_CHECKS,
        "url": (_is_http_url, "must be an http(s) URL of an OpenAI-compatible server, e.g. http://127.0.0.1:8000"),
        "timeout_s": (lambda v: 0 < v < float("inf"), "must be > 0 (seconds)"),
        "api_key_env": (lambda v: not v or v in os.environ, "must name a set environment variable, or be empty"),
    },
)
def judge_reward(
    trajectory: Trajectory,
    *,
    url: str,
    model: str = "judge",
    timeout_s: float = 30.0,
    api_key_env: str = "",
    invalid_action_penalty: float = 0.0,
    tool_call_cost: float = 0.0,
) -> RewardResult:
    """The judge's score of the final answer (0 without one, no request), minus the shaping terms
    (stratarl.rewards.builtin). ``api_key_env``: the environment variable holding the endpoint's key, if any."""
    if trajectory.answer is None:
        answer = 0.0
    else:
        prompt = JUDGE_PROMPT.format(
            question=trajectory.question, golds="; ".join(trajectory.golds), answer=trajectory.answer
        )
        key = os.environ.get(api_key_env, "") if api_key_env else ""
        answer = ask_judge(url, model, prompt, timeout_s=timeout_s, api_key=key)
    return shaped(trajectory, answer, invalid_action_penalty=invalid_action_penalty, tool_call_cost=tool_call_cost)
