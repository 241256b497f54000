"""Forced tool calls on the real default model, greedy: the grammar closes the arguments after the declared
properties, never repeats an identical call, and a call cut by the token budget stays a call in every API."""
import json

import anthropic
import openai
import pytest

from engine.constrain import closed_objects, tool_call_constraint

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Get the weather in a city",
                                         "parameters": PARAMS}}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture
def oai(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)


def test_closed_objects_closes_listed_properties_only():
    nested = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}},
                                               "c": {"type": "array", "items": {"type": "object",
                                                                                "properties": {"d": {}}}}}}
    closed = closed_objects(nested)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert closed["properties"]["c"]["items"]["additionalProperties"] is False
    assert "additionalProperties" not in nested  # the request's schema is left as it was
    explicit = {"type": "object", "properties": {"a": {}}, "additionalProperties": {"type": "string"}}
    assert closed_objects(explicit) == explicit
    combined = {"allOf": [{"type": "object", "properties": {"a": {}}}, {"type": "object", "properties": {"b": {}}}]}
    assert closed_objects(combined) == combined  # closing allOf parts would make them contradict
    assert closed_objects({"type": "object"}) == {"type": "object"}


def test_a_repeated_call_ends_a_required_answer(default_engine):
    tok = default_engine.tokenizer
    constraint = tool_call_constraint(tok, [TOOL], True).fresh()
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    for t in tok.encode(call + "\n" + call[:-len("\n</tool_call>")]):
        assert not constraint.finished
        constraint.accept(t)
    assert constraint.finished  # the second call repeats the first: nothing more may follow


def test_a_forced_call_closes_its_arguments(oai, server):
    r = oai.chat.completions.create(model=MODEL, messages=USER, tools=[TOOL], temperature=0, max_tokens=128,
                                    tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) <= {"city"}


def test_required_never_repeats_a_call(oai):
    r = oai.chat.completions.create(model=MODEL, messages=USER, tools=[TOOL], temperature=0, max_tokens=200,
                                    tool_choice="required")
    calls = [(c.function.name, json.dumps(json.loads(c.function.arguments), sort_keys=True))
             for c in r.choices[0].message.tool_calls]
    assert calls and len(set(calls)) == len(calls)


def test_a_cut_call_stays_a_call_in_every_api(oai, server):
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = oai.chat.completions.create(model=MODEL, messages=USER, tools=[TOOL], temperature=0, max_tokens=14,
                                    tool_choice=named)
    choice = r.choices[0]
    assert choice.finish_reason == "length" and not choice.message.content
    assert choice.message.tool_calls[0].function.name == "get_weather"
    assert isinstance(json.loads(choice.message.tool_calls[0].function.arguments), dict)

    resp = oai.responses.create(model=MODEL, input=USER[0]["content"], temperature=0, max_output_tokens=14,
                                tools=[{"type": "function", "name": "get_weather", "parameters": PARAMS}],
                                tool_choice={"type": "function", "name": "get_weather"})
    assert resp.status == "incomplete" and [o.type for o in resp.output] == ["function_call"]

    claude = anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0)
    msg = claude.messages.create(model=MODEL, messages=USER, max_tokens=14, extra_body={"temperature": 0},
                                 tools=[{"name": "get_weather", "input_schema": PARAMS}],
                                 tool_choice={"type": "tool", "name": "get_weather"})
    assert msg.stop_reason == "max_tokens" and [b.type for b in msg.content] == ["tool_use"]
    assert isinstance(msg.content[0].input, dict)
