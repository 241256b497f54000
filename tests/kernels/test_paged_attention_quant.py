"""Triton paged decode attention over quantized K/V pages (k8v8, k8v4, k4v4, rk4v4) against its twin, under the
interpreter.

The pages are one layer of a real `KVCache`, filled with `engine.memory.kv.quant.quantize` (rk4v4: of the Hadamard-rotated
keys, queries rotated by `KVCache.rotate_queries`, as the engine does). Every page of the cache holds data, so rows
past a context (stale slots of a last page, pages not in a list) would change the result if they were read.

Tolerances: tolerances.py, by query dtype. The kernel decodes int4 codes * fp16 scale to exactly the twin's float32
values and applies int8 row scales to the scores and probabilities instead (a float32 rounding per product); what
is left is the float32 summation order and the final rounding to q's dtype, as for float pages.

Head dims: the int4 group is 32 for D 64/96/128 (96 pads to a 128 tile) and 20 for D 80 (the per-channel scale
gather); the Hadamard block is D for 64/128, 32 for 96 and 16 for 80.
"""
import pytest
import torch

from engine.memory.kv import quant
from engine.memory.kv.cache import KVCache
from kernels.paged_attention import paged_decode_attention
from kernels.reference import kv_dequantize_ref, paged_decode_attention_ref
from tests.kernels.tolerances import assert_close

PAGE = 64
FORMATS = quant.QUANT_KV_DTYPES  # k8v8, k8v4, k4v4, rk4v4


def quant_cache(fmt: str, num_pages: int, hkv: int, d: int, outliers: bool = False) -> KVCache:
    """A one-layer KVCache of `fmt` whose every slot holds quantized random K/V."""
    cache = KVCache(1, num_pages, hkv, d, fmt, torch.empty(0).device)  # the default device (conftest: cpu or cuda)
    k = torch.randn(num_pages, PAGE, hkv, d)
    if outliers:  # real keys: a few channels much larger than the rest
        k[..., :3] *= 20
    v = torch.randn(num_pages, PAGE, hkv, d)
    if cache.format.k.rotate:
        k = quant.rotate(k)
    for data, scale, part, x in ((cache.k, cache.k_scale, cache.format.k, k), (cache.v, cache.v_scale, cache.format.v,
                                                                             v)):
        codes, s = quant.quantize(x, part.bits)
        data[0].copy_(codes)
        scale[0].copy_(s)
    return cache


