"""Speculative decoding: each method's output is exactly the output without it (greedy tokens, and the sampling
distribution), rejected drafts give their pages back, a draft with another tokenizer is refused, MTP drafts are
what a transformers-built reference computes, and the draft length adapts."""
from __future__ import annotations

import random
import threading

import pytest
import torch

from engine.build import build_engine
from engine.errors import NInferError
from engine.sampling import SamplingParams
from engine.speculative.draft import TokenizerMismatchError
from engine.speculative.ngram import NgramIndex
from engine.speculative.adaptive import PAUSE_STEPS, SpecState, StepCosts, best_length, expected_tokens
from tests.engine.helpers import run_concurrently
from tests.engine.spec_models import add_mtp, swap_tokenizer_ids, tiny_folder

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], list(range(2, 60)), [9, 40, 3, 9, 40, 3, 77] * 3]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    return {
        "target": tiny_folder(root, "target", 1),
        "draft": tiny_folder(root, "draft", 2),
        "mtp-qwen3-next": add_mtp(tiny_folder(root, "mtp-q", 1), "qwen3-next"),
        "mtp-deepseek-v3": add_mtp(tiny_folder(root, "mtp-d", 1), "deepseek-v3"),
        "other-vocab": tiny_folder(root, "other-vocab", 3, vocab=384),
        "other-ids": swap_tokenizer_ids(tiny_folder(root, "other-ids", 4)),
    }


def generate(folder, prompts, params, **kw):
    loaded = build_engine(str(folder), max_context=1024, max_concurrency=4, max_shared_prefixes=0, **kw)
    engine = loaded.engine.start()
    try:
        outs = [engine.generate(p, params) for p in prompts]
        return outs, engine.stats()
    finally:
        engine.shutdown()


GREEDY = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
METHODS = {
    "ngram": ("target", dict(spec="ngram")),
    "draft": ("target", dict(spec="draft", draft_model="draft")),
    "draft-self": ("target", dict(spec="draft", draft_model="target")),
    "draft-lm-head": ("target", dict(spec="draft", draft_model="target", lm_head_draft=True)),
    "mtp-qwen3-next": ("mtp-qwen3-next", dict(spec="mtp")),
    "mtp-deepseek-v3": ("mtp-deepseek-v3", dict(spec="mtp", lm_head_draft=True, draft_tokens=6)),
}


def _kwargs(ckpt, kw):
    return {k: str(ckpt[v]) if k == "draft_model" else v for k, v in kw.items()}


@pytest.mark.parametrize("method", list(METHODS))
def test_greedy_output_is_identical_to_no_speculation(ckpt, method, one_thread):
    folder, kw = METHODS[method]
    plain, _ = generate(ckpt["target"], PROMPTS, GREEDY)
    spec, stats = generate(ckpt[folder], PROMPTS, GREEDY, **_kwargs(ckpt, kw))
    for a, b in zip(plain, spec):
        assert len(a) == 128 and a == b
    assert stats["spec_drafted"] > 0 and stats["spec_steps"] > 0
    assert stats["pages_free"] == stats["pages_total"]
    if method == "draft-self":  # the target drafting for itself: every draft is right, which needs a correct draft KV
        assert stats["spec_acceptance"] == 1.0
        assert stats["spec_mean_accepted"] > 1.0
    if method == "ngram":  # the repeating prompts are drafted from
        assert stats["spec_accepted"] > 20


def test_ngram_proposes_the_latest_longest_match():
    tokens = [0, 1, 2, 3, 4, 11, 1, 2, 3, 5, 7, 8, 12, 9, 2, 3]
    index = NgramIndex(2, 4)
    assert index.lookup(tokens, 3) == [5, 7, 8]  # [2, 3] last occurred before 5 (the latest of two)
    assert index.lookup(tokens + [13, 0, 1, 2, 3], 2) == [4, 11]  # the 4-gram [0, 1, 2, 3] wins over [2, 3]
    assert NgramIndex(2, 4).lookup([1, 2, 3, 4], 3) == []  # no earlier occurrence
    assert NgramIndex(2, 4).lookup([1, 2, 3, 4, 1, 2], 9) == [3, 4, 1, 2]  # the continuation runs to the end


