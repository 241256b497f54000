"""The chat: a transcript streamed over the HTTP API, like any client (the conversation list is
app/chat/conversations.py, the transcript's HTML app/chat/transcript.py, the per-conversation settings
app/chat/options.py, the context bar and attachments app/chat/context_bar.py).

Streaming runs as an asyncio task on the qasync loop (httpx), never on the GUI thread's time: tokens only mark the
transcript dirty, and a timer repaints it a few times a second. Stop cancels the task, which closes the connection,
which aborts the request in the engine. Each answer records its tokens, time to first token and tokens per second.
Regenerate keeps the earlier answers as versions to flip through (app/chat/versions.py). When the conversation outgrows
the model's context, the oldest turns are left out of the prompt and the answer says so (app/chat/context.py). With
MCP servers picked under Tools, a turn loops through approved tool calls (app/chat/streaming.py, tools.py). Images are
attached, pasted or dropped (app/chat/image_input.py) and sent as content parts before the message's text.
"""
from __future__ import annotations

import asyncio

from PySide6.QtCore import QTimer, Signal
from PySide6.QtWidgets import QButtonGroup, QHBoxLayout, QLabel, QPushButton, QToolButton, QVBoxLayout, QWidget

from engine.errors import NInferError

from app import theme
from app.chat import context, render, versions
from app.asyncutil import spawn
from app.chat.context_bar import ContextBar
from app.chat.image_input import ImageInput
from app.chat.image_tray import ImageTray
from app.chat.image_view import TranscriptBrowser
from app.chat.images import content as image_content
from app.chat.message_box import MessageBox
from app.chat.actions import TranscriptActions
from app.chat.options import ChatOptions
from app.chat.streaming import TurnMixin
from app.chat.tool_widgets import ApprovalBar, ToolsBar
from app.chat.tools import ChatTools, agent_sampling
from app.chat.store import Conversation, ConversationStore, Message
from app.chat.transcript import header_text, transcript_html

REPAINT_MS = 200  # at most five repaints a second while tokens stream
COPIED_MS = 1500  # how long "Copied ✓" stands in place of a Copy link
NEW_TITLE = "New chat"


def transcript_palette() -> dict[str, str]:
    """The transcript's colours for the app's current theme."""
    return render.DARK if theme.is_dark() else render.LIGHT


