"""Triton paged decode attention against its twin (gather the pages, SDPA in float32), under the interpreter.

Covers GQA ratios 1/3/4/8, head dims 64/128, context lengths that end mid-page (1, 63, 65, 130, ...) or exactly on a
page boundary, shuffled non-contiguous page lists with unused trailing entries, a zero-length context, all three
cache dtypes. Tolerances: tolerances.py (inputs are the same half values on both sides; only the float32 summation
order and the final rounding differ).
"""
import pytest
import torch

from kernels.paged_attention import paged_decode_attention
from kernels.reference import paged_decode_attention_ref
from tests.kernels.tolerances import assert_close

PAGE = 64


def make_case(B, Hq, Hkv, D, lens, dtype, num_pages=None, max_pages=None):
    lens = torch.tensor(lens, dtype=torch.int32)
    need = [(int(n) + PAGE - 1) // PAGE for n in lens]
    max_pages = max_pages or max(max(need), 1) + 1  # one spare column: entries past the context are never read
    num_pages = num_pages or sum(need) + 3
    perm = torch.randperm(num_pages)  # pages of a sequence are scattered, and sequences share no page
    table = torch.full((B, max_pages), num_pages + 1000, dtype=torch.int32)  # out-of-range filler must not be read
    used = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[used:used + n].int()
        used += n
    k = torch.randn(num_pages, PAGE, Hkv, D).to(dtype)
    v = torch.randn(num_pages, PAGE, Hkv, D).to(dtype)
    q = torch.randn(B, Hq, D).to(dtype)
    return q, k, v, table, lens


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("ratio", [1, 3, 4, 8])
def test_gqa_ratios_and_head_dims(ratio, D):
    Hkv = 2
    q, k, v, table, lens = make_case(3, Hkv * ratio, Hkv, D, [1, 130, 64 * 2], torch.float32)
    out = paged_decode_attention(q, k, v, table, lens)
    assert_close(out, paged_decode_attention_ref(q, k, v, table, lens), what=f"ratio {ratio} D {D}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_cache_dtypes_and_partial_pages(dtype):
    q, k, v, table, lens = make_case(4, 8, 2, 64, [63, 65, 200, 5], dtype)
    out = paged_decode_attention(q, k, v, table, lens)
    assert out.dtype == dtype
    assert_close(out, paged_decode_attention_ref(q, k, v, table, lens), what=str(dtype))


def test_custom_scale_and_zero_length():
    q, k, v, table, lens = make_case(3, 4, 4, 128, [0, 77, 1], torch.float32)
    out = paged_decode_attention(q, k, v, table, lens, scale=0.3)
    ref = paged_decode_attention_ref(q, k, v, table, lens, scale=0.3)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert_close(out, ref, what="scale 0.3")


def test_peaked_softmax_is_stable():
    """Large logits (scale 4 on unit vectors): the online max/rescale must not overflow and must match the twin."""
    q, k, v, table, lens = make_case(2, 4, 1, 64, [150, 129], torch.float32)
    q = q * 8
    out = paged_decode_attention(q, k, v, table, lens, scale=4.0)
    assert torch.isfinite(out).all()
    assert_close(out, paged_decode_attention_ref(q, k, v, table, lens, scale=4.0), what="peaked")


def test_rejects_bad_shapes():
    q, k, v, table, lens = make_case(1, 6, 4, 64, [10], torch.float32)
    with pytest.raises(ValueError):
        paged_decode_attention(q, k, v, table, lens)  # 6 query heads over 4 kv heads
