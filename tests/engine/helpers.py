"""Builders shared by the engine tests: tiny random transformers models, GGUF files written from them, runners
and engines over them, and reference (transformers) forward passes."""
from __future__ import annotations

import math
import threading
import time
from pathlib import Path

import numpy as np
import torch

from engine.engine import Engine
from engine.model.llama import LlamaModel
from engine.model.loader import load_weights
from engine.runner import ModelRunner, Work

PAGE = 64

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}


def tiny_config(arch: str = "llama", **overrides):
    """A small transformers config: vocab 512, hidden 64, 2 layers, 4 heads, 2 KV heads."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[arch]
    kw = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=False,
              initializer_range=0.1, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if arch == "qwen3":
        kw["head_dim"] = 32  # not hidden / heads (16)
    kw.update(overrides)
    return cls(**kw)


def tiny_hf_model(arch: str, tmp_path: Path, seed: int = 0, name: str | None = None, **overrides):
    """A random transformers model (fp32, eager attention, eval mode), saved as safetensors into a folder.
    Norm weights and biases are randomized too, so that none of them is a no-op. Returns (hf_model, folder)."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(arch, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif pname.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    folder = Path(tmp_path) / (name or f"{arch}-{seed}")
    model.save_pretrained(folder, safe_serialization=True)
    return model, folder


def add_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level tokenizer over the tiny vocabulary ("<unk>", "<eos>", "w2", "w3", ...), saved into the folder so
    that Tokenizer.from_folder and build_engine can load it; "w5 w17" encodes to [5, 17]."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>").save_pretrained(folder)


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to Llama q/k rows (interleaved RoPE layout)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_freq_factors(head_dim: int, theta: float, s: dict) -> np.ndarray:
    """llama.cpp's converter: llama3 RoPE scaling as factors dividing each rotary frequency."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old = s["original_max_position_embeddings"]
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


_GGUF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_tensor_name(hf: str) -> str:
    glob = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}
    if hf in glob:
        return glob[hf]
    _, _, idx, rest = hf.split(".", 3)
    return f"blk.{idx}.{_GGUF_LAYER_NAMES[rest]}"


def write_tiny_gguf(hf_model, path: Path, arch: str | None = None, *, overrides: dict | None = None,
                    skip: tuple[str, ...] = (), reshape: dict | None = None) -> Path:
    """Writes a transformers model's weights (F32) as a GGUF the way llama.cpp's converter lays it out:
    GGUF tensor names, `<arch>.*` metadata, Llama q/k rows permuted. `overrides` replaces tensors (GGUF names; a
    value (uint8 blocks, GGMLQuantizationType) is written as quantized blocks), `skip` leaves GGUF tensors out,
    `arch` can claim another architecture."""
    import gguf

    cfg = hf_model.config
    real_arch = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}[cfg.model_type]
    arch = arch or real_arch
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{real_arch}")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_vocab_size(cfg.vocab_size)
    tensors = {}
    for name, t in hf_model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        arr = t.detach().float().numpy().copy()
        if real_arch == "llama" and name.endswith("q_proj.weight"):
            arr = llama_cpp_permute(arr, cfg.num_attention_heads)
        elif real_arch == "llama" and name.endswith("k_proj.weight"):
            arr = llama_cpp_permute(arr, cfg.num_key_value_heads)
        tensors[gguf_tensor_name(name)] = arr
    rope = cfg.rope_parameters or {}
    if rope.get("rope_type") == "llama3":  # llama.cpp stores llama3 scaling as per-frequency factors
        tensors["rope_freqs.weight"] = llama3_freq_factors(head_dim, rope["rope_theta"], rope)
    tensors.update(overrides or {})
    for name, arr in tensors.items():
        if name in skip:
            continue
        if isinstance(arr, tuple):  # (uint8 blocks [rows, bytes], GGMLQuantizationType): stored as they are
            blocks, qtype = arr
            w.add_tensor(name, np.ascontiguousarray(blocks, dtype=np.uint8), raw_dtype=qtype)
        else:
            w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def our_model(path: Path, dtype=torch.float32) -> LlamaModel:
    _, weights = load_weights(path)
    return LlamaModel(weights, dtype, torch.device("cpu"))


def make_runner(model_or_path, num_pages: int = 16) -> ModelRunner:
    model = model_or_path if isinstance(model_or_path, LlamaModel) else our_model(model_or_path)
    return ModelRunner(model, num_pages, torch.float32, PAGE)


def make_engine(model_or_runner, *, num_pages: int = 16, max_concurrency: int = 4, prefill_chunk: int = 512,
                max_context: int | None = None, eos_ids=frozenset()) -> Engine:
    """A started Engine over a runner with its own page pool (stop it with .shutdown())."""
    runner = model_or_runner if isinstance(model_or_runner, ModelRunner) else make_runner(model_or_runner, num_pages)
    ctx = max_context or runner.pool.num_pages * runner.pool.page_size
    return Engine(runner, max_concurrency=max_concurrency, prefill_chunk=prefill_chunk, max_context=ctx,
                  eos_ids=frozenset(eos_ids), max_shared_prefixes=0).start()


def pages_for(n_tokens: int, pool) -> list[int]:
    return pool.allocate(-(-n_tokens // pool.page_size))


def runner_logits(runner: ModelRunner, tokens: list[int], chunks: list[int] | None = None,
                  pages: list[int] | None = None) -> torch.Tensor:
    """Logits for every position of `tokens`, computed in chunks of the given sizes (one shot when None)."""
    own = pages is None
    if own:
        pages = pages_for(len(tokens) + 1, runner.pool)
    chunks = chunks or [len(tokens)]
    out, start = [], 0
    try:
        while start < len(tokens):
            n = min(chunks[min(len(out), len(chunks) - 1)], len(tokens) - start)
            out.append(runner.run([Work(tokens[start:start + n], start, pages, "all")])[0].clone())
            start += n
    finally:
        if own:
            runner.pool.deallocate(pages)
    return torch.cat(out)


@torch.no_grad()
def hf_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    """transformers' logits for every position, [len, vocab], fp32."""
    return hf_model(torch.tensor([tokens]), use_cache=False).logits[0].float()


