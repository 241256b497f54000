"""``ninfer-bench --profile-steps N``: where a decode step's time goes, by operator (ATen, ninfer_cpu) (torch.profiler).

After the timed runs, one more request runs on the calling thread (`Engine.step`): its prefill unprofiled, then N
decode steps under the profiler. The table ranks operators by their own time; the profiler's bookkeeping inflates
every call a little, so read it for shares and call counts, not for absolute speed (`ninfer-bench` measures that).
"""
from __future__ import annotations

import queue
import time

import torch
from torch.profiler import ProfilerActivity, profile

from engine.sampling import SamplingParams


def profile_decode(engine, prompt_ids: list[int], steps: int, rows: int = 15) -> dict:
    """{"steps", "ms_per_step" (under the profiler), "aten_calls_per_step" (nested calls included), "table" (the
    `rows` costliest operators, as text), "ops" (every operator: calls and self time per step, share)}."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    stream = engine.submit(list(prompt_ids), SamplingParams(max_tokens=steps + 1, temperature=0.0,
                                                            ignore_eos=True))
    while engine.step():  # the prefill (in chunks when long), unprofiled: until the first token is out
        try:
            stream.get(timeout=0)
            break
        except queue.Empty:
            continue
    before = engine.counters["steps"]
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        while engine.counters["steps"] - before < steps and engine.step():
            pass
        seconds = time.perf_counter() - t0
    done = engine.counters["steps"] - before
    while engine.step():  # the request's last token (it is never cut short)
        pass
    if done == 0:
        raise RuntimeError("no decode step ran: the profiled request ended with its prefill")
    ops = [e for e in prof.key_averages() if e.key.startswith(("aten::", "ninfer_cpu::"))]  # ours: the C++ kernels
    ops.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in ops) or 1.0
    every = [dict(op=e.key, calls_per_step=e.count / done, self_ms_per_step=e.self_cpu_time_total / 1e3 / done,
                  share=e.self_cpu_time_total / total) for e in ops]
    lines = [f"{'operator (ATen, ninfer_cpu)':<40} {'calls/step':>10} {'self ms/step':>12} {'share':>6}"]
    lines += [f"{t['op']:<40} {t['calls_per_step']:>10.1f} {t['self_ms_per_step']:>12.3f} {t['share']:>6.1%}"
              for t in every[:rows]]
    return dict(steps=done, ms_per_step=seconds * 1e3 / done, aten_calls_per_step=sum(e.count for e in ops) / done,
                table="\n".join(lines), ops=every)
