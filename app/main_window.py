"""The main window: conversations on the left; Chat, Monitor, Server and Logs tabs; a status bar that says what
serves where. Closing it hides it in the tray (the API keeps answering) or, with no tray, asks before quitting."""
from __future__ import annotations

from PySide6.QtGui import QAction, QActionGroup, QKeySequence
from PySide6.QtWidgets import QLabel, QMainWindow, QSplitter, QTabWidget, QWidget

from app import theme
from app.asyncutil import spawn
from app.chat import ChatPanel
from app.conversations import ConversationList
from app.logs import LogsPanel
from app.monitor import MonitorPanel
from app.server_panel import ServerPanel
from app.widgets import remember_size, restore_size


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
        self.conversations.setMinimumWidth(150)
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

    def hideEvent(self, event) -> None:
        remember_size(self, self.controller.config, "main")
        super().hideEvent(event)

    def closeEvent(self, event) -> None:
        remember_size(self, self.controller.config, "main")
        if self.controller.window_closing():
            event.accept()
        else:
            event.ignore()