@torch.no_grad()
def hf_greedy(hf_model, prompt: list[int], n: int) -> list[int]:
    out = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                            do_sample=False, max_new_tokens=n, min_new_tokens=n, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max())


def random_prompt(rng, vocab: int, n: int) -> list[int]:
    return [int(rng.integers(0, vocab)) for _ in range(n)]


def collect(stream, timeout: float = 60.0):
    """Every output of a stream: (token ids, last RequestOutput)."""
    tokens, last = [], None
    while last is None or not last.finished:
        last = stream.get(timeout=timeout)
        tokens.extend(last.token_ids)
    return tokens, last


def run_concurrently(engine: Engine, prompts: list[list[int]], params_list) -> list[tuple[list[int], object]]:
    """Submits all requests at once, collects each in its own thread."""
    streams = [engine.submit(p, sp) for p, sp in zip(prompts, params_list)]
    results: list = [None] * len(streams)

    def worker(i):
        results[i] = collect(streams[i])

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(streams))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results


def wait_idle(engine: Engine, timeout: float = 30.0) -> dict:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = engine.stats()
        if s["running"] == 0 and s["waiting"] == 0 and engine._commands.empty():
            time.sleep(0.05)
            s = engine.stats()
            if s["running"] == 0 and s["waiting"] == 0:
                return s
        time.sleep(0.02)
    raise AssertionError(f"engine did not go idle: {engine.stats()}")


def consume_with_aborts(stream, mode: str, after_tokens: int, delay: float, results: dict, failures: dict,
                        timeout: float = 60) -> None:
    """Reads a request's stream, aborting it by `mode`: "random_time" (after `delay` seconds), "mid_decode" (once
    `after_tokens` tokens arrived) or anything else (never). Puts (tokens, last output) into results, or the error
    into failures, under the request id."""
    tokens, last = [], None
    try:
        if mode == "random_time":
            time.sleep(delay)
            stream.abort()
        while last is None or not last.finished:
            last = stream.get(timeout=timeout)
            tokens.extend(last.token_ids)
            if mode == "mid_decode" and len(tokens) >= after_tokens and not last.finished:
                stream.abort()
        results[stream.request_id] = (tokens, last)
    except Exception as e:
        failures[stream.request_id] = f"{type(e).__name__}: {e} after {len(tokens)} tokens"


def abort_storm(engine: Engine, prompt_of, params_of, n: int = 200, seed: int = 7, at_once: int = 8) -> dict:
    """Submits `n` requests (prompt_of(i, rng), params_of(rng)), at most `at_once` read at a time, a third aborted
    at a random time, a third after a few tokens, a third never; asserts none failed and all ended; returns the
    engine's stats once idle."""
    import random

    rng = random.Random(seed)
    results, failures, threads = {}, {}, []
    for i in range(n):
        stream = engine.submit(prompt_of(i, rng), params_of(rng))
        mode = rng.choice(["random_time", "mid_decode", "none"])
        t = threading.Thread(target=consume_with_aborts,
                             args=(stream, mode, rng.randint(1, 4), rng.random() * 0.02, results, failures))
        t.start()
        threads.append(t)
        if len(threads) >= at_once:
            threads.pop(0).join(60)
    for t in threads:
        t.join(60)
    assert not failures and len(results) == n
    return wait_idle(engine)
