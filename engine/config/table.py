"""The table of every NInfer setting: each knob is declared here exactly once.

``engine.config.loading`` reads this table to build the command-line parser, read environment variables and TOML
files, validate values, print the effective configuration and generate docs/CONFIG.md. The desktop app reads it
for its settings form (``help`` is the tooltip; ``type``, ``choices``, ``minimum`` and ``maximum`` pick the widget).
Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

# Display order of the groups; SETTINGS is sorted this way.
GROUPS = ("server", "model", "memory", "speculative", "sampling", "performance")

# NINFER_* environment variables that are not settings but are used legitimately: never warned about.
ENV_ALLOWED = ("NINFER_HOME",)
ENV_ALLOWED_PREFIXES = ("NINFER_TEST_",)


def _always(value: Any) -> bool:
    return True


def _only(*values: Any) -> Callable[[Any], bool]:
    """An ``available`` predicate accepting exactly ``values`` (compared with == and the same type)."""
    return lambda value: any(value == v and type(value) is type(v) for v in values)


def show_value(value: Any) -> str:
    """A value as the user would write it: true/false, unset, comma-separated lists; blank text is quoted."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value)) if value else "[]"
    if isinstance(value, str) and (not value or any(c.isspace() for c in value)):
        return repr(value)
    return str(value)


def _not_blank(value: Any) -> str | None:
    return "must not be empty or contain spaces" if not value or any(c.isspace() for c in value) else None


def _api_key_ok(value: Any) -> str | None:
    return None if value.isascii() and value.isprintable() and " " not in value else "must be printable ASCII without spaces"


def _origins_ok(origins: Any) -> str | None:
    """Each origin is * or scheme://host[:port], exactly as browsers send it in the Origin header (no path, no slash)."""
    for o in origins:
        scheme, sep, rest = o.partition("://")
        if o != "*" and not (sep and scheme.isalpha() and rest and not any(c in rest for c in "/?#@ ")):
            return f"{o!r} is not an origin; write it as scheme://host[:port] with no path (e.g. http://localhost:3000) or *"
    return None


def _aliases_ok(aliases: Any) -> str | None:
    """Each alias is PATTERN or PATTERN=MODEL_ID, both parts non-empty and without spaces."""
    for a in aliases:
        pattern, sep, target = a.partition("=")
        if not pattern.strip() or (sep and not target.strip()) or any(c.isspace() for c in a):
            return f"{a!r} is not an alias; write it as PATTERN=MODEL_ID (e.g. claude-*=local) or PATTERN"
    return None


@dataclass(frozen=True)
class Setting:
    """One knob: its name is the TOML key and the ``Settings`` attribute; ``flag`` and ``env`` are derived from it."""

    name: str  # snake_case; the TOML key and the attribute name
    flag: str  # --kebab-case
    env: str  # NINFER_UPPER_SNAKE
    type: type  # str, int, float, bool, or list (a list of str)
    default: Any
    help: str  # one user-facing sentence (the app's tooltip)
    choices: tuple[str, ...] | None = None
    group: str = "server"
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: bool = False  # the value must be strictly above ``minimum``
    allow_auto: bool = False  # a number setting that also accepts the string "auto"
    nullable: bool = False  # None (unset) is a valid value; an empty string from env/TOML means None
    validator: Callable[[Any], str | None] | None = None  # extra check: returns what is wrong, or None
    available: Callable[[Any], bool] = _always  # does this version support this value?
    needs: str = ""  # what would provide the values ``available`` rejects
    default_means: str = ""  # what the default (0 / auto / unset) stands for, shown in docs and --print-config
    aliases: tuple[tuple[str, str], ...] = ()  # extra spellings of choices, e.g. ("1", "on")
    positional: bool = False  # also accepted as the optional positional argument
    secret: bool = False  # never shown: --print-config and problem messages hide the value
    metavar: str = ""  # the value's name in --help (e.g. KEY, ORIGIN); derived from the type when empty

    def values_text(self) -> str:
        """The accepted values in words, e.g. "auto, cpu, cuda" or "1 to 65535"."""
        if self.choices:
            return ", ".join(self.choices)
        if self.type in (bool, list, str):
            if self.secret:
                return "text, or unset"
            return {bool: "true, false", list: f"list of {self.metavar.lower() + 's' if self.metavar else 'names'}"}.get(
                self.type, "path" if self.nullable else "text")
        lo, hi = self.minimum, self.maximum
        text = f"{lo} to {hi}" if lo is not None and hi is not None else f">= {lo}" if lo is not None else "number"
        if self.exclusive_minimum:
            text = f"above {lo}, up to {hi}"
        return ("auto or " if self.allow_auto else "") + text + (", or unset" if self.nullable else "")

    def availability(self) -> str:
        """Either "yes", or which values this version supports and what would provide the others."""
        if not self.needs:
            return "yes"
        if self.choices or self.type is bool:
            candidates: list[Any] = list(self.choices or (False, True))
        else:
            zero = [0] if self.minimum == 0 else []
            candidates = list(dict.fromkeys([self.default] + (["auto"] if self.allow_auto else []) + zero))
        ok = [c for c in candidates if self.available(c)]
        if len(ok) == len(candidates) and (self.choices or self.type is bool):
            return "yes"
        return f"only {', '.join(show_value(c) for c in ok)} ({self.needs})"


