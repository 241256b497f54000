"""Mixture-of-experts Gated-DeltaNet hybrids (Qwen3.5/3.6-MoE, Qwen3-Next MoE) against transformers on tiny seeded
random checkpoints (fp32, experts_implementation eager): 7 experts (odd), top 3, a shared expert, routers far from
uniform; the same weights as HF folders (per-expert and the published fused layout) and as qwen35moe GGUF files."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from engine.build import build_engine
from engine.memory.state import SeqState
from engine.model.config import MoEConfig
from engine.model.loader import load_weights
from engine.model.registry import build_model
from engine.runner import ModelRunner, Work
from engine.sampling import SamplingParams
from kernels.quant import QuantizedWeight
from tests.engine.helpers import hf_logits, rel_err, run_concurrently, wait_idle
from tests.engine.qwen35_models import VOCAB, perturb, save_for_engine
from tests.engine.qwen35_moe_models import fused_state, tiny_moe_checkpoint, tiny_qwen3_next_moe, write_moe_gguf

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return tiny_moe_checkpoint(tmp_path_factory.mktemp("moe") / "tiny-qwen35-moe", seed=0)


@pytest.fixture(scope="module")
def model(moe):
    return build_model(load_weights(moe[1])[1], torch.float32, CPU)


def tokens(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(2, VOCAB, n)]


def chunked_logits(model, ids: list[int], chunks: list[int]) -> torch.Tensor:
    runner = ModelRunner(model, 4, torch.float32, 64, state_slots=1)
    pages, state, rows, start = runner.pool.allocate(-(-len(ids) // 64) + 1), SeqState(runner.state.allocate()), [], 0
    for n in chunks:
        rows.append(runner.run([Work(ids[start:start + n], start, pages, "all", state)])[0])
        start += n
    return torch.cat(rows)


def test_the_config_reads_the_experts(model):
    cfg = model.cfg
    assert cfg.arch == "qwen35" and cfg.moe == MoEConfig(7, 3, 32, 64, True, (0, 1, 2, 3))
    assert cfg.intermediate_size == 0 and cfg.layer_kinds == ("recurrent",) * 3 + ("attention",)
    for layer in model.layers:
        assert len(layer.moe.experts) == 7 and layer.moe.router.dtype == torch.float32
        assert not hasattr(layer, "gate_up")


@pytest.mark.parametrize("chunks", [[131], [37, 64, 30], [1] * 24])
def test_logits_match_transformers(model, moe, chunks):
    """Prefill (tokens grouped by expert), chunked prefill at odd sizes, and one-token decode steps."""
    ids = tokens(1, sum(chunks))
    assert rel_err(chunked_logits(model, ids, chunks), hf_logits(moe[0], ids)) <= 1e-4


def test_the_published_fused_layout_loads_the_same_tensors(moe, tmp_path):
    """Qwen3_5MoeForConditionalGeneration: text_config, model.language_model., 3-D gate_up_proj / down_proj, a vision
    tower beside (not loaded)."""
    hf, folder = moe
    published = tmp_path / "published"
    published.mkdir()
    for f in folder.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, published / f.name)
    text = json.loads((folder / "config.json").read_text())
    (published / "config.json").write_text(json.dumps({"architectures": ["Qwen3_5MoeForConditionalGeneration"],
                                                       "model_type": "qwen3_5_moe", "text_config": text}))
    state = fused_state(hf) | {"model.visual.patch_embed.weight": torch.ones(4, 4)}
    assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, str(published / "model.safetensors"))
    ours, ref = load_weights(published)[1], load_weights(folder)[1]
    assert ours.config.moe == ref.config.moe and ours.tensors.keys() == ref.tensors.keys()
    assert all(torch.equal(ours.tensors[n], ref.tensors[n]) for n in ref.tensors)


def test_one_token_runs_its_k_experts_and_a_batch_one_matmul_per_expert(model):
    """The block reads only the experts the router picks: for one token, k expert calls; for six tokens, one call
    per expert any token picked, over exactly the tokens that picked it; the output equals a dense reference that
    runs every expert on every token, weighted by the renormalised top-k softmax (zero elsewhere)."""
    block = model.layers[1].moe
    calls: list[tuple[int, int]] = []

    class Counted:
        def __init__(self, e, inner):
            self.e, self.inner = e, inner

        def __call__(self, x):
            calls.append((self.e, x.shape[0]))
            return self.inner(x)

    torch.manual_seed(3)
    experts = block.experts
    try:
        block.experts = [Counted(e, x) for e, x in enumerate(experts)]
        for rows in (1, 6):
            h = torch.randn(rows, 64)
            calls.clear()
            out = block(h)
            probs = torch.softmax(h @ block.router.T, -1)
            top, ids = probs.topk(3, -1)
            weights = torch.zeros_like(probs).scatter(1, ids, top / top.sum(-1, keepdim=True))
            dense = sum(weights[:, e:e + 1] * experts[e](h) for e in range(7))
            shared = torch.sigmoid(h @ block.shared_gate.T) * block.shared(h)
            assert rel_err(out, dense + shared) <= 1e-5
            picked = torch.bincount(ids.reshape(-1), minlength=7)
            assert sorted(calls) == [(e, int(n)) for e, n in enumerate(picked) if n]
    finally:
        block.experts = experts


def test_bytes_per_token_count_the_routed_experts_only(model):
    """weight_bytes (ninfer-bench's GB/s) reads k of the 7 experts per layer: the whole model's float32 bytes, less
    the embedding table and the 4 experts per layer a token skips."""
    cfg, m = model.cfg, model.cfg.moe
    total = 4 * cfg.num_parameters() - 4 * cfg.vocab_size * cfg.hidden_size
    skipped = cfg.num_layers * (m.num_experts - m.top_k) * 3 * cfg.hidden_size * m.expert_size * 4
    assert model.weight_bytes() == total - skipped


@pytest.mark.parametrize("fmt,bound", [("int8", 1e-2), ("int4", 1e-1)])  # measured 4.3e-3, 5.2e-2
def test_low_bit_experts_keep_a_float32_router(moe, model, fmt, bound):
    weights = load_weights(moe[1])[1]
    low = build_model(weights, torch.float32, CPU, fmt)
    layer = low.layers[0].moe
    assert isinstance(layer.experts[0].gate_up.weight, QuantizedWeight) and layer.router.dtype == torch.float32
    assert torch.equal(layer.router, model.layers[0].moe.router)
    ids = tokens(5, 70)
    ours, ref = chunked_logits(low, ids, [70]), hf_logits(moe[0], ids)
    assert ((ours - ref).norm() / ref.norm()).item() < bound


# ---------------------------------------------------------------- Qwen3-Next: dense and MoE layers, norm_topk_prob

@pytest.fixture(scope="module", params=[True, False], ids=["renormalised", "not-renormalised"])
def qwen3_next_moe(request, tmp_path_factory):
    return tiny_qwen3_next_moe(tmp_path_factory.mktemp("next-moe") / "tiny-qwen3-next-moe", request.param)


def test_qwen3_next_moe_matches_transformers(qwen3_next_moe):
    hf, folder = qwen3_next_moe
    model = build_model(load_weights(folder)[1], torch.float32, CPU)
    assert model.cfg.moe.layers == (0, 2, 3, 4, 6, 7) and model.cfg.moe.norm_topk == hf.config.norm_topk_prob
    assert model.layers[1].moe is None and model.layers[2].moe is not None
    ids = tokens(6, 97)
    ours, ref = chunked_logits(model, ids, [50, 47]), hf_logits(hf, ids)
    assert rel_err(ours, ref) <= 1e-4
    # the flag matters at this size: the other routing moves the logits far beyond the bound
    for layer in model.layers:
        if layer.moe is not None:
            layer.moe.renormalize = not hf.config.norm_topk_prob
    assert rel_err(chunked_logits(model, ids, [97]), ref) > 1e-3


# ---------------------------------------------------------------- qwen35moe GGUF

@pytest.mark.parametrize("merged", [False, True], ids=["gate-and-up", "gate_up_exps"])
def test_gguf_logits_match_transformers(moe, model, tmp_path, merged):
    hf, _ = moe
    path = write_moe_gguf(hf, tmp_path / "tiny-qwen35moe-F32.gguf", merged=merged)
    weights = load_weights(path)[1]
    assert weights.config.moe == model.cfg.moe and weights.config.layer_kinds == model.cfg.layer_kinds
    ids = tokens(7, 131)
    ours = chunked_logits(build_model(weights, torch.float32, CPU), ids, [64, 67])
    assert rel_err(ours, hf_logits(hf, ids)) <= 1e-4


@torch.no_grad()
def _q8_0_twin(hf):
    """transformers on the weights a Q8_0 file holds (every linear weight and expert rounded through Q8_0; the router
    and the shared gate float32)."""
    import copy

    import gguf
    from tests.engine.test_qwen35_formats import q8_0_roundtrip

    twin = copy.deepcopy(hf)
    state = twin.state_dict()
    kept = ("mlp.gate.weight", "mlp.shared_expert_gate.weight")  # F32 in the file, as the converter writes them
    flat = q8_0_roundtrip({n: t for n, t in state.items() if t.ndim == 2 and not n.endswith(kept)}, twin.config)
    for name, t in state.items():
        if name in flat:
            t.copy_(flat[name])
        elif ".mlp.experts." in name:  # stacked experts: blocks of 32 along each row
            q = gguf.quants.quantize(t.numpy(), gguf.GGMLQuantizationType.Q8_0)
            t.copy_(torch.from_numpy(gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0).reshape(t.shape)))
    return twin


def test_q8_0_gguf_experts_decoded_and_kept_as_stored(moe, tmp_path):
    hf, _ = moe
    path = write_moe_gguf(hf, tmp_path / "tiny-qwen35moe-Q8_0.gguf", q8_0=True)
    twin, ids = _q8_0_twin(hf), tokens(8, 90)
    ref = hf_logits(twin, ids)
    decoded = build_model(load_weights(path)[1], torch.float32, CPU)
    assert rel_err(chunked_logits(decoded, ids, [90]), ref) <= 1e-4
    native = load_weights(path, native=True)[1]
    expert = native.tensors["model.layers.2.mlp.experts.6.down_proj.weight"]
    assert isinstance(expert, QuantizedWeight) and expert.format == "int8" and expert.shape == (64, 32)
    assert native.tensors["model.layers.2.mlp.gate.weight"].dtype == torch.float32
    model = build_model(native, torch.float32, CPU, "int8", keep_native=True)
    ours = chunked_logits(model, ids, [90])
    assert ((ours - ref).norm() / ref.norm()).item() < 2e-2  # the CPU int8 kernels round activations to bf16


# ---------------------------------------------------------------- the engine

def test_greedy_batched_equals_alone_and_transformers(moe):
    """Four prompts decoded together give the tokens each gives alone, and each token is transformers' argmax
    after the prompt and the tokens before it (greedy decoding, teacher-forced in one oracle pass)."""
    hf, folder = moe
    loaded = build_engine(folder, device="cpu", max_context=512, max_concurrency=4)
    try:
        engine = loaded.engine.start()
        prompts = [tokens(10 + i, 20 + 41 * i) for i in range(4)]
        greedy = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
        together = [out for out, _ in run_concurrently(engine, prompts, [greedy] * 4)]
        alone = [run_concurrently(engine, [p], [greedy])[0][0] for p in prompts]
        assert together == alone
        for p, out in zip(prompts, together):
            assert len(out) == 64
            assert hf_logits(hf, p + out)[len(p) - 1:-1].argmax(-1).tolist() == out
        idle = wait_idle(engine)
        assert idle["pages_free"] == idle["pages_total"]
    finally:
        loaded.engine.shutdown()
