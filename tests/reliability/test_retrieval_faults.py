"""A dead, hanging or lying retrieval server: every step with failed searches warns on the terminal,
a hanging server costs at most the step's budget, and `retrieval.max_failed_steps` failing steps in a
row stop the run with a checkpoint and a message naming the server and its error."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from fault_injection import TINY

from stratarl.retrieval.base import RetrievalError
from stratarl.retrieval.remote import RemoteRetriever
from stratarl.retrieval.timed import TimedRetriever
from stratarl.rollout.generation import Generator

pytestmark = pytest.mark.slow


class _Lying(BaseHTTPRequestHandler):
    mode = "500"

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.mode == "500":
            self._send(500, b"internal error")
        elif self.mode == "not json":
            self._send(200, b"<html>hello</html>")
        else:  # one result list too few
            self._send(200, json.dumps({"result": [[] for _ in body["queries"][1:]]}).encode())

    def _send(self, status, payload):
        self.send_response(status)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


@pytest.fixture
def lying_server(request):
    handler = type("Handler", (_Lying,), {"mode": request.param})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/retrieve", request.param
    server.shutdown()
    server.server_close()


def test_a_hanging_server_costs_at_most_the_step_budget(hanging_server):
    remote = RemoteRetriever(hanging_server.url, timeout_s=30, max_retries=3, backoff_s=0.1)
    timed = TimedRetriever(remote, budget_s=0.5)
    start = time.monotonic()
    with pytest.raises(RetrievalError, match=hanging_server.url):
        timed.search(["a", "b"], 2)
    # Without the budget this call would wait 4 x 30 s; the bound below only catches that hang.
    assert time.monotonic() - start < 10
    sent = len(hanging_server.connections)
    with pytest.raises(RetrievalError, match="budget"):
        timed.search(["c"], 2)
    assert len(hanging_server.connections) == sent  # the spent budget sends nothing more
    assert (timed.step_queries, timed.step_failed) == (3, 3)
    timed.start_step()
    assert (timed.step_queries, timed.step_failed, timed.last_error) == (0, 0, "")


class SearchingGenerator(Generator):
    """Every turn of every rollout asks to search: the retriever is called at every step."""

    def __init__(self, tokenizer):
        self.ids = tokenizer("<search> who wrote it </search>", add_special_tokens=False)["input_ids"]

    def generate(self, prompts, params, max_new_tokens=None):
        from stratarl.rollout.generation import Generation

        budgets = list(max_new_tokens) if max_new_tokens is not None else [params.max_new_tokens] * len(prompts)
        return [Generation(self.ids[:b], [-1.0] * len(self.ids[:b]), "stop", "</search>") for b in budgets]


def _train_against(url, tmp_path, monkeypatch, base_overrides, extra=()):
    from stratarl.trainer.config import load_config
    from stratarl.trainer.rl import train
    from stratarl.trainer.run import RunParts
    from stratarl.trainer.stops import RETRIEVAL_STOP_CODE

    parts = RunParts(make_generator=lambda model, tokenizer, backend, seed, **kwargs: SearchingGenerator(tokenizer))
    spec = json.dumps({"kind": "remote", "url": url, "timeout_s": 5, "max_retries": 1, "backoff_s": 0.01})
    cfg = load_config(
        TINY,
        [
            *base_overrides,
            f"retrieval.spec={spec}",
            "trainer.steps=5",
            "trainer.save_every=0",
            "retrieval.max_failed_steps=2",
            *extra,
        ],
    )
    summary = train(cfg, tmp_path / "run", parts=parts)
    assert summary["exit_code"] == RETRIEVAL_STOP_CODE
    return summary


LIES = {
    "500": "HTTP 500",
    "not json": "the response is not JSON",
    "wrong count": "sent 4 queries but got 3 result lists",
}


@pytest.mark.parametrize("lying_server", list(LIES), indirect=True)
def test_a_lying_server_stops_the_run_with_a_checkpoint(lying_server, tmp_path, monkeypatch, base_overrides, capsys):
    url, mode = lying_server
    summary = _train_against(url, tmp_path, monkeypatch, base_overrides)
    err = capsys.readouterr().err
    assert "warning: step 1: 4 of 4 searches failed" in err and "warning: step 2: 4 of 4" in err
    # Both steps took no update (every rollout's search failed): the checkpoint holds step 0, the last healthy state.
    assert summary["steps"] == 2 and summary["checkpoint_step"] == 0
    assert (tmp_path / "run" / "checkpoints" / "step_000000" / "manifest.json").is_file()
    assert url in summary["retrieval_failure"] and "2 consecutive steps" in summary["retrieval_failure"]
    assert LIES[mode] in summary["retrieval_failure"]


def test_a_dead_server_stops_the_run_naming_it(dead_url, tmp_path, monkeypatch, base_overrides):
    summary = _train_against(dead_url, tmp_path, monkeypatch, base_overrides)
    assert dead_url in summary["retrieval_failure"] and "ConnectError" in summary["retrieval_failure"]


def test_evaluation_searches_are_not_cut_by_a_spent_step_budget():
    class Recording:
        deadline = "unset"

        def search(self, queries, k):
            self.seen_deadline = self.deadline
            return [[] for _ in queries]

    inner = Recording()
    timed = TimedRetriever(inner, budget_s=1.0)
    timed.step_seconds = 5.0  # this step's budget is spent
    with pytest.raises(RetrievalError, match="budget"):
        timed.search(["a"], 1)
    with timed.unbudgeted():
        assert timed.search(["a"], 1) == [[]]
    assert inner.seen_deadline is None and timed.budget_s == 1.0
