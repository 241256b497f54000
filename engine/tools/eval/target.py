"""What a check evaluates: the in-process engine built from settings (as ``ninfer-serve`` builds it), or any
OpenAI-compatible server through its /v1/completions endpoint.

``EngineTarget.logits`` runs a token sequence through the engine's own scheduler, memory manager and runner (so
every setting applies: weight and KV formats, window, retrieval, chunked prefill) and captures the full-vocabulary
logits after every position: the runner is asked for the logits of every row of each step, and the engine is
handed back exactly the rows it asked for."""
from __future__ import annotations

import json
from typing import Any

import torch

from engine.errors import NInferError
from engine.runner import Work
from engine.sampling import SamplingParams

# Settings that change what the model computes; the rest (server, sampling defaults) do not enter result keys.
ENGINE_KEYS = ("model", "device", "weight_dtype", "kv_dtype", "max_context", "gdn_state_fp16", "kv_window",
               "kv_retrieve", "kv_ring", "host_kv_mib", "allow_lossy_window", "prefill_chunk", "prefill_cublas",
               "spec", "draft_tokens", "draft_model", "lm_head_draft", "threads", "cuda_graphs", "cpu_compile")


class EngineTarget:
    """The engine built in this process from ``settings`` (an engine.config.loading.Settings) with ``overrides`` applied
    (EngineConfig fields), on ``model`` when given (else the settings' model); driven on the calling thread with
    Engine.step()."""

    def __init__(self, settings: Any, overrides: dict[str, Any] | None = None, model: Any = None):
        from engine.build import build_engine
        from engine.config.engine_config import EngineConfig

        self.config = EngineConfig.from_settings(settings).replace(**(overrides or {}))
        self.loaded = build_engine(model if model is not None else settings.model, self.config)
        self.engine, self.tokenizer = self.loaded.engine, self.loaded.tokenizer
        self._capture: list[tuple[int, torch.Tensor]] | None = None
        self._run = self.engine.runner.run
        self.engine.runner.run = self._run_capturing  # this engine instance only

    def describe(self) -> dict[str, Any]:
        """The configuration in the words a report uses."""
        net = self.engine.runner.model
        c = self.config
        window = "none" if not c.kv_window else f"{c.kv_window} (retrieve {c.kv_retrieve})"
        return {"model": self.loaded.path.name, "device": str(self.loaded.device),
                "weights": getattr(net, "weight_format", str(self.loaded.dtype)),
                "kv": self.engine.runner.kv.kv_dtype,
                "window": window, "context": self.loaded.context_window}

    @property
    def context_window(self) -> int:
        return self.loaded.context_window

    def _run_capturing(self, works: list[Work], *more, **named) -> list[torch.Tensor | None]:
        if self._capture is None:
            return self._run(works, *more, **named)
        asked = [w.logits for w in works]
        for w in works:
            w.logits = "all"
        try:
            rows = self._run(works, *more, **named)
        finally:
            for w, a in zip(works, asked):
                w.logits = a
        out: list[torch.Tensor | None] = []
        for w, a, r in zip(works, asked, rows):
            self._capture.append((w.start, r.detach().float().cpu()))
            out.append(None if a is None else r[-1:] if a == "last" else r)
        return out

    def _finish(self, stream) -> list[int]:
        while self.engine.step():
            pass
        tokens = []
        while not stream.finished:
            out = stream.get(timeout=0)
            if out.error:
                raise NInferError(f"The engine failed on an evaluation prompt: {out.error}",
                                  "See the log above; try a shorter --ctx or other settings.")
            tokens += out.token_ids
        return tokens

    def logits(self, ids: list[int]) -> torch.Tensor:
        """The logits after each of ``ids`` (float32, [len(ids), vocab]), computed as the engine serves them."""
        self._capture = []
        try:
            self._finish(self.engine.submit(list(ids), SamplingParams(max_tokens=1, temperature=0.0)))
            captured = sorted(self._capture, key=lambda c: c[0])
        finally:
            self._capture = None
        rows, next_pos = [], 0
        for start, r in captured:
            if start != next_pos:
                break
            rows.append(r)
            next_pos += len(r)
        if next_pos < len(ids):
            raise NInferError(f"The engine computed positions up to {next_pos} of {len(ids)} for the evaluation "
                              f"text (a cached prefix skipped the rest).", "Run with --max-shared-prefixes 0.")
        return torch.cat(rows)[:len(ids)]

    def complete(self, prompt: str, max_tokens: int) -> str:
        """Greedy continuation of ``prompt`` (raw text, no chat template)."""
        ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        return self.tokenizer.decode(self._finish(self.engine.submit(
            ids, SamplingParams(max_tokens=max_tokens, temperature=0.0))))

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=True))

    def close(self) -> None:
        self.engine.shutdown()


