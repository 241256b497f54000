"""`--spec mtp` on a Qwen3.5-class hybrid: the checkpoint's MTP block (fc over [norm(embed(t+1)), norm(h_t)], one
gated attention layer, norm, the shared output layer; every norm zero-centred, 1 + w) on tiny random
Qwen3_5ForCausalLM checkpoints with `mtp.*` tensors added. Its drafts and logits equal the block written out in
torch here; greedy output with MTP is the output without it (the recurrent state rolled back on rejected drafts);
and an MTP block that computes what the target computes is accepted, with the acceptance reported."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from engine.build import build_engine
from engine.errors import ModelLoadError
from engine.sampling import SamplingParams
from tests.engine.helpers import collect, run_concurrently, wait_idle
from tests.engine.qwen35_models import VOCAB, perturb, save_for_engine, tiny_config
from tests.engine.spec_models import add_tensors

LAYER_OUT = ("o_proj.weight", "down_proj.weight", "linear_attn.out_proj.weight")  # what each layer adds to the stream


def make_checkpoint(root, name: str, layer_scale: float | None = None):
    """A tiny Qwen3_5ForCausalLM as tests/engine/test_qwen35.py builds it (8 layers 3:1, value heads > key heads,
    perturbed norms, A_log and dt_bias) plus one MTP block. layer_scale None: a random block. A number: every
    layer's output projections scaled by it (0: the target predicts from the last token alone, a bigram model),
    and a block that computes that bigram prediction (see mimic_mtp)."""
    from transformers import Qwen3_5ForCausalLM

    torch.manual_seed(0)
    hf = Qwen3_5ForCausalLM(tiny_config()).eval()
    perturb(hf)
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if layer_scale is not None and n.endswith(LAYER_OUT):
                p.mul_(layer_scale)
    folder = save_for_engine(hf, root / name)
    tensors = load_file(folder / "model.safetensors")
    layer = {n.removeprefix("model.layers.3."): t for n, t in tensors.items() if n.startswith("model.layers.3.")}
    g = torch.Generator().manual_seed(11)
    mtp = {f"mtp.layers.0.{n}": (0.3 if n.endswith("norm.weight") else 0.1) * torch.randn(t.shape, generator=g)
           for n, t in layer.items()}  # zero-centred norms: 1 + w scales by about 1
    mtp |= {"mtp.fc.weight": 0.1 * torch.randn(64, 128, generator=g),
            **{f"mtp.{n}.weight": 0.3 * torch.randn(64, generator=g)
               for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}}
    if layer_scale is not None:
        mtp |= mimic_mtp(tensors)
    add_tensors(folder, mtp)
    return hf, folder


def mimic_mtp(tensors) -> dict[str, torch.Tensor]:
    """A block whose layer adds nothing (its output projections zero) and whose fc passes the normalized embedding
    of t+1 through: x = e / rms(e) (pre_fc_norm_embedding w = 0 scales by 1 + 0). mtp.norm carries the target's
    final-norm weight, so its logits are lm_head(g * x / rms(x)), a positive multiple of the bigram target's
    lm_head(g * e / rms(e)) for the same token: the same argmax, if (and only if) both norms scale by 1 + w."""
    return {"mtp.fc.weight": torch.cat([torch.eye(64), torch.zeros(64, 64)], 1),
            "mtp.pre_fc_norm_embedding.weight": torch.zeros(64),
            "mtp.norm.weight": tensors["model.norm.weight"].clone(),
            "mtp.layers.0.self_attn.o_proj.weight": torch.zeros(64, 128),
            "mtp.layers.0.mlp.down_proj.weight": torch.zeros(64, 128)}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen35-mtp")
    return {"random": make_checkpoint(root, "random"), "bigram": make_checkpoint(root, "bigram", 0.0),
            "near-bigram": make_checkpoint(root, "near-bigram", 0.2)}


def tokens(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(2, VOCAB, n)]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


# ---------------------------------------------------------------- the block written out in torch

def _rms(x, w, eps):
    """Qwen3.5's RMSNorm: zero-centred weight, x / rms(x) * (1 + w)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)


