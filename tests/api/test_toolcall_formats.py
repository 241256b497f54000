"""One table of tool-call formats and tool_choice values, through all three APIs (chat completions, responses,
messages), streamed and not: the streamed fragments rebuild the non-streamed answer (per call: id, type and name
once, arguments concatenating to the same JSON text), read with the official SDKs; a long argument arrives in
many pieces as it is generated."""
import json

import anthropic
import openai
import pytest


PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": PARAMS}}
RESP_TOOL = {"type": "function", "name": "get_weather", "description": "Weather", "parameters": PARAMS}
MSG_TOOL = {"name": "get_weather", "description": "Weather", "input_schema": PARAMS}
FORMATS = {
    "hermes": 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "qwen3_coder_xml": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
                       "</tool_call>",
    "bare_json": '{"name": "get_weather", "arguments": {"city": "Paris"}}',
    "fenced_json": 'Sure:\n```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    "mistral_args": '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',
    "two_calls": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                 '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
}
CHOICES = ["auto", "required", "named", "none"]
USER = [{"role": "user", "content": "Weather in Paris?"}]


def expected_calls(fmt: str, choice: str) -> list[tuple[str, dict]]:
    if choice == "none":
        return []
    cities = ["Paris", "Oslo"] if fmt == "two_calls" else ["Paris"]
    return [("get_weather", {"city": c}) for c in cities]


def rebuilt(pieces: dict[int, dict]) -> list[tuple[str, dict]]:
    """Calls from streamed fragments, checking that id, type and name came exactly once per call."""
    calls = []
    for index in sorted(pieces):
        p = pieces[index]
        assert len(p["ids"]) == 1 and len(p["names"]) == 1 and len(p["types"]) <= 1, p
        calls.append((p["names"][0], json.loads("".join(p["args"]))))
    return calls


def argument_texts(pieces: dict[int, dict]) -> list[tuple[str, int]]:
    """Per call: its arguments text as streamed, and in how many non-empty pieces it came."""
    return [("".join(p["args"]), sum(1 for a in p["args"] if a)) for _, p in sorted(pieces.items())]


def _piece(pieces, index):
    return pieces.setdefault(index, {"ids": [], "names": [], "types": [], "args": []})


def chat(base_url, fmt, choice):
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0)
    tool_choice = {"type": "function", "function": {"name": "get_weather"}} if choice == "named" else choice
    kwargs = dict(model="scripted", messages=USER, tools=[CHAT_TOOL], tool_choice=tool_choice)
    r = client.chat.completions.create(**kwargs)
    calls = r.choices[0].message.tool_calls or []
    whole = [(c.function.name, json.loads(c.function.arguments)) for c in calls]
    texts = [c.function.arguments for c in calls]
    pieces = {}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            p = _piece(pieces, tc.index)
            p["ids"] += [tc.id] if tc.id else []
            p["types"] += [tc.type] if tc.type else []
            p["names"] += [tc.function.name] if tc.function.name else []
            p["args"].append(tc.function.arguments or "")
    return whole, rebuilt(pieces), r.choices[0].finish_reason, texts, argument_texts(pieces)


def responses(base_url, fmt, choice):
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0)
    tool_choice = {"type": "function", "name": "get_weather"} if choice == "named" else choice
    kwargs = dict(model="scripted", input="Weather in Paris?", tools=[RESP_TOOL], tool_choice=tool_choice)
    r = client.responses.create(**kwargs)
    whole = [(o.name, json.loads(o.arguments)) for o in r.output if o.type == "function_call"]
    texts = [o.arguments for o in r.output if o.type == "function_call"]
    pieces = {}
    for ev in client.responses.create(stream=True, **kwargs):
        if ev.type == "response.output_item.added" and ev.item.type == "function_call":
            p = _piece(pieces, ev.output_index)
            p["ids"].append(ev.item.call_id)
            p["names"].append(ev.item.name)
        elif ev.type == "response.function_call_arguments.delta":
            pieces[ev.output_index]["args"].append(ev.delta)
    return whole, rebuilt(pieces), r.status, texts, argument_texts(pieces)


