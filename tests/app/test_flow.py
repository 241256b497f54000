"""The app with a real engine: the default model started from the launcher (one for the whole module), chat streaming
over the HTTP API, stop, regenerate, edit-and-resend, the mode switch, the monitor, the server panel, the tray,
closing to the tray, a remote server, stopping and starting the engine, and a clean quit."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from fastapi import Request  # module level: the fake server's route annotations are resolved from here
from PySide6.QtCore import Qt, QUrl
from PySide6.QtGui import QGuiApplication
from PySide6.QtTest import QTest
from PySide6.QtWidgets import QMenu

from app.chat.store import ConversationStore
from tests.app.conftest import free_port, run, wait_until

GEN_TIMEOUT = 120_000


def settings_route(service) -> dict:
    r = httpx.get(service.base_url + "/ninfer/v1/settings", timeout=10,
                  headers={"Authorization": f"Bearer {service.api_key}"} if service.api_key else {})
    assert r.status_code == 200, "GET /ninfer/v1/settings is not there (engine/server/admin.py)"
    return r.json()


def engine_idle(service) -> bool:
    s = service.stats()
    return s["running"] == 0 and s["waiting"] == 0


def test_started_with_the_default_model(started):
    controller, window = started
    s = controller.service
    assert s.status == "ready" and s.model_ids == ["smollm2-135m-instruct"]
    assert httpx.get(s.base_url + "/health", timeout=10).json() == {"status": "ok"}
    assert s.stats()["context_window"] == 1024
    assert window.isVisible() and not controller.launcher.isVisible()
    assert controller.config.last_good is not None and controller.config.last_good["values"]["max_context"] == 1024
    assert controller.config.crashed  # a session is open until a clean quit
    assert "Serving" in window.status_label.text()


def test_chat_streams_text_into_the_view(started):
    controller, window = started
    chat = window.chat
    chat.max_tokens = 8
    renders = chat.render_count
    QTest.keyClicks(chat.input, "Say hello.")
    started_at = time.monotonic()
    QTest.mouseClick(chat.send_button, Qt.MouseButton.LeftButton)
    assert chat.busy and not chat.send_button.isEnabled() and chat.stop_button.isEnabled()
    wait_until(lambda: chat.messages[-1].content, timeout=GEN_TIMEOUT)  # the first tokens are in ...
    wait_until(lambda: not chat.busy, timeout=GEN_TIMEOUT)
    elapsed = time.monotonic() - started_at
    answer = chat.messages[-1]
    assert answer.role == "assistant" and answer.content.strip()
    # throttled: at most one repaint per 200 ms tick, plus the ones at send and at the end
    assert chat.render_count - renders <= elapsed / 0.2 + 4
    assert answer.content.strip()[:20] in chat.view.toPlainText()  # ... and shown
    finish, tokens = answer.stats["finish"], answer.stats["tokens"]
    # max_tokens 8: cut there, or the model's end of turn came first (as the 8th token at the latest)
    assert (finish, tokens) == ("length", 8) or (finish == "stop" and 0 < tokens <= 8)
    assert answer.stats["ttft"] > 0 and (answer.stats["tok_s"] or 0) >= 0
    n = answer.stats["tokens"]
    assert f"{n} token{'' if n == 1 else 's'}" in chat.view.toPlainText() and "TTFT" in chat.view.toPlainText()
    assert chat.render_count > renders
    assert window.conversations.titles()[0] == "Say hello."
    wait_until(lambda: chat.send_button.isEnabled(), 2000)
    assert not chat.stop_button.isEnabled()


def test_stop_mid_stream_aborts_the_request(started):
    controller, window = started
    chat = window.chat
    chat.max_tokens = 400
    assert chat.send("Count from one to one hundred in words.")
    wait_until(lambda: len(chat.messages[-1].content) > 0, timeout=GEN_TIMEOUT)
    QTest.mouseClick(chat.stop_button, Qt.MouseButton.LeftButton)
    wait_until(lambda: not chat.busy, timeout=10_000)
    answer = chat.messages[-1]
    assert answer.stats["finish"] == "stopped" and answer.content
    assert answer.stats["tokens"] < 400
    wait_until(lambda: engine_idle(controller.service), timeout=10_000)  # the engine dropped the request
    stored = controller.store.messages(chat.conversation.id)[-1]
    assert stored.content == answer.content and stored.stats["finish"] == "stopped"
    chat.max_tokens = 8


def test_regenerate_replaces_the_last_answer(started):
    controller, window = started
    chat = window.chat
    n = len(chat.messages)
    old = chat.messages[-1]
    QTest.mouseClick(chat.regen_button, Qt.MouseButton.LeftButton)
    wait_until(lambda: not chat.busy, timeout=GEN_TIMEOUT)
    assert len(chat.messages) == n and chat.messages[-1].id != old.id
    assert chat.messages[-1].content and chat.messages[-1].stats["finish"] in ("length", "stop")
    assert [m.id for m in controller.store.messages(chat.conversation.id)] == [m.id for m in chat.messages]


def test_edit_and_resend(started):
    controller, window = started
    chat = window.chat
    chat.edit(0)
    assert chat.input.toPlainText() == "Say hello." and chat.edit_bar.isVisibleTo(window)
    chat.input.setPlainText("Say goodbye.")
    chat.send()
    wait_until(lambda: not chat.busy, timeout=GEN_TIMEOUT)
    assert [m.role for m in chat.messages] == ["user", "assistant"]
    assert chat.messages[0].content == "Say goodbye." and chat.messages[1].content
    stored = controller.store.messages(chat.conversation.id)
    assert [(m.role, m.content) for m in stored] == [(m.role, m.content) for m in chat.messages]
    chat.copy(1)
    assert QGuiApplication.clipboard().text() == chat.messages[1].content


def test_mode_toggle_switches_the_server_live(started):
    controller, window = started
    s = controller.service
    agent = next(b for b in window.chat.mode_buttons.buttons() if b.property("mode") == "agent")
    chat_button = next(b for b in window.chat.mode_buttons.buttons() if b.property("mode") == "chat")
    assert chat_button.isChecked() and settings_route(s)["mode"] == "chat"
    QTest.mouseClick(agent, Qt.MouseButton.LeftButton)
    wait_until(lambda: controller.mode == "agent", timeout=10_000)
    reported = settings_route(s)
    assert reported["mode"] == "agent" and reported["sampling"]["temperature"] == 0.2
    assert "temperature 0.2" in window.chat.sampling_label.text() and "presence 0.05" in window.chat.sampling_label.text()
    assert agent.isChecked() and window.mode_actions["agent"].isChecked() and controller.tray.mode_actions["agent"].isChecked()
    QTest.mouseClick(chat_button, Qt.MouseButton.LeftButton)
    wait_until(lambda: controller.mode == "chat", timeout=10_000)
    assert settings_route(s)["sampling"]["temperature"] == 0.7


def test_monitor_receives_updates(started):
    controller, window = started
    monitor = window.monitor
    window.tabs.setCurrentWidget(monitor)
    n = monitor.updates
    wait_until(lambda: monitor.updates >= n + 2, timeout=5000)
    last = monitor.last
    assert last["pages_free"] + last["pages_used"] == controller.service.stats()["pages_total"] > 0
    assert last["decode_tps_avg"] > 0  # answers were generated above
    assert "/" in monitor.stat_kv.value.text()
    assert monitor.stat_prefix.value.text().endswith("%")  # the engine's prefix hit ratio
    assert monitor.stat_spec.value.text() == "not running"  # started without speculative decoding
    assert monitor.stat_spec.detail.text() == "speculative decoding is off"
    if monitor.vram.handle is None:
        assert monitor.stat_vram.title.text() == "RAM (no GPU)" and monitor.stat_vram.value.text().endswith("MiB")
    assert len(monitor.series["pages_free"]) >= 2


def test_tray_actions(started):
    controller, window = started
    tray = controller.tray
    s = controller.service
    QGuiApplication.clipboard().clear()
    tray.copy_action.trigger()
    assert QGuiApplication.clipboard().text() == s.url
    tray.mode_actions["agent"].trigger()
    wait_until(lambda: controller.mode == "agent", timeout=10_000)
    assert settings_route(s)["mode"] == "agent"
    tray.mode_actions["chat"].trigger()
    wait_until(lambda: controller.mode == "chat", timeout=10_000)
    window.hide()
    tray.show_action.trigger()
    assert window.isVisible()
    assert tray.server_action.text() == "Stop server" and tray.server_action.isEnabled()


def test_close_to_tray_keeps_the_api_answering(started):
    controller, window = started
    s = controller.service
    assert controller.has_tray
    window.close()
    assert not window.isVisible() and not controller.quitting
    r = httpx.post(s.url + "/chat/completions", timeout=120, json={
        "model": "smollm2-135m-instruct", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    controller.show_window()
    assert window.isVisible()


def test_without_a_tray_closing_asks_first(started):
    controller, window = started
    controller.has_tray = False
    asked = []
    controller.confirm_quit = lambda: asked.append(1) or False  # "No"
    try:
        window.close()
        assert asked and window.isVisible() and not controller.quitting
        assert controller.service.serving
    finally:
        controller.has_tray = True


def test_api_key_and_lan_from_the_server_panel(started):
    controller, window = started
    panel = window.server
    s = controller.service
    panel.refresh()
    panel.lan.setChecked(True)
    assert not panel.apply_button.isEnabled() and "needs an API key" in panel.apply_note.text()
    panel.lan.setChecked(False)
    panel.key.setText("sk-test-123")
    assert panel.apply_button.isEnabled()
    panel.apply()
    wait_until(lambda: s.api_key == "sk-test-123" and controller.client.endpoint.api_key == "sk-test-123"
               and panel.apply_note.text() == "Applied.", 20_000)
    assert httpx.get(s.url + "/models", timeout=10).status_code == 401
    assert httpx.get(s.url + "/models", timeout=10, headers={"Authorization": "Bearer sk-test-123"}).status_code == 200
    assert "sk-test-123" in panel.curl.toPlainText() and "sk-test-123" in panel.python.toPlainText()
    run(controller.refresh_mode())  # the chat's client carries the key
    assert controller.mode == "chat"
    panel.key.setText("")
    assert panel.apply_note.text() != "Applied."  # an edit clears the last result
    panel.apply()
    wait_until(lambda: s.api_key is None and controller.client.endpoint.api_key is None
               and panel.apply_note.text() == "Applied.", 20_000)
    assert httpx.get(s.url + "/models", timeout=10).status_code == 200
    port = s.port  # the network at the same port: the app's own listener steps aside first
    panel.key.setText("sk-lan-456")
    panel.lan.setChecked(True)
    panel.apply()
    wait_until(lambda: s.host == "0.0.0.0" and panel.apply_note.text() == "Applied.", 20_000)
    assert s.port == port and s.serving
    assert httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10,
                     headers={"Authorization": "Bearer sk-lan-456"}).status_code == 200
    panel.lan.setChecked(False)
    panel.key.setText("")
    panel.apply()
    wait_until(lambda: s.host == "127.0.0.1" and s.api_key is None and panel.apply_note.text() == "Applied.", 20_000)
    assert s.port == port and httpx.get(s.url + "/models", timeout=10).status_code == 200


class _FakeOpenAI:
    """A minimal OpenAI-compatible server with no /metrics and no mode switch (like many others)."""

    def __init__(self):
        import uvicorn
        from fastapi import FastAPI
        from fastapi.responses import StreamingResponse

        api = FastAPI()

        @api.get("/v1/models")
        def models():
            return {"object": "list", "data": [{"id": "other-model", "object": "model"}]}

        self.requests: list[dict] = []

        @api.post("/v1/chat/completions")
        async def chat(request: Request):
            body = await request.json()
            self.requests.append(body)
            wants_tool = "weather" in body["messages"][-1]["content"]

            def chunk(delta, finish=None):
                return "data: " + json.dumps({"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}) + "\n\n"

            def events():
                if wants_tool:  # reasoning, then a tool call whose arguments arrive in two pieces
                    yield chunk({"reasoning_content": "The user wants the weather. "})
                    yield chunk({"reasoning_content": "I should call the tool."})
                    yield chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                                 "function": {"name": "get_weather", "arguments": '{"city": '}}]})
                    yield chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]})
                    yield chunk({}, "tool_calls")
                else:
                    for word in ("Hello ", "from ", "elsewhere."):
                        yield chunk({"content": word})
                    yield chunk({}, "stop")
                yield "data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")

        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(api, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started and time.time() < deadline:
            time.sleep(0.05)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)


def test_remote_backend(started):
    controller, window = started
    fake = _FakeOpenAI()
    try:
        assert run(controller.connect_remote(f"http://127.0.0.1:{fake.port}/v1", None)) is None
        assert controller.remote and controller.model_id == "other-model" and controller.mode is None
        assert "no mode switch" in window.chat.sampling_label.text()
        assert not any(b.isEnabled() for b in window.chat.mode_buttons.buttons())
        window.new_chat()
        window.chat.send("Hi there")
        wait_until(lambda: not window.chat.busy, timeout=20_000)
        assert window.chat.messages[-1].content == "Hello from elsewhere.", window.chat.messages[-1].stats
        monitor = window.monitor
        n = monitor.updates
        wait_until(lambda: monitor.updates >= n + 1 and monitor.note.isVisibleTo(window), timeout=10_000)
        assert "does not offer /metrics" in monitor.note.text()
        assert "@ http://127.0.0.1" in window.chat.model_label.text()

        chat = window.chat
        chat.system_prompt.setPlainText("You are terse.")
        chat.send("What is the weather in Paris?")
        wait_until(lambda: not chat.busy, timeout=20_000)
        assert fake.requests[-1]["messages"][0] == {"role": "system", "content": "You are terse."}
        assert fake.requests[-1]["messages"][1] == {"role": "user", "content": "Hi there"}
        answer = chat.messages[-1]
        assert answer.reasoning == "The user wants the weather. I should call the tool."
        assert answer.tool_calls == [{"id": "call_1", "type": "function",
                                      "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]
        text = chat.view.toPlainText()
        assert "Reasoning (10 words)" in text and "I should call the tool" not in text  # collapsed
        assert "Tool call get_weather" in text and '"city": "Paris"' in text and "tool calls" in text
        chat._link(QUrl(f"ninfer:reasoning/{len(chat.messages) - 1}"))
        assert "I should call the tool" in chat.view.toPlainText()  # expanded on click
        assert controller.store.get(chat.conversation.id).system_prompt == "You are terse."
    finally:
        fake.stop()
    controller.use_local()
    wait_until(lambda: not controller.remote and controller.mode == "chat", timeout=10_000)
    assert controller.model_id == "smollm2-135m-instruct"


def test_rename_and_delete_conversations_and_logs(started):
    controller, window = started
    conversations = window.conversations
    conversations.refresh()
    conversations.list.setCurrentRow(0)
    cid = conversations.current_id()
    conversations.ask_title = lambda title: ("Renamed chat", True)
    conversations.rename(cid)
    assert conversations.titles()[0] == "Renamed chat" and controller.store.get(cid).title == "Renamed chat"
    conversations.confirm_delete = lambda title: False
    conversations.delete(cid)
    assert controller.store.get(cid) is not None  # "No" keeps it
    conversations.confirm_delete = lambda title: True
    conversations.delete(cid)
    assert controller.store.get(cid) is None and "Renamed chat" not in conversations.titles()
    logs = window.logs.view.toPlainText()
    assert "ninfer.service" in logs and "ready:" in logs  # the engine's log, live


def test_conversations_survive_a_restart(started):
    controller, window = started
    titles = window.conversations.titles()
    assert titles == ["Say hello."]  # (the remote chat was deleted above)
    reopened = ConversationStore(controller.store.path)  # what the next start of the app reads
    try:
        assert [c.title for c in reopened.list()] == titles
        conv = next(c for c in reopened.list() if c.title == "Say hello.")
        assert [(m.role, m.content[:12]) for m in reopened.messages(conv.id)][0] == ("user", "Say goodbye.")
        assert [m.role for m in reopened.messages(conv.id)] == ["user", "assistant"]
    finally:
        reopened.close()
    window.conversations.search.setText("goodbye")  # matches the edited message's text
    assert window.conversations.titles() == ["Say hello."]
    window.conversations.search.setText("")


def answer_under_way(chat) -> None:
    """A long answer streaming into the chat window, its first tokens shown."""
    chat.max_tokens = 400
    assert chat.send("Count from one to one hundred in words.")
    wait_until(lambda: len(chat.messages[-1].content) > 0, timeout=GEN_TIMEOUT)


def test_stop_and_start_the_server_from_the_tray(started):
    """#39 item 4: the tray's Stop, clicked while an answer streams, ends the answer and lets the engine's model and
    runner go (nothing in the app holds them, so their memory is not counted as other programs' at the next start);
    Start serves again with the same settings."""
    import gc
    import weakref

    controller, window = started
    tray = controller.tray
    service = controller.service
    url = service.url
    engine = service.state.loaded.engine
    model, runner, thread = weakref.ref(engine.runner.model), weakref.ref(engine.runner), engine._thread
    del engine
    answer_under_way(window.chat)
    tray.server_action.trigger()  # Stop
    wait_until(lambda: controller.service is None and not service.serving and service.state.loaded is None,
               timeout=30_000)
    wait_until(lambda: not window.chat.busy, timeout=10_000)
    assert window.chat.messages[-1].stats["tokens"] < 400  # cut by the stop
    window.chat.max_tokens = 8
    assert not thread.is_alive()

    async def collect():  # on the app's loop: the cut stream's connection objects are finalized where they ran
        gc.collect()

    run(collect())
    assert runner() is None and model() is None, gc.get_referrers(model())[:3] if model() else None
    with pytest.raises(httpx.ConnectError):
        httpx.get(url.replace("/v1", "/health"), timeout=5)
    tray.refresh()
    assert tray.server_action.text() == "Start server"
    tray.server_action.trigger()  # Start again, same settings
    wait_until(lambda: controller.service is not None and controller.service.status == "ready"
               and controller.mode is not None, timeout=240_000)
    assert httpx.get(url.replace("/v1", "/health"), timeout=10).status_code == 200


def test_change_model_keeps_the_lan_address_and_key_set_in_the_server_panel(started):
    controller, window = started
    panel = window.server
    panel.refresh()
    panel.key.setText("sk-lan-789")
    panel.lan.setChecked(True)
    panel.apply()
    wait_until(lambda: controller.service.host == "0.0.0.0" and panel.apply_note.text() == "Applied.", 20_000)
    port = controller.service.port
    change = next(a for m in window.menuBar().findChildren(QMenu) for a in m.actions()
                  if a.text().startswith("Change model or settings"))
    change.trigger()  # File > Change model or settings...
    launcher = controller.launcher
    wait_until(lambda: controller.service is None and launcher.isVisible(), 30_000)
    values = launcher.form.values()
    assert (values.get("host"), values.get("port"), values.get("api_key")) == ("0.0.0.0", port, "sk-lan-789"), values
    wait_until(launcher.start_button.isEnabled, 60_000)
    QTest.mouseClick(launcher.start_button, Qt.MouseButton.LeftButton)
    wait_until(lambda: controller.service is not None and controller.service.status == "ready"
               and controller.mode is not None, 240_000)
    s = controller.service
    assert (s.host, s.port, s.api_key) == ("0.0.0.0", port, "sk-lan-789")
    assert controller.config.last["values"]["host"] == "0.0.0.0"  # and app.json keeps them
    panel.refresh()
    panel.lan.setChecked(False)
    panel.key.setText("")
    panel.apply()
    wait_until(lambda: s.host == "127.0.0.1" and s.api_key is None and panel.apply_note.text() == "Applied.", 20_000)


def test_quit_stops_everything(started):
    """The tray's Quit, clicked while an answer streams (#39 item 10: it once hung 14 s): the engine thread, the
    server and the session end."""
    controller, window = started
    s = controller.service
    url = s.base_url
    thread = s.state.loaded.engine._thread
    calls = controller.quit_app.calls
    answer_under_way(window.chat)
    controller.tray.quit_action.trigger()
    wait_until(lambda: controller.quit_app.calls == calls + 1, timeout=60_000)
    assert controller.service is None and not s.serving and s.state.loaded is None
    assert not thread.is_alive()
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/health", timeout=5)
    assert not controller.config.crashed  # a clean quit closes the session