def page_table(lens, num_pages, max_pages=None):
    """Scattered pages, no page shared between rows; unused entries hold an out-of-range id (never read)."""
    need = [-(-int(n) // PAGE) for n in lens]
    max_pages = max_pages or max(max(need), 1) + 1
    perm = torch.randperm(num_pages)
    table = torch.full((len(lens), max_pages), num_pages + 1000, dtype=torch.int32)
    used = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[used:used + n].int()
        used += n
    return table


def run_both(cache, q, table, lens, scale=None, **kw):
    q = cache.rotate_queries(q)
    args = (q, cache.k[0], cache.v[0], table, torch.tensor(lens, dtype=torch.int32), scale)
    scales = dict(k_scale=cache.k_scale[0], v_scale=cache.v_scale[0])
    return paged_decode_attention(*args, **scales, **kw), paged_decode_attention_ref(*args, **scales)


# ---------------------------------------------------------------------------------------------------- the twin
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("d", [64, 80, 96, 128])
def test_twin_dequantize_is_the_engines(bits, d):
    """kv_dequantize_ref == engine.memory.kv.quant.dequantize bit for bit: on quantized rows and on every code pattern."""
    x = torch.randn(5, 64, 3, d) * torch.logspace(-3, 2, 5).view(5, 1, 1, 1)
    codes, s = quant.quantize(x, bits)
    assert torch.equal(kv_dequantize_ref(codes, s), quant.dequantize(codes, s, bits))
    if bits == 8:
        codes = torch.randint(-128, 128, codes.shape, dtype=torch.int8)
    else:
        codes = torch.randint(0, 256, codes.shape, dtype=torch.uint8)  # code 0 (= -8) included
    s = (torch.rand(s.shape) * 4).half()
    assert torch.equal(kv_dequantize_ref(codes, s), quant.dequantize(codes, s, bits))


# ---------------------------------------------------------------------------------------------------- the kernel
@pytest.mark.parametrize("ratio", [1, 4, 8])
@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("fmt", FORMATS)
def test_formats_head_dims_and_gqa(fmt, d, ratio):
    hkv, lens = 2, [1, 130, PAGE * 2]  # one token, a partial last page, a page boundary
    cache = quant_cache(fmt, 8, hkv, d)
    q = torch.randn(len(lens), hkv * ratio, d)
    out, ref = run_both(cache, q, page_table(lens, 8), lens)
    assert_close(out, ref, what=f"{fmt} D {d} ratio {ratio}")


@pytest.mark.parametrize("fmt", ["k4v4", "rk4v4", "k8v4"])
def test_head_dim_80_gathers_group_scales(fmt):
    """D 80: int4 groups of 20 (not a power of two) and a 128-wide tile; outlier key channels."""
    lens = [77, 129, 3]
    cache = quant_cache(fmt, 6, 2, 80, outliers=True)
    out, ref = run_both(cache, torch.randn(3, 8, 80), page_table(lens, 6), lens)
    assert_close(out, ref, what=f"{fmt} D 80")


@pytest.mark.parametrize("fmt", FORMATS)
def test_sink_window_and_retrieved_pages_batch_of_eight(fmt):
    """The windowed layout: sink page 0, retrieved pages in arbitrary order, then the recent window whose last page
    is partial; eight rows of different lengths over the same pool (rows may share pages, as prefixes do)."""
    num_pages, d = 24, 64
    cache = quant_cache(fmt, num_pages, 2, d)
    rows, lens = [], []
    for b in range(8):
        retrieved = torch.randperm(num_pages - 1)[:b % 4].add(1).tolist()  # 0..3 pages from 1.., in random order
        window = torch.randperm(num_pages - 1)[:1 + b % 3].add(1).tolist()
        pages = [0] + retrieved + [p for p in window if p not in retrieved]
        rows.append(pages)
        lens.append((len(pages) - 1) * PAGE + int(torch.randint(1, PAGE + 1, ())))
    table = torch.full((8, max(map(len, rows)) + 2), 10 ** 6, dtype=torch.int32)
    for b, pages in enumerate(rows):
        table[b, :len(pages)] = torch.tensor(pages, dtype=torch.int32)
    out, ref = run_both(cache, torch.randn(8, 8, d), table, lens)
    assert_close(out, ref, what=fmt)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fmt", ["k8v4", "rk4v4"])
def test_half_queries(fmt, dtype):
    lens = [63, 65, 200, 5]
    cache = quant_cache(fmt, 10, 2, 128)
    out, ref = run_both(cache, torch.randn(4, 8, 128).to(dtype), page_table(lens, 10), lens)
    assert out.dtype == dtype
    assert_close(out, ref, what=f"{fmt} {dtype}")


@pytest.mark.parametrize("block_t", [16, 32])
@pytest.mark.parametrize("fmt", ["k8v8", "k4v4"])
def test_sub_page_tiles(fmt, block_t):
    """The GPU's half-page tiles (D 256, or tf32x3 dots at D 128): BLOCK_T rows of a page at a time."""
    lens = [150, 33, 64]
    cache = quant_cache(fmt, 8, 1, 64)
    out, ref = run_both(cache, torch.randn(3, 4, 64), page_table(lens, 8), lens, block_t=block_t)
    assert_close(out, ref, what=f"{fmt} block_t {block_t}")


def test_zero_length_custom_scale_and_peaked_logits():
    lens = [0, 77, 1]
    cache = quant_cache("k8v4", 6, 2, 64)
    out, ref = run_both(cache, torch.randn(3, 4, 64) * 8, page_table(lens, 6), lens, scale=2.0)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isfinite(out).all()
    assert_close(out, ref, what="zero length, scale 2, peaked")


def test_rotated_keys_need_rotated_queries():
    """rk4v4 with rotated q gives the attention of the plain q over the un-rotated keys (H is its own inverse)."""
    lens = [100, 190]
    cache = quant_cache("rk4v4", 6, 2, 128, outliers=True)
    table, q = page_table(lens, 6), torch.randn(2, 8, 128)
    out, _ = run_both(cache, q, table, lens)
    keys = quant.rotate(kv_dequantize_ref(cache.k[0], cache.k_scale[0]))  # back to the original basis
    values = kv_dequantize_ref(cache.v[0], cache.v_scale[0])
    plain = paged_decode_attention_ref(q, keys, values, table, torch.tensor(lens))
    assert_close(out, plain, what="rotated", dtype=torch.float16)  # float32 rounding of two rotations
    unrotated = paged_decode_attention(q, cache.k[0], cache.v[0], table, torch.tensor(lens),
                                       k_scale=cache.k_scale[0], v_scale=cache.v_scale[0])
    assert (unrotated - plain).norm() > 0.05 * plain.norm()  # the rotation is not optional


def test_rejects_mismatched_codes_and_scales():
    cache = quant_cache("k8v4", 2, 2, 64)
    q, table, lens = torch.randn(1, 4, 64), torch.zeros(1, 1, dtype=torch.int32), torch.tensor([5])
    with pytest.raises(ValueError):  # int4 V with 3 scales a row: 64 channels are not 3 equal groups
        paged_decode_attention(q, cache.k[0], cache.v[0], table, lens, k_scale=cache.k_scale[0],
                               v_scale=cache.v_scale[0].repeat(1, 1, 1, 2)[..., :3])
    with pytest.raises(ValueError):  # int8 K with int4-style group scales
        paged_decode_attention(q, cache.k[0], cache.v[0], table, lens, k_scale=cache.v_scale[0],
                               v_scale=cache.v_scale[0])
    with pytest.raises(ValueError):  # codes without scales
        paged_decode_attention(q, cache.k[0], cache.v[0], table, lens)
    with pytest.raises(ValueError):  # head dim 96 over 64-wide codes
        paged_decode_attention(torch.randn(1, 4, 96), cache.k[0], cache.v[0], table, lens,
                               k_scale=cache.k_scale[0], v_scale=cache.v_scale[0])
