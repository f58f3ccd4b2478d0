"""The ``/retrieve`` HTTP server (Search-R1's protocol, `stratarl.retrieval.protocol`) and a thread runner.

``POST /retrieve`` is one raw ASGI handler (`RetrieveEndpoint`: no framework request or response objects,
the response JSON written by `encode_retrieve_response`); concurrent requests share retriever calls
(`MicroBatcher`). FastAPI serves ``GET /health`` (status, retriever, limits and batching counters) and
the JSON 404 / 405 answers. Several processes on one port: `stratarl.retrieval.workers`.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Sized
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from stratarl.retrieval.base import Retriever
from stratarl.retrieval.batcher import MicroBatcher
from stratarl.retrieval.protocol import (
    RequestError,
    ServerLimits,
    decode_retrieve_request,
    encode_retrieve_response,
    error_body,
    receive_body,
)
from stratarl.retrieval.slow_clients import DEFAULT_REQUEST_TIMEOUT_S, request_timeout_protocol

if TYPE_CHECKING:
    import uvicorn

logger = logging.getLogger("stratarl.server")

_JSON_HEADERS = [(b"content-type", b"application/json")]


class RetrieveEndpoint:
    """``POST /retrieve`` as an ASGI app: the body read within ``limits.max_body_bytes``, validated
    (`decode_retrieve_request`), searched through ``batcher`` and answered with `encode_retrieve_response`.

    A bad request gets its 4xx and ``{"error": message}``, a retriever failure a 500; a client that
    disconnects before its body arrives is logged in one line and gets no answer."""

    def __init__(self, batcher: MicroBatcher, limits: ServerLimits) -> None:
        self.batcher = batcher
        self.limits = limits

    async def __call__(self, scope, receive, send) -> None:
        status, body = await self._answer(scope, receive)
        if status is None:
            return  # the client is gone: nobody to answer
        headers = [*_JSON_HEADERS, (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _answer(self, scope, receive) -> tuple[int | None, bytes]:
        try:
            body = await receive_body(scope, receive, self.limits.max_body_bytes)
            if body is None:
                _log_disconnect(scope.get("client"))
                return None, b""
            queries, topk, return_scores = decode_retrieve_request(body, self.limits)
        except RequestError as error:
            return error.status, error_body(error.message)
        try:
            results = await self.batcher.search(queries, topk)
            return 200, encode_retrieve_response(results, return_scores)
        except Exception as error:  # noqa: BLE001  any retriever error is the client's 500, the server goes on
            return 500, error_body(f"retriever failed: {type(error).__name__}: {error}")


def _log_disconnect(client: tuple | None) -> None:
    who = f"{client[0]}:{client[1]}" if client else "a client"
    logger.warning("%s disconnected before sending its whole request; nothing was searched", who)


class RetrievalApp:
    """The ASGI app `create_app` returns: ``POST /retrieve`` goes straight to ``retrieve`` (a
    `RetrieveEndpoint`), everything else (``/health``, 404 / 405, lifespan) to the FastAPI app ``app``."""

    def __init__(self, app, retrieve: RetrieveEndpoint) -> None:
        self.app = app
        self.retrieve = retrieve

    @property
    def state(self):
        return self.app.state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] == "/retrieve" and scope["method"] == "POST":
            await self.retrieve(scope, receive, send)
        else:
            await self.app(scope, receive, send)


def create_app(retriever: Retriever, *, fast_path: bool = True, **limits):
    """An ASGI app serving ``retriever`` over Search-R1's ``/retrieve`` protocol, plus ``/health``.

    ``limits``: `ServerLimits` fields (``default_topk=3``, ``max_queries=4096``, ``max_query_chars=2048``,
    ``max_topk=100``, ``max_body_bytes``, ``max_batch_queries``, ``max_hits``; the defaults are its own).
    Every malformed request gets a 4xx with ``{"error": message}``; a client that disconnects before
    its body arrives is logged in one line (logger ``stratarl.server``). ``/retrieve`` is always answered
    by the same `RetrieveEndpoint`: with ``fast_path`` (the default) a `RetrievalApp` hands it the request
    before FastAPI; ``fast_path=False`` reaches it through FastAPI / Starlette's middleware and routing
    (same answers, more time per request: for comparisons)."""
    server_limits = ServerLimits(**limits)
    batcher = MicroBatcher(retriever, max_batch_queries=server_limits.max_batch_queries)
    retrieve = RetrieveEndpoint(batcher, server_limits)
    app = _fastapi_app(retriever, retrieve)
    return RetrievalApp(app, retrieve) if fast_path else app


def _fastapi_app(retriever: Retriever, retrieve: RetrieveEndpoint):
    """The FastAPI app: ``POST /retrieve`` (``retrieve``), ``GET /health``, JSON 404 / 405, the batcher's shutdown."""
    # fastapi takes 0.6 s to import: only when a server is made, so `import stratarl.retrieval` stays light
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse  # fastapi: only when a server is made
    from starlette.exceptions import HTTPException as StarletteHTTPException  # fastapi's: only when a server is made

    batcher, limits = retrieve.batcher, retrieve.limits

    @asynccontextmanager
    async def lifespan(app):
        yield
        await batcher.aclose()

    app = FastAPI(title="stratarl retrieval server", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.batcher = batcher
    app.state.limits = limits

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, error):  # 404 / 405 as JSON {"error"} like every other error
        return JSONResponse({"error": str(error.detail)}, status_code=error.status_code)

    async def health(request):
        size = len(retriever) if isinstance(retriever, Sized) else None
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

    # An ASGI object as the endpoint: Starlette passes it the raw request, so every bad request gets our
    # {"error"} JSON and a precise status instead of pydantic's 422 format.
    app.router.add_route("/retrieve", retrieve, methods=["POST"])  # type: ignore[arg-type]  # an ASGI endpoint
    app.router.add_route("/health", health, methods=["GET"])
    return app


@dataclass
class ServerThread:
    """Runs an ASGI app with uvicorn in a background thread on ``host:port`` (port 0 = a free one).

    For tests, benchmarks and in-process servers: ``with ServerThread(app) as server: server.url``.
    """

    app: Any  # an ASGI app (create_app's)
    host: str = "127.0.0.1"
    port: int = 0
    log_level: str = "warning"
    graceful_shutdown_s: float = 1.0
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S
    """A connection that has not delivered a whole request within this many seconds is closed (slow_clients)."""
    _server: uvicorn.Server | None = field(default=None, init=False, repr=False)
    _thread: threading.Thread | None = field(default=None, init=False, repr=False)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> ServerThread:
        import uvicorn  # here: `import stratarl.retrieval` does not load the HTTP server

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.app,
            log_level=self.log_level,
            lifespan="on",
            backlog=256,
            timeout_graceful_shutdown=self.graceful_shutdown_s,  # type: ignore[arg-type]  # seconds; a float works
            http=request_timeout_protocol(self.request_timeout_s),
        )
        server = self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not server.started:
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


def serve(
    retriever: Retriever,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
    **limits,
) -> None:
    """Serve ``retriever`` on ``host:port`` until interrupted (blocking); limits as in `create_app`; a
    connection without a whole request after ``request_timeout_s`` is closed (`request_timeout_protocol`)."""
    import uvicorn  # here: `import stratarl.retrieval` does not load the HTTP server

    sock = bound_socket(host, port)  # bound here: a port in use is an OSError for the caller, not uvicorn's exit
    config = uvicorn.Config(
        create_app(retriever, **limits), log_level=log_level, http=request_timeout_protocol(request_timeout_s)
    )
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
