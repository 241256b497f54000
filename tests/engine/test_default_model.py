"""The embedded SmolLM2-135M-Instruct GGUF: our forward pass agrees with transformers' reading of the same file,
and the model answers a simple question."""
from __future__ import annotations

import pytest
import torch

from engine.model.default import default_model_path
from engine.runner import ModelRunner
from engine.sampling import SamplingParams
from tests.engine.helpers import hf_logits, rel_err, runner_logits

pytestmark = pytest.mark.slow

TEXT = (
    "The Amazon rainforest covers much of the Amazon basin of South America. This basin encompasses seven million "
    "square kilometers, of which five and a half million square kilometers are covered by the rainforest. The "
    "region includes territory belonging to nine nations. The majority of the forest is contained within Brazil, "
    "with sixty percent of the rainforest, followed by Peru with thirteen percent, Colombia with ten percent, and "
    "with minor amounts in Bolivia, Ecuador, French Guiana, Guyana, Suriname, and Venezuela. The rainforest "
    "represents over half of the planet's remaining rainforests, and comprises the largest and most biodiverse "
    "tract of tropical rainforest in the world, with an estimated three hundred and ninety billion individual "
    "trees divided into sixteen thousand species. Scientists have long tried to understand how such a rich "
    "ecosystem formed. Some believe that the climate of the region remained stable for millions of years, while "
    "others argue that changes in rivers and mountains created isolated areas where new species could develop. "
    "Today, the forest faces serious threats from logging, farming and fires, and many people are working to "
    "protect it for future generations."
)


def test_teacher_forced_top1_agrees_with_transformers(default_fp32_engine, default_hf_oracle):
    tok = default_fp32_engine.tokenizer
    ids = tok.encode(TEXT)
    assert len(ids) >= 200
    runner = ModelRunner(default_fp32_engine.engine.runner.model, 8, default_fp32_engine.dtype, 64)
    ours = runner_logits(runner, ids)
    ref = hf_logits(default_hf_oracle, ids)
    assert ours.shape == ref.shape == (len(ids), 49152)
    agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree >= 0.99, f"top-1 agreement {agree:.3f} over {len(ids)} positions"
    # both dequantize the same Q4_1 tensors to fp32, so the logits themselves are close too
    assert rel_err(ours, ref) <= 1e-3
    # and the model predicts this text far better than chance (the weights are not scrambled)
    nll = -ours[:-1].log_softmax(-1).gather(1, torch.tensor(ids[1:])[:, None]).mean().item()
    assert nll < 4.0, f"mean negative log-likelihood {nll:.2f}"


def test_config_agrees_with_transformers(default_fp32_engine, default_hf_oracle):
    ours, theirs = default_fp32_engine.config, default_hf_oracle.config
    assert ours.arch == "llama"
    assert ours.vocab_size == theirs.vocab_size == 49152
    assert ours.hidden_size == theirs.hidden_size
    assert ours.num_layers == theirs.num_hidden_layers
    assert ours.num_heads == theirs.num_attention_heads
    assert ours.num_kv_heads == theirs.num_key_value_heads
    assert ours.intermediate_size == theirs.intermediate_size
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"]
    assert ours.tie_embeddings
    assert default_fp32_engine.path == default_model_path()


def test_chat_answer_names_paris(default_fp32_engine):
    tok = default_fp32_engine.tokenizer
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}])
    out = default_fp32_engine.engine.generate(prompt, SamplingParams(temperature=0, max_tokens=48))
    answer = tok.decode(out)
    assert "Paris" in answer, answer