def _rope(x, pos, rotated: int, theta: float):
    """RoPE (rotate-half pairs) on the first `rotated` dims of each head of x [T, heads, D]."""
    inv = 1.0 / theta ** (torch.arange(0, rotated, 2, dtype=torch.float64) / rotated)
    ang = (pos[:, None].double() * inv[None]).float()
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    r, rest = x[..., :rotated], x[..., rotated:]
    half = rotated // 2
    return torch.cat([r * cos + torch.cat([-r[..., half:], r[..., :half]], -1) * sin, rest], -1)


def _gated_attention_layer(x, w, cfg):
    """One Qwen3.5 full-attention decoder layer over x [T, H] (positions 0..T-1, causal), with plain SDPA."""
    eps, hd, nh, nkv = cfg.rms_norm_eps, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    rotated = int(hd * cfg.rope_parameters["partial_rotary_factor"])
    theta = cfg.rope_parameters["rope_theta"]
    t = x.shape[0]
    pos = torch.arange(t)
    h = _rms(x, w["input_layernorm.weight"], eps)
    qg = (h @ w["self_attn.q_proj.weight"].T).view(t, nh, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:].reshape(t, nh * hd)
    k = (h @ w["self_attn.k_proj.weight"].T).view(t, nkv, hd)
    v = (h @ w["self_attn.v_proj.weight"].T).view(t, nkv, hd)
    q = _rope(_rms(q, w["self_attn.q_norm.weight"], eps), pos, rotated, theta)
    k = _rope(_rms(k, w["self_attn.k_norm.weight"], eps), pos, rotated, theta)
    k, v = (z.repeat_interleave(nh // nkv, dim=1) for z in (k, v))
    attn = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
    x = x + (attn.transpose(0, 1).reshape(t, nh * hd) * torch.sigmoid(gate)) @ w["self_attn.o_proj.weight"].T
    h = _rms(x, w["post_attention_layernorm.weight"], eps)
    return x + (F.silu(h @ w["mlp.gate_proj.weight"].T) * (h @ w["mlp.up_proj.weight"].T)) @ w["mlp.down_proj.weight"].T


@torch.no_grad()
def reference_chain(hf, folder, prompt: list[int], first: int, k: int):
    """The MTP block over the prompt with transformers' hidden states after the final norm (as vLLM's Qwen3.5 MTP
    reads them), then a greedy chain of k, each step feeding the block's normed output back as the hidden state."""
    w = load_file(folder / "model.safetensors")
    layer = {n.removeprefix("mtp.layers.0."): t for n, t in w.items() if n.startswith("mtp.layers.0.")}
    cfg, eps = hf.config, hf.config.rms_norm_eps
    ids = torch.tensor([prompt + [first]])
    out = hf.model(ids).last_hidden_state[0]
    torch.testing.assert_close(hf.lm_head(out), hf(ids).logits[0])  # last_hidden_state is after the final norm
    hidden, nexts = list(out[:len(prompt)]), prompt[1:] + [first]
    drafts, logits = [], []
    for _ in range(k):
        e = _rms(w["model.embed_tokens.weight"][nexts], w["mtp.pre_fc_norm_embedding.weight"], eps)
        x = torch.cat([e, _rms(torch.stack(hidden), w["mtp.pre_fc_norm_hidden.weight"], eps)], -1)
        y = _rms(_gated_attention_layer(x @ w["mtp.fc.weight"].T, layer, cfg), w["mtp.norm.weight"], eps)
        logits.append(y[-1] @ w["lm_head.weight"].T)
        drafts.append(int(logits[-1].argmax()))
        hidden.append(y[-1])
        nexts.append(drafts[-1])
    return drafts, logits


def test_mtp_drafts_and_logits_match_the_block_written_in_torch(ckpt, one_thread):
    hf, folder = ckpt["random"]
    loaded = build_engine(folder, device="cpu", max_context=256, max_concurrency=1, spec="mtp", draft_tokens=4,
                          max_shared_prefixes=0)
    engine = loaded.engine  # stepped by hand on this thread
    prompt = tokens(1, 45)
    stream = engine.submit(prompt, greedy(50))
    engine.speculator.adaptive = False  # always the whole chain of 4
    proposer = engine.speculator.proposer
    runs, run = [], proposer._run
    proposer._run = lambda works, hidden: runs.append(run(works, hidden)) or runs[-1]  # keep each pass's logits
    engine._drain(block=False)
    seq = engine.scheduler.find(stream.request_id)
    while not seq.output:
        engine._step()
    at, drafts = proposer._pending[seq.request_id]
    assert at == len(seq.tokens) and len(drafts) == 4 and len(runs) == 4  # one catch-up pass, three chain steps
    ref_drafts, ref_logits = reference_chain(hf, folder, prompt, seq.output[0], 4)
    assert drafts == ref_drafts
    for ours, ref in zip(runs, ref_logits):
        torch.testing.assert_close(ours[0][-1], ref, rtol=1e-4, atol=1e-4)
    engine.abort(stream.request_id)
    engine._drain(block=False)


def _generate(folder, prompts, n: int, adaptive: bool = True, **kw):
    loaded = build_engine(folder, device="cpu", max_context=512, max_concurrency=2, max_shared_prefixes=0, **kw)
    engine = loaded.engine
    if engine.speculator is not None:
        engine.speculator.adaptive = adaptive
    try:
        engine.start()
        if len(prompts) == 1:
            outs = [collect(engine.submit(prompts[0], greedy(n)), timeout=300)[0]]
        else:
            outs = [out for out, _ in run_concurrently(engine, prompts, [greedy(n)] * len(prompts))]
        stats = wait_idle(engine)
        assert stats["pages_free"] == stats["pages_total"]
        return outs, stats
    finally:
        engine.shutdown()


@pytest.mark.parametrize("name", ["random", "near-bigram"])
def test_greedy_output_with_mtp_is_the_output_without_it(ckpt, name, one_thread):
    """128 greedy tokens, one request and two at once, every step drafting 3 (no adaptive pauses): rejected drafts
    roll the recurrent state back (the random block: nearly every step), partly accepted ones too (near-bigram)."""
    _, folder = ckpt[name]
    prompts = [tokens(2, 37), tokens(3, 90)]
    for batch in (prompts[:1], prompts):
        expected, _ = _generate(folder, batch, 128)
        got, s = _generate(folder, batch, 128, adaptive=False, spec="mtp", draft_tokens=3)
        assert got == expected
        assert s["spec_method"] == "mtp" and s["spec_drafted"] > 0 and s["state_rollbacks"] > 0
        if name == "near-bigram":
            assert s["spec_accepted"] > 0


def test_an_mtp_that_computes_the_targets_prediction_is_accepted(ckpt, one_thread):
    """The bigram target and its mimicking block (mimic_mtp): every draft is the target's own greedy token, so
    (up to float rounding at a near tie) all are accepted; the acceptance is reported as the other methods report it."""
    _, folder = ckpt["bigram"]
    expected, _ = _generate(folder, [tokens(4, 20)], 64)
    got, s = _generate(folder, [tokens(4, 20)], 64, adaptive=False, spec="mtp", draft_tokens=4)
    assert got == expected
    assert s["spec_drafted"] >= 4 * 10 and s["spec_acceptance"] == s["spec_accepted"] / s["spec_drafted"] >= 0.95
    assert s["spec_mean_accepted"] >= 3.5


def test_a_mis_shaped_mtp_tensor_is_refused_by_name(tmp_path, one_thread):
    """An MTP attention layer whose q_proj has no gate half (a llama-shaped layer) is named at load."""
    _, folder = make_checkpoint(tmp_path, "bad")
    add_tensors(folder, {"mtp.layers.0.self_attn.q_proj.weight": torch.zeros(128, 64)})
    with pytest.raises(ModelLoadError, match=r"mtp\.layers\.0\.self_attn\.q_proj\.weight has shape \[128, 64\].*"
                                             r"needs \[256, 64\]"):
        build_engine(folder, device="cpu", max_context=256, max_concurrency=1, spec="mtp")
