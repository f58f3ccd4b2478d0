"""The /retrieve server under malformed and oversized requests and clients that go away: a 400 with
a JSON body for every malformed request, a bound on passages per request, large requests searched
chunk by chunk so a small one is not stuck behind them, and a disconnect logged in one line."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time

import httpx
import pytest

from stratarl.retrieval.base import Passage
from stratarl.retrieval.batcher import MicroBatcher
from stratarl.retrieval.server import ServerThread, create_app


class EchoRetriever:
    """Passage i of query q is f"{q}#{i}"; records every call."""

    def __init__(self):
        self.calls: list[list[str]] = []
        self.release = threading.Event()
        self.release.set()

    def __len__(self):
        return 1

    def search(self, queries, k):
        self.calls.append(list(queries))
        assert self.release.wait(60), "never released (hang)"
        return [[Passage(f"{q}#{i}", f'"T"\n{q} {i}') for i in range(k)] for q in queries]


@pytest.fixture(scope="module")
def server():
    with ServerThread(create_app(EchoRetriever(), max_topk=10, max_hits=20)) as running:
        yield running


@pytest.mark.parametrize(
    "body",
    [
        b"[" * 100_000 + b"]" * 100_000,  # nested past the parser's recursion limit
        b'{"queries": ["a"], "topk": ' + b"9" * 5001 + b"}",  # an integer too long to convert
        b'{"queries": ["a"], "topk": 1e999}',
        b"\xff\xfe not json",
    ],
    ids=["deep nesting", "5001-digit topk", "infinite topk", "binary"],
)
def test_malformed_requests_get_a_4xx_with_a_json_error(server, body):
    response = httpx.post(f"{server.url}/retrieve", content=body, timeout=30)
    assert 400 <= response.status_code < 500
    assert isinstance(response.json()["error"], str) and len(response.json()["error"]) < 400


def test_passages_per_request_are_bounded(server):
    response = httpx.post(f"{server.url}/retrieve", json={"queries": ["a"] * 5, "topk": 5}, timeout=30)
    assert response.status_code == 413 and "at most 20" in response.json()["error"]
    ok = httpx.post(f"{server.url}/retrieve", json={"queries": ["a"] * 4, "topk": 5}, timeout=30)
    assert ok.status_code == 200 and len(ok.json()["result"]) == 4


def test_a_large_request_does_not_hold_the_retriever_from_a_small_one():
    retriever = EchoRetriever()
    batcher = MicroBatcher(retriever, max_batch_queries=2)

    async def scenario():
        retriever.release.clear()  # the first chunk of the large request blocks in the retriever
        big = asyncio.create_task(batcher.search([f"big{i}" for i in range(6)], 1))
        while not retriever.calls:
            await asyncio.sleep(0.001)
        small = asyncio.create_task(batcher.search(["small"], 1))
        await asyncio.sleep(0.01)
        retriever.release.set()
        return await big, await small

    big, small = asyncio.run(scenario())
    assert [hits[0].id for hits in big] == [f"big{i}#0" for i in range(6)] and small[0][0].id == "small#0"
    small_call = next(i for i, call in enumerate(retriever.calls) if "small" in call)
    last_big_call = max(i for i, call in enumerate(retriever.calls) if "big5" in call)
    assert small_call <= last_big_call  # answered before (or with) the large request's last chunk
    assert max(len(call) for call in retriever.calls) <= 3


def test_a_client_that_disconnects_mid_body_is_logged_in_one_line(server, caplog):
    caplog.set_level(logging.WARNING)
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(
            b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 1000\r\n\r\n{"queries": ['
        )
    deadline = time.monotonic() + 30
    while not any("disconnected" in r.getMessage() for r in caplog.records):
        assert time.monotonic() < deadline, "the disconnect was never logged"
        time.sleep(0.01)
    time.sleep(0.1)  # let any traceback that would follow reach the log
    records = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len([r for r in records if "disconnected" in r.getMessage()]) == 1
    assert not [r for r in records if r.exc_info or "Traceback" in r.getMessage()]


def test_a_small_request_waits_for_at_most_one_bulk_chunk_however_many_large_requests_wait():
    retriever = EchoRetriever()
    batcher = MicroBatcher(retriever, max_batch_queries=8, bulk_chunk_queries=2)

    async def scenario():
        retriever.release.clear()  # the first bulk chunk blocks in the retriever
        bigs = [asyncio.create_task(batcher.search([f"big{j}-{i}" for i in range(6)], 1)) for j in range(3)]
        while not retriever.calls:
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.01)  # the other large requests' first chunks are queued
        small = asyncio.create_task(batcher.search(["small"], 1))
        await asyncio.sleep(0.01)
        retriever.release.set()
        return [await b for b in bigs], await small

    bigs, small = asyncio.run(scenario())
    assert small[0][0].id == "small#0"
    assert all([h[0].id for h in big] == [f"big{j}-{i}#0" for i in range(6)] for j, big in enumerate(bigs))
    small_call = next(i for i, call in enumerate(retriever.calls) if "small" in call)
    assert small_call == 1  # the call right after the blocked one
    assert all(sum(q.startswith("big") for q in call) <= 2 for call in retriever.calls)  # one chunk per call


def _eof_or_reset(sock: socket.socket) -> bool:
    """Whether the server closed ``sock`` (reads EOF or a reset) within the socket's timeout."""
    try:
        while True:
            data = sock.recv(4096)
            if not data:
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def test_slow_clients_are_closed_while_normal_clients_are_served():
    retriever = EchoRetriever()
    with ServerThread(create_app(retriever), request_timeout_s=0.5) as running:
        host, port = running.url.removeprefix("http://").split(":")
        starts = [
            b"POST /retrieve HTTP/1.1\r\nHo",  # headers byte by byte
            b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{",  # a body that never ends
            b"",
        ]  # connects and says nothing
        slow = [socket.create_connection((host, int(port))) for _ in range(100)]
        for i, sock in enumerate(slow):
            sock.sendall(starts[i % 3])
        stop = threading.Event()

        def trickle():  # one more byte to each slow socket, again and again, until the server closes them
            while not stop.is_set():
                for sock in slow[:2] + slow[3:5]:
                    with contextlib.suppress(OSError):
                        sock.send(b"s")
                time.sleep(0.05)

        threading.Thread(target=trickle, daemon=True).start()
        try:
            for _ in range(3):  # normal clients are served meanwhile
                ok = httpx.post(
                    f"{running.url}/retrieve", json={"queries": ["a"], "topk": 1, "return_scores": True}, timeout=30
                )
                assert ok.status_code == 200 and ok.json()["result"][0][0]["document"]["id"] == "a#0"
            for sock in slow:
                sock.settimeout(30)  # bounds a hang only: the server closes them after 0.5 s
                assert _eof_or_reset(sock)
        finally:
            stop.set()
            for sock in slow:
                sock.close()
        # A request that has arrived is never cut, however long its search takes.
        retriever.release.clear()
        threading.Timer(1.5, retriever.release.set).start()
        slow_search = httpx.post(
            f"{running.url}/retrieve", json={"queries": ["b"], "topk": 1, "return_scores": True}, timeout=30
        )
        assert slow_search.status_code == 200 and slow_search.json()["result"][0][0]["document"]["id"] == "b#0"


def test_a_bad_request_timeout_is_one_clear_error():
    from stratarl.retrieval.slow_clients import check_request_timeout

    for bad in (0, -1, float("nan"), "5", True):
        with pytest.raises(ValueError, match=r"--request-timeout .*positive number of seconds. Fix: use e.g. 5"):
            check_request_timeout(bad)
    assert check_request_timeout(2) == 2.0
