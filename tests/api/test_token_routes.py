"""The routes agents read that generate nothing, and the prefix-cache count in chat usage: cached_tokens against the
engine's own count on the default model; input token counts, /tokenize, /detokenize and /apply-template against
what the generation routes see (scripted model, the default model's tokenizer), in their references' shapes
(OpenAI's, through the openai SDK where it has the call; llama-server's for the others)."""
import httpx
import openai
import pytest

from tests.api.conftest import wait_idle
from tests.api.test_security import KEY, serving

MODEL = "smollm2-135m-instruct"
HELLO = [{"role": "user", "content": "Hello there."}]
CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                            "parameters": CITY}}
NEW_ROUTES = ("/v1/responses/input_tokens", "/v1/chat/completions/input_tokens", "/tokenize", "/detokenize",
              "/apply-template")


@pytest.fixture
def http(scripted):
    scripted.engine.script, scripted.engine.fail_after = "Hello!", None
    with httpx.Client(base_url=scripted.base_url, timeout=30) as c:
        yield c


@pytest.fixture
def sdk(scripted):
    scripted.engine.script, scripted.engine.fail_after = "Hello!", None  # an empty script would never end
    return openai.OpenAI(base_url=scripted.base_url + "/v1", api_key="unused", max_retries=0)


def ok(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


# ---------------------------------------------------------------- cached_tokens (the real engine)

def _long_question(tag: str) -> list[dict]:
    facts = " ".join(f"Fact {i}: the {tag} number {i} is {i * 7}." for i in range(40))  # ~500 tokens
    return [{"role": "user", "content": facts + " Which number is fact 3?"}]


def test_cached_tokens_equal_the_engines_reused_tokens_on_a_resent_prompt(server, default_engine):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    engine = default_engine.engine
    question = _long_question("plain")
    first = client.chat.completions.create(model=MODEL, messages=question, temperature=0, max_tokens=2)
    before = wait_idle(engine)["prefix_hit_tokens"]
    again = client.chat.completions.create(model=MODEL, messages=question, temperature=0, max_tokens=2)
    reused = wait_idle(engine)["prefix_hit_tokens"] - before
    assert first.usage.prompt_tokens == again.usage.prompt_tokens
    assert 0 < reused < again.usage.prompt_tokens  # the last prompt token is always computed
    assert again.usage.prompt_tokens_details.cached_tokens == reused


def test_streamed_usage_reports_the_cached_tokens_too(server, default_engine):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    engine = default_engine.engine
    question = _long_question("streamed")
    client.chat.completions.create(model=MODEL, messages=question, temperature=0, max_tokens=2)
    before = wait_idle(engine)["prefix_hit_tokens"]
    chunks = list(client.chat.completions.create(model=MODEL, messages=question, temperature=0, max_tokens=2,
                                                 stream=True, stream_options={"include_usage": True}))
    reused = wait_idle(engine)["prefix_hit_tokens"] - before
    assert chunks[-1].choices == [] and reused > 0
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == reused


def test_a_prompt_counts_once_with_what_every_one_of_its_choices_reused():
    from engine.server.generation import usage_dict

    usage = usage_dict(30, {0: 2, 1: 2, 2: 2, 3: 2}, cached={0: 0, 1: 16, 2: 12, 3: 12}, per_prompt=2)
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0 + 12}  # two prompts x n=2
    assert "prompt_tokens_details" not in usage_dict(30, {0: 2})


def test_a_prompt_seen_for_the_first_time_has_no_cached_tokens(sdk, scripted):
    r = sdk.chat.completions.create(model="scripted", messages=HELLO)
    assert r.usage.prompt_tokens_details.cached_tokens == 0  # the scripted engine reuses nothing


# ---------------------------------------------------------------- input token counts

def test_responses_input_tokens_is_the_prompt_the_responses_route_counts(sdk, scripted):
    body = dict(instructions="Be brief.", tools=[{"type": "function", "name": "get_weather",
                                                  "parameters": {"type": "object", "properties": {}}}],
                input=[{"type": "message", "role": "user", "content": "Weather in Oslo?"}])
    count = sdk.responses.input_tokens.count(model="scripted", **body)
    assert count.object == "response.input_tokens"
    answer = sdk.responses.create(model="scripted", **body)
    assert count.input_tokens == answer.usage.input_tokens == len(scripted.engine.prompts[-1])
    assert sdk.responses.input_tokens.count(input="Hi").input_tokens > 0  # model and instructions optional


