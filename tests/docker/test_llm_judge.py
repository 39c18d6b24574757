"""The LLM-as-judge example reward against an OpenAI-compatible endpoint served by the test on the host."""

from __future__ import annotations

import json
import shutil
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rewardbox import build_samples
from tests.conftest import ROOT, run

API_KEY = "sk-test-rewardbox-123"


class FakeOpenAI(BaseHTTPRequestHandler):
    """Grades 10 when the answer equals the reference, else 3; rejects a wrong key like the real API."""

    requests: list = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        FakeOpenAI.requests.append((self.path, self.headers.get("Authorization"), body))
        if self.headers.get("Authorization") != f"Bearer {API_KEY}":
            return self._reply(401, {"error": {"message": "bad key", "type": "invalid_request_error"}})
        user = body["messages"][-1]["content"]
        reference = user.split("Reference: ")[1].split("\n")[0]
        answer = user.split("Answer: ")[1]
        content = "Score: 10" if answer.strip() == reference.strip() else "Score: 3"
        self._reply(200, {
            "id": "chatcmpl-1", "object": "chat.completion", "created": int(time.time()), "model": body["model"],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        })

    def _reply(self, status, payload):
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def judge_endpoint():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeOpenAI)
    FakeOpenAI.requests = []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()


def test_llm_judge_scores_through_the_network_with_its_secret_and_falls_back_without_network(
    docker_sandboxes, judge_endpoint, tmp_path, monkeypatch
):
    monkeypatch.setenv("JUDGE_API_KEY", API_KEY)
    (tmp_path / "rewards").mkdir(exist_ok=True)
    shutil.copy(ROOT / "examples" / "llm_judge" / "judge.py", tmp_path / "rewards" / "judge.py")
    common = {"file": "judge.py", "function": "judge", "packages": ["openai>=1.40"], "secrets": ["JUDGE_API_KEY"],
              "env": {"JUDGE_BASE_URL": judge_endpoint, "JUDGE_MODEL": "judge-model", "JUDGE_TIMEOUT_S": "5"},
              "timeout_s": 10, "default_score": None}
    s = docker_sandboxes(
        [{"name": "judge", "network": True, "isolation": "worker", **common},
         {"name": "judge_per_sample", "network": True, **common},  # isolation: sample, a fresh process each
         {"name": "judge_offline", **common}],
        sandbox={"docker": {"network_mode": "host"}},  # the endpoint listens on the host's loopback
    )
    samples = build_samples(["What is 2 + 2?", "Capital of France?"], ["4", "Lyon"], {"answer": ["4", "Paris"]})
    report = run(s["judge"].client.score(samples))
    assert report.statuses == ["ok", "ok"]
    assert report.values == [1.0, 0.3]
    assert len(FakeOpenAI.requests) == 2
    assert all(auth == f"Bearer {API_KEY}" and path == "/v1/chat/completions"
               for path, auth, _ in FakeOpenAI.requests)

    # The example keeps one module-level AsyncOpenAI client: under isolation: worker it lives (with its connection
    # pool) in one event loop per worker for the worker's life, so later batches use it as the first did.
    questions = [f"What is {i} + {i}?" for i in range(8)]
    answers = [str(2 * i) for i in range(8)]
    later = build_samples(questions, [a if i % 2 else "wrong" for i, a in enumerate(answers)], {"answer": answers})
    for _ in range(3):
        report = run(s["judge"].client.score(later))
        assert report.statuses == ["ok"] * 8, report.errors
        assert report.values == [0.3, 1.0] * 4
    per_sample = run(s["judge_per_sample"].client.score(later))
    assert per_sample.statuses == ["ok"] * 8 and per_sample.values == [0.3, 1.0] * 4
    sent = len(FakeOpenAI.requests)
    assert sent == 2 + 3 * 8 + 8

    offline = run(s["judge_offline"].client.score(samples))
    # a connection error and its fallback, not a hang (a hang would read "timeout")
    assert offline.statuses == ["error", "error"]
    assert offline.values == [None, None]
    assert "APIConnectionError" in offline.errors[0]
    assert len(FakeOpenAI.requests) == sent  # nothing reached the endpoint
