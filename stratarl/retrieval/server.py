"""The ``/retrieve`` HTTP server (Search-R1's protocol) with a micro-batcher, and a thread runner.

POST /retrieve  ``{"queries": [...], "topk": 3, "return_scores": true}`` →
``{"result": [[{"document": {"id", "contents"}, "score": s}, ...], ...]}`` (one list per query, in
request order); with ``return_scores`` false or absent (Search-R1's default) each hit is the bare
document. ``topk`` missing, null or 0 means the server's default (as in Search-R1's server).
GET /health → status, retriever, limits and batching counters.

Concurrent requests are not answered one by one: they wait in an asyncio queue, and one worker
runs the retriever (in a thread, so the event loop keeps accepting requests) on all the queries
that arrived meanwhile, then splits the results. While one retriever call runs, the next batch
gathers, so N concurrent clients cost a handful of calls instead of N serial ones.

``POST /retrieve`` is served from the raw ASGI messages (`RetrievalApp`: no framework objects, the
response JSON written directly); FastAPI serves ``/health`` and the JSON 404 / 405 answers. Several
processes on one port: `stratarl.retrieval.workers`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field

from stratarl.retrieval.base import Passage, Retriever
from stratarl.retrieval.slow_clients import DEFAULT_REQUEST_TIMEOUT_S, request_timeout_protocol

logger = logging.getLogger("stratarl.server")


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
        for name, value in asdict(self).items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ServerLimits.{name} must be a positive integer, got {value!r}")
        if self.default_topk > self.max_topk:
            raise ValueError(f"default_topk ({self.default_topk}) must be <= max_topk ({self.max_topk})")


class RequestError(Exception):
    """A bad request: answered with ``status`` and ``{"error": message}``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


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
            413, f"{len(queries)} queries in one request; this server accepts at most {limits.max_queries} (split the batch)"
        )
    for position, query in enumerate(queries):
        if len(query) > limits.max_query_chars:
            raise RequestError(
                413, f"query {position} has {len(query)} characters; this server accepts at most {limits.max_query_chars}"
            )
    topk = payload.get("topk")
    if topk is None or topk == 0:
        topk = limits.default_topk
    if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= limits.max_topk:
        shown = repr(topk) if len(repr(topk)) <= 40 else f"{repr(topk)[:20]}... ({len(repr(topk))} characters)"
        raise RequestError(422, f"'topk' must be an integer from 1 to {limits.max_topk}, got {shown}")
    if len(queries) * topk > limits.max_hits:
        raise RequestError(413, f"{len(queries)} queries x topk {topk} = {len(queries) * topk} passages; this server "
                                f"returns at most {limits.max_hits} per request (split the batch or lower topk)")
    return_scores = payload.get("return_scores")
    if return_scores is None:
        return_scores = False
    if not isinstance(return_scores, bool):
        raise RequestError(422, f"'return_scores' must be true or false, got {return_scores!r}")
    return queries, topk, return_scores


def _json_score(score: object) -> str:
    if score is None:
        return "null"
    value = float(score)  # numpy scalars too (their repr is not JSON)
    if not math.isfinite(value):
        raise ValueError(f"the retriever returned a non-finite score ({value}); JSON has no such number")
    return repr(value)


def encode_retrieve_response(results: list[list[Passage]], return_scores: bool) -> bytes:
    """`format_retrieve_response` as compact UTF-8 JSON bytes, written directly (no dicts built).

    ``json.loads(encode_retrieve_response(r, s)) == format_retrieve_response(r, s)``; about twice as
    fast as ``json.dumps`` of the dicts. Raises ValueError on a non-finite score. A passage whose id
    or contents is not a string (a retriever outside stratarl) goes through ``json.dumps`` instead."""
    try:
        return _encode_response(results, return_scores, json.encoder.encode_basestring).encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate (from a query echoed back): escape it, as json.dumps does
        return _encode_response(results, return_scores, json.encoder.encode_basestring_ascii).encode("ascii")
    except TypeError:
        return json.dumps(format_retrieve_response(results, return_scores), allow_nan=False).encode("ascii")


