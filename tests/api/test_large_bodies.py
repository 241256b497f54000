"""Large bodies are read off the event loop and their cost is bounded: while a 15 MiB body is parsed and refused,
/health and other clients are answered at once. Bodies that are not JSON get the same 400 as before."""
import json

import httpx
import pytest

from tests.api.conftest import post_while_polling_health

MIB15 = 15 * 1024 * 1024
HEALTH_WITHIN = 1.5  # seconds; measured at most 0.6 s on a shared 2-core machine


def _bodies():
    return {
        # more values than any request needs: refused before parsing (engine.server.bodyjson), no field named
        "4096+ messages": ("/v1/chat/completions", "too_many_values", {"model": "scripted", "messages": [
            {"role": "user", "content": "hi"}] * (MIB15 // 33)}),
        "a million text parts": ("/v1/chat/completions", "too_many_values", {"model": "scripted", "messages": [
            {"role": "user", "content": [{"type": "text", "text": "a"}] * (MIB15 // 30)}]}),
        "one 15 MiB string": ("/v1/chat/completions", "messages", {"model": "scripted", "messages": [
            {"role": "user", "content": "hello " * (MIB15 // 6)}]}),
        "a 15 MiB completions prompt": ("/v1/completions", "prompt", {"model": "scripted",
                                                                     "prompt": "hello " * (MIB15 // 6)}),
        "a 15 MiB responses input": ("/v1/responses", "input", {"model": "scripted", "input": "hello " * (MIB15 // 6)}),
        "a 15 MiB message": ("/v1/messages", None, {"model": "scripted", "max_tokens": 4, "messages": [
            {"role": "user", "content": "hello " * (MIB15 // 6)}]}),
    }


@pytest.mark.parametrize("case", list(_bodies()))
def test_health_answers_at_once_while_a_15_mib_body_is_refused(scripted, case):
    path, param, body = _bodies()[case]
    data = json.dumps(body).encode()
    r, _, slowest = post_while_polling_health(scripted.base_url, path, data)
    assert r.status_code == 400, r.text[:300]
    if param is None:
        assert r.json()["type"] == "error" and "cannot fit" in r.json()["error"]["message"]
    elif param == "too_many_values":
        assert r.json()["error"]["code"] == param
    else:
        assert r.json()["error"]["param"] == param
    assert slowest < HEALTH_WITHIN, f"/health took {slowest:.2f} s while the body was read"


@pytest.mark.parametrize("content,words", [
    (b"{not json", "not valid JSON"), (b'{"model": "\xff"}', "not UTF-8"), (b"[" * 100_000, "nested too deeply"),
    (b"", "not valid JSON"), (b"[1, 2]", "valid dictionary"),
])
def test_a_body_that_is_not_a_json_object_is_a_400(scripted, content, words):
    with httpx.Client(base_url=scripted.base_url, timeout=30) as c:
        r = c.post("/v1/chat/completions", content=content, headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text[:300]
        r = c.post("/v1/messages", content=content, headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["type"] == "error", r.text[:300]


def test_the_openapi_schema_still_describes_the_bodies(scripted):
    with httpx.Client(base_url=scripted.base_url, timeout=30) as c:
        paths = c.get("/openapi.json").json()["paths"]
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"):
        assert "requestBody" in paths[path]["post"], path