def _costs(per_token: float, ceiling: int = 8) -> StepCosts:
    costs = StepCosts()
    for k in range(ceiling + 1):
        costs.record(1 + k, 0.05 * (1 + per_token * k))
    return costs


def test_draft_length_follows_acceptance_and_step_cost():
    cheap, dear = _costs(0.05), _costs(0.8)
    assert expected_tokens(0.5, 2) == pytest.approx(1.75) and expected_tokens(1.0, 4) == 5
    assert best_length(0.95, 8, cheap) == 8  # predictable text on a GPU-like cost curve: the whole ceiling
    assert best_length(0.6, 8, cheap) >= 3
    assert best_length(0.6, 8, dear) == 0  # the same acceptance where extra rows cost 80% each: not worth it
    assert best_length(0.95, 8, dear) >= 2
    assert best_length(0.05, 8, cheap) == 0


def test_rejections_pause_drafting_with_doubling_pauses_and_acceptance_lifts_it():
    costs = _costs(0.3)
    st = SpecState()
    lengths, pauses, probes = [], [], 0
    for _ in range(400):  # nothing is ever accepted
        probing, paused = st.probe, st.pause
        k = st.length(8, costs, adaptive=True)
        if k:
            probes += probing
            assert k == 1 or not probing  # after a pause: a one-token probe
            st.record(drafted=k, accepted=0)
        elif not paused and st.pause:  # a pause starts
            pauses.append(st.pause)
        lengths.append(k)
    assert lengths[0] >= 1  # a new sequence drafts
    assert pauses[:6] == [4, 8, 16, 32, 64, 64]
    assert probes >= 5 and sum(1 for k in lengths if k) <= 12  # a few drafts and probes in 400 steps
    steps = 0
    while st.length(8, costs, adaptive=True) < 4:  # from now on every draft is kept: drafting comes back
        if st.probe or st.pause == 0:
            k = st.length(8, costs, adaptive=True)
            if k:
                st.record(k, k)
        steps += 1
        assert steps < 300
    assert st.next_pause == PAUSE_STEPS[0]
    fixed = SpecState()
    for _ in range(10):
        assert fixed.length(3, costs, adaptive=False) == 3
        fixed.record(3, 0)


def test_kept_probes_that_do_not_pay_leave_the_pauses_long():
    """A draft as slow as the model (each extra row costs a whole step, as a same-size draft model does on a CPU):
    every draft is accepted, yet no length gains, so the pauses grow to the longest and stay there; with cheap
    steps the same kept probes bring drafting back."""
    dear, cheap = _costs(1.5), _costs(0.3)
    for costs, pays in ((dear, False), (cheap, True)):
        st = SpecState(accepted_w=0.0, rejected_w=5.0)  # starts out paused by rejections
        pauses, drafted = [], 0
        for _ in range(600):
            paused = st.pause
            k = st.length(8, costs, adaptive=True)
            if k:
                drafted += 1
                st.record(k, k, costs, 8)  # everything accepted
            elif not paused and st.pause:
                pauses.append(st.pause)
        if pays:
            assert drafted > 300  # drafting came back and stayed
        else:
            assert pauses[:5] == [4, 8, 16, 32, 64] and set(pauses[4:]) == {64} and drafted <= 12


def test_ngram_stops_drafting_where_nothing_is_accepted(ckpt, one_thread):
    """Random text: what little ngram drafts is mostly rejected, and the pauses keep verification steps rare."""
    rng = random.Random(3)
    prompt = [rng.randrange(2, 512) for _ in range(200)]
    params = SamplingParams(max_tokens=200, temperature=1.0, seed=5, ignore_eos=True)
    _, stats = generate(ckpt["target"], [prompt], params, spec="ngram", draft_tokens=8)
    assert stats["spec_steps"] < 40
    assert stats["spec_drafted"] < 120


