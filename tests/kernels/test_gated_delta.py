"""The gated delta rule kernels (kernels/gated_delta.py, kernels/gated_delta_chunk.py) against their twins under the
interpreter, and the twins against an independent oracle: a per-token, per-head loop in float64 written here.

Covers: state pools in float32 and float16 storage, value heads grouped under key heads (HV / HK = 3 and 1), head
dims that are not powers of two, q/k/v as strided views of one fused projection (as the engine splits them),
non-contiguous slots ([3, 0]) with every slot the call must not touch left bit-identical; decode (T = 1) and draft
tokens (T = 3, step slots including -1, each step slot holding the state after its token); prefill of 1, 37, 64
and 150 tokens (inside one chunk, exactly one chunk, a ragged last chunk) from a non-zero state, including a token
with a decay so strong that exp underflows, and in segments of 1 and 2 chunks; the causal conv update for kernel
widths 4 and 2.

Tolerances: kernel vs twin, both float32 with a different summation order (the chunked kernel also inverts the
unit-triangular matrix by forward substitution where the twin calls solve_triangular): tolerances.py's float32.
Twin vs the float64 oracle: rtol 1e-4, atol 1e-4 x max (float32 rounding accumulated over up to 150 tokens).
States stored in float16: the float16 tolerance (each side rounds its float32 state once). Compiled for a GPU
(NINFER_TEST_DEVICE=cuda) the chunk kernels multiply in tf32 (10-bit mantissa; about 5e-4 relative error over 1K
tokens, estimated on the CPU by rounding the twin's products): there they are held to the float16 tolerance.
"""
import importlib
import math
import os
import sys

import pytest
import torch
import torch.nn.functional as F

from kernels import dispatch, reference
from tests.kernels.tolerances import assert_close

DEVICE = os.environ.get("NINFER_TEST_DEVICE", "cpu")
CHUNK_TOL = torch.float32 if DEVICE == "cpu" else torch.float16  # tolerance class of the chunk kernels vs the twin

# conftest.py defines the listed Triton modules for the interpreter; these are defined the same way here.
if DEVICE == "cpu":
    _saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    for _name in ("kernels.gated_delta", "kernels.gated_delta_chunk"):
        if _name in sys.modules:
            importlib.reload(sys.modules[_name])
        else:
            importlib.import_module(_name)
    if _saved is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = _saved

from kernels import gated_delta_chunk  # noqa: E402
from kernels.gated_delta import causal_conv_update, gdn_recurrent  # noqa: E402
from kernels.gated_delta_chunk import gdn_chunked  # noqa: E402

ORACLE_TOL = dict(rtol=1e-4, atol=1e-4)


