"""The launcher's words (Qt-free): settings shown by their field labels, not their command-line flags.

The engine's problems speak ``ninfer-serve`` ("[app, default] --kv-window 4096 ...; Set --host-kv-mib (e.g. 4096)").
In the app the same problem names the field to change ("KV window", "Host KV memory (MiB)"), says where a value came
from only when it is not the form itself, and, where one value fixes it, carries that value so the launcher can offer
a button that applies it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.config.table import SETTINGS, Setting

EMBEDDED_NAME = "SmolLM2-135M-Instruct"
BY_FLAG: dict[str, Setting] = {s.flag: s for s in SETTINGS}
BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}

LABELS = {
    "host": "Listen on (host)", "port": "Port", "model_id": "Model name in the API", "api_key": "API key",
    "insecure_no_auth": "Allow the network without a key", "cors_origins": "Allowed web origins (CORS)",
    "max_queue": "Waiting requests (max)", "max_body_mib": "Largest request (MiB)", "log_level": "Log level",
    "device": "Device", "weight_dtype": "Weight format", "max_context": "Context length (tokens)",
    "gdn_state_fp16": "Gated-DeltaNet state in FP16", "cpu_moe": "Experts on the CPU (all MoE layers)",
    "n_cpu_moe": "Experts on the CPU (first N MoE layers)", "fit": "Place MoE experts to fit the GPU", "allow_lossy_format": "Allow a format that fails the self-check", "kv_capacity": "KV cache size (tokens)",
    "kv_headroom_mib": "Memory kept free (MiB)", "kv_dtype": "KV cache format",
    "host_kv_mib": "Host KV memory (MiB)", "max_shared_prefixes": "Shared prefixes kept",
    "kv_window": "KV window (tokens)", "kv_retrieve": "Older context brought back (tokens)",
    "kv_ring": "Windowed conversations",
    "allow_lossy_window": "Allow a window without retrieval", "host_pageable": "Pageable host memory",
    "kv_reuse_hostbacked": "Reuse prefixes from host memory", "spec": "Speculative decoding",
    "draft_tokens": "Draft tokens per step", "draft_model": "Draft model", "lm_head_draft": "Cut the draft's output layer",
    "default_max_tokens": "Default max tokens", "default_reasoning_effort": "Default reasoning effort",
    "mode": "Mode", "temperature": "Temperature", "top_p": "Top-p", "top_k": "Top-k", "min_p": "Min-p",
    "presence_penalty": "Presence penalty", "frequency_penalty": "Frequency penalty", "greedy": "Greedy (no sampling)",
    "threads": "CPU threads", "cuda_graphs": "CUDA graphs",
    "cpu_compile": "Compile for the CPU", "prefill_cublas": "Prefill with cuBLAS",
    "prefill_chunk": "Prefill chunk (tokens)", "max_concurrency": "Conversations at once",
}


def label(name: str) -> str:
    """The form's label of a setting ("kv_headroom_mib" -> "Memory kept free (MiB)")."""
    if name in LABELS:
        return LABELS[name]
    words = [{"kv": "KV", "mib": "(MiB)", "api": "API", "id": "ID", "gpu": "GPU", "cpu": "CPU"}.get(w, w)
             for w in name.split("_")]
    text = " ".join(words)
    return text[:1].upper() + text[1:]


def model_name(model: str | None) -> str:
    """The name the model list shows: the embedded model's name, or the file or folder name."""
    return Path(model).name if model else EMBEDDED_NAME


@dataclass(frozen=True)
class Fix:
    """One value that fixes a problem: the launcher offers it as a button."""
    name: str
    value: Any

    @property
    def text(self) -> str:
        s = BY_NAME[self.name]
        if s.type is bool:
            return f"{'Tick' if self.value else 'Untick'} “{label(self.name)}”"
        if self.value == s.default:
            return f"Reset “{label(self.name)}”"
        return f"Set “{label(self.name)}” to {self.value}"


_SOURCES = re.compile(r"^\[([^\]]*)\]\s*")
_FLAG = re.compile(r"--[a-z][a-z0-9-]*")


def _source_text(sources: str) -> str:
    """"app, default" -> "" (the form itself); "preset:12gb-mtp" -> " (from the preset 12gb-mtp)"."""
    out = []
    for part in (p.strip() for p in sources.split(",")):
        kind, _, what = part.partition(":")
        if kind in ("app", "default", "") or part in out:
            continue
        if kind == "preset":
            out.append(f"the preset {Path(what).stem if what.endswith('.toml') else what}")
        elif kind == "env":
            out.append(f"the environment variable {what}")
        else:
            out.append(part)
    return f" (from {' and '.join(dict.fromkeys(out))})" if out else ""


def _flag_label(m: re.Match) -> str:
    s = BY_FLAG.get(m.group(0))
    return f"“{label(s.name)}”" if s is not None else m.group(0)


def words(text: str) -> str:
    """Flags become field labels: "--host-kv-mib is 0" -> "“Host KV memory (MiB)” is 0"; "pass --x" -> "tick “X”"."""
    text = re.sub(r"\b[Pp]ass (--[a-z][a-z0-9-]*)", lambda m: ("Tick " if m.group(0)[0] == "P" else "tick ")
                  + m.group(1), text)
    text = re.sub(r"\b([Dd]rop|[Rr]emove) (--[a-z][a-z0-9-]*)", lambda m: ("Reset " if m.group(1)[0].isupper()
                                                                           else "reset ") + m.group(2), text)
    return _FLAG.sub(_flag_label, text)


def _coerce(s: Setting, raw: str) -> Any:
    raw = raw.strip().rstrip(".,;)")
    if raw == "auto" and s.allow_auto:
        return "auto"
    if s.type is int:
        return int(raw.replace(",", ""))
    if s.type is float:
        return float(raw)
    if s.type is bool:
        return raw.lower() in ("true", "1", "on", "yes")
    if s.choices and raw not in s.choices:
        raise ValueError(raw)
    return raw


def find_fix(message: str, remedy: str) -> Fix | None:
    """The one value the remedy asks for, when it asks for one: "Set --x (e.g. 4096)", "Raise --x to 25792",
    "pass --x", or "remove it or use the default" for the setting the message names."""
    m = re.search(r"\b(?:Set|Raise|Lower|Use)\s+(--[a-z][a-z0-9-]*)\s+(?:to\s+|\(e\.g\.\s+|\(or\s+)?([\w.,]+)",
                  remedy)
    if m and m.group(1) in BY_FLAG:
        s = BY_FLAG[m.group(1)]
        try:
            return Fix(s.name, _coerce(s, m.group(2)))
        except (ValueError, TypeError):
            pass
    m = re.match(r"\s*[Pp]ass (--[a-z][a-z0-9-]*)", remedy)
    if m and m.group(1) in BY_FLAG and BY_FLAG[m.group(1)].type is bool:
        return Fix(BY_FLAG[m.group(1)].name, True)
    flag = _FLAG.search(_SOURCES.sub("", message))
    if flag and flag.group(0) in BY_FLAG and re.search(r"(?i)\bremove it\b", remedy) and \
            "not available in this version" in message:
        s = BY_FLAG[flag.group(0)]
        return Fix(s.name, s.default)
    return None


def plain(message: str, remedy: str) -> tuple[str, str, Fix | None]:
    """(message, remedy, fix) as the app shows them."""
    fix = find_fix(message, remedy)
    m = _SOURCES.match(message)
    source = ""
    if m and not message.startswith("[command line]"):
        source = _source_text(m.group(1))
        message = message[m.end():]
    message = words(message).rstrip(".") + source + "."
    return message, words(remedy), fix
