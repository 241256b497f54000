import socket
import threading
import time

import httpx
import pytest
import uvicorn

from engine.config.loading import load_settings
from engine.server.app import create_app
from engine.server.state import ServerState


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RunningServer:
    def __init__(self, state: ServerState):
        self.state = state
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(create_app(state), host="127.0.0.1", port=self.port,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            if time.time() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="session")
def default_engine(engine_for):
    """The embedded default model as the server runs it (its own weight format), started, for the whole session."""
    loaded = engine_for(None, max_concurrency=4, max_context=2048)
    loaded.engine.start()
    return loaded


@pytest.fixture(scope="session")
def server(default_engine):
    settings, _ = load_settings([], {})
    state = ServerState(settings, ["smollm2-135m-instruct", "smol"])
    state.loaded = default_engine
    with RunningServer(state) as running:
        yield running


@pytest.fixture(scope="module")
def scripted(default_engine):
    """A server over the scripted engine (tests/api/scripted.py), one per test module (a module may define its own)."""
    from tests.api.scripted import scripted_server

    with scripted_server(default_engine) as running:
        yield running


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client


def wait_idle(engine, timeout=10.0):
    """Waits until the engine holds no sequence; returns its stats."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        stats = engine.stats()
        if stats["running"] == 0 and stats["waiting"] == 0:
            return stats
        time.sleep(0.02)
    return engine.stats()


def post_while_polling_health(base_url: str, path: str, content: bytes, method: str = "POST"):
    """(response, seconds it took, the slowest /health answer meanwhile)."""
    slowest, done = [0.0], threading.Event()

    def poll():
        with httpx.Client(base_url=base_url, timeout=30) as c:
            while not done.is_set():
                t = time.perf_counter()
                assert c.get("/health").status_code == 200
                slowest[0] = max(slowest[0], time.perf_counter() - t)
                time.sleep(0.01)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        time.sleep(0.05)
        t = time.perf_counter()
        with httpx.Client(base_url=base_url, timeout=120) as c:
            r = c.request(method, path, content=content, headers={"Content-Type": "application/json"})
        took = time.perf_counter() - t
    finally:
        done.set()
        poller.join()
    return r, took, slowest[0]
