"""Security by default: loopback Host check, API key, CORS, request size limits."""
from __future__ import annotations


def install(app, state) -> None:
    """Adds the server's protective middleware to the app."""
