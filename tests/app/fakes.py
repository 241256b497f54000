"""Stand-ins for the engine's LocalService and the chat's ApiClient, so the app's windows can be tested in a second
instead of loading a model. FakeService listens on real sockets and rebinds the way LocalService.restart_server does
(the new socket is bound before the old one is closed)."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

from engine.config.loading import is_loopback
from engine.errors import NInferError
from engine.service import bind_socket

from app.client import ChatEvent


class FakeService:
    status = "ready"
    model_ids = ["fake-model"]
    model_path = "fake-model.gguf"
    progress, message, load_error, switch_error = 1.0, "ready", None, None

    def __init__(self, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None):
        self.host, self.api_key = host, api_key
        self.sock = bind_socket(host, port)
        self.sock.listen()
        self.port = self.sock.getsockname()[1]
        self.state = SimpleNamespace(loaded=None)
        self.serving = True
        self.stopped = False

    @property
    def base_url(self) -> str:
        return f"http://{'127.0.0.1' if self.host == '0.0.0.0' else self.host}:{self.port}"

    @property
    def url(self) -> str:
        return self.base_url + "/v1"

    def stats(self) -> dict:
        return {"status": "ready", "device": "cpu", "context_window": 1024, "mode": "chat", "url": self.url,
                "pages_used": 0, "pages_free": 64}

    def restart_server(self, *, host=None, port=None, api_key=...) -> None:
        new_host = self.host if host is None else host
        new_port = self.port if port is None else port
        key = self.api_key if api_key is ... else (api_key or None)
        if not is_loopback(new_host) and key is None:
            raise NInferError(f"Listening on {new_host} would open the API to the network without a key.",
                              "Set an API key first.")
        if (new_host, new_port) != (self.host, self.port):
            sock = bind_socket(new_host, new_port)  # raises PortInUseError, as the service does
            self.sock.close()
            sock.listen()
            self.sock, self.port = sock, sock.getsockname()[1]
        self.host, self.api_key = new_host, key

    def stop(self, timeout: float = 10.0) -> None:
        self.sock.close()
        self.serving, self.stopped = False, True

    def cancel(self) -> None:
        pass


class FakeClient:
    """An ApiClient whose settings are a dict the test changes, and whose chat streams ``words`` slowly."""

    def __init__(self, settings: dict | None = None, words=("Hello", " there", "."), delay: float = 0.05,
                 chars_per_token: float = 4.0, template_tokens: int = 0):
        self.data = settings
        self.words = list(words)
        self.delay = delay
        self.chars_per_token = chars_per_token  # how the stand-in counts prompt tokens
        self.template_tokens = template_tokens  # what a chat template (and a server's system prompt) adds
        self.requests: list[dict] = []
        self.endpoint = SimpleNamespace(base_url="http://fake", api_url="http://fake/v1", api_key=None)

    async def settings(self):
        return self.data

    async def put_settings(self, changes: dict):
        self.data = {**(self.data or {}), **changes}
        return self.data

    async def aclose(self):
        pass

    async def stream_chat(self, model, messages, **params):
        self.requests.append({"model": model, "messages": messages, **params})
        for word in self.words:
            await asyncio.sleep(self.delay)
            yield ChatEvent("content", word)
        yield ChatEvent("finish", "stop")
        chars = sum(len(m.get("content") or "") for m in messages)
        yield ChatEvent("usage", data={"prompt_tokens": int(chars / self.chars_per_token) + 4 * len(messages)
                                       + self.template_tokens,
                                       "completion_tokens": len(self.words)})