def test_chat_input_tokens_is_the_prompt_the_chat_route_counts(http, sdk, scripted):
    body = {"model": "scripted", "messages": HELLO, "tools": [WEATHER]}
    count = ok(http.post("/v1/chat/completions/input_tokens", json=body))
    assert set(count) == {"object", "input_tokens"} and count["object"] == "response.input_tokens"
    answer = sdk.chat.completions.create(**body)
    assert count["input_tokens"] == answer.usage.prompt_tokens == len(scripted.engine.prompts[-1])
    assert ok(http.post("/chat/completions/input_tokens", json=body)) == count  # also without /v1


def test_counting_generates_nothing_and_refusals_have_the_api_shape(http, scripted):
    submitted = len(scripted.engine.prompts)
    ok(http.post("/v1/chat/completions/input_tokens", json={"messages": HELLO}))
    ok(http.post("/v1/responses/input_tokens", json={"input": "Hi"}))
    assert len(scripted.engine.prompts) == submitted
    r = http.post("/v1/responses/input_tokens", json={"model": "gpt-none", "input": "Hi"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = http.post("/v1/responses/input_tokens", json={"input": "Hi", "previous_response_id": "resp_1"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"
    r = http.post("/v1/chat/completions/input_tokens", json={"messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


# ---------------------------------------------------------------- /tokenize, /detokenize, /apply-template

def test_tokenize_and_detokenize_round_trip(http, scripted):
    tok = scripted.engine.tokenizer
    text = "What is the capital of France? <|im_end|>"
    tokens = ok(http.post("/tokenize", json={"content": text}))
    assert set(tokens) == {"tokens"} and tokens["tokens"] == tok.encode(text)
    assert ok(http.post("/detokenize", json={"tokens": tokens["tokens"]})) == {"content": text}
    plain = ok(http.post("/tokenize", json={"content": text, "parse_special": False}))["tokens"]
    assert tok.token_to_id("<|im_end|>") in tokens["tokens"] and tok.token_to_id("<|im_end|>") not in plain
    assert ok(http.post("/detokenize", json={"tokens": plain}))["content"] == text
    with_bos = ok(http.post("/tokenize", json={"content": "Hi", "add_special": True}))["tokens"]
    assert with_bos == tok.encode("Hi", add_special_tokens=True)


def test_tokenize_with_pieces_gives_text_or_bytes(http, scripted):
    text = "Hello \u00e1 \U0001F917"
    pieces = ok(http.post("/tokenize", json={"content": text, "with_pieces": True}))["tokens"]
    assert [p["id"] for p in pieces] == scripted.engine.tokenizer.encode(text)
    assert pieces[0] == {"id": pieces[0]["id"], "piece": "Hello"}
    assert any(isinstance(p["piece"], list) for p in pieces)  # the emoji's bytes are split over tokens
    whole = b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"]) for p in pieces)
    assert whole.decode("utf-8") == text


def test_token_routes_refuse_in_the_api_shape(http):
    for path, body, param in (("/detokenize", {"tokens": [10**9]}, "tokens"),
                              ("/detokenize", {"tokens": ["a"]}, "tokens"), ("/tokenize", {}, "content"),
                              ("/tokenize", {"content": "x", "with_pieces": "yes"}, "with_pieces"),
                              ("/apply-template", {"messages": "Hi"}, "messages")):
        r = http.post(path, json=body)
        assert r.status_code == 400, (path, r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"} and r.json()["error"]["param"] == param
    r = http.post("/tokenize", json={"content": "x", "model": "gpt-none"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_apply_template_is_the_prompt_the_chat_route_renders(http, sdk, scripted):
    tok = scripted.engine.tokenizer
    messages = [{"role": "system", "content": "Be brief."}, *HELLO,
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    prompt = ok(http.post("/apply-template", json={"messages": messages, "tools": [WEATHER]}))
    assert set(prompt) == {"prompt"} and prompt["prompt"].startswith("<|im_start|>system\nBe brief.")
    sdk.chat.completions.create(model="scripted", messages=messages, tools=[WEATHER])
    assert tok.encode(prompt["prompt"]) == scripted.engine.prompts[-1]


# ---------------------------------------------------------------- the app-wide checks apply

def test_the_new_routes_need_the_key_when_one_is_set():
    with serving(api_key=KEY, max_body_mib=1) as (_, client):  # no model: refused before any route runs
        for path in NEW_ROUTES:
            r = client.post(path, json={"content": "x"})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, r.text)
            r = client.post(path, json={"content": "x"}, headers={"Authorization": f"Bearer {KEY}"})
            assert r.status_code in (400, 503), (path, r.text)  # past the key: the body, then "still loading"
            r = client.post(path, content=b"x" * (2 << 20), headers={"X-Api-Key": KEY})
            assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", path
        r = client.post("/tokenize", json={"content": "x"}, headers={"X-Api-Key": KEY, "Host": "evil.test"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed"
