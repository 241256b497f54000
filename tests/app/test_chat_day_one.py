"""The chat with a stand-in client (answers in a blink): focus after Stop, copy feedback and code-block copy,
regenerate keeping versions, settings per conversation against the mode's defaults, the context bar with the
oldest turns left out visibly, attached files, export and import, and the conversation list's empty search."""
from __future__ import annotations

import json

import pytest
from PySide6.QtCore import Qt, QUrl
from PySide6.QtGui import QGuiApplication
from PySide6.QtTest import QTest

from tests.app.conftest import make_controller, run, wait_until
from tests.app.fakes import FakeClient

CHAT = {"mode": "chat", "sampling": {"temperature": 0.7, "top_p": 0.95, "top_k": 40}}


@pytest.fixture
def chat_window(qapp, qloop, app_home, request):
    controller = make_controller(app_home, request.node.name)
    client = FakeClient(dict(CHAT))
    controller.client, controller.model_id = client, "fake-model"
    run(controller.refresh_mode())
    controller.show_main()
    window = controller.window
    window.activateWindow()
    yield controller, window, client
    controller.quitting = True
    controller.client = None
    window.hide()
    controller.launcher.hide()


def answer(chat) -> None:
    wait_until(lambda: not chat.busy, 10_000)


def test_focus_returns_to_the_message_box_after_stop(chat_window):
    controller, window, client = chat_window
    chat = window.chat
    client.words = ["word "] * 200
    client.delay = 0.02
    QTest.keyClicks(chat.input, "Count to a hundred.")
    QTest.mouseClick(chat.send_button, Qt.MouseButton.LeftButton)
    wait_until(lambda: chat.messages[-1].content, 5000)
    chat.stop_button.setFocus()  # where a click on Stop leaves the focus
    QTest.mouseClick(chat.stop_button, Qt.MouseButton.LeftButton)
    answer(chat)
    assert chat.messages[-1].stats["finish"] == "stopped"
    wait_until(lambda: chat.input.hasFocus(), 2000)
    QTest.keyClicks(window.focusWidget(), "next")
    assert chat.input.toPlainText() == "next"  # what is typed next goes into the message box


def test_copy_says_copied_and_code_blocks_have_their_own_copy(chat_window):
    controller, window, client = chat_window
    chat = window.chat
    client.words = ["Here:\n", "```python\n", "print('hi')\n", "```\n", "and\n```\nx = 2\n```\n"]
    chat.send("Show code")
    answer(chat)
    i = len(chat.messages) - 1
    html = chat.transcript_html()
    assert f"ninfer:copycode/{i}/0" in html and f"ninfer:copycode/{i}/1" in html
    chat._link(QUrl(f"ninfer:copycode/{i}/1"))
    assert QGuiApplication.clipboard().text() == "x = 2"
    assert "Copied ✓" in chat.view.toPlainText()
    wait_until(lambda: "Copied ✓" not in chat.view.toPlainText(), 4000)  # then the link is back
    chat._link(QUrl(f"ninfer:copy/{i}"))
    assert QGuiApplication.clipboard().text() == chat.messages[i].content
    assert "Copied ✓" in chat.view.toPlainText()


def test_regenerate_keeps_the_earlier_answers_as_versions(chat_window):
    controller, window, client = chat_window
    chat = window.chat
    client.words = ["First answer."]
    chat.send("Tell me something.")
    answer(chat)
    client.words = ["Second answer."]
    assert chat.regenerate()
    answer(chat)
    last = len(chat.messages) - 1
    assert chat.messages[last].content == "Second answer." and "version 2 of 2" in chat.view.toPlainText()
    chat._link(QUrl(f"ninfer:version/{last}/0"))
    assert chat.messages[last].content == "First answer." and "version 1 of 2" in chat.view.toPlainText()
    stored = controller.store.messages(chat.conversation.id)[last]
    assert stored.content == "First answer."  # the version shown is what the next message builds on
    client.words = ["Third."]
    chat.regenerate()
    answer(chat)
    assert "version 3 of 3" in chat.view.toPlainText()
    assert [v["content"] for v in chat.messages[-1].stats["versions"]] == ["First answer.", "Second answer.", "Third."]
    chat.send("And then?")
    answer(chat)
    assert client.requests[-1]["messages"][1]["content"] == "Third."


