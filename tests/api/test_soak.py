"""A mixed soak: a few hundred requests (streams, non-streams, completions, random client cancels, bad requests)
at once; afterwards no KV page is leaked and the server still answers."""
import asyncio
import random

import httpx
import pytest

from tests.api.conftest import wait_idle

MODEL = "smollm2-135m-instruct"


@pytest.mark.slow
def test_mixed_soak_leaks_nothing(server):
    engine = server.state.loaded.engine
    start = wait_idle(engine)
    rng = random.Random(1234)
    outcomes = {"ok": 0, "cancelled": 0, "bad": 0, "busy": 0}

    async def one(client: httpx.AsyncClient, i: int):
        kind = rng.choice(["stream", "stream", "whole", "completion", "bad"])
        cancel_after = rng.choice([None, None, 1, 2, 4])
        body = {"model": MODEL, "max_tokens": rng.randint(1, 6), "temperature": rng.choice([0, 0.7]),
                "messages": [{"role": "user", "content": f"Say something about the number {i}."}]}
        if kind == "bad":
            r = await client.post("/v1/chat/completions", json={**body, "temperature": 5})
            assert r.status_code == 400
            outcomes["bad"] += 1
            return
        if kind == "completion":
            body = {"model": MODEL, "prompt": f"Number {i} is", "max_tokens": body["max_tokens"]}
            r = await client.post("/v1/completions", json=body)
            assert r.status_code in (200, 429), r.text
            outcomes["ok" if r.status_code == 200 else "busy"] += 1
            return
        if kind == "whole":
            if cancel_after:
                try:
                    await client.post("/v1/chat/completions", json={**body, "max_tokens": 200, "ignore_eos": True},
                                      timeout=0.05 * cancel_after)
                except httpx.TimeoutException:
                    outcomes["cancelled"] += 1
                    return
            r = await client.post("/v1/chat/completions", json=body)
            assert r.status_code in (200, 429), r.text
            outcomes["ok" if r.status_code == 200 else "busy"] += 1
            return
        async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            if r.status_code == 429:
                outcomes["busy"] += 1
                return
            assert r.status_code == 200
            lines = 0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    lines += 1
                    if cancel_after and lines >= cancel_after:
                        outcomes["cancelled"] += 1
                        return
                    if line == "data: [DONE]":
                        break
            outcomes["ok"] += 1

    async def main():
        limits = httpx.Limits(max_connections=12)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60, limits=limits) as client:
            await asyncio.gather(*(one(client, i) for i in range(160)))

    asyncio.run(main())
    end = wait_idle(engine, timeout=10)
    assert end["pages_free"] == start["pages_free"] == end["pages_total"]
    assert outcomes["ok"] > 40 and outcomes["cancelled"] > 15 and outcomes["bad"] > 15, outcomes
    with httpx.Client(base_url=server.base_url) as c:
        assert c.get("/health").status_code == 200
        r = c.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 3,
                                                 "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 200
