"""Anthropic's thinking.budget_tokens is enforced: after that many reasoning tokens the model's `</think>` is forced
and the answer follows. The budget is checked here by running the constraint the server built over a scripted
model (one that would think forever) token by token, as the engine does."""
import httpx
import pytest
import torch

from engine.constrain import ThinkingBudget

THINK_FOREVER = "<think>\n" + "I should think about this more. " * 40
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture
def thinking_template(scripted, monkeypatch):
    tok = scripted.engine.tokenizer
    monkeypatch.setattr(tok, "chat_template", tok.chat_template + "{# <think> #}")
    scripted.engine.script = "<think>\nHm.\n</think>\n\nHello!"
    return tok


def run(constraint, tok, script: str, steps: int = 120) -> str:
    """Greedy generation by a model that wants to say `script`: its next script token, unless the constraint
    forbids it (then the allowed token the constraint leaves, and the script goes on after it)."""
    c = constraint.fresh()
    want, out, i = tok.encode(script), [], 0
    for _ in range(steps):
        logits = torch.zeros(tok.vocab_size)
        logits[want[i]] = 10.0
        token = int(torch.argmax(c.apply(logits)))
        c.accept(token)
        out.append(token)
        i += token == want[i]
        if i == len(want):
            break
    return tok.decode(out, skip_special_tokens=False)


def opened_at(tok, ids) -> int:
    return next(n for n in range(1, len(ids) + 1) if "<think>" in tok.decode(ids[:n], skip_special_tokens=False))


def post(scripted, **body):
    with httpx.Client(base_url=scripted.base_url, timeout=30) as c:
        return c.post("/v1/messages", json={"model": "scripted", "max_tokens": 64, "messages": HI, **body})


def test_the_reasoning_ends_after_budget_tokens(scripted, thinking_template):
    tok = thinking_template
    r = post(scripted, thinking={"type": "enabled", "budget_tokens": 5})
    assert r.status_code == 200, r.text
    constraint = scripted.engine.params[-1].constraint
    assert isinstance(constraint, ThinkingBudget) and constraint.budget == 5
    text = run(constraint, tok, THINK_FOREVER)
    want = tok.encode(THINK_FOREVER)
    opened = opened_at(tok, want)
    assert text.startswith(tok.decode(want[:opened + 5], skip_special_tokens=False) + "</think>"), text[:200]
    assert text.count("</think>") == 1 and len(text) > len(tok.decode(want[:opened + 5])) + 20  # the answer goes on


def test_a_model_that_ends_its_reasoning_in_time_is_left_alone(scripted, thinking_template):
    tok = thinking_template
    post(scripted, thinking={"type": "enabled", "budget_tokens": 50})
    script = "<think>\nShort thought.\n</think>\n\nHello! " + "More answer. " * 20
    assert run(scripted.engine.params[-1].constraint, tok, script, steps=400) == tok.decode(
        tok.encode(script), skip_special_tokens=False)


def test_an_answer_without_reasoning_is_left_alone(scripted, thinking_template):
    tok = thinking_template
    post(scripted, thinking={"type": "enabled", "budget_tokens": 3})
    script = "Hello there, no thinking today. " * 5
    assert run(scripted.engine.params[-1].constraint, tok, script) == tok.decode(tok.encode(script))


def test_reasoning_opened_by_the_prompt_counts_from_the_first_token(scripted):
    tok = scripted.engine.tokenizer
    budget = ThinkingBudget(tok, 4, in_reasoning=True)
    script = "Let me think about it at length. " * 10
    text = run(budget, tok, script)
    assert text.startswith(tok.decode(tok.encode(script)[:4]) + "</think>"), text[:120]


def test_no_budget_no_constraint(scripted, thinking_template):
    post(scripted, thinking={"type": "enabled", "budget_tokens": 1024})  # more than max_tokens: cannot bind
    assert scripted.engine.params[-1].constraint is None
    post(scripted, thinking={"type": "adaptive"})
    assert scripted.engine.params[-1].constraint is None


@pytest.mark.parametrize("budget", ["5", 0, -1, True, 2**31, 1.5])
def test_a_budget_that_is_not_a_token_count_is_a_400(scripted, budget):
    r = post(scripted, thinking={"type": "enabled", "budget_tokens": budget})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert "budget_tokens" in r.json()["error"]["message"]
