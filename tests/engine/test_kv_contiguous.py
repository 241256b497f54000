"""A sequence's pages tend to be consecutive ids (the pool hands out its lowest free pages), and the CPU attention path
reads consecutive pages as a view of the cache instead of gathering them: same values, no copy."""
from __future__ import annotations

import pytest
import torch

from engine.memory.kv.cache import KVCache
from engine.memory.kv.pages import PagePool
from engine.memory.kv.table import PageList
from engine.runner import Work
from tests.engine.helpers import make_runner


def test_the_pool_hands_out_its_lowest_free_pages():
    pool = PagePool(12, 4)
    a, b, c = pool.allocate(3), pool.allocate(2), pool.allocate(4)
    assert (a, b, c) == ([0, 1, 2], [3, 4], [5, 6, 7, 8])
    pool.deallocate(c)
    pool.deallocate(a)
    # freed in another order, still handed out lowest first: a new sequence gets one run of ids
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(5) == [5, 6, 7, 8, 9]
    pool.deallocate([7])
    assert pool.allocate(2) == [7, 10]
    assert pool.num_free == 1


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "k8v4"])
def test_gather_of_consecutive_pages_equals_the_copy_and_floats_are_views(dtype):
    torch.manual_seed(0)
    cache = KVCache(2, 10, 3, 16, dtype, torch.device("cpu"), page_size=4)
    slots = torch.arange(40)
    for layer in range(2):
        cache.write(layer, slots, torch.randn(40, 3, 16), torch.randn(40, 3, 16))
    pages = torch.tensor([3, 4, 5, 6])
    for length in (13, 16, 1):
        n = -(-length // 4)
        k_copy, v_copy = cache.gather(1, pages[:n], length, torch.float32)
        k_view, v_view = cache.gather(1, pages[:n], length, torch.float32, first_page=3)
        assert k_view.shape == (length, 3, 16)
        assert torch.equal(k_view, k_copy) and torch.equal(v_view, v_copy)
        if dtype == "fp32":  # a float part in its own dtype: read in place
            base = cache.k[1].untyped_storage().data_ptr()
            assert k_view.untyped_storage().data_ptr() == base
            assert k_view.data_ptr() == cache.k[1][3].data_ptr()


def test_runner_reads_consecutive_pages_in_place_and_others_by_copy(tiny_models, monkeypatch):
    """first_page is set for the page list [4, 5, 6] and not for [4, 6, 7]; the logits of a prompt and of one decode
    step are the same either way (the copying path is the oracle of the in-place one)."""
    runner = make_runner(tiny_models("llama")[1])
    seen = []
    gather = KVCache.gather

    def spy(self, layer, pages, length, dtype=None, first_page=None):
        seen.append(first_page)
        return gather(self, layer, pages, length, dtype, first_page)

    monkeypatch.setattr(KVCache, "gather", spy)
    prompt = list(range(5, 5 + 2 * runner.page_size + 3))  # three pages, the last one partial
    outs = []
    for pages, first in ((PageList([4, 5, 6]), 4), (PageList([4, 6, 7]), None)):
        seen.clear()
        prefill = runner.run([Work(prompt, 0, pages, "last")])[0]
        decode = runner.run([Work([7], len(prompt), pages, "last")])[0]
        assert set(seen) == {first}
        outs.append(torch.cat((prefill, decode)))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-5)
