"""ninfer-bench modes beyond the transformers comparison: the llama.cpp peer (refused with the install command when
absent; its runs summarised like the other engines': greedy settings, warm-up dropped, TTFT and decode split at the
first token) and --warm-prefix."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from engine.tools.bench.measure import decode_bytes_per_token, summarise
from engine.tools.bench.peer_llamacpp import PORTABLE_BUILD, bench_llamacpp, load_llamacpp

ROOT = Path(__file__).resolve().parents[2]
STAND_IN_PEER = """
import sys
sys.path.insert(0, {root!r})
from engine.tools.bench import peer_llamacpp as peer
from tests.engine.test_bench_modes import FakeLlama
peer.load_llamacpp = lambda path, threads, context: FakeLlama(path)
sys.exit(peer.child_main())
"""


def test_missing_llama_cpp_names_the_install_command(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    with pytest.raises(RuntimeError, match="pip install llama-cpp-python"):
        load_llamacpp(tmp_path / "m.gguf", 2, 128)
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    from engine.tools.bench.cli import main
    assert main(["--compare", "llama.cpp"]) == 1  # refused before anything is loaded or measured
    assert "pip install llama-cpp-python" in capsys.readouterr().err


class FakeLlama:
    """Stands in for llama_cpp.Llama: yields 10, 11, 12, ... and records the sampling settings it was given."""

    def __init__(self, model_path: Path):
        self.model_path = str(model_path)
        self.calls = []

    def reset(self):
        pass

    def generate(self, tokens, **kw):
        self.calls.append((list(tokens), kw))
        n = 10
        while True:
            yield n
            n += 1


def test_runs_are_greedy_and_summarised(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"x" * 1000)
    llm = FakeLlama(model)
    result = bench_llamacpp(llm, [1, 2, 3], 5, 2, lambda runs, wb: summarise(
        runs, 3, 5, decode_bytes_per_token(wb, 100, 3, 5)))
    assert len(llm.calls) == 3  # one warm-up + two measured runs
    tokens, kw = llm.calls[0]
    assert tokens == [1, 2, 3] and kw["temp"] == 0.0 and kw["top_k"] == 1 and kw["repeat_penalty"] == 1.0
    assert result["tokens"] == [10, 11, 12, 13, 14] and len(result["runs"]) == 2
    assert result["weight_bytes"] == 1000 and result["bytes_per_decode_token"] == 1000 + 100 * (3 + 2.5)
    assert result["decode_tps"] > 0 and result["ttft_s"] >= 0


def test_warm_prefix_reuses_the_cached_pages(tmp_path, capsys):
    """ninfer-bench --warm-prefix: the second identical prompt reuses all but its last token (full pages shared,
    the partial last page copied); one changed last token still reuses every token before it."""
    from engine.tools.bench.cli import main
    from tests.engine.spec_models import tiny_folder

    folder = tiny_folder(tmp_path, "t", 1)
    assert main([str(folder), "--warm-prefix", "--prompt-tokens", "200", "--gen-tokens", "2"]) == 0
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ") and "TTFT" not in line}
    assert "| 0 of 200 |" in rows["cold"]
    assert "| 199 of 200 |" in rows["warm (same prompt)"]  # three full 64-token pages + 7 tokens copied
    assert "| 199 of 200 |" in rows["warm (last token changed)"]


@pytest.mark.subprocess
def test_compare_llamacpp_reports_the_peer_under_its_name(tmp_path, monkeypatch, capsys):
    """ninfer-bench --compare llama.cpp on the default GGUF, with a stand-in Llama: the table names llama.cpp, the
    JSON keeps its column under "llama.cpp", and the greedy agreement line compares the two token lists."""
    import json

    from engine.tools.bench import peer_llamacpp as peer
    from engine.tools.bench.cli import main

    # the peer's child process, with the stand-in Llama in place of llama_cpp's
    monkeypatch.setattr(peer, "PEER_COMMAND", [sys.executable, "-c", STAND_IN_PEER.format(root=str(ROOT))])
    monkeypatch.setattr(peer, "check_installed", lambda: None)
    out = tmp_path / "bench.json"
    assert main(["--weight-dtype", "auto", "--compare", "llama.cpp", "--prompt-tokens", "16", "--gen-tokens", "4",
                 "--repeat", "1", "--threads", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["peer"] == "llama.cpp" and "transformers" not in result
    assert result["llama.cpp"]["tokens"] == [10, 11, 12, 13] and set(result["ratio"]) >= {"decode_tps", "ttft_s"}
    assert result["machine"]["ninfer KV"] == "fp16"  # the peer's f16 cache, like for like (--kv-dtype same)
    text = capsys.readouterr().out
    header = next(line for line in text.splitlines() if line.startswith("| metric"))
    assert "llama.cpp" in header
    assert "greedy outputs agree on the first 0 of 4 tokens" in text  # the stand-in's tokens are not the model's


@pytest.mark.parametrize("cpu_compile", ["off", "auto"])
def test_profile_steps_counts_each_layers_operators_per_decode_step(tmp_path, capsys, cpu_compile):
    """ninfer-bench --profile-steps 3 on a tiny float32 model: three decode steps profiled after the prefill. Eager
    (--cpu-compile off) each layer's decode attention is one baddbmm (scores) and one bmm (P @ V) per step; with the
    C++ step (auto) a step is one decode_step call and the output layer's GEMV. Printed and kept in the JSON."""
    import json

    from engine.tools.bench.cli import main
    from tests.engine.spec_models import tiny_folder

    folder = tiny_folder(tmp_path, "t", 1)
    layers = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
    out = tmp_path / "bench.json"
    assert main([str(folder), "--compare", "none", "--prompt-tokens", "40", "--gen-tokens", "6", "--repeat", "1",
                 "--threads", "1", "--profile-steps", "3", "--cpu-compile", cpu_compile, "--json", str(out)]) == 0
    profile = json.loads(out.read_text())["profile"]
    assert profile["steps"] == 3 and profile["ms_per_step"] > 0
    calls = {op["op"]: op["calls_per_step"] for op in profile["ops"]}
    if cpu_compile == "off":
        assert calls["aten::baddbmm"] == layers and calls["aten::bmm"] == layers
        assert "ninfer_cpu::decode_step" not in calls
    else:
        assert calls["ninfer_cpu::decode_step"] == 1 and calls["ninfer_cpu::dense_linear"] == 1
        assert "aten::baddbmm" not in calls
    assert profile["aten_calls_per_step"] >= sum(calls.values()) - 1e-9
    assert abs(sum(op["share"] for op in profile["ops"]) - 1) < 1e-6
    text = capsys.readouterr().out
    assert "decode step profile: 3 steps" in text and "aten::" in text


