"""`ninfer-bench --via-api`: the same measurement as engine-direct, but through the real HTTP server and SSE, as a
client sees it (streaming /v1/completions with the prompt's token ids, so both paths run the same prompt)."""
from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import uvicorn

from engine.config.loading import load_settings
from engine.server.app import create_app
from engine.server.state import ServerState
from engine.tools.bench.measure import summarise


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server:
    """The ninfer-serve app around an already loaded engine, on a free loopback port, in this process."""

    def __init__(self, loaded):
        settings, _ = load_settings([], {})
        state = ServerState(settings, ["bench"])
        state.loaded = loaded
        self.url = f"http://127.0.0.1:{_free_port()}"
        port = int(self.url.rsplit(":", 1)[1])
        self.server = uvicorn.Server(uvicorn.Config(create_app(state), host="127.0.0.1", port=port,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started and time.time() < deadline:
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(10)


def bench_via_api(loaded, prompt_ids: list[int], gen_tokens: int, repeat: int = 3) -> dict:
    """TTFT = request sent -> first token chunk; decode = first -> last token chunk (one chunk per token)."""
    body = {"model": "bench", "prompt": list(prompt_ids), "max_tokens": gen_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "logprobs": 0}
    runs = []
    with _Server(loaded) as server, httpx.Client(base_url=server.url, timeout=600) as client:
        for i in range(repeat + 1):
            stamps, tokens = [], []
            t0 = time.perf_counter()
            with client.stream("POST", "/v1/completions", json=body) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    lp = (chunk["choices"][0].get("logprobs") or {}) if chunk["choices"] else {}
                    for token in lp.get("tokens") or []:
                        stamps.append(time.perf_counter())
                        tokens.append(token)
            if len(tokens) != gen_tokens:
                raise RuntimeError(f"the API streamed {len(tokens)} tokens, expected {gen_tokens}")
            if i:
                runs.append(dict(ttft_s=stamps[0] - t0, decode_s=stamps[-1] - stamps[0], tokens=tokens))
    return summarise(runs, len(prompt_ids), gen_tokens, 0.0)


def format_api_table(direct: dict, api: dict) -> str:
    rows = [("TTFT (ms)", "ttft_s", lambda v: f"{v * 1000:.1f}", False),
            ("prefill tok/s", "prefill_tps", lambda v: f"{v:.1f}", True),
            ("decode tok/s", "decode_tps", lambda v: f"{v:.2f}", True)]
    lines = ["", "| metric         | engine-direct |    via API | API/direct |", "|---|---|---|---|"]
    for label, key, fmt, higher_better in rows:
        ratio = api[key] / direct[key] if higher_better else direct[key] / api[key]
        lines.append(f"| {label:<14} | {fmt(direct[key]):>13} | {fmt(api[key]):>10} | {ratio:>10.3f} |")
    lines.append("API/direct: share of engine-direct performance kept through HTTP + SSE (1.0 = no loss).")
    return "\n".join(lines)
