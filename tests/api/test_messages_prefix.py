"""Prefix reuse survives what Claude Code sends: its per-request billing block (first in `system`, different in
every request) is dropped, so a resent conversation is served from the prefix cache (real default engine)."""
import anthropic
import pytest

from tests.api.conftest import wait_idle

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"
RULES = "You are a careful coding assistant. Answer in one short sentence. " * 12


def system(build: int) -> list[dict]:
    return [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.{build}; cch={build * 7919:x};"},
            {"type": "text", "text": RULES, "cache_control": {"type": "ephemeral"}}]


def test_a_resent_conversation_reuses_its_prefix(server, default_engine):
    client = anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0)
    messages = [{"role": "user", "content": "Name a prime number between 10 and 20."}]
    first = client.messages.create(model=MODEL, max_tokens=4, system=system(1), messages=messages)
    wait_idle(default_engine.engine)
    before = default_engine.engine.stats()["prefix_hit_tokens"]
    second = client.messages.create(model=MODEL, max_tokens=4, system=system(2), messages=messages)
    wait_idle(default_engine.engine)
    reused = default_engine.engine.stats()["prefix_hit_tokens"] - before
    prompt = second.usage.input_tokens + second.usage.cache_read_input_tokens
    assert prompt == first.usage.input_tokens + first.usage.cache_read_input_tokens
    # all but the last, partly filled page of the prompt comes from the cache
    assert reused >= prompt - 64 and reused > 0
    assert second.usage.cache_read_input_tokens == reused  # the engine reports each request's reused tokens
