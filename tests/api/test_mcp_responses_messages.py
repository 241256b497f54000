"""Server-side MCP tools on the Responses API (OpenAI's hosted `mcp` tool) and the Messages API (Anthropic's MCP
connector), and streamed on all three APIs: the SDK test server of tests/app/mcp_server.py runs the calls of a
scripted model (tests/api/scripted.py), so what reaches its next prompt is checked exactly; the answers are read
with the official SDKs' own types. The slow tests let the real default model make a forced call."""
from __future__ import annotations

import json

import httpx
import pytest
from openai.types.responses import Response
from openai.types.responses.response_output_item import McpCall, McpListTools

from engine.config.loading import load_settings
from engine.server.state import ServerState
from tests.api.conftest import RunningServer
from tests.api.test_mcp_server_side import call_text, mcp_json, serve  # noqa: F401  (serve: a fixture)

QUESTION = "What is 2 + 3? Use the tool."
RESPONSES_MCP = {"type": "mcp", "server_label": "calc", "require_approval": "never"}
MCP_SERVERS = [{"type": "url", "name": "calc", "url": "https://calc.example.com/mcp"}]
TOOLSET = {"type": "mcp_toolset", "mcp_server_name": "calc"}
ASK = [{"role": "user", "content": QUESTION}]


def post(url: str, path: str, **body) -> httpx.Response:
    return httpx.post(url + path, timeout=120, json={"model": "scripted", **body})


def events(r: httpx.Response) -> list[tuple[str, dict]]:
    out = []
    for block in r.text.strip().split("\n\n"):
        lines = block.split("\n")
        if lines[0].startswith("event: "):
            out.append((lines[0][7:], json.loads(lines[1][6:])))
    return out


def prompts(engine) -> list[str]:
    return [engine.tokenizer.decode(p) for p in engine.prompts]


def test_responses_mcp_call_runs_and_its_items_are_the_sdk_types(serve, tmp_path):
    url, engine = serve([call_text("calc__add", {"a": 2, "b": 3}), "The sum is 5."],
                        ["--mcp-config", str(mcp_json(tmp_path))])
    r = post(url, "/v1/responses", input=QUESTION, tools=[RESPONSES_MCP])
    assert r.status_code == 200, r.text
    response = Response.model_validate(r.json())
    listing, call, message = response.output
    assert isinstance(listing, McpListTools) and listing.server_label == "calc"
    assert {t.name for t in listing.tools} == {"add", "slow"}
    assert listing.tools[0].input_schema["type"] == "object"
    assert isinstance(call, McpCall)
    assert (call.server_label, call.name, json.loads(call.arguments), call.output, call.error) == \
        ("calc", "add", {"a": 2, "b": 3}, "5", None)
    assert message.type == "message" and response.output_text == "The sum is 5."
    first, second = prompts(engine)
    assert "5" not in first and "tool\n5\n" in second, second  # the output reached the next round
    assert response.usage.input_tokens == len(engine.prompts[0]) + len(engine.prompts[1])


def test_responses_mcp_through_the_openai_client_streamed(serve, tmp_path):
    import openai

    url, engine = serve([call_text("calc__add", {"a": 2, "b": 3}), "The sum is 5."],
                        ["--mcp-config", str(mcp_json(tmp_path))])
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    with client.responses.stream(model="scripted", input=QUESTION, tools=[RESPONSES_MCP]) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[-1] == "response.completed"
    assert [type(i) for i in final.output[:2]] == [McpListTools, McpCall] and final.output[2].type == "message"
    assert final.output[1].output == "5" and final.output_text == "The sum is 5."


def test_responses_mcp_items_sent_back_are_read_as_the_call_and_its_output(serve, tmp_path):
    url, engine = serve([call_text("calc__add", {"a": 2, "b": 3}), "The sum is 5.", "It was 5."],
                        ["--mcp-config", str(mcp_json(tmp_path))])
    first = post(url, "/v1/responses", input=QUESTION, tools=[RESPONSES_MCP]).json()
    again = [{"role": "user", "content": QUESTION}, *first["output"], {"role": "user", "content": "And again?"}]
    r = post(url, "/v1/responses", input=again, tools=[RESPONSES_MCP])
    assert r.status_code == 200, r.text
    third = prompts(engine)[2]
    assert "tool\n5\n" in third and third.index("tool\n5\n") < third.index("And again?"), third


def test_an_engine_failure_in_a_later_round_fails_the_answer(serve, tmp_path):
    url, engine = serve([call_text("calc__add", {"a": 2, "b": 3}), "The sum is 5."],
                        ["--mcp-config", str(mcp_json(tmp_path))])
    real_submit = engine.submit

    def fail_second(prompt, params, request_id=None, loop=None):
        engine.fail_after = 2 if engine.prompts else None
        return real_submit(prompt, params, request_id, loop)

    engine.submit = fail_second
    r = post(url, "/v1/responses", input=QUESTION, tools=[RESPONSES_MCP])
    assert r.status_code == 500 and "engine" in r.json()["error"]["message"], r.text
    engine.prompts.clear()
    got = events(post(url, "/v1/responses", input=QUESTION, tools=[RESPONSES_MCP], stream=True))
    kinds = [k for k, _ in got]
    assert kinds[-1] == "response.failed" and kinds.count("error") == 1
    assert got[-1][1]["response"]["output"][1]["type"] == "mcp_call"  # what ran before the failure
    engine.prompts.clear()
    got = events(post(url, "/v1/messages", messages=ASK, max_tokens=64, mcp_servers=MCP_SERVERS, stream=True))
    assert got[-1][0] == "error" and "message_stop" not in [k for k, _ in got]


