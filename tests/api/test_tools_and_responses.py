"""Tool calls and the Responses API through the real server with a scripted model output."""
import json

import openai
import pytest


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
CALL_TEXTS = {
    "hermes": 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "bare": '{"name": "get_weather", "arguments": {"city": "Paris"}}',
    "fenced": 'Sure:\n```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```',
}


@pytest.fixture
def client(scripted):
    return openai.OpenAI(base_url=scripted.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("fmt", sorted(CALL_TEXTS))
def test_tool_call_non_stream(client, scripted, fmt):
    scripted.engine.script = CALL_TEXTS[fmt]
    r = client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "Weather?"}],
                                       tools=[WEATHER])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert call.id.startswith("call_")
    if fmt == "bare":
        assert choice.message.content is None
    else:
        assert choice.message.content in ("Let me check.", "Sure:")


@pytest.mark.parametrize("fmt", sorted(CALL_TEXTS))
def test_tool_call_streamed_as_deltas(client, scripted, fmt):
    scripted.engine.script = CALL_TEXTS[fmt]
    chunks = list(client.chat.completions.create(model="scripted", stream=True, tools=[WEATHER],
                                                 messages=[{"role": "user", "content": "Weather?"}]))
    calls = {}
    for c in chunks:
        for tc in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            entry = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            entry["id"] = tc.id or entry["id"]
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
    assert list(calls) == [0]
    assert calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"]) == {"city": "Paris"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "<tool_call>" not in text and "get_weather" not in text


def test_tool_choice_none_keeps_text_and_hides_tools(client, scripted):
    scripted.engine.script = CALL_TEXTS["hermes"]
    r = client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "Weather?"}],
                                       tools=[WEATHER], tool_choice="none")
    assert r.choices[0].finish_reason == "stop" and "<tool_call>" in r.choices[0].message.content
    prompt = scripted.engine.tokenizer.decode(scripted.engine.prompts[-1], skip_special_tokens=False)
    assert "get_weather" not in prompt


def test_tool_result_message_reaches_the_template(client, scripted):
    scripted.engine.script = "It is sunny in Paris."
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    r = client.chat.completions.create(model="scripted", messages=messages, tools=[WEATHER])
    assert r.choices[0].message.content == "It is sunny in Paris."
    prompt = scripted.engine.tokenizer.decode(scripted.engine.prompts[-1], skip_special_tokens=False)
    assert "sunny, 21 C" in prompt


def test_invalid_tools_are_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "x"}],
                                       tools=[{"type": "function", "function": {"name": "bad name!"}}])
    assert e.value.body["param"] == "tools"


def test_reasoning_is_split_when_the_template_thinks(scripted, client, monkeypatch):
    tok = scripted.engine.tokenizer
    monkeypatch.setattr(tok, "chat_template", tok.chat_template + "{# <think> #}")
    scripted.engine.script = "<think>\nThe user wants a greeting.\n</think>\n\nHello!"
    r = client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "Hi"}])
    msg = r.choices[0].message
    assert msg.content == "Hello!"
    assert msg.model_extra["reasoning_content"] == "The user wants a greeting."
    assert msg.model_extra["reasoning"] == "The user wants a greeting."
    chunks = list(client.chat.completions.create(model="scripted", stream=True,
                                                 messages=[{"role": "user", "content": "Hi"}]))
    reasoning = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks if c.choices)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert (reasoning, content) == ("The user wants a greeting.", "Hello!")


RESP_TOOL = {"type": "function", "name": "get_weather", "description": "Weather for a city",
             "parameters": WEATHER["function"]["parameters"]}


def test_responses_text_non_stream(client, scripted):
    scripted.engine.script = "Paris is the capital."
    r = client.responses.create(model="scripted", instructions="Be brief.", input="Capital of France?")
    assert r.status == "completed" and r.output_text == "Paris is the capital."
    assert r.usage.output_tokens > 0 and r.usage.input_tokens > 0
    prompt = scripted.engine.tokenizer.decode(scripted.engine.prompts[-1], skip_special_tokens=False)
    assert "Be brief." in prompt and "Capital of France?" in prompt


def test_responses_stream_events(client, scripted):
    scripted.engine.script = "Paris is the capital."
    events = list(client.responses.create(model="scripted", input="Capital of France?", stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Paris is the capital."
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.output[0].content[0].text == "Paris is the capital."


def test_responses_function_call_round_trip(client, scripted):
    scripted.engine.script = CALL_TEXTS["hermes"]
    events = list(client.responses.create(model="scripted", input="Weather in Paris?", tools=[RESP_TOOL],
                                          stream=True))
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds
    done = events[-1].response
    call = next(o for o in done.output if o.type == "function_call")
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    # the Codex loop: send the call and its output back as input items
    scripted.engine.script = "It is sunny."
    r = client.responses.create(model="scripted", tools=[RESP_TOOL], input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}])
    assert r.output_text == "It is sunny."
    prompt = scripted.engine.tokenizer.decode(scripted.engine.prompts[-1], skip_special_tokens=False)
    assert "sunny, 21 C" in prompt


def test_responses_length_is_incomplete(client, scripted):
    scripted.engine.script = "one two three four five six seven eight"
    r = client.responses.create(model="scripted", input="Count", max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"


def test_responses_rejects_what_it_cannot_do(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="scripted", input="x", previous_response_id="resp_1")
    assert e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="scripted", input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}]}])
    assert e.value.body["param"] == "input[0].content[0]" and "no vision" in e.value.body["message"]


def test_engine_failure_mid_stream_sends_an_error_chunk_then_done(scripted, client):
    import httpx
    scripted.engine.script = "Hello there, general Kenobi."
    scripted.engine.fail_after = 2
    try:
        with httpx.Client(base_url=scripted.base_url, timeout=10) as c:
            lines = [line for line in c.post("/v1/chat/completions", json={
                "model": "scripted", "stream": True, "messages": [{"role": "user", "content": "Hi"}]}
            ).text.splitlines() if line.startswith("data: ")]
            assert lines[-1] == "data: [DONE]"
            error = json.loads(lines[-2][6:])["error"]
            assert error["code"] == "engine_error" and "boom" in error["message"]
            assert any('"content": "Hello"' in line for line in lines[:-2])
            r = c.post("/v1/chat/completions", json={"model": "scripted",
                                                     "messages": [{"role": "user", "content": "Hi"}]})
            assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error"
        scripted.engine.fail_after = None
        assert client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "Hi"}]
                                              ).choices[0].message.content == "Hello there, general Kenobi."
    finally:
        scripted.engine.fail_after = None