def _encode_response(results: list[list[Passage]], return_scores: bool, quote) -> str:
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


def format_retrieve_response(results: list[list[Passage]], return_scores: bool) -> dict:
    """Search-R1's response: hits as ``{"document", "score"}`` or as bare documents."""
    if return_scores:
        return {
            "result": [[{"document": p.to_document(), "score": p.score} for p in hits] for hits in results]
        }
    return {"result": [[p.to_document() for p in hits] for hits in results]}


@dataclass
class _Pending:
    queries: list[str]
    k: int
    future: asyncio.Future


@dataclass
class BatcherStats:
    requests: int = 0
    queries: int = 0
    retriever_calls: int = 0
    largest_call: int = 0
    errors: int = 0


class MicroBatcher:
    """Gathers concurrent searches into few retriever calls, run one at a time in a worker thread.

    Requests that arrive while a call runs are merged (up to ``max_batch_queries`` queries, one
    retriever call per distinct k) into the next call; each request gets back exactly its own
    slice, in order. A request of more than ``bulk_chunk_queries`` queries is *bulk*: it is searched
    one chunk of that size at a time, and a retriever call takes every waiting small request but at
    most one bulk chunk, so a small request waits for at most one call of about ``bulk_chunk_queries``
    queries however many large requests are in flight. The queues and the worker are created on first
    use in the running loop.
    """

    def __init__(self, retriever: Retriever, *, max_batch_queries: int = 1024, bulk_chunk_queries: int = 256) -> None:
        self.retriever = retriever
        self.max_batch_queries = max_batch_queries
        self.chunk_queries = max(1, min(max_batch_queries, bulk_chunk_queries))
        self.stats = BatcherStats()
        self._small: asyncio.Queue | None = None
        self._bulk: asyncio.Queue | None = None
        self._ready: asyncio.Event | None = None
        self._worker: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stratarl-retriever")

    async def search(self, queries: list[str], k: int) -> list[list[Passage]]:
        """Results of ``queries`` in order (a bulk request chunk by chunk, each behind the small requests
        that arrived meanwhile)."""
        self.stats.requests += 1
        if len(queries) <= self.chunk_queries:
            return await self._submit(queries, k, bulk=False)
        results: list[list[Passage]] = []
        for start in range(0, len(queries), self.chunk_queries):
            results.extend(await self._submit(queries[start : start + self.chunk_queries], k, bulk=True))
        return results

    async def _submit(self, queries: list[str], k: int, *, bulk: bool) -> list[list[Passage]]:
        if not queries:
            return []
        loop = asyncio.get_running_loop()
        if self._worker is None or self._worker.done() or self._loop is not loop:
            # (Re)start in this loop: an app can outlive the loop it first ran in (test clients).
            self._small, self._bulk, self._ready, self._loop = asyncio.Queue(), asyncio.Queue(), asyncio.Event(), loop
            self._worker = loop.create_task(self._run())
        future = loop.create_future()
        self.stats.queries += len(queries)
        (self._bulk if bulk else self._small).put_nowait(_Pending(queries, k, future))
        self._ready.set()
        return await future

    async def _run(self) -> None:
        assert self._small is not None and self._bulk is not None and self._ready is not None
        while True:
            await self._ready.wait()
            batch, size = [], 0
            while not self._small.empty() and size < self.max_batch_queries:
                batch.append(self._small.get_nowait())
                size += len(batch[-1].queries)
            if not self._bulk.empty() and size < self.max_batch_queries:
                batch.append(self._bulk.get_nowait())  # at most one bulk chunk per call
            if self._small.empty() and self._bulk.empty():
                self._ready.clear()
            for k in sorted({item.k for item in batch}):
                await self._answer([item for item in batch if item.k == k], k)

    async def _answer(self, group: list[_Pending], k: int) -> None:
        queries = [q for item in group for q in item.queries]
        self.stats.retriever_calls += 1
        self.stats.largest_call = max(self.stats.largest_call, len(queries))
        try:
            loop = asyncio.get_running_loop()
            results = await loop.run_in_executor(self._executor, self.retriever.search, queries, k)
            if len(results) != len(queries):
                raise RuntimeError(f"retriever returned {len(results)} result lists for {len(queries)} queries")
        except Exception as error:  # every waiting request gets the error, the worker goes on
            self.stats.errors += 1
            for item in group:
                if not item.future.done():
                    item.future.set_exception(error)
            return
        offset = 0
        for item in group:
            if not item.future.done():  # a client that went away has a cancelled future
                item.future.set_result(results[offset : offset + len(item.queries)])
            offset += len(item.queries)

    async def aclose(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            try:
                await self._worker
            except asyncio.CancelledError:
                pass
        self._executor.shutdown(wait=False)


def _error(status: int, message: str):
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": message}, status_code=status)


async def _read_body(request, max_bytes: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise RequestError(413, f"request body is {declared} bytes; this server accepts at most {max_bytes}")
    body = bytearray()
    async for chunk in request.stream():
        body.extend(chunk)
        if len(body) > max_bytes:
            raise RequestError(413, f"request body exceeds {max_bytes} bytes")
    return bytes(body)


async def _receive_body(scope: dict, receive, max_bytes: int) -> bytes | None:
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
    except ValueError as error:  # JSONDecodeError, UnicodeDecodeError, an integer of > 4300 digits
        raise RequestError(400, f"request body is not valid JSON: {str(error)[:200]}") from None
    return parse_retrieve_request(payload, limits)


def _log_disconnect(client: tuple | None) -> None:
    who = f"{client[0]}:{client[1]}" if client else "a client"
    logger.warning("%s disconnected before sending its whole request; nothing was searched", who)


_JSON_HEADERS = [(b"content-type", b"application/json")]


class RetrievalApp:
    """The ASGI app `create_app` returns: ``POST /retrieve`` is answered here from the raw ASGI messages
    (no framework request or response objects, the response JSON written by `encode_retrieve_response`),
    everything else (``/health``, 404 / 405, lifespan) goes to the FastAPI app ``app``."""

    def __init__(self, app, batcher: MicroBatcher, limits: ServerLimits) -> None:
        self.app = app
        self.batcher = batcher
        self.limits = limits

    @property
    def state(self):
        return self.app.state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] != "/retrieve" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        status, body = await self._retrieve(scope, receive)
        if status is None:
            return  # the client is gone: nobody to answer
        headers = [*_JSON_HEADERS, (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _retrieve(self, scope, receive) -> tuple[int | None, bytes]:
        try:
            body = await _receive_body(scope, receive, self.limits.max_body_bytes)
            if body is None:
                _log_disconnect(scope.get("client"))
                return None, b""
            queries, topk, return_scores = decode_retrieve_request(body, self.limits)
        except RequestError as error:
            return error.status, _error_body(error.message)
        try:
            results = await self.batcher.search(queries, topk)
            return 200, encode_retrieve_response(results, return_scores)
        except Exception as error:
            return 500, _error_body(f"retriever failed: {type(error).__name__}: {error}")


def _error_body(message: str) -> bytes:
    return json.dumps({"error": message}, ensure_ascii=False).encode("utf-8", "backslashreplace")


def create_app(
    retriever: Retriever,
    *,
    default_topk: int = 3,
    max_queries: int = 4096,
    max_query_chars: int = 2048,
    max_topk: int = 100,
    max_body_bytes: int = 16 * 1024 * 1024,
    max_batch_queries: int = 1024,
    max_hits: int = 16384,
    fast_path: bool = True,
):
    """An ASGI app serving ``retriever`` over Search-R1's ``/retrieve`` protocol, plus ``/health``.

    Every malformed request gets a 4xx with ``{"error": message}``; a client that disconnects before
    its body arrives is logged in one line (logger ``stratarl.server``). With ``fast_path`` (the
    default) ``/retrieve`` is a `RetrievalApp` in front of FastAPI; ``fast_path=False`` routes it
    through FastAPI / Starlette too (same answers, more time per request: for comparisons)."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    limits = ServerLimits(
        default_topk=default_topk,
        max_queries=max_queries,
        max_query_chars=max_query_chars,
        max_topk=max_topk,
        max_body_bytes=max_body_bytes,
        max_batch_queries=max_batch_queries,
        max_hits=max_hits,
    )
    batcher = MicroBatcher(retriever, max_batch_queries=limits.max_batch_queries)

    @asynccontextmanager
    async def lifespan(app):
        yield
        await batcher.aclose()

    app = FastAPI(title="stratarl retrieval server", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.batcher = batcher
    app.state.limits = limits

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, error):  # 404 / 405 as JSON {"error"} like every other error
        return _error(error.status_code, str(error.detail))

    # Plain Starlette routes: the handler reads and validates the raw body itself, so every bad
    # request gets our {"error"} JSON and a precise status instead of pydantic's 422 format.
    async def retrieve(request):
        from starlette.requests import ClientDisconnect
        from starlette.responses import Response

        try:
            body = await _read_body(request, limits.max_body_bytes)
            queries, topk, return_scores = decode_retrieve_request(body, limits)
        except RequestError as error:
            return _error(error.status, error.message)
        except ClientDisconnect:
            _log_disconnect((request.client.host, request.client.port) if request.client else None)
            return Response(status_code=400)
        try:
            results = await batcher.search(queries, topk)
        except Exception as error:
            return _error(500, f"retriever failed: {type(error).__name__}: {error}")
        return JSONResponse(format_retrieve_response(results, return_scores))

    async def health(request):
        size = len(retriever) if hasattr(retriever, "__len__") else None
        return JSONResponse(
            {
                "status": "ok",
                "retriever": repr(retriever),
                "num_passages": size,
                "pid": os.getpid(),
                "limits": asdict(limits),
                "stats": asdict(batcher.stats),
            }
        )

    app.router.add_route("/retrieve", retrieve, methods=["POST"])
    app.router.add_route("/health", health, methods=["GET"])
    return RetrievalApp(app, batcher, limits) if fast_path else app


@dataclass
class ServerThread:
    """Runs an ASGI app with uvicorn in a background thread on ``host:port`` (port 0 = a free one).

    For tests, benchmarks and in-process servers: ``with ServerThread(app) as server: server.url``.
    """

    app: object
    host: str = "127.0.0.1"
    port: int = 0
    log_level: str = "warning"
    graceful_shutdown_s: float = 1.0
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S
    """A connection that has not delivered a whole request within this many seconds is closed (slow_clients)."""
    _server: object = field(default=None, init=False, repr=False)
    _thread: threading.Thread | None = field(default=None, init=False, repr=False)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> ServerThread:
        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.app,
            log_level=self.log_level,
            lifespan="on",
            backlog=256,
            timeout_graceful_shutdown=self.graceful_shutdown_s,
            http=request_timeout_protocol(self.request_timeout_s),
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server on {self.url} did not start within {timeout_s} s")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()


def serve(retriever: Retriever, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
          request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S, **limits) -> None:
    """Serve ``retriever`` on ``host:port`` until interrupted (blocking); limits as in `create_app`; a
    connection without a whole request after ``request_timeout_s`` is closed (`request_timeout_protocol`)."""
    import uvicorn

    sock = bound_socket(host, port)  # bound here: a port in use is an OSError for the caller, not uvicorn's exit
    config = uvicorn.Config(create_app(retriever, **limits), log_level=log_level,
                            http=request_timeout_protocol(request_timeout_s))
    uvicorn.Server(config).run(sockets=[sock])


def bound_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (IPv4 or IPv6, as ``host`` resolves), not yet listening.
    proto=IPPROTO_TCP, as uvicorn's own: asyncio turns Nagle off only on sockets whose proto says TCP."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock
