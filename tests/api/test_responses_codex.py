"""The Responses API as Codex CLI uses it, through the `openai` SDK, with a scripted model output: every input item
kind, every tool type, streamed and not, the fields Codex sends, and the routes without /v1."""
import json

import httpx
import openai
import pytest


FUNCTION = {"type": "function", "name": "get_weather", "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
NAMESPACE = {"type": "namespace", "name": "crm", "description": "The customer database.", "tools": [
    {"type": "function", "name": "lookup", "description": "Find a customer",
     "parameters": {"type": "object", "properties": {"email": {"type": "string"}}, "required": ["email"]}}]}
CUSTOM = {"type": "custom", "name": "apply_patch", "description": "Edit files with a patch.",
          "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "*** Begin Patch" /(.|\\n)*/'}}
SHELL = {"type": "local_shell"}
CODEX_FIELDS = dict(store=False, include=["reasoning.encrypted_content"], parallel_tool_calls=False,
                    prompt_cache_key="conv-1", reasoning={"effort": "medium", "summary": "auto"},
                    text={"verbosity": "low"}, service_tier="auto",
                    extra_body={"client_metadata": {"originator": "codex_exec"}})


def call_text(name: str, args: dict) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


@pytest.fixture
def client(scripted):
    return openai.OpenAI(base_url=scripted.base_url + "/v1", api_key="unused", max_retries=0)


def prompt_text(scripted) -> str:
    return scripted.engine.tokenizer.decode(scripted.engine.prompts[-1], skip_special_tokens=False)


def both(client, **kwargs):
    """(non-streamed response, streamed events, the response of the last streamed event)."""
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    return whole, events, events[-1].response


@pytest.mark.parametrize("tools", [[FUNCTION, NAMESPACE, CUSTOM, SHELL, {"type": "web_search"}]])
def test_codex_request_is_accepted_and_hosted_tools_reported(client, scripted, tools):
    scripted.engine.script = "Hello."
    raw = client.responses.with_raw_response.create(model="scripted", instructions="You are Codex.", input=[
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Sandbox: none."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Say hello."}]}],
        tools=tools, tool_choice="auto", **CODEX_FIELDS)
    r = raw.parse()
    assert r.output_text == "Hello." and r.status == "completed"
    assert raw.headers["x-ninfer-omitted-tools"] == "web_search"
    assert r.model_extra["omitted_tools"] == ["web_search"]
    prompt = prompt_text(scripted)
    assert "You are Codex." in prompt and "Sandbox: none." in prompt and "Say hello." in prompt


@pytest.mark.parametrize("kind", ["function", "namespace", "custom", "local_shell"])
def test_each_tool_type_gives_its_output_item_streamed_and_not(client, scripted, kind):
    scripted.engine.script = {
        "function": call_text("get_weather", {"city": "Paris"}),
        "namespace": call_text("crm__lookup", {"email": "a@b.c"}),
        "custom": call_text("apply_patch", {"input": "*** Begin Patch\n*** End Patch"}),
        "local_shell": call_text("local_shell", {"command": ["ls", "-la"], "workdir": "/tmp"}),
    }[kind]
    whole, events, streamed = both(client, model="scripted", input="Go.", tools=[FUNCTION, NAMESPACE, CUSTOM, SHELL])
    for r in (whole, streamed):
        (item,) = r.output
        assert r.status == "completed"
        if kind == "function":
            assert item.type == "function_call" and item.name == "get_weather"
            assert json.loads(item.arguments) == {"city": "Paris"} and item.namespace is None
        elif kind == "namespace":
            assert item.type == "function_call" and (item.name, item.namespace) == ("lookup", "crm")
            assert json.loads(item.arguments) == {"email": "a@b.c"}
        elif kind == "custom":
            assert item.type == "custom_tool_call" and item.name == "apply_patch"
            assert item.input == "*** Begin Patch\n*** End Patch"
        else:
            assert item.type == "local_shell_call" and item.action.command == ["ls", "-la"]
            assert item.action.working_directory == "/tmp" and item.call_id.startswith("call_")
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 1
    if kind in ("function", "namespace"):
        deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
        assert "".join(deltas) == streamed.output[0].arguments and "response.function_call_arguments.done" in kinds
        assert len(deltas) > 3  # as the scripted model writes them, a token at a time
    elif kind == "custom":
        deltas = [e.delta for e in events if e.type == "response.custom_tool_call_input.delta"]
        done = [e for e in events if e.type == "response.custom_tool_call_input.done"]
        assert "".join(deltas) == done[0].input == streamed.output[0].input
        assert len(deltas) > 3 and all(deltas)


