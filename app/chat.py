"""The chat: a conversation list (SQLite) and a transcript streamed over the HTTP API, like any client.

Streaming runs as an asyncio task on the qasync loop (httpx), never on the GUI thread's time: tokens only mark the
transcript dirty, and a timer repaints it a few times a second. Stop cancels the task, which closes the connection,
which aborts the request in the engine. Each answer records its tokens, time to first token and tokens per second.
"""
from __future__ import annotations

import asyncio
import html
import time
from contextlib import aclosing

import httpx
from PySide6.QtCore import Qt, QTimer, QUrl, Signal
from PySide6.QtGui import QDesktopServices, QGuiApplication, QKeyEvent
from PySide6.QtWidgets import (QButtonGroup, QHBoxLayout, QInputDialog, QLabel, QLineEdit, QListWidget,
                               QListWidgetItem, QMenu, QMessageBox, QPlainTextEdit, QPushButton, QSpinBox, QTextBrowser,
                               QToolButton, QVBoxLayout, QWidget)

from app import render, theme
from app.asyncutil import spawn
from app.client import ApiError
from app.store import Conversation, ConversationStore, Message

REPAINT_MS = 200  # at most five repaints a second while tokens stream
NEW_TITLE = "New chat"


def sampling_text(sampling: dict | None) -> str:
    if not sampling:
        return ""
    names = (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"), ("min_p", "min_p"),
             ("presence_penalty", "presence"), ("frequency_penalty", "frequency"))
    parts = []
    for key, label in names:
        value = sampling.get(key)
        if value is None or (key in ("min_p", "frequency_penalty") and not value):
            continue
        parts.append(f"{label} {value:g}" if isinstance(value, (int, float)) else f"{label} {value}")
    return " · ".join(parts)


class ConversationList(QWidget):
    """Search, list (newest first), new, rename, delete."""

    selected = Signal(int)
    new_requested = Signal()

    def __init__(self, store: ConversationStore, parent=None):
        super().__init__(parent)
        self.store = store
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        self.new_button = QPushButton("+  New chat")
        self.new_button.setObjectName("Primary")
        self.new_button.clicked.connect(self.new_requested)
        layout.addWidget(self.new_button)
        self.search = QLineEdit()
        self.search.setPlaceholderText("Search conversations…")
        self.search.setClearButtonEnabled(True)
        self.search.textChanged.connect(lambda: self.refresh(self.current_id()))
        layout.addWidget(self.search)
        self.list = QListWidget()
        self.list.setTextElideMode(Qt.TextElideMode.ElideRight)
        self.list.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.list.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.list.customContextMenuRequested.connect(self._menu)
        self.list.currentItemChanged.connect(self._current_changed)
        self.list.itemDoubleClicked.connect(lambda item: self.rename(item.data(Qt.ItemDataRole.UserRole)))
        layout.addWidget(self.list, 1)
        row = QHBoxLayout()
        rename = QPushButton("Rename")
        rename.clicked.connect(lambda: self.rename(self.current_id()))
        delete = QPushButton("Delete")
        delete.setObjectName("Danger")
        delete.clicked.connect(lambda: self.delete(self.current_id()))
        row.addWidget(rename)
        row.addWidget(delete)
        layout.addLayout(row)
        self.confirm_delete = lambda title: QMessageBox.question(
            self, "Delete conversation", f"Delete “{title}”? This cannot be undone.") == QMessageBox.StandardButton.Yes
        self.ask_title = lambda title: QInputDialog.getText(self, "Rename conversation", "Title:", text=title)

    def current_id(self) -> int | None:
        item = self.list.currentItem()
        return item.data(Qt.ItemDataRole.UserRole) if item else None

    def refresh(self, select: int | None = None) -> None:
        self.list.blockSignals(True)
        self.list.clear()
        for conv in self.store.list(self.search.text()):
            item = QListWidgetItem(conv.title)
            item.setData(Qt.ItemDataRole.UserRole, conv.id)
            item.setToolTip(conv.title)
            self.list.addItem(item)
            if conv.id == select:
                self.list.setCurrentItem(item)
        self.list.blockSignals(False)

    def titles(self) -> list[str]:
        return [self.list.item(i).text() for i in range(self.list.count())]

    def _current_changed(self, current, _previous) -> None:
        if current is not None:
            self.selected.emit(current.data(Qt.ItemDataRole.UserRole))

    def _menu(self, pos) -> None:
        item = self.list.itemAt(pos)
        if item is None:
            return
        cid = item.data(Qt.ItemDataRole.UserRole)
        menu = QMenu(self)
        menu.addAction("Rename…", lambda: self.rename(cid))
        menu.addAction("Delete", lambda: self.delete(cid))
        menu.exec(self.list.mapToGlobal(pos))

    def rename(self, cid: int | None) -> None:
        conv = self.store.get(cid) if cid is not None else None
        if conv is None:
            return
        title, ok = self.ask_title(conv.title)
        if ok and title.strip():
            self.store.rename(cid, title)
            self.refresh(cid)

    def delete(self, cid: int | None) -> None:
        conv = self.store.get(cid) if cid is not None else None
        if conv is None or not self.confirm_delete(conv.title):
            return
        self.store.delete(cid)
        self.refresh()
        if self.list.count():
            self.list.setCurrentRow(0)
        else:
            self.new_requested.emit()


