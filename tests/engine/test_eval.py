"""ninfer-eval: KLD of a configuration against itself is exactly 0 and a perturbed weight shows a large one; the
results file resumes; the needle grid, table and heatmap work, and on the embedded model (slow) the needle check
fails where a KV window without retrieval hides the middle of the prompt and passes with the full cache or with
retrieval."""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from engine.tools.eval import cli, count, needle
from engine.tools.eval.results import ResultsFile
from tests.engine.helpers import add_tokenizer, tiny_hf_model

VOCAB = 512


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random llama with a word-level tokenizer, a copy with one weight scaled, and a text of its words."""
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("eval")
    _, folder = tiny_hf_model("llama", root, seed=3)
    add_tokenizer(folder, VOCAB)
    broken = root / "broken"
    shutil.copytree(folder, broken)
    weights = load_file(str(broken / "model.safetensors"))
    weights["model.layers.0.self_attn.o_proj.weight"] *= 10.0
    save_file(weights, str(broken / "model.safetensors"), metadata={"format": "pt"})
    rng = random.Random(0)
    text = root / "text.txt"
    text.write_text(" ".join(f"w{rng.randrange(2, VOCAB)}" for _ in range(400)))
    return folder, broken, text


def _kld(tmp_path: Path, model: Path, text: Path, *extra: str) -> dict:
    out = tmp_path / f"summary-{len(list(tmp_path.glob('summary-*')))}.json"
    rc = cli.main(["kld", str(model), "--text", str(text), "--ctx", "128", "--max-context", "512", "--device", "cpu",
                   "--no-progress", "--json", str(out), *extra])
    assert rc == 0
    return json.loads(out.read_text())


def test_kld_of_a_configuration_against_itself_is_zero(tiny, tmp_path, one_thread):
    folder, _, text = tiny
    s = _kld(tmp_path, folder, text, "--weight-dtype", "fp32", "--kv-dtype", "fp32")
    assert s["segments"] == 3 and s["positions"] == 3 * 127
    assert s["kld_mean"] == 0.0 and s["kld_max"] == 0.0 and s["kld_p999"] == 0.0
    assert s["top1_agreement"] == 1.0
    assert s["ppl"] == s["ppl_ref"]


def test_a_perturbed_weight_shows_a_large_kld(tiny, tmp_path, one_thread):
    folder, broken, text = tiny
    same = _kld(tmp_path, folder, text, "--weight-dtype", "fp32", "--ref", str(folder))
    s = _kld(tmp_path, broken, text, "--weight-dtype", "fp32", "--ref", str(folder))
    assert same["kld_mean"] == 0.0
    assert s["kld_mean"] > 0.1 and s["kld_p99"] > s["kld_mean"]
    assert s["top1_agreement"] < 0.9
    assert s["ppl"] != s["ppl_ref"]


def test_a_lossy_kv_format_is_measured_above_zero(tiny, tmp_path, one_thread):
    folder, _, text = tiny
    s = _kld(tmp_path, folder, text, "--weight-dtype", "fp32", "--kv-dtype", "k4v4")
    assert 0.0 < s["kld_mean"] and s["kld_mean"] <= s["kld_max"]


def test_the_results_file_resumes(tiny, tmp_path, one_thread, monkeypatch):
    folder, _, text = tiny
    results = tmp_path / "results.jsonl"
    first = _kld(tmp_path, folder, text, "--kv-dtype", "k8v4", "--results", str(results), "--max-segments", "2")
    assert first["resumed"] == 0 and len(results.read_text().splitlines()) == 2
    built = []
    from engine.tools.eval import target
    real = target.EngineTarget
    monkeypatch.setattr(target, "EngineTarget", lambda *a, **k: built.append(a) or real(*a, **k))
    again = _kld(tmp_path, folder, text, "--kv-dtype", "k8v4", "--results", str(results), "--max-segments", "2")
    assert built == [] and again["resumed"] == 2
    assert {k: again[k] for k in ("kld_mean", "kld_p99", "top1_agreement")} == \
        {k: first[k] for k in ("kld_mean", "kld_p99", "top1_agreement")}
    third = _kld(tmp_path, folder, text, "--kv-dtype", "k8v4", "--results", str(results))  # one segment more
    assert third["resumed"] == 2 and third["segments"] == 3 and len(built) == 2  # candidate and reference
    assert len(results.read_text().splitlines()) == 3
    other = _kld(tmp_path, folder, text, "--kv-dtype", "fp32", "--results", str(results), "--max-segments", "1")
    assert other["resumed"] == 0  # another configuration does not reuse those lines


def test_a_line_cut_short_runs_again(tmp_path):
    path = tmp_path / "r.jsonl"
    ResultsFile(path, "needle", "k").add("a", {"passed": True})
    with path.open("a") as f:
        f.write('{"check": "needle", "key": "k", "id": "b", "pas')
    assert set(ResultsFile(path, "needle", "k").done) == {"a"}
    assert ResultsFile(path, "needle", "other").done == {}


def test_reference_logits_are_reused(tiny, tmp_path, one_thread, monkeypatch):
    folder, _, text = tiny
    cache = tmp_path / "ref"
    first = _kld(tmp_path, folder, text, "--kv-dtype", "k8v8", "--ref-logits", str(cache), "--max-segments", "2")
    assert len(list(cache.glob("*.pt"))) == 2
    from engine.tools.eval import target
    built = []
    real = target.EngineTarget
    monkeypatch.setattr(target, "EngineTarget", lambda *a, **k: built.append(k) or real(*a, **k))
    again = _kld(tmp_path, folder, text, "--kv-dtype", "k8v8", "--ref-logits", str(cache), "--max-segments", "2")
    assert len(built) == 1  # the candidate only
    assert again["kld_mean"] == first["kld_mean"]


def test_usage_errors_name_the_problem(tiny, capsys):
    folder, _, text = tiny
    assert cli.main(["kld", str(folder), "--kv-dtyp", "fp32"]) == 2
    assert "--kv-dtyp" in capsys.readouterr().err
    assert cli.main(["needle", "--url", "http://127.0.0.1:9", "--kv-dtype", "k8v4"]) == 2
    err = capsys.readouterr().err
    assert "kv_dtype" in err and "--url" in err
    assert cli.main(["needle", "--lengths", "512,lots"]) == 2
    assert "'512,lots' is not whole numbers" in capsys.readouterr().err
    assert cli.main(["kld", str(folder), "--text", str(text), "--ctx", "64", "--url", "http://127.0.0.1:9",
                     "--no-progress"]) == 1
    assert "Cannot reach http://127.0.0.1:9/v1/models" in capsys.readouterr().err
    assert cli.main(["kld", str(folder), "--text", str(text), "--ctx", "8"]) == 1
    assert "--ctx" in capsys.readouterr().err
    # a segment as long as the whole context: refused in the check's own words, with the --ctx that fits
    assert cli.main(["kld", str(folder), "--text", str(text), "--ctx", "256", "--max-context", "256", "--device",
                     "cpu", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "--ctx 256 makes segments of 256 tokens" in err and "Use --ctx 255 or less" in err


def test_text_names_a_bundled_text_or_a_file(tiny, tmp_path, capsys):
    """--text harbour / genesis are the bundled texts; the long one holds tens of thousands of the default model's
    tokens (long contexts); any other value is a path, and one that cannot be read is named with the remedy."""
    from engine.model.loader import resolve_model_path
    from engine.tokenizer import Tokenizer
    from engine.tools.eval import kld

    assert kld.text_path(None) == kld.text_path("harbour") == kld.TEXTS_DIR / "harbour.txt"
    assert kld.text_path("genesis").name == "genesis.txt"
    assert kld.text_path(str(tmp_path / "mine.txt")) == tmp_path / "mine.txt"
    tok = Tokenizer.from_path(resolve_model_path(None))
    lengths = {name: len(tok.encode(path.read_text(encoding="utf-8"), add_special_tokens=False))
               for name, path in kld.BUNDLED_TEXTS.items()}
    assert lengths["harbour"] == 2837 and lengths["genesis"] > 40_000, lengths
    folder, _, _ = tiny
    assert cli.main(["kld", str(folder), "--text", str(tmp_path / "missing.txt"), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "missing.txt" in err and "genesis" in err


# ---------------------------------------------------------------- needle

def test_needle_prompt_hides_the_key_at_its_depth():
    words = lambda text: len(text.split())  # a stand-in tokenizer
    for depth in (0.0, 0.5, 1.0):
        prompt = needle.build_prompt(600, depth, 12345, words)
        assert abs(words(prompt) - 600) < 20
        body = prompt[len(needle.INTRO):prompt.index(needle.QUESTION)]
        where = body.index("12345") / len(body)
        assert abs(where - depth) < 0.05
    assert needle.pass_key(512, 0.5, 0) != needle.pass_key(512, 0.5, 1)


class _SeesOnlyTheEnd:
    """A stand-in target that answers the key only when it lies in the last 1,500 characters of the prompt
    (as a window without retrieval would), and counts its calls."""
    calls = 0

    def __init__(self, *args, **kwargs):
        self.visible = 1500

    def describe(self):
        return {"weights": "fake", "kv": "fake", "window": "last 1500 characters"}

    context_window = 100_000

    def count_tokens(self, text):
        return len(text) // 4

    def complete(self, prompt, max_tokens):
        type(self).calls += 1
        tail = prompt[-self.visible:]
        digits = [w.strip(".") for w in tail.split() if w.strip(".").isdigit()]
        return " " + (digits[0] if digits else "I do not know") + "."

    def close(self):
        pass


def test_needle_grid_table_heatmap_and_resume(tmp_path, monkeypatch, capsys):
    from engine.tools.eval import target
    monkeypatch.setattr(target, "EngineTarget", _SeesOnlyTheEnd)
    results = tmp_path / "needle.jsonl"
    args = ["needle", "--lengths", "256,1024", "--depths", "0,0.5,1", "--seeds", "2", "--no-progress",
            "--results", str(results)]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert _SeesOnlyTheEnd.calls == 12
    assert "| 1 | 2/2 | 2/2 |" in out  # the end is always visible
    assert "| 0 | 2/2 | 0/2 |" in out  # the start of a long prompt is not
    png = results.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert cli.main(args) == 0
    assert _SeesOnlyTheEnd.calls == 12  # nothing run again
    assert "12 from the results file" in capsys.readouterr().out


def test_needle_refuses_a_grid_beyond_the_context(monkeypatch, capsys):
    from engine.tools.eval import target

    class Short(_SeesOnlyTheEnd):
        context_window = 300
    monkeypatch.setattr(target, "EngineTarget", Short)
    assert cli.main(["needle", "--lengths", "512", "--no-progress"]) == 1
    assert "--max-context" in capsys.readouterr().err


def _fake_server(seen: list):
    """An OpenAI-compatible server in an httpx transport: lists one model, and completes a prompt with the pass
    key when the needle lies in its last 1,500 characters; it wants the key "secret"."""
    import httpx

    def handle(request: httpx.Request) -> httpx.Response:
        if request.headers.get("authorization") != "Bearer secret":
            return httpx.Response(401, json={"error": {"message": "bad key"}})
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "served-model"}]})
        body = json.loads(request.content)
        seen.append(body)
        text = _SeesOnlyTheEnd().complete(body["prompt"], body["max_tokens"])
        return httpx.Response(200, json={"choices": [{"index": 0, "text": text}]})
    return httpx.MockTransport(handle)


def test_needle_through_a_url(tmp_path, monkeypatch, capsys):
    from engine.tools.eval import target
    seen: list = []
    real = target.RemoteTarget
    monkeypatch.setattr(target, "RemoteTarget", lambda *a, **k: real(*a, **k, transport=_fake_server(seen)))
    monkeypatch.setenv("NINFER_API_KEY", "secret")
    assert cli.main(["needle", "--url", "http://server:8000", "--lengths", "256,1024", "--depths", "0,1",
                     "--seeds", "1", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "| 0 | 1/1 | 0/1 |" in out and "| 1 | 1/1 | 1/1 |" in out
    assert len(seen) == 4 and {b["model"] for b in seen} == {"served-model"}
    assert all(b["temperature"] == 0.0 for b in seen)
    monkeypatch.setenv("NINFER_API_KEY", "wrong")
    assert cli.main(["needle", "--url", "http://server:8000", "--lengths", "256", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "401" in err and "API key" in err


# ---------------------------------------------------------------- count

class _CountsOnlyTheEnd(_SeesOnlyTheEnd):
    """Counts the asked word in the last 1,500 characters of the list: right only when it sees all of it."""

    def complete(self, prompt, max_tokens):
        type(self).calls += 1
        body, question = prompt.rsplit("\n\n", 1)
        word = question.split('"')[1]
        return f" {body[-self.visible:].replace(',', ' ').replace('.', ' ').split().count(word)}."


def test_count_prompt_spreads_the_word_over_the_whole_list():
    words = lambda text: len(text.split())  # a stand-in tokenizer
    prompt, word, k = count.build_prompt(800, 1, words)
    body = prompt[len(count.INTRO):prompt.rindex("\n\n")].rstrip(".").split(", ")
    where = [i for i, w in enumerate(body) if w == word]
    assert len(where) == k >= 2 and abs(words(prompt) - 800) < 40
    for i, at in enumerate(where):  # one in each k-th part of the list
        assert i * len(body) / k - 1 <= at < (i + 1) * len(body) / k + 1
    assert count.first_number(" 7, I think") == 7 and count.first_number(" five.") == 5
    assert count.first_number(" I do not know") is None


def test_count_fails_where_only_the_end_is_seen(tmp_path, monkeypatch, capsys):
    from engine.tools.eval import target
    monkeypatch.setattr(target, "EngineTarget", _CountsOnlyTheEnd)
    results = tmp_path / "count.jsonl"
    args = ["count", "--lengths", "200,2000", "--seeds", "4", "--no-progress", "--results", str(results)]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "| 200 | 4/4 | 0 | 0 |" in out  # all of it is seen
    assert "| 2000 | 0/4 | 4 | 0 |" in out  # only the end: too few, every time
    calls = _CountsOnlyTheEnd.calls
    assert cli.main(args) == 0 and _CountsOnlyTheEnd.calls == calls  # resumed: nothing run again


NEEDLE_ARGS = ["needle", "--lengths", "512", "--depths", "0.5", "--seeds", "2", "--no-progress",
               "--max-context", "1024", "--device", "cpu", "--prefill-chunk", "128", "--max-shared-prefixes", "0"]
WINDOW = ["--kv-window", "128", "--host-kv-mib", "64"]


@pytest.mark.slow
@pytest.mark.parametrize("flags, passes", [
    ([], True),
    (WINDOW + ["--kv-retrieve", "0", "--allow-lossy-window"], False),
    (WINDOW + ["--kv-retrieve", "512"], True),
], ids=["full-cache", "window-without-retrieval", "window-with-retrieval"])
def test_needle_on_the_default_model(flags, passes, tmp_path):
    """The embedded SmolLM2 finds a pass key in the middle of a 512-token prompt when it can see it: with the whole
    cache, or with a 128-token window whose retrieval brings the older pages back; a window without retrieval (the
    last 128-token prefill chunk sees only the window) never finds it."""
    summary = tmp_path / "s.json"
    assert cli.main([*NEEDLE_ARGS, *flags, "--json", str(summary)]) == 0
    s = json.loads(summary.read_text())
    assert (s["passed"] == s["items"]) if passes else (s["passed"] == 0), s
