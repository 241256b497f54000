"""Constrained decoding: a grammar (any JSON object, a JSON Schema, a forced tool call) that a sequence's output must
follow, enforced token by token with llguidance.

Build a constraint on a request thread with one of the factories below; compiling the grammar takes a moment and
raises ``UnsupportedSchema`` when llguidance cannot enforce the schema (the output is never left unconstrained).
Put it in ``SamplingParams.constraint``: it is a template, never advanced itself; the engine takes a ``fresh()`` copy
for each sequence it runs, then on its thread, for every token, masks the logits with ``apply`` and advances the
grammar with ``accept``. When ``finished`` (the grammar is complete and nothing but EOS may follow), the sequence
ends with finish_reason "stop". The state depends only on the output tokens accepted so far, so preemption (which
recomputes the KV of the same tokens) leaves it valid.
"""
from __future__ import annotations

import json
import threading
import weakref
from typing import Any, Iterable, Literal

import numpy as np
import torch

from engine.errors import NInferError

# Canonical spacing ({"a": 1, "b": [1, 2]}): the spacing models are trained on, and no room for whitespace runs (a
# small model allowed free whitespace can loop on newlines inside an object until max_tokens).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"  # the Hermes form engine.server.toolcalls parses
MAX_PARALLEL_CALLS = 8

_llg_tokenizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_llg_lock = threading.Lock()


_SCHEMA_REMEDY = ("Remove or rewrite that part of the schema (llguidance does not support e.g. 'not' or regex "
                  "look-arounds); the output is never left unconstrained.")


class UnsupportedSchema(NInferError):
    """A schema (or tool parameters schema) llguidance cannot enforce."""


class ConstraintError(NInferError):
    """A constrained sequence cannot go on: no token is allowed, or a token off the grammar was taken."""


def llg_tokenizer(tokenizer) -> Any:
    """The llguidance tokenizer for an engine Tokenizer, built once per Tokenizer object (about half a second)."""
    with _llg_lock:
        found = _llg_tokenizers.get(tokenizer)
        if found is None:
            import llguidance.hf

            found = llguidance.hf.from_tokenizer(tokenizer._hf, n_vocab=tokenizer.vocab_size,
                                                 eos_token=sorted(tokenizer.eos_token_ids) or None)
            _llg_tokenizers[tokenizer] = found
        return found


