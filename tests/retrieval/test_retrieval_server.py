"""The /retrieve server over real HTTP on a loopback port: protocol, bad requests, concurrency, batching."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from stratarl.retrieval.base import Passage
from stratarl.retrieval.protocol import RequestError, ServerLimits, parse_retrieve_request
from stratarl.retrieval.remote import RemoteRetriever
from stratarl.retrieval.server import ServerThread, create_app


class SlowRetriever:
    """Wraps a retriever, sleeps per call and records each call's queries (to observe batching)."""

    def __init__(self, inner, delay_s: float = 0.0, fail_on: str | None = None) -> None:
        self.inner, self.delay_s, self.fail_on = inner, delay_s, fail_on
        self.calls: list[list[str]] = []
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.inner)

    def search(self, queries: list[str], k: int) -> list[list[Passage]]:
        with self.lock:
            self.calls.append(list(queries))
        time.sleep(self.delay_s)
        if self.fail_on is not None and self.fail_on in queries:
            raise RuntimeError("index file vanished")
        return self.inner.search(queries, k)


@pytest.fixture(scope="module")
def server(bm25_retriever):
    app = create_app(bm25_retriever, max_queries=8, max_query_chars=100, max_topk=5, max_body_bytes=4000)
    with ServerThread(app) as running:
        yield running


def post(server, payload=None, **kwargs):
    if payload is not None:
        kwargs["json"] = payload
    return httpx.post(server.url + "/retrieve", timeout=10, **kwargs)


def test_response_with_scores_matches_the_retriever(server, bm25_retriever):
    queries = ["capital of France", "cats as pets", "zzzz"]
    response = post(server, {"queries": queries, "topk": 2, "return_scores": True})
    assert response.status_code == 200
    expected = bm25_retriever.search(queries, 2)
    assert response.json() == {
        "result": [
            [{"document": {"id": p.id, "contents": p.contents}, "score": p.score} for p in hits] for hits in expected
        ]
    }
    assert response.json()["result"][2] == []


def test_bare_documents_and_defaults(server, bm25_retriever):
    # Search-R1's server: return_scores defaults to false, a missing/null/0 topk means the default (3).
    for payload in (
        {"queries": ["capital"]},
        {"queries": ["capital"], "topk": None},
        {"queries": ["capital"], "topk": 0, "return_scores": False},
    ):
        result = post(server, payload).json()["result"]
        assert result == [[p.to_document() for p in bm25_retriever.search(["capital"], 3)[0]]]
    assert post(server, {"queries": []}).json() == {"result": []}


@pytest.mark.parametrize(
    ("payload", "status", "fragment"),
    [
        (b"{not json", 400, "not valid JSON"),
        (b"\xff\xfe", 400, "not valid JSON"),
        ([1, 2], 422, "JSON object"),
        ({"topk": 3}, 422, "missing field 'queries'"),
        ({"queries": "capital"}, 422, "list of strings"),
        ({"queries": ["ok", 3]}, 422, "list of strings"),
        ({"queries": ["q"], "topk": -1}, 422, "from 1 to 5"),
        ({"queries": ["q"], "topk": 6}, 422, "from 1 to 5"),
        ({"queries": ["q"], "topk": "3"}, 422, "from 1 to 5"),
        ({"queries": ["q"], "topk": True}, 422, "from 1 to 5"),
        ({"queries": ["q"], "return_scores": "yes"}, 422, "true or false"),
        ({"queries": ["q"] * 9}, 413, "at most 8"),
        ({"queries": ["x" * 101]}, 413, "query 0 has 101 characters"),
        (b'{"queries": ["' + b"y" * 5000 + b'"]}', 413, "at most 4000"),
    ],
)
def test_bad_requests_get_4xx_and_a_json_error(server, payload, status, fragment):
    response = post(server, content=payload) if isinstance(payload, bytes) else post(server, payload)
    assert response.status_code == status
    assert fragment in response.json()["error"]
    assert "sys." not in response.json()["error"]  # no Python advice meant for the server's operator


def test_unknown_routes_and_methods_are_json_errors(server):
    assert (httpx.get(server.url + "/nope").status_code, httpx.get(server.url + "/nope").json()) == (
        404,
        {"error": "Not Found"},
    )
    assert httpx.get(server.url + "/retrieve").status_code == 405
    assert "error" in httpx.get(server.url + "/retrieve").json()


