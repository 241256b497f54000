"""The app's conductor: owns the embedded engine (``engine.service.LocalService``), the HTTP client the chat uses
(to the local API or to a remote server), the windows and the tray; decides what closing and quitting mean.

It talks to the engine only through LocalService's public API (start, cancel, stop, restart_server, stats) and to the
model only through HTTP, like any client. Everything that could block (stopping threads, HTTP calls) is awaited on
the qasync loop or run with ``asyncio.to_thread``; the GUI thread only polls ``LocalService`` state from a timer.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Mapping

from PySide6.QtCore import QObject, QTimer, Signal
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import QApplication, QMessageBox, QSystemTrayIcon

from engine.errors import NInferError
from engine.service import CANCELLED, READY, LocalService

from app.server import logs
from app.appconfig import AppConfig, with_server
from app.asyncutil import spawn
from app.backend import BackendMixin
from app.library.control import LibraryMixin
from app.client import ApiClient, Endpoint, shared_url
from app.launcher.window import LauncherWindow
from app.qtcompat import guard_refcount_leaks
from app.chat.store import ConversationStore
from app.tray import Tray

log = logging.getLogger("ninfer.app")
MODE_POLL_MS = 1000


class Controller(LibraryMixin, BackendMixin, QObject):
    state_changed = Signal()
    mode_changed = Signal(object, object)  # mode ("chat"/"agent", or None: no mode switch), sampling dict
    ready = Signal()  # the embedded engine is serving and the chat is connected to it

    def __init__(self, *, config: AppConfig | None = None, store: ConversationStore | None = None,
                 env: Mapping[str, str] | None = None, has_tray: bool | None = None,
                 confirm_quit: Callable[[], bool] | None = None, quit_app: Callable[[], None] | None = None,
                 log_handler: logs.QtLogHandler | None = None):
        super().__init__()
        guard_refcount_leaks()  # PySide6 6.12 on Python 3.11 would otherwise crash a long session (see qtcompat)
        self.config = config or AppConfig()
        self.store = store or ConversationStore()
        self.log_handler = log_handler or logs.install()
        self.service: LocalService | None = None
        self.settings: Any = None  # the Settings the engine was last started with (for Start server)
        self.launch_cfg: dict | None = None
        self.endpoint: Endpoint | None = None
        self.client: ApiClient | None = None
        self.remote = False
        self.model_id: str | None = None
        self.mode: str | None = None
        self.sampling: dict | None = None
        self.quitting = False
        self.starting = False  # start_local is building and binding the service on a worker thread
        self._cancel_requested = False
        self.has_tray = QSystemTrayIcon.isSystemTrayAvailable() if has_tray is None else has_tray
        self.confirm_quit = confirm_quit or self._ask_quit
        self.quit_app = quit_app or QApplication.quit
        self.window = None
        self.library = None  # the model library window, made when first shown
        self.switching = False  # the running engine is switching to another model
        self.tray = Tray(self, self.has_tray)
        self.launcher = LauncherWindow(self, env)
        self._poll_timer = QTimer(self, interval=100)
        self._poll_timer.timeout.connect(self._poll)
        self._status_timer = QTimer(self, interval=1000)
        self._status_timer.timeout.connect(self.state_changed)
        self._status_timer.start()
        self._mode_timer = QTimer(self, interval=MODE_POLL_MS)  # follows mode switches made by other clients
        self._mode_timer.timeout.connect(self._poll_mode)
        self._mode_timer.start()
        self._mode_polling = False
        self._mode_epoch = 0  # counts mode changes shown, so a poll answered before one is dropped
        self.state_changed.connect(self._refresh_views)
        self.mode_changed.connect(lambda *_: self.state_changed.emit())

    # ---- what views show ---------------------------------------------------------------------------------------
    def status_text(self) -> str:
        s = self.service
        if self.remote and self.endpoint is not None:
            local = f" · engine here: {s.status}" if s is not None else ""
            return f"Chatting with {self.endpoint.api_url} · model {self.model_id}{local}"
        if s is None:
            return "Starting the engine…" if self.starting else "Engine stopped"
        if s.status == "loading":
            from engine.build import WARMUP

            if s.message.startswith(WARMUP):  # the weights are in: say which phase of the warm-up runs
                return f"Warming up: {s.message.removeprefix(WARMUP)}…"
            return f"Loading the model… {s.progress:.0%}"
        if s.status == READY:
            loaded = s.state.loaded
            device = f" · {loaded.device}" if loaded is not None else ""
            return f"● Serving {', '.join(s.model_ids)} at {shared_url(s)}{device}"
        return f"Engine {s.status}" + (f": {s.load_error}" if s.load_error else "")

    def model_label(self) -> str:
        if self.model_id is None:
            return "No model"
        return self.model_id + (f"  @ {self.endpoint.base_url}" if self.remote and self.endpoint else "")

    @property
    def can_toggle_server(self) -> bool:
        s = self.service
        if s is not None:
            return s.status == READY
        return self.settings is not None

    def _refresh_views(self) -> None:
        if self.window is not None:
            self.window.refresh()
        self.tray.refresh()

    def restyle(self) -> None:
        """The palette changed (the system switched between light and dark): redraw what paints its own colours."""
        if self.launcher.validation is not None:
            self.launcher._show(self.launcher.validation)
        if self.window is not None:
            self.window.chat.render()
            self.window.monitor.restyle()

    def conversations_changed(self, select: int | None = None) -> None:
        if self.window is not None:
            self.window.conversations.refresh(select)

    # ---- windows -------------------------------------------------------------------------------------------------
    def show_window(self) -> None:
        w = self.window if self.window is not None and (self.service is not None or self.remote) else self.launcher
        w.show()
        w.raise_()
        w.activateWindow()

    def show_main(self) -> None:
        if self.window is None:
            from app.main_window import MainWindow
            self.window = MainWindow(self, self.log_handler)
        self.window.show()
        self.window.raise_()
        self.launcher.hide()
        self.state_changed.emit()

    def window_closing(self) -> bool:
        """The main window is being closed: True lets it close (hide). With a tray the engine and API keep running;
        without one, closing means quitting, so ask first."""
        if self.quitting:
            return True
        if self.has_tray:
            url = self.service.url if self.service is not None and self.service.serving else None
            self.tray.notify("NInfer is still running",
                             (f"The API keeps answering at {url}. " if url else "") + "Quit from the tray icon.")
            return True
        if self.confirm_quit():
            spawn(self.quit(), "quit")
            return True
        return False

    def _ask_quit(self) -> bool:
        parent = self.window if self.window is not None else self.launcher
        serving = self.service is not None and self.service.serving
        text = ("This desktop has no tray to keep NInfer in, so closing the window quits it"
                + (" and stops the API server." if serving else ".") + " Quit NInfer?")
        return QMessageBox.question(parent, "Quit NInfer?", text) == QMessageBox.StandardButton.Yes

    def launcher_closing(self, event) -> None:
        """The launcher is being closed: with nothing else open (no chat window, no engine) that means quit."""
        if self.quitting or self.window is not None and self.window.isVisible():
            event.accept()
            return
        if self.service is None and not self.remote:
            event.accept()
            spawn(self.quit(), "quit")
        elif self.window_closing():
            event.accept()
        else:
            event.ignore()

    # ---- the embedded engine -----------------------------------------------------------------------------------------
    def start_local(self, settings: Any, launch_cfg: dict | None) -> None:
        """Starts the engine off the GUI thread (building the service imports the server, binding waits for it);
        a missing model or a taken port comes back through ``launcher.loading_finished(False, error)``."""
        if self.service is not None or self.starting:
            raise NInferError("The engine is already running.", "Stop it first.")
        self.starting, self._cancel_requested = True, False
        self.settings, self.launch_cfg = settings, launch_cfg
        spawn(self._start_local(settings, launch_cfg), "start-engine")
        self.state_changed.emit()

    async def _start_local(self, settings: Any, launch_cfg: dict | None) -> None:
        try:
            service = await asyncio.to_thread(lambda: LocalService(settings).start())
        except Exception as e:  # NInferError (missing model, port taken) or anything unexpected
            self.starting = False
            error = str(e) if isinstance(e, NInferError) else f"{type(e).__name__}: {e}"
            log.error("the engine did not start: %s", error)
            self.launcher.loading_finished(False, error)
            if self.window is not None:
                self.window.statusBar().showMessage(error, 10000)
            self.state_changed.emit()
            return
        self.starting = False
        if self.quitting:  # quit while it was starting
            await asyncio.to_thread(service.stop)
            return
        self.service = service
        if launch_cfg is not None:
            self.config.remember_start(launch_cfg)
        if self._cancel_requested:
            service.cancel()
        self._poll_timer.start()
        self.state_changed.emit()

    def cancel_loading(self) -> None:
        if self.service is not None:
            self.service.cancel()
        elif self.starting:
            self._cancel_requested = True  # cancelled as soon as the service exists

    def _poll(self) -> None:
        s = self.service
        if s is None:
            self._poll_timer.stop()
            return
        if not s.finished.is_set():
            self.launcher.loading_progress(s.progress, s.message)
            return
        self._poll_timer.stop()
        if s.ready.is_set():
            spawn(self._on_ready(s), "engine-ready")
        else:
            spawn(self._on_failed(s), "engine-failed")

    async def _on_ready(self, s: LocalService) -> None:
        if not self.remote:
            await self._connect_local(s)
        ok = False
        try:
            client = self.client if not self.remote else ApiClient(Endpoint(s.base_url, s.api_key, local=True))
            status, _ = await client.health()
            ok = status == 200
            if client is not self.client:
                await client.aclose()
        except Exception as e:
            log.warning("the API does not answer: %s", e)
        if ok and self.launch_cfg is not None:
            self.config.remember_good(self.launch_cfg)
        self.launcher.loading_finished(True)
        if self.quitting:
            return
        switched, self.switching = self.switching, False
        if switched and s.switch_error:  # the new model did not load: the one served before is back
            self.settings = s.settings
            if self.launch_cfg is not None:
                self.launch_cfg = dict(self.launch_cfg, model=s.settings.model)
        if self.window is None or self.launcher.isVisible():
            self.show_main()
        elif switched and s.switch_error:
            self.window.statusBar().showMessage(f"The model could not be loaded ({s.switch_error}); serving "
                                                f"{', '.join(s.model_ids)} again.", 20000)
        elif switched:
            self.window.statusBar().showMessage(f"Now serving {', '.join(s.model_ids)} at {s.url}", 10000)
        else:  # started again from the tray while the window stays hidden
            self.tray.notify("NInfer is serving", f"The API answers at {s.url}.")
        self.state_changed.emit()
        self.ready.emit()

    async def _on_failed(self, s: LocalService) -> None:
        error, status = s.load_error, s.status
        await asyncio.to_thread(s.stop)
        if self.service is s:
            self.service = None
        if status == CANCELLED:
            self.launcher.notice = "Loading cancelled"
            self.launcher.loading_finished(True)
        else:
            self.config.remember_failure(error or "the model could not be loaded")
            self.launcher.loading_finished(False, error or "")
            self.launcher.show()
        self.state_changed.emit()

    async def _connect_local(self, s: LocalService) -> None:
        old = self.client
        self.endpoint = Endpoint(s.base_url, s.api_key, local=True)
        self.client = ApiClient(self.endpoint)
        self.remote = False
        self.model_id = s.model_ids[0]
        if old is not None:
            await old.aclose()
        await self.refresh_mode()

    async def stop_local(self) -> None:
        """Stops the engine cleanly (Stop server, Change model or settings): the session ends as a quit does, so the
        launcher has no crash to report."""
        s = self.service
        if s is None:
            return
        self.service = None
        self.config.close_session()
        if not self.remote:
            self.mode, self.sampling = None, None
            self.mode_changed.emit(None, None)
        self.state_changed.emit()
        await asyncio.to_thread(s.stop)
        self.state_changed.emit()

    async def start_again(self) -> None:
        if self.service is not None or self.starting or self.settings is None:
            return
        self.start_local(self.settings, self.launch_cfg)

    def toggle_server(self) -> None:
        if self.service is not None and self.service.serving:
            spawn(self.stop_local(), "stop-server")
        else:
            spawn(self.start_again(), "start-server")

    async def restart_server(self, host: str, port: int, api_key: str | None) -> str | None:
        """Serves the loaded engine on another host/port/key; returns what went wrong (also logged), or None. The
        new values are remembered for the next start."""
        s = self.service
        if s is None:
            return "The engine is not running."
        old = (s.host, s.port, s.api_key)
        try:
            if port == s.port and host != s.host:
                # The same port on another address (this computer only <-> the network): the running listener holds
                # it, and the service binds the new socket before it lets the old one go. Step aside to a free port
                # on the old address first; on failure, come back to where it was.
                await asyncio.to_thread(s.restart_server, host=s.host, port=0)
                try:
                    await asyncio.to_thread(s.restart_server, host=host, port=port, api_key=api_key)
                except NInferError:
                    await asyncio.to_thread(s.restart_server, host=old[0], port=old[1], api_key=old[2])
                    raise
            else:
                await asyncio.to_thread(s.restart_server, host=host, port=port, api_key=api_key)
        except NInferError as e:
            log.error("the API server could not move to %s:%s: %s", host, port, e)
            return str(e)
        log.info("the API server now listens on %s:%s%s", host, port, " with an API key" if api_key else "")
        self.config.remember_server(host, port, api_key)
        if self.launch_cfg is not None:
            with_server(self.launch_cfg, host, port, api_key)
        if self.settings is not None:
            import dataclasses
            self.settings = dataclasses.replace(self.settings, host=host, port=port, api_key=api_key)
        if not self.remote:
            await self._connect_local(s)
        self.state_changed.emit()
        return None

    async def back_to_launcher(self) -> None:
        """Change model or settings: stop the engine, hide the main window, show the launcher."""
        await self.stop_local()
        if self.window is not None:
            self.window.hide()
        if self.launch_cfg is not None:  # what runs now, with the Server tab's address and key, not the form at start
            self.launcher.apply_config(self.launch_cfg)
        self.launcher.show()
        self.launcher.raise_()
        self.launcher.schedule()

    # ---- small things -------------------------------------------------------------------------------------------
    def copy_url(self) -> None:
        if self.service is not None and not self.remote:
            url = shared_url(self.service)  # with the API open to the network: the address other computers use
        elif self.endpoint is not None:
            url = self.endpoint.api_url
        else:
            return
        QGuiApplication.clipboard().setText(url)

    def stop_views(self) -> None:
        """Stops every timer of the controller and of its windows (polls, status, the monitor, repaints) and hides
        the tray icon: nothing of this controller runs on the event loop afterwards."""
        for owner in (self, self.window, self.library, self.launcher):
            if owner is not None:
                for timer in owner.findChildren(QTimer):
                    timer.stop()
        self.tray.hide()

    async def quit(self) -> None:
        """Stops the API server and the engine cleanly, then leaves."""
        if self.quitting:
            return
        self.quitting = True
        self.stop_views()
        if self.window is not None:
            self.window.chat.stop()
            await asyncio.to_thread(self.window.chat.tools.close)  # the MCP sessions and their subprocesses
            self.window.close()
        self.launcher.close()
        if self.library is not None:
            self.library.find.cancel()  # a download under way stops (and continues next time)
            self.library.close()
        if self.client is not None:
            await self.client.aclose()
            self.client = None
        if self.service is not None:
            s, self.service = self.service, None
            await asyncio.to_thread(s.stop)
        self.config.close_session()
        self.store.close()
        self.quit_app()