@pytest.mark.parametrize("method", ["draft", "mtp"])
def test_pages_return_after_200_speculative_requests_with_aborts(ckpt, method, one_thread):
    folder = ckpt["target"] if method == "draft" else ckpt["mtp-qwen3-next"]
    kw = dict(spec="draft", draft_model=str(ckpt["draft"])) if method == "draft" else dict(spec="mtp")
    loaded = build_engine(str(folder), max_context=512, max_concurrency=8, kv_capacity=2048, max_queue=256, **kw)
    engine = loaded.engine.start()
    proposer = engine.speculator.proposer
    free0 = engine.pool.num_free
    rng = random.Random(11)
    threads = []

    def consume(stream, abort_after):
        got = 0
        for out in stream:
            got += len(out.token_ids)
            if abort_after is not None and got >= abort_after:
                stream.abort()
                break

    try:
        for i in range(200):
            prompt = [rng.randrange(2, 512) for _ in range(rng.randrange(4, 150))]
            params = SamplingParams(max_tokens=rng.randrange(1, 60), temperature=rng.choice([0.0, 0.8]), seed=i)
            stream = engine.submit(prompt, params)
            abort_after = rng.randrange(0, 20) if rng.random() < 0.4 else None
            t = threading.Thread(target=consume, args=(stream, abort_after))
            t.start()
            threads.append(t)
        for t in threads:
            t.join(120)
        deadline = 200
        while (engine.scheduler.has_work() or not engine._commands.empty()) and deadline:
            threading.Event().wait(0.05)
            deadline -= 1
        stats = engine.stats()
    finally:
        engine.shutdown()
    assert not any(t.is_alive() for t in threads)
    assert engine.pool.num_free == free0 == engine.pool.num_pages
    assert stats["spec_drafted"] > 100
    if method == "draft":
        assert proposer.pool.num_used == 0 and not proposer._seqs
    else:
        assert not proposer._pending


def test_draft_model_with_another_tokenizer_is_refused(ckpt):
    for other, detail in (("other-vocab", "vocabulary sizes differ (512 vs 384)"), ("other-ids", "tokens have other ids")):
        with pytest.raises(TokenizerMismatchError) as e:
            build_engine(str(ckpt["target"]), max_context=256, spec="draft", draft_model=str(ckpt[other]))
        msg = str(e.value)
        assert "does not share the tokenizer" in msg and detail in msg and "--spec ngram" in msg


def test_mtp_without_mtp_layers_is_refused(ckpt):
    with pytest.raises(NInferError, match="carries no multi-token-prediction"):
        build_engine(str(ckpt["target"]), max_context=256, spec="mtp")


def test_draft_without_a_model_is_refused(ckpt):
    with pytest.raises(NInferError, match="needs a draft model"):
        build_engine(str(ckpt["target"]), max_context=256, spec="draft")


# ---------------------------------------------------------------- sampling exactness

SAMPLES = 12_000
P_MIN = 1e-3  # the test fails when the chi-square p-value is below this (a correct sampler fails 0.1% of seeds)


def _chi_square_p(counts: dict, probs: dict, n: int) -> float:
    """Pearson's chi-square goodness of fit; cells expected below 5 are pooled into one."""
    stat, pooled_obs, pooled_exp, cells = 0.0, 0, 0.0, 0
    for cell, p in probs.items():
        expected = n * p
        if expected < 5:
            pooled_obs += counts.get(cell, 0)
            pooled_exp += expected
            continue
        stat += (counts.get(cell, 0) - expected) ** 2 / expected
        cells += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        cells += 1
    assert sum(counts.values()) == n and not set(counts) - set(probs)  # nothing outside the support
    df = cells - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def _exact_second_and_third(engine, prompt, params) -> dict[tuple[int, int], float]:
    """P(t2, t3) without speculation, from the model's logits: the sum over t1 of p(t1) p(t2 | t1) p(t3 | t1, t2)."""
    from engine.runner import Work
    from engine.sampling import target_distribution

    runner = engine.runner
    pages = runner.pool.allocate(runner.pool.pages_for(len(prompt) + 2))
    try:
        vocab = runner.model.cfg.vocab_size
        first = target_distribution(runner.run([Work(prompt, 0, pages)])[0][-1], params, prompt, [])
        pairs: dict[tuple[int, int], float] = {}
        for t1 in range(vocab):
            if first[t1] == 0:
                continue
            for t2 in range(vocab):
                rows = runner.run([Work(prompt + [t1, t2], 0, pages, "all")])[0]
                p2 = target_distribution(rows[-2], params, prompt, [t1])[t2]
                if p2 == 0:
                    continue
                p3 = target_distribution(rows[-1], params, prompt, [t1, t2])
                for t3 in range(vocab):
                    if p3[t3] > 0:
                        pairs[(t2, t3)] = pairs.get((t2, t3), 0.0) + float(first[t1] * p2 * p3[t3])
        return pairs
    finally:
        runner.pool.deallocate(pages)