def test_health(server):
    body = httpx.get(server.url + "/health").json()
    assert body["status"] == "ok" and body["num_passages"] == 8
    assert body["limits"]["max_queries"] == 8 and body["limits"]["default_topk"] == 3
    assert {"requests", "queries", "retriever_calls"} <= set(body["stats"])


def test_32_concurrent_clients_are_batched_and_answered_in_order(bm25_retriever):
    slow = SlowRetriever(bm25_retriever, delay_s=0.05)
    words = ["capital", "France", "cat", "mountain", "music", "energy", "running", "python"]
    requests = [[f"{words[(i + j) % 8]} {i}" for j in range(1 + i % 3)] for i in range(32)]
    barrier = threading.Barrier(32)
    with ServerThread(create_app(slow)) as running, RemoteRetriever(running.url, timeout_s=30, max_retries=0) as client:

        def one_client(queries):
            barrier.wait()
            return client.search(queries, k=2)

        with ThreadPoolExecutor(32) as pool:
            answers = list(pool.map(one_client, requests))
        stats = httpx.get(running.url + "/health").json()["stats"]
    assert answers == [bm25_retriever.search(queries, 2) for queries in requests]  # each gets its own, in order
    assert stats["requests"] == 32 and stats["errors"] == 0
    assert stats["queries"] == sum(len(q) for q in requests)
    # One retriever call per request would be 32; the micro-batcher merges requests that wait.
    assert stats["retriever_calls"] == len(slow.calls) < 32
    assert max(len(call) for call in slow.calls) > 3  # at least one call merged several requests


def test_mixed_topk_in_one_batch_each_get_their_own(bm25_retriever):
    slow = SlowRetriever(bm25_retriever, delay_s=0.05)
    with ServerThread(create_app(slow)) as running, ThreadPoolExecutor(8) as pool:
        bodies = [{"queries": ["capital city"], "topk": 1 + i % 2} for i in range(8)]
        responses = list(pool.map(lambda body: httpx.post(running.url + "/retrieve", json=body, timeout=10), bodies))
    for body, response in zip(bodies, responses):
        assert len(response.json()["result"][0]) == body["topk"]


def test_retriever_failure_is_a_500_and_the_server_keeps_going(bm25_retriever):
    failing = SlowRetriever(bm25_retriever, fail_on="explode")
    with ServerThread(create_app(failing)) as running:
        bad = httpx.post(running.url + "/retrieve", json={"queries": ["explode"]})
        good = httpx.post(running.url + "/retrieve", json={"queries": ["capital"]})
    assert bad.status_code == 500 and "RuntimeError: index file vanished" in bad.json()["error"]
    assert good.status_code == 200 and len(good.json()["result"][0]) == 2


def test_a_huge_integer_gets_a_short_400_of_our_own(bm25_retriever):
    body = b'{"queries": ["q"], "topk": ' + b"9" * 5000 + b"}"  # more digits than Python converts
    with ServerThread(create_app(bm25_retriever)) as running:
        response = httpx.post(running.url + "/retrieve", content=body, timeout=10)
    assert response.status_code == 400
    assert response.json() == {
        "error": 'request body has an integer of more than 4300 digits; send small integers (e.g. "topk": 3)'
    }


def test_parse_request_and_limits_validation():
    limits = ServerLimits(default_topk=2, max_topk=4)
    assert parse_retrieve_request({"queries": ["a"], "topk": 4, "return_scores": True}, limits) == (["a"], 4, True)
    assert parse_retrieve_request({"queries": ["a"], "extra": 1}, limits) == (["a"], 2, False)
    with pytest.raises(RequestError) as info:
        parse_retrieve_request({"queries": ["a"], "topk": 5}, limits)
    assert info.value.status == 422
    # The messages name the `stratarl serve` flags, not the dataclass fields.
    with pytest.raises(ValueError) as info:
        ServerLimits(max_queries=0)
    assert str(info.value) == "--max-queries 0: must be a positive integer. Fix: pass e.g. --max-queries 4096"
    with pytest.raises(ValueError) as info:
        ServerLimits(default_topk=10, max_topk=5)
    assert str(info.value) == "--topk 10 is more than --max-topk 5. Fix: lower --topk or raise --max-topk"


def test_binds_loopback_by_default(bm25_retriever):
    with ServerThread(create_app(bm25_retriever)) as running:
        assert running.host == "127.0.0.1" and running.url.startswith("http://127.0.0.1:")
