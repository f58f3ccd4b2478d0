"""Search-R1's ``/retrieve`` protocol: request limits, reading and validating a request, encoding the answer.

POST /retrieve  ``{"queries": [...], "topk": 3, "return_scores": true}`` →
``{"result": [[{"document": {"id", "contents"}, "score": s}, ...], ...]}`` (one list per query, in
request order); with ``return_scores`` false or absent (Search-R1's default) each hit is the bare
document. ``topk`` missing, null or 0 means the server's default (as in Search-R1's server).
A bad request is answered with its status and ``{"error": message}`` (`RequestError`).
The differences from Search-R1's own server, and why: docs/retrieval.md.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass
from typing import SupportsFloat

from stratarl.retrieval.base import Passage


@dataclass(frozen=True)
class ServerLimits:
    """Bounds on one request. Search-R1's trainer sends every search query of a rollout step in one
    request (train batch × group size, often a few thousand), hence the generous ``max_queries``."""

    default_topk: int = 3
    max_queries: int = 4096
    max_query_chars: int = 2048
    max_topk: int = 100
    max_body_bytes: int = 16 * 1024 * 1024
    max_batch_queries: int = 1024
    max_hits: int = 16384
    """Most passages one request may ask for (queries x topk): bounds the work and the response size
    of a single request (16384 = 4096 queries at topk 4)."""

    def __post_init__(self) -> None:
        # Messages name the `stratarl serve` flag users type (`_flag`).
        defaults = ServerLimits.__dataclass_fields__
        for name, value in asdict(self).items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                flag = _flag(name)
                raise ValueError(
                    f"{flag} {value!r}: must be a positive integer. Fix: pass e.g. {flag} {defaults[name].default}"
                )
        if self.default_topk > self.max_topk:
            raise ValueError(
                f"--topk {self.default_topk} is more than --max-topk {self.max_topk}. Fix: lower --topk "
                f"or raise --max-topk"
            )


def _flag(field: str) -> str:
    """The `stratarl serve` flag that sets a `ServerLimits` field (max_body_bytes has none: its own name)."""
    if field == "max_body_bytes":
        return field
    return "--topk" if field == "default_topk" else "--" + field.replace("_", "-")


class RequestError(Exception):
    """A bad request: answered with ``status`` and ``{"error": message}``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


async def receive_body(scope: dict, receive, max_bytes: int) -> bytes | None:
    """The body of a raw ASGI request (None if the client went away first); `RequestError` past ``max_bytes``."""
    for name, value in scope["headers"]:
        if name == b"content-length" and value.isdigit() and int(value) > max_bytes:
            raise RequestError(413, f"request body is {value.decode()} bytes; this server accepts at most {max_bytes}")
    body = bytearray()
    more = True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        body.extend(message.get("body", b""))
        more = message.get("more_body", False)
        if len(body) > max_bytes:
            raise RequestError(413, f"request body exceeds {max_bytes} bytes")
    return bytes(body)


def decode_retrieve_request(body: bytes, limits: ServerLimits) -> tuple[list[str], int, bool]:
    """A raw ``/retrieve`` body → (queries, topk, return_scores); raises `RequestError` (400 for bad JSON)."""
    try:
        payload = json.loads(body)
    except RecursionError:
        raise RequestError(400, "request body is nested too deeply") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise RequestError(400, f"request body is not valid JSON: {str(error)[:200]}") from None
    except ValueError:  # an integer of more digits than Python converts (its message advises a server setting)
        raise RequestError(
            400,
            f"request body has an integer of more than {sys.get_int_max_str_digits()} digits; "
            'send small integers (e.g. "topk": 3)',
        ) from None
    return parse_retrieve_request(payload, limits)


