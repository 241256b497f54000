"""The engine's forward pass through the Triton kernels (the CUDA path; here in the interpreter): RMSNorm, RoPE,
SiLU-and-mul and paged decode attention give the PyTorch path's logits, prefill then one-token decode steps."""
import torch

from tests.engine.helpers import make_runner, runner_logits, tiny_hf_model


def test_tiny_model_logits_match_the_torch_path(tmp_path, monkeypatch):
    from kernels import paged_attention, rms_norm, rope, silu_and_mul

    _, folder = tiny_hf_model("llama", tmp_path, seed=5, tie_word_embeddings=True)
    tokens = torch.randint(0, 512, (70,)).tolist()
    calls = []
    for mod, name in ((rms_norm, "rms_norm"), (rope, "rope"), (silu_and_mul, "silu_and_mul"),
                      (paged_attention, "paged_decode_attention")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _real=real, _n=name, **k: calls.append(_n) or _real(*a, **k))
    chunks = [64, 1, 1, 1, 1, 1, 1]  # a prefill chunk, then decode steps over a second page
    ours = runner_logits(make_runner(folder), tokens, chunks)
    assert {"rms_norm", "rope", "silu_and_mul", "paged_decode_attention"} <= set(calls)
    monkeypatch.setenv("NINFER_NO_TRITON", "1")
    calls.clear()
    ref = runner_logits(make_runner(folder), tokens, chunks)
    assert not calls
    err = (ours - ref).norm() / ref.norm()
    assert err < 1e-5, err
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
