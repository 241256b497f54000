"""engine.service.LocalService without Qt: the errors it raises at once, cancelling a load, and its rules.
(Starting, serving and stopping a real engine is covered by test_flow.py through the app.)"""
from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from engine.config.loading import settings_from_mapping
from engine.errors import ModelLoadError, NInferError
from engine.service import CANCELLED, STOPPED, LocalService, PortInUseError, connect_host
from tests.api.test_unreadable_requests import raw_exchange
from tests.app.conftest import free_port


def test_a_missing_model_fails_before_any_thread(tmp_path):
    with pytest.raises(ModelLoadError):
        LocalService(settings_from_mapping({"model": str(tmp_path / "none.gguf")}, "app"))


def test_a_taken_port_fails_at_start():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        service = LocalService(settings_from_mapping({"port": s.getsockname()[1]}, "app"))
        with pytest.raises(PortInUseError) as e:
            service.start()
        assert "choose another port" in str(e.value)
        assert service.status == STOPPED and not service.serving


def test_cancel_a_load_and_the_lan_rule():
    port = free_port()
    service = LocalService(settings_from_mapping({"port": port, "max_context": 512}, "app")).start()
    try:
        assert service.serving and service.url == f"http://127.0.0.1:{port}/v1"
        health = httpx.get(service.base_url + "/health", timeout=10)
        assert health.status_code == 503 and health.json()["status"] == "loading"  # the API answers while loading
        with pytest.raises(NInferError, match="without a key"):
            service.restart_server(host="0.0.0.0")
        assert service.host == "127.0.0.1"
        service.cancel()
        assert not service.wait_ready(120)
        assert service.status == CANCELLED and "cancelled" in service.load_error
        deadline = time.time() + 10
        while service.serving and time.time() < deadline:
            time.sleep(0.05)
        assert not service.serving
        stats = service.stats()
        assert stats["status"] == CANCELLED and stats["engine_attached"] is False
    finally:
        service.stop()
    assert not service.serving and service.state.loaded is None


def test_connect_host():
    assert connect_host("0.0.0.0") == "127.0.0.1" and connect_host("::") == "[::1]"
    assert connect_host("127.0.0.1") == "127.0.0.1" and connect_host("::1") == "[::1]"


def test_stats_carry_engine_keys_the_snapshot_lacks():
    """Whatever Engine.stats() reports reaches the monitor through stats(), even keys the metrics snapshot does not
    carry yet; the snapshot's own keys win."""

    class _Engine:
        def stats(self):
            return {"spec_emitted": 30, "kv_future_counter": 7, "pages_total": 10, "pages_free": 4,
                    "pages_used": 999}

    class _Loaded:
        engine = _Engine()
        device = "cpu"
        context_window = 512
        load_seconds = 1.0

    service = LocalService(settings_from_mapping({"port": free_port()}, "app"))
    stats = service.stats()
    assert "spec_emitted" not in stats and "kv_future_counter" not in stats  # nothing loaded: the snapshot alone
    assert stats["spec_method"] == "none"  # the speculative-decoding setting in force
    service.state.loaded = _Loaded()
    try:
        stats = service.stats()
        assert stats["spec_emitted"] == 30 and stats["kv_future_counter"] == 7
        assert stats["pages_used"] == 10 - 4 and stats["context_window"] == 512  # the snapshot's own count
    finally:
        service.state.loaded = None


