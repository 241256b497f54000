"""The hub client's HTTP: connect and read timeouts on every request, and a reachability check before a hub
operation. The client's own defaults wait forever on a hub that accepts a connection and never answers, and retry
a refused connection for ~25 s before saying so; here the first is a timeout, the second an error at once."""
from __future__ import annotations

import threading
import time

CONNECT_S = 10.0  # to open a connection
READ_S = 30.0  # with no byte arriving: the hub (or a proxy) stalled
REACHED_FOR_S = 60.0  # a reachability check holds this long

_installed = False
_reached: dict[str, float] = {}  # endpoint -> when it last answered
_lock = threading.Lock()


def timeout(read: float | None = None):
    """The timeouts of one request (the module's values as they are now)."""
    import httpx2

    return httpx2.Timeout(READ_S if read is None else read, connect=CONNECT_S)


def install_timeouts() -> None:
    """Every request the hub client makes from now on has the timeouts above (once per process)."""
    global _installed
    with _lock:
        if _installed:
            return
        from huggingface_hub import set_client_factory
        from huggingface_hub.utils._http import default_client_factory

        def factory():
            client = default_client_factory()
            client.timeout = timeout()
            return client

        set_client_factory(factory)
        _installed = True


def is_network_error(e: BaseException) -> bool:
    """A connection that failed or timed out (the hub client's HTTP library, whatever its module, or the OS)."""
    names = {c.__name__ for c in type(e).__mro__}
    return isinstance(e, OSError) or bool(names & {"TransportError", "NetworkError", "TimeoutException"})


def check_reachable(endpoint: str, what: str) -> None:
    """An OfflineError at once when nothing answers at ``endpoint`` (any HTTP answer counts: the address is right)."""
    from huggingface_hub.utils import get_session

    from engine.library.errors import OfflineError

    install_timeouts()
    if time.monotonic() - _reached.get(endpoint, -REACHED_FOR_S) < REACHED_FOR_S:
        return
    try:
        get_session().head(endpoint + "/", timeout=timeout(read=CONNECT_S))
    except Exception as e:  # the HTTP library's errors: only a transport failure means "cannot reach"
        if not is_network_error(e):
            raise
        raise OfflineError(f"Cannot {what}: {endpoint} cannot be reached ({type(e).__name__}: {e}).",
                           "Check the network connection (or HF_ENDPOINT); models already downloaded still "
                           "work.") from None
    _reached[endpoint] = time.monotonic()
