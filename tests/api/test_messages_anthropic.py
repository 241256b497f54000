"""The Anthropic Messages API through the official `anthropic` SDK, against the real server with a scripted model."""
import json
from types import SimpleNamespace

import anthropic
import httpx
import pytest

from engine.config.loading import load_settings
from engine.engine import QueueFullError
from engine.server.state import ServerState
from tests.api.conftest import RunningServer

WEATHER = {"name": "get_weather", "description": "Weather for a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
HERMES_CALL = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
USER = [{"role": "user", "content": "Capital of France?"}]


@pytest.fixture
def client(scripted):
    scripted.engine.fail_after = None
    return anthropic.Anthropic(base_url=scripted.base_url, api_key="unused", max_retries=0)


def prompt_text(scripted) -> str:
    return scripted.engine.tokenizer.decode(scripted.engine.prompts[-1], skip_special_tokens=False)


def test_plain_message(client, scripted):
    scripted.engine.script = "Paris is the capital."
    msg = client.messages.create(model="scripted", max_tokens=64, system="Be brief.", messages=USER)
    assert msg.type == "message" and msg.role == "assistant" and msg.model == "scripted"
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == "Paris is the capital."
    assert msg.stop_reason == "end_turn" and msg.stop_sequence is None
    assert msg.usage.input_tokens == len(scripted.engine.prompts[-1]) and msg.usage.output_tokens > 0
    assert msg.usage.cache_read_input_tokens == 0
    assert "Be brief." in prompt_text(scripted) and "Capital of France?" in prompt_text(scripted)


def test_streamed_message_rebuilds_the_same_answer(client, scripted):
    scripted.engine.script = "Paris is the capital."
    with client.messages.stream(model="scripted", max_tokens=64, messages=USER) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == final.content[0].text == "Paris is the capital."
    assert final.stop_reason == "end_turn" and final.usage.output_tokens > 0


def test_raw_stream_has_ping_and_event_names(scripted):
    scripted.engine.script = "Hi."
    with httpx.Client(base_url=scripted.base_url, timeout=30) as c:
        body = c.post("/v1/messages?beta=true", json={"model": "scripted", "max_tokens": 8, "stream": True,
                                                      "messages": USER}).text
    names = [line[7:] for line in body.splitlines() if line.startswith("event: ")]
    datas = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: ")]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    assert [d["type"] for d in datas] == names


def test_claude_code_request_shape_is_accepted(client, scripted):
    """What Claude Code sends: system blocks led by the per-request billing block, a system entry in messages,
    betas, adaptive thinking, context_management, output_config, metadata."""
    scripted.engine.script = "Done."
    system = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.328; cc_entrypoint=sdk-cli"},
              {"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}},
              {"type": "text", "text": "Work in the repository.", "cache_control": {"type": "ephemeral"}}]
    with client.messages.stream(
        model="scripted", max_tokens=32000, system=system,
        messages=[{"role": "system", "content": "Extra rules."},
                  {"role": "user", "content": [{"type": "text", "text": "Fix the bug.",
                                                "cache_control": {"type": "ephemeral"}}]}],
        tools=[WEATHER], thinking={"type": "adaptive", "display": "omitted"}, metadata={"user_id": "u1"},
        extra_body={"context_management": {"edits": []}, "output_config": {"effort": "high"}},
        extra_headers={"anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,made-up-beta"},
    ) as stream:
        msg = stream.get_final_message()
    assert msg.content[0].text == "Done."
    prompt = prompt_text(scripted)
    assert "x-anthropic-billing-header" not in prompt and "cc_version" not in prompt
    assert "You are a coding agent.\n\nWork in the repository.\n\nExtra rules." in prompt


def test_tool_use_round_trip(client, scripted):
    scripted.engine.script = HERMES_CALL
    msg = client.messages.create(model="scripted", max_tokens=128, tools=[WEATHER],
                                 messages=[{"role": "user", "content": "Weather in Paris?"}])
    assert msg.stop_reason == "tool_use"
    assert [b.type for b in msg.content] == ["text", "tool_use"] and msg.content[0].text == "Let me check."
    use = msg.content[1]
    assert use.name == "get_weather" and use.input == {"city": "Paris"} and use.id.startswith("toolu_")
    scripted.engine.script = "It is sunny in Paris."
    reply = client.messages.create(model="scripted", max_tokens=128, tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [b.model_dump() for b in msg.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": [{"type": "text", "text": "sunny, 21 C"}]},
                                     {"type": "text", "text": "And tomorrow?"}]}])
    assert reply.content[0].text == "It is sunny in Paris." and reply.stop_reason == "end_turn"
    prompt = prompt_text(scripted)
    assert "sunny, 21 C" in prompt and "And tomorrow?" in prompt


