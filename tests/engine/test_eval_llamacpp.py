"""ninfer-eval kld --llama-cpp: where llama-cpp-python is missing the check says how to get it or measure llama.cpp's
server instead; where present, its full-vocabulary logits are compared like the engine's. The package is stood in
for by a module with its Llama API (reset, eval, scores) computing the logits with transformers, an independent
implementation: the KLD is ~0 against the engine's reference on the same model, and a perturbed model's KLD is the
one the engine itself measures for that model."""
from __future__ import annotations

import json
import sys
import types

import numpy as np
import torch

from engine.tools.eval import cli
from tests.engine.test_eval import tiny  # noqa: F401  (the module's fixture: tiny model, perturbed copy, text)


def _llama_cpp_on_transformers() -> types.ModuleType:
    from transformers import AutoModelForCausalLM

    class Llama:
        def __init__(self, model_path, n_ctx, logits_all, verbose, **kw):
            assert logits_all, "every position's logits are needed"
            self.model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32).eval()
            self.n_ctx = n_ctx
            self.scores = np.zeros((n_ctx, self.model.config.vocab_size), dtype=np.float32)

        def reset(self):
            self.scores[:] = 0

        def eval(self, tokens):
            with torch.no_grad():
                out = self.model(torch.tensor([tokens])).logits[0]
            self.scores[:len(tokens)] = out.numpy()

    return types.SimpleNamespace(Llama=Llama, __version__="stand-in")


def _kld(tmp_path, *argv) -> dict:
    out = tmp_path / "s.json"
    assert cli.main(["kld", *argv, "--ctx", "128", "--max-context", "512", "--device", "cpu", "--no-progress",
                     "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_llama_cpp_is_compared_over_the_full_vocabulary(tiny, tmp_path, one_thread, monkeypatch):  # noqa: F811
    folder, broken, text = tiny
    monkeypatch.setitem(sys.modules, "llama_cpp", _llama_cpp_on_transformers())
    same = _kld(tmp_path, str(folder), "--text", str(text), "--llama-cpp")
    assert same["candidate"]["weights"] == "llama.cpp" and same["positions"] == 3 * 127
    assert same["kld_max"] < 1e-5 and same["top1_agreement"] > 0.99
    peer = _kld(tmp_path, str(broken), "--text", str(text), "--llama-cpp", "--ref", str(folder))
    engine = _kld(tmp_path, str(broken), "--text", str(text), "--weight-dtype", "fp32", "--ref", str(folder))
    assert peer["kld_mean"] > 0.1
    assert abs(peer["kld_mean"] - engine["kld_mean"]) < 1e-3 * engine["kld_mean"]


def test_a_missing_llama_cpp_says_how_to_get_it(tiny, monkeypatch, capsys):  # noqa: F811
    folder, _, text = tiny
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails as when not installed
    assert cli.main(["kld", str(folder), "--text", str(text), "--ctx", "128", "--llama-cpp", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "llama-cpp-python package, which is not installed" in err
    assert "pip install llama-cpp-python" in err and "--url" in err
