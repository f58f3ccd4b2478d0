"""`MicroBatcher`: concurrent ``/retrieve`` requests merged into few retriever calls.

Concurrent requests are not answered one by one: they wait in an asyncio queue, and one worker
runs the retriever (in a thread, so the event loop keeps accepting requests) on all the queries
that arrived meanwhile, then splits the results. While one retriever call runs, the next batch
gathers, so N concurrent clients cost a handful of calls instead of N serial ones.
"""

from __future__ import annotations

import asyncio
import contextlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from stratarl.retrieval.base import Passage, Retriever


@dataclass
class _Pending:
    queries: list[str]
    k: int
    future: asyncio.Future


@dataclass
class BatcherStats:
    """What ``/health`` reports of the batching: requests and queries received, retriever calls made (and
    the most queries in one), calls that raised."""

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
        queue, ready = (self._bulk if bulk else self._small), self._ready
        if queue is None or ready is None:  # set with the worker above
            raise RuntimeError("the micro-batcher has no queue")
        queue.put_nowait(_Pending(queries, k, future))
        ready.set()
        return await future

    async def _run(self) -> None:
        assert self._small is not None and self._bulk is not None and self._ready is not None  # noqa: S101  search() made them
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
        except Exception as error:  # noqa: BLE001  any retriever error: every waiting request gets it, the worker goes on
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
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker
        self._executor.shutdown(wait=False)
