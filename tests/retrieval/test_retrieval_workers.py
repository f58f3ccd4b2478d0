"""The multi-worker server: same answers as one process, Search-R1's format, errors visible, no orphans."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from stratarl.retrieval.base import Passage
from stratarl.retrieval.protocol import ServerLimits, encode_retrieve_response, format_retrieve_response
from stratarl.retrieval.server import ServerThread, create_app
from stratarl.retrieval.workers import WorkerError, WorkerPool

QUERIES = [
    "capital of France",
    "cats as pets",
    "highest mountain",
    "jazz music",
    "zzzz",
    "python language",
    "running race",
    "light energy plants",
    "capital of Germany",
]


@pytest.fixture(scope="module")
def index_dir(bm25_retriever, tmp_path_factory):
    return bm25_retriever.save(tmp_path_factory.mktemp("index") / "bm25")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0) until reaped: it has exited all the same.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def _children(pid: int) -> set[int]:
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.add(int(entry))
            except OSError:
                continue
    return found


def _worker_children() -> list[int]:
    """This test process's children that are server workers (exited ones are reaped by `stop`)."""
    found = []
    for pid in _children(os.getpid()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"stratarl.retrieval.workers" in f.read():
                    found.append(pid)
        except OSError:
            continue
    return found


def _requests():
    # 40 requests: 1-3 queries each, both response shapes, topk 1-3 (and the default).
    bodies = []
    for i in range(40):
        body = {"queries": [QUERIES[(i + j) % len(QUERIES)] for j in range(1 + i % 3)], "return_scores": i % 2 == 0}
        if i % 4:
            body["topk"] = 1 + i % 3
        bodies.append(body)
    return bodies


def test_response_encoder_matches_the_dict_format():
    results = [
        [],
        [Passage("1", 'say "hi"\\\n\t\u00e9\u4e2d\U0001f600', 1.5), Passage("2", "x", None)],
        [Passage("lone \ud800 surrogate", "y", 2.0)],
    ]
    for return_scores in (True, False):
        assert json.loads(encode_retrieve_response(results, return_scores)) == format_retrieve_response(
            results, return_scores
        )
    assert encode_retrieve_response([], True) == b'{"result":[]}'
    foreign = [[Passage(7, "int id from a retriever outside stratarl", 1.0)]]  # type: ignore[arg-type]
    assert json.loads(encode_retrieve_response(foreign, True)) == format_retrieve_response(foreign, True)
    with pytest.raises(ValueError, match="non-finite score"):
        encode_retrieve_response([[Passage("1", "x", float("nan"))]], True)


@pytest.mark.parametrize("fast_path", [True, False])
def test_fast_path_and_framework_path_answer_alike(bm25_retriever, fast_path):
    with ServerThread(create_app(bm25_retriever, fast_path=fast_path)) as running:
        answers = [httpx.post(running.url + "/retrieve", json=body, timeout=10).json() for body in _requests()[:6]]
    expected = [
        format_retrieve_response(bm25_retriever.search(b["queries"], b.get("topk") or 3), b["return_scores"])
        for b in _requests()[:6]
    ]
    assert answers == json.loads(json.dumps(expected))


def test_two_workers_answer_concurrent_requests_like_one_process_and_all_exit(bm25_retriever, index_dir):
    bodies = _requests()
    with ServerThread(create_app(bm25_retriever)) as single:
        expected = [httpx.post(single.url + "/retrieve", json=body, timeout=10).json() for body in bodies]
    with WorkerPool({"index": str(index_dir)}, workers=2, limits=ServerLimits(max_topk=5)) as pool:
        pids = pool.pids
        assert len(set(pids)) == 2 and all(_alive(pid) for pid in pids)
        with httpx.Client(timeout=30, limits=httpx.Limits(max_connections=16)) as client:
            with ThreadPoolExecutor(16) as threads:
                answers = list(threads.map(lambda body: client.post(pool.url + "/retrieve", json=body), bodies))
            health = client.get(pool.url + "/health").json()
        bad = httpx.post(pool.url + "/retrieve", json={"queries": ["q"], "topk": 6}, timeout=10)
    assert [a.status_code for a in answers] == [200] * len(bodies)
    assert [a.json() for a in answers] == expected  # identical to the single-process server, in order
    first = answers[0].json()["result"][0][0]  # Search-R1's shape with return_scores
    assert set(first) == {"document", "score"} and set(first["document"]) == {"id", "contents"}
    assert set(answers[1].json()["result"][0][0]) == {"id", "contents"}  # bare documents without
    assert health["pid"] in pids and health["limits"]["max_topk"] == 5
    assert bad.status_code == 422 and "from 1 to 5" in bad.json()["error"]
    assert not any(_alive(pid) for pid in pids)


def test_connections_are_spread_over_the_workers(index_dir):
    if not sys.platform.startswith("linux"):
        pytest.skip("SO_REUSEPORT spreading is Linux's")
    with WorkerPool({"index": str(index_dir)}, workers=2) as pool:
        seen = set()
        for _ in range(32):  # a new connection each time; 32 all landing on one of 2 workers: p = 2^-31
            with httpx.Client(timeout=10) as client:
                seen.add(client.get(pool.url + "/health").json()["pid"])
        assert seen == set(pool.pids)


def test_a_worker_that_cannot_load_the_index_is_an_error_and_nothing_stays(index_dir, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "stratarl_index.json").write_text((index_dir / "stratarl_index.json").read_text())  # no arrays
    pool = WorkerPool({"index": str(broken)}, workers=2)
    with pytest.raises(WorkerError, match="server worker [01] failed to start: .*"):
        pool.start()
    assert pool.processes == [] and not _worker_children()


def test_a_worker_that_dies_stops_the_pool(index_dir):
    with WorkerPool({"index": str(index_dir)}, workers=2) as pool:
        pids = pool.pids
        os.kill(pids[0], signal.SIGKILL)
        assert pool.wait() == 1
        assert not any(_alive(pid) for pid in pids)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("source", ["index", "corpus"])
def test_serve_workers_command_serves_and_leaves_no_process(index_dir, small_corpus_path, source):
    port = _free_port()
    where = str(index_dir) if source == "index" else str(small_corpus_path)
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "stratarl.cli",
            "serve",
            f"--{source}",
            where,
            "--port",
            str(port),
            "--workers",
            "2",
            "--log-level",
            "warning",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = process.stdout.readline()  # printed once every worker answers
        assert "with 2 workers" in line, process.stderr.read()
        workers = _children(process.pid)
        assert len(workers) == 2
        response = httpx.post(
            f"http://127.0.0.1:{port}/retrieve", json={"queries": ["capital of France"], "topk": 1}, timeout=10
        )
        assert response.json() == {
            "result": [
                [
                    {
                        "id": "0",
                        "contents": '"Paris"\nParis is the capital and largest city of France, on the river Seine.',
                    }
                ]
            ]
        }
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in workers):
            assert time.monotonic() < deadline, "a worker outlived `stratarl serve`"
            time.sleep(0.05)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_serve_rejects_zero_workers(index_dir):
    result = subprocess.run(
        [sys.executable, "-m", "stratarl.cli", "serve", "--index", str(index_dir), "--workers", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "--workers 0 must be at least 1" in result.stderr


def test_worker_sockets_get_nagle_turned_off_by_asyncio():
    """A worker's own listening socket says it is TCP, so asyncio sets TCP_NODELAY on each accepted
    connection; with proto 0 it would not, and every small response would wait for a delayed ACK."""
    import asyncio.base_events
    import socket

    from stratarl.retrieval.workers import _listening_socket

    listener = _listening_socket("127.0.0.1", 0, reuse_port=True)
    client = socket.create_connection(listener.getsockname())
    try:
        accepted, _ = listener.accept()
        with accepted:
            asyncio.base_events._set_nodelay(accepted)  # what asyncio's transport does to each connection
            assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    finally:
        client.close()
        listener.close()