class _Input(QPlainTextEdit):
    """Enter sends, Shift+Enter adds a line."""

    submit = Signal()

    def keyPressEvent(self, event: QKeyEvent) -> None:
        if event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter) and not (
                event.modifiers() & Qt.KeyboardModifier.ShiftModifier):
            self.submit.emit()
            return
        super().keyPressEvent(event)


class ChatPanel(QWidget):
    """``controller`` gives ``client`` (ApiClient), ``model_id``, ``set_mode()`` and the ``mode_changed`` signal."""

    generation_finished = Signal()

    def __init__(self, controller, store: ConversationStore, parent=None):
        super().__init__(parent)
        self.controller = controller
        self.store = store
        self.conversation: Conversation | None = None
        self.messages: list[Message] = []
        self.streaming: Message | None = None
        self.task: asyncio.Task | None = None
        self.editing: int | None = None
        self.expanded: set[int] = set()  # message ids with their reasoning shown
        self.dirty = False
        self._stick = True  # the transcript follows its end
        self.render_count = 0
        self.max_tokens: int | None = None
        self._build()
        self._timer = QTimer(self, interval=REPAINT_MS)
        self._timer.timeout.connect(self._repaint_if_dirty)
        self._timer.start()
        controller.mode_changed.connect(self.show_mode)
        self.show_mode(controller.mode, controller.sampling)

    # ---- layout --------------------------------------------------------------------------------------------------
    def _build(self) -> None:
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        bar = QHBoxLayout()
        self.model_label = QLabel()
        self.model_label.setObjectName("Section")
        bar.addWidget(self.model_label)
        bar.addStretch(1)
        self.mode_buttons = QButtonGroup(self)
        self.mode_buttons.setExclusive(True)
        for mode, tip in (("chat", "Varied sampling for conversation (temperature 0.7)"),
                          ("agent", "Convergent sampling for tools and agents: stops repeated tool calls "
                                    "(temperature 0.2, light presence penalty)")):
            b = QPushButton(mode.capitalize())
            b.setCheckable(True)
            b.setToolTip(tip + ". Switches the server's default sampling live, for every client.")
            b.setProperty("mode", mode)
            self.mode_buttons.addButton(b)
            bar.addWidget(b)
        self.mode_buttons.buttonClicked.connect(lambda b: spawn(self.controller.set_mode(b.property("mode"))))
        self.sampling_label = QLabel()
        self.sampling_label.setObjectName("Muted")
        bar.addWidget(self.sampling_label)
        self.system_toggle = QToolButton()
        self.system_toggle.setText("System prompt")
        self.system_toggle.setCheckable(True)
        self.system_toggle.toggled.connect(lambda on: self.system_prompt.setVisible(on))
        bar.addWidget(self.system_toggle)
        layout.addLayout(bar)

        self.system_prompt = QPlainTextEdit()
        self.system_prompt.setPlaceholderText("System prompt for this conversation (optional)")
        self.system_prompt.setMaximumHeight(80)
        self.system_prompt.setVisible(False)
        self.system_prompt.textChanged.connect(self._system_changed)
        layout.addWidget(self.system_prompt)

        self.view = QTextBrowser()
        self.view.setObjectName("Transcript")
        self.view.setOpenLinks(False)
        self.view.anchorClicked.connect(self._link)
        self.view.verticalScrollBar().sliderMoved.connect(
            lambda v: setattr(self, "_stick", v >= self.view.verticalScrollBar().maximum() - 8))
        layout.addWidget(self.view, 1)

        self.edit_bar = QWidget()
        eb = QHBoxLayout(self.edit_bar)
        eb.setContentsMargins(0, 0, 0, 0)
        self.edit_label = QLabel("Editing a message: sending replaces it and everything after it.")
        self.edit_label.setObjectName("Muted")
        cancel_edit = QPushButton("Cancel edit")
        cancel_edit.clicked.connect(self.cancel_edit)
        eb.addWidget(self.edit_label, 1)
        eb.addWidget(cancel_edit)
        self.edit_bar.setVisible(False)
        layout.addWidget(self.edit_bar)

        row = QHBoxLayout()
        self.input = _Input()
        self.input.setPlaceholderText("Message the model  (Enter sends, Shift+Enter for a new line)")
        self.input.setMaximumHeight(96)
        self.input.submit.connect(lambda: self.send())
        row.addWidget(self.input, 1)
        buttons = QVBoxLayout()
        self.send_button = QPushButton("Send")
        self.send_button.setObjectName("Primary")
        self.send_button.clicked.connect(lambda: self.send())
        self.stop_button = QPushButton("Stop")
        self.stop_button.clicked.connect(self.stop)
        self.regen_button = QPushButton("Regenerate")
        self.regen_button.clicked.connect(self.regenerate)
        buttons.addWidget(self.send_button)
        buttons.addWidget(self.stop_button)
        buttons.addWidget(self.regen_button)
        row.addLayout(buttons)
        layout.addLayout(row)
        opts = QHBoxLayout()
        opts.addStretch(1)
        opts.addWidget(QLabel("Max tokens"))
        self.max_tokens_spin = QSpinBox()
        self.max_tokens_spin.setRange(0, 1_000_000)
        self.max_tokens_spin.setSpecialValueText("server default")
        self.max_tokens_spin.setToolTip("Longest answer in tokens; 0 uses the server's default_max_tokens.")
        self.max_tokens_spin.valueChanged.connect(lambda v: setattr(self, "max_tokens", v or None))
        opts.addWidget(self.max_tokens_spin)
        layout.addLayout(opts)
        self._update_buttons()

    # ---- conversations -----------------------------------------------------------------------------------------
    def open(self, conversation_id: int | None) -> None:
        if self.busy:
            self.stop()
        conv = self.store.get(conversation_id) if conversation_id is not None else None
        self.conversation = conv
        self.messages = self.store.messages(conv.id) if conv else []
        self.system_prompt.blockSignals(True)
        self.system_prompt.setPlainText(conv.system_prompt if conv else "")
        self.system_prompt.blockSignals(False)
        self.system_toggle.setChecked(bool(conv and conv.system_prompt))
        self.cancel_edit()
        self._stick = True
        self.render()
        self._update_buttons()

    def _system_changed(self) -> None:
        if self.conversation is not None:
            self.conversation.system_prompt = self.system_prompt.toPlainText()
            self.store.set_system_prompt(self.conversation.id, self.conversation.system_prompt)

    def _ensure_conversation(self) -> Conversation:
        if self.conversation is None:
            self.conversation = self.store.create(NEW_TITLE, self.system_prompt.toPlainText())
            self.controller.conversations_changed(self.conversation.id)
        return self.conversation

    # ---- sending -------------------------------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return self.task is not None and not self.task.done()

    def send(self, text: str | None = None) -> bool:
        text = (self.input.toPlainText() if text is None else text).strip()
        if not text or self.busy or self.controller.client is None:
            return False
        conv = self._ensure_conversation()
        if self.editing is not None:
            self.store.truncate(conv.id, self.editing)
            self.messages = self.messages[:self.editing]
            self.cancel_edit()
        self.messages.append(self.store.append(conv.id, Message("user", text)))
        if conv.title == NEW_TITLE:
            conv.title = text.splitlines()[0][:48] or NEW_TITLE
            self.store.rename(conv.id, conv.title)
            self.controller.conversations_changed(conv.id)
        self.input.clear()
        self._generate()
        return True

    def regenerate(self) -> bool:
        if self.busy or self.conversation is None:
            return False
        last_user = max((i for i, m in enumerate(self.messages) if m.role == "user"), default=None)
        if last_user is None:
            return False
        self.store.truncate(self.conversation.id, last_user + 1)
        self.messages = self.messages[:last_user + 1]
        self._generate()
        return True

    def stop(self) -> None:
        if self.busy:
            self.task.cancel()

    def edit(self, index: int) -> None:
        if self.busy or not (0 <= index < len(self.messages)) or self.messages[index].role != "user":
            return
        self.editing = index
        self.input.setPlainText(self.messages[index].content)
        self.input.setFocus()
        self.edit_bar.setVisible(True)

    def cancel_edit(self) -> None:
        self.editing = None
        self.edit_bar.setVisible(False)

    def copy(self, index: int) -> None:
        if 0 <= index < len(self.messages):
            QGuiApplication.clipboard().setText(self.messages[index].content)

    def _generate(self) -> None:
        conv = self.conversation
        assistant = self.store.append(conv.id, Message("assistant"))
        self.messages.append(assistant)
        self.streaming = assistant
        self.task = spawn(self._stream(assistant), "chat-stream")
        self.task.add_done_callback(lambda _t: self._never_ran(assistant))
        self._update_buttons()
        self.render()

    def _never_ran(self, msg: Message) -> None:
        """The task is done: update the buttons; a task cancelled before it started never reached its ``finally``,
        so tidy up for it."""
        self._update_buttons()
        if self.streaming is msg:
            self.streaming = None
            msg.stats["finish"] = "stopped"
            self.store.update(msg)
            self.render()
            self._update_buttons()
            self.generation_finished.emit()

    def api_messages(self) -> list[dict]:
        history = [m for m in self.messages if m is not self.streaming and not m.stats.get("error")
                   and (m.role != "assistant" or m.content or m.tool_calls)]
        system = self.system_prompt.toPlainText().strip()
        return ([{"role": "system", "content": system}] if system else []) + [m.api_dict() for m in history]

    async def _stream(self, msg: Message) -> None:
        client = self.controller.client
        messages = self.api_messages()
        t0 = time.perf_counter()
        first: float | None = None
        events = 0
        usage = None
        finish = None
        try:
            stream = client.stream_chat(self.controller.model_id, messages, max_tokens=self.max_tokens)
            async with aclosing(stream) as events_in:
                async for ev in events_in:
                    if ev.kind in ("content", "reasoning", "tool_calls"):
                        first = first if first is not None else time.perf_counter()
                        events += 1
                    if ev.kind == "content":
                        msg.content += ev.text
                    elif ev.kind == "reasoning":
                        msg.reasoning += ev.text
                    elif ev.kind == "tool_calls":
                        msg.tool_calls = ev.data
                    elif ev.kind == "usage":
                        usage = ev.data
                    elif ev.kind == "finish":
                        finish = ev.text
                    elif ev.kind == "error":
                        msg.stats["error"] = ev.text
                    self.dirty = True
        except asyncio.CancelledError:
            finish = "stopped"
        except ApiError as e:
            msg.stats["error"] = str(e)
        except httpx.HTTPError as e:
            msg.stats["error"] = f"{type(e).__name__}: {e or 'the connection failed'}"
        finally:
            end = time.perf_counter()
            tokens = (usage or {}).get("completion_tokens", events if events else None)
            msg.stats.update(tokens=tokens, finish=finish or msg.stats.get("finish"),
                             ttft=(first - t0) if first is not None else None,
                             tok_s=((tokens - 1) / (end - first)) if first is not None and tokens and tokens > 1
                             and end > first else None)
            self.store.update(msg)
            self.streaming = None
            self.render()
            self._update_buttons()
            self.generation_finished.emit()

    # ---- showing ---------------------------------------------------------------------------------------------------
    def show_mode(self, mode: str | None, sampling: dict | None) -> None:
        available = mode is not None
        for b in self.mode_buttons.buttons():
            b.setEnabled(available)
            b.setChecked(b.property("mode") == mode)
        self.sampling_label.setText(sampling_text(sampling) if available else
                                    "this server has no mode switch")

    def set_model_label(self, text: str) -> None:
        self.model_label.setText(text)

    def _update_buttons(self) -> None:
        busy = self.busy
        self.send_button.setEnabled(not busy)
        self.stop_button.setEnabled(busy)
        self.regen_button.setEnabled(not busy and any(m.role == "user" for m in self.messages))

    def _repaint_if_dirty(self) -> None:
        if self.dirty:
            self.render()

    def render(self) -> None:
        self.dirty = False
        self.render_count += 1
        bar = self.view.verticalScrollBar()
        at_bottom = self._stick or bar.value() >= bar.maximum() - 8
        position = bar.value()
        self.view.setHtml(self.transcript_html())
        bar.setValue(bar.maximum() if at_bottom else position)
        self._stick = at_bottom  # follow the answer; reading further up stops following
        if at_bottom:  # once the layout is done (also when the tab was hidden while it grew)
            QTimer.singleShot(0, lambda: bar.setValue(bar.maximum()))

    def showEvent(self, event) -> None:
        super().showEvent(event)
        if self._stick:
            QTimer.singleShot(0, lambda: self.view.verticalScrollBar().setValue(
                self.view.verticalScrollBar().maximum()))

    def transcript_html(self) -> str:
        t = theme.transcript_theme()
        if not self.messages:
            tip = ("Ask anything. Answers stream from the model through its OpenAI-compatible API; the same API "
                   "serves your editor or agent (see the Server tab).")
            return (f'<div style="color:{t["muted"]};margin:40px 30px;text-align:center">'
                    f'<p style="font-size:large">Start a conversation</p><p>{html.escape(tip)}</p></div>')
        last_assistant = max((i for i, m in enumerate(self.messages) if m.role == "assistant"), default=-1)
        out = [f'<div style="color:{t["text"]}">']
        for i, m in enumerate(self.messages):
            out.append(self._message_html(i, m, t, i == last_assistant))
        out.append("</div>")
        return "".join(out)

    def _message_html(self, i: int, m: Message, t: dict, last_assistant: bool) -> str:
        link = f'style="color:{t["accent"]};text-decoration:none"'
        if m.role == "user":
            bg, who = t["user_bg"], "You"
            actions = [f'<a href="ninfer:copy/{i}" {link}>Copy</a>', f'<a href="ninfer:edit/{i}" {link}>Edit</a>']
        else:
            bg, who = t["assistant_bg"], "Assistant"
            actions = [f'<a href="ninfer:copy/{i}" {link}>Copy</a>']
            if last_assistant and m is not self.streaming:
                actions.append(f'<a href="ninfer:regen/{i}" {link}>Regenerate</a>')
        body = []
        if m.reasoning:
            shown = m.id in self.expanded
            arrow = "▾" if shown else "▸"
            words = len(m.reasoning.split())
            body.append(f'<p style="margin:2px 0"><a href="ninfer:reasoning/{i}" {link}>{arrow} Reasoning '
                        f'({words} words)</a></p>')
            if shown:
                body.append(f'<table width="100%" cellpadding="6" bgcolor="{t["reasoning_bg"]}"><tr><td '
                            f'style="color:{t["muted"]}">{render.markdown(m.reasoning, t)}</td></tr></table>')
        if m.tool_calls:
            body.append(render.tool_calls_html(m.tool_calls, t))
        if m is self.streaming:
            body.append(render.markdown(m.content + "▍", t))  # the cursor follows the text, even inside code
        elif m.content:
            body.append(render.markdown(m.content, t))
        if m.stats.get("error"):
            body.append(f'<p style="color:{t["error"]}">⚠ {html.escape(m.stats["error"])}</p>')
        stats = render.stats_text(m.stats) if m.role == "assistant" and m is not self.streaming else ""
        meta = f'<span style="color:{t["muted"]};font-size:small">&nbsp;&nbsp;{html.escape(stats)}</span>'
        acts = (f'<p style="margin:4px 0 0 0;font-size:small">{" &nbsp;·&nbsp; ".join(actions)}</p>'
                if m is not self.streaming else "")
        return (f'<table width="100%" cellspacing="0" cellpadding="10" style="margin:6px 4px" bgcolor="{bg}">'
                f'<tr><td><b>{who}</b>{meta}{"".join(body)}{acts}</td></tr></table>')

    def _link(self, url: QUrl) -> None:
        if url.scheme() != "ninfer":
            QDesktopServices.openUrl(url)
            return
        action, _, index = url.path().partition("/")
        try:
            i = int(index)
        except ValueError:
            return
        if action == "copy":
            self.copy(i)
        elif action == "edit":
            self.edit(i)
        elif action == "regen":
            self.regenerate()
        elif action == "reasoning" and 0 <= i < len(self.messages):
            self.expanded ^= {self.messages[i].id}
            self.render()