def _stream_in_background(url: str, body: dict, route: str = "/chat/completions") -> dict:
    """A streamed chat (or completion) read in a thread: its parsed events, and an Event set once the first token
    came."""
    import threading

    out = {"events": [], "started": threading.Event()}

    def read():
        with httpx.stream("POST", url + route, json={**body, "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    out["events"].append(json.loads(line[6:]))
                    out["started"].set()

    out["thread"] = threading.Thread(target=read, daemon=True)
    out["thread"].start()
    return out


def test_switch_the_model_on_the_same_port(tmp_path):
    """The served model is replaced without stopping the server: during the switch a chat gets 503 with Retry-After,
    afterwards the new model (here the embedded file under another name) answers on the same port and the old name
    is gone. A missing file is refused before anything is unloaded."""
    import shutil

    from engine.library import usage
    from engine.model.default import default_model_path

    other = tmp_path / "other-model.gguf"
    shutil.copyfile(default_model_path(), other)
    port = free_port()
    service = LocalService(settings_from_mapping({"port": port, "max_context": 512, "device": "cpu"}, "app")).start()
    chat = {"messages": [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
            "max_tokens": 48,
            "temperature": 0}
    try:
        assert service.wait_ready(240), service.load_error
        old_id = service.model_ids[0]
        with pytest.raises(ModelLoadError):
            service.switch_model(str(tmp_path / "missing.gguf"))
        assert service.status == "ready" and service.model_ids == [old_id]
        in_flight = _stream_in_background(service.url, dict(chat, model=old_id, max_tokens=400, ignore_eos=True))
        assert in_flight["started"].wait(60), in_flight
        service.switch_model(str(other), drain_s=0.0)
        in_flight["thread"].join(60)
        cut = in_flight["events"]  # the request the switch stopped says it was cut, not that it finished
        assert cut and "error" in cut[-1] and cut[-1]["error"]["code"] == "request_cut", cut[-3:]
        assert not any(ch.get("finish_reason") for e in cut for ch in e.get("choices", [])), cut[-3:]
        assert service.port == port and service.serving
        during = httpx.post(service.url + "/chat/completions", json=dict(chat, model="other-model"), timeout=30)
        assert during.status_code == 503, during.text
        assert during.headers["Retry-After"] == "2" and "switching to the model 'other-model'" in during.text
        health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=30)
        if health.status_code == 503:  # still switching: /health says so, with the same Retry-After
            assert health.headers["Retry-After"] == "2"
            assert health.json()["status"] == "switching" and health.json()["model"] == "other-model"
        else:
            assert health.status_code == 200
        assert service.wait_ready(240), service.load_error
        assert service.port == port and service.model_ids == ["other-model"]
        assert usage.last_used(other) is not None  # the library's "last used" column
        models = httpx.get(service.url + "/models", timeout=10).json()["data"]
        assert [m["id"] for m in models] == ["other-model"]
        after = httpx.post(service.url + "/chat/completions", json=dict(chat, model="other-model"), timeout=120)
        assert after.status_code == 200, after.text
        assert "Paris" in after.json()["choices"][0]["message"]["content"]
        gone = httpx.post(service.url + "/chat/completions", json=dict(chat, model=old_id), timeout=30)
        assert gone.status_code == 404
        # the app's server, like ninfer-serve, answers what the HTTP parser refuses in the API's error shape
        status, headers, body = raw_exchange(port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                                   b"Content-Length: abc\r\n\r\n")
        assert status == 400 and headers["content-type"] == "application/json"
        assert json.loads(body)["error"]["code"] == "invalid_http"
    finally:
        service.stop()


def test_a_switch_to_a_model_that_fails_to_load_serves_the_old_one_again(tmp_path):
    """A file that exists but does not load (a GGUF cut short): the switch goes back to the model served before,
    on the same port, and says why (switch_error); chats answer again."""
    from engine.model.default import default_model_path

    broken = tmp_path / "broken.gguf"
    broken.write_bytes(default_model_path().read_bytes()[:1 << 20])
    port = free_port()
    service = LocalService(settings_from_mapping({"port": port, "max_context": 512, "device": "cpu"}, "app")).start()
    try:
        assert service.wait_ready(240), service.load_error
        old_id, old_path = service.model_ids[0], service.model_path
        service.switch_model(str(broken))
        assert service.wait_ready(240), service.load_error
        assert service.status == "ready" and service.port == port and service.model_ids == [old_id]
        assert service.model_path == old_path and service.settings.model != str(broken)
        assert "broken.gguf" in service.switch_error or "truncated" in service.switch_error.lower()
        chat = {"model": old_id, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        assert httpx.post(service.url + "/chat/completions", json=chat, timeout=120).status_code == 200
    finally:
        service.stop()


@pytest.mark.parametrize("model,cpu_compile", [("embedded", "auto"), ("tiny llama", "step")])
def test_stop_mid_answer_ends_the_answer_and_frees_the_model(model, cpu_compile, tmp_path):
    """#39 items 4 and 10: Stop (the tray's, or Change model's) while an answer streams ends that answer at once, and
    the engine's model, pools and compiled step go with it: nothing the process keeps (the compiled decode step's
    cache entries, with --cpu-compile step) holds them, so their memory returns instead of counting as "other
    programs" at the next start. (The compiled step on a 2-layer model: the embedded one's 30 layers compile for a
    minute.)"""
    import gc
    import weakref

    from tests.engine.helpers import add_tokenizer, tiny_hf_model

    settings = {"port": free_port(), "max_context": 512, "device": "cpu", "cpu_compile": cpu_compile}
    route, body = "/chat/completions", {"messages": [{"role": "user", "content": "Count to a thousand."}]}
    if model == "tiny llama":
        _, folder = tiny_hf_model("llama", tmp_path, seed=5)
        add_tokenizer(folder, 512)
        settings["model"] = str(folder)
        route, body = "/completions", {"prompt": "w5 w17 w9"}
    service = LocalService(settings_from_mapping(settings, "app")).start()
    stopped = False
    try:
        assert service.wait_ready(240), service.load_error
        engine = service.state.loaded.engine
        model, runner = weakref.ref(engine.runner.model), weakref.ref(engine.runner)
        thread = engine._thread
        request = dict(body, model=service.model_ids[0], max_tokens=400, ignore_eos=True, temperature=0)
        in_flight = _stream_in_background(service.url, request, route)

        def tokens() -> int:
            return sum(1 for e in list(in_flight["events"]) for ch in e.get("choices", [])
                       if ch.get("delta", {}).get("content") or ch.get("text"))

        deadline = time.time() + 60
        while tokens() < 3 and time.time() < deadline:  # the answer is under way
            time.sleep(0.01)
        del engine
        service.stop()
        stopped = True
        assert not thread.is_alive()  # the engine thread ended within stop()
        in_flight["thread"].join(30)
        assert not in_flight["thread"].is_alive()
        assert 3 <= tokens() < 400, tokens()  # the answer was cut, not run to its end
        gc.collect()
        assert runner() is None and model() is None, gc.get_referrers(model())[:3] if model() else None
    finally:
        if not stopped:
            service.stop()
