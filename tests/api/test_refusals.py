"""Requests a strict server refuses get a 400 in the API's error shape before anything is admitted: schemas whose
grammar cannot start (a required recursion), values of the wrong JSON type, numbers beyond their bounds, and error
messages that echo a huge value only in part."""
import json

import httpx
import pytest

HELLO = [{"role": "user", "content": "Say hello."}]
RECURSIVE = {"type": "object", "properties": {"child": {"$ref": "#"}}, "required": ["child"]}


@pytest.fixture
def client(scripted):
    scripted.engine.script = "Hello."
    scripted.engine.prompts.clear()
    with httpx.Client(base_url=scripted.base_url, timeout=30) as c:
        yield c


def openai_error(r, param: str | None = None) -> str:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err
    return err["message"]


RECURSIVE_REQUESTS = {
    "chat response_format": ("/v1/chat/completions", {"messages": HELLO, "response_format": {
        "type": "json_schema", "json_schema": {"name": "tree", "schema": RECURSIVE}}}, "response_format"),
    "responses text.format": ("/v1/responses", {"input": "hi", "text": {"format": {
        "type": "json_schema", "name": "tree", "schema": RECURSIVE}}}, "text.format"),
    "forced tool parameters": ("/v1/chat/completions", {"messages": HELLO, "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "grow", "parameters": RECURSIVE}}]}, "tools"),
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("case", list(RECURSIVE_REQUESTS))
def test_a_required_recursion_is_refused_before_the_request_is_admitted(client, scripted, case, stream):
    path, body, param = RECURSIVE_REQUESTS[case]
    r = client.post(path, json={"model": "scripted", "stream": stream, **body})
    message = openai_error(r, param)
    assert "never ends" in message and "optional" in message and "<state>" not in message
    assert not scripted.engine.prompts  # nothing was submitted


def test_a_recursion_with_an_end_is_still_enforced(client, scripted):
    tree = {"type": "object", "properties": {"child": {"$ref": "#"}}}
    r = client.post("/v1/chat/completions", json={"model": "scripted", "messages": HELLO, "response_format": {
        "type": "json_schema", "json_schema": {"name": "tree", "schema": tree}}})
    assert r.status_code == 200, r.text
    assert scripted.engine.params[-1].constraint is not None


def test_a_recursive_tool_under_anthropic_any_is_a_400_in_anthropic_shape(client):
    r = client.post("/v1/messages", json={"model": "scripted", "max_tokens": 8, "messages": HELLO,
                                          "tool_choice": {"type": "any"},
                                          "tools": [{"name": "grow", "input_schema": RECURSIVE}]})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert "never ends" in r.json()["error"]["message"]


WRONG_TYPES = [("max_tokens", "10"), ("max_tokens", True), ("max_tokens", 10.5), ("temperature", "0.5"),
               ("temperature", True), ("logprobs", "yes"), ("stream", "yes"), ("n", "2"), ("seed", "3"),
               ("top_k", 1e20), ("top_k", 2**31), ("max_tokens", 10**30), ("stop", [""]),
               ("logit_bias", {"5": "1"}), ("stream_options", {"include_usage": 1})]


@pytest.mark.parametrize("field,value", WRONG_TYPES)
def test_chat_fields_take_only_their_json_type_and_range(client, scripted, field, value):
    r = client.post("/v1/chat/completions", json={"model": "scripted", "messages": HELLO, field: value})
    message = openai_error(r)
    assert r.json()["error"]["param"].split(".")[0] == field and field in message
    assert not scripted.engine.prompts


def test_the_message_names_the_json_type_that_was_sent(client):
    r = client.post("/v1/chat/completions", json={"model": "scripted", "messages": HELLO, "max_tokens": "10"})
    assert "valid integer, not a string" in openai_error(r, "max_tokens")


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"text": "hi"}]}]}, "messages.0.content"),
    ("/v1/completions", {"prompt": [1, True]}, "prompt"),
    ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]},
     "input[0].content[0].text"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": "10"}, "max_output_tokens"),
    ("/v1/responses", {"input": "hi", "stream": "yes"}, "stream"),
])
def test_text_and_numbers_are_not_coerced(client, path, body, param):
    openai_error(client.post(path, json={"model": "scripted", **body}), param)


