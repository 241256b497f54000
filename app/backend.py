"""The chat's backend, as a part of the Controller: the embedded engine's API or another OpenAI-compatible server
(URL + key), the loaded model's /v1/models card (whether it reads images), and the server's mode (chat / agent) with
the sampling values in force, read again every second so a switch made by another client (PUT /ninfer/v1/settings)
shows here too."""
from __future__ import annotations

import logging

from engine.service import READY

from app.asyncutil import spawn
from app.client import ApiClient, ApiError, Endpoint

log = logging.getLogger("ninfer.app")


class BackendMixin:
    """Expects the Controller's attributes: client, endpoint, remote, model_id, mode, sampling, service, config,
    launcher, mode_changed, state_changed, show_main() and _connect_local()."""

    # ---- another server -------------------------------------------------------------------------------------------
    async def connect_remote(self, url: str, api_key: str | None) -> str | None:
        """Chat with another OpenAI-compatible server; returns what went wrong, or None."""
        try:
            endpoint = Endpoint.parse(url, api_key)
        except ValueError as e:
            return str(e)
        client = ApiClient(endpoint)
        try:
            models = await client.models()
        except (ApiError, Exception) as e:  # httpx errors, bad JSON
            await client.aclose()
            return str(e) or type(e).__name__
        if not models:
            await client.aclose()
            return "The server lists no models."
        old = self.client
        self.endpoint, self.client, self.remote = endpoint, client, True
        self.model_id = models[0].get("id")
        self.config.set("remote", {"url": endpoint.api_url})
        if old is not None:
            await old.aclose()
        await self.refresh_mode()
        self.show_main()
        return None

    def use_local(self) -> None:
        if self.service is not None and self.service.status == READY:
            spawn(self._connect_local(self.service), "use-local")
            self.state_changed.emit()
        else:
            self.remote = False
            self.launcher.show()

    # ---- what the chat needs to know about the model ------------------------------------------------------------
    def context_window(self) -> int | None:
        """The model's context in tokens (this computer's engine; unknown for another server)."""
        s = self.service
        if self.remote or s is None or s.status != READY:
            return None
        value = s.stats().get("context_window")
        return value if isinstance(value, int) and value > 0 else None

    def default_max_tokens(self) -> int | None:
        s = self.service
        if self.remote or s is None:
            return None
        return getattr(getattr(s, "settings", None), "default_max_tokens", None)

    async def read_model_card(self) -> None:
        """The loaded model's /v1/models entry, read when the chat connects (refresh_mode); None when unreadable."""
        card = None
        if self.client is not None:
            try:
                card = next((m for m in await self.client.models() if m.get("id") == self.model_id), None)
            except Exception as e:  # the chat still works; images are then left to the server to judge
                log.debug("cannot read the server's model list: %s", e)
        self.model_card = card

    def model_reads_images(self) -> bool | None:
        """Whether the loaded model reads images, by its card (``capabilities.vision``, else ``input_modalities``,
        top-level or under ``architecture`` as llama-server's router has it); None when the card does not say."""
        card = getattr(self, "model_card", None) or {}
        if card.get("id") != self.model_id:
            return None
        vision = (card.get("capabilities") or {}).get("vision")
        if isinstance(vision, bool):
            return vision
        modalities = card.get("input_modalities", (card.get("architecture") or {}).get("input_modalities"))
        return "image" in modalities if isinstance(modalities, list) else None

    # ---- mode -----------------------------------------------------------------------------------------------------
    async def refresh_mode(self) -> None:
        """The server's mode and sampling in force (and, as the chat has just connected, the model's card)."""
        data = None
        if self.client is not None:
            try:
                data = await self.client.settings()
            except Exception as e:
                log.warning("cannot read the server's settings: %s", e)
        self._set_mode_from(data)
        await self.read_model_card()

    async def set_mode(self, mode: str) -> None:
        """Switches the server's default sampling (PUT /ninfer/v1/settings) and shows what is now in force."""
        if self.client is None:
            return
        try:
            data = await self.client.put_settings({"mode": mode})
        except ApiError as e:
            log.error("switching to %s mode failed: %s", mode, e)
            if e.status not in (404, 405):
                await self.refresh_mode()  # show what the server really uses
                return
            data = None  # this server has no mode switch
        except Exception as e:  # the server went away
            log.error("switching to %s mode failed: %s", mode, e)
            await self.refresh_mode()
            return
        self._set_mode_from(data)
        log.info("mode is now %s", self.mode)

    def _poll_mode(self) -> None:
        if self.remote and self.mode is None:
            return  # another server without NInfer's mode switch: nothing to follow
        if self.client is not None and not self._mode_polling and not self.quitting:
            self._mode_polling = True
            spawn(self._read_mode(self.client), "poll-mode")

    async def _read_mode(self, client: ApiClient) -> None:
        """Another client may have switched the mode (PUT /ninfer/v1/settings): show what is in force."""
        epoch = self._mode_epoch
        try:
            data = await client.settings()
        except Exception as e:  # the server is restarting or gone: keep what is shown
            log.debug("cannot read the server's settings: %s", e)
            return
        finally:
            self._mode_polling = False
        if client is not self.client or epoch != self._mode_epoch:
            return  # another client now, or this app switched the mode while the answer was on its way
        mode, sampling = (data.get("mode"), data.get("sampling")) if data else (None, None)
        if (mode, sampling) != (self.mode, self.sampling):
            self._set_mode_from(data)

    def _set_mode_from(self, data: dict | None) -> None:
        self._mode_epoch = self._mode_epoch + 1  # a poll already under way is now stale
        self.mode = data.get("mode") if data else None
        self.sampling = data.get("sampling") if data else None
        self.mode_changed.emit(self.mode, self.sampling)
