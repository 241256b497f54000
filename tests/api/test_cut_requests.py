"""A request the server stops before its end (a model switch, a shutdown: the engine ends it with finish reason
"abort") is answered as cut on every route, streamed or not: never as a normal completion."""
import json

import httpx
import pytest

from tests.api.conftest import wait_idle

USER = [{"role": "user", "content": "hi"}]
ROUTES = {"/v1/chat/completions": {"messages": USER, "max_tokens": 32},
          "/v1/completions": {"prompt": "hi", "max_tokens": 32},
          "/v1/responses": {"input": "hi", "max_output_tokens": 32},
          "/v1/messages": {"messages": USER, "max_tokens": 32}}


@pytest.fixture
def cutting(scripted):
    scripted.engine.script, scripted.engine.cut_after = "One two three four five six seven eight nine ten.", 3
    yield scripted
    scripted.engine.cut_after = None


def _events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]


@pytest.mark.parametrize("path", list(ROUTES))
def test_a_cut_request_is_a_503_saying_so_not_a_completion(cutting, path):
    with httpx.Client(base_url=cutting.base_url, timeout=30) as c:
        r = c.post(path, json={"model": "scripted", **ROUTES[path]})
    assert r.status_code == 503, r.text[:300]
    error = r.json()["error"]
    assert "stopped this request before its answer was finished" in error["message"], error
    assert error.get("code", "request_cut") == "request_cut" and error.get("type") != "invalid_request_error"
    assert wait_idle(cutting.engine)["running"] == 0


@pytest.mark.parametrize("path", list(ROUTES))
def test_a_cut_stream_ends_with_an_error_event_and_no_normal_end(cutting, path):
    with httpx.Client(base_url=cutting.base_url, timeout=30) as c:
        r = c.post(path, json={"model": "scripted", "stream": True, **ROUTES[path]})
    assert r.status_code == 200
    events = _events(r.text)
    kinds = [e.get("type") for e in events]
    finishes = [ch.get("finish_reason") for e in events for ch in e.get("choices", [])]
    assert not {"stop", "length"} & set(finishes), finishes
    assert "response.completed" not in kinds and "message_stop" not in kinds, kinds
    errors = [e for e in events if e.get("type") == "error" or "error" in e]
    assert errors, kinds
    text = json.dumps(errors[-1])
    assert "stopped this request before its answer was finished" in text, text
    if path == "/v1/responses":
        assert kinds[-1] == "response.failed" and events[-1]["response"]["error"]["code"] == "request_cut"
