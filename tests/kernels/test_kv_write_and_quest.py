"""KV quantize-on-write and Quest page bounds against their twins (interpreter): the codes and scales are
bit-identical to engine/memory/kv/quant.py's (the format's definition), the bounds equal the float32 einsum."""
import pytest
import torch

from engine.memory.kv.quant import dequantize, group_size, quantize
from kernels.kv_write import kv_quant_write
from kernels.quest import quest_bounds
from kernels.reference import quest_bounds_ref
from tests.kernels.tolerances import assert_close


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("heads,dim", [(3, 64), (2, 128), (4, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_quantize_on_write_is_bit_identical_to_the_reference(bits, heads, dim, dtype):
    pages, page = 5, 16
    g = group_size(bits, dim)
    x = torch.randn(9, heads, dim) * torch.logspace(-3, 2, 9)[:, None, None]  # rows of very different scales
    x[2, 0, 5] = 60.0  # an outlier channel
    x[4] = 0.0  # an all-zero row: the smallest scale, all codes 0
    x = x.to(dtype)
    slots = torch.randperm(pages * page)[:9]
    width = dim if bits == 8 else dim // 2
    codes = torch.full((pages, page, heads, width), 99, dtype=torch.int8 if bits == 8 else torch.uint8)
    scales = torch.full((pages, page, heads, dim // g), -1.0, dtype=torch.float16)
    kv_quant_write(x, slots, codes, scales, bits, g)
    want_codes, want_scales = quantize(x, bits)
    got_codes = codes.view(-1, heads, width)[slots]
    got_scales = scales.view(-1, heads, dim // g)[slots]
    assert torch.equal(got_scales, want_scales)
    assert torch.equal(got_codes, want_codes)
    untouched = torch.ones(pages * page, dtype=torch.bool)
    untouched[slots] = False
    assert (codes.view(-1, heads, width)[untouched] == 99).all()  # nothing written outside the slots
    err = (dequantize(got_codes, got_scales, bits) - x.float()).abs()
    assert (err <= got_scales.float().repeat_interleave(g, -1) / 2 + 1e-6).all()


def test_quantize_on_write_rounds_halves_to_even():
    """Values exactly half-way between two codes: 0.5 * scale steps, as torch.round does (to even)."""
    scale = 1.0 / 127.0 * (1 + 2.0 ** -10)
    s16 = torch.tensor(scale).half().float()
    x = torch.zeros(1, 1, 64)
    x[0, 0, 0] = 127 * s16 / (1 + 2.0 ** -10)  # sets absmax, so the stored scale is s16
    x[0, 0, 1:6] = torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5]) * s16
    codes = torch.zeros(1, 4, 1, 64, dtype=torch.int8)
    scales = torch.zeros(1, 4, 1, 1, dtype=torch.float16)
    kv_quant_write(x, torch.tensor([2]), codes, scales, 8, 64)
    want, _ = quantize(x, 8)
    assert torch.equal(codes[0, 2], want[0])
    assert codes[0, 2, 0, 1:6].tolist() == [0, 2, 2, 0, -2]


@pytest.mark.parametrize("t,hq,hkv,n,d", [(1, 9, 3, 300, 64), (4, 8, 2, 65, 128), (2, 4, 4, 7, 64), (1, 32, 8, 1000, 128),
                                          (3, 6, 1, 130, 96)])
def test_quest_bounds_match_the_twin(t, hq, hkv, n, d):
    q = torch.randn(t, hq, d)
    keys = torch.randn(n, 16, hkv, d)
    keys[:, :, :, 3] *= 20  # an outlier channel
    kmin, kmax = keys.amin(1), keys.amax(1)
    got = quest_bounds(q, kmin, kmax)
    want = quest_bounds_ref(q, kmin, kmax)
    assert got.shape == want.shape == (n, t, hkv, hq // hkv)
    assert_close(got, want, what="quest bounds")
    # it is a bound: no key of a page scores above it, for any query row and head
    per_head = keys[:, :, torch.arange(hq) // (hq // hkv), :]  # [n, 16, hq, d]: each query head's KV head
    dots = torch.einsum("thd,nkhd->nthk", q, per_head).amax(-1)  # [n, t, hq]
    assert (dots <= got.reshape(n, t, hq) + 1e-3 * got.abs().max()).all()


def test_the_kv_cache_and_page_scores_route_through_the_kernels(monkeypatch):
    """Where Triton runs (here the interpreter), KVCache.write quantizes with kv_write and page_scores bounds with
    quest; the results equal the PyTorch path's (NINFER_NO_TRITON=1)."""
    from engine.memory.kv.cache import KVCache
    from engine.memory.kv.summary import page_scores
    from kernels import kv_write, quest

    calls = []
    for mod, name in ((kv_write, "kv_quant_write"), (quest, "quest_bounds")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _real=real, _n=name, **k: calls.append(_n) or _real(*a, **k))
    k, v = torch.randn(20, 3, 64), torch.randn(20, 3, 64)
    slots = torch.randperm(4 * 64)[:20]
    q, kmin, kmax = torch.randn(2, 9, 64), torch.randn(50, 3, 64), torch.randn(50, 3, 64) + 3
    results = {}
    for route in ("triton", "torch"):
        if route == "torch":
            monkeypatch.setenv("NINFER_NO_TRITON", "1")
        cache = KVCache(1, 4, 3, 64, "k8v4", torch.device("cpu"))
        cache.write(0, slots, k, v)
        results[route] = (cache.k[0].clone(), cache.k_scale[0].clone(), cache.v[0].clone(), cache.v_scale[0].clone(),
                          page_scores(q, kmin, kmax))
    assert calls.count("kv_quant_write") == 2 and calls.count("quest_bounds") == 1
    for a, b in zip(results["triton"][:4], results["torch"][:4]):
        assert torch.equal(a, b)
    assert_close(results["triton"][4], results["torch"][4], what="page scores")
