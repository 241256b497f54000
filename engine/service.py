"""The engine as a service inside another program (the desktop app): load in the background, serve the API in-process.

``LocalService(settings)`` is what ``ninfer-serve`` does, as an object: ``start()`` binds the API's socket at once
(so a port that is taken is an error right away, not a log line), runs the uvicorn server on its own thread (so the
API keeps answering whatever the caller's windows do) and loads the model on another thread, with progress and
cancel. ``stats()`` is a plain-dict snapshot for a monitor; ``stop()`` shuts the server and the engine down cleanly.

No Qt here (tests/test_repository.py checks it): the desktop app polls ``stats()`` / ``status`` from a timer and talks
to the model over HTTP like any other client.
"""
from __future__ import annotations

import dataclasses
import logging
import socket
import threading
import time
from pathlib import Path
from typing import Any

from engine.config.loading import Settings, is_loopback
from engine.errors import NInferError
from engine.config.engine_config import EngineConfig
from engine.serve import served_model_ids

log = logging.getLogger("ninfer.service")

# status values, in the order a service goes through them
STOPPED, LOADING, READY, FAILED, CANCELLED = "stopped", "loading", "ready", "failed", "cancelled"


class PortInUseError(NInferError):
    def __init__(self, host: str, port: int, reason: str):
        super().__init__(f"Cannot listen on {host}:{port}: {reason}.",
                         "Another program (perhaps another ninfer-serve) uses this port: choose another port, "
                         "or stop the other program.")


def free_memory() -> None:
    """Hands back what a stopped engine held, once nothing refers to it: its reference cycles collected, CUDA's cached
    blocks (on the GPU and pinned in host memory) released when CUDA is up, the heap glibc keeps trimmed."""
    import gc

    import torch

    from engine.hardware import return_freed_memory

    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()
        torch.accelerator.empty_host_cache()
    freed = return_freed_memory()
    if freed >= 16 * 2**20:
        log.info("memory: %.0f MiB the stopped engine held handed back to the OS", freed / 2**20)