def messages(base_url, fmt, choice):
    client = anthropic.Anthropic(base_url=base_url, api_key="x", max_retries=0)
    tool_choice = {"type": "tool", "name": "get_weather"} if choice == "named" else {
        "auto": {"type": "auto"}, "required": {"type": "any"}, "none": {"type": "none"}}[choice]
    kwargs = dict(model="scripted", max_tokens=256, messages=USER, tools=[MSG_TOOL], tool_choice=tool_choice)
    r = client.messages.create(**kwargs)
    whole = [(b.name, b.input) for b in r.content if b.type == "tool_use"]
    texts = [json.dumps(b.input, ensure_ascii=False) for b in r.content if b.type == "tool_use"]
    pieces = {}
    with client.messages.stream(**kwargs) as stream:
        for ev in stream:
            if ev.type == "content_block_start" and ev.content_block.type == "tool_use":
                p = _piece(pieces, ev.index)
                p["ids"].append(ev.content_block.id)
                p["names"].append(ev.content_block.name)
            elif ev.type == "content_block_delta" and ev.delta.type == "input_json_delta":
                pieces[ev.index]["args"].append(ev.delta.partial_json)
    return whole, rebuilt(pieces), r.stop_reason, texts, argument_texts(pieces)


@pytest.mark.parametrize("api", [chat, responses, messages], ids=["chat", "responses", "messages"])
@pytest.mark.parametrize("choice", CHOICES)
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_every_format_and_tool_choice_through_every_api(scripted, api, choice, fmt):
    scripted.engine.script = FORMATS[fmt]
    whole, streamed, finish, texts, streamed_texts = api(scripted.base_url, fmt, choice)
    assert whole == streamed == expected_calls(fmt, choice)
    assert texts == [text for text, _ in streamed_texts]  # the same arguments text, not only the same JSON
    called = bool(whole)
    assert finish == {chat: "tool_calls" if called else "stop", responses: "completed",
                      messages: "tool_use" if called else "end_turn"}[api]


LONG_CITY = "Paris, " + "the city of light on the Seine, " * 8 + "in France"


@pytest.mark.parametrize("api", [chat, responses, messages], ids=["chat", "responses", "messages"])
@pytest.mark.parametrize("choice", ["auto", "required"])
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_a_long_argument_streams_in_pieces_that_rebuild_the_answer(scripted, api, choice, fmt):
    """The scripted model gives one token per step: a call's arguments must come as they are generated, in many
    pieces (one per token of the long value at least), not once the call is complete."""
    scripted.engine.script = FORMATS[fmt].replace('"Paris"', json.dumps(LONG_CITY)).replace(
        "\nParis\n", f"\n{LONG_CITY}\n")
    whole, streamed, _, texts, streamed_texts = api(scripted.base_url, fmt, choice)
    cities = [LONG_CITY, "Oslo"] if fmt == "two_calls" else [LONG_CITY]
    assert whole == streamed == [("get_weather", {"city": c}) for c in cities]
    assert texts == [text for text, _ in streamed_texts]
    value_tokens = len(scripted.engine.tokenizer.encode(LONG_CITY))
    assert streamed_texts[0][1] >= value_tokens // 2 > 10, streamed_texts


def test_parallel_calls_off_keeps_the_first_call_in_every_api(scripted):
    """parallel_tool_calls false (Anthropic: disable_parallel_tool_use) under auto: the answer holds one call."""
    scripted.engine.script = FORMATS["two_calls"]
    oai = openai.OpenAI(base_url=scripted.base_url + "/v1", api_key="x", max_retries=0)
    r = oai.chat.completions.create(model="scripted", messages=USER, tools=[CHAT_TOOL], parallel_tool_calls=False)
    assert [json.loads(c.function.arguments) for c in r.choices[0].message.tool_calls] == [{"city": "Paris"}]
    chunks = oai.chat.completions.create(model="scripted", messages=USER, tools=[CHAT_TOOL], stream=True,
                                         parallel_tool_calls=False)
    assert {tc.index for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []} == {0}
    for stream in (False, True):
        r = oai.responses.create(model="scripted", input="Weather?", tools=[RESP_TOOL], parallel_tool_calls=False,
                                 stream=stream)
        r = list(r)[-1].response if stream else r
        assert [json.loads(o.arguments) for o in r.output if o.type == "function_call"] == [{"city": "Paris"}]
    ant = anthropic.Anthropic(base_url=scripted.base_url, api_key="x", max_retries=0)
    kwargs = dict(model="scripted", max_tokens=256, messages=USER, tools=[MSG_TOOL],
                  tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    with ant.messages.stream(**kwargs) as stream:
        streamed = stream.get_final_message()
    for msg in (ant.messages.create(**kwargs), streamed):
        assert [b.input for b in msg.content if b.type == "tool_use"] == [{"city": "Paris"}]
