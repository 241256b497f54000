"""MCP tools in the chat window, the turn as a whole, through what a user clicks: a conversation exported as JSON and
imported again keeps the servers chosen under Tools (one not configured on this machine is kept and shown as
unavailable); Regenerate on an answer that made tool calls replaces the whole turn (the call, its result, the final
answer) and the transcript's version links bring whole turns back; while a call waits for approval nothing offers
to regenerate; the Tools bar wraps its servers at the app's smallest window size.

The model is the ScriptedClient of test_chat_tools.py; the server is the real one (tests/app/mcp_server.py)."""
from __future__ import annotations

import json

import pytest
from PySide6.QtCore import QPoint, Qt
from PySide6.QtGui import QTextCursor
from PySide6.QtTest import QTest
from PySide6.QtWidgets import QFileDialog

from tests.app.conftest import wait_until
from tests.app.test_chat_tools import SLOW_MS, click, opened, pick_server, send, stdio_entry, wait_done  # noqa: F401

pytestmark = pytest.mark.subprocess


def menu_action(window, text: str):
    """The File menu's action called ``text``."""
    for action in window.menuBar().actions()[0].menu().actions():
        if action.text() == text:
            return action
    raise AssertionError(f"no {text!r} in the File menu")


def fragments(view):
    """The transcript's text fragments, in order."""
    block = view.document().begin()
    while block.isValid():
        it = block.begin()
        while not it.atEnd():
            yield it.fragment()
            it += 1
        block = block.next()


def links(view) -> list[str]:
    return list(dict.fromkeys(f.charFormat().anchorHref() for f in fragments(view) if f.charFormat().anchorHref()))


