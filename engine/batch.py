"""What one forward pass computes: a flat run of tokens from several sequences, and where their KV lives."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SeqSlice:
    q_start: int  # first row of this sequence in the flat token batch
    q_len: int  # tokens of this sequence computed in this step
    ctx_len: int  # tokens in its KV after this step (earlier context + q_len)
    pages: torch.Tensor | None  # page ids covering ctx_len tokens, in order (None for a windowed sequence)
    tiers: "object | None" = None  # engine.memory.kv.window.TieredPages of a windowed sequence, prepared for this step
    first_page: int | None = None  # set when `pages` are consecutive ids: the CPU path reads them as a view, no copy
    state: int | None = None  # its recurrent-state slot (engine/memory/state.py), for models with recurrent layers
    saves: tuple = ()  # (i, snapshot): after its token i of this step, save the state (engine/memory/state.py)
    _memo: dict = field(default_factory=dict, repr=False, compare=False)  # per-step tensors every layer reuses

    def causal_mask(self, device) -> torch.Tensor:
        """[q_len, ctx_len] bool: token i of this step sees the earlier context and tokens up to itself (built once
        per step, shared by every layer)."""
        key = ("mask", str(device))
        if key not in self._memo:
            offset = self.ctx_len - self.q_len
            rows = torch.arange(self.q_len, device=device).unsqueeze(1) + offset
            self._memo[key] = torch.arange(self.ctx_len, device=device).unsqueeze(0) <= rows
        return self._memo[key]

    def ctx_lens(self, device, length: int | None = None) -> torch.Tensor:
        """[1] int32 tokens attended to (ctx_len, or a windowed sequence's `length`) on the device, for the
        paged-attention kernel (built once per step and length, not once per layer)."""
        n = self.ctx_len if length is None else length
        key = ("ctx", n, str(device))
        if key not in self._memo:
            self._memo[key] = torch.tensor([n], dtype=torch.int32, device=device)
        return self._memo[key]


@dataclass
class DecodeTable:
    """A static decode batch's attention metadata (engine/model/graphs.py): one token per row, fixed shapes."""
    page_table: torch.Tensor  # int32 [B, P]: each row's page ids (unused entries: the scratch page)
    ctx_lens: torch.Tensor  # int32 [B]: tokens each row attends to, its own included
    state_slots: torch.Tensor | None = None  # int64 [B]: each row's recurrent-state slot (models with recurrent layers)
    rows: list[SeqSlice] | None = None  # each real row's pages on the host, where attention reads them as views (CPU)
    span: tuple[int, int] | None = None  # one row on consecutive pages: (first flat slot, tokens) (engine/model/cpu_step.py)


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slots: torch.Tensor  # [T] flat KV slot (page * page_size + offset) each token's K/V is written to
    seqs: list[SeqSlice]
    kv: "object"  # engine.memory.kv.cache.KVCache
    state: "object | None" = None  # engine.memory.state.StatePool (models with recurrent layers)
    logit_rows: torch.Tensor | None = None  # rows to compute logits for; None = every row
    max_position: int = 0
    decode: DecodeTable | None = None  # set for a static decode step: attention reads this table, not `seqs`
    # images (engine/model/vision_input.py): M-RoPE positions [3, T] (time, height, width) of a step with image
    # tokens, None otherwise (1-D `positions`); and (rows [N], values [N, hidden]): embeddings that replace the
    # embedding lookup of those rows
    rope_positions: torch.Tensor | None = None
    image_rows: tuple[torch.Tensor, torch.Tensor] | None = None
    _memo: dict = field(default_factory=dict, repr=False, compare=False)

    def single_token_rows(self) -> tuple[list[SeqSlice], torch.Tensor | None, torch.Tensor | None]:
        """The sequences computing one token this step, their rows and their state slots (device tensors; None
        when there are none): recurrent layers step them together (built once per step, shared by every layer)."""
        if "ones" not in self._memo:
            ones = [s for s in self.seqs if s.q_len == 1]
            dev = self.input_ids.device
            self._memo["ones"] = (ones, torch.tensor([s.q_start for s in ones], device=dev) if ones else None,
                                  torch.tensor([s.state for s in ones], device=dev) if ones else None)
        return self._memo["ones"]
