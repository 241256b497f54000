"""llama.cpp as a peer for ``ninfer-bench --compare llama.cpp``: the same GGUF file, prompt token ids, greedy
decoding and thread count, through llama-cpp-python. It is measured, never used: install it only to compare
(docs/BENCHMARKS.md, "Peers"). It runs in a child process (`python -m engine.tools.bench.peer_llamacpp`: the spec
as the first line on stdin, then one run for each "run" line, each answered by one JSON line on stdout), so a peer
that crashes (SIGILL from a build for instructions this CPU does not run) is reported by name instead of taking the
bench down with it, and its runs can alternate with NInfer's (a machine whose speed drifts then moves both alike)."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PEER_COMMAND = [sys.executable, "-m", "engine.tools.bench.peer_llamacpp"]
PORTABLE_BUILD = ('CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON '
                  '-DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF '
                  '-DGGML_AMX_BF16=OFF" pip install --force-reinstall --no-cache-dir llama-cpp-python==0.3.36')


def check_installed() -> None:
    """Refuses at once (before NInfer is measured) where llama-cpp-python is missing; it is imported in the child."""
    import importlib.util
    if importlib.util.find_spec("llama_cpp") is None:
        raise RuntimeError(MISSING)


MISSING = ("--compare llama.cpp needs llama-cpp-python, which is not installed; run `pip install llama-cpp-python` "
           "(it compiles llama.cpp; on Intel CPUs with AMX use the portable build in docs/BENCHMARKS.md, Peers), "
           "or use --compare transformers")


def load_llamacpp(path: Path, threads: int, context: int):
    try:  # optional, and only for this comparison: imported when asked for
        from llama_cpp import Llama
    except ImportError:
        raise RuntimeError(MISSING)
    if path.suffix.lower() != ".gguf":
        raise RuntimeError(f"--compare llama.cpp needs a GGUF file; {path.name} is not one")
    return Llama(model_path=str(path), n_ctx=context, n_threads=threads, n_threads_batch=threads, n_batch=512,
                 logits_all=False, verbose=False)


def one_run(llm, prompt_ids: list[int], gen_tokens: int) -> dict:
    """TTFT = prompt evaluation plus the first token; decode = first token -> last token, greedy (temperature 0,
    no repetition penalty), never stopping early."""
    llm.reset()
    tokens, stamps = [], []
    t0 = time.perf_counter()
    for token in llm.generate(list(prompt_ids), top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0,
                              reset=True):
        stamps.append(time.perf_counter())
        tokens.append(int(token))
        if len(tokens) == gen_tokens:
            break
    return dict(ttft_s=stamps[0] - t0, decode_s=stamps[-1] - stamps[0], tokens=tokens)


def read_per_token(path: str | Path) -> int:
    """Bytes of the file's tensors one decoded token reads, counted as NInfer's weight_bytes counts them: every
    tensor but the token embedding (one row of it is read; unless the output layer is tied to it), and of stacked
    experts (`*_exps`) the share a token routes to (expert_used_count of expert_count). The file's size where the
    gguf package cannot read it."""
    try:
        import gguf

        reader = gguf.GGUFReader(str(path))
    except Exception:  # noqa: BLE001 (a file the package does not read: the old figure)
        return Path(path).stat().st_size
    arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")

    def field(key: str) -> int | None:
        f = reader.fields.get(f"{arch}.{key}")
        return None if f is None else int(f.parts[-1][0])

    experts, used = field("expert_count"), field("expert_used_count")
    names = {t.name for t in reader.tensors}
    total = 0
    for t in reader.tensors:
        if t.name == "token_embd.weight" and "output.weight" in names:
            continue
        share = used / experts if experts and used and "_exps." in t.name else 1.0
        total += int(t.n_bytes * share)
    return total


def measure_runs(llm, prompt_ids: list[int], gen_tokens: int, repeat: int) -> list[dict]:
    """`repeat` runs after one warm-up run, which is not kept."""
    return [one_run(llm, prompt_ids, gen_tokens) for _ in range(repeat + 1)][1:]


def bench_llamacpp(llm, prompt_ids: list[int], gen_tokens: int, repeat: int, summarise) -> dict:
    """The runs of `measure_runs` in this process, summarised (`summarise(runs, weight_bytes)`)."""
    runs = measure_runs(llm, prompt_ids, gen_tokens, repeat)
    weight_bytes = read_per_token(llm.model_path)
    return dict(summarise(runs, weight_bytes), weight_bytes=weight_bytes)


class PeerProcess:
    """llama.cpp loaded in a child process, measured one run at a time (`run`); RuntimeError says what went wrong,
    naming the signal when the peer crashed, and what to do."""

    def __init__(self, path: Path, threads: int, context: int, prompt_ids: list[int], gen_tokens: int):
        self.weight_bytes = read_per_token(path) if Path(path).exists() else 0
        self._stderr = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: a chatty peer cannot block on it
        self.proc = subprocess.Popen(PEER_COMMAND, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._stderr, text=True)
        self._send(json.dumps(dict(path=str(path), threads=threads, context=context, prompt=list(prompt_ids),
                                   gen_tokens=gen_tokens)))
        if self._answer() != "ready":  # loaded before anything is timed
            raise self._failure()

    def run(self) -> dict:
        self._send("run")
        try:
            return json.loads(self._answer())
        except ValueError:
            raise self._failure()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()  # the child ends at the end of its input
            except OSError:
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._stderr.close()

    def _send(self, line: str) -> None:
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except OSError:  # the child is gone
            raise self._failure()

    def _answer(self) -> str:
        line = self.proc.stdout.readline()
        if not line:
            raise self._failure()
        return line.strip()

    def _failure(self) -> RuntimeError:
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        code = self.proc.wait()
        self._stderr.seek(0)
        stderr = self._stderr.read()
        if code < 0:
            return RuntimeError(crash_message(-code, stderr))
        said = stderr.strip().splitlines()
        if code != 0:
            return RuntimeError(said[-1] if said else f"the llama.cpp peer exited with status {code}")
        return RuntimeError(f"the llama.cpp peer ended without its results (stderr: {stderr[-300:]!r})")


def crash_message(signum: int, stderr: str = "") -> str:
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    text = f"the llama.cpp peer (llama-cpp-python) crashed: killed by {name}"
    if signum == signal.SIGILL:
        return (text + " (illegal instruction). Its llama.cpp was built for instructions this CPU does not run: a "
                "native build dies so on Intel CPUs with AMX, on the first token. Rebuild it portable, without AMX: "
                + PORTABLE_BUILD)
    last = stderr.strip().splitlines()[-1:] or ["(nothing on stderr)"]
    return f"{text}; its last words: {last[0]}. NInfer's own results above are unaffected."


def child_main() -> int:
    spec = json.loads(sys.stdin.readline())
    try:
        llm = load_llamacpp(Path(spec["path"]), spec["threads"], spec["context"])
    except RuntimeError as err:
        print(err, file=sys.stderr)
        return 3
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        print(json.dumps(one_run(llm, spec["prompt"], spec["gen_tokens"])), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(child_main())
