"""A cheap load generator for a `/retrieve` server: one process, asyncio, raw HTTP/1.1 keep-alive sockets.

``clients`` coroutines each hold one connection and send requests of ``per_request`` queries back to
back until ``requests`` have been sent in all; every response is parsed (``json.loads``) and must
hold one result list per query. Prints one JSON line: wall time, queries/s, p50/p99 latency, errors
and this process's CPU seconds (to tell how much of the machine the clients themselves used)::

    python benchmarks/load_client.py http://127.0.0.1:8000 queries.json --clients 32 --requests 400 --per-request 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from urllib.parse import urlsplit


async def _one_client(host: str, port: int, bodies, latencies: list, errors: list) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        for body, expected in bodies:
            head = (
                f"POST /retrieve HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n"
            ).encode()
            start = time.perf_counter()
            writer.write(head + body)
            status_line = await reader.readline()
            length = None
            while True:
                line = await reader.readline()
                if line in (b"\r\n", b""):
                    break
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            if length is None:
                raise RuntimeError(f"response without Content-Length: {status_line!r}")
            payload = await reader.readexactly(length)
            latencies.append(time.perf_counter() - start)
            status = int(status_line.split()[1])
            if status != 200 or len(json.loads(payload)["result"]) != expected:
                errors.append(status)
    finally:
        writer.close()


async def run(url: str, queries: list[str], clients: int, requests: int, per_request: int, topk: int = 3) -> dict:
    parts = urlsplit(url)
    host, port = parts.hostname, parts.port or 80
    bodies = []
    for i in range(requests):
        batch = [queries[(i * per_request + j) % len(queries)] for j in range(per_request)]
        bodies.append((json.dumps({"queries": batch, "topk": topk, "return_scores": True}).encode(), per_request))
    # Request i goes to client i % clients: every client sends its share back to back.
    shares = [bodies[c::clients] for c in range(clients)]
    latencies: list[float] = []
    errors: list[int] = []
    cpu0, start = time.process_time(), time.perf_counter()
    outcomes = await asyncio.gather(
        *(_one_client(host, port, share, latencies, errors) for share in shares if share), return_exceptions=True
    )
    failures = [f"{type(o).__name__}: {o}" for o in outcomes if isinstance(o, BaseException)]
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu0
    latencies.sort()
    if not latencies:
        raise RuntimeError(f"no request succeeded: {failures[:1]}")
    return {
        "clients": clients,
        "requests": len(latencies),
        "wall_s": wall,
        "qps": len(latencies) * per_request / wall,
        "p50_ms": 1000 * statistics.median(latencies),
        "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        "errors": len(errors) + requests - len(latencies),
        "client_cpu_s": cpu,
        "first_failure": failures[0] if failures else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("url")
    parser.add_argument("queries", help="a JSON file with a list of query strings")
    parser.add_argument("--clients", type=int, default=1)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--per-request", type=int, default=8)
    parser.add_argument("--topk", type=int, default=3)
    args = parser.parse_args()
    with open(args.queries, encoding="utf-8") as f:
        queries = json.load(f)
    result = asyncio.run(run(args.url, queries, args.clients, args.requests, args.per_request, args.topk))
    json.dump(result, sys.stdout)
    print()


if __name__ == "__main__":
    main()