def test_the_context_bar_follows_a_version_flip(chat_window):
    controller, window, client = chat_window
    chat = window.chat
    controller.context_window = lambda: 8000
    client.words = ["word " * 600]
    chat.send("Say a lot.")
    answer(chat)
    client.words = ["Short."]
    assert chat.regenerate()
    answer(chat)
    short = chat.context_bar.label.text()
    last = len(chat.messages) - 1
    chat._link(QUrl(f"ninfer:version/{last}/0"))  # the "previous version" link of the transcript
    assert chat.messages[last].content.startswith("word") and chat.context_bar.label.text() != short, short
    chat._link(QUrl(f"ninfer:version/{last}/1"))
    assert chat.context_bar.label.text() == short


def test_sampling_settings_belong_to_each_conversation(chat_window):
    controller, window, client = chat_window
    chat = window.chat
    spins = chat.options.spins
    assert spins["temperature"].specialValueText() == "mode: 0.7" and spins["top_k"].specialValueText() == "mode: 40"
    chat.system_toggle.setChecked(True)
    chat.send("First chat")
    answer(chat)
    assert "temperature" not in client.requests[-1]  # unset: the server's mode decides
    first = chat.conversation.id
    spins["temperature"].setValue(0.3)
    spins["max_tokens"].setValue(77)
    chat.system_prompt.setPlainText("Be terse.")
    chat.send("Again")
    answer(chat)
    sent = client.requests[-1]
    assert sent["temperature"] == 0.3 and sent["max_tokens"] == 77
    assert sent["messages"][0] == {"role": "system", "content": "Be terse."}
    window.new_chat()
    assert spins["temperature"].value() == spins["temperature"].minimum()  # a new chat starts from the mode
    chat.send("Second chat")
    answer(chat)
    assert "temperature" not in client.requests[-1] and "max_tokens" not in client.requests[-1]
    chat.open(first)
    assert spins["temperature"].value() == pytest.approx(0.3) and chat.max_tokens == 77
    assert controller.store.get(first).options == {"temperature": 0.3, "max_tokens": 77}


def test_the_context_bar_and_turns_left_out_visibly(chat_window):
    controller, window, client = chat_window
    chat = window.chat
    controller.context_window = lambda: 400
    client.words = ["ok " * 30]
    for n in range(4):
        chat.send(f"Message {n}: " + "lorem ipsum dolor " * 25)
        answer(chat)
    assert "/ 400 tokens" in chat.context_bar.label.text() and chat.context_bar.bar.maximum() == 400
    sent = client.requests[-1]["messages"]
    assert len(sent) < 7 and sent[-1]["content"].startswith("Message 3")  # the oldest turns were left out ...
    assert sent[0]["content"].startswith("Message") and sent[0]["role"] == "user"
    last = chat.messages[-1]
    assert last.stats["left_out"] == 7 - len(sent)
    assert "left out of this answer's prompt" in chat.view.toPlainText()  # ... and the chat says so


def test_an_attached_file_goes_into_the_prompt_or_says_it_does_not_fit(chat_window, tmp_path):
    controller, window, client = chat_window
    chat = window.chat
    controller.context_window = lambda: 1000
    notes = tmp_path / "notes.txt"
    notes.write_text("The launch code is 4242.\n", encoding="utf-8")
    assert chat.context_bar.attach(str(notes)) is None
    assert "notes.txt" in chat.context_bar.files.text()
    chat.send("What is the launch code?")
    answer(chat)
    content = client.requests[-1]["messages"][-1]["content"]
    assert "What is the launch code?" in content and "The launch code is 4242." in content and "notes.txt" in content
    assert not chat.context_bar.attachments  # attached to that message only
    big = tmp_path / "big.txt"
    big.write_text("word " * 5000, encoding="utf-8")
    chat.context_bar.attach(str(big))
    n = len(client.requests)
    assert chat.send("Summarise this.")  # an estimate warns; the server's own count decides
    answer(chat)
    assert len(client.requests) == n + 1 and chat.notice.isVisibleTo(window)
    assert "holds 1,000 tokens" in chat.notice.text() and "may refuse" in chat.notice.text()
    binary = tmp_path / "image.png"
    binary.write_bytes(b"\x89PNG\0\0\0binary")
    assert "not a text file" in chat.context_bar.attach(str(binary))
    chat.context_bar.clear_attachments()
    for path in (binary, notes):  # through the button, as a user attaches: a refusal, then a good file
        chat.context_bar.ask_file = lambda p=path: str(p)
        QTest.mouseClick(chat.context_bar.attach_button, Qt.MouseButton.LeftButton)
        if path is binary:
            assert chat.notice.isVisibleTo(window) and "not a text file" in chat.notice.text()
    assert "notes.txt" in chat.context_bar.files.text()
    assert not chat.notice.isVisibleTo(window), "the refusal of the earlier file still shows"