def assert_oracle(actual, expected, what, loosen=1.0):
    e = expected.to(actual.dtype)
    rtol, atol = ORACLE_TOL["rtol"] * loosen, ORACLE_TOL["atol"] * loosen * e.abs().max().item()
    torch.testing.assert_close(actual, e, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def oracle(q, k, v, g, beta, state):
    """One sequence, token by token and head by head, in float64: q, k [T, HK, Dk], v [T, HV, Dv], g, beta [T, HV],
    state [HV, Dk, Dv]. Returns the outputs [T, HV, Dv] and the state after each token [T, HV, Dk, Dv]."""
    T, HK, DK = q.shape
    HV = v.shape[1]
    s = state.double().clone()
    out = torch.zeros(T, HV, v.shape[2], dtype=torch.float64)
    states = []
    for t in range(T):
        for h in range(HV):
            qh, kh = q[t, h // (HV // HK)].double(), k[t, h // (HV // HK)].double()
            qh = qh / math.sqrt(float(qh @ qh) + 1e-6) / math.sqrt(DK)
            kh = kh / math.sqrt(float(kh @ kh) + 1e-6)
            s[h] = s[h] * math.exp(float(g[t, h]))
            delta = float(beta[t, h]) * (v[t, h].double() - s[h].T @ kh)
            s[h] = s[h] + torch.outer(kh, delta)
            out[t, h] = s[h].T @ qh
        states.append(s.clone())
    return out, torch.stack(states)


def fused_qkv(lead, HK, HV, DK, DV):
    """q, k, v as the engine gets them: strided views of one [..., 2 HK Dk + HV Dv] projection."""
    x = torch.randn(*lead, 2 * HK * DK + HV * DV)
    q, k, v = x.split([HK * DK, HK * DK, HV * DV], dim=-1)
    return q.unflatten(-1, (HK, DK)), k.unflatten(-1, (HK, DK)), v.unflatten(-1, (HV, DV))


def gates(lead, HV):
    g = -F.softplus(torch.randn(*lead, HV) - 1.0) * 2  # log decays <= 0, as the layer makes them
    return g.float(), torch.rand(*lead, HV).float()


def assert_state(actual, expected, what, tol=torch.float32):
    assert_close(actual, expected, dtype=actual.dtype if actual.dtype != torch.float32 else tol, what=what)


SHAPES = [(2, 6, 32, 16), (2, 2, 24, 20)]  # (HK, HV, Dk, Dv): grouping 3 with Dk != Dv; grouping 1, odd dims


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "HK{}-HV{}-Dk{}-Dv{}".format(*s))
@pytest.mark.parametrize("T", [1, 3])
def test_recurrent(T, shape, state_dtype):
    HK, HV, DK, DV = shape
    B, S = 2, 7
    q, k, v = fused_qkv((B, T), HK, HV, DK, DV)
    g, beta = gates((B, T), HV)
    pool = torch.randn(S, HV, DK, DV).to(state_dtype)
    slots = torch.tensor([3, 0])
    steps = torch.tensor([[1, -1, 2], [4, -1, -1]])[:, :T] if T > 1 else None
    written = set(slots.tolist()) | (set(steps.flatten().tolist()) - {-1} if steps is not None else set())

    kern_pool, twin_pool = pool.clone(), pool.clone()
    o_kernel = gdn_recurrent(q, k, v, g, beta, kern_pool, slots, steps)
    o_twin = reference.gdn_recurrent_ref(q, k, v, g, beta, twin_pool, slots, steps)
    assert o_kernel.shape == (B, T, HV, DV) and o_kernel.dtype == torch.float32
    assert_close(o_kernel, o_twin, what="o kernel vs twin")
    assert_state(kern_pool, twin_pool, "state kernel vs twin")

    for b, slot in enumerate(slots.tolist()):
        o_ref, after = oracle(q[b], k[b], v[b], g[b], beta[b], pool[slot].float())
        assert_oracle(o_twin[b], o_ref, f"o twin vs oracle, sequence {b}")
        assert_state(twin_pool[slot], after[-1].to(state_dtype), f"final state, sequence {b}")
        for t in range(T):
            dst = int(steps[b, t]) if steps is not None else -1
            if dst >= 0:
                assert_state(twin_pool[dst], after[t].to(state_dtype), f"step slot {dst} after token {t}")
    for slot in set(range(S)) - written:
        assert torch.equal(kern_pool[slot], pool[slot]) and torch.equal(twin_pool[slot], pool[slot]), slot


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("T", [1, 37, 64, 150])
def test_chunked(T, state_dtype):
    HK, HV, DK, DV = 2, 6, 32, 16
    q, k, v = fused_qkv((T,), HK, HV, DK, DV)
    g, beta = gates((T,), HV)
    g[T // 2, 1] = -40.0  # exp underflows across this token: no inf/nan from the masked decays
    pool = torch.randn(4, HV, DK, DV).to(state_dtype)
    kern_pool, twin_pool = pool.clone(), pool.clone()
    o_kernel = gdn_chunked(q, k, v, g, beta, kern_pool, 2)
    o_twin = reference.gdn_chunked_ref(q, k, v, g, beta, twin_pool, 2)
    assert o_kernel.shape == (T, HV, DV) and torch.isfinite(o_kernel).all()
    assert_close(o_kernel, o_twin, dtype=CHUNK_TOL, what="o kernel vs twin")
    assert_state(kern_pool, twin_pool, "state kernel vs twin", CHUNK_TOL)

    o_ref, after = oracle(q, k, v, g, beta, pool[2].float())
    assert_oracle(o_twin, o_ref, "o twin vs oracle")
    assert_state(twin_pool[2], after[-1].to(state_dtype), "final state twin vs oracle")
    for slot in (0, 1, 3):
        assert torch.equal(kern_pool[slot], pool[slot]) and torch.equal(twin_pool[slot], pool[slot]), slot


@pytest.mark.parametrize("segment", [1, 2])
def test_chunked_in_segments(segment, monkeypatch):
    """A prompt longer than SEGMENT_CHUNKS chunks: the state crosses segments in float32, the fp16 slot is read once
    and stored once."""
    monkeypatch.setattr(gated_delta_chunk, "SEGMENT_CHUNKS", segment)
    HK, HV, DK, DV, T = 1, 2, 32, 16, 150
    q, k, v = fused_qkv((T,), HK, HV, DK, DV)
    g, beta = gates((T,), HV)
    pool = torch.randn(3, HV, DK, DV).half()
    kern_pool, twin_pool = pool.clone(), pool.clone()
    o_kernel = gdn_chunked(q, k, v, g, beta, kern_pool, 0)
    assert_close(o_kernel, reference.gdn_chunked_ref(q, k, v, g, beta, twin_pool, 0), dtype=CHUNK_TOL, what="o")
    assert_state(kern_pool, twin_pool, "state", CHUNK_TOL)
    assert torch.equal(kern_pool[1:], pool[1:])


def test_chunked_odd_head_dims():
    HK, HV, DK, DV = 1, 2, 24, 40
    q, k, v = fused_qkv((70,), HK, HV, DK, DV)
    g, beta = gates((70,), HV)
    pool = torch.randn(2, HV, DK, DV)
    kern_pool, twin_pool = pool.clone(), pool.clone()
    o_kernel = gdn_chunked(q, k, v, g, beta, kern_pool, 1)
    assert_close(o_kernel, reference.gdn_chunked_ref(q, k, v, g, beta, twin_pool, 1), dtype=CHUNK_TOL, what="o")
    assert_state(kern_pool, twin_pool, "state", CHUNK_TOL)


def test_prefill_then_decode_continues_the_same_recurrence():
    """The dispatched ops chained as the engine chains them (a prompt through the chunked form, then a token through
    the recurrent one) against the oracle over all the tokens."""
    HK, HV, DK, DV, T = 2, 4, 16, 16, 70
    q, k, v = fused_qkv((T + 1,), HK, HV, DK, DV)
    g, beta = gates((T + 1,), HV)
    pool = torch.randn(3, HV, DK, DV)
    o_ref, after = oracle(q, k, v, g, beta, pool[1])
    start = pool.clone()
    o_pre = dispatch.gdn_chunked(q[:T], k[:T], v[:T], g[:T], beta[:T], pool, 1)
    o_dec = dispatch.gdn_recurrent(q[None, T:], k[None, T:], v[None, T:], g[None, T:], beta[None, T:], pool,
                                   torch.tensor([1]))
    loosen = 1.0 if DEVICE == "cpu" else 20.0  # tf32 products on a GPU
    assert_oracle(torch.cat((o_pre, o_dec[0])), o_ref, "outputs", loosen)
    assert_oracle(pool[1], after[-1], "state", loosen)
    assert torch.equal(pool[0], start[0]) and torch.equal(pool[2], start[2])


def test_dispatch_routes_to_the_twin_without_triton(monkeypatch):
    HK, HV, DK, DV = 1, 2, 16, 16
    q, k, v = fused_qkv((1, 1), HK, HV, DK, DV)
    g, beta = gates((1, 1), HV)
    pool = torch.randn(2, HV, DK, DV)
    triton_pool, twin_pool = pool.clone(), pool.clone()
    o_triton = dispatch.gdn_recurrent(q, k, v, g, beta, triton_pool, torch.tensor([1]))
    monkeypatch.setenv("NINFER_NO_TRITON", "1")
    o_twin = dispatch.gdn_recurrent(q, k, v, g, beta, twin_pool, torch.tensor([1]))
    assert_close(o_triton, o_twin, what="o")
    assert_state(triton_pool, twin_pool, "state")


def conv_oracle(x, weight, window):
    """Per channel: silu(sum_j weight[c, j] * [window | x][c, j]) in float64."""
    full = torch.cat((window.double(), x.double()[:, None]), dim=1)
    z = (full * weight.double()).sum(1)
    return z / (1 + torch.exp(-z))


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("width", [4, 2])
def test_causal_conv_update(width, state_dtype):
    B, C, S = 2, 300, 5
    x = torch.randn(B, C)
    weight = torch.randn(C, width)
    pool = torch.randn(S, C, width - 1).to(state_dtype)
    slots = torch.tensor([3, 0])
    kern_pool, twin_pool = pool.clone(), pool.clone()
    out = causal_conv_update(x, weight, kern_pool, slots)
    twin = reference.causal_conv_update_ref(x, weight, twin_pool, slots)
    assert_close(out, twin, what="out kernel vs twin")
    assert torch.equal(kern_pool, twin_pool)
    for b, slot in enumerate(slots.tolist()):
        assert_oracle(twin[b], conv_oracle(x[b], weight, pool[slot]), f"twin vs oracle, sequence {b}")
        shifted = torch.cat((pool[slot].float(), x[b][:, None]), dim=1)[:, 1:].to(state_dtype)
        assert torch.equal(twin_pool[slot], shifted)
    for slot in (1, 2, 4):
        assert torch.equal(kern_pool[slot], pool[slot])


def test_rejects_bad_shapes():
    q, k, v = fused_qkv((1, 1), 4, 6, 16, 16)  # 6 value heads over 4 key heads
    g, beta = gates((1, 1), 6)
    with pytest.raises(ValueError):
        gdn_recurrent(q, k, v, g, beta, torch.zeros(2, 6, 16, 16), torch.tensor([0]))
    q, k, v = fused_qkv((5,), 2, 4, 16, 16)
    g, beta = gates((5,), 4)
    with pytest.raises(ValueError):
        gdn_chunked(q, k, v, g, beta, torch.zeros(2, 4, 16, 8), 0)  # state Dv 8 != 16
