"""/health while the model loads, while the served model is being switched, after a failed load, and once ready:
503 with Retry-After while waiting helps (loading, switching), 503 without it after a failure, 200 when serving."""
from __future__ import annotations

from fastapi.testclient import TestClient

from engine.config.loading import load_settings
from engine.server.app import create_app
from engine.server.state import ServerState


def health(**state_fields):
    settings, _ = load_settings([], {})
    state = ServerState(settings, ["m"], **state_fields)
    with TestClient(create_app(state), base_url="http://127.0.0.1") as client:
        return client.get("/health"), client.head("/health")


def test_loading_asks_to_retry():
    got, head = health(load_progress=0.25)
    assert got.status_code == head.status_code == 503 and got.headers["Retry-After"] == "2"
    assert got.json() == {"status": "loading", "progress": 0.25, "error": None}


def test_switching_names_the_model_and_asks_to_retry():
    got, _ = health(switching_to="other-model", load_progress=0.5)
    assert got.status_code == 503 and got.headers["Retry-After"] == "2"
    assert got.json() == {"status": "switching", "progress": 0.5, "error": None, "model": "other-model"}


def test_a_failed_load_does_not_ask_to_retry():
    got, _ = health(load_error="the file is truncated")
    assert got.status_code == 503 and "Retry-After" not in got.headers
    assert got.json()["status"] == "error" and got.json()["error"] == "the file is truncated"


def test_ready_is_200():
    got, head = health(loaded=object())
    assert got.status_code == head.status_code == 200 and got.json() == {"status": "ok"}
