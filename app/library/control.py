"""The model library, as a part of the Controller: the library window, and loading a model picked there (starting it
from the launcher, or switching the running engine to it without a restart, on the same API port)."""
from __future__ import annotations

import asyncio
import dataclasses
import logging

from engine.errors import NInferError
from engine.service import READY, LocalService

from app.asyncutil import spawn

log = logging.getLogger("ninfer.app")


class LibraryMixin:
    """Expects the Controller's attributes: service, starting, launcher, window, library, switching, settings,
    launch_cfg, _poll_timer and state_changed."""

    # ---- the model library ------------------------------------------------------------------------------------------
    def show_library(self) -> None:
        if self.library is None:
            from app.library.window import LibraryWindow
            self.library = LibraryWindow(self)
        self.library.show()
        self.library.raise_()
        self.library.activateWindow()

    def load_model(self, model: str) -> str | None:
        """Serves ``model`` (a path or an hf: reference in the cache; "" for the embedded default): a running engine switches to it without a
        restart, on the same API port; otherwise the launcher starts it with its settings once the checks pass.
        Returns why it cannot now, or None."""
        s = self.service
        if self.starting or (s is not None and s.status != READY):
            return "The engine is loading a model: wait until it is ready, then load another."
        if model:
            self.launcher.pick_model(model)
        else:  # the embedded default
            self.launcher.select_model(None)
        if s is not None and s.serving:
            spawn(self._switch(s, model), "switch-model")
            return None
        self.launcher.auto_start = True  # starts as soon as the checks pass (else shows what to fix)
        self.launcher.show()
        self.launcher.raise_()
        return None

    async def _switch(self, s: LocalService, model: str) -> None:
        self.switching = True
        try:
            await asyncio.to_thread(s.switch_model, model)
        except NInferError as e:
            self.switching = False
            log.error("switching the model failed: %s", e)
            if self.window is not None:
                self.window.statusBar().showMessage(str(e), 10000)
            return
        if self.launch_cfg is not None:
            self.launch_cfg = dict(self.launch_cfg, model=model)
        if self.settings is not None:
            self.settings = dataclasses.replace(self.settings, model=model)
        self._poll_timer.start()
        self.state_changed.emit()