@pytest.mark.parametrize("flag,value", [("--profile-steps", "-1"), ("--gen-tokens", "1"), ("--repeat", "0")])
def test_bad_counts_are_refused_with_what_is_needed(flag, value, capsys):
    from engine.tools.bench.cli import main

    assert main([flag, value]) == 2
    assert "--profile-steps >= 0" in capsys.readouterr().err


@pytest.mark.subprocess
def test_a_peer_killed_by_sigill_is_named_with_the_build_that_works(tmp_path, monkeypatch, capsys):
    """A stand-in peer that kills itself with SIGILL (as a native llama-cpp-python build does on Intel CPUs with
    AMX): the bench prints NInfer's own table, then names the signal and the portable build command; exit 1."""
    import json

    from engine.tools.bench import peer_llamacpp as peer
    from engine.tools.bench.cli import main

    monkeypatch.setattr(peer, "PEER_COMMAND", [sys.executable, "-c",
                                               "import os, signal; os.kill(os.getpid(), signal.SIGILL)"])
    monkeypatch.setattr(peer, "check_installed", lambda: None)
    out = tmp_path / "bench.json"
    assert main(["--weight-dtype", "auto", "--compare", "llama.cpp", "--prompt-tokens", "16", "--gen-tokens", "4",
                 "--repeat", "1", "--threads", "1", "--json", str(out)]) == 1
    captured = capsys.readouterr()
    header = next(line for line in captured.out.splitlines() if line.startswith("| metric"))  # NInfer's table
    assert "llama.cpp" in header
    assert "killed by SIGILL (illegal instruction)" in captured.err
    assert "-DGGML_NATIVE=OFF" in captured.err and "-DGGML_AMX_INT8=OFF" in captured.err
    assert "llama-cpp-python==0.3.36" in captured.err and PORTABLE_BUILD in captured.err
    result = json.loads(out.read_text())
    assert result["peer"] is None and "SIGILL" in result["peer_error"] and result["ninfer"]["decode_tps"] > 0


@pytest.mark.subprocess
def test_other_peer_failures_are_named(monkeypatch):
    """Another signal is named with the peer's last words; a peer that exits with an error passes its message on
    (a missing llama-cpp-python in the child gives the install command)."""
    from engine.tools.bench import peer_llamacpp as peer

    monkeypatch.setattr(peer, "PEER_COMMAND", [sys.executable, "-c", "import os, signal, sys; "
                                               "print('ggml: out of memory', file=sys.stderr, flush=True); "
                                               "os.kill(os.getpid(), signal.SIGSEGV)"])
    with pytest.raises(RuntimeError, match="killed by SIGSEGV; its last words: ggml: out of memory"):
        peer.PeerProcess(Path("m.gguf"), 1, 64, [1, 2], 2)
    monkeypatch.setattr(peer, "PEER_COMMAND", [sys.executable, "-c", "import sys; sys.modules['llama_cpp'] = None; "
                                               "from engine.tools.bench import peer_llamacpp as p; "
                                               "sys.exit(p.child_main())"])
    with pytest.raises(RuntimeError, match="pip install llama-cpp-python"):
        peer.PeerProcess(Path("m.gguf"), 1, 64, [1, 2], 2)


@pytest.mark.subprocess
def test_the_load_meter_does_not_count_the_benchmarks_own_child_process():
    """A peer measured in a child process (llama.cpp) is the benchmark's own work, not another process's load."""
    import subprocess
    import sys
    import time

    from engine.tools.bench.machine import LoadMeter

    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 1.0:\n    pass\n"
    with LoadMeter() as idle:  # whatever else this machine runs meanwhile (other tests, on a busy one)
        time.sleep(1.0)
    with LoadMeter() as meter:
        subprocess.run([sys.executable, "-c", burn], check=True)
    assert meter.own_seconds >= 0.95, meter.own_seconds  # the child's second of CPU counts as the benchmark's own
    assert meter.cores < idle.cores + 0.5, (meter.cores, idle.cores)  # and not as another process's load


def test_compare_llamacpp_alternates_the_engines_runs(tmp_path, monkeypatch):
    """The peer is loaded before anything is timed, then each NInfer run is followed by one of the peer's (the
    warm-ups first), so a machine whose speed drifts moves both columns alike; the warm-ups are not kept."""
    import json

    from engine.engine import Engine
    from engine.tools.bench import peer_llamacpp as peer
    from engine.tools.bench.cli import main

    events = []

    class FakePeer:
        def __init__(self, path, threads, context, prompt_ids, gen_tokens):
            events.append("peer loaded")
            self.weight_bytes, self.gen = 1000, gen_tokens

        def run(self):
            events.append("peer")
            return dict(ttft_s=0.5, decode_s=1.0, tokens=list(range(self.gen)))

        def close(self):
            events.append("peer closed")

    submit = Engine.submit
    monkeypatch.setattr(Engine, "submit", lambda self, *a, **kw: events.append("ninfer") or submit(self, *a, **kw))
    monkeypatch.setattr(peer, "PeerProcess", FakePeer)
    monkeypatch.setattr(peer, "check_installed", lambda: None)
    out = tmp_path / "bench.json"
    assert main(["--weight-dtype", "auto", "--compare", "llama.cpp", "--prompt-tokens", "16", "--gen-tokens", "4",
                 "--repeat", "2", "--threads", "1", "--json", str(out)]) == 0
    assert events == ["peer loaded"] + ["ninfer", "peer"] * 3 + ["peer closed"]
    result = json.loads(out.read_text())
    assert len(result["llama.cpp"]["runs"]) == 2 and result["llama.cpp"]["ttft_s"] == 0.5
