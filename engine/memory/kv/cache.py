"""The KV tensors: per layer, keys and values stored in fixed-size pages, as floats or quantized (engine/memory/kv/quant.py).

Every tensor of a layer is shaped [num_pages, page_size, num_kv_heads, ...], so a page id means the same slots in
all of them: page bookkeeping (allocation, prefix reuse, windows) never needs to know the number format."""
from __future__ import annotations

import torch

from engine.memory.kv import quant
from engine.memory.kv.quant import kv_format
from engine.memory.geometry import PAGE_SIZE
from kernels import dispatch


class KVCache:
    """`dtype`: a torch float dtype or a kv_dtype name (fp32, fp16, bf16, k8v8, k8v4, k4v4, rk4v4).

    `k[layer]` / `v[layer]` hold the floats, or the quantized codes (int8 [.., D] or packed int4 uint8 [.., D/2]);
    `k_scale[layer]` / `v_scale[layer]` the fp16 scales [.., D / group] (None for floats). For the rk* formats K is
    stored in the Hadamard-rotated basis: `gather` returns it so, and `rotate_queries` brings q into the same basis."""

    def __init__(self, num_layers: int, num_pages: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype | str, device: torch.device, page_size: int = PAGE_SIZE, pin: bool = False):
        """`pin`: page-locked host memory (for a host tier on a CUDA machine: copies to the GPU can be async)."""
        self.page_size = page_size
        self.num_layers, self.num_kv_heads = num_layers, num_kv_heads
        self.num_pages = num_pages
        self.format = kv_format(dtype)
        self.kv_dtype = self.format.name
        self.head_dim = head_dim
        lead = (num_pages, page_size, num_kv_heads)

        def alloc(part):
            tensors = {name: [_zeros(lead + (n,), dt, device, pin) for _ in range(num_layers)]
                       for name, n, dt in quant.part_layout(part, head_dim)}
            return tensors["data"], tensors.get("scale")

        self.k, self.k_scale = alloc(self.format.k)
        self.v, self.v_scale = alloc(self.format.v)
        # caches addressed by the same page ids (an MTP module's own layer): copy_pages copies their pages too
        self.followers: list[KVCache] = []

    # ---- sizes (engine.memory.geometry.KV_LAYOUTS states them before anything is allocated) -----------------
    @property
    def page_bytes(self) -> int:
        """Bytes of one page over all layers, counted from the allocated tensors."""
        tensors = [t for group in (self.k, self.v, self.k_scale, self.v_scale) if group for t in group]
        return sum(t.numel() * t.element_size() for t in tensors) // self.num_pages

    @property
    def token_bytes(self) -> int:
        return self.page_bytes // self.page_size

    # ---- writing and reading ----------------------------------------------------------------------------------
    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Stores this step's k/v [T, Hkv, D] at flat slots (page * page_size + offset), quantizing on the way."""
        fmt = self.format
        if fmt.k.rotate:
            k = quant.rotate(k, torch.float32)
        self._put(self.k[layer], self.k_scale[layer] if fmt.k.quantized else None, fmt.k.bits, slots, k)
        self._put(self.v[layer], self.v_scale[layer] if fmt.v.quantized else None, fmt.v.bits, slots, v)

    @staticmethod
    def _put(data: torch.Tensor, scale: torch.Tensor | None, bits: int | None, slots: torch.Tensor,
             x: torch.Tensor) -> None:
        if scale is None:
            data.view(-1, *data.shape[2:]).index_copy_(0, slots, x if x.dtype == data.dtype else x.to(data.dtype))
            return
        if dispatch.kv_quant_write(x, slots, data, scale, bits, quant.group_size(bits, x.shape[-1])):
            return  # quantized and written by the Triton kernel (kernels/kv_write.py)
        codes, s = quant.quantize(x, bits)
        data.view(-1, *data.shape[2:]).index_copy_(0, slots, codes)
        scale.view(-1, *scale.shape[2:]).index_copy_(0, slots, s)

    def gather(self, layer: int, pages: torch.Tensor, length: int, dtype: torch.dtype | None = None,
               first_page: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `length` tokens' K and V along the page list, each [length, Hkv, D], in `dtype` (default: the
        stored float dtype, or float32 for quantized parts). K of an rk* format is in the rotated basis.
        `first_page`, when the pages are the consecutive ids first_page, first_page + 1, ...: a float part is then
        returned as a view of the cache (read-only for the caller), not a copy."""
        fmt = self.format
        k = self._take(self.k[layer], self.k_scale[layer] if fmt.k.quantized else None, fmt.k.bits, pages,
                       length, dtype, first_page)
        v = self._take(self.v[layer], self.v_scale[layer] if fmt.v.quantized else None, fmt.v.bits, pages,
                       length, dtype, first_page)
        return k, v

    @staticmethod
    def _take(data: torch.Tensor, scale: torch.Tensor | None, bits: int | None, pages: torch.Tensor, length: int,
              dtype: torch.dtype | None, first_page: int | None = None) -> torch.Tensor:
        def rows(t):
            if first_page is not None:
                return t[first_page:first_page + pages.numel()].view(-1, *t.shape[2:])[:length]
            if pages.numel() == 1:
                return t[int(pages[0]), :length]
            return t.index_select(0, pages).view(-1, *t.shape[2:])[:length]

        if scale is None:
            x = rows(data)
            return x if dtype is None or dtype == x.dtype else x.to(dtype)
        return quant.dequantize(rows(data), rows(scale), bits, dtype or torch.float32)

    def span(self, layer: int, first_slot: int, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `length` consecutive flat slots from `first_slot` (a sequence on consecutive pages), each
        [length, Hkv, D] in `dtype`: views of a float cache in that dtype, else dequantized (rotated K for rk*). Shapes
        follow the two ints, so a compiled decode step reads any context length through one graph."""
        fmt = self.format

        def part(data, scale, bits):
            rows = data.view(-1, *data.shape[2:])[first_slot:first_slot + length]
            if scale is None:
                return rows if rows.dtype == dtype else rows.to(dtype)
            return quant.dequantize(rows, scale.view(-1, *scale.shape[2:])[first_slot:first_slot + length], bits, dtype)

        return (part(self.k[layer], self.k_scale[layer] if fmt.k.quantized else None, fmt.k.bits),
                part(self.v[layer], self.v_scale[layer] if fmt.v.quantized else None, fmt.v.bits))

    def gather_keys(self, layer: int, pages: torch.Tensor) -> torch.Tensor:
        """K of whole pages, [len(pages) * page_size, Hkv, D] float32 (rotated basis for rk*)."""
        fmt = self.format
        return self._take(self.k[layer], self.k_scale[layer] if fmt.k.quantized else None, fmt.k.bits, pages,
                          pages.numel() * self.page_size, torch.float32)

    def layer_tensors(self, layer: int) -> list[torch.Tensor]:
        """Every tensor of one layer (codes and scales), each indexed by page id first."""
        return [group[layer] for group in (self.k, self.v, self.k_scale, self.v_scale) if group]

    def decode_attention(self, layer: int, q: torch.Tensor, page_table: torch.Tensor, ctx_lens: torch.Tensor,
                         scale: float) -> torch.Tensor:
        """One token per row of q [B, Hq, D] attending over its page-table row [B, P] up to ctx_lens [B]: the paged
        decode kernel (kernels.dispatch), reading this layer's float or quantized pages in place."""
        fmt = self.format
        return dispatch.paged_decode_attention(q, self.k[layer], self.v[layer], page_table, ctx_lens, scale,
                                               k_scale=self.k_scale[layer] if fmt.k.quantized else None,
                                               v_scale=self.v_scale[layer] if fmt.v.quantized else None)

    def rotate_queries(self, q: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D] in the basis gather's K is in: rotated for the rk* formats, q itself otherwise."""
        return quant.rotate(q) if self.format.k.rotate else q

    def copy_pages(self, src: torch.Tensor | list[int], dst: torch.Tensor | list[int]) -> None:
        """Copies whole pages (codes and scales, every layer): page src[i] -> dst[i]."""
        device = self.k[0].device
        src = torch.as_tensor(src, dtype=torch.long, device=device)
        dst = torch.as_tensor(dst, dtype=torch.long, device=device)
        for group in (self.k, self.v, self.k_scale, self.v_scale):
            for t in group or ():
                t.index_copy_(0, dst, t.index_select(0, src))
        for cache in self.followers:
            cache.copy_pages(src, dst)


def _zeros(shape, dtype, device, pin: bool) -> torch.Tensor:
    """Allocated page-locked from the start when pinned (pinning a copy would briefly need twice the memory)."""
    if pin:
        return torch.zeros(shape, dtype=dtype, device="cpu", pin_memory=True)
    return torch.zeros(shape, dtype=dtype, device=device)