def test_speculative_sampling_matches_the_target_distribution(tmp_path, one_thread):
    """The first token comes from the prompt's step; the second and third are the first ones speculation can
    produce (a draft of 2, verified in one step). The target drafts for itself (greedily), so that drafts are
    accepted often enough to exercise both branches. Over 12,000 seeded requests, (t2, t3) follows the exact
    distribution of sampling without speculation (penalties, top-p and temperature included): chi-square p >= 1e-3.
    The same test rejects samples drawn from another model's distribution (p < 1e-6), so it has power."""
    target = tiny_folder(tmp_path, "t16", 21, vocab=16)
    other = tiny_folder(tmp_path, "o16", 22, vocab=16)
    prompt = [3, 7, 2, 9, 3, 7, 2]
    params = SamplingParams(max_tokens=4, temperature=0.5, top_p=0.97, presence_penalty=0.5, ignore_eos=True)
    loaded = build_engine(str(target), max_context=64, max_concurrency=64, max_queue=SAMPLES, kv_capacity=8192,
                          max_shared_prefixes=0, spec="draft", draft_model=str(target), draft_tokens=3)
    engine = loaded.engine
    exact = _exact_second_and_third(engine, prompt, params)
    engine.start()
    try:
        streams = [engine.submit(prompt, SamplingParams(**{**vars(params), "seed": i})) for i in range(SAMPLES)]
        counts: dict[tuple[int, int], int] = {}
        for s in streams:
            tokens = tuple([t for out in s for t in out.token_ids][1:3])
            counts[tokens] = counts.get(tokens, 0) + 1
        stats = engine.stats()
    finally:
        engine.shutdown()
    assert stats["spec_steps"] >= SAMPLES and 0.1 < stats["spec_acceptance"] < 0.95, stats  # both branches ran
    p_value = _chi_square_p(counts, exact, SAMPLES)
    assert p_value >= P_MIN, (p_value, stats["spec_acceptance"])

    d_loaded = build_engine(str(other), max_context=64, max_concurrency=1, kv_capacity=256)
    wrong = _exact_second_and_third(d_loaded.engine, prompt, params)
    cells = list(wrong)
    g = torch.Generator().manual_seed(0)
    picks = torch.multinomial(torch.tensor([wrong[c] for c in cells]), SAMPLES, replacement=True, generator=g)
    wrong_counts: dict = {}
    for i in picks.tolist():
        wrong_counts[cells[i]] = wrong_counts.get(cells[i], 0) + 1
    wrong_counts = {c: n for c, n in wrong_counts.items() if c in exact}
    assert _chi_square_p(wrong_counts, exact, sum(wrong_counts.values())) < 1e-6


# ---------------------------------------------------------------- MTP against a transformers-built reference

