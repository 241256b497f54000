"""Structured output through the official openai SDK: response_format json_object / json_schema (whole and streamed),
400s for schemas that cannot be enforced, and tool_choice "required" / a named tool forcing a parsed tool call."""
import json

import jsonschema
import openai
import pytest

from tests.api.conftest import wait_idle

MODEL = "smollm2-135m-instruct"
ALICE = [{"role": "user", "content": "Return a JSON object with the keys name and age for Alice, who is 30."}]
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
PARIS = [{"role": "user", "content": "What is the weather like in Paris?"}]


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def schema_format(schema, name="person", strict=True):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": strict}}


def streamed_text(chunks) -> tuple[str, list]:
    chunks = list(chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]


@pytest.mark.slow
def test_json_object_gives_a_json_object(client):
    for kw in ({"temperature": 0}, {"temperature": 1.0, "seed": 3}):
        r = client.chat.completions.create(model=MODEL, messages=ALICE, max_tokens=120,
                                           response_format={"type": "json_object"}, **kw)
        assert r.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    text, finishes = streamed_text(client.chat.completions.create(
        model=MODEL, messages=ALICE, max_tokens=120, temperature=0, response_format={"type": "json_object"},
        stream=True))
    assert isinstance(json.loads(text), dict) and finishes == ["stop"]


@pytest.mark.slow
def test_json_schema_output_validates_whole_and_streamed(client):
    r = client.chat.completions.create(model=MODEL, messages=ALICE, max_tokens=120, temperature=0,
                                       response_format=schema_format(PERSON))
    value = json.loads(r.choices[0].message.content)
    jsonschema.validate(value, PERSON)
    assert r.choices[0].finish_reason == "stop"
    text, finishes = streamed_text(client.chat.completions.create(
        model=MODEL, messages=ALICE, max_tokens=120, temperature=0, response_format=schema_format(PERSON),
        stream=True))
    assert json.loads(text) == value and finishes == ["stop"]


@pytest.mark.slow
def test_json_schema_with_n_2_sampled_choices(client):
    r = client.chat.completions.create(model=MODEL, messages=ALICE, max_tokens=120, temperature=1.0, seed=5, n=2,
                                       response_format=schema_format(PERSON, strict=False))
    assert len(r.choices) == 2
    for choice in r.choices:
        jsonschema.validate(json.loads(choice.message.content), PERSON)


@pytest.mark.slow
def test_text_format_is_plain_text(client):
    plain = client.chat.completions.create(model=MODEL, messages=ALICE, max_tokens=30, temperature=0)
    r = client.chat.completions.create(model=MODEL, messages=ALICE, max_tokens=30, temperature=0,
                                       response_format={"type": "text"})
    assert r.choices[0].message.content == plain.choices[0].message.content


@pytest.mark.slow
def test_completions_take_response_format(client):
    r = client.completions.create(model=MODEL, prompt="Alice is 30. As JSON with name and age:", max_tokens=60,
                                  temperature=0, extra_body={"response_format": schema_format(PERSON)})
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)


@pytest.mark.slow
@pytest.mark.parametrize("schema", [{"type": "object", "not": {"required": ["a"]}}, {"type": "nope"},
                                    {"type": "string", "pattern": "(?<=a)b"}])
def test_unenforceable_schema_is_a_400(client, server, schema):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=ALICE, max_tokens=10,
                                       response_format=schema_format(schema))
    err = info.value.body
    assert info.value.status_code == 400 and err["param"] == "response_format"
    assert "cannot be enforced" in err["message"]
    assert wait_idle(server.state.loaded.engine)["running"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("fmt", [{"type": "xml"}, {"type": "json_schema"}, {"type": "json_schema",
                                                                            "json_schema": {"name": "x"}},
                                 {"json_schema": {}}, "json"])
def test_malformed_response_format_is_a_400(client, fmt):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=ALICE, max_tokens=10, response_format=fmt)
    assert info.value.status_code == 400 and info.value.body["param"].startswith("response_format")


@pytest.mark.slow
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_call(client, tool_choice):
    r = client.chat.completions.create(model=MODEL, messages=PARIS, tools=[WEATHER_TOOL], tool_choice=tool_choice,
                                       max_tokens=120, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert isinstance(json.loads(call.function.arguments)["city"], str)


@pytest.mark.slow
def test_forced_tool_call_streamed(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=PARIS, tools=[WEATHER_TOOL],
                                                 tool_choice="required", max_tokens=120, temperature=0, stream=True))
    calls: dict[int, dict] = {}
    for c in chunks:
        for d in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            call = calls.setdefault(d.index, {"name": "", "arguments": ""})
            call["name"] += d.function.name or ""
            call["arguments"] += d.function.arguments or ""
    assert calls and calls[0]["name"] == "get_weather"
    assert isinstance(json.loads(calls[0]["arguments"])["city"], str)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["tool_calls"]
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


@pytest.mark.slow
def test_forced_tool_with_a_bad_parameters_schema_is_a_400(client):
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "not": {}}}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=PARIS, tools=[bad], tool_choice="required",
                                       max_tokens=10)
    assert info.value.body["param"] == "tools" and "'f'" in info.value.body["message"]


def test_responses_text_format_json_schema_is_enforced(server):
    import json as _json

    import openai as _openai
    client = _openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}
    r = client.responses.create(model="smollm2-135m-instruct", input="Name a city in France as JSON.",
                                max_output_tokens=60, temperature=0,
                                text={"format": {"type": "json_schema", "name": "city", "schema": schema}})
    assert isinstance(_json.loads(r.output_text)["city"], str)
    with pytest.raises(_openai.BadRequestError) as e:
        client.responses.create(model="smollm2-135m-instruct", input="x",
                                text={"format": {"type": "json_schema", "name": "bad",
                                                 "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}})
    assert e.value.body["param"] in ("response_format", "text.format")
