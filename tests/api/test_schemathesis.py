"""A bounded schemathesis run against the server's own OpenAPI: no input makes it answer 500, and it stays up."""
from types import SimpleNamespace

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from engine.config import load_settings
from engine.model.default import default_model_path
from engine.server.app import create_app
from engine.server.state import ServerState
from engine.tokenizer import Tokenizer
from tests.api.scripted import ScriptedEngine

_settings, _ = load_settings([], {})
_state = ServerState(_settings, ["scripted"])
_tok = Tokenizer.from_gguf(default_model_path())
_engine = ScriptedEngine(_tok)
_engine.script = 'Hello! <tool_call>{"name": "f", "arguments": {}}</tool_call>'
_state.loaded = SimpleNamespace(engine=_engine, tokenizer=_tok, context_window=2048)
app = create_app(_state)
schema = schemathesis.openapi.from_asgi("/openapi.json", app, headers={"Host": "localhost"})


@schema.parametrize()
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_input_gives_a_server_error(case):
    if isinstance(case.body, dict) and "model" in case.body:
        case.body["model"] = "scripted"  # reach past the model check into validation, rendering and generation
    response = case.call(headers={"Host": "localhost"})
    assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])


def test_server_is_still_healthy_after_the_run():
    from starlette.testclient import TestClient
    with TestClient(app, base_url="http://localhost") as client:
        assert client.get("/health").status_code == 200
        r = client.post("/v1/chat/completions", json={"model": "scripted",
                                                       "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
