"""Sampling: filters and penalties against transformers' logits processors and the OpenAI formula, parameter
validation, the empirical distribution of samples, seeds."""
from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from engine.errors import NInferError
from engine.sampling import SamplingParams, apply_penalties, filter_logits, sample_token

pytestmark = pytest.mark.usefixtures("one_thread")

V = 1000
SEEDS = range(4)


def random_logits(seed: int, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, generator=g) * scale


def hf_apply(processors, logits: torch.Tensor, input_ids: list[int] | None = None) -> torch.Tensor:
    ids = torch.tensor([input_ids or [0]])
    scores = logits[None].clone()
    for proc in processors:
        scores = proc(ids, scores)
    return scores[0]


def assert_same_filter(ours: torch.Tensor, ref: torch.Tensor) -> None:
    kept = torch.isfinite(ours)
    assert torch.equal(kept, torch.isfinite(ref)), (
        f"kept sets differ: ours {int(kept.sum())}, transformers {int(torch.isfinite(ref).sum())}")
    assert torch.all(ours[~kept] == float("-inf"))
    torch.testing.assert_close(ours[kept], ref[kept], rtol=1e-6, atol=1e-6)


FILTERS = [
    ("temperature", 0.3), ("temperature", 1.0), ("temperature", 1.7),
    ("top_k", 1), ("top_k", 50), ("top_k", 999),
    ("top_p", 0.05), ("top_p", 0.5), ("top_p", 0.9), ("top_p", 0.999),
    ("min_p", 0.01), ("min_p", 0.2), ("min_p", 0.9),
]


def _warper(kind: str, value):
    return {"temperature": TemperatureLogitsWarper, "top_k": TopKLogitsWarper, "top_p": TopPLogitsWarper,
            "min_p": MinPLogitsWarper}[kind](value)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kind,value", FILTERS, ids=[f"{k}={v}" for k, v in FILTERS])
def test_each_filter_matches_transformers(kind, value, seed):
    logits = random_logits(seed)
    ours = filter_logits(logits.clone(), SamplingParams(**{kind: value}))
    ref = hf_apply([_warper(kind, value)], logits)
    assert_same_filter(ours, ref)
    kept = int(torch.isfinite(ours).sum())
    if kind == "temperature":
        assert kept == V
    else:
        assert kept == int(torch.isfinite(ref).sum()) < V  # transformers keeps as many; something was removed
    if kind == "top_k":
        assert kept == value


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [
    (0.7, 40, 0.9, 0.05), (1.3, 200, 0.8, 0.0), (0.5, 0, 0.95, 0.1), (1.0, 10, 1.0, 0.3)])
def test_filters_combined_match_transformers(seed, temperature, top_k, top_p, min_p):
    logits = random_logits(seed)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    chain = [TemperatureLogitsWarper(temperature)]
    if top_k:
        chain.append(TopKLogitsWarper(top_k))
    if top_p < 1:
        chain.append(TopPLogitsWarper(top_p))
    if min_p:
        chain.append(MinPLogitsWarper(min_p))
    assert_same_filter(filter_logits(logits.clone(), params), hf_apply(chain, logits))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_matches_transformers(seed, penalty):
    logits = random_logits(seed)
    g = torch.Generator().manual_seed(100 + seed)
    prompt = torch.randint(0, V, (30,), generator=g).tolist()
    output = torch.randint(0, V, (20,), generator=g).tolist() + prompt[:5]  # repeats within and across
    ours = apply_penalties(logits.clone(), SamplingParams(repetition_penalty=penalty), prompt, output)
    ref = hf_apply([RepetitionPenaltyLogitsProcessor(penalty)], logits, prompt + output)
    torch.testing.assert_close(ours, ref, rtol=0, atol=0)
    assert not torch.equal(ours, logits)


def openai_penalties(logits: torch.Tensor, output: list[int], presence: float, frequency: float) -> torch.Tensor:
    """logits[j] -= c[j] * frequency + (c[j] > 0) * presence, with c[j] the count of j in the generated tokens."""
    out = logits.clone()
    for j in range(len(out)):
        c = output.count(j)
        out[j] = out[j] - c * frequency - (1.0 if c > 0 else 0.0) * presence
    return out


@pytest.mark.parametrize("presence,frequency", [(0.5, 0.0), (0.0, 0.7), (1.5, -0.4), (-2.0, 2.0)])
def test_presence_and_frequency_penalties_follow_the_openai_formula(presence, frequency):
    logits = random_logits(7)
    prompt = [1, 2, 3, 900]  # the prompt does not count
    output = [5, 5, 5, 9, 17, 17, 999, 3]
    params = SamplingParams(presence_penalty=presence, frequency_penalty=frequency)
    ours = apply_penalties(logits.clone(), params, prompt, output)
    torch.testing.assert_close(ours, openai_penalties(logits, output, presence, frequency), rtol=0, atol=1e-6)
    assert ours[1] == logits[1] and ours[900] == logits[900]
    # nothing generated yet: nothing changes
    assert torch.equal(apply_penalties(logits.clone(), params, prompt, []), logits)


