"""How much of the model's context a conversation uses, and which turns are left out when it is full (Qt-free).

Token counts are estimated from characters (an image from its size, app/chat/images.py), calibrated by the server's
own count: after each answer the usage it reports (prompt tokens for the characters sent) sets the characters-per-token
ratio. When the conversation does not
fit the context with room for the answer, the oldest turns are left out (the system prompt and the newest message
always stay) and the chat says which; never silently.
"""
from __future__ import annotations

from dataclasses import dataclass

from app.chat.images import content_tokens, text_of

DEFAULT_CHARS_PER_TOKEN = 3.5
MESSAGE_OVERHEAD = 4  # tokens a chat template adds around each message (role markers)
ANSWER_RESERVE = 512  # tokens kept for the answer when no max tokens is set (at most a quarter of the context)


def estimate_tokens(text: str, chars_per_token: float = DEFAULT_CHARS_PER_TOKEN) -> int:
    return int(len(text) / max(chars_per_token, 0.5)) + 1 if text else 0


def message_tokens(message: dict, chars_per_token: float) -> int:
    content = message.get("content") or ""
    calls = str(message.get("tool_calls") or "")
    return estimate_tokens(text_of(content) + calls, chars_per_token) + content_tokens(content) + MESSAGE_OVERHEAD


def answer_reserve(context: int, max_tokens: int | None) -> int:
    return min(max_tokens, context // 2) if max_tokens else min(ANSWER_RESERVE, context // 4)


@dataclass
class Fit:
    messages: list[dict]  # what is sent
    left_out: int  # messages left out, oldest first
    tokens: int  # estimated prompt tokens of what is sent
    fits: bool  # False: even the newest message alone is too long


def fit(messages: list[dict], context: int | None, max_tokens: int | None,
        chars_per_token: float = DEFAULT_CHARS_PER_TOKEN) -> Fit:
    """``messages`` as the API takes them (a system message first, if any). Leaves out the oldest turns until the
    rest and the answer's reserve fit in ``context`` tokens (None: unknown, everything is sent)."""
    sizes = [message_tokens(m, chars_per_token) for m in messages]
    total = sum(sizes)
    if not context:
        return Fit(list(messages), 0, total, True)
    budget = context - answer_reserve(context, max_tokens)
    system = 1 if messages and messages[0].get("role") == "system" else 0
    start = system
    while total > budget and start < len(messages) - 1:
        total -= sizes[start]
        start += 1
    while start < len(messages) - 1 and messages[start].get("role") not in ("user",):
        total -= sizes[start]  # a turn starts with the user's message, never with an answer or a tool result
        start += 1
    kept = messages[:system] + messages[start:]
    return Fit(kept, start - system, total, total <= budget)


CALIBRATE_MIN_TOKENS = 64  # a count that grew less says more about the template than about the text


def calibrate(chars_sent: int, prompt_tokens: int | None, previous: float,
              last: tuple[int, int] | None = None) -> float:
    """The characters-per-token ratio after the server counted ``prompt_tokens`` for ``chars_sent`` characters of
    content. The count includes the chat template and any system prompt the server adds, so the ratio is read
    from what changed since the ``last`` (characters, tokens) of the conversation, or from one count large enough
    for those to be a small part; a short exchange ("Hi") leaves the ratio as it was."""
    if not prompt_tokens or chars_sent <= 0:
        return previous
    if last is not None and chars_sent > last[0] and prompt_tokens - last[1] >= CALIBRATE_MIN_TOKENS:
        chars, tokens = chars_sent - last[0], prompt_tokens - last[1]
    elif prompt_tokens >= 8 * CALIBRATE_MIN_TOKENS:
        chars, tokens = chars_sent, prompt_tokens
    else:
        return previous
    return max(1.0, min(8.0, chars / tokens))