class RemoteTarget:
    """Any OpenAI-compatible server: greedy /v1/completions (raw text, no chat template)."""

    def __init__(self, url: str, api_key: str | None = None, model: str | None = None, timeout: float = 3600.0,
                 transport=None):
        """``transport``: an httpx transport to use instead of the network (tests)."""
        import httpx

        self.url = url.rstrip("/")
        if not self.url.endswith("/v1"):
            self.url += "/v1"
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(headers=headers, timeout=timeout, transport=transport)
        self.model = model or self._first_model()

    def _post(self, path: str, body: dict | None = None) -> dict:
        import httpx

        try:
            r = self.client.post(self.url + path, json=body) if body is not None else self.client.get(self.url + path)
        except httpx.HTTPError as e:
            raise NInferError(f"Cannot reach {self.url + path}: {e}.",
                              "Check --url (e.g. http://127.0.0.1:8080) and that the server is running.") from None
        if r.status_code != 200:
            raise NInferError(f"{self.url + path} answered {r.status_code}: {r.text[:300]}",
                              "Check --url, the API key (--api-key or NINFER_API_KEY) and --model-id.")
        try:
            return r.json()
        except json.JSONDecodeError:
            raise NInferError(f"{self.url + path} did not answer JSON.", "Check that --url is an OpenAI-compatible "
                              "server.") from None

    def _first_model(self) -> str:
        data = self._post("/models").get("data") or []
        if not data:
            raise NInferError(f"{self.url}/models lists no model.", "Name the model with --model-id.")
        return data[0]["id"]

    def describe(self) -> dict[str, Any]:
        return {"url": self.url, "model": self.model}

    def complete(self, prompt: str, max_tokens: int) -> str:
        reply = self._post("/completions", {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                                            "temperature": 0.0})
        try:
            return reply["choices"][0]["text"]
        except (KeyError, IndexError, TypeError):
            raise NInferError(f"{self.url}/completions answered without choices[0].text: {str(reply)[:300]}",
                              "Use a server with the OpenAI completions endpoint.") from None

    def next_token_top(self, ids: list[int], k: int) -> list[tuple[str, float]]:
        """The server's top-``k`` (token text, logprob) for the token after ``ids`` (sent as token ids): one greedy
        token asked with ``logprobs``. Reads the completions format (``top_logprobs``: a list of {text: logprob})
        and the chat format (``content``: [{top_logprobs: [{token, logprob}]}]) that some servers answer with."""
        reply = self._post("/completions", {"model": self.model, "prompt": list(ids), "max_tokens": 1,
                                            "temperature": 0.0, "logprobs": k})
        try:
            lps = reply["choices"][0]["logprobs"]
            if isinstance(lps.get("top_logprobs"), list) and lps["top_logprobs"]:
                return [(str(t), float(v)) for t, v in lps["top_logprobs"][0].items()]
            first = lps["content"][0]["top_logprobs"]
            return [(str(e["token"]), float(e["logprob"])) for e in first]
        except (KeyError, IndexError, TypeError, AttributeError, ValueError):
            raise NInferError(f"{self.url}/completions answered without the top logprobs of the next token: "
                              f"{str(reply)[:300]}", "Use a server whose /v1/completions takes token-id prompts "
                              "and returns logprobs (ninfer-serve, llama.cpp's llama-server, vLLM).") from None

    def count_tokens(self, text: str) -> int | None:
        return None  # the server's tokenizer is not known here

    def close(self) -> None:
        self.client.close()


CHARS_PER_TOKEN = 4.0  # the length estimate for a server (--url), whose tokenizer is not known here


def open_target(args, settings: Any, longest: int):
    """The configuration a check runs against (`--url`: that server; else an engine built in process) and its token
    counter; refuses prompts of `longest` tokens that the configuration's context cannot hold with 16 for the
    answer."""
    target = RemoteTarget(args.url, settings.api_key, (settings.model_id or [None])[0]) if args.url \
        else EngineTarget(settings)
    count = target.count_tokens if not args.url else (lambda text: round(len(text) / CHARS_PER_TOKEN))
    limit = getattr(target, "context_window", None)
    if limit is not None and longest + 16 > limit:
        target.close()
        raise NInferError(f"--lengths {longest} does not fit this configuration's context of {limit} tokens (with "
                          f"16 for the answer).", "Lower --lengths, or raise --max-context (and --kv-capacity if it "
                          "is set).")
    return target, count