def _s(name: str, type_: type, default: Any, help: str, **kw: Any) -> Setting:
    return Setting(name, "--" + name.replace("_", "-"), "NINFER_" + name.upper(), type_, default, help, **kw)


def _group(group: str, *settings: Setting) -> tuple[Setting, ...]:
    return tuple(replace(s, group=group) for s in settings)


_KV_DTYPES = ("auto", "fp32", "fp16", "bf16", "k8v8", "k8v4", "k4v4", "rk4v4")
_SPECS = ("none", "ngram", "draft", "mtp", "dflash2")

SETTINGS: tuple[Setting, ...] = (
    *_group(
        "server",
        _s("model", str, None, "Path to the model file or folder to serve; leave unset to serve the embedded default model.",
           nullable=True, positional=True, default_means="the embedded default model"),
        _s("host", str, "127.0.0.1", "Address the API server listens on; 127.0.0.1 accepts connections from this computer only.",
           validator=_not_blank),
        _s("port", int, 8080, "TCP port the API server listens on.", minimum=1, maximum=65535),
        _s("model_id", list, [], "Name clients put in the API's model field; repeat the flag (or separate with commas) to give several.",
           validator=lambda ids: next((f"{i!r} must not contain spaces" for i in ids if _not_blank(i)), None),
           default_means="derived from the model file name"),
        _s("model_alias", list, [], "Other model names clients may send, each PATTERN=MODEL_ID (shell wildcards allowed, "
           "e.g. claude-*=local); a bare PATTERN maps to the first served id. Unmapped unknown names are refused with 404.",
           metavar="PATTERN=ID", validator=_aliases_ok, default_means="only the served ids"),
        _s("log_level", str, "info", "How much the server logs.", choices=("debug", "info", "warning", "error")),
        _s("api_key", str, None, "Secret key clients must send as `Authorization: Bearer KEY` or `X-Api-Key: KEY`; "
           "prefer setting it with NINFER_API_KEY, as command lines are visible to other users.",
           nullable=True, secret=True, metavar="KEY", validator=_api_key_ok, default_means="no key needed"),
        _s("insecure_no_auth", bool, False, "Allow a --host other than loopback without --api-key; only for a trusted network."),
        _s("cors_origins", list, [], "Web origins (e.g. http://localhost:3000) whose browser pages may call the API; "
           "empty sends no CORS headers, * allows every origin.",
           metavar="ORIGIN", validator=_origins_ok, default_means="no CORS headers"),
        _s("max_queue", int, 64, "Requests allowed to wait for a free slot beyond --max-concurrency; more are refused "
           "until the queue drains.", minimum=0),
        _s("max_body_mib", int, 16, "Largest request body accepted, in MiB; bigger requests are refused with 413.",
           minimum=1),
        _s("mcp_config", str, "", "An mcp.json (the mcpServers shape: stdio command + args + env, or url + headers) "
           "whose servers' tools chat requests may ask for with {\"type\": \"mcp\", \"server_label\": NAME}; the server "
           "runs those calls itself (docs/API.md). Loopback only unless an API key is set.",
           metavar="FILE", default_means="no server-side MCP tools"),
        _s("image_url_fetch", bool, False, "Let requests name images by http(s) URL, which the server then downloads "
           "(at most --max-image-mib, within 10 s); off, only images sent inline (data: URIs, Anthropic base64 sources) "
           "are accepted."),
        _s("max_image_mib", int, 10, "Largest image accepted, in MiB of encoded file (PNG, JPEG, ...); bigger ones are "
           "refused with 400.", minimum=1, maximum=1024),
        _s("max_images", int, 16, "Most images one request may carry; more are refused with 400.", minimum=1,
           maximum=256),
    ),
    *_group(
        "model",
        _s("device", str, "auto", "Where the model runs; auto uses the GPU when there is one, otherwise the CPU.",
           choices=("auto", "cpu", "cuda")),
        _s("weight_dtype", str, "auto", "Number format of the model weights in memory; auto picks the best one for the device.",
           choices=("auto", "fp32", "bf16", "fp16", "int8", "int4", "ternary"),
           default_means="low-bit GGUF weights (Q4_0/Q4_1 -> int4, Q8_0 -> int8, TQ2_0 -> ternary) as stored, others dense"),
        _s("max_context", int, 0, "Longest conversation (prompt plus reply) in tokens; 0 uses the model's own context length.",
           minimum=0, default_means="the model's own context length"),
        _s("allow_lossy_format", bool, False, "Load a weight or KV format even when the load-time self-check finds it "
           "breaks the model (its predictions on a fixed text disagree with the file's own weights)."),
        _s("gdn_state_fp16", bool, False, "Keep the Gated-DeltaNet recurrent state in fp16 to save memory (it is "
           "computed in fp32; hybrid models only)."),
        _s("cpu_moe", bool, False, "Keep the expert weights of every mixture-of-experts layer in host memory and "
           "compute them on the CPU, the rest of the model on the GPU (MoE models on a GPU too small for them)."),
        _s("n_cpu_moe", int, 0, "Keep the expert weights of the first N mixture-of-experts layers in host memory and "
           "compute them on the CPU, the rest on the GPU; 0 keeps them all on the GPU.", minimum=0),
        _s("fit", bool, True, "When a mixture-of-experts model does not fit the GPU and neither cpu_moe nor "
           "n_cpu_moe is set, keep the experts of as few layers as needed in host memory (and the context at 4K "
           "tokens or more), with kv_dtype auto holding the KV in k8v8 where that moves fewer experts or gives a "
           "longer context; a model that cannot fit even so is refused before loading."),
        _s("mmproj", str, "", "The vision projector GGUF (llama.cpp's mmproj file) of a GGUF model, so it reads "
           "images; empty looks for one file named mmproj*.gguf beside the model file.", metavar="FILE",
           default_means="an mmproj*.gguf beside the model file, if there is exactly one"),
        _s("max_image_pixels", int, 4194304, "Largest image, in pixels, a vision model reads: a bigger one is scaled "
           "down to fit (each 32x32 pixels is one prompt token on Qwen3.5, so the default 2048x2048 is 4,096 tokens); "
           "the model's own image processor may cap it lower.", minimum=1024,
           default_means="4,194,304 pixels (4,096 image tokens)"),
    ),
    *_group(
        "memory",
        _s("kv_capacity", int, "auto", "Tokens the KV cache holds across all requests; auto sizes it from free memory minus the headroom.",
           minimum=64, allow_auto=True, default_means="sized from free memory minus kv_headroom_mib"),
        _s("kv_headroom_mib", int, 1024, "Memory in MiB left free for other programs when the KV cache is sized automatically.",
           minimum=0),
        _s("kv_dtype", str, "auto", "Number format of the KV cache; the k/v variants are quantized to save memory.",
           choices=_KV_DTYPES),
        _s("host_kv_mib", int, 0, "MiB of host (CPU) memory for KV pages that left the GPU window (ring mode); 0: no host tier.",
           minimum=0, default_means="no host KV tier"),
        _s("max_shared_prefixes", int, "auto", "How many distinct prompt prefixes stay cached for reuse (least recently used "
           "ones are evicted beyond it, and whenever their memory is needed); 0 turns prefix sharing off.",
           minimum=0, allow_auto=True, default_means="max(max_concurrency, 8)"),
        _s("kv_window", int, 0, "Recent tokens of each conversation kept on the GPU (rounded up to 64-token pages); 0 keeps "
           "the whole context on the GPU.", minimum=0, default_means="the whole context on the GPU"),
        _s("kv_retrieve", int, 0, "Tokens of older context (in 64-token pages) brought back from host memory to the GPU "
           "per layer and step, the pages most relevant to the current token; needs --kv-window.",
           minimum=0, default_means="no retrieval"),
        _s("kv_ring", str, "auto", "auto: a conversation that outgrows --kv-window continues windowed, its older pages in "
           "host memory; on: every conversation runs windowed; off: --kv-window caps each conversation.",
           choices=("auto", "on", "off"), aliases=(("1", "on"), ("0", "off"))),
        _s("allow_lossy_window", bool, False, "Accept a KV window without retrieval (--kv-retrieve 0): context older "
           "than the window is then never attended to again."),
        _s("host_pageable", bool, False, "Use ordinary pageable host memory for the host KV instead of pinned memory "
           "(pinned memory makes host-to-GPU copies faster but cannot be swapped out)."),
        _s("kv_reuse_hostbacked", bool, False, "Keep cached prompt prefixes evicted from the GPU in the host KV memory "
           "(--host-kv-mib) and bring them back when a prompt starts with them again."),
    ),
    *_group(
        "speculative",
        _s("spec", str, "none", "Speculative decoding method: ngram drafts from earlier text (no extra weights), draft "
           "uses a small model with the same tokenizer, mtp uses the checkpoint's multi-token-prediction layers. "
           "Output is exactly what decoding without it gives.",
           choices=_SPECS, available=_only("none", "ngram", "draft", "mtp"),
           needs="the DFlash2 drafter is not supported; use mtp, draft or ngram"),
        _s("draft_tokens", int, 0, "Most tokens drafted per step; the engine shortens drafts while few are accepted "
           "and lengthens them again when most are; 0 uses the method's default.",
           minimum=0, maximum=16, default_means="the method's default (4)"),
        _s("draft_model", str, None, "Path to the small model (GGUF file or folder) that drafts tokens for --spec draft; "
           "it must use the same tokenizer as the served model.",
           nullable=True, default_means="no draft model"),
        _s("lm_head_draft", bool, False, "Draft with an output layer cut to the most frequent quarter of the "
           "vocabulary: cheaper drafts, slightly fewer accepted (--spec draft or mtp)."),
    ),
    *_group(
        "sampling",
        _s("default_max_tokens", int, 4096, "Longest reply in tokens when a request does not set max_tokens.", minimum=1,
           maximum=2**31 - 1),
        _s("default_reasoning_effort", str, "auto", "Reasoning effort used when a request does not set one; auto lets the model decide.",
           choices=("auto", "none", "low", "medium", "high")),
        _s("reasoning_budget", int, -1, "Most tokens a thinking model may reason before its end-of-thinking tag is "
           "forced and the answer follows: -1 unrestricted, 0 ends thinking at once; a request's reasoning_effort "
           "allows a share of its max_tokens (at most this), its thinking.budget_tokens exactly that many.",
           minimum=-1, maximum=2**31 - 1, default_means="unrestricted"),
        _s("reasoning_budget_message", str, "", "Text the model is made to write, on lines of its own, just before "
           "its end-of-thinking tag when the thinking budget runs out (e.g. \"Time is up, I answer now.\"); empty "
           "adds nothing.", metavar="TEXT", default_means="nothing"),
        _s("reasoning_preserve", str, "auto", "The reasoning of earlier turns in the prompt: on keeps every turn's, "
           "off drops the reasoning of turns before the last user message, auto leaves it to the chat template.",
           choices=("auto", "on", "off"),
           aliases=(("true", "on"), ("false", "off"), ("1", "on"), ("0", "off"), ("yes", "on"), ("no", "off"))),
        _s("mode", str, "chat", "Sampling preset for requests: chat is more varied, agent is more deterministic for tool use.",
           choices=("chat", "agent")),
        _s("temperature", float, None, "Default sampling temperature (0 to 2); unset uses the mode's value.",
           nullable=True, minimum=0.0, maximum=2.0, default_means="from --mode"),
        _s("top_p", float, None, "Default nucleus-sampling probability (above 0, up to 1); unset uses the mode's value.",
           nullable=True, minimum=0.0, maximum=1.0, exclusive_minimum=True, default_means="from --mode"),
        _s("top_k", int, None, "Default number of most likely tokens sampled from (0 turns it off); unset uses the mode's value.",
           nullable=True, minimum=0, maximum=2**31 - 1, default_means="from --mode"),
        _s("min_p", float, None, "Default minimum token probability relative to the most likely token (0 to 1); unset means 0.",
           nullable=True, minimum=0.0, maximum=1.0, default_means="0"),
        _s("presence_penalty", float, None, "Default penalty (-2 to 2) for tokens already present; unset uses the mode's value.",
           nullable=True, minimum=-2.0, maximum=2.0, default_means="from --mode"),
        _s("frequency_penalty", float, None, "Default penalty (-2 to 2) growing with how often a token was used; unset means 0.",
           nullable=True, minimum=-2.0, maximum=2.0, default_means="0"),
        _s("greedy", bool, False, "Always pick the most likely token (temperature 0), whatever the other sampling settings say."),
    ),
    *_group(
        "performance",
        _s("threads", int, 0, "CPU threads used for computing on the CPU; 0 uses all CPU threads.",
           minimum=0, default_means="auto: all CPU threads"),
        _s("cuda_graphs", str, "auto", "Replay decoding steps as CUDA graphs (one per batch size) to cut kernel-launch "
           "overhead; auto: on when the model runs on a CUDA GPU with Triton; on is refused elsewhere.",
           choices=("auto", "on", "off")),
        _s("cpu_compile", str, "auto", "On the CPU, build C++ kernels for this CPU: for a low-bit model the output "
           "layer's float32 logits read from the file's 8-bit codes (about 4x fewer bytes per token than a float32 "
           "layer), and the decoder layers' 4- and 8-bit weights read as stored while generating (activations "
           "rounded to int16 per block of 32: finer than the bf16 of ATen's kernels); for float32 weights a GEMV "
           "about 2x ATen's while generating; for a llama-family model or a Qwen3.5 hybrid the whole decoding step "
           "as one C++ call (about 2.5x faster decoding on the default model, 3x on a small hybrid); prompts multiply dense "
           "weights unpacked into one shared buffer, as --prefill-cublas does (float32 products; bf16 where the CPU "
           "has native bf16). "
           "Needs a C++ compiler the first time (cached after); without one it falls back, with a warning, to the "
           "float32 output layer (torch.compile's kernel where that builds) and ATen's kernels. step: also compile "
           "the whole decode step of one sequence into one graph (about a minute to compile the first time, some "
           "10 s at later starts). off: the float32 output layer and ATen's kernels.",
           choices=("auto", "step", "off")),
        _s("prefill_cublas", bool, False, "While reading the prompt, low-bit weights are unpacked into a shared buffer "
           "and multiplied as dense matrices (cuBLAS on a GPU; on the CPU always on under --cpu-compile auto or "
           "step, 1.4-2.7x faster prompt reading); generating keeps the low-bit kernels."),
        _s("prefill_chunk", int, 512, "Prompt tokens processed per step; bigger is faster but needs more memory.", minimum=16),
        _s("max_concurrency", int, 4, "Requests generated at the same time; more wait in a queue.", minimum=1, maximum=256),
    ),
)
