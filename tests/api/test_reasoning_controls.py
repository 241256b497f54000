"""How long a thinking model thinks and which earlier thinking its prompt keeps: reasoning_effort mapped to a
thinking budget (engine.server.thinking.EFFORT_SHARE), --reasoning-budget, --reasoning-budget-message forced before
the end of thinking, --reasoning-preserve. The thinking model is the scripted one with a template that thinks (as in
test_thinking_budget.py, whose greedy runner checks what the constraint forces); the prompt is checked as rendered."""
import dataclasses

import httpx
import pytest

from engine.server.thinking import EFFORT_SHARE, BudgetWithMessage
from tests.api.test_thinking_budget import THINK_FOREVER, opened_at, run

HI = [{"role": "user", "content": "Hi"}]
# Renders every assistant message's reasoning_content, and says whether the template was told to keep it.
KEEPS_ALL = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.reasoning_content %}<think>"
             "{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
             "{% if preserve_thinking is defined %}[preserve_thinking={{ preserve_thinking }}]{% endif %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
HISTORY = [{"role": "user", "content": "What is 2+2?"},
           {"role": "assistant", "content": "4", "reasoning_content": "OLD-THOUGHT"},
           {"role": "assistant", "content": "<think>INLINE-OLD</think>\n\nIt is 4."},
           {"role": "user", "content": "Weather in Oslo?"},
           {"role": "assistant", "content": "", "reasoning_content": "CURRENT-THOUGHT", "tool_calls": [
               {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
           {"role": "tool", "tool_call_id": "c1", "content": "snow"}]


@pytest.fixture
def thinking(scripted, monkeypatch):
    """The scripted server's model thinks (its template has <think>); its settings are put back afterwards."""
    tok = scripted.engine.tokenizer
    monkeypatch.setattr(tok, "chat_template", tok.chat_template + "{# <think> #}")
    scripted.engine.script = "<think>\nHm.\n</think>\n\nHello!"
    original = scripted.state.settings
    yield scripted
    scripted.state.apply_settings(original)


def configure(scripted, **values):
    scripted.state.apply_settings(dataclasses.replace(scripted.state.settings, **values))


def post(scripted, path: str, body: dict) -> dict:
    with httpx.Client(base_url=scripted.base_url, timeout=30) as c:
        r = c.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def budget_of(scripted, **body) -> int | None:
    post(scripted, "/v1/chat/completions", {"model": "scripted", "messages": HI, **body})
    constraint = scripted.engine.params[-1].constraint
    return constraint.budget if constraint is not None else None


# ---------------------------------------------------------------- budgets

def test_effort_levels_map_to_shares_of_the_answer_budget(thinking):
    """OpenRouter's documented normalization: low 20%, medium 50%, high 80% (minimal 10%) of max_tokens."""
    assert EFFORT_SHARE == {"minimal": 0.1, "low": 0.2, "medium": 0.5, "high": 0.8}
    assert [budget_of(thinking, max_tokens=100, reasoning_effort=e) for e in ("minimal", "low", "medium", "high")] \
        == [10, 20, 50, 80]
    assert isinstance(thinking.engine.params[-1].constraint, BudgetWithMessage)
    assert budget_of(thinking, max_tokens=100, reasoning_effort="none") == 0  # thinking ends at once
    assert budget_of(thinking, max_tokens=100) is None  # auto: unrestricted by default
    post(thinking, "/v1/responses", {"model": "scripted", "input": "Hi", "max_output_tokens": 100,
                                     "reasoning": {"effort": "medium"}})
    assert thinking.engine.params[-1].constraint.budget == 50


def test_reasoning_budget_is_the_default_and_caps_the_effort(thinking):
    configure(thinking, reasoning_budget=10)
    assert budget_of(thinking, max_tokens=100) == 10
    assert budget_of(thinking, max_tokens=100, reasoning_effort="high") == 10  # 80 capped
    assert budget_of(thinking, max_tokens=20, reasoning_effort="low") == 4  # under the cap
    configure(thinking, default_reasoning_effort="medium", reasoning_budget=-1)
    assert budget_of(thinking, max_tokens=100) == 50
    configure(thinking, default_reasoning_effort="auto", reasoning_budget=500)
    assert budget_of(thinking, max_tokens=100) is None  # a budget at or above max_tokens cannot bind


def test_no_thinking_template_no_budget(scripted):
    assert budget_of(scripted, max_tokens=100, reasoning_effort="low") is None


def test_the_budget_message_is_forced_before_the_end_of_thinking(thinking):
    tok = thinking.engine.tokenizer
    configure(thinking, reasoning_budget_message="Time is up, I answer now.")
    assert budget_of(thinking, max_tokens=40, reasoning_effort="low") == 8
    text = run(thinking.engine.params[-1].constraint, tok, THINK_FOREVER)
    want = tok.encode(THINK_FOREVER)
    thought = tok.decode(want[:opened_at(tok, want) + 8], skip_special_tokens=False)
    assert text.startswith(thought + "\n\nTime is up, I answer now.\n</think>"), text[:300]
    assert text.count("</think>") == 1


def test_budget_zero_ends_the_thinking_at_once(thinking):
    tok = thinking.engine.tokenizer
    assert budget_of(thinking, max_tokens=40, reasoning_effort="none") == 0
    text = run(thinking.engine.params[-1].constraint, tok, THINK_FOREVER)
    want = tok.encode(THINK_FOREVER)
    assert text.startswith(tok.decode(want[:opened_at(tok, want)], skip_special_tokens=False) + "</think>"), text


def test_messages_budget_tokens_wins_and_carries_the_message(thinking):
    tok = thinking.engine.tokenizer
    configure(thinking, reasoning_budget=3, reasoning_budget_message="Enough.")
    body = {"model": "scripted", "max_tokens": 64, "messages": HI}
    post(thinking, "/v1/messages", {**body, "thinking": {"type": "enabled", "budget_tokens": 6}})
    constraint = thinking.engine.params[-1].constraint
    assert constraint.budget == 6 and "\n\nEnough.\n</think>" in run(constraint, tok, THINK_FOREVER)
    configure(thinking, reasoning_budget=-1)
    post(thinking, "/v1/messages", {**body, "thinking": {"type": "enabled"}})  # no budget_tokens: effort high
    assert thinking.engine.params[-1].constraint.budget == int(64 * 0.8)


# ---------------------------------------------------------------- --reasoning-preserve

def rendered(scripted, monkeypatch, preserve: str) -> str:
    monkeypatch.setattr(scripted.engine.tokenizer, "chat_template", KEEPS_ALL + "{# <think> #}")
    configure(scripted, reasoning_preserve=preserve)
    return post(scripted, "/apply-template", {"messages": HISTORY})["prompt"]


def test_preserve_auto_leaves_the_history_to_the_template(thinking, monkeypatch):
    prompt = rendered(thinking, monkeypatch, "auto")
    assert "OLD-THOUGHT" in prompt and "INLINE-OLD" in prompt and "CURRENT-THOUGHT" in prompt
    assert "preserve_thinking" not in prompt


def test_preserve_off_drops_the_thinking_of_earlier_turns(thinking, monkeypatch):
    prompt = rendered(thinking, monkeypatch, "off")
    assert "OLD-THOUGHT" not in prompt and "INLINE-OLD" not in prompt and "It is 4." in prompt
    assert "<think>CURRENT-THOUGHT</think>" in prompt  # the turn in progress keeps its reasoning
    assert "[preserve_thinking=False]" in prompt
    post(thinking, "/v1/chat/completions", {"model": "scripted", "messages": HISTORY})  # the generation route too
    assert thinking.engine.tokenizer.decode(thinking.engine.prompts[-1], skip_special_tokens=False) == prompt
    post(thinking, "/v1/messages", {"model": "scripted", "max_tokens": 8, "messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "OLD-THOUGHT", "signature": ""},
                                          {"type": "text", "text": "Hello."}]},
        {"role": "user", "content": "Again"}]})
    assert "OLD-THOUGHT" not in thinking.engine.tokenizer.decode(thinking.engine.prompts[-1])


def test_preserve_on_keeps_every_turn_and_tells_the_template(thinking, monkeypatch):
    prompt = rendered(thinking, monkeypatch, "on")
    assert "OLD-THOUGHT" in prompt and "CURRENT-THOUGHT" in prompt and "[preserve_thinking=True]" in prompt
