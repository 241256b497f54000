"""The main window: conversations on the left; Chat, Monitor, Server and Logs tabs; a status bar that says what
serves where; File ▸ Export / Import conversation (Markdown or JSON). Closing it hides it in the tray (the API keeps
answering) or, with no tray, asks before quitting. Its size is remembered between runs."""
from __future__ import annotations

from pathlib import Path

from PySide6.QtGui import QAction, QActionGroup, QKeySequence
from PySide6.QtWidgets import QFileDialog, QLabel, QMainWindow, QMessageBox, QSplitter, QTabWidget, QWidget

from app.chat import files as chat_io

from app import theme
from app.asyncutil import spawn
from app.chat.view import ChatPanel
from app.chat.conversations import ConversationList
from app.evals.reports import EvalReportsPanel, configuration_flags
from app.server.logs import LogsPanel
from app.monitor.panel import MonitorPanel
from app.server.panel import ServerPanel
from app.widgets import last_folder, remember_folder, remember_size, restore_size


class MainWindow(QMainWindow):
    def __init__(self, controller, log_handler):
        super().__init__()
        self.controller = controller
        self.setWindowTitle("NInfer")
        self.setWindowIcon(theme.app_icon())
        self.setMinimumSize(640, 480)
        store = controller.store

        split = QSplitter()
        self.conversations = ConversationList(store)
        self.conversations.setMinimumWidth(175)
        self.conversations.setMaximumWidth(360)
        split.addWidget(self.conversations)
        self.tabs = QTabWidget()
        self.chat = ChatPanel(controller, store)
        self.monitor = MonitorPanel(controller)
        self.server = ServerPanel(controller)
        self.logs = LogsPanel(log_handler)
        self.tabs.addTab(self.chat, "Chat")
        self.tabs.addTab(self.monitor, "Monitor")
        self.tabs.addTab(self.server, "Server")
        self.tabs.addTab(self.logs, "Logs")
        self.evals = EvalReportsPanel()  # ninfer-eval's reports on the running configuration
        self.tabs.addTab(self.evals, "Checks")
        self._eval_flags: list[str] | None = None
        split.addWidget(self.tabs)
        split.setStretchFactor(1, 1)
        split.setCollapsible(1, False)
        split.setSizes([240, 940])
        container = QWidget()
        from PySide6.QtWidgets import QVBoxLayout
        layout = QVBoxLayout(container)
        layout.setContentsMargins(10, 8, 10, 4)
        layout.addWidget(split)
        self.setCentralWidget(container)

        self.status_label = QLabel()
        self.status_label.setMinimumWidth(50)  # a long URL is cut in the status bar, never the window widened
        self.statusBar().addWidget(self.status_label, 1)
        restore_size(self, controller.config, "main", (1180, 800))

        self.conversations.selected.connect(self.chat.open)
        self.conversations.new_requested.connect(self.new_chat)
        self._menus()
        self.conversations.refresh()
        if self.conversations.list.count():
            self.conversations.list.setCurrentRow(0)
        else:
            self.chat.open(None)

    def _menus(self) -> None:
        c = self.controller
        bar = self.menuBar()
        file = bar.addMenu("&File")
        new = file.addAction("New chat", self.new_chat)
        new.setShortcut(QKeySequence.StandardKey.New)
        file.addAction("Import conversation…", lambda: self.import_conversation())
        self.export_action = file.addAction("Export conversation…", lambda: self.export_conversation())
        file.addSeparator()
        file.addAction("Model library…", c.show_library)
        file.addAction("MCP servers…", lambda: self.chat.edit_servers())
        file.addAction("Change model or settings…", lambda: spawn(c.back_to_launcher()))
        file.addSeparator()
        quit_action = file.addAction("Quit", lambda: spawn(c.quit()))
        quit_action.setShortcut(QKeySequence.StandardKey.Quit)
        server = bar.addMenu("&Server")
        server.addAction("Copy API URL", c.copy_url)
        self.server_action = server.addAction("Stop server", c.toggle_server)
        mode = bar.addMenu("&Mode")
        group = QActionGroup(self)
        self.mode_actions: dict[str, QAction] = {}
        for name in ("chat", "agent"):
            a = mode.addAction(name.capitalize(), lambda n=name: spawn(c.set_mode(n)))
            a.setCheckable(True)
            group.addAction(a)
            self.mode_actions[name] = a

    def new_chat(self) -> None:
        self.conversations.search.clear()
        self.chat.open(None)
        self.conversations.list.clearSelection()
        self.conversations.list.setCurrentItem(None)
        self.chat.input.setFocus()

    def export_conversation(self, path: str | None = None) -> str | None:
        """Saves the conversation shown as Markdown (.md) or JSON (.json); returns what went wrong, or None."""
        chat = self.chat
        if chat.conversation is None:
            return self._say("Nothing to export yet: send a message first, or pick a conversation.")
        if path is None:
            name = "".join(ch if ch.isalnum() or ch in " -_" else "_" for ch in chat.conversation.title).strip()
            start = last_folder(self.controller.config, "conversations") / f"{name or 'chat'}.md"
            path, _ = QFileDialog.getSaveFileName(self, "Export conversation", str(start),
                                                  "Markdown (*.md);;JSON, to import again (*.json)")
            if not path:
                return None
            remember_folder(self.controller.config, "conversations", path)
        conv, messages = chat.conversation, chat.messages
        text = chat_io.to_json(conv, messages) if path.lower().endswith(".json") else chat_io.to_markdown(conv, messages)
        try:
            Path(path).write_text(text, encoding="utf-8")
        except OSError as e:
            return self._say(f"Could not write {path}: {e.strerror or e}. Pick another folder.")
        self.statusBar().showMessage(f"Exported to {path}", 5000)
        return None

    def import_conversation(self, path: str | None = None) -> str | None:
        """Adds a conversation from a JSON file (exported here, or OpenAI-style messages) and opens it."""
        if path is None:
            path, _ = QFileDialog.getOpenFileName(self, "Import conversation",
                                                  str(last_folder(self.controller.config, "conversations")),
                                                  "Conversations (*.json);;All files (*)")
            if not path:
                return None
            remember_folder(self.controller.config, "conversations", path)
        try:
            got = chat_io.read_json(Path(path).read_text(encoding="utf-8"))
        except OSError as e:
            return self._say(f"Could not read {path}: {e.strerror or e}.")
        except chat_io.ConversationFileError as e:
            return self._say(f"Could not import {Path(path).name}: {e}")
        title, messages, store = got.title, got.messages, self.controller.store
        conv = store.create(title, got.system_prompt)
        store.set_options(conv.id, got.options)
        store.set_tools(conv.id, got.tools)  # by name: one not configured here shows as unavailable under Tools
        for m in messages:
            store.append(conv.id, m)
        self.conversations.search.clear()
        self.conversations.refresh(conv.id)
        self.chat.open(conv.id)
        self.statusBar().showMessage(f"Imported “{title}” ({len(messages)} messages)", 5000)
        return None

    def _say(self, error: str) -> str:
        self.statusBar().showMessage(error, 10000)
        if self.isVisible() and not self.controller.quitting and getattr(self, "ask", True):
            QMessageBox.warning(self, "NInfer", error)
        return error

    def refresh(self) -> None:
        """The controller's state changed: status bar, labels, menus."""
        c = self.controller
        self.status_label.setText(c.status_text())
        self.chat.set_model_label(c.model_label())
        self.server.refresh()
        s = c.service
        self.server_action.setText("Stop server" if s is not None and s.serving else "Start server")
        self.server_action.setEnabled(c.can_toggle_server)
        for name, a in self.mode_actions.items():
            a.setChecked(name == c.mode)
            a.setEnabled(c.mode is not None)
        flags = configuration_flags(c.settings) if c.settings is not None else None
        if flags is not None and flags != self._eval_flags:
            self._eval_flags = flags
            self.evals.set_configuration(flags)

    def hideEvent(self, event) -> None:
        remember_size(self, self.controller.config, "main")
        super().hideEvent(event)

    def closeEvent(self, event) -> None:
        remember_size(self, self.controller.config, "main")
        if self.controller.window_closing():
            event.accept()
        else:
            event.ignore()
