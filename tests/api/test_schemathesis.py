"""Property-based fuzzing of the three APIs (OpenAI chat and completions, Anthropic messages, Responses; the token
routes too) from the server's own OpenAPI schema, with valid bodies and with bodies that break it (schemathesis'
positive and negative modes), bounded in examples: no input makes the server answer 500, every refusal is in the
shape of the API its route belongs to, and afterwards the server is healthy and holds no sequence."""
from types import SimpleNamespace

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import GenerationMode
from starlette.testclient import TestClient

from engine.config.loading import load_settings
from engine.model.default import default_model_path
from engine.server.app import create_app
from engine.server.errors import is_anthropic
from engine.server.state import ServerState
from engine.tokenizer import Tokenizer
from tests.api.scripted import ScriptedEngine

HOST = {"Host": "localhost"}
EXAMPLES = 25  # per route and mode: about 500 requests in all, a minute on a shared 2-core machine


class TrackingEngine(ScriptedEngine):
    """The scripted engine, counting a sequence as running until its last output was read or it was aborted."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.streams = []

    def submit(self, prompt, params, request_id=None, loop=None):
        stream = super().submit(prompt, params, request_id, loop)
        self.streams.append(stream)
        return stream

    def stats(self):
        aborted = set(self.aborted)
        running = sum(1 for s in self.streams if not s.finished and s.request_id not in aborted)
        return {"running": running, "waiting": 0}


_settings, _ = load_settings([], {})
_state = ServerState(_settings, ["scripted"])
_tok = Tokenizer.from_gguf(default_model_path())
_engine = TrackingEngine(_tok)
_engine.script = 'Hello! <tool_call>{"name": "f", "arguments": {}}</tool_call>'
_state.loaded = SimpleNamespace(engine=_engine, tokenizer=_tok, context_window=2048)
app = create_app(_state)
config = schemathesis.Config()
config.projects.default.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
                                          max_examples=EXAMPLES, deterministic=True)
schema = schemathesis.openapi.from_asgi("/openapi.json", app, config=config, headers=HOST)


def _api_error_shape(path: str, body) -> bool:
    if is_anthropic(path):
        return (isinstance(body, dict) and body.get("type") == "error"
                and set(body.get("error", {})) == {"type", "message"})
    return isinstance(body, dict) and set(body.get("error", {})) == {"message", "type", "param", "code"}


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_input_gives_a_server_error_and_refusals_have_the_api_shape(case):
    if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
        case.body["model"] = "scripted"  # reach past the model check into validation, rendering and generation
    response = case.call(headers=HOST)
    seen = (case.method, case.path, str(case.body)[:300], response.text[:300])
    assert response.status_code < 500, seen
    if response.status_code >= 400:
        assert _api_error_shape(case.path, response.json()), seen


def test_every_api_is_fuzzed():
    fuzzed = {result.ok().path for result in schema.get_all_operations()}
    assert {"/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens",
            "/v1/responses", "/v1/responses/input_tokens", "/v1/chat/completions/input_tokens", "/tokenize",
            "/detokenize", "/apply-template"} <= fuzzed


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/completions", {"prompt": "hi"}),
    ("/v1/responses", {"input": "hi"}),
    ("/v1/messages", {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}),
])
def test_the_server_is_healthy_and_idle_after_the_run(path, body):
    with TestClient(app, base_url="http://localhost") as client:
        assert client.get("/health").status_code == 200
        r = client.post(path, json={"model": "scripted", **body})
        assert r.status_code == 200, r.text
    assert _engine.stats()["running"] == 0, "a sequence of a fuzzed request is still held"
