"""The chat: a transcript streamed over the HTTP API, like any client (the conversation list is app/conversations.py,
the transcript's HTML app/transcript.py).

Streaming runs as an asyncio task on the qasync loop (httpx), never on the GUI thread's time: tokens only mark the
transcript dirty, and a timer repaints it a few times a second. Stop cancels the task, which closes the connection,
which aborts the request in the engine. Each answer records its tokens, time to first token and tokens per second.
"""
from __future__ import annotations

import asyncio
import time
from contextlib import aclosing

import httpx
from PySide6.QtCore import Qt, QTimer, QUrl, Signal
from PySide6.QtGui import QDesktopServices, QGuiApplication, QKeyEvent
from PySide6.QtWidgets import (QButtonGroup, QHBoxLayout, QLabel, QPlainTextEdit, QPushButton, QSpinBox, QTextBrowser,
                               QToolButton, QVBoxLayout, QWidget)

from app import theme
from app.asyncutil import spawn
from app.client import ApiError
from app.store import Conversation, ConversationStore, Message
from app.transcript import sampling_text, transcript_html

REPAINT_MS = 200  # at most five repaints a second while tokens stream
NEW_TITLE = "New chat"


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
        return transcript_html(self.messages, self.streaming, self.expanded, theme.transcript_theme())

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