class Constraint:
    """One sequence's grammar state. ``start_after``: a token id (e.g. ``</think>``) before which the output is free
    (but may not end); the grammar applies from the token after it."""

    def __init__(self, matcher, eos_ids: Iterable[int], description: str, start_after: int | None = None,
                 repeat: RepeatedCallStop | None = None):
        self._matcher = matcher
        self._eos_ids = tuple(sorted(eos_ids))
        self.description = description
        self.start_after = start_after
        self.active = start_after is None
        self.repeat = repeat  # ends a tool-call answer at a call that repeats an earlier one
        self._repeated = False

    def fresh(self) -> Constraint:
        """A copy in the initial state, for one more sequence (this one is left as it is)."""
        twin = Constraint(self._matcher.deep_copy(), self._eos_ids, self.description, self.start_after,
                          self.repeat.fresh() if self.repeat is not None else None)
        twin._matcher.reset()
        return twin

    @property
    def finished(self) -> bool:
        """The grammar is complete and can take nothing but EOS (or the last tool call repeated an earlier one):
        the sequence must stop now."""
        if not self.active:
            return False
        return self._repeated or self._matcher.is_stopped() and not self._matcher.is_error()

    def allowed(self, vocab_size: int) -> torch.Tensor:
        """A bool mask over the vocabulary: the tokens the grammar allows next (EOS only where it may end)."""
        if not self.active:
            mask = torch.ones(vocab_size, dtype=torch.bool)
            mask[[e for e in self._eos_ids if e < vocab_size]] = False
            return mask
        bits = np.unpackbits(np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        if self._matcher.is_error():
            raise ConstraintError(f"The output grammar ({self.description}) failed: "
                                  f"{_short(self._matcher.get_error())}.",
                                  "Simplify the schema, or report the request.")
        if len(bits) < vocab_size:
            bits = np.concatenate([bits, np.zeros(vocab_size - len(bits), dtype=np.uint8)])
        bits = bits[:vocab_size]
        if not bits.any():
            raise ConstraintError(f"No token can continue the output under its grammar ({self.description}).",
                                  "The schema may be unsatisfiable: simplify it.")
        return torch.from_numpy(bits.view(np.bool_))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits row [V] with disallowed tokens at -inf (a new tensor; the input is left as it is)."""
        allowed = self.allowed(logits.shape[-1]).to(logits.device, non_blocking=True)
        return logits.masked_fill(~allowed, float("-inf"))

    def accept(self, token_id: int) -> None:
        """Advances the grammar by the sampled token; ConstraintError when the grammar does not allow it."""
        if not self.active:
            self.active = token_id == self.start_after
            return
        if not self._matcher.consume_token(int(token_id)):
            raise ConstraintError(f"Token {token_id} does not fit the output grammar ({self.description}): "
                                  f"{_short(self._matcher.get_error())}", "Report the request.")
        if self.repeat is not None and self.repeat.feed(int(token_id)):
            self._repeated = True


class RepeatedCallStop:
    """Watches a forced tool-call answer token by token and says when a call is complete that repeats an earlier
    call of the same answer (same name and arguments): identical calls are never useful, so the answer ends there
    (the parser drops the repeat). A small model under a "required" grammar otherwise emits the same call again."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._detok = tokenizer.detokenizer(skip_special_tokens=False)
        self._text = ""
        self._pos = 0  # where to look for the next call's body
        self._seen: set[str] = set()

    def fresh(self) -> RepeatedCallStop:
        return RepeatedCallStop(self._tokenizer)

    def feed(self, token_id: int) -> bool:
        piece = self._detok.add([token_id])
        self._text += piece
        if "}" not in piece:
            return False
        start = self._text.find(TOOL_CALL_OPEN, self._pos)
        if start < 0:
            return False
        body = start + len(TOOL_CALL_OPEN)
        while body < len(self._text) and self._text[body] in " \t\r\n":
            body += 1
        try:
            call, end = json.JSONDecoder().raw_decode(self._text, body)
        except ValueError:
            return False  # the call is not complete yet
        self._pos = end
        key = json.dumps(call, sort_keys=True, ensure_ascii=False)
        if key in self._seen:
            return True
        self._seen.add(key)
        return False


THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class ThinkingBudget:
    """Ends a sequence's reasoning after ``budget`` tokens: once that many tokens were written inside the
    ``<think>`` block (which the prompt opened, ``in_reasoning``, or the model opens first thing), the tokens of
    ``</think>`` are forced one per step and the answer follows. ``inner``: the output grammar, which starts
    after ``</think>`` (Constraint.start_after), or None. Used as a Constraint (fresh, apply, accept, finished)."""

    def __init__(self, tokenizer, budget: int, in_reasoning: bool, inner: Constraint | None = None):
        self._tokenizer = tokenizer
        self.budget = budget
        self._in_reasoning = in_reasoning
        self.inner = inner
        self._close = tokenizer.encode(THINK_CLOSE)
        self._detok = tokenizer.detokenizer(skip_special_tokens=False)
        self._tail = ""  # the latest text, where <think> or </think> shows
        self._state = "thinking" if in_reasoning else "before"  # then "forcing", then "done"
        self.used = 0  # reasoning tokens so far
        self._forced = 0  # tokens of </think> forced so far

    def fresh(self) -> ThinkingBudget:
        return ThinkingBudget(self._tokenizer, self.budget, self._in_reasoning,
                              self.inner.fresh() if self.inner is not None else None)

    @property
    def finished(self) -> bool:
        return self.inner is not None and self.inner.finished

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self._state == "forcing":
            forced = torch.full_like(logits, float("-inf"))
            forced[..., self._close[self._forced]] = 0.0
            return forced
        return self.inner.apply(logits) if self.inner is not None else logits

    def accept(self, token_id: int) -> None:
        if self.inner is not None:
            self.inner.accept(token_id)
        if self._state == "done":
            return
        if self._state == "forcing":
            self._forced += 1
            self._state = "done" if self._forced == len(self._close) else "forcing"
            return
        self._tail = (self._tail + self._detok.add([int(token_id)]))[-4 * len(THINK_CLOSE):]
        if self._state == "before":
            head = self._tail.lstrip()
            if THINK_OPEN in head:
                self._state, self._tail = "thinking", head.split(THINK_OPEN, 1)[1]
            elif head and not THINK_OPEN.startswith(head):
                self._state = "done"  # the answer starts without reasoning
            return
        if THINK_CLOSE in self._tail:
            self._state = "done"
            return
        self.used += 1
        if self.used >= self.budget:
            self._state = "forcing"


def grammar_constraint(tokenizer, grammar: str, description: str, start_after: int | None = None) -> Constraint:
    """A constraint from an llguidance grammar (see LLMatcher.grammar_from_*); UnsupportedSchema when invalid."""
    from llguidance import LLMatcher

    matcher = LLMatcher(llg_tokenizer(tokenizer), grammar, log_level=0)
    _dry_run(matcher, description)
    return Constraint(matcher, tokenizer.eos_token_ids, description, start_after)


def _dry_run(matcher, what: str) -> None:
    """UnsupportedSchema unless the grammar can start: a copy of the matcher takes the tokens its grammar forces
    at the start (a required recursion, such as an object whose required property is the object itself, forces
    an endless text and fails here, before any request is admitted) and then must allow some token."""
    trial = matcher.deep_copy()
    if trial.is_error():
        raise UnsupportedSchema(f"The {what} cannot be enforced: {_short(trial.get_error())}.", _SCHEMA_REMEDY)
    forced = trial.compute_ff_tokens()
    if not trial.is_error() and forced:
        trial.consume_tokens(forced)
    if trial.is_error() and "Too many items" in trial.get_error():
        raise UnsupportedSchema(f"The {what} cannot be enforced: the output it forces from the start never ends.",
                                "A required property whose schema refers back to its own object (\"$ref\": \"#\") "
                                "asks for an endlessly nested value: make that property optional.")
    if trial.is_error():
        raise UnsupportedSchema(f"The {what} cannot be enforced: {_short(trial.get_error())}.", _SCHEMA_REMEDY)
    if not any(trial.compute_bitmask()) or trial.is_error():
        raise UnsupportedSchema(f"The {what} cannot be enforced: no output can satisfy it.", _SCHEMA_REMEDY)


def _schema_grammar(schema: Any, what: str) -> str:
    from llguidance import LLMatcher

    if not isinstance(schema, (dict, bool)):
        raise UnsupportedSchema(f"The {what} must be a JSON Schema object, not {type(schema).__name__}.",
                                "Send a JSON Schema object.")
    try:
        return LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
    except (ValueError, TypeError) as err:
        raise UnsupportedSchema(f"The {what} cannot be enforced: {_short(err)}.", "Send a valid JSON Schema.") from None


def json_object_constraint(tokenizer, start_after: int | None = None) -> Constraint:
    """Any JSON object."""
    return grammar_constraint(tokenizer, _schema_grammar({"type": "object"}, "JSON object"), "JSON object",
                              start_after)


def json_schema_constraint(tokenizer, schema: dict, start_after: int | None = None) -> Constraint:
    """JSON that validates against ``schema``; UnsupportedSchema when llguidance cannot enforce it."""
    return grammar_constraint(tokenizer, _schema_grammar(schema, "JSON schema"), "JSON schema", start_after)


def tool_call_constraint(tokenizer, tools: list[dict], name_or_required: str | Literal[True], *,
                         parallel: bool = True, start_after: int | None = None) -> Constraint:
    """The output is tool calls only: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` with the
    arguments following that tool's parameters schema. ``name_or_required``: a tool's name (exactly one call of
    it), or True (tool_choice "required": a call of any offered tool; up to MAX_PARALLEL_CALLS when parallel)."""
    from llguidance import LLMatcher

    options = []
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            continue
        if name_or_required is not True and fn["name"] != name_or_required:
            continue
        params = fn.get("parameters")
        params = {"type": "object"} if params is None else closed_objects(params)
        _check(tokenizer, _schema_grammar(params, f"parameters schema of the tool {fn['name']!r}"),
               f"parameters schema of the tool {fn['name']!r}")
        options.append({"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": params},
                        "required": ["name", "arguments"], "additionalProperties": False})
    if not options:
        raise UnsupportedSchema("No offered tool matches tool_choice, so no tool call can be forced.",
                                "Name one of the tools in tool_choice.")
    call = {"anyOf": options, "x-guidance": JSON_OPTIONS} if len(options) > 1 else {**options[0],
                                                                                      "x-guidance": JSON_OPTIONS}
    many = parallel and name_or_required is True and MAX_PARALLEL_CALLS > 1
    start = f'call ("\\n" call){{0,{MAX_PARALLEL_CALLS - 1}}}' if many else "call"
    lark = (f"start: {start}\n"
            f"call: {json.dumps(TOOL_CALL_OPEN + chr(10))} body {json.dumps(chr(10) + TOOL_CALL_CLOSE)}\n"
            f"body: %json {json.dumps(call)}\n")
    what = "forced tool call" if name_or_required is True else f"forced call of {name_or_required!r}"
    constraint = grammar_constraint(tokenizer, LLMatcher.grammar_from_lark(lark), what, start_after)
    if many:
        constraint.repeat = RepeatedCallStop(tokenizer)
    return constraint