def connect_host(host: str) -> str:
    """The address a client on this computer uses to reach a server bound to ``host``."""
    h = host.strip().strip("[]")
    if h in ("0.0.0.0", "", "*"):
        return "127.0.0.1"
    if h == "::":
        return "[::1]"
    return f"[{h}]" if ":" in h else h


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening-ready socket bound to (host, port); port 0 picks a free one. Raises PortInUseError."""
    h = host.strip().strip("[]")
    family = socket.AF_INET6 if ":" in h else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((h, port))
    except OSError as e:
        sock.close()
        raise PortInUseError(host, port, e.strerror or str(e)) from None
    sock.set_inheritable(True)
    return sock


class LocalService:
    """One engine plus its OpenAI-compatible API server, in this process.

    Lifecycle: ``start()`` -> status "loading" (``progress`` 0..1, ``message``) -> "ready" (``ready`` event set) or
    "failed" (``load_error``) or "cancelled" (after ``cancel()``); ``stop()`` -> "stopped". ``restart_server()``
    rebinds the HTTP side (host, port, API key) and keeps the loaded engine; ``switch_model()`` unloads the engine and
    loads another model behind the same server (503 with Retry-After meanwhile).
    """

    def __init__(self, settings: Settings):
        from engine.model.loader import resolve_model_path
        from engine.server.state import ServerState

        self.settings = settings
        self.model_path: Path = resolve_model_path(settings.model)  # ModelLoadError now, not on the thread
        self.state = ServerState(settings, served_model_ids(settings, self.model_path))
        self.ready = threading.Event()
        self.finished = threading.Event()  # loading ended, one way or another
        self.progress = 0.0
        self.message = ""
        self.status = STOPPED
        self.started_at: float | None = None
        self.ready_at: float | None = None
        self._cancel = threading.Event()
        self._fallback: tuple | None = None  # (settings, path, model ids) served before a switch, until it loads
        self.switch_error: str | None = None  # why the last switch went back to the model served before
        self._server = None  # uvicorn.Server
        self._server_thread: threading.Thread | None = None
        self._load_thread: threading.Thread | None = None
        self._port: int | None = None
        self._lock = threading.RLock()

    # ---- what callers read --------------------------------------------------------------------------------
    @property
    def load_error(self) -> str | None:
        return self.state.load_error

    @property
    def host(self) -> str:
        return self.state.settings.host

    @property
    def port(self) -> int:
        return self._port if self._port is not None else self.state.settings.port

    @property
    def api_key(self) -> str | None:
        return self.state.settings.api_key

    @property
    def base_url(self) -> str:
        """http://HOST:PORT, the address to reach this server from this computer."""
        return f"http://{connect_host(self.host)}:{self.port}"

    @property
    def url(self) -> str:
        """The OpenAI base URL clients use: http://HOST:PORT/v1."""
        return self.base_url + "/v1"

    @property
    def model_ids(self) -> list[str]:
        return list(self.state.model_ids)

    @property
    def serving(self) -> bool:
        """Whether the HTTP server thread is alive."""
        return self._server_thread is not None and self._server_thread.is_alive()

    def stats(self) -> dict[str, Any]:
        """A snapshot for a monitor: the metrics snapshot (engine stats, rates, TTFT, HTTP counts) plus the
        service's own status, progress, URL and model. Cheap and thread-safe; never raises."""
        snap = self.state.metrics.snapshot()
        loaded = self.state.loaded
        if loaded is not None:  # keys of Engine.stats() the metrics snapshot does not carry (yet): speculative
            try:  # decoding, KV tiers, ...
                for key, value in loaded.engine.stats().items():
                    snap.setdefault(key, value)
            except Exception:  # a half-built engine: the snapshot alone
                log.debug("engine stats unavailable", exc_info=True)
        snap.update(status=self.status, progress=self.progress, message=self.message, error=self.load_error,
                    url=self.url, serving=self.serving, model_ids=self.model_ids, model_path=str(self.model_path),
                    mode=self.state.settings.mode, sampling=dict(self.state.defaults),
                    spec_method=getattr(self.state.settings, "spec", None),
                    device=str(loaded.device) if loaded is not None else None,
                    context_window=loaded.context_window if loaded is not None else None,
                    load_seconds=loaded.load_seconds if loaded is not None else None)
        return snap

    # ---- lifecycle ------------------------------------------------------------------------------------------
    def start(self) -> "LocalService":
        """Binds the port (PortInUseError at once when taken), starts the API server thread and the loading
        thread, and returns without waiting for either."""
        with self._lock:
            if self.status in (LOADING, READY):
                return self
            self._cancel.clear()
            self.ready.clear()
            self.finished.clear()
            self._fallback, self.switch_error = None, None
            self.state.load_error, self.state.load_progress = None, 0.0
            self.progress, self.message, self.status = 0.0, "starting", LOADING
            self.started_at = time.monotonic()
            try:
                self._start_server()
            except Exception:
                self.status = STOPPED
                raise
            self._load_thread = threading.Thread(target=self._load, name="ninfer-load", daemon=True)
            self._load_thread.start()
        return self

    def cancel(self) -> None:
        """Asks the loading thread to stop at the next tensor; the service ends "cancelled" (server stopped)."""
        self._cancel.set()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Blocks until loading ends; True when the engine is ready. (For scripts and tests, not a GUI thread.)"""
        self.finished.wait(timeout)
        return self.ready.is_set()

    def stop(self, timeout: float = 10.0) -> None:
        """Stops the engine (requests in flight end at once, finish reason "abort"), then the API server (their
        streams end with it) and cancels a load in progress; each thread is waited for up to ``timeout`` s. The
        engine's memory goes back to the OS (``free_memory``). Safe to call twice and from any thread but the
        server's own."""
        with self._lock:
            self._cancel.set()
            loaded, self.state.loaded = self.state.loaded, None  # new requests get 503 from here on
            if loaded is not None:
                self.state.metrics.detach()
                loaded.engine.shutdown(timeout)
                loaded.engine.runner.release()
            self._stop_server(timeout)
            if self._load_thread is not None:
                self._load_thread.join(timeout)
                self._load_thread = None
            self.ready.clear()
            if self.status in (LOADING, READY):
                self.status = STOPPED
            self.message = "stopped"
            del loaded
            free_memory()
            log.info("service stopped")

    def restart_server(self, *, host: str | None = None, port: int | None = None,
                       api_key: Any = ...) -> None:
        """Serves the already loaded engine on another host/port/API key (e.g. opening it to the LAN).

        Checks the same rule as the settings: a non-loopback host needs an API key (NInferError otherwise).
        The new port is bound before the old server stops, so a taken port leaves the service as it was.
        """
        with self._lock:
            s = self.state.settings
            changes: dict[str, Any] = {}
            if host is not None:
                changes["host"] = host
            if port is not None:
                changes["port"] = port
            if api_key is not ...:
                changes["api_key"] = api_key or None
            new = dataclasses.replace(s, **changes, sources={**s.sources, **{k: "app" for k in changes}})
            if not is_loopback(new.host) and new.api_key is None and not new.insecure_no_auth:
                raise NInferError(f"Listening on {new.host} would open the API to the network without a key.",
                                  "Set an API key first.")
            same_socket = new.host == s.host and (port is None or port == self.port)
            sock = None if same_socket else bind_socket(new.host, new.port)
            self._stop_server(10.0)  # (the same address can only be bound again once the old server is gone)
            self.state.apply_settings(new)
            self._start_server(sock)

    def switch_model(self, model: str, drain_s: float = 5.0) -> None:
        """Serves another model on the same server (same host, port and key): the old engine is unloaded and the new
        one loads on a thread, as ``start()`` loads; requests meanwhile get 503 with Retry-After. Requests already
        running get up to ``drain_s`` seconds to finish before the old engine stops. A model that fails to load ends
        the old model loaded again (``switch_error`` says why; the server stays up); should that fail too, the
        service ends "failed", as a failed start does. Raises NInferError when nothing is served
        or a load is under way, and ModelLoadError when ``model`` is not a usable path (the old model stays)."""
        from engine.model.loader import resolve_model_path

        with self._lock:
            if self.status != READY or not self.serving:
                raise NInferError(f"Cannot switch the model while the engine is {self.status}.",
                                  "Wait until the model is loaded (or start the engine), then switch.")
            path = resolve_model_path(model)  # a missing file fails here, with the old model still served
            settings = dataclasses.replace(self.state.settings, model=model,
                                           sources={**self.state.settings.sources, "model": "app"})
            old = self.state.loaded
            # what to serve again should the new model fail to load
            self._fallback = (self.settings, self.model_path, list(self.state.model_ids))
            self.switch_error = None
            self.ready.clear()
            self.finished.clear()
            self._cancel.clear()
            self.state.load_error, self.state.load_progress = None, 0.0
            self.state.switching_to = path.stem if path.is_file() else path.name
            self.state.loaded = None  # new requests get 503 + Retry-After from here on
            self.progress, self.message, self.status = 0.0, f"switching to {self.state.switching_to}", LOADING
            self.started_at = time.monotonic()
            log.info("switching the model to %s", path)
            self._unload(old, drain_s)
            del old
            free_memory()  # before the next model loads
            self.settings, self.model_path = settings, path
            self.state.apply_settings(settings)
            self.state.model_ids = served_model_ids(settings, path)
            self._load_thread = threading.Thread(target=self._load, name="ninfer-load", daemon=True)
            self._load_thread.start()

    def _unload(self, loaded: Any, drain_s: float) -> None:
        """Lets the running requests of an engine taken out of service finish (up to ``drain_s``), then stops it."""
        if loaded is None:
            return
        deadline = time.monotonic() + drain_s
        while time.monotonic() < deadline:
            stats = loaded.engine.stats()
            if not stats.get("running") and not stats.get("waiting"):
                break
            time.sleep(0.05)
        self.state.metrics.detach()
        loaded.engine.shutdown(10.0)  # what still runs ends with finish reason "abort"
        loaded.engine.runner.release()

    # ---- internals ------------------------------------------------------------------------------------------
    def _start_server(self, sock: socket.socket | None = None) -> None:
        import uvicorn

        from engine.server.app import create_app
        from engine.server.protocol import APIErrorsProtocol

        s = self.state.settings
        sock = sock or bind_socket(s.host, s.port)
        self._port = sock.getsockname()[1]
        config = uvicorn.Config(create_app(self.state), log_level=s.log_level, log_config=None,
                                timeout_graceful_shutdown=5, lifespan="off", http=APIErrorsProtocol)
        server = uvicorn.Server(config)
        self._server = server

        def serve():
            try:
                server.run(sockets=[sock])
            except BaseException:  # SystemExit from uvicorn on startup failure included
                log.exception("the API server stopped with an error")
            finally:
                sock.close()

        self._server_thread = threading.Thread(target=serve, name=f"ninfer-http-{self._port}", daemon=True)
        self._server_thread.start()
        deadline = time.monotonic() + 10
        while not server.started and self._server_thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        log.info("API on %s (model %s)", self.url, ", ".join(self.model_ids))

    def _stop_server(self, timeout: float) -> None:
        server, thread = self._server, self._server_thread
        if server is not None:
            server.should_exit = True
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        self._server, self._server_thread = None, None

    def _on_progress(self, fraction: float, message: str) -> None:
        self.progress = self.state.load_progress = float(fraction)
        self.message = message

    def _load(self) -> None:
        from engine.build import build_engine
        from engine.model.weights import LoadCancelled

        settings = self.settings
        try:
            loaded = build_engine(self.model_path, EngineConfig.from_settings(settings), progress=self._on_progress,
                                  cancel=self._cancel)
            if self._cancel.is_set():
                raise LoadCancelled()
            loaded.engine.start()
            self._fallback = None
            self.state.switching_to = ""
            self.state.loaded = loaded
            self.progress, self.message, self.status = 1.0, "ready", READY
            self.ready_at = time.monotonic()
            self.ready.set()
            from engine.library import usage
            usage.record(loaded.path)
            log.info("ready: %s on %s, context %d tokens, %d KV pages, loaded in %.1f s", loaded.path.name,
                     loaded.device, loaded.context_window, loaded.engine.pool.num_pages, loaded.load_seconds)
        except LoadCancelled as e:
            self.state.switching_to = ""
            self.state.load_error = str(e)
            self.status, self.message = CANCELLED, "cancelled"
            log.info("model loading cancelled")
            self._stop_server(10.0)
        except NInferError as e:
            self._fail(str(e))
        except Exception as e:  # unexpected: keep the traceback in the log
            log.exception("loading the model failed")
            self._fail(f"{type(e).__name__}: {e}")
        finally:
            self.finished.set()

    def _fall_back(self, error: str) -> bool:
        """After a switch whose model failed to load: loads the model served before again (True), once."""
        if self._fallback is None:
            return False
        settings, path, model_ids = self._fallback
        self._fallback = None
        self.switch_error = error
        log.error("switching the model failed: %s; loading %s again", error, path)
        self.settings, self.model_path = settings, path
        self.state.apply_settings(settings)
        self.state.model_ids = model_ids
        self.state.switching_to = path.stem if path.is_file() else path.name
        self.state.load_error, self.state.load_progress = None, 0.0
        self.progress, self.message = 0.0, f"switching back to {self.state.switching_to}"
        self._load()
        return True

    def _fail(self, error: str) -> None:
        if self._fall_back(error):
            return
        self.state.switching_to = ""
        self.state.load_error = error
        self.status, self.message = FAILED, "failed"
        log.error("%s", error)
        self._stop_server(10.0)
