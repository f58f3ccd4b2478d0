"""The judge reward against a local stub of an OpenAI-compatible server (127.0.0.1, started by the test):
what it sends, how it reads the reply, and that every failure is a RewardFault (never a silent 0)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from stratarl.rewards import RewardFault, Trajectory, build_reward
from stratarl.rewards.judge import endpoint, parse_score


class Stub:
    """An OpenAI-compatible chat-completions server whose next replies the test scripts."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.headers: list[dict] = []
        self.mode = "reply"  # reply | status | garbage | sleep
        self.content = "1"
        self.status = 500
        self.delay_s = 0.0
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stub.requests.append({"path": self.path, **body})
                stub.headers.append(dict(self.headers))
                if stub.mode == "sleep":
                    time.sleep(stub.delay_s)
                if stub.mode == "status":
                    self.send_response(stub.status)
                    self.end_headers()
                    return
                payload = (
                    b"{not json"
                    if stub.mode == "garbage"
                    else json.dumps({"choices": [{"message": {"role": "assistant", "content": stub.content}}]}).encode()
                )
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stub():
    server = Stub()
    yield server
    server.close()


ANSWERED = Trajectory(
    response_text="<answer>Paris</answer>",
    question="What is the capital of France?",
    answer="Paris",
    golds=("Paris", "Paris, France"),
    tool_calls=2,
)


def test_a_right_answer_scores_1_with_the_request_it_should_send(stub):
    reward = build_reward("judge", {"url": stub.url, "model": "grader", "tool_call_cost": 0.1})
    result = reward(ANSWERED)
    assert result.outcome == 1.0 and result.total == pytest.approx(0.8)
    assert result.components == pytest.approx({"answer": 1.0, "tool_cost": -0.2})
    (request,) = stub.requests
    assert request["path"] == "/v1/chat/completions" and request["model"] == "grader"
    assert request["temperature"] == 0
    prompt = request["messages"][0]["content"]
    assert "What is the capital of France?" in prompt and "Paris; Paris, France" in prompt
    assert "Predicted answer: Paris" in prompt


@pytest.mark.parametrize(("content", "score"), [("0", 0.0), ("Yes.", 1.0), ("incorrect", 0.0), ("0.5 (close)", 0.5)])
def test_the_reply_is_read_as_a_score(stub, content, score):
    stub.content = content
    assert build_reward("judge", {"url": stub.url})(ANSWERED).outcome == score


def test_no_answer_scores_0_without_a_request(stub):
    result = build_reward("judge", {"url": stub.url})(Trajectory(response_text="<search>x</search>"))
    assert result.total == 0.0 and stub.requests == []


def test_the_api_key_comes_from_the_named_environment_variable(stub, monkeypatch):
    monkeypatch.setenv("STRATARL_TEST_JUDGE_KEY", "k-123")
    build_reward("judge", {"url": stub.url, "api_key_env": "STRATARL_TEST_JUDGE_KEY"})(ANSWERED)
    assert stub.headers[0]["Authorization"] == "Bearer k-123"


@pytest.mark.parametrize(
    ("mode", "words"),
    [("status", "HTTP 500"), ("garbage", "malformed reply"), ("sleep", "timed out"), ("nonsense", "does not start")],
)
def test_every_failure_is_a_reward_fault(stub, mode, words):
    stub.mode, stub.delay_s = ("reply" if mode == "nonsense" else mode), 2.0
    if mode == "nonsense":
        stub.content = "I think it might be Paris"
    reward = build_reward("judge", {"url": stub.url, "timeout_s": 0.3})
    with pytest.raises(RewardFault, match=words) as caught:
        reward(ANSWERED)
    assert stub.url.split("//")[1] in str(caught.value)  # the message names the endpoint


def test_a_refused_connection_is_a_reward_fault():
    server = Stub()
    url = server.url
    server.close()  # nothing listens there now
    with pytest.raises(RewardFault, match="judge"):
        build_reward("judge", {"url": url, "timeout_s": 1.0})(ANSWERED)


def test_endpoint_and_parse_score():
    assert endpoint("http://h:1") == "http://h:1/v1/chat/completions"
    assert endpoint("http://h:1/v1/") == "http://h:1/v1/chat/completions"
    assert endpoint("http://h:1/api/chat/completions") == "http://h:1/api/chat/completions"
    assert parse_score("**1**") == 1.0 and parse_score("2") is None and parse_score("") is None
    assert parse_score("10") is None  # "1" followed by "0" is not the score 1