_COMBINED = ("allOf",)  # subschemas that must hold together: closing each could make them contradict


def closed_objects(schema: Any) -> Any:
    """The schema with every object that lists its properties closed after them (additionalProperties false)
    unless it says itself what other keys it allows (additionalProperties, patternProperties,
    unevaluatedProperties). Under a forced call the grammar would otherwise admit any extra key, and a small model
    keeps adding keys until max_tokens cuts the call."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in ("properties", "$defs", "definitions", "patternProperties") and isinstance(value, dict):
            out[key] = {k: closed_objects(v) for k, v in value.items()}
        elif key in ("items", "anyOf", "oneOf", "prefixItems", "additionalProperties"):
            out[key] = closed_objects(value)
        else:
            out[key] = value  # allOf parts and everything else as given
    open_keys = ("additionalProperties", "patternProperties", "unevaluatedProperties")
    if isinstance(schema.get("properties"), dict) and not any(k in schema for k in open_keys) \
            and not any(k in schema for k in _COMBINED):
        out["additionalProperties"] = False
    return out


def _check(tokenizer, grammar: str, what: str) -> None:
    from llguidance import LLMatcher

    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, llg_tokenizer(tokenizer))
    if is_error:
        raise UnsupportedSchema(f"The {what} cannot be enforced: {_short(messages[0] if messages else '?')}.",
                                _SCHEMA_REMEDY)
    _dry_run(LLMatcher(llg_tokenizer(tokenizer), grammar, log_level=0), what)


def _short(err: Any, limit: int = 400) -> str:
    """The grammar engine's message without the parser state it appends (an internal dump, no use to a client)."""
    text = str(err).split("<state>", 1)[0].strip().rstrip(".") or type(err).__name__
    return text if len(text) <= limit else text[:limit] + "..."
