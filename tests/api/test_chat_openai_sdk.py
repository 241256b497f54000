"""The official openai SDK against ninfer-serve's app on a free loopback port, with the embedded default model."""
import asyncio

import openai
import pytest

from tests.api.conftest import wait_idle

MODEL = "smollm2-135m-instruct"
FRANCE = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def test_models_lists_served_ids_and_context(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL, "smol"]
    assert models[0].model_extra["context_window"] == 2048
    # what each GGUF type of the file (210 Q4_1 linear weights, 61 F32 norms, the Q8_0 embedding) became: the
    # embedding keeps its 8-bit codes (decoded per looked-up row; the tied output layer computes float32 logits)
    assert models[0].model_extra["weight_storage"] == "210 x Q4_1 -> int4, 61 x F32, 1 x Q8_0 -> int8"


def test_chat_non_stream_answers_paris_with_usage(client):
    r = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=40)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_alias_serves_the_same_model(client):
    r = client.chat.completions.create(model="smol", messages=FRANCE, temperature=0, max_tokens=40)
    assert "Paris" in r.choices[0].message.content


def test_stream_matches_non_stream_and_reports_usage(client, server):
    whole = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=40)
    chunks = list(client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=40,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_max_tokens_ends_with_length(client):
    r = client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=3, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3


def test_stop_string_is_not_emitted(client):
    full = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=40)
    content = full.choices[0].message.content
    cut = content.index("Paris")
    r = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=40, stop=["Paris"])
    assert r.choices[0].message.content == content[:cut]
    assert r.choices[0].finish_reason == "stop"
    chunks = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=40,
                                            stop="Paris", stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == content[:cut]


def test_seed_reproduces_sampled_output(client):
    def run(seed):
        return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell a story."}],
                                              temperature=1.0, top_p=1.0, seed=seed, max_tokens=24
                                              ).choices[0].message.content
    assert run(7) == run(7)
    assert len({run(s) for s in (1, 2, 3)}) > 1


def test_logprobs_are_returned(client):
    r = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=5, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)  # greedy: chosen = best
        assert entry.logprob <= 0


def test_unknown_model_is_404_naming_served_ids(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=FRANCE)
    assert e.value.body["code"] == "model_not_found" and MODEL in e.value.body["message"]


@pytest.mark.parametrize("body, param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"n": 9}, "n"),
])
def test_bad_requests_are_400_in_openai_shape(http, body, param):
    payload = {"model": MODEL, "messages": FRANCE, **body}
    r = http.post("/v1/chat/completions", json=payload)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


def test_malformed_json_is_400(http):
    r = http.post("/v1/chat/completions", content=b'{"model": "x", "messages": [',
                  headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


def test_prompt_over_context_is_400_context_length_exceeded(http):
    long = "word " * 3000  # > 2048 tokens
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": long}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert "2048" in r.json()["error"]["message"]


def test_unknown_fields_are_accepted(client):
    r = client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=4, temperature=0,
                                       extra_body={"metadata": {"a": "b"}, "store": False, "user": "u",
                                                   "service_tier": "auto", "parallel_tool_calls": True,
                                                   "stream_options": {"include_usage": True}})
    assert r.usage.completion_tokens == 4


def test_async_client_streams_concurrently_and_frees_pages(server):
    engine = server.state.loaded.engine
    start_free = wait_idle(engine)["pages_free"]

    async def main():
        client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)

        async def one(q):
            stream = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": q}], temperature=0, max_tokens=16, stream=True)
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        return await asyncio.gather(*(one(q) for q in ["Hi!", "Name a fruit.", "Count to five.", "Say yes."]))

    texts = asyncio.run(main())
    assert all(texts)
    assert wait_idle(engine)["pages_free"] == start_free


def test_disconnect_mid_stream_aborts_and_frees_pages(server):
    import httpx
    engine = server.state.loaded.engine
    start = wait_idle(engine)
    with httpx.Client(base_url=server.base_url, timeout=30) as c:
        with c.stream("POST", "/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "Write a very long essay."}],
                "max_tokens": 1000, "ignore_eos": True, "stream": True}) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i > 6:
                    break
    after = wait_idle(engine, timeout=5)
    assert after["pages_free"] == start["pages_free"]
    assert after["aborted"] == start["aborted"] + 1


def test_n_choices_are_independent_and_reproducible(client):
    def run():
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell a story."}],
                                           n=3, temperature=1.0, seed=11, max_tokens=12,
                                           extra_body={"ignore_eos": True})
        return [c.message.content for c in sorted(r.choices, key=lambda c: c.index)], r
    texts, r = run()
    assert [c.index for c in sorted(r.choices, key=lambda c: c.index)] == [0, 1, 2]
    assert len(set(texts)) > 1
    assert run()[0] == texts
    assert r.usage.completion_tokens == 36


def test_n_choices_stream_with_indices(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=FRANCE, n=2, temperature=0, max_tokens=20,
                                                 stream=True))
    by_index = {0: "", 1: ""}
    for c in chunks:
        for ch in c.choices:
            by_index[ch.index] += ch.delta.content or ""
    assert by_index[0] == by_index[1] and "Paris" in by_index[0]


def test_completions_endpoint_plain_prompt(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0,
                                  logprobs=2)
    assert r.object == "text_completion" and r.choices[0].text
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == r.usage.completion_tokens
    assert "".join(lp.tokens) == r.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0, stream=True) if c.choices)
    assert streamed == r.choices[0].text


def test_completions_token_prompts_and_echo(client):
    r = client.completions.create(model=MODEL, prompt=["Hello", "One, two,"], max_tokens=4, temperature=0, echo=True)
    assert sorted(c.index for c in r.choices) == [0, 1]
    texts = {c.index: c.text for c in r.choices}
    assert texts[0].startswith("Hello") and texts[1].startswith("One, two,")


def test_completions_bad_token_id_is_400(http):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2, 10**9]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_disconnect_of_non_stream_request_aborts_within_a_second(server):
    import time

    import httpx
    engine = server.state.loaded.engine
    start = wait_idle(engine)
    with httpx.Client(base_url=server.base_url, timeout=0.8) as c:
        with pytest.raises(httpx.ReadTimeout):
            c.post("/v1/chat/completions", json={"model": MODEL, "messages": FRANCE, "max_tokens": 2000,
                                                  "ignore_eos": True})
    t0 = time.time()
    after = wait_idle(engine, timeout=5)
    assert time.time() - t0 < 1.5
    assert after["pages_free"] == start["pages_free"] and after["aborted"] == start["aborted"] + 1


def test_queue_full_is_429_with_retry_after(default_engine, server, http):
    engine = default_engine.engine
    saved = engine._admitted
    import threading
    engine._admitted = threading.Semaphore(0)  # as if running + waiting requests filled every slot
    try:
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": FRANCE})
    finally:
        engine._admitted = saved
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "queue_full" and "--max-queue" in r.json()["error"]["message"]


def test_logit_bias_steers_and_bad_keys_are_400(client, http, default_engine):
    tok = default_engine.tokenizer
    banned = tok.encode(" Paris")[0]
    r = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=12,
                                       logit_bias={str(banned): -100})
    assert " Paris" not in r.choices[0].message.content
    forced = tok.encode(" banana")[0]
    r = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=3,
                                       logit_bias={str(forced): 100})
    assert r.choices[0].message.content == tok.decode([forced] * 3)
    bad = http.post("/v1/chat/completions", json={"model": MODEL, "messages": FRANCE, "logit_bias": {"abc": 1}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logit_bias"


def test_best_of_above_one_is_refused(http):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "best_of": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of"
