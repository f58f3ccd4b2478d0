"""A client for any server speaking Search-R1's ``/retrieve`` protocol (ours, Search-R1's, veRL's).

Request ``{"queries": [...], "topk": k, "return_scores": true}``; response
``{"result": [[{"document": {"id", "contents"}, "score": s}, ...], ...]}`` (or bare documents).
"""

from __future__ import annotations

import re
import threading
import time
from urllib.parse import urlsplit, urlunsplit

from stratarl.retrieval.base import Passage, RetrievalError, check_k

RETRYABLE_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})


def transport_error(error: BaseException) -> str:
    """``ConnectError: Connection refused``: the error's type and text without the raw ``[Errno 111]``."""
    text = re.sub(r"\[Errno -?\d+\] ", "", str(error))
    return f"{type(error).__name__}: {text}"


def normalize_retrieve_url(url: str) -> str:
    """``http://host:port`` → ``http://host:port/retrieve``; a URL with a path is kept as it is."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"retrieval URL must look like http://127.0.0.1:8000/retrieve, got {url!r}")
    path = parts.path if parts.path not in ("", "/") else "/retrieve"
    return urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


def _document_to_passage(document: dict, score: float | None, where: str) -> Passage:
    if not isinstance(document, dict) or "contents" not in document:
        # Servers built on Pyserini without stored contents send title/text instead.
        if isinstance(document, dict) and "title" in document and "text" in document:
            contents = f'"{document["title"]}"\n{document["text"]}'
            return Passage(str(document.get("id", "")), contents, score)
        raise RetrievalError(f"{where}: each hit needs a document with 'contents', got {str(document)[:200]!r}")
    return Passage(str(document.get("id", "")), str(document["contents"]), score)


def parse_retrieve_response(payload: object, num_queries: int, where: str = "response") -> list[list[Passage]]:
    """Parse either response shape of ``/retrieve`` into passages, checking one list per query."""
    if not isinstance(payload, dict) or not isinstance(payload.get("result"), list):
        raise RetrievalError(f"{where}: expected a JSON object with a 'result' list, got {str(payload)[:200]!r}")
    result = payload["result"]
    if len(result) != num_queries:
        raise RetrievalError(f"{where}: sent {num_queries} queries but got {len(result)} result lists")
    parsed = []
    for hits in result:
        if not isinstance(hits, list):
            raise RetrievalError(f"{where}: each result must be a list of hits, got {str(hits)[:200]!r}")
        row = []
        for hit in hits:
            if isinstance(hit, dict) and "document" in hit:
                score = hit.get("score")
                row.append(_document_to_passage(hit["document"], None if score is None else float(score), where))
            else:
                row.append(_document_to_passage(hit, None, where))
        parsed.append(row)
    return parsed


class RemoteRetriever:
    """Retriever backed by an HTTP ``/retrieve`` server.

    Queries are sent in chunks of ``batch_size``. Each POST gets ``timeout_s``; on a timeout, a
    connection error or a retryable status (408, 425, 429, 5xx) it is retried up to ``max_retries``
    times, sleeping ``backoff_s · 2^attempt`` in between, then `RetrievalError` is raised with the
    last error. Other 4xx answers are raised at once (retrying a bad request cannot help).
    ``deadline`` (a `time.monotonic()` value, or None) caps the whole call: no attempt or sleep runs
    past it, and each attempt's timeout shrinks to the time left (the trainer sets it per step).
    Thread-safe: one pooled ``httpx.Client`` is shared.
    """

    def __init__(
        self,
        url: str = "http://127.0.0.1:8000/retrieve",
        *,
        timeout_s: float = 30.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        batch_size: int = 64,
        return_scores: bool = True,
    ) -> None:
        import httpx  # 0.2 s to import: only when a client is made, so `import stratarl.retrieval` stays light

        if timeout_s <= 0 or max_retries < 0 or backoff_s < 0 or batch_size < 1:
            raise ValueError(
                "RemoteRetriever needs timeout_s > 0, max_retries >= 0, backoff_s >= 0, batch_size >= 1; "
                f"got {timeout_s}, {max_retries}, {backoff_s}, {batch_size}"
            )
        self.url = normalize_retrieve_url(url)
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.batch_size = batch_size
        self.return_scores = return_scores
        self._client = httpx.Client(timeout=timeout_s)
        self._stats_lock = threading.Lock()
        self.num_requests = 0
        self.num_retries = 0
        self.deadline: float | None = None

    def __repr__(self) -> str:
        return f"RemoteRetriever({self.url!r}, timeout_s={self.timeout_s}, max_retries={self.max_retries})"

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> RemoteRetriever:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _post_with_retries(self, body: dict) -> object:
        import httpx  # here, as in __init__: `import stratarl.retrieval` stays light

        last_error = ""
        attempts = self.max_retries + 1
        deadline = self.deadline
        tried = 0
        for attempt in range(attempts):
            if attempt > 0:
                with self._stats_lock:
                    self.num_retries += 1
                pause = self.backoff_s * 2 ** (attempt - 1)
                if deadline is not None and time.monotonic() + pause >= deadline:
                    last_error += " (no time left in the step's retrieval budget for another retry)"
                    break
                time.sleep(pause)
            timeout = self.timeout_s
            if deadline is not None:
                timeout = min(timeout, deadline - time.monotonic())
                if timeout <= 0:
                    last_error = last_error or "the step's retrieval budget was spent before the request"
                    break
            with self._stats_lock:
                self.num_requests += 1
            tried += 1
            try:
                response = self._client.post(self.url, json=body, timeout=timeout)
            except httpx.TimeoutException:
                last_error = f"timed out after {timeout:.3g} s"
                continue
            except httpx.TransportError as error:
                last_error = transport_error(error)
                continue
            if response.status_code in RETRYABLE_STATUS:
                last_error = f"HTTP {response.status_code}: {response.text[:300]}"
                continue
            if response.status_code >= 400:
                raise RetrievalError(
                    f"POST {self.url} was rejected with HTTP {response.status_code}: {response.text[:300]} "
                    "(a bad request is not retried; check the query count, length and topk against the server's limits)"
                )
            try:
                return response.json()
            except ValueError:
                raise RetrievalError(f"POST {self.url}: the response is not JSON: {response.text[:200]!r}") from None
        raise RetrievalError(
            f"POST {self.url} failed after {tried} attempt(s) (timeout {self.timeout_s} s each, "
            f"{self.max_retries} retries with backoff from {self.backoff_s} s); last error: {last_error}. "
            "Is the server running? Start one with `stratarl serve --index DIR` or `stratarl serve --corpus corpus.jsonl`."
        )

    def search(self, queries: list[str], k: int) -> list[list[Passage]]:
        """Top-``k`` passages for each query from the server, one list per query, in order."""
        check_k(k)
        queries = list(queries)
        results: list[list[Passage]] = []
        for start in range(0, len(queries), self.batch_size):
            chunk = queries[start : start + self.batch_size]
            body = {"queries": chunk, "topk": k, "return_scores": self.return_scores}
            payload = self._post_with_retries(body)
            results.extend(parse_retrieve_response(payload, len(chunk), where=f"POST {self.url}"))
        return results


def probe_retriever(url: str, timeout_s: float = 10.0) -> None:
    """Send one search (top 1, no retry, at most ``timeout_s``) to the ``/retrieve`` server at ``url``;
    raise `RetrievalError` naming the URL and what went wrong unless it answers with one result list.

    Run before any warm start or RL step, so a wrong URL or a dead server costs seconds, not a run."""
    import httpx  # 0.2 s to import: only when a probe is sent, so `import stratarl.retrieval` stays light

    why = None
    fix = "start the server (`stratarl serve --index DIR`) or correct retrieval.spec"
    try:
        response = httpx.post(
            url, json={"queries": ["stratarl probe"], "topk": 1, "return_scores": True}, timeout=timeout_s
        )
    except httpx.TimeoutException:
        why = f"no answer within {timeout_s:g} s"
    except httpx.TransportError as error:
        why = transport_error(error)
    else:
        body = " ".join(response.text.split())[:200]
        if response.status_code >= 500:
            why = f"the server answered HTTP {response.status_code}: {body}"
            fix = "the server is running but failing: see its log"
        elif response.status_code >= 400:
            why = f"HTTP {response.status_code}: {body}"
            fix = "correct retrieval.spec (the URL of a /retrieve server)"
        else:
            fix = "correct retrieval.spec (the URL of a stratarl or Search-R1 /retrieve server)"
            try:
                payload = response.json()
            except ValueError:
                why = f"the reply is not JSON: {body[:80]!r}"
            else:
                try:
                    parse_retrieve_response(payload, 1, where="the reply")
                except (ValueError, RetrievalError) as error:
                    why = f"{str(error)[:200]}"
    if why is not None:
        raise RetrievalError(
            f"retrieval.spec: the probe search to {url} failed ({why}). Fix: {fix}; "
            "--no-retriever-check skips this check"
        )
