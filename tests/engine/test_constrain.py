"""Constrained decoding (engine.constrain): the masks, and generations of the embedded default model that must follow
a JSON object grammar, a JSON schema or a forced tool call, greedy and sampled, n>1 and under preemption."""
from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from engine.constrain import (ConstraintError, UnsupportedSchema, json_object_constraint, json_schema_constraint,
                              tool_call_constraint)
from engine.engine import Engine
from engine.runner import ModelRunner
from engine.sampling import SamplingParams
from engine.server.parsers import parse_tool_calls
from tests.engine.helpers import collect, run_concurrently, wait_idle

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
ALICE = "Return a JSON object with the keys name and age for Alice, who is 30."
WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
SAMPLED = [(0.0, None), (1.0, 1), (1.0, 2), (1.0, 3), (0.8, 4)]


@pytest.fixture(scope="module")
def tok(default_fp32_engine):
    return default_fp32_engine.tokenizer


def chat(tok, text: str, **kw) -> list[int]:
    return tok.apply_chat_template([{"role": "user", "content": text}], **kw)


def allowed_texts(constraint, tok) -> set[str]:
    return {tok.token_text(i) for i in torch.nonzero(constraint.allowed(tok.vocab_size)).flatten().tolist()}


def walk(constraint, tok, text: str) -> None:
    """Feeds text's tokens, checking each is allowed first."""
    for t in tok.encode(text):
        assert constraint.allowed(tok.vocab_size)[t], (text, tok.token_text(t))
        constraint.accept(t)


def run(engine, prompt, constraint, temperature=0.0, seed=None, max_tokens=120, **kw):
    out, last = collect(engine.submit(prompt, SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens,
                                                             constraint=constraint, **kw)))
    return out, last


# ----- masks (the tokenizer only) -----


@pytest.mark.slow
def test_enum_mask_excludes_other_tokens(tok):
    c = json_schema_constraint(tok, {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}},
                                     "required": ["answer"], "additionalProperties": False})
    hello = tok.encode("Hello")
    assert len(hello) == 1
    mask = c.allowed(tok.vocab_size)
    assert mask.dtype == torch.bool and mask.shape == (tok.vocab_size,)
    assert not mask[hello[0]]
    assert allowed_texts(c, tok) and allowed_texts(c, tok) <= {"{", '{"'}
    assert not any(mask[e] for e in tok.eos_token_ids)  # the object cannot end before it starts
    walk(c, tok, '{"answer": "')
    allowed = allowed_texts(c, tok)
    assert allowed and all(t and ('yes"}'.startswith(t) or 'no"}'.startswith(t)) for t in allowed), allowed
    walk(c, tok, 'no"}')
    assert c.finished
    # logits masked: only allowed tokens stay finite
    c2 = json_schema_constraint(tok, {"enum": ["yes", "no"]})
    logits = c2.apply(torch.zeros(tok.vocab_size))
    assert torch.isfinite(logits).sum() == c2.allowed(tok.vocab_size).sum()
    assert logits[hello[0]] == float("-inf")


@pytest.mark.slow
def test_accept_rejects_a_token_off_the_grammar(tok):
    c = json_object_constraint(tok)
    with pytest.raises(ConstraintError, match="does not fit"):
        c.accept(tok.encode("Hello")[0])


@pytest.mark.slow
def test_fresh_copies_start_over_and_leave_the_template(tok):
    c = json_object_constraint(tok)
    walk(c, tok, '{"a": 1}')
    assert c.finished
    twin = c.fresh()
    assert not twin.finished and c.finished
    walk(twin, tok, '{"b": [true, null]}')
    assert twin.finished


@pytest.mark.slow
def test_eos_is_allowed_only_where_the_value_may_end(tok):
    c = json_schema_constraint(tok, {"type": "integer"})
    eos = next(iter(tok.eos_token_ids))
    assert not c.allowed(tok.vocab_size)[eos]
    walk(c, tok, "12")
    assert c.allowed(tok.vocab_size)[eos] and not c.finished
    c.accept(eos)
    assert c.finished


