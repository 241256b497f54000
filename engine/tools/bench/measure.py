"""What ``ninfer-bench`` measures and prints for one request: the prompt, our engine's run, the summary of runs
(median TTFT and decode time, tok/s, GB/s), the ratios to a peer and the table.

A run is a dict with ttft_s (submit -> first token), decode_s (first -> last token) and tokens; every engine measured
(ours, through the API, or a peer) is summarised by `summarise`. Decode bandwidth is reported the way gpt-fast does:
the bytes one decode step must read (all weights, plus the KV cache at the mean context) times decode tokens per
second. Against the machine's stream read bandwidth (machine.measure_read_bandwidth) that gives the roofline: the
tok/s a decode that only read its bytes at that bandwidth would reach, and the fraction of it measured
(`add_roofline`).
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

from engine.sampling import SamplingParams

# Deterministic English filler; repeated until the prompt is long enough, then cut to the exact token count.
FILLER = (
    "The history of the lighthouse is a story of engineering, weather and patience. Early keepers burned wood "
    "and coal in open braziers on towers of stone, and sailors learned to read the coast by the rhythm of the "
    "lights. Later lamps used oil and mirrors, then glass lenses that bent the beam into a narrow band visible "
    "for many miles. Each station kept a logbook of storms, ships and repairs, and the keepers trimmed wicks, "
    "polished brass and wound the clockwork that turned the lens through the night. "
)
METRICS = (  # key, label, format, whether higher is better
    ("ttft_s", "TTFT (ms)", lambda v: f"{v * 1e3:.1f}", False),
    ("prefill_tps", "prefill tok/s", lambda v: f"{v:.1f}", True),
    ("decode_tps", "decode tok/s", lambda v: f"{v:.2f}", True),
    ("decode_gbps", "decode GB/s", lambda v: f"{v:.2f}", True),
)


def build_prompt(tokenizer, n: int) -> list[int]:
    """Exactly n token ids of the filler text, as our tokenizer encodes it (no special tokens)."""
    text, ids = FILLER, tokenizer.encode(FILLER)
    while len(ids) < n:
        text += FILLER
        ids = tokenizer.encode(text)
    return ids[:n]


def decode_bytes_per_token(weight_bytes: int, kv_bytes_per_position: int, prompt_tokens: int, gen_tokens: int) -> float:
    """Bytes one decode step reads: every weight, plus the KV at the mean decode context. Decode steps see
    contexts prompt+1 .. prompt+gen-1, whose mean is prompt + gen/2."""
    return weight_bytes + kv_bytes_per_position * (prompt_tokens + gen_tokens / 2)


def summarise(runs: list[dict], prompt_tokens: int, gen_tokens: int, bytes_per_token: float) -> dict:
    ttft = statistics.median(r["ttft_s"] for r in runs)
    decode = statistics.median(r["decode_s"] for r in runs)
    decode_tps = (gen_tokens - 1) / decode
    return dict(ttft_s=ttft, prefill_tps=prompt_tokens / ttft, decode_tps=decode_tps,
                decode_gbps=bytes_per_token * decode_tps / 1e9, bytes_per_decode_token=bytes_per_token,
                runs=[{k: v for k, v in r.items() if k != "tokens"} for r in runs], tokens=runs[-1]["tokens"])


def add_roofline(column: dict, stream_gbps: float) -> dict:
    """Adds roofline_tps (stream bandwidth / bytes per decode token) and roofline_fraction (decode tok/s / that, =
    bytes x tok/s / bandwidth) to a summarised column that knows its bytes per token; others are left as they are."""
    per_token = column.get("bytes_per_decode_token") or 0.0
    if per_token > 0 and stream_gbps > 0 and column.get("decode_tps"):
        column["roofline_tps"] = stream_gbps * 1e9 / per_token
        column["roofline_fraction"] = column["decode_tps"] / column["roofline_tps"]
    return column


def bench_engine(loaded, prompt_ids: list[int], gen_tokens: int, repeat: int = 3,
                 between: Callable[[int], None] | None = None) -> dict:
    """Our engine, batch 1, through Engine.submit on the engine thread (started here if needed).
    TTFT = submit -> first output (includes the prefill); decode = first output -> last output. Build the engine
    with max_shared_prefixes=0, or runs after the first reuse the prompt's cached KV instead of prefilling it.
    `between(i)` is called after run i (0: the warm-up): a peer's run i there alternates the two engines."""
    engine = loaded.engine
    engine.start()
    params = SamplingParams(max_tokens=gen_tokens, temperature=0.0, ignore_eos=True)
    hits_before = engine.stats().get("prefix_hit_tokens", 0)
    runs = []
    for i in range(repeat + 1):
        t0 = time.perf_counter()
        stamps, tokens = [], []
        for out in engine.submit(list(prompt_ids), params):
            if out.error:
                raise RuntimeError(out.error)
            now = time.perf_counter()
            for token in out.token_ids:
                stamps.append(now)
                tokens.append(token)
        if len(tokens) != gen_tokens:
            raise RuntimeError(f"the engine produced {len(tokens)} tokens, expected {gen_tokens}")
        if i:  # run 0 is the warm-up
            runs.append(dict(ttft_s=stamps[0] - t0, decode_s=stamps[-1] - stamps[0], tokens=tokens))
        if between is not None:
            between(i)
    kv_per_pos = engine.runner.kv.token_bytes  # 2 * layers * kv_heads * head_dim * element size, for floats
    weights = engine.runner.model.weight_bytes()
    return dict(summarise(runs, len(prompt_ids), gen_tokens, decode_bytes_per_token(
        weights, kv_per_pos, len(prompt_ids), gen_tokens)), weight_bytes=weights,
        prefix_hit_tokens=engine.stats().get("prefix_hit_tokens", 0) - hits_before)  # 0 unless KV was reused


