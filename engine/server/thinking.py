"""How long a thinking model may think, and which earlier thinking its prompt keeps.

**Budget.** A model whose chat template thinks in ``<think>`` blocks gets a budget of reasoning tokens; when it is
spent, ``--reasoning-budget-message`` (if set, on lines of its own) and then ``</think>`` are forced, one token per
step, and the answer follows (llama-server's ``--reasoning-budget`` / ``--reasoning-budget-message``). The budget
is the first of:

- a request's own number (Anthropic's ``thinking.budget_tokens``);
- its ``reasoning_effort`` (or ``--default-reasoning-effort``): a share of the answer's token budget
  (``max_tokens``, capped to the room left in the context), ``EFFORT_SHARE``, at most ``--reasoning-budget`` when
  that is set; ``none`` ends any thinking at once (budget 0);
- ``--reasoning-budget`` (-1: unrestricted, 0: thinking ends at once, N: N tokens).

A budget at or above ``max_tokens`` cannot bind and adds nothing.

**Earlier thinking** (``--reasoning-preserve``, llama-server's flag of that name): ``auto`` leaves it to the template;
``off`` removes the reasoning of assistant messages before the last user message (the turns before the current one;
the reasoning between the last user message and now, a tool-calling turn in progress, stays); ``on`` keeps every
turn's. Both also set the variables through which templates that can keep the whole history's reasoning are told
to (``preserve_thinking``, ``clear_thinking``, ``truncate_history_thinking``: those llama.cpp sets), when the template
reads them.
"""
from __future__ import annotations

from engine.constrain import Constraint, ThinkingBudget
from engine.server.reasoning import OPEN, split_reasoning

# reasoning_effort -> the share of the answer's token budget the model may spend thinking. OpenAI documents the levels
# only as "fewer / more reasoning tokens"; llama-server hands the level to the template and has one budget for all.
# These are OpenRouter's documented normalization of effort into a thinking budget (openrouter.ai/docs, "Reasoning
# Tokens": minimal ~10%, low ~20%, medium ~50%, high ~80% of max_tokens), so an answer always keeps room after its
# thinking. Responses' xhigh reads as high.
EFFORT_SHARE = {"minimal": 0.1, "low": 0.2, "medium": 0.5, "high": 0.8}
PRESERVE_VARIABLES = ("preserve_thinking", "clear_thinking", "truncate_history_thinking")
_REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking")


def thinking_budget(effort: str | None, max_tokens: int, server_budget: int, explicit: int | None = None) -> int | None:
    """The reasoning tokens allowed (see the module's docstring), or None for no limit."""
    if explicit is not None:
        return explicit
    if effort == "none":
        return 0
    if effort in EFFORT_SHARE:
        budget = max(1, int(max_tokens * EFFORT_SHARE[effort]))
        return budget if server_budget < 0 else min(budget, server_budget)
    return server_budget if server_budget >= 0 else None


class BudgetWithMessage(ThinkingBudget):
    """ThinkingBudget whose forced end is ``message`` and then ``</think>``; a budget of 0 forces it at once (before
    any reasoning token when the prompt opened the block, right after ``<think>`` when the model opens it)."""

    def __init__(self, tokenizer, budget: int, in_reasoning: bool, inner: Constraint | None = None,
                 message: str = ""):
        super().__init__(tokenizer, budget, in_reasoning, inner)
        self.message = message
        if message:  # on lines of its own, so neither the reasoning's last word nor the tag runs into it
            self._close = tokenizer.encode("\n\n" + message.strip() + "\n") + self._close
        if in_reasoning and budget <= 0:
            self._state = "forcing"

    def fresh(self) -> BudgetWithMessage:
        return BudgetWithMessage(self._tokenizer, self.budget, self._in_reasoning,
                                 self.inner.fresh() if self.inner is not None else None, self.message)

    def accept(self, token_id: int) -> None:
        super().accept(token_id)
        if self._state == "thinking" and self.used >= self.budget:  # budget 0: the block just opened
            self._state = "forcing"


def thinking_constraint(state, tokenizer, effort: str | None, max_tokens: int, in_reasoning: bool,
                        inner: Constraint | None, explicit: int | None = None):
    """The constraint that ends a thinking model's reasoning after its budget (the output grammar `inner` applying
    after it), or `inner` unchanged when the model does not think or no budget binds."""
    if OPEN not in (tokenizer.chat_template or ""):
        return inner
    s = state.settings
    budget = thinking_budget(effort or s.default_reasoning_effort, max_tokens, s.reasoning_budget, explicit)
    if budget is None or budget >= max_tokens:
        return inner
    return BudgetWithMessage(tokenizer, budget, in_reasoning, inner, s.reasoning_budget_message or "")


def preserve_kwargs(preserve: str, template: str) -> dict:
    """The template variables that tell a template to keep (on) or drop (off) the history's reasoning, those of
    PRESERVE_VARIABLES it reads; none for auto."""
    if preserve not in ("on", "off"):
        return {}
    keep = preserve == "on"
    values = {"preserve_thinking": keep, "clear_thinking": not keep, "truncate_history_thinking": not keep}
    return {name: value for name, value in values.items() if name in template}


def drop_earlier_thinking(messages: list[dict]) -> list[dict]:
    """The messages without the reasoning of assistant messages before the last user message: their
    reasoning_content / reasoning / thinking fields removed, a leading <think>...</think> cut from their text."""
    last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=-1)
    out = []
    for i, m in enumerate(messages):
        if i < last_user and m.get("role") == "assistant":
            m = {k: v for k, v in m.items() if k not in _REASONING_FIELDS}
            content = m.get("content")
            if isinstance(content, str) and content.lstrip().startswith(OPEN):
                m["content"] = split_reasoning(content)[1]
        out.append(m)
    return out