def test_a_custom_call_whose_arguments_do_not_begin_with_its_input_gives_it_at_the_end(client, scripted):
    scripted.engine.script = ('<tool_call>\n{"name": "apply_patch", "arguments": {"note": "x", "input": "*** Begin '
                              'Patch\\n*** End Patch"}}\n</tool_call>')
    whole, events, streamed = both(client, model="scripted", input="Go.", tools=[CUSTOM])
    deltas = [e.delta for e in events if e.type == "response.custom_tool_call_input.delta"]
    assert deltas == [whole.output[0].input] == [streamed.output[0].input] == ["*** Begin Patch\n*** End Patch"]


def test_the_model_sees_each_tool_as_a_function(client, scripted, monkeypatch):
    tok = scripted.engine.tokenizer
    listing = "{% for t in tools or [] %}TOOL {{ t.function.name }}: {{ t.function.description }}\n{% endfor %}"
    monkeypatch.setattr(tok, "chat_template", listing + tok.chat_template)
    scripted.engine.script = "ok"
    client.responses.create(model="scripted", input="Go.",
                            tools=[FUNCTION, NAMESPACE, CUSTOM, SHELL, {"type": "web_search"}])
    prompt = prompt_text(scripted)
    names = [line.split(":")[0][5:] for line in prompt.splitlines() if line.startswith("TOOL ")]
    assert names == ["get_weather", "crm__lookup", "apply_patch", "local_shell"]
    assert "The customer database." in prompt and "*** Begin Patch" in prompt  # namespace note, lark grammar


def test_custom_regex_format_constrains_a_forced_call(scripted, client):
    tool = {"type": "custom", "name": "pick", "format": {"type": "grammar", "syntax": "regex",
                                                          "definition": "(yes|no)"}}
    scripted.engine.script = call_text("pick", {"input": "yes"})
    r = client.responses.create(model="scripted", input="?", tools=[tool],
                                tool_choice={"type": "custom", "name": "pick"})
    assert r.output[0].type == "custom_tool_call" and r.output[0].input == "yes"
    constraint = scripted.engine.params[-1].constraint
    assert constraint is not None and "pick" in constraint.description


def test_every_input_item_kind_reaches_the_prompt(client, scripted):
    scripted.engine.script = "All done."
    r = client.responses.create(model="scripted", tools=[FUNCTION, NAMESPACE, CUSTOM, SHELL], input=[
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Start."}]},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "Thinking it over."}],
         "encrypted_content": "opaque"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "snow, -3 C"},
        {"type": "function_call", "call_id": "c2", "name": "lookup", "namespace": "crm",
         "arguments": '{"email": "a@b.c"}'},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "Ann"}]},
        {"type": "custom_tool_call", "call_id": "c3", "name": "apply_patch", "input": "*** Begin Patch PATCHBODY"},
        {"type": "custom_tool_call_output", "call_id": "c3", "output": "patched ok"},
        {"type": "local_shell_call", "id": "lsh_1", "call_id": "c4", "status": "completed",
         "action": {"type": "exec", "command": ["pwd"], "env": {}}},
        {"type": "local_shell_call_output", "id": "c4", "output": "/home/me"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Earlier answer."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Finish."}]}],
        **CODEX_FIELDS)
    assert r.output_text == "All done."
    prompt = prompt_text(scripted)
    for text in ("Start.", "snow, -3 C", "Ann", "patched ok", "/home/me", "Earlier answer.", "Finish."):
        assert text in prompt, text