def _reference_mtp_chain(folder, prompt: list[int], first: int, k: int) -> tuple[list[int], list[torch.Tensor]]:
    """The MTP layer rebuilt from transformers parts (LlamaDecoderLayer, its rotary embedding, eager attention over
    the whole sequence): catch-up over the prompt with the target's hidden states, then a greedy chain of k."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm

    model = AutoModelForCausalLM.from_pretrained(str(folder), attn_implementation="eager", dtype=torch.float32).eval()
    cfg = model.config
    w = {}
    for f in folder.glob("*.safetensors"):
        w.update(load_file(f))
    layer = LlamaDecoderLayer(cfg, layer_idx=0).eval()
    layer.load_state_dict({n.removeprefix("mtp.layers.0."): t for n, t in w.items() if n.startswith("mtp.layers.0.")})

    def norm(name):
        n = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        n.weight.data.copy_(w[name])
        return n

    norm_e, norm_h, norm_out = (norm(f"mtp.{n}.weight") for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"))
    captured = {}
    model.model.norm.register_forward_hook(lambda mod, args, out: captured.__setitem__("h", args[0]))
    tokens = prompt + [first]
    with torch.no_grad():
        model(torch.tensor([tokens]))
        hidden = list(captured["h"][0, :len(prompt)])  # h_i for the prompt positions
        nexts = tokens[1:]  # t_{i+1}
        drafts, logits = [], []
        for _ in range(k):
            n = len(hidden)
            emb = model.model.embed_tokens(torch.tensor([nexts]))
            x = torch.nn.functional.linear(torch.cat([norm_e(emb), norm_h(torch.stack(hidden)[None])], -1),
                                           w["mtp.fc.weight"])
            pos = torch.arange(n)[None]
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            out = layer(x, attention_mask=mask, position_ids=pos,
                        position_embeddings=model.model.rotary_emb(x, pos))
            out = out[0] if isinstance(out, tuple) else out
            logits.append(model.lm_head(norm_out(out[0, -1])))
            token = int(logits[-1].argmax())
            drafts.append(token)
            hidden.append(out[0, -1])  # the chain: the MTP output stands in for the next position's hidden
            nexts.append(token)
    return drafts, logits


def test_mtp_drafts_match_a_transformers_reference(ckpt, one_thread):
    folder = ckpt["mtp-qwen3-next"]
    loaded = build_engine(str(folder), max_context=256, max_concurrency=1, spec="mtp", draft_tokens=4,
                          max_shared_prefixes=0)
    engine = loaded.engine  # stepped by hand on this thread
    prompt = PROMPTS[1][:40]
    stream = engine.submit(prompt, SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    engine.speculator.adaptive = False  # always the whole chain of 4
    proposer = engine.speculator.proposer
    runs, run = [], proposer._run
    proposer._run = lambda works, hidden: runs.append(run(works, hidden)) or runs[-1]  # keep each pass's logits
    engine._drain(block=False)
    seq = engine.scheduler.find(stream.request_id)
    prefill_chunks = 0
    while not seq.output:
        engine._step()
        prefill_chunks += 1
    at, drafts = proposer._pending[seq.request_id]
    assert at == len(seq.tokens) and len(drafts) == 4 and prefill_chunks == 1 and len(runs) == 4
    ref_drafts, ref_logits = _reference_mtp_chain(folder, prompt, seq.output[0], 4)
    assert drafts == ref_drafts
    for ours, ref in zip(runs, ref_logits):  # the catch-up pass's last row, then each chain step
        torch.testing.assert_close(ours[0][-1], ref, rtol=1e-4, atol=1e-4)
    engine.abort(stream.request_id)
    engine._drain(block=False)


def test_mtp_kv_follows_a_copied_prefix_tail(ckpt):
    """Prefix reuse copies a cached partial page into the new sequence's own page: the MTP module's KV (its own
    cache at the same page ids) is copied with it, so its drafts attend real keys at the reused positions."""
    loaded = build_engine(str(ckpt["mtp-qwen3-next"]), max_context=256, max_concurrency=1, spec="mtp")
    engine = loaded.engine
    copies = []
    copy = engine.runner.kv.copy_pages
    engine.runner.kv.copy_pages = lambda src, dst: copies.append((list(src), list(dst))) or copy(src, dst)
    engine.start()
    try:
        params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
        first = engine.generate(PROMPTS[1][:40], params)
        again = engine.generate(PROMPTS[1][:40], params)
        copied = engine.stats()["prefix_partial_tokens"]
    finally:
        engine.shutdown()
    assert again == first and copies and copied > 0
    (src,), (dst,) = copies[0]
    mtp = engine.speculator.proposer.runner.kv
    assert mtp is not engine.runner.kv and mtp.k[0][src, :copied].abs().sum() > 0
    for part in (mtp.k[0], mtp.v[0]):
        torch.testing.assert_close(part[dst, :copied], part[src, :copied], rtol=0, atol=0)


# ---------------------------------------------------------------- the default model

@pytest.fixture(scope="module")
def ngram_engine(default_fp32_engine):
    """An ngram-speculating engine over the default engine's weights (its own KV pages)."""
    from engine.engine import Engine
    from engine.runner import ModelRunner
    from engine.speculative import Speculator
    from engine.speculative.ngram import NgramProposer

    base = default_fp32_engine.engine
    runner = ModelRunner(base.runner.model, 40, base.runner.kv.kv_dtype, base.runner.page_size)
    engine = Engine(runner, max_concurrency=2, prefill_chunk=512, max_context=2048, eos_ids=base.eos_ids,
                    max_shared_prefixes=0, speculator=Speculator(NgramProposer())).start()
    yield engine
    engine.shutdown()


