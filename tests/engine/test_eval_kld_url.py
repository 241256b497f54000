"""ninfer-eval kld --url: a real server (ninfer-serve's app over a tiny model) scored from its top-k logprobs against
the in-process reference. Serving the reference's own model gives a bound of 0 and full top-1 agreement; serving a
perturbed copy gives a bound above 0 that, position by position, never exceeds the full-vocabulary KLD the
in-process check measures for the same model."""
from __future__ import annotations

import json
from contextlib import contextmanager

import pytest

from engine.tools.eval import cli
from engine.tools.eval.kld_url import bounded_position
from tests.engine.test_eval import tiny  # noqa: F401  (the module's fixture: tiny model, perturbed copy, text)

import torch


@contextmanager
def serving(folder):
    from engine.build import build_engine
    from engine.config.loading import load_settings
    from engine.server.state import ServerState
    from tests.api.conftest import RunningServer

    loaded = build_engine(folder, weight_dtype="fp32", kv_dtype="fp32", max_context=512, device="cpu")
    loaded.engine.start()
    try:
        settings, _ = load_settings([], {})
        state = ServerState(settings, ["tiny"])
        state.loaded = loaded
        with RunningServer(state) as running:
            yield running.base_url
    finally:
        loaded.engine.shutdown()


def _kld(tmp_path, *argv) -> tuple[dict, list[float]]:
    out, results = tmp_path / "summary.json", tmp_path / f"r{len(list(tmp_path.glob('r*.jsonl')))}.jsonl"
    assert cli.main(["kld", *argv, "--ctx", "64", "--max-segments", "2", "--max-context", "512", "--device", "cpu",
                     "--no-progress", "--json", str(out), "--results", str(results)]) == 0
    kl = [v for line in results.read_text().splitlines() for v in json.loads(line)["kl"]]
    return json.loads(out.read_text()), kl


def test_kld_through_a_url_is_a_lower_bound(tiny, tmp_path, one_thread):  # noqa: F811
    folder, broken, text = tiny
    with serving(folder) as url:
        same, _ = _kld(tmp_path, str(folder), "--text", str(text), "--url", url, "--top-logprobs", "5")
    assert same["bound"] and same["positions"] == 2 * 63
    assert same["kld_max"] < 1e-6 and same["top1_agreement"] == 1.0
    assert same["ppl"] <= same["ppl_ref"] * (1 + 1e-6)  # a lower bound of the same model's perplexity

    with serving(broken) as url:
        bound, bound_kl = _kld(tmp_path, str(folder), "--text", str(text), "--url", url, "--top-logprobs", "20")
    full, full_kl = _kld(tmp_path, str(broken), "--text", str(text), "--weight-dtype", "fp32", "--kv-dtype", "fp32",
                         "--ref", str(folder))
    assert bound["kld_mean"] > 0.02 and bound["top1_agreement"] < 0.9
    assert len(bound_kl) == len(full_kl) == 2 * 63
    assert all(b <= f + 1e-6 for b, f in zip(bound_kl, full_kl))
    assert bound["top1_agreement"] == pytest.approx(full["top1_agreement"])
    assert bound["ppl"] <= full["ppl"] * (1 + 1e-6)


def test_the_bound_equals_the_full_kld_when_the_top_k_hold_every_token():
    torch.manual_seed(0)
    ref, cand = torch.randn(12), torch.randn(12)
    p, q = ref.double().softmax(-1), cand.double().softmax(-1)
    exact = float((p * (p.log() - q.log())).sum())
    texts = [f"t{i}" for i in range(12)]
    buckets = {t: [i] for i, t in enumerate(texts)}
    every = [(t, float(q[i].log())) for i, t in enumerate(texts)]
    assert bounded_position(ref, every, 3, buckets, texts)["kl"] == pytest.approx(exact, rel=1e-9)
    top3 = sorted(every, key=lambda e: -e[1])[:3]
    r = bounded_position(ref, top3, 3, buckets, texts)
    assert 0 < r["kl"] < exact
    rest = 1 - sum(float(q[int(t[1:])]) for t, _ in top3)
    assert r["nll_cand"] == pytest.approx(-float(q[3].log()) if "t3" in dict(top3) else -torch.tensor(rest).log())


def test_a_server_with_another_tokenizer_is_refused():
    from engine.errors import NInferError

    with pytest.raises(NInferError, match="do not share a tokenizer"):
        bounded_position(torch.zeros(3), [("zebra", -0.1)], 0, {"a": [0], "b": [1], "c": [2]}, ["a", "b", "c"])


def test_server_options_without_a_server_are_refused(tiny, capsys):  # noqa: F811
    folder, _, text = tiny
    assert cli.main(["kld", str(folder), "--text", str(text), "--ctx", "64", "--stride", "4", "--no-progress"]) == 1
    assert "--url" in capsys.readouterr().err
