"""RemoteRetriever against real HTTP servers that fail, stall, reject, or are not there."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from stratarl.retrieval.base import Passage, RetrievalError, Retriever
from stratarl.retrieval.remote import RemoteRetriever, normalize_retrieve_url, parse_retrieve_response
from stratarl.retrieval.server import ServerThread


def scripted_app(failures: list[str], *, stall_s: float = 1.0):
    """A /retrieve server that plays ``failures`` (one per request: "500", "422", "stall") then answers.

    It echoes each query back as a passage with id = the query, so order can be checked.
    """
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    app = FastAPI()
    app.state.calls = []

    async def retrieve(request):
        body = await request.json()
        app.state.calls.append(body)
        step = failures[len(app.state.calls) - 1] if len(app.state.calls) <= len(failures) else "ok"
        if step == "500":
            return JSONResponse({"error": "boom"}, status_code=500)
        if step == "422":
            return JSONResponse({"error": "'topk' must be an integer"}, status_code=422)
        if step == "stall":
            await asyncio.sleep(stall_s)
        hits = [[{"document": {"id": q, "contents": f'"{q}"\ntext'}, "score": 1.0}] for q in body["queries"]]
        return JSONResponse({"result": hits})

    app.router.add_route("/retrieve", retrieve, methods=["POST"])
    return app


def test_recovers_after_server_errors():
    app = scripted_app(["500", "500"])
    with ServerThread(app) as server, RemoteRetriever(server.url, max_retries=3, backoff_s=0.01) as client:
        assert isinstance(client, Retriever)
        results = client.search(["q1", "q2"], k=1)
    assert [[p.id for p in hits] for hits in results] == [["q1"], ["q2"]]
    assert len(app.state.calls) == 3 and client.num_retries == 2


def test_gives_up_after_the_last_retry_with_a_clear_error():
    app = scripted_app(["500"] * 10)
    with ServerThread(app) as server, RemoteRetriever(server.url, max_retries=2, backoff_s=0.01) as client:
        with pytest.raises(RetrievalError) as info:
            client.search(["q"], k=3)
    assert len(app.state.calls) == 3  # 1 try + 2 retries
    message = str(info.value)
    assert f"POST {server.url}/retrieve failed after 3 attempt(s)" in message
    assert "HTTP 500" in message and "boom" in message and "stratarl serve" in message


def test_timeouts_are_retried_then_reported():
    app = scripted_app(["stall"], stall_s=1.0)
    with (
        ServerThread(app) as server,
        RemoteRetriever(server.url, timeout_s=0.2, max_retries=1, backoff_s=0.01) as client,
    ):
        assert [hits[0].id for hits in client.search(["a"], k=1)] == ["a"]
        assert len(app.state.calls) == 2
    app = scripted_app(["stall"] * 5, stall_s=1.0)
    with (
        ServerThread(app) as server,
        RemoteRetriever(server.url, timeout_s=0.2, max_retries=1, backoff_s=0.01) as client,
    ):
        with pytest.raises(RetrievalError, match=r"failed after 2 attempt\(s\).*timed out after 0.2 s"):
            client.search(["a"], k=1)


def test_backoff_doubles():
    app = scripted_app(["500"] * 3)
    with ServerThread(app) as server, RemoteRetriever(server.url, max_retries=2, backoff_s=0.15) as client:
        start = time.perf_counter()
        with pytest.raises(RetrievalError):
            client.search(["q"], k=1)
        elapsed = time.perf_counter() - start
    assert elapsed >= 0.15 + 0.30  # sleeps of backoff_s · 2^0 and · 2^1 before the two retries


def test_bad_request_is_not_retried():
    app = scripted_app(["422"])
    with ServerThread(app) as server, RemoteRetriever(server.url, max_retries=3, backoff_s=0.01) as client:
        with pytest.raises(RetrievalError, match="rejected with HTTP 422.*topk"):
            client.search(["q"], k=1)
    assert len(app.state.calls) == 1


def test_unreachable_server():
    with socket.socket() as sock:  # a port nothing listens on once the socket is closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with RemoteRetriever(f"http://127.0.0.1:{port}", max_retries=1, backoff_s=0.01, timeout_s=2) as client:
        with pytest.raises(RetrievalError, match=r"failed after 2 attempt\(s\).*ConnectError.*Is the server running"):
            client.search(["q"], k=1)


def test_batches_keep_query_order():
    app = scripted_app([])
    queries = [f"q{i}" for i in range(5)]
    with ServerThread(app) as server, RemoteRetriever(server.url, batch_size=2) as client:
        results = client.search(queries, k=2)
        assert client.search([], k=2) == []
    assert [hits[0].id for hits in results] == queries
    assert [call["queries"] for call in app.state.calls] == [["q0", "q1"], ["q2", "q3"], ["q4"]]
    assert all(call["topk"] == 2 and call["return_scores"] is True for call in app.state.calls)


def test_parse_both_response_shapes():
    with_scores = {"result": [[{"document": {"id": "1", "contents": '"T"\nx'}, "score": 0.5}], []]}
    assert parse_retrieve_response(with_scores, 2) == [[Passage("1", '"T"\nx', 0.5)], []]
    bare = {"result": [[{"id": "1", "contents": '"T"\nx', "title": "T"}]]}
    assert parse_retrieve_response(bare, 1) == [[Passage("1", '"T"\nx')]]
    # Pyserini-style servers without stored contents send title/text.
    assert parse_retrieve_response({"result": [[{"id": 3, "title": "T", "text": "x"}]]}, 1) == [
        [Passage("3", '"T"\nx')]
    ]
    with pytest.raises(RetrievalError, match="sent 2 queries but got 1 result lists"):
        parse_retrieve_response({"result": [[]]}, 2)
    with pytest.raises(RetrievalError, match="'result' list"):
        parse_retrieve_response({"detail": "nope"}, 1)
    with pytest.raises(RetrievalError, match="needs a document with 'contents'"):
        parse_retrieve_response({"result": [[{"id": "1"}]]}, 1)


def test_url_and_argument_validation():
    assert normalize_retrieve_url("http://127.0.0.1:8000") == "http://127.0.0.1:8000/retrieve"
    assert normalize_retrieve_url("http://h:1/") == "http://h:1/retrieve"
    assert normalize_retrieve_url("https://h/api/search") == "https://h/api/search"
    with pytest.raises(ValueError, match="must look like"):
        normalize_retrieve_url("127.0.0.1:8000")
    with pytest.raises(ValueError, match="timeout_s > 0"):
        RemoteRetriever("http://127.0.0.1:1", timeout_s=0)
    with pytest.raises(ValueError, match="k must be a positive integer"):
        RemoteRetriever("http://127.0.0.1:1").search(["q"], k=0)
