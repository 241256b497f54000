"""The tray icon: Show, Copy API URL, Mode > Chat/Agent, Start/Stop server, Quit. The menu exists even where the
system has no tray (it is then simply not shown), so the same actions back the main window's menus and the tests."""
from __future__ import annotations

from PySide6.QtGui import QAction, QActionGroup
from PySide6.QtWidgets import QMenu, QSystemTrayIcon

from app import theme
from app.asyncutil import spawn


class Tray:
    def __init__(self, controller, show_icon: bool):
        self.controller = controller
        c = controller
        self.menu = QMenu()
        self.show_action = self.menu.addAction("Show NInfer", c.show_window)
        self.copy_action = self.menu.addAction("Copy API URL", c.copy_url)
        mode_menu = self.menu.addMenu("Mode")
        self.mode_group = QActionGroup(self.menu)
        self.mode_actions: dict[str, QAction] = {}
        for name in ("chat", "agent"):
            a = mode_menu.addAction(name.capitalize(), lambda n=name: spawn(c.set_mode(n)))
            a.setCheckable(True)
            self.mode_group.addAction(a)
            self.mode_actions[name] = a
        self.server_action = self.menu.addAction("Stop server", c.toggle_server)
        self.menu.addSeparator()
        self.quit_action = self.menu.addAction("Quit NInfer", lambda: spawn(c.quit()))
        self.icon = QSystemTrayIcon(theme.app_icon())
        self.icon.setContextMenu(self.menu)
        self.icon.setToolTip("NInfer")
        self.icon.activated.connect(self._activated)
        if show_icon:
            self.icon.show()

    def _activated(self, reason) -> None:
        if reason in (QSystemTrayIcon.ActivationReason.Trigger, QSystemTrayIcon.ActivationReason.DoubleClick):
            self.controller.show_window()

    def refresh(self) -> None:
        c = self.controller
        s = c.service
        self.icon.setToolTip(f"NInfer — {c.status_text()}")
        self.copy_action.setEnabled(c.endpoint is not None)
        self.server_action.setText("Stop server" if s is not None and s.serving else "Start server")
        self.server_action.setEnabled(c.can_toggle_server)
        for name, a in self.mode_actions.items():
            a.setChecked(name == c.mode)
            a.setEnabled(c.mode is not None)

    def notify(self, title: str, message: str) -> None:
        if self.icon.isVisible():
            self.icon.showMessage(title, message, theme.app_icon(), 4000)

    def hide(self) -> None:
        self.icon.hide()