@pytest.mark.slow
@pytest.mark.parametrize("schema", [{"not": {"type": "string"}}, {"type": "nope"},
                                    {"type": "string", "pattern": "(?=x)a"}, {"$ref": "#/missing"}, [1, 2],
                                    {"type": "object", "required": ["n"],  # unsatisfiable
                                     "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 1}}}])
def test_unsupported_schema_raises(tok, schema):
    with pytest.raises(UnsupportedSchema, match="cannot be enforced|must be a JSON Schema"):
        json_schema_constraint(tok, schema)


@pytest.mark.slow
def test_tool_call_constraint_forces_the_named_tool(tok):
    tools = WEATHER + [{"type": "function", "function": {"name": "other", "parameters": {"type": "object"}}}]
    c = tool_call_constraint(tok, tools, "get_weather")
    walk(c, tok, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
    assert c.finished
    c = tool_call_constraint(tok, tools, "get_weather")
    walk(c, tok, '<tool_call>\n{"name": "')
    assert allowed_texts(c, tok) <= {"get", "g", "ge", "get_", "get_weather"}  # never "other"
    with pytest.raises(UnsupportedSchema, match="tool 'bad'"):
        tool_call_constraint(tok, [{"type": "function", "function": {"name": "bad", "parameters": {"not": {}}}}],
                             True)


@pytest.mark.slow
def test_start_after_leaves_the_prefix_free_but_unended(tok):
    nl = tok.encode("\n")[0]
    c = json_object_constraint(tok, start_after=nl)
    mask = c.allowed(tok.vocab_size)
    assert mask[tok.encode("Hello")[0]] and not any(mask[e] for e in tok.eos_token_ids)
    walk(c, tok, "Hello there")
    assert not c.finished
    c.accept(nl)
    walk(c, tok, '{"a": 1}')
    assert c.finished


# ----- generation with the embedded model -----


@pytest.mark.slow
def test_json_object_generations_are_json_objects(default_fp32_engine, tok):
    c = json_object_constraint(tok)
    for temperature, seed in SAMPLED:
        out, last = run(default_fp32_engine.engine, chat(tok, ALICE), c, temperature, seed)
        assert last.finish_reason == "stop", (temperature, seed, tok.decode(out))
        value = json.loads(tok.decode(out))
        assert isinstance(value, dict)


@pytest.mark.slow
def test_json_schema_generations_validate(default_fp32_engine, tok):
    c = json_schema_constraint(tok, PERSON)
    for temperature, seed in SAMPLED:
        out, last = run(default_fp32_engine.engine, chat(tok, ALICE), c, temperature, seed)
        assert last.finish_reason == "stop"
        value = json.loads(tok.decode(out))
        jsonschema.validate(value, PERSON)
        assert set(value) == {"name", "age"} and isinstance(value["name"], str) and type(value["age"]) is int
    out, _ = run(default_fp32_engine.engine, chat(tok, ALICE), c)
    assert json.loads(tok.decode(out)) == {"name": "Alice", "age": 30}


@pytest.mark.slow
def test_grammar_end_stops_even_with_ignore_eos_and_beats_length(default_fp32_engine, tok):
    c = json_schema_constraint(tok, PERSON)
    out, last = run(default_fp32_engine.engine, chat(tok, ALICE), c, ignore_eos=True)
    assert last.finish_reason == "stop" and json.loads(tok.decode(out)) == {"name": "Alice", "age": 30}
    exact, last = run(default_fp32_engine.engine, chat(tok, ALICE), c, max_tokens=len(out))
    assert exact == out and last.finish_reason == "stop"
    cut, last = run(default_fp32_engine.engine, chat(tok, ALICE), c, max_tokens=len(out) - 1)
    assert cut == out[:-1] and last.finish_reason == "length"


@pytest.mark.slow
def test_one_params_object_serves_concurrent_sequences(default_fp32_engine, tok):
    """The constraint in SamplingParams is a template: each sequence gets its own state (as for n=2 choices)."""
    engine = default_fp32_engine.engine
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=120, constraint=json_schema_constraint(tok, PERSON))
              for s in (11, 12)]
    params = [params[0], SamplingParams(**{**vars(params[0]), "seed": 12})]  # as generation.submit copies them
    results = run_concurrently(engine, [chat(tok, ALICE)] * 2, params)
    for out, last in results:
        assert last.finish_reason == "stop"
        jsonschema.validate(json.loads(tok.decode(out)), PERSON)
    assert not params[0].constraint.finished  # the template was never advanced


@pytest.mark.slow
def test_forced_tool_call_is_parsed(default_fp32_engine, tok):
    prompt = chat(tok, "What is the weather like in Paris?", tools=WEATHER)
    for choice in (True, "get_weather"):
        out, last = run(default_fp32_engine.engine, prompt, tool_call_constraint(tok, WEATHER, choice), max_tokens=200)
        assert last.finish_reason == "stop"
        parsed = parse_tool_calls(tok.decode(out), {"get_weather"})
        assert parsed.content is None and parsed.tool_calls
        assert parsed.tool_calls[0].name == "get_weather"
        assert isinstance(json.loads(parsed.tool_calls[0].arguments)["city"], str)


@pytest.mark.slow
def test_logprobs_under_a_constraint_are_the_models(default_fp32_engine, tok):
    """Logprobs stay the model's own (finite, JSON-safe), though only "yes"/"no" may be sampled."""
    stream = default_fp32_engine.engine.submit(chat(tok, "Is Paris in France?"), SamplingParams(
        temperature=0, max_tokens=20, logprobs=5, constraint=json_schema_constraint(tok, {"enum": ["yes", "no"]})))
    outs = []
    while not outs or not outs[-1].finished:
        outs.append(stream.get(timeout=60))
    tokens = [t for o in outs for t in o.token_ids]
    assert tok.decode(tokens) in ('"yes"', '"no"') and outs[-1].finish_reason == "stop"
    entries = [e for o in outs for e in o.logprobs or []]
    assert len(entries) == len(tokens)
    for e in entries:
        assert len(e.top) == 5 and all(torch.isfinite(torch.tensor([e.logprob] + [v for _, v in e.top])))


class _DeadEnd:
    """A stand-in constraint that allows anything for two tokens, then nothing."""

    def __init__(self):
        self.steps, self.finished = 0, False

    def fresh(self):
        return _DeadEnd()

    def apply(self, logits):
        if self.steps >= 2:
            raise ConstraintError("No token can continue the output under its grammar (test).")
        return logits

    def accept(self, token_id):
        self.steps += 1


@pytest.mark.slow
def test_a_dead_end_grammar_ends_only_its_sequence_with_an_error(default_fp32_engine, tok):
    engine = default_fp32_engine.engine
    prompt = chat(tok, ALICE)
    results = run_concurrently(engine, [prompt, prompt],
                               [SamplingParams(temperature=0, max_tokens=8, constraint=_DeadEnd()),
                                SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)])
    (bad, bad_last), (good, good_last) = results
    assert len(bad) == 2 and bad_last.finish_reason == "error" and "No token can continue" in bad_last.error
    assert len(good) == 8 and good_last.finish_reason == "length"
    wait_idle(engine)


@pytest.mark.slow
def test_preemption_keeps_constrained_outputs(default_fp32_engine, tok):
    """Four constrained sequences in a pool of four 64-token pages each need two pages: the scheduler preempts and
    recomputes, and every output is still the one it gives alone."""
    prompts = [chat(tok, f"Return a JSON object with the keys name and age for {who}, who is {age}. Reply with the "
                         f"JSON only, no other text. {pad}")
               for who, age, pad in [("Alice", 30, "Thanks."), ("Bob", 41, "Thank you."),
                                     ("Carol", 25, "Please be brief."), ("Dave", 52, "Use the keys name and age.")]]
    params = SamplingParams(temperature=0, max_tokens=60, constraint=json_schema_constraint(tok, PERSON))
    alone = [default_fp32_engine.engine.generate(p, params) for p in prompts]
    assert all(64 < len(p) + len(o) <= 128 for p, o in zip(prompts, alone)), [len(p) + len(o)
                                                                               for p, o in zip(prompts, alone)]
    runner = ModelRunner(default_fp32_engine.engine.runner.model, 4, torch.float32, 64)
    engine = Engine(runner, max_concurrency=4, prefill_chunk=512, max_context=256, max_shared_prefixes=0,
                    eos_ids=tok.eos_token_ids).start()
    try:
        results = run_concurrently(engine, prompts, [params] * 4)
        wait_idle(engine)
        assert engine.scheduler.preemptions > 0
        assert [out for out, _ in results] == alone
        for out, last in results:
            assert last.finish_reason == "stop"
            jsonschema.validate(json.loads(tok.decode(out)), PERSON)
    finally:
        engine.shutdown()