@pytest.mark.parametrize("body", [
    {"max_tokens": "10"}, {"max_tokens": 2**31}, {"top_k": 1e20}, {"temperature": "0.5"}, {"stream": "yes"},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
    {"system": [{"type": "text", "text": 5}]}, {"stop_sequences": [""]},
])
def test_messages_fields_take_only_their_json_type_and_range(client, body):
    r = client.post("/v1/messages", json={"model": "scripted", "max_tokens": 8, "messages": HELLO, **body})
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    assert r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("parameters,where", [
    ({"type": "objectx"}, "parameters.type"),
    ({"type": "object", "properties": {"city": {"type": 7}}}, "properties.city.type"),
    ({"type": "object", "required": "city"}, "parameters.required"),
    ({"type": "object", "properties": []}, "parameters.properties"),
])
@pytest.mark.parametrize("tool_choice", ["auto", None])
def test_a_malformed_tool_schema_is_refused_even_when_no_call_is_forced(client, parameters, where, tool_choice):
    body = {"model": "scripted", "messages": HELLO,
            "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": parameters}}]}
    if tool_choice:
        body["tool_choice"] = tool_choice
    assert where in openai_error(client.post("/v1/chat/completions", json=body), "tools")


def test_a_malformed_input_schema_is_named_as_the_messages_api_calls_it(client):
    r = client.post("/v1/messages", json={"model": "scripted", "max_tokens": 8, "messages": HELLO, "tools": [
        {"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "town"}}}}]})
    assert r.status_code == 400 and "tools[0].input_schema.properties.city.type" in r.json()["error"]["message"]


def test_well_formed_tool_schemas_still_pass(client):
    schema = {"type": "object", "$defs": {"unit": {"enum": ["C", "F"]}}, "additionalProperties": False,
              "properties": {"city": {"type": ["string", "null"], "minLength": 1, "description": "City"},
                             "days": {"type": "integer", "minimum": 1, "exclusiveMaximum": 15},
                             "unit": {"$ref": "#/$defs/unit"}, "tags": {"type": "array", "items": {"type": "string"}},
                             "x-extension": {"anything": [1, 2]}},
              "required": ["city"], "anyOf": [{"required": ["city"]}, {"required": ["days"]}]}
    r = client.post("/v1/chat/completions", json={"model": "scripted", "messages": HELLO, "tools": [
        {"type": "function", "function": {"name": "get_weather", "parameters": schema}}]})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("body,problem", [
    ({"top_k": 1e30}, "whole number"), ({"top_k": 10**30}, "at most"), ({"top_k": "5"}, "not a string"),
    ({"default_max_tokens": 1e30}, "whole number"), ({"default_max_tokens": 10**30}, "at most"),
    ({"greedy": "yes"}, "true or false"), ({"temperature": "0.5"}, "a number"), ({"mode": 5}, "a string"),
])
def test_settings_put_takes_only_json_types_and_bounded_numbers(client, scripted, body, problem):
    before = client.get("/ninfer/v1/settings").json()
    r = client.put("/ninfer/v1/settings", json=body)
    assert problem in openai_error(r, next(iter(body)))
    assert client.get("/ninfer/v1/settings").json()["sampling"] == before["sampling"]


def test_a_responses_input_string_is_not_held_to_the_item_limit(client):
    r = client.post("/v1/responses", json={"model": "scripted", "input": "word " * 1000})  # 5,000 characters
    assert r.status_code == 200, r.text


MIB = "a" * (1 << 20)


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": HELLO, "tools": [{"type": "function", "function": {"name": MIB}}]}),
    ("/v1/chat/completions", {"messages": HELLO, "tools": [{"type": MIB, "function": {"name": "f"}}]}),
    ("/v1/chat/completions", {"messages": HELLO, "logit_bias": {MIB: 1}}),
    ("/v1/responses", {"input": [{"type": MIB}]}),
    ("/v1/messages", {"max_tokens": 8, "messages": [{"role": MIB, "content": "hi"}]}),
])
def test_a_huge_value_is_echoed_only_in_part(client, path, body):
    r = client.post(path, json={"model": "scripted", **body})
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert len(err["message"]) < 1000 and "aaaa…" in err["message"]
    assert len(err.get("param") or "") <= 201


def test_a_huge_model_name_or_setting_name_is_echoed_only_in_part(client):
    r = client.post("/v1/chat/completions", json={"model": MIB, "messages": HELLO})
    assert r.status_code == 404 and len(r.json()["error"]["message"]) < 1000 and "…" in r.text
    r = client.put("/ninfer/v1/settings", json={MIB: 1})
    assert r.status_code == 400 and len(r.text) < 1500 and "…" in r.json()["error"]["message"]