def test_a_short_exchange_does_not_make_the_estimate_refuse_a_long_paste(qapp, qloop, app_home, request):
    """"Hi", then a 12,188-character text into an 8,192-token context: the server (like this stand-in: 4.4
    characters a token, 30 tokens of template) counts ~2,800 tokens. One short exchange must not pin the
    characters-per-token ratio at its floor (it read 12,191 tokens and refused)."""
    controller = make_controller(app_home, request.node.name)
    client = FakeClient(dict(CHAT), chars_per_token=4.4, template_tokens=30)
    controller.client, controller.model_id = client, "fake-model"
    controller.context_window = lambda: 8192
    run(controller.refresh_mode())
    controller.show_main()
    chat = controller.window.chat
    chat.send("Hi")
    answer(chat)
    text = ("The quick brown fox jumps over the lazy dog while the river runs. " * 190)[:12_188]
    QGuiApplication.clipboard().setText(text)
    chat.input.setFocus()
    QTest.keySequence(chat.input, "Ctrl+V")  # pasted, as a user would
    assert len(chat.input.toPlainText()) == 12_188
    QTest.mouseClick(chat.send_button, Qt.MouseButton.LeftButton)
    answer(chat)
    assert client.requests[-1]["messages"][-1]["content"].startswith("The quick brown fox")
    assert not chat.notice.isVisibleTo(controller.window), chat.notice.text()
    words = chat.context_bar.label.text()
    estimate = int(words.split("~")[1].split()[0].replace(",", ""))
    assert 2_000 < estimate < 4_500, words  # near the server's count, not 12,000


def test_file_dialogs_open_where_the_last_one_of_their_kind_was(chat_window, tmp_path, monkeypatch):
    """Attach, export and import start in the folder the previous dialog of that kind used (home the first time)."""
    from pathlib import Path

    from PySide6.QtWidgets import QFileDialog

    controller, window, client = chat_window
    chat = window.chat
    notes_dir, out_dir = tmp_path / "notes", tmp_path / "exports"
    notes_dir.mkdir()
    out_dir.mkdir()
    (notes_dir / "a.txt").write_text("first", encoding="utf-8")
    opened: list[str] = []

    def pick_open(parent, title, folder, *rest):
        opened.append(folder)
        return (str(notes_dir / "a.txt"), "")

    def pick_save(parent, title, start, *rest):
        opened.append(start)
        return (str(out_dir / "talk.md"), "")

    monkeypatch.setattr(QFileDialog, "getOpenFileName", pick_open)
    monkeypatch.setattr(QFileDialog, "getSaveFileName", pick_save)
    for _ in range(2):
        QTest.mouseClick(chat.context_bar.attach_button, Qt.MouseButton.LeftButton)
    assert opened == [str(Path.home()), str(notes_dir)]
    chat.send("Hello")
    answer(chat)
    window.export_action.trigger()  # File > Export conversation...
    window.export_action.trigger()
    assert Path(opened[2]).parent == Path.home() and Path(opened[3]).parent == out_dir, opened
    assert (out_dir / "talk.md").exists()


def test_export_and_import_a_conversation(chat_window, tmp_path):
    controller, window, client = chat_window
    chat = window.chat
    client.words = ["Paris is the capital."]
    chat.system_prompt.setPlainText("Answer in one line.")
    chat.send("Capital of France?")
    answer(chat)
    chat.options.spins["temperature"].setValue(0.4)
    md, js = tmp_path / "chat.md", tmp_path / "chat.json"
    assert window.export_conversation(str(md)) is None and window.export_conversation(str(js)) is None
    text = md.read_text(encoding="utf-8")
    assert "# Capital of France?" in text and "## You\n\nCapital of France?" in text
    assert "## Assistant\n\nParis is the capital." in text and "Answer in one line." in text
    before = len(controller.store.list())
    assert window.import_conversation(str(js)) is None
    assert len(controller.store.list()) == before + 1 and chat.conversation.id != controller.store.list()[1].id
    assert [(m.role, m.content) for m in chat.messages] == [("user", "Capital of France?"),
                                                             ("assistant", "Paris is the capital.")]
    assert chat.system_prompt.toPlainText() == "Answer in one line."
    assert chat.conversation.options == {"temperature": 0.4}
    openai = tmp_path / "openai.json"
    openai.write_text(json.dumps({"messages": [{"role": "system", "content": "S"},
                                               {"role": "user", "content": "Hi"}]}), encoding="utf-8")
    assert window.import_conversation(str(openai)) is None and chat.system_prompt.toPlainText() == "S"
    bad = tmp_path / "bad.json"
    bad.write_text("{\"messages\": 3}", encoding="utf-8")
    window.ask = False
    error = window.import_conversation(str(bad))
    assert error and "no list of messages" in error