def click_link(view, href: str) -> None:
    """Clicks the transcript's link to ``href`` where it is drawn (the middle of its first character)."""
    fragment = next((f for f in fragments(view) if f.charFormat().anchorHref() == href), None)
    assert fragment is not None, f"no link to {href} in the transcript: {links(view)}"
    cursor = QTextCursor(view.document())
    cursor.setPosition(fragment.position())
    view.setTextCursor(cursor)
    view.ensureCursorVisible()
    left = view.cursorRect(cursor)
    cursor.setPosition(fragment.position() + 1)
    middle = QPoint((left.x() + view.cursorRect(cursor).x()) // 2, left.center().y())
    assert view.anchorAt(middle) == href, (href, view.anchorAt(middle))
    QTest.mouseClick(view.viewport(), Qt.MouseButton.LeftButton, pos=middle)


def box_click(box) -> None:
    QTest.mouseClick(box, Qt.MouseButton.LeftButton, pos=QPoint(8, box.height() // 2))


# ---- JSON export and import keep the chosen servers -----------------------------------------------------------------
def test_json_import_restores_the_chosen_servers_and_keeps_one_not_configured_here_as_unavailable(
        opened, tmp_path, monkeypatch):
    controller, chat, client = opened([("text", "Hi.")], {"tests": stdio_entry(), "files": stdio_entry()})
    window = controller.window
    window.ask = False
    pick_server(chat, "tests")
    send(chat, "Hello")
    wait_done(chat)
    exported = tmp_path / "chat.json"
    monkeypatch.setattr(QFileDialog, "getSaveFileName", lambda *a, **k: (str(exported), ""))
    monkeypatch.setattr(QFileDialog, "getOpenFileName", lambda *a, **k: (str(exported), ""))
    menu_action(window, "Export conversation…").trigger()
    assert json.loads(exported.read_text())["tools"] == ["tests"]
    first = chat.conversation.id

    menu_action(window, "Import conversation…").trigger()
    imported = chat.conversation
    assert imported.id != first and [m.content for m in chat.messages] == ["Hello", "Hi."]
    assert controller.store.get(imported.id).tools == ["tests"]
    assert chat.tools_bar.boxes["tests"].isChecked() and not chat.tools_bar.boxes["files"].isChecked()
    assert chat.tools_toggle.text() == "Tools (1)"

    chat.tools.path.write_text(json.dumps({"mcpServers": {"files": stdio_entry()}}))  # another machine: no "tests"
    menu_action(window, "Import conversation…").trigger()
    conv = chat.conversation
    assert controller.store.get(conv.id).tools == ["tests"]
    if not chat.tools_bar.isVisible():
        click(chat.tools_toggle)
    kept = chat.tools_bar.boxes["tests"]
    wait_until(kept.isVisible, 2000)
    assert kept.isChecked() and "not configured" in kept.text()
    note = chat.tools_bar.note.text()
    assert '"tests"' in note and "not configured on this machine" in note and "MCP servers…" in note
    box_click(chat.tools_bar.boxes["files"])  # picking and dropping another server keeps the unavailable one
    assert controller.store.get(conv.id).tools == ["tests", "files"]
    box_click(chat.tools_bar.boxes["files"])
    assert controller.store.get(conv.id).tools == ["tests"]
    client.requests.clear()
    send(chat, "Again")
    wait_done(chat)
    assert "tools" not in client.requests[0]
    assert '⚠ The MCP server "tests" is no longer in mcp.json' in chat.view.toPlainText()

    exported.write_text(json.dumps({"messages": [{"role": "user", "content": "x"}], "tools": "tests"}))
    menu_action(window, "Import conversation…").trigger()
    said = window.statusBar().currentMessage()
    assert "tools" in said and "list of server names" in said, said
    assert chat.conversation.id == conv.id  # nothing imported


# ---- Regenerate replaces the whole turn; versions are whole turns ---------------------------------------------------
def turn_of(chat) -> list[tuple[str, str]]:
    return [(m.role, m.content) for m in chat.messages]


def test_nothing_offers_to_regenerate_or_switch_versions_while_a_call_waits_for_approval(opened):
    controller, chat, client = opened([("call", "tests__add", {"a": 2, "b": 3}), ("text", "5.")],
                                      {"tests": stdio_entry()})
    chat.tools.approvals.always = {"tests": ["add"]}
    pick_server(chat)
    send(chat, "Add two numbers")
    wait_done(chat)
    client.requests.clear()
    chat.tools.approvals.always = {}
    click(chat.regen_button)  # the answer now has two versions
    wait_until(chat.approval.isVisible, SLOW_MS)
    chat.render()
    shown = chat.view.toPlainText()
    assert "Regenerate" not in shown and "version" not in shown, shown
    assert not [href for href in links(chat.view) if href.startswith(("ninfer:regen", "ninfer:version"))]
    assert not chat.regen_button.isEnabled()
    click(chat.approval.approve_button)
    wait_done(chat)
    assert "Regenerate" in chat.view.toPlainText() and "version 2 of 2" in chat.view.toPlainText()


def test_regenerate_after_tool_calls_replaces_the_whole_turn_and_versions_switch_whole_turns(opened):
    controller, chat, client = opened([("call", "tests__add", {"a": 2, "b": 3}), ("text", "2 + 3 is 5.")],
                                      {"tests": stdio_entry()})
    pick_server(chat)
    send(chat, "Add two numbers")
    wait_until(chat.approval.isVisible, SLOW_MS)
    click(chat.approval.approve_button)
    wait_done(chat)
    old = [("user", "Add two numbers"), ("assistant", ""), ("tool", "5"), ("assistant", "2 + 3 is 5.")]
    assert turn_of(chat) == old

    client.script = [("call", "tests__add", {"a": 4, "b": 4}), ("text", "4 + 4 is 8.")]
    client.requests.clear()
    click(chat.regen_button)
    wait_until(chat.approval.isVisible, SLOW_MS)
    click(chat.approval.approve_button)
    wait_done(chat)
    new = [("user", "Add two numbers"), ("assistant", ""), ("tool", "8"), ("assistant", "4 + 4 is 8.")]
    assert [(m["role"], m.get("content")) for m in client.requests[0]["messages"]] == [("user", "Add two numbers")]
    assert turn_of(chat) == new
    assert [(m.role, m.content) for m in controller.store.messages(chat.conversation.id)] == new
    text = chat.view.toPlainText()
    assert "4 + 4 is 8." in text and "2 + 3 is 5." not in text and "version 2 of 2" in text

    click_link(chat.view, "ninfer:version/1/0")  # ‹ : the first turn, whole
    assert turn_of(chat) == old
    assert [(m.role, m.content) for m in controller.store.messages(chat.conversation.id)] == old
    assert chat.messages[1].tool_calls[0]["function"]["arguments"] == json.dumps({"a": 2, "b": 3})
    text = chat.view.toPlainText()
    assert "2 + 3 is 5." in text and "4 + 4 is 8." not in text and "version 1 of 2" in text
    assert [m["role"] for m in chat.api_messages()] == ["user", "assistant", "tool", "assistant"]

    click_link(chat.view, "ninfer:version/1/1")  # › : the regenerated turn again
    assert turn_of(chat) == new
    assert [(m.role, m.content) for m in controller.store.messages(chat.conversation.id)] == new
    assert chat.messages[2].stats["tool_call_id"] == chat.messages[1].tool_calls[0]["id"]

    client.script = [("text", "Plain now.")]  # a third version, from the first turn shown
    click_link(chat.view, "ninfer:version/1/0")
    click(chat.regen_button)
    wait_done(chat)
    assert turn_of(chat) == [("user", "Add two numbers"), ("assistant", "Plain now.")]
    assert "version 3 of 3" in chat.view.toPlainText()
    click_link(chat.view, "ninfer:version/1/1")
    assert turn_of(chat) == new and "version 2 of 3" in chat.view.toPlainText()
    click_link(chat.view, "ninfer:version/1/0")
    assert turn_of(chat) == old and "version 1 of 3" in chat.view.toPlainText()
    click_link(chat.view, "ninfer:version/1/1")
    click_link(chat.view, "ninfer:version/1/2")
    assert turn_of(chat) == [("user", "Add two numbers"), ("assistant", "Plain now.")]
    assert [(m.role, m.content) for m in controller.store.messages(chat.conversation.id)] == turn_of(chat)


# ---- the Tools bar at 800 x 600 -----------------------------------------------------------------------------------
def test_the_tools_bar_wraps_many_long_server_names_inside_an_800_by_600_window(opened):
    names = [f"a-server-with-a-rather-long-name-{i}" for i in range(8)]
    controller, chat, client = opened([("text", "Hi.")], {n: {"url": f"http://127.0.0.1:9/{n}"} for n in names})
    window = controller.window
    window.resize(800, 600)
    click(chat.tools_toggle)
    wait_until(lambda: window.width() == 800 and chat.tools_bar.isVisible(), 3000)
    bar = chat.tools_bar
    QTest.qWait(50)
    assert window.width() == 800 and bar.width() <= chat.width()
    inside = bar.rect()
    for widget in [*bar.boxes.values(), bar.require, bar.edit_button]:
        assert widget.isVisible(), widget.text()
        where = widget.geometry().translated(widget.parentWidget().mapTo(bar, QPoint(0, 0)))
        assert inside.contains(where), (widget.text(), where, inside)
        assert widget.width() >= widget.sizeHint().width(), widget.text()
    placed = [w.geometry().translated(w.parentWidget().mapTo(bar, QPoint(0, 0))) for w in bar.boxes.values()]
    assert len({r.top() for r in placed}) > 1  # wrapped onto more rows
    assert not any(a.intersects(b) for i, a in enumerate(placed) for b in placed[i + 1:])
    box_click(bar.boxes[names[-1]])
    assert chat.tools_toggle.text() == "Tools (1)" and bar.chosen() == [names[-1]]