def test_tool_use_streamed_as_input_json(client, scripted):
    scripted.engine.script = HERMES_CALL
    with client.messages.stream(model="scripted", max_tokens=128, tools=[WEATHER],
                                messages=[{"role": "user", "content": "Weather?"}]) as stream:
        events = list(stream)
        final = stream.get_final_message()
    partial = "".join(e.delta.partial_json for e in events
                      if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
    assert json.loads(partial) == {"city": "Paris"} == final.content[-1].input
    assert final.stop_reason == "tool_use" and final.content[-1].type == "tool_use"


def test_tool_result_error_and_tool_choice_forms(client, scripted):
    scripted.engine.script = HERMES_CALL
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"},
                   {"type": "auto", "disable_parallel_tool_use": True}):
        msg = client.messages.create(model="scripted", max_tokens=128, tools=[WEATHER], tool_choice=choice,
                                     messages=[{"role": "user", "content": "Weather?"}])
        assert msg.content[-1].type == "tool_use", choice
    msg = client.messages.create(model="scripted", max_tokens=128, tools=[WEATHER], tool_choice={"type": "none"},
                                 messages=[{"role": "user", "content": "Weather?"}])
    assert msg.stop_reason == "end_turn" and "<tool_call>" in msg.content[0].text
    scripted.engine.script = "Sorry."
    client.messages.create(model="scripted", max_tokens=16, tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "no network",
                                      "is_error": True}]}])
    assert "Error: no network" in prompt_text(scripted)


def test_thinking_blocks_when_the_template_thinks(client, scripted, monkeypatch):
    tok = scripted.engine.tokenizer
    monkeypatch.setattr(tok, "chat_template", tok.chat_template + "{# <think> #}")
    scripted.engine.script = "<think>\nThe user wants a greeting.\n</think>\n\nHello!"
    msg = client.messages.create(model="scripted", max_tokens=64, messages=[{"role": "user", "content": "Hi"}],
                                 thinking={"type": "enabled", "budget_tokens": 1024})
    assert [b.type for b in msg.content] == ["thinking", "text"]
    assert msg.content[0].thinking == "The user wants a greeting." and msg.content[1].text == "Hello!"
    with client.messages.stream(model="scripted", max_tokens=64, messages=[{"role": "user", "content": "Hi"}],
                                thinking={"type": "enabled", "budget_tokens": 1024}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    thought = "".join(e.delta.thinking for e in events
                      if e.type == "content_block_delta" and e.delta.type == "thinking_delta")
    assert thought == "The user wants a greeting." and final.content[1].text == "Hello!"
    hidden = client.messages.create(model="scripted", max_tokens=64, messages=[{"role": "user", "content": "Hi"}],
                                    thinking={"type": "adaptive", "display": "omitted"})
    assert hidden.content[0].type == "thinking" and hidden.content[0].thinking == ""
    # thinking from an earlier turn is accepted (and kept or dropped by the template)
    client.messages.create(model="scripted", max_tokens=8, messages=[
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "x"},
                                          {"type": "redacted_thinking", "data": "abc"},
                                          {"type": "text", "text": "Hello!"}]},
        {"role": "user", "content": "Again"}])


def test_count_tokens_is_the_prompt_the_engine_sees(client, scripted):
    scripted.engine.script = "ok"
    kwargs = dict(model="scripted", system=[{"type": "text", "text": "Be brief."}], tools=[WEATHER],
                  messages=[{"role": "user", "content": "Weather in Paris?"}])
    counted = client.messages.count_tokens(**kwargs)
    client.messages.create(max_tokens=4, **kwargs)
    assert counted.input_tokens == len(scripted.engine.prompts[-1]) > 0