class ChatPanel(TurnMixin, TranscriptActions, ImageInput, QWidget):
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
        self.copied: tuple[int, int | None] | None = None  # (message, code block or None) just copied
        self.chars_per_token = context.DEFAULT_CHARS_PER_TOKEN  # calibrated by each answer's usage
        self.last_count: tuple[int, int] | None = None  # (content characters, prompt tokens) of the last request
        self.mode_sampling: tuple[str | None, dict | None] = (None, None)  # the server's mode and its sampling
        self.shown_model: str | None = None  # the model loaded when the transcript was last drawn
        self.tools = ChatTools(controller.config)  # MCP servers' tools (app/chat/tools.py)
        self.mcp_dialog = None
        self._build()
        self.setAcceptDrops(True)  # image files or data dropped anywhere on the chat (ImageInput.dropEvent)
        self._copied_timer = QTimer(self, singleShot=True, interval=COPIED_MS)
        self._copied_timer.timeout.connect(self._copied_done)
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
        self.model_label.setWordWrap(True)  # a long model name or remote URL wraps instead of widening the window
        bar.addWidget(self.model_label, 1)
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
        self.system_toggle = QToolButton()
        self.system_toggle.setText("Chat settings")
        self.system_toggle.setToolTip("System prompt, temperature, top-p, top-k and max tokens for this conversation")
        self.system_toggle.setCheckable(True)
        self.system_toggle.toggled.connect(lambda on: self.options.setVisible(on))
        bar.addWidget(self.system_toggle)
        self.tools_toggle = QToolButton()
        self.tools_toggle.setText("Tools")
        self.tools_toggle.setToolTip("Which MCP servers' tools the model may call in this conversation")
        self.tools_toggle.setCheckable(True)
        self.tools_toggle.toggled.connect(lambda on: self.tools_bar.setVisible(on))
        bar.addWidget(self.tools_toggle)
        layout.addLayout(bar)
        self.sampling_label = QLabel()
        self.sampling_label.setObjectName("Muted")
        self.sampling_label.setWordWrap(True)
        layout.addWidget(self.sampling_label)

        self.options = ChatOptions()
        self.options.setVisible(False)
        self.system_prompt = self.options.system_prompt
        self.options.changed.connect(self._options_changed)
        layout.addWidget(self.options)
        self.tools_bar = ToolsBar()
        self.tools_bar.setVisible(False)
        self.tools_bar.changed.connect(self._tools_changed)
        self.tools_bar.edit_requested.connect(self.edit_servers)
        layout.addWidget(self.tools_bar)

        self.view = TranscriptBrowser()
        self.view.setObjectName("Transcript")
        self.view.setOpenLinks(False)
        self.view.anchorClicked.connect(self._link)
        self.view.verticalScrollBar().sliderMoved.connect(
            lambda v: setattr(self, "_stick", v >= self.view.verticalScrollBar().maximum() - 8))
        layout.addWidget(self.view, 1)

        self.edit_bar = QWidget()
        eb = QHBoxLayout(self.edit_bar)
        eb.setContentsMargins(0, 0, 0, 0)
        self.edit_label = QLabel("Editing a message: sending starts a new branch from it (the earlier one stays, "
                                 "to flip back to).")
        self.edit_label.setWordWrap(True)
        self.edit_label.setObjectName("Muted")
        cancel_edit = QPushButton("Cancel edit")
        cancel_edit.clicked.connect(self.cancel_edit)
        eb.addWidget(self.edit_label, 1)
        eb.addWidget(cancel_edit)
        self.edit_bar.setVisible(False)
        layout.addWidget(self.edit_bar)

        self.notice = QLabel()  # why a message was not sent (too long for the context, ...)
        self.notice.setObjectName("Error")
        self.notice.setWordWrap(True)
        self.notice.setVisible(False)
        layout.addWidget(self.notice)
        self.approval = ApprovalBar()  # a tool call waiting for the user's answer
        layout.addWidget(self.approval)
        self.image_tray = ImageTray()  # the images the next message carries
        self.image_tray.changed.connect(self.update_context)
        layout.addWidget(self.image_tray)
        row = QHBoxLayout()
        self.input = MessageBox()
        self.input.submit.connect(lambda: self.send())
        self.input.images_offered.connect(self.attach_images_from)
        self.input.textChanged.connect(self.update_context)
        row.addWidget(self.input, 1)
        buttons = QVBoxLayout()
        self.send_button, self.stop_button, self.regen_button = (QPushButton(t) for t in ("Send", "Stop", "Regenerate"))
        self.send_button.setObjectName("Primary")
        for b, slot in ((self.send_button, lambda: self.send()), (self.stop_button, self.stop),
                        (self.regen_button, self.regenerate)):
            b.clicked.connect(slot)
            buttons.addWidget(b)
        row.addLayout(buttons)
        layout.addLayout(row)
        self.context_bar = ContextBar(self)
        self.context_bar.changed.connect(self.update_context)
        layout.addWidget(self.context_bar)
        self._update_buttons()

    # ---- conversations -----------------------------------------------------------------------------------------
    def open(self, conversation_id: int | None) -> None:
        if self.busy:
            self.stop()
        conv = self.store.get(conversation_id) if conversation_id is not None else None
        self.conversation = conv
        self.messages = self.store.messages(conv.id) if conv else []
        self.options.set_options(conv.options if conv else {}, conv.system_prompt if conv else "")
        self.system_toggle.setChecked(bool(conv and (conv.system_prompt or conv.options)))
        self.show_tools(conv.tools if conv else [])
        self.context_bar.clear_attachments()
        self.image_tray.clear()
        self.notice.setVisible(False)
        self.cancel_edit()
        self.update_context()
        self._stick = True
        self.render()
        self._show_sampling()
        self._update_buttons()

    def _options_changed(self) -> None:
        if self.conversation is not None:
            self.conversation.system_prompt = self.system_prompt.toPlainText()
            self.conversation.options = self.options.options()
            self.store.set_system_prompt(self.conversation.id, self.conversation.system_prompt)
            self.store.set_options(self.conversation.id, self.conversation.options)
        self._show_sampling()
        self.update_context()

    # ---- MCP tools (app/chat/tools.py, streaming.py) ----------------------------------------------------------------
    def show_tools(self, chosen: list[str]) -> None:
        """The Tools bar for a conversation whose chosen servers are ``chosen`` (read mcp.json again)."""
        try:
            servers, error = self.tools.servers(), None
        except NInferError as e:
            servers, error = {}, str(e)
        self.tools_bar.set_servers(servers, chosen, error, bool(self.controller.config.get("mcp_require_call")))
        on = self.tools_bar.chosen()
        self.tools_toggle.setText(f"Tools ({len(on)})" if on else "Tools")
        self._show_sampling()

    def _tools_changed(self) -> None:
        chosen = self.tools_bar.chosen()
        if self.tools_bar.require.isChecked() != bool(self.controller.config.get("mcp_require_call")):
            self.controller.config.set("mcp_require_call", self.tools_bar.require.isChecked())
        if self.conversation is not None:
            self.conversation.tools = chosen
            self.store.set_tools(self.conversation.id, chosen)
        self.tools_toggle.setText(f"Tools ({len(chosen)})" if chosen else "Tools")
        self._show_sampling()

    def edit_servers(self) -> None:
        """MCP servers…: the dialog (not modal for the event loop: Test connection runs while it is open)."""
        from app.chat.mcp_dialog import McpServersDialog
        if self.mcp_dialog is not None:
            self.mcp_dialog.deleteLater()
        self.mcp_dialog = McpServersDialog(self.tools, self)
        self.mcp_dialog.accepted.connect(lambda: self.show_tools(self.tools_bar.chosen()))
        self.mcp_dialog.open()

    @property
    def max_tokens(self) -> int | None:
        return self.options.options().get("max_tokens")

    @max_tokens.setter
    def max_tokens(self, value: int | None) -> None:
        self.options.set_value("max_tokens", value)

    def _ensure_conversation(self) -> Conversation:
        if self.conversation is None:
            self.conversation = self.store.create(NEW_TITLE, self.system_prompt.toPlainText())
            self.conversation.options = self.options.options()
            self.store.set_options(self.conversation.id, self.conversation.options)
            self._tools_changed()
            self.controller.conversations_changed(self.conversation.id)
        return self.conversation

    # ---- sending -------------------------------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return self.task is not None and not self.task.done()

    def send(self, text: str | None = None) -> bool:
        text = (self.input.toPlainText() if text is None else text).strip()
        images = list(self.image_tray.images)
        if not (text or images) or self.busy or self.controller.client is None:
            return False
        refusal = self.vision_refusal(images)  # the text and the images stay where they are
        if refusal:
            self.notice.setText(refusal)
            self.notice.setVisible(True)
            return False
        text = self.context_bar.with_attachments(text)
        problem = self.context_bar.too_long(text)  # an estimate: said, never a refusal (the server counts exactly,
        self.notice.setText(problem or "")        # and its refusal shows as the answer's error)
        self.notice.setVisible(bool(problem))
        self.context_bar.clear_attachments()
        self.image_tray.clear()
        conv = self._ensure_conversation()
        user = Message("user", text, images=images)
        if self.editing is not None:  # what followed the edited message stays, as a branch to flip back to
            versions.edited(self.messages[self.editing:], user)
            self.store.truncate(conv.id, self.editing)
            self.messages = self.messages[:self.editing]
            self.cancel_edit()
        self.messages.append(self.store.append(conv.id, user))
        if conv.title == NEW_TITLE:
            conv.title = (text.splitlines() or [images[0].name])[0][:48] or NEW_TITLE
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
        before = versions.earlier(self.messages[last_user + 1:])  # the earlier answers stay: versions of the new one
        self.store.truncate(self.conversation.id, last_user + 1)
        self.messages = self.messages[:last_user + 1]
        self._generate(before)
        return True

    def stop(self) -> None:
        if self.busy:
            self.task.cancel()
        self.input.setFocus()  # the next message is typed at once (Stop is about to be disabled)

    def _generate(self, before: list | None = None) -> None:
        assistant = self._new_answer()
        self.task = spawn(self._turn(assistant, before or []), "chat-turn")
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

    def api_messages(self, extra: str | list | None = None) -> list[dict]:
        """The conversation as the API takes it (``extra``: the content of a message still being typed, for the
        context bar)."""
        history = [m for m in self.messages if m is not self.streaming and not m.stats.get("error")
                   and (m.role != "assistant" or m.content or m.tool_calls)]
        system = self.system_prompt.toPlainText().strip()
        out = ([{"role": "system", "content": system}] if system else []) + [m.api_dict() for m in history]
        return out + ([{"role": "user", "content": extra}] if extra else [])

    def update_context(self) -> None:
        typed, images = self.input.toPlainText().strip(), self.image_tray.images
        self.context_bar.show_usage(self.api_messages(image_content(self.context_bar.with_attachments(typed), images)
                                                      if typed or self.context_bar.attachments or images else None))

    # ---- showing ---------------------------------------------------------------------------------------------------
    def show_mode(self, mode: str | None, sampling: dict | None) -> None:
        available = mode is not None
        for b in self.mode_buttons.buttons():
            b.setEnabled(available)
            b.setChecked(b.property("mode") == mode)
        self.mode_sampling = (mode, sampling)
        self._show_sampling()
        self.options.set_defaults(sampling, self.controller.default_max_tokens()
                                  if hasattr(self.controller, "default_max_tokens") else None)

    def _show_sampling(self) -> None:
        """The header's line: this conversation's own sampling values, then the mode's for the rest."""
        mode, sampling = self.mode_sampling
        if self.tools_bar.usable():  # while tools are on, the requests carry Agent mode's sampling
            sampling, mode = agent_sampling(mode is not None), mode or "agent"
        self.sampling_label.setText(header_text(sampling, self.options.options(), mode is not None))

    def set_model_label(self, text: str) -> None:
        self.model_label.setText(text)
        if self.controller.model_id != self.shown_model:  # a switch: the answers say which model wrote them
            self.render()

    def _update_buttons(self) -> None:
        busy = self.busy
        if busy is False and self.stop_button.hasFocus():
            self.input.setFocus()  # a disabled Stop would hand the focus to the next field
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
        self.view.set_images({im.key: im for m in self.messages for im in m.images})
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
        self.shown_model = self.controller.model_id
        return transcript_html(self.messages, self.streaming, self.expanded, transcript_palette(), self.copied,
                               self.shown_model, busy=self.busy)