def parse_retrieve_request(payload: object, limits: ServerLimits) -> tuple[list[str], int, bool]:
    """Validate a decoded ``/retrieve`` body → (queries, topk, return_scores); raises `RequestError`."""
    if not isinstance(payload, dict):
        raise RequestError(422, 'the body must be a JSON object like {"queries": ["..."], "topk": 3}')
    if "queries" not in payload:
        raise RequestError(422, "missing field 'queries' (a list of strings)")
    queries = payload["queries"]
    if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
        raise RequestError(422, "'queries' must be a list of strings (wrap a single query in a list)")
    if len(queries) > limits.max_queries:
        raise RequestError(
            413,
            f"{len(queries)} queries in one request; this server accepts at most {limits.max_queries} (split the batch)",
        )
    for position, query in enumerate(queries):
        if len(query) > limits.max_query_chars:
            raise RequestError(
                413,
                f"query {position} has {len(query)} characters; this server accepts at most {limits.max_query_chars}",
            )
    topk = payload.get("topk")
    if topk is None or topk == 0:
        topk = limits.default_topk
    if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= limits.max_topk:
        shown = repr(topk) if len(repr(topk)) <= 40 else f"{repr(topk)[:20]}... ({len(repr(topk))} characters)"
        raise RequestError(422, f"'topk' must be an integer from 1 to {limits.max_topk}, got {shown}")
    if len(queries) * topk > limits.max_hits:
        raise RequestError(
            413,
            f"{len(queries)} queries x topk {topk} = {len(queries) * topk} passages; this server "
            f"returns at most {limits.max_hits} per request (split the batch or lower topk)",
        )
    return_scores = payload.get("return_scores")
    if return_scores is None:
        return_scores = False
    if not isinstance(return_scores, bool):
        raise RequestError(422, f"'return_scores' must be true or false, got {return_scores!r}")
    return queries, topk, return_scores


def format_retrieve_response(results: list[list[Passage]], return_scores: bool) -> dict:
    """Search-R1's response as Python objects (for ``json.dumps``): hits as ``{"document", "score"}`` or as
    bare documents. The server writes the same JSON with `encode_retrieve_response`."""
    if return_scores:
        return {"result": [[{"document": p.to_document(), "score": p.score} for p in hits] for hits in results]}
    return {"result": [[p.to_document() for p in hits] for hits in results]}


def encode_retrieve_response(results: list[list[Passage]], return_scores: bool) -> bytes:
    """`format_retrieve_response` as compact UTF-8 JSON bytes, written directly (no dicts built).

    ``json.loads(encode_retrieve_response(r, s)) == format_retrieve_response(r, s)``; about twice as
    fast as ``json.dumps`` of the dicts. Raises ValueError on a non-finite score. A passage whose id
    or contents is not a string (a retriever outside stratarl) goes through ``json.dumps`` instead."""
    try:
        return _response_json(results, return_scores, json.encoder.encode_basestring).encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate (from a query echoed back): escape it, as json.dumps does
        return _response_json(results, return_scores, json.encoder.encode_basestring_ascii).encode("ascii")
    except TypeError:
        return json.dumps(format_retrieve_response(results, return_scores), allow_nan=False).encode("ascii")


def _response_json(results: list[list[Passage]], return_scores: bool, quote) -> str:
    """The response as JSON text, each string written by ``quote`` (a ``json.encoder`` string encoder)."""
    if return_scores:
        rows = [
            ",".join(
                f'{{"document":{{"id":{quote(p.id)},"contents":{quote(p.contents)}}},"score":{_json_score(p.score)}}}'
                for p in hits
            )
            for hits in results
        ]
    else:
        rows = [",".join(f'{{"id":{quote(p.id)},"contents":{quote(p.contents)}}}' for p in hits) for hits in results]
    return '{"result":[[' + "],[".join(rows) + "]]}" if rows else '{"result":[]}'


def _json_score(score: SupportsFloat | None) -> str:
    """A score as a JSON number (``null`` for None): the shortest repr that reads back as the same float."""
    if score is None:
        return "null"
    value = float(score)  # numpy scalars too (their repr is not JSON)
    if not math.isfinite(value):
        raise ValueError(f"the retriever returned a non-finite score ({value}); JSON has no such number")
    return repr(value)


def error_body(message: str) -> bytes:
    """The body of an error answer: ``{"error": message}`` as UTF-8 JSON."""
    return json.dumps({"error": message}, ensure_ascii=False).encode("utf-8", "backslashreplace")