def test_stop_sequence_and_max_tokens(client, scripted):
    scripted.engine.script = "one two three STOP four five"
    msg = client.messages.create(model="scripted", max_tokens=64, messages=USER, stop_sequences=["STOP"])
    assert (msg.stop_reason, msg.stop_sequence, msg.content[0].text) == ("stop_sequence", "STOP", "one two three ")
    msg = client.messages.create(model="scripted", max_tokens=2, messages=USER)
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 2


def test_a_call_cut_by_max_tokens_stays_a_tool_use(client, scripted):
    scripted.engine.script = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "detail": "the'
    n = len(scripted.engine.tokenizer.encode(scripted.engine.script))
    msg = client.messages.create(model="scripted", max_tokens=n, tools=[WEATHER], messages=USER)
    assert msg.stop_reason == "max_tokens"
    assert [b.type for b in msg.content] == ["tool_use"] and msg.content[0].input["city"] == "Paris"


def test_model_aliases(client, scripted, monkeypatch):
    scripted.engine.script = "ok"
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-sonnet-4-5", max_tokens=4, messages=USER)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "not_found_error"
    assert "--model-alias" in e.value.body["error"]["message"]
    monkeypatch.setattr(scripted.state.settings, "model_alias", ["claude-*=scripted", "gpt-5*"])
    for name in ("claude-sonnet-4-5", "claude-haiku-4-5-20251001", "gpt-5-codex"):
        msg = client.messages.create(model=name, max_tokens=4, messages=USER)
        assert msg.content[0].text == "ok" and msg.model == name
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="llama", max_tokens=4, messages=USER)
    monkeypatch.setattr(scripted.state.settings, "model_alias", ["claude-*=missing"])
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-x", max_tokens=4, messages=USER)
    assert "'missing'" in e.value.body["error"]["message"]


def _error(exc) -> dict:
    assert exc.body["type"] == "error" and set(exc.body["error"]) >= {"type", "message"}
    return exc.body["error"]


PNG = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}


def test_an_image_in_a_tool_result_is_refused_as_one_in_a_user_turn(client):
    """A text-only model reads no image, wherever it is: both are a 400 naming the block, not a silent drop."""
    errors = []
    for content in ([{"type": "text", "text": "Look:"}, PNG],
                    [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "Look:"},
                                                                                    PNG]}]):
        with pytest.raises(anthropic.BadRequestError) as e:
            client.messages.create(model="scripted", max_tokens=8, tools=[WEATHER], messages=[
                {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                   "input": {"city": "Paris"}}]},
                {"role": "user", "content": content}])
        errors.append(_error(e.value)["message"])
    assert "messages[2].content[1] is an image block" in errors[0]
    assert "messages[2].content[0].content[1] is an image block" in errors[1]
    assert all("no vision" in m and "Send the content as text" in m for m in errors)