def test_a_later_round_the_engine_refuses_ends_each_stream_with_an_error(serve, tmp_path):
    from engine.engine import ContextLengthError

    url, engine = serve([call_text("calc__add", {"a": 2, "b": 3}), "x"], ["--mcp-config", str(mcp_json(tmp_path))])
    full = ContextLengthError(3000, 2048, "the context")
    engine.refuse = (1, full)  # the first round runs; the second, with the call's result, does not fit
    got = events(post(url, "/v1/responses", input=QUESTION, tools=[RESPONSES_MCP], stream=True))
    assert [k for k, _ in got][-2:] == ["error", "response.failed"] and got[-2][1]["code"] == "context_length_exceeded"
    assert got[-1][1]["response"]["output"][1]["type"] == "mcp_call"
    engine.prompts.clear()
    got = events(post(url, "/v1/messages", messages=ASK, max_tokens=64, mcp_servers=MCP_SERVERS, stream=True))
    assert got[-1][0] == "error" and "context" in got[-1][1]["error"]["message"]
    engine.prompts.clear()
    r = httpx.post(url + "/v1/chat/completions", timeout=120, json={"model": "scripted", "messages": ASK,
                                                                    "tools": [RESPONSES_MCP], "stream": True})
    lines = [line[6:] for line in r.text.split("\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]" and json.loads(lines[-2])["error"]["code"] == "context_length_exceeded"
    engine.prompts.clear()
    r = post(url, "/v1/messages", messages=ASK, max_tokens=64, mcp_servers=MCP_SERVERS)
    assert r.status_code == 400 and "context" in r.json()["error"]["message"]


def test_a_first_round_that_cannot_start_is_a_status_code_even_streamed(serve, tmp_path):
    url, _ = serve(["x"], ["--mcp-config", str(mcp_json(tmp_path))])
    r = post(url, "/v1/responses", input=[{"type": "bogus"}], tools=[RESPONSES_MCP], stream=True)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[0].type"
    r = post(url, "/v1/messages", messages=ASK, mcp_servers=MCP_SERVERS, stream=True)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("max_tokens")


def test_responses_mcp_a_failing_call_is_an_error_item_the_model_reads(serve, tmp_path):
    url, engine = serve([call_text("calc__add", {"a": "two", "b": 3}), "Sorry."],
                        ["--mcp-config", str(mcp_json(tmp_path))])
    response = Response.model_validate(post(url, "/v1/responses", input=QUESTION, tools=[RESPONSES_MCP]).json())
    call = response.output[1]
    assert isinstance(call, McpCall) and call.status == "failed"
    assert call.error.type == "mcp_tool_execution_error" and "valid integer" in call.output
    assert "valid integer" in prompts(engine)[1]


def test_other_hosted_tools_next_to_mcp_are_still_left_out_and_named(serve, tmp_path):
    url, _ = serve(["Hi."], ["--mcp-config", str(mcp_json(tmp_path))])
    r = post(url, "/v1/responses", input=QUESTION, tools=[RESPONSES_MCP, {"type": "web_search"}])
    assert r.json()["omitted_tools"] == ["web_search"] and r.headers["X-NInfer-Omitted-Tools"] == "web_search"
    r = post(url, "/v1/messages", messages=ASK, max_tokens=8, mcp_servers=MCP_SERVERS,
             tools=[{"type": "web_search_20250305", "name": "web_search"}])
    assert r.status_code == 200 and r.headers["X-NInfer-Omitted-Tools"] == "web_search"


def test_responses_mcp_allowed_tools_leave_the_others_unrun(serve, tmp_path):
    url, engine = serve([call_text("calc__slow", {"seconds": 0}), "x"], ["--mcp-config", str(mcp_json(tmp_path))])
    r = post(url, "/v1/responses", input=QUESTION, tools=[dict(RESPONSES_MCP, allowed_tools=["add"])])
    response = Response.model_validate(r.json())
    assert response.output[0].type == "mcp_list_tools"
    assert not [i for i in response.output if i.type == "mcp_call"] and len(engine.prompts) == 1


def test_responses_mcp_refusals(serve, tmp_path):
    url, engine = serve(["Hi."], [])  # no --mcp-config: a hosted mcp tool is left out, as before
    r = post(url, "/v1/responses", input=QUESTION, tools=[RESPONSES_MCP])
    assert r.status_code == 200 and r.json()["omitted_tools"] == ["mcp"] and len(engine.prompts) == 1
    url, _ = serve(["x"], ["--mcp-config", str(mcp_json(tmp_path))])
    for tool, needle in ((dict(RESPONSES_MCP, server_label="nope"), "'calc'"),
                         (dict(RESPONSES_MCP, require_approval="always"), "require_approval"),
                         (dict(RESPONSES_MCP, server_url="https://mcp.example.com/mcp"), "server_url")):
        r = post(url, "/v1/responses", input=QUESTION, tools=[tool])
        assert r.status_code == 400, (tool, r.text)
        assert needle in r.json()["error"]["message"] and r.json()["error"]["param"] == "tools"


def test_responses_mcp_streams_the_items_then_the_message(serve, tmp_path):
    url, engine = serve([call_text("calc__add", {"a": 2, "b": 3}), "The sum is 5."],
                        ["--mcp-config", str(mcp_json(tmp_path))])
    r = post(url, "/v1/responses", input=QUESTION, tools=[RESPONSES_MCP], stream=True)
    got = events(r)
    assert [b["sequence_number"] for _, b in got] == list(range(len(got)))
    items = [(k, b["output_index"], b["item"]["type"]) for k, b in got if k.startswith("response.output_item")]
    assert items == [("response.output_item.added", 0, "mcp_list_tools"), ("response.output_item.done", 0,
                      "mcp_list_tools"), ("response.output_item.added", 1, "mcp_call"),
                     ("response.output_item.done", 1, "mcp_call"), ("response.output_item.added", 2, "message"),
                     ("response.output_item.done", 2, "message")]
    kinds = [k for k, _ in got]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.delta" not in kinds  # the call ran here: no function call shown
    text = "".join(b["delta"] for k, b in got if k == "response.output_text.delta")
    assert text == "The sum is 5."
    final = Response.model_validate(got[-1][1]["response"])
    assert [i.type for i in final.output] == ["mcp_list_tools", "mcp_call", "message"]
    assert final.output[1].output == "5"



def test_messages_mcp_call_runs_as_mcp_blocks_of_the_sdk(serve, tmp_path):
    from anthropic.types.beta import BetaMCPToolResultBlock, BetaMCPToolUseBlock, BetaMessage, BetaTextBlock

    url, engine = serve([call_text("calc__add", {"a": 2, "b": 3}), "The sum is 5."],
                        ["--mcp-config", str(mcp_json(tmp_path))])
    r = post(url, "/v1/messages", messages=ASK, max_tokens=64, mcp_servers=MCP_SERVERS, tools=[TOOLSET])
    assert r.status_code == 200, r.text
    message = BetaMessage.model_validate(r.json())
    use, result, text = message.content
    assert isinstance(use, BetaMCPToolUseBlock) and (use.name, use.server_name, use.input) == \
        ("add", "calc", {"a": 2, "b": 3})
    assert isinstance(result, BetaMCPToolResultBlock) and result.tool_use_id == use.id and not result.is_error
    assert [b.text for b in result.content] == ["5"]
    assert isinstance(text, BetaTextBlock) and text.text == "The sum is 5." and message.stop_reason == "end_turn"
    first, second = prompts(engine)
    assert "5" not in first and "tool\n5\n" in second, second
    assert message.usage.input_tokens == len(engine.prompts[0]) + len(engine.prompts[1])


def test_messages_mcp_through_the_anthropic_beta_client(serve, tmp_path):
    import anthropic
    from anthropic.types.beta import BetaMCPToolResultBlock, BetaMCPToolUseBlock

    url, engine = serve([call_text("calc__add", {"a": 2, "b": 3}), "The sum is 5."],
                        ["--mcp-config", str(mcp_json(tmp_path))])
    client = anthropic.Anthropic(base_url=url, api_key="none")
    with client.beta.messages.stream(model="scripted", max_tokens=64, messages=ASK, mcp_servers=MCP_SERVERS,
                                     tools=[TOOLSET], betas=["mcp-client-2025-11-20"]) as stream:
        message = stream.get_final_message()
    use, result, text = message.content
    assert isinstance(use, BetaMCPToolUseBlock) and use.input == {"a": 2, "b": 3}
    assert isinstance(result, BetaMCPToolResultBlock) and result.content[0].text == "5"
    assert text.text == "The sum is 5."


def test_messages_mcp_toolsets_and_tool_configuration_narrow_the_tools(serve, tmp_path):
    flags = ["--mcp-config", str(mcp_json(tmp_path))]
    off = dict(TOOLSET, default_config={"enabled": False}, configs={"slow": {"enabled": True}})
    older = [dict(MCP_SERVERS[0], tool_configuration={"allowed_tools": ["slow"]})]
    for extra in ({"tools": [off], "mcp_servers": MCP_SERVERS}, {"mcp_servers": older}):
        url, engine = serve([call_text("calc__add", {"a": 1, "b": 1}), "x"], flags)
        body = post(url, "/v1/messages", messages=ASK, max_tokens=64, **extra).json()
        assert not [b for b in body["content"] if b["type"].startswith("mcp_")], body  # add is not offered
        assert len(engine.prompts) == 1
    url, engine = serve([call_text("calc__add", {"a": 1, "b": 1}), "x"], flags)  # the older beta, all tools
    body = post(url, "/v1/messages", messages=ASK, max_tokens=64, mcp_servers=MCP_SERVERS).json()
    assert [b["type"] for b in body["content"]] == ["mcp_tool_use", "mcp_tool_result", "text"]


def test_messages_mcp_refusals(serve, tmp_path):
    url, _ = serve(["x"], [])
    r = post(url, "/v1/messages", messages=ASK, max_tokens=8, mcp_servers=MCP_SERVERS)
    assert r.status_code == 400 and "--mcp-config" in r.json()["error"]["message"]
    assert r.json()["type"] == "error"  # Anthropic's error shape
    url, _ = serve(["x"], ["--mcp-config", str(mcp_json(tmp_path))])
    r = post(url, "/v1/messages", messages=ASK, max_tokens=8, mcp_servers=[dict(MCP_SERVERS[0], name="web")])
    assert r.status_code == 400 and "'calc'" in r.json()["error"]["message"]
    r = post(url, "/v1/messages", messages=ASK, max_tokens=8, mcp_servers=MCP_SERVERS,
             tools=[dict(TOOLSET, mcp_server_name="web")])
    assert r.status_code == 400 and "mcp_server_name" in r.json()["error"]["message"]


def test_messages_mcp_streams_the_mcp_blocks_then_the_text(serve, tmp_path):
    from anthropic.types.beta import BetaRawMessageStreamEvent
    from pydantic import TypeAdapter

    url, engine = serve([call_text("calc__add", {"a": 2, "b": 3}), "The sum is 5."],
                        ["--mcp-config", str(mcp_json(tmp_path))])
    r = post(url, "/v1/messages", messages=ASK, max_tokens=64, mcp_servers=MCP_SERVERS, tools=[TOOLSET], stream=True)
    got = events(r)
    adapter = TypeAdapter(BetaRawMessageStreamEvent)
    for _, body in got:
        if body["type"] != "ping":
            adapter.validate_python(body)
    kinds = [k for k, _ in got]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == ["message_delta", "message_stop"]
    starts = [(b["index"], b["content_block"]["type"]) for k, b in got if k == "content_block_start"]
    assert starts == [(0, "mcp_tool_use"), (1, "mcp_tool_result"), (2, "text")]
    assert [b["index"] for k, b in got if k == "content_block_stop"] == [0, 1, 2]
    assert not [b for k, b in got if k == "content_block_start" and b["content_block"]["type"] == "tool_use"]
    text = "".join(b["delta"]["text"] for k, b in got if k == "content_block_delta" and b["index"] == 2)
    assert text == "The sum is 5."
    arguments = "".join(b["delta"]["partial_json"] for k, b in got if k == "content_block_delta" and b["index"] == 0)
    assert json.loads(arguments) == {"a": 2, "b": 3}
    assert got[-2][1]["usage"]["input_tokens"] == len(engine.prompts[0]) + len(engine.prompts[1])


@pytest.fixture
def real_server(default_engine, tmp_path):
    settings, _ = load_settings(["--mcp-config", str(mcp_json(tmp_path))], {})
    state = ServerState(settings, ["smol"])
    state.loaded = default_engine
    with RunningServer(state) as running:
        yield running.base_url
    state.mcp.close()


@pytest.mark.slow
def test_the_default_model_makes_a_forced_call_through_the_responses_api(real_server):
    r = httpx.post(real_server + "/v1/responses", timeout=300, json={
        "model": "smol", "input": QUESTION, "tools": [RESPONSES_MCP], "temperature": 0, "max_output_tokens": 48,
        "tool_choice": {"type": "mcp", "server_label": "calc", "name": "add"}})
    assert r.status_code == 200, r.text
    response = Response.model_validate(r.json())
    calls = [i for i in response.output if isinstance(i, McpCall)]
    assert calls and calls[0].name == "add" and calls[0].error is None, response.output
    arguments = json.loads(calls[0].arguments)
    assert calls[0].output == str(arguments["a"] + arguments["b"])  # schema-valid arguments; the tool added them
    assert response.output[-1].type == "message"


@pytest.mark.slow
def test_the_default_model_makes_a_forced_call_through_the_messages_api_streamed(real_server):
    r = httpx.post(real_server + "/v1/messages", timeout=300, json={
        "model": "smol", "messages": ASK, "max_tokens": 48, "temperature": 0, "stream": True,
        "mcp_servers": MCP_SERVERS, "tools": [TOOLSET], "tool_choice": {"type": "tool", "name": "calc__add"}})
    assert r.status_code == 200, r.text
    got = events(r)
    blocks = [b["content_block"] for k, b in got if k == "content_block_start"]
    use, result = blocks[0], blocks[1]
    assert (use["type"], use["name"], result["type"], result["is_error"]) == \
        ("mcp_tool_use", "add", "mcp_tool_result", False), blocks
    arguments = json.loads("".join(b["delta"]["partial_json"] for k, b in got
                                   if k == "content_block_delta" and b["index"] == 0))
    assert result["content"][0]["text"] == str(arguments["a"] + arguments["b"])
    assert [k for k, _ in got][-1] == "message_stop"
