"""The KV tensors: per layer, keys and values stored in fixed-size pages."""
from __future__ import annotations

import torch

PAGE_SIZE = 64


class KVCache:
    def __init__(self, num_layers: int, num_pages: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, page_size: int = PAGE_SIZE):
        self.page_size = page_size
        self.num_pages = num_pages
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer].view(-1, *k.shape[1:]).index_copy_(0, slots, k.to(self.k[layer].dtype))
        self.v[layer].view(-1, *v.shape[1:]).index_copy_(0, slots, v.to(self.v[layer].dtype))

    def gather(self, layer: int, pages: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `length` tokens' K and V along the page list, each [length, Hkv, D]."""
        k, v = self.k[layer], self.v[layer]
        if pages.numel() == 1:
            p = int(pages[0])
            return k[p, :length], v[p, :length]
        heads = k.shape[2:]
        return (k.index_select(0, pages).view(-1, *heads)[:length],
                v.index_select(0, pages).view(-1, *heads)[:length])