def test_request_errors_have_anthropic_shape(client):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="scripted", max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}])
    err = _error(e.value)
    assert err["type"] == "invalid_request_error" and "no vision" in err["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="scripted", max_tokens=8, messages=[{"role": "robot", "content": "x"}])
    assert "messages[0].role" in _error(e.value)["message"]
    with pytest.raises(anthropic.BadRequestError) as e:  # a body that fails validation
        client.messages.create(model="scripted", max_tokens=0, messages=USER)
    assert "max_tokens" in _error(e.value)["message"]
    with httpx.Client(base_url=str(client.base_url), timeout=30) as c:
        r = c.post("/v1/messages", json={"model": "scripted", "messages": USER})
        assert r.status_code == 400 and "max_tokens is required" in r.json()["error"]["message"]
        r = c.post("/v1/messages", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["type"] == "error"


def test_context_overflow_says_what_was_sent_and_what_fits(client):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="scripted", max_tokens=8, messages=[{"role": "user", "content": "word " * 3000}])
    message = _error(e.value)["message"]
    assert "2048" in message and "prompt has" in message


def test_queue_full_and_loading_and_engine_failure(client, scripted, monkeypatch):
    def full(*a, **k):
        raise QueueFullError(68)
    with monkeypatch.context() as m:
        m.setattr(scripted.engine, "submit", full)
        with pytest.raises(anthropic.RateLimitError) as e:
            client.messages.create(model="scripted", max_tokens=8, messages=USER)
        assert _error(e.value)["type"] == "rate_limit_error"
    scripted.engine.script = "Hello there, general Kenobi."
    scripted.engine.fail_after = 2
    with pytest.raises(anthropic.APIStatusError) as e:
        with client.messages.stream(model="scripted", max_tokens=64, messages=USER) as stream:
            list(stream)
    assert "boom" in _error(e.value)["message"]
    with pytest.raises(anthropic.InternalServerError) as e:
        client.messages.create(model="scripted", max_tokens=64, messages=USER)
    assert _error(e.value)["type"] == "api_error"
    scripted.engine.fail_after = None
    loading = ServerState(load_settings([], {})[0], ["scripted"])
    with RunningServer(loading) as running:
        c = anthropic.Anthropic(base_url=running.base_url, api_key="x", max_retries=0)
        with pytest.raises(anthropic.InternalServerError) as e:
            c.messages.create(model="scripted", max_tokens=8, messages=USER)
        assert e.value.status_code == 503 and _error(e.value)["type"] == "overloaded_error"


def test_auth_by_x_api_key_or_bearer_and_size_limit(default_engine):
    settings, _ = load_settings(["--api-key", "sekret", "--max-body-mib", "1"], {})
    state = ServerState(settings, ["scripted"])
    from tests.api.scripted import ScriptedEngine
    engine = ScriptedEngine(default_engine.tokenizer)
    engine.script = "ok"
    state.loaded = SimpleNamespace(engine=engine, tokenizer=default_engine.tokenizer, context_window=2048)
    with RunningServer(state) as running:
        good = anthropic.Anthropic(base_url=running.base_url, api_key="sekret", max_retries=0)  # x-api-key
        assert good.messages.create(model="scripted", max_tokens=4, messages=USER).content[0].text == "ok"
        bearer = anthropic.Anthropic(base_url=running.base_url, auth_token="sekret", max_retries=0)
        assert bearer.messages.create(model="scripted", max_tokens=4, messages=USER).content[0].text == "ok"
        bad = anthropic.Anthropic(base_url=running.base_url, api_key="wrong", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError) as e:
            bad.messages.create(model="scripted", max_tokens=4, messages=USER)
        assert _error(e.value)["type"] == "authentication_error" and "x-api-key" in _error(e.value)["message"].lower()
        with pytest.raises(anthropic.APIStatusError) as e:
            good.messages.create(model="scripted", max_tokens=4, messages=[{"role": "user", "content": "x" * 2**21}])
        assert e.value.status_code == 413 and _error(e.value)["type"] == "request_too_large"
        # the OpenAI routes keep the OpenAI shape
        with httpx.Client(base_url=running.base_url) as c:
            assert "type" not in c.post("/v1/chat/completions", json={}).json()


def test_hosted_tools_are_left_out_and_reported(scripted):
    scripted.engine.script = "ok"
    with httpx.Client(base_url=scripted.base_url, timeout=30) as c:
        r = c.post("/v1/messages", json={"model": "scripted", "max_tokens": 8, "messages": USER, "tools": [
            WEATHER, {"type": "web_search_20250305", "name": "web_search"}]})
    assert r.status_code == 200 and r.headers["x-ninfer-omitted-tools"] == "web_search"
    assert "get_weather" in r.request.content.decode()


def test_malformed_fields_are_400s_not_crashes(scripted):
    with httpx.Client(base_url=scripted.base_url, timeout=30) as c:
        for extra in ({"thinking": {"type": ["enabled"]}}, {"tool_choice": {"type": "tool"}},
                      {"system": [{"type": "image"}]}, {"messages": [{"role": "user", "content": 5}]}):
            r = c.post("/v1/messages", json={"model": "scripted", "max_tokens": 4, "messages": USER, **extra})
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text


def test_host_check_refusal_has_anthropic_shape(scripted):
    with httpx.Client(base_url=scripted.base_url, timeout=30) as c:
        r = c.post("/v1/messages", headers={"Host": "attacker.example"},
                   json={"model": "scripted", "max_tokens": 4, "messages": USER})
        assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
        r = c.post("/v1/chat/completions", headers={"Host": "attacker.example"}, json={})
        assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed"