@pytest.mark.slow
def test_ngram_on_the_default_model_is_lossless_on_three_kinds_of_content(default_fp32_engine, ngram_engine):
    """The bench's three prompts (repetitive JSON, code, prose), 128 greedy tokens each: identical with ngram
    speculation, which drafts on all of them and is accepted most on the repetitive one."""
    from engine.tools.bench.speculative import CONTENT

    base, spec = default_fp32_engine.engine, ngram_engine
    spec.speculator.adaptive = False  # draft wherever something matches, so every prompt is verified
    tok = default_fp32_engine.tokenizer
    params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    prompts = {name: tok.apply_chat_template([{"role": "user", "content": text}]) for name, text in CONTENT.items()}
    plain = dict(zip(prompts, (out for out, _ in run_concurrently(base, list(prompts.values()), [params] * 3))))
    try:
        rates = {}
        for content, prompt in prompts.items():
            before = spec.stats()
            ours = spec.generate(prompt, params)
            after = spec.stats()
            assert ours == plain[content], content
            drafted = after["spec_drafted"] - before["spec_drafted"]
            assert drafted > 0, content
            rates[content] = (after["spec_accepted"] - before["spec_accepted"]) / drafted
        assert rates["repetitive"] > 0.6 and rates["repetitive"] > rates["prose"], rates
    finally:
        spec.speculator.adaptive = True


@pytest.mark.slow
def test_ngram_under_a_json_schema_keeps_the_output(default_fp32_engine, ngram_engine):
    """Drafts pass through the grammar like sampled tokens: the constrained output is the same with speculation,
    greedy and sampled (same seeds give other draws, so sampled outputs are checked against the schema)."""
    import json

    import jsonschema

    from engine.constrain import json_schema_constraint

    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                               "city": {"type": "string"}},
              "required": ["name", "age", "city"], "additionalProperties": False}
    tok = default_fp32_engine.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": 'Repeat exactly: {"name": "Alice", "age": 30, '
                                                                  '"city": "Paris"}'}])
    c = json_schema_constraint(tok, schema)
    greedy = SamplingParams(max_tokens=60, temperature=0.0, constraint=c)
    before = ngram_engine.stats()
    ours = ngram_engine.generate(prompt, greedy)
    assert ours == default_fp32_engine.engine.generate(prompt, greedy)
    assert json.loads(tok.decode(ours)) == {"name": "Alice", "age": 30, "city": "Paris"}
    for seed in range(3):
        out = ngram_engine.generate(prompt, SamplingParams(max_tokens=60, temperature=1.0, seed=seed, constraint=c))
        jsonschema.validate(json.loads(tok.decode(out)), schema)
    assert ngram_engine.stats()["spec_accepted"] > before["spec_accepted"]


def test_a_plain_step_is_timed_first_and_then_now_and_again():
    """Single-sequence decoding: until a one-token step has been timed (and again every BASE_EVERY speculative
    steps) the speculator leaves the step plain, so that c(k) is measured, not assumed."""
    from engine.speculative.adaptive import BASE_EVERY

    costs = StepCosts()
    assert costs.needs_base
    costs.record(1, 0.05)
    assert not costs.needs_base
    for _ in range(BASE_EVERY - 1):
        costs.record(5, 0.3)
    assert not costs.needs_base
    costs.record(5, 0.3)
    assert costs.needs_base
    assert costs.ratio(4) == pytest.approx(6.0)  # a proposer as slow as the model: drafting 4 costs 6 steps
    assert best_length(1.0, 4, costs) in (1, 2, 3)  # k = 4 loses (5 tokens for 6 steps); the others are unmeasured
    for k, ratio in ((1, 2.2), (2, 3.4), (3, 4.7)):
        costs.record(1 + k, 0.05 * ratio)
    assert best_length(1.0, 4, costs) == 0  # every length measured and none gains: plain decoding