def test_all_penalties_together():
    logits = random_logits(8)
    prompt, output = [4, 8, 15, 16], [23, 42, 42, 4]
    params = SamplingParams(repetition_penalty=1.2, presence_penalty=0.3, frequency_penalty=0.2)
    ref = hf_apply([RepetitionPenaltyLogitsProcessor(1.2)], logits, prompt + output)
    ref = openai_penalties(ref, output, 0.3, 0.2)
    torch.testing.assert_close(apply_penalties(logits.clone(), params, prompt, output), ref, rtol=0, atol=1e-6)


# ----- validation -----

BAD = [
    ("max_tokens", 0, "max_tokens"), ("temperature", -0.1, "temperature"), ("temperature", 2.1, "temperature"),
    ("top_p", 0.0, "top_p"), ("top_p", 1.5, "top_p"), ("top_k", -1, "top_k"), ("min_p", -0.1, "min_p"),
    ("min_p", 1.1, "min_p"), ("presence_penalty", 2.5, "presence_penalty"),
    ("presence_penalty", -2.1, "presence_penalty"), ("frequency_penalty", 3.0, "frequency_penalty"),
    ("repetition_penalty", 0.0, "repetition_penalty"), ("repetition_penalty", 11.0, "repetition_penalty"),
    ("logprobs", -1, "logprobs"), ("logprobs", 21, "logprobs"),
]


@pytest.mark.parametrize("field,value,word", BAD, ids=[f"{f}={v}" for f, v, _ in BAD])
def test_validate_rejects_out_of_range_values(field, value, word):
    with pytest.raises(NInferError, match="Invalid sampling parameters") as info:
        SamplingParams(**{field: value}).validate()
    assert word in str(info.value)


def test_validate_names_every_problem_and_accepts_the_edges():
    with pytest.raises(NInferError) as info:
        SamplingParams(temperature=5, top_p=2).validate()
    assert "temperature" in str(info.value) and "top_p" in str(info.value)
    for ok in [dict(), dict(temperature=0.0), dict(temperature=2.0), dict(top_p=1.0), dict(top_k=1),
               dict(min_p=1.0), dict(presence_penalty=-2.0, frequency_penalty=2.0), dict(repetition_penalty=10.0),
               dict(logprobs=0), dict(logprobs=20), dict(max_tokens=1)]:
        SamplingParams(**ok).validate()


# ----- sampling itself -----

PROBS = [0.1, 0.2, 0.3, 0.15, 0.25]
CHI2_CRITICAL_DF4_P001 = 18.47


def _draw(logits: torch.Tensor, params: SamplingParams, n: int) -> list[int]:
    g = params.make_generator()
    counts = [0] * len(logits)
    for _ in range(n):
        token, _ = sample_token(logits, params, [], [], g)
        counts[token] += 1
    return counts


def _chi2(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs))


def test_samples_follow_the_distribution():
    logits = torch.tensor([math.log(p) for p in PROBS]) + 1.5  # an offset changes nothing
    counts = _draw(logits, SamplingParams(temperature=1.0, seed=12345), 20_000)
    assert sum(counts) == 20_000
    assert _chi2(counts, PROBS) < CHI2_CRITICAL_DF4_P001, counts
    # the test has teeth: temperature 0.5 squares the probabilities, which it detects
    sharp = _draw(logits, SamplingParams(temperature=0.5, seed=12345), 20_000)
    squared = [p * p / sum(q * q for q in PROBS) for p in PROBS]
    assert _chi2(sharp, PROBS) > 10 * CHI2_CRITICAL_DF4_P001
    assert _chi2(sharp, squared) < CHI2_CRITICAL_DF4_P001, sharp


def test_filtered_tokens_are_never_sampled():
    logits = torch.tensor([math.log(p) for p in PROBS])
    counts = _draw(logits, SamplingParams(temperature=1.0, top_k=2, seed=1), 2000)
    assert counts[0] == counts[1] == counts[3] == 0 and counts[2] > 0 and counts[4] > 0
    counts = _draw(logits, SamplingParams(temperature=1.0, top_p=0.5, seed=2), 2000)
    assert counts[2] > 0 and counts[4] > 0 and sum(counts) == counts[2] + counts[4]


def test_greedy_ignores_the_generator_and_applies_penalties():
    logits = random_logits(3)
    best = int(logits.argmax())
    for seed in range(5):
        token, _ = sample_token(logits, SamplingParams(temperature=0, seed=seed), [], [],
                                SamplingParams(seed=seed).make_generator())
        assert token == best
    token, _ = sample_token(logits, SamplingParams(temperature=0, presence_penalty=2.0, frequency_penalty=2.0),
                            [], [best] * 50, torch.Generator())
    assert token != best


def test_logprobs_are_of_the_unfiltered_model_distribution():
    logits = random_logits(4)
    params = SamplingParams(temperature=0.5, top_k=3, logprobs=5, repetition_penalty=2.0, seed=0)
    _, logprobs = sample_token(logits, params, [1, 2, 3], [], params.make_generator())
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1))
    assert torch.equal(logits, random_logits(4))  # the caller's logits are left alone


def test_same_seed_same_samples_different_seed_different_samples():
    logits = random_logits(5, scale=1.0)

    def run(seed):
        params = SamplingParams(temperature=1.0, seed=seed)
        g = params.make_generator()
        return [sample_token(logits, params, [], [], g)[0] for _ in range(50)]

    assert run(42) == run(42)
    assert run(42) != run(43)
    assert run(None) != run(None)
