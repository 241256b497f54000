"""The engine's forward pass through the Triton kernels (the CUDA path; here in the interpreter): RMSNorm, RoPE,
SiLU-and-mul and paged decode attention give the PyTorch path's logits, prefill then one-token decode steps; over a
quantized KV cache, decode attention reads the codes in the kernel and gives the gather + torch path's tokens."""
import pytest
import torch

from tests.engine.helpers import make_runner, our_model, runner_logits, tiny_hf_model


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


def greedy(runner, prompt: list[int], steps: int, batch: int = 1) -> tuple[list[list[int]], torch.Tensor]:
    """`batch` copies of the prompt (each shifted by its row index, so lengths differ), prefilled, then decoded
    greedily `steps` tokens, all rows in one step: (tokens per row, the decode logits [steps, batch, vocab])."""
    from engine.runner import Work

    prompts = [prompt[:len(prompt) - b] for b in range(batch)]
    pages = [runner.pool.allocate(-(-(len(p) + steps) // runner.page_size)) for p in prompts]
    last = [runner.run([Work(p, 0, pg)])[0][-1] for p, pg in zip(prompts, pages)]
    tokens, logits = [[] for _ in prompts], []
    for i in range(steps):
        for b in range(batch):
            tokens[b].append(int(last[b].argmax()))
        outs = runner.run([Work([tokens[b][-1]], len(prompts[b]) + i, pages[b]) for b in range(batch)])
        last = [o[-1] for o in outs]
        logits.append(torch.stack(last))
    return tokens, torch.stack(logits)


@pytest.mark.parametrize("kv_dtype", ["k8v4", "rk4v4"])
def test_quantized_kv_decode_runs_the_quantized_kernel(tmp_path, monkeypatch, kv_dtype):
    """--kv-dtype k8v4 / rk4v4 (head dim 64: two int4 groups, GQA 2): decode steps of three sequences of different
    lengths read the quantized pages in the Triton kernel; same greedy tokens and logits as gather + torch."""
    from engine.runner import ModelRunner
    from kernels import paged_attention

    _, folder = tiny_hf_model("llama", tmp_path, seed=11, hidden_size=256, intermediate_size=256,
                              num_attention_heads=4, num_key_value_heads=2)
    calls = []
    real = paged_attention.paged_decode_attention
    monkeypatch.setattr(paged_attention, "paged_decode_attention",
                        lambda *a, **k: calls.append(k.get("k_scale") is not None) or real(*a, **k))
    # the decode steps run over a second page
    prompt = torch.randint(0, 512, (70,), generator=torch.Generator().manual_seed(0)).tolist()
    ours, ours_logits = greedy(ModelRunner(our_model(folder), 8, kv_dtype, 64), prompt, 4, batch=3)
    assert len(calls) == 4 * 2 and all(calls)  # steps x layers (the three rows in one call), every one with scales
    monkeypatch.setenv("NINFER_NO_TRITON", "1")
    calls.clear()
    ref, ref_logits = greedy(ModelRunner(our_model(folder), 8, kv_dtype, 64), prompt, 4, batch=3)
    assert not calls
    assert ours == ref
    err = (ours_logits - ref_logits).norm() / ref_logits.norm()
    # The two paths write the same codes from inputs that differ in float rounding (the kernels' sums run in another
    # order), so a value that lies at a rounding boundary of the format can get the neighbouring code: one step of
    # it, absmax/7.5 of the group for int4. Measured over seeded prompts: no flip, 0.6e-6 to 1e-6 (fp32 pages:
    # 1.1e-6); with flips up to 1.1e-4 (k8v4, 30 prompts) and 6.4e-4 (rk4v4, 12 prompts). A kernel that reads one
    # token short is 0.14 to 0.73 away.
    assert err < 2e-3, err


@pytest.mark.parametrize("kv_dtype", [torch.float32, "k8v4"], ids=["fp32", "k8v4"])
def test_windowed_decode_runs_the_kernel_over_sink_retrieved_and_window_pages(tmp_path, monkeypatch, kv_dtype):
    """A windowed sequence (--kv-window 128, retrieval covering the older pages, so both paths attend to the same
    tokens): its decode steps call the paged kernel with the tiered page list (sink + retrieved + window, not in
    position order), and the greedy tokens equal the gather + torch path's."""
    from engine.engine import Engine
    from engine.runner import ModelRunner
    from engine.sampling import SamplingParams
    from kernels import paged_attention

    _, folder = tiny_hf_model("llama", tmp_path, seed=7)
    model = our_model(folder)
    prompt = torch.randint(2, 512, (330,), generator=torch.Generator().manual_seed(3)).tolist()
    tables = []
    real = paged_attention.paged_decode_attention

    def spy(q, k, v, table, ctx, *a, **kw):
        tables.append((table[0].tolist(), int(ctx[0])))
        return real(q, k, v, table, ctx, *a, **kw)

    monkeypatch.setattr(paged_attention, "paged_decode_attention", spy)

    def generate():
        runner = ModelRunner(model, 40, kv_dtype, 64, host_pages=16)
        engine = Engine(runner, max_concurrency=1, prefill_chunk=128, max_context=1024, kv_window=128, max_shared_prefixes=0,
                        kv_retrieve=512).start()
        try:
            return [o.token_ids for o in engine.submit(prompt, SamplingParams(max_tokens=4, temperature=0.0))]
        finally:
            engine.shutdown()

    ours = generate()
    decode_tables = [t for t, ctx in tables if ctx > 128]
    assert decode_tables and all(len(set(t)) == len(t) for t in decode_tables)
    assert any(t != sorted(t) for t in decode_tables)  # staged retrieved pages sit between the sink and the window
    monkeypatch.setenv("NINFER_NO_TRITON", "1")
    tables.clear()
    assert generate() == ours and not tables


def test_a_hybrid_runs_the_gated_delta_kernels_and_matches_the_torch_path(tmp_path, monkeypatch):
    """A tiny Qwen3.5 hybrid: chunked prefill of two prompts (gdn_chunked), then batched decode steps of both
    (causal_conv_update, gdn_recurrent over their state slots) through the Triton kernels give the PyTorch path's
    logits and tokens."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from engine.memory.state import SeqState
    from engine.model.loader import load_weights
    from engine.model.registry import build_model
    from engine.runner import ModelRunner, Work
    from kernels import gated_delta, gated_delta_chunk

    cfg = Qwen3_5TextConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
                            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                            layer_types=["linear_attention"] * 3 + ["full_attention"], tie_word_embeddings=False)
    torch.manual_seed(3)
    Qwen3_5ForCausalLM(cfg).save_pretrained(tmp_path / "hybrid")
    weights = load_weights(tmp_path / "hybrid")[1]
    calls = []
    for mod, name in ((gated_delta, "gdn_recurrent"), (gated_delta, "causal_conv_update"),
                      (gated_delta_chunk, "gdn_chunked")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _real=real, _n=name, **k: calls.append(_n) or _real(*a, **k))
    prompts = [torch.randint(0, 256, (n,)).tolist() for n in (70, 9)]

    def run():
        model = build_model(weights, torch.float32, torch.device("cpu"))
        runner = ModelRunner(model, 6, torch.float32, 64, state_slots=2)
        seqs = [(p, runner.pool.allocate(3), SeqState(runner.state.allocate())) for p in prompts]
        rows = [runner.run([Work(p, 0, pg, "last", st)])[0] for p, pg, st in seqs]
        for step in range(3):
            tokens = [int(r[-1].argmax()) for r in rows]
            rows = runner.run([Work([t], len(p) + step, pg, "last", st) for t, (p, pg, st) in zip(tokens, seqs)])
        return torch.cat(rows)

    ours = run()
    assert {"gdn_recurrent", "causal_conv_update", "gdn_chunked"} <= set(calls)
    monkeypatch.setenv("NINFER_NO_TRITON", "1")
    calls.clear()
    ref = run()
    assert not calls
    assert (ours - ref).norm() / ref.norm() < 1e-4
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