def test_a_search_without_matches_says_so_and_disables_rename_and_delete(chat_window):
    controller, window, client = chat_window
    conversations = window.conversations
    window.chat.send("A first conversation")
    answer(window.chat)
    conversations.refresh(window.chat.conversation.id)
    assert conversations.rename_button.isEnabled() and conversations.delete_button.isEnabled()
    assert _error_red_pixels(conversations.delete_button) > 0  # an enabled Delete is drawn in the error colour
    conversations.search.setText("zebra-quantum")
    assert conversations.list.count() == 0
    assert conversations.empty.isVisibleTo(window) and "No conversation matches" in conversations.empty.text()
    assert not conversations.rename_button.isEnabled() and not conversations.delete_button.isEnabled()
    assert _error_red_pixels(conversations.delete_button) == 0, "a disabled Delete still looks like one to press"
    conversations.search.clear()
    assert not conversations.empty.isVisibleTo(window)


def _error_red_pixels(button) -> int:
    """Pixels of the button as drawn that are close to the theme's error colour."""
    from PySide6.QtGui import QColor

    from app import theme

    red = QColor(theme.colors()["error"])
    image = button.grab().toImage()
    near = 0
    for y in range(image.height()):
        for x in range(image.width()):
            c = image.pixelColor(x, y)
            near += abs(c.red() - red.red()) + abs(c.green() - red.green()) + abs(c.blue() - red.blue()) < 60
    return near


def test_rename_dialog_and_delete_prompt_show_whole_words(chat_window):
    from app.chat.conversations import short_title
    controller, window, client = chat_window
    conversations = window.conversations
    dialog = conversations.rename_dialog("A title")
    title_width = dialog.fontMetrics().horizontalAdvance(dialog.windowTitle())
    assert dialog.width() >= 420 and dialog.width() > title_width + 120  # room for the title bar's text
    long = "Explain the difference between supervised and unsupervised learning with many examples please"
    short = short_title(long)
    assert short.endswith("…") and long.startswith(short[:-1]) and short[:-1].split()[-1] in long.split()
    asked = []
    conversations.confirm_delete = lambda title: asked.append(title) or False
    conv = controller.store.create(long)
    conversations.refresh(conv.id)
    conversations.delete(conv.id)
    assert asked == [long]


def test_edit_keeps_the_earlier_branch(chat_window):
    controller, window, client = chat_window
    chat = window.chat
    client.words = ["Rome."]
    chat.send("Capital of Italy?")
    answer(chat)
    client.words = ["It is old."]
    chat.send("Tell me more.")
    answer(chat)
    chat.edit(0)
    chat.input.setPlainText("Capital of Spain?")
    client.words = ["Madrid."]
    chat.send()
    answer(chat)
    assert [m.content for m in chat.messages] == ["Capital of Spain?", "Madrid."]
    assert "edit 2 of 2" in chat.view.toPlainText()
    chat._link(QUrl("ninfer:branch/0/0"))  # back to the first branch, all of it
    assert [m.content for m in chat.messages] == ["Capital of Italy?", "Rome.", "Tell me more.", "It is old."]
    assert "edit 1 of 2" in chat.view.toPlainText()
    stored = controller.store.messages(chat.conversation.id)
    assert [m.content for m in stored] == [m.content for m in chat.messages]
    chat._link(QUrl("ninfer:branch/0/1"))
    assert [m.content for m in chat.messages] == ["Capital of Spain?", "Madrid."]
    client.words = ["Spain is sunny."]
    chat.send("And the weather?")
    answer(chat)
    assert [m["content"] for m in client.requests[-1]["messages"]] == ["Capital of Spain?", "Madrid.",
                                                                        "And the weather?"]