def test_reasoning_item_streams_reasoning_text(client, scripted, monkeypatch):
    tok = scripted.engine.tokenizer
    monkeypatch.setattr(tok, "chat_template", tok.chat_template + "{# <think> #}")
    scripted.engine.script = "<think>\nCheck the sky.\n</think>\n\nSunny."
    whole, events, streamed = both(client, model="scripted", input="Weather?")
    for r in (whole, streamed):
        assert [o.type for o in r.output] == ["reasoning", "message"] and r.output_text == "Sunny."
        assert r.output[0].content[0].text == "Check the sky."
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == "Check the sky." and any(e.type == "response.reasoning_text.done" for e in events)
    # with reasoning.summary (as Codex asks), the reasoning comes as the summary
    whole, events, streamed = both(client, model="scripted", input="Weather?", reasoning={"summary": "auto"})
    for r in (whole, streamed):
        assert r.output[0].summary[0].text == "Check the sky." and not r.output[0].content
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_summary_text.delta")
    kinds = [e.type for e in events]
    assert deltas == "Check the sky." and "response.reasoning_text.delta" not in kinds
    assert kinds.index("response.reasoning_summary_part.added") < kinds.index("response.reasoning_summary_part.done")


def test_a_cut_call_stays_a_call_and_the_response_is_incomplete(client, scripted):
    scripted.engine.script = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "cel'
    n = len(scripted.engine.tokenizer.encode(scripted.engine.script))
    whole, _, streamed = both(client, model="scripted", input="?", tools=[FUNCTION], max_output_tokens=n)
    for r in (whole, streamed):
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        (item,) = r.output
        assert item.type == "function_call" and json.loads(item.arguments)["city"] == "Paris"


def test_routes_without_the_v1_prefix(scripted):
    scripted.engine.script = "Hi."
    bare = openai.OpenAI(base_url=scripted.base_url, api_key="unused", max_retries=0)
    assert bare.responses.create(model="scripted", input="Hello").output_text == "Hi."
    chat = bare.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "Hello"}])
    assert chat.choices[0].message.content == "Hi."
    assert [m.id for m in bare.models.list().data] == ["scripted"]


def test_models_say_what_the_model_can_do(scripted):
    with httpx.Client(base_url=scripted.base_url) as c:
        (card,) = c.get("/v1/models").json()["data"]
    assert card["context_window"] == card["max_output_tokens"] == 2048
    template = scripted.engine.tokenizer.chat_template
    assert card["capabilities"] == {"chat": True, "tools": "tools" in template, "reasoning": "<think>" in template,
                                    "vision": False, "structured_output": True}


def test_unknown_items_and_bad_efforts_are_clear_400s(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="scripted", input=[{"type": "item_reference", "id": "x"}])
    assert e.value.body["param"] == "input[0].type" and "local_shell_call" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="scripted", input="x", reasoning={"effort": "extreme"})
    assert e.value.body["param"] == "reasoning.effort"


def test_malformed_tools_and_calls_are_400s_not_crashes(scripted):
    with httpx.Client(base_url=scripted.base_url, timeout=30) as c:
        for body, param in [
            ({"tools": [{"type": "function", "name": ["x"]}]}, "tools[0].name"),
            ({"tools": [{"type": "namespace", "name": "ns", "tools": [{"type": "function", "name": 3}]}]},
             "tools[0].tools[0].name"),
            ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "namespace": 5, "arguments": "{}"}]},
             "input"),
        ]:
            r = c.post("/v1/responses", json={"model": "scripted", "input": "x", **body})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_forcing_a_custom_tool_with_a_lark_grammar_is_a_clear_400(client, scripted):
    """A forced call's input cannot be held to a lark grammar: refused, never a call that may break the grammar."""
    scripted.engine.prompts.clear()
    for choice, tools in (({"type": "custom", "name": "apply_patch"}, [CUSTOM]),
                          ({"type": "custom", "name": "apply_patch", "namespace": "fs"},
                           [{"type": "namespace", "name": "fs", "tools": [CUSTOM]}])):
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model="scripted", input="Patch it.", tools=tools, tool_choice=choice)
        assert e.value.body["param"] == "tool_choice"
        assert "lark grammar" in e.value.body["message"] and "regex" in e.value.body["message"]
    assert not scripted.engine.prompts
    scripted.engine.script = "Done."
    assert client.responses.create(model="scripted", input="Patch it.", tools=[CUSTOM],
                                   tool_choice="auto").status == "completed"  # offered, the grammar shown
