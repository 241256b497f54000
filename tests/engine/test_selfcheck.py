"""The load-time self-check of lossy formats on the default model (SmolLM2-135M, Q4_1): re-quantizing it to
ternary destroys it (top-1 agreement 0%) and is refused naming the numbers unless --allow-lossy-format; int8
weights and quantized KV pass and their numbers are logged; the file's own format runs no check; a reference that
would not fit in memory is skipped, saying so."""
from __future__ import annotations

import logging

import pytest
import torch

from engine import selfcheck
from engine.errors import NInferError
from engine.model.default import default_model_path
from engine.model.loader import load_weights
from engine.model.registry import build_model
from engine.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def default():
    path, weights = load_weights(default_model_path(), native=True)
    return weights, Tokenizer.from_gguf(path)


def candidate(weights, fmt):
    return build_model(weights, torch.float32, torch.device("cpu"), fmt)


def test_ternary_weights_are_refused_with_the_numbers(default):
    weights, tok = default
    with pytest.raises(NInferError) as err:
        selfcheck.run(weights, candidate(weights, "ternary"), "ternary", torch.float32, tok, allow=False)
    text = str(err.value)
    assert "--weight-dtype ternary (the file stores Q4_1)" in text and "top-1 agreement" in text
    assert "--allow-lossy-format" in err.value.remedy and "--weight-dtype auto" in err.value.remedy


def test_allow_lossy_format_loads_it_and_warns(default, caplog):
    weights, tok = default
    with caplog.at_level(logging.WARNING, logger="ninfer.selfcheck"):
        check = selfcheck.run(weights, candidate(weights, "ternary"), "ternary", torch.float32, tok, allow=True)
    assert check.broken and check.top1 < selfcheck.MIN_TOP1
    assert "loaded anyway: --allow-lossy-format" in caplog.text


@pytest.mark.parametrize("fmt, kv", [("int8", torch.float32), ("int4", "k8v4")])
def test_near_lossless_formats_pass_and_are_logged(default, caplog, fmt, kv):
    weights, tok = default
    with caplog.at_level(logging.INFO, logger="ninfer.selfcheck"):
        check = selfcheck.run(weights, candidate(weights, fmt), fmt, kv, tok, allow=False)
    assert not check.broken and check.top1 > 0.9 and check.kl_mean < 0.1 and check.tokens > 200
    assert f"self-check of {check.what}" in caplog.text and "top-1 agreement" in caplog.text
    assert ("--kv-dtype k8v4" in check.what) == (kv == "k8v4")
    assert ("--weight-dtype" in check.what) == (fmt != "int4")  # int4 is how the file's Q4_1 runs


def test_the_files_own_format_runs_no_check(default):
    weights, tok = default
    assert selfcheck.run(weights, candidate(weights, "int4"), "int4", torch.float32, tok, allow=False) is None


def test_a_reference_too_big_for_memory_is_skipped_saying_so(default, caplog, monkeypatch):
    weights, tok = default

    class Tight:
        available = 1024

    monkeypatch.setattr(selfcheck.psutil, "virtual_memory", lambda: Tight)
    with caplog.at_level(logging.WARNING, logger="ninfer.selfcheck"):
        assert selfcheck.run(weights, candidate(weights, "int8"), "int8", torch.float32, tok, allow=False) is None
    assert "self-check of --weight-dtype int8" in caplog.text and "skipped" in caplog.text


def test_build_engine_refuses_ternary_on_the_default_model(engine_for):
    with pytest.raises(NInferError, match="breaks this model"):
        engine_for(None, device="cpu", weight_dtype="ternary", max_context=512)