def ratios(ours: dict, theirs: dict) -> dict:
    """> 1 always means ours is better: throughput ours/theirs, TTFT theirs/ours."""
    return {key: (ours[key] / theirs[key] if higher else theirs[key] / ours[key])
            for key, _, _, higher in METRICS if ours.get(key) and theirs.get(key)}


def format_table(facts: dict, ours: dict, theirs: dict | None, ratio: dict | None, command: str = "",
                 peer: str = "transformers") -> str:
    peer = peer if theirs or peer != "none" else "transformers"
    lines = ["NInfer benchmark" + (f": {command}" if command else "")]
    lines += [f"  {k:<26} {v}" for k, v in facts.items()]
    head = f"| {'metric':<14} | {'ninfer':>10} | {peer:>12} | {'ratio':>6} |"
    lines += ["", head, "|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|"]
    for key, label, fmt, _ in METRICS:
        other = fmt(theirs[key]) if theirs else "-"
        r = f"{ratio[key]:.2f}" if ratio and key in ratio else "-"
        lines.append(f"| {label:<14} | {fmt(ours[key]):>10} | {other:>12} | {r:>6} |")
    lines += _roofline_rows(ours, theirs)
    lines.append("")
    lines.append(f"ratio > 1 means ninfer is better: ninfer/{peer} for throughput, {peer}/ninfer for TTFT.")
    if "roofline_tps" in ours:
        lines.append("roofline: the stream read bandwidth / bytes read per decode token; decode/roofline = "
                     "decode tok/s / roofline tok/s.")
    if theirs:
        same = next((i for i, (a, b) in enumerate(zip(ours["tokens"], theirs["tokens"])) if a != b),
                    len(ours["tokens"]))
        lines.append(f"greedy outputs agree on the first {same} of {len(ours['tokens'])} tokens.")
    return "\n".join(lines)


def _roofline_rows(ours: dict, theirs: dict | None) -> list[str]:
    """The table's rows for the roofline (none when the bandwidth was not measured): each column's own bytes."""
    if "roofline_tps" not in ours:
        return []
    rows = []
    for key, label, fmt in (("roofline_tps", "roofline tok/s", lambda v: f"{v:.1f}"),
                            ("roofline_fraction", "decode/roofln", lambda v: f"{v:.2f}")):
        other = fmt(theirs[key]) if theirs and key in theirs else "-"
        rows.append(f"| {label:<14} | {fmt(ours[key]):>10} | {other:>12} | {'-':>6} |")
    return rows
