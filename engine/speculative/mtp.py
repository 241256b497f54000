"""`--spec mtp`: multi-token-prediction layers shipped with the checkpoint draft from the target's hidden state.

An MTP layer at position i reads the target's last hidden state h_i and the embedding of the next token t_{i+1}:
x = fc([norm_e(embed(t_{i+1})), norm_h(h_i)]), then one decoder layer (attention over its own KV, at the target's
page slots), the norm and the output layer predict t_{i+2}. Chained, its output hidden state stands in for h of the
next position. Two checkpoint layouts are read:
- Qwen3-Next / Qwen3.5: mtp.fc, mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden, mtp.layers.0.*, mtp.norm;
- DeepSeek-V3 (num_nextn_predict_layers): model.layers.{L}.eh_proj, enorm, hnorm, shared_head.norm
  (+ shared_head.head), and the decoder layer's own tensors under model.layers.{L}, L = num_hidden_layers.
The target's model class builds the decoder layer (`mtp_layer`: a llama DecoderLayer, or Qwen3.5's gated attention
layer), scales the block's norms its own way (`mtp_norm`: plain weight * x, or Qwen3.5's 1 + w) and says which hidden
state the block reads (`mtp_reads_normed_hidden`): the llama family reads h before the final norm and chains the
layer's output before mtp.norm; Qwen3.5 (as vLLM's qwen3_5_mtp) reads h after the final norm and chains the output
after mtp.norm, the same rows its logits come from.

Every target forward is followed by an MTP pass over the positions whose next token is now known (prompt chunks,
accepted drafts), so the MTP KV stays complete; the pass's last row starts the draft chain for the next step. On a
hybrid, a verification step with a rejected draft rolls the recurrent state back and rewinds the sequence to the
step's start (engine/memory/state.py): the step keeps no rows, and the next step's pass recomputes them."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from engine.errors import ModelLoadError
from engine.ledger.common import DEFAULT_DRAFT_TOKENS
from engine.model.head import embed_rows
from engine.model.layers import rms_norm
from engine.model.linear import Linear
from engine.runner import ModelRunner, Work
from engine.sequence import Sequence
from engine.speculative.heads import draft_head, greedy_tokens


@dataclass
class MTPWeights:
    """One MTP layer's tensors under common names (layer: the decoder layer's tensors, names relative to it)."""
    fc: torch.Tensor  # [H, 2H]: input [embedding half, hidden half]
    norm_embedding: torch.Tensor
    norm_hidden: torch.Tensor
    norm_out: torch.Tensor
    layer: dict[str, torch.Tensor]  # "input_layernorm.weight", "self_attn.q_proj.weight", ...
    head: torch.Tensor | None = None  # its own output layer, when the checkpoint has one
    layout: str = ""
    names: dict[str, str] = field(default_factory=dict)  # common name (fc, norm_out, ...) -> the checkpoint's
    prefix: str = ""  # the checkpoint's prefix of the layer's tensors


_FIELDS = ("fc", "norm_embedding", "norm_hidden", "norm_out", "head", "layer")
_LAYOUTS = {  # the checkpoint's names of _FIELDS ("layer": the prefix of the decoder layer's tensors)
    "qwen3-next": ("mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
                   "mtp.norm.weight", "mtp.lm_head.weight", "mtp.layers.0."),
    "deepseek-v3": ("{L}eh_proj.weight", "{L}enorm.weight", "{L}hnorm.weight", "{L}shared_head.norm.weight",
                    "{L}shared_head.head.weight", "{L}"),  # {L}: model.layers.{num_hidden_layers}.
}


def find_mtp(tensors: dict[str, torch.Tensor], cfg) -> MTPWeights | None:
    """The first MTP layer in a checkpoint's tensors, in either layout; None when there is none. A layout found with
    a tensor missing is refused, naming it."""
    for layout, layout_names in _LAYOUTS.items():
        names = {k: n.format(L=f"model.layers.{cfg.num_layers}.") for k, n in zip(_FIELDS, layout_names)}
        if names["fc"] not in tensors:
            continue
        missing = [names[k] for k in ("norm_embedding", "norm_hidden", "norm_out") if names[k] not in tensors]
        if missing:
            raise ModelLoadError(f"--spec mtp: the checkpoint's MTP layer ({layout} layout) lacks "
                                 f"{', '.join(missing)}.", "The checkpoint is incomplete: download or convert it "
                                                           "again, or use --spec ngram.")
        p = names["layer"]
        layer = {n.removeprefix(p): t for n, t in tensors.items() if n.startswith(p)}
        return MTPWeights(tensors[names["fc"]], tensors[names["norm_embedding"]], tensors[names["norm_hidden"]],
                          tensors[names["norm_out"]], layer, tensors.get(names["head"]), layout, names, p)
    return None


def check_mtp_shapes(w: MTPWeights, target) -> None:
    """Every tensor the MTP block reads is there with the shape the target's configuration gives it; otherwise a
    ModelLoadError names the first tensor that is missing or mis-shaped."""
    cfg = target.cfg
    h = cfg.hidden_size
    expected = {"fc": (w.fc, (h, 2 * h)), "norm_embedding": (w.norm_embedding, (h,)),
                "norm_hidden": (w.norm_hidden, (h,)), "norm_out": (w.norm_out, (h,))}
    if w.head is not None:
        expected["head"] = (w.head, (cfg.vocab_size, h))
    rows = [(w.names.get(k, k), t, shape) for k, (t, shape) in expected.items()]
    layer = type(target).layer_shapes("attention", cfg, "")
    rows += [(w.prefix + n, w.layer.get(n), shape) for n, shape in layer.items()]
    for name, t, shape in rows:
        if t is None:
            raise ModelLoadError(f"--spec mtp: the checkpoint's MTP layer lacks {name} (a {cfg.arch} attention "
                                 f"layer needs it, shape {list(shape)}).",
                                 "The checkpoint is incomplete: download or convert it again, or use --spec ngram.")
        if tuple(t.shape) != shape:
            raise ModelLoadError(f"--spec mtp: MTP tensor {name} has shape {list(t.shape)}, but this {cfg.arch} "
                                 f"model (hidden {h}) needs {list(shape)}.",
                                 "The MTP layers belong to another model or were converted wrongly; use the "
                                 "checkpoint they came with, or --spec ngram.")


def is_mtp_tensor(name: str, num_layers: int) -> bool:
    return name.startswith(("mtp.", f"model.layers.{num_layers}."))


class MTPModule:
    """The MTP layer as a model the ModelRunner can run: forward(batch) reads `self.hidden_in` (one row per
    token of the batch, as the block reads them: see from_target) beside the batch's token ids; it keeps the hidden
    states its chain goes on from in `self.hidden_out`."""

    def __init__(self, target, w: MTPWeights, lm_head_draft: bool):
        check_mtp_shapes(w, target)
        dev, dt = target.device, target.dtype
        moe = target.cfg.moe  # the block's MLP is MoE where the model's every layer is (engine/model/moe.py)
        self.cfg = replace(target.cfg, num_layers=1, layer_kinds=("attention",),
                           moe=moe and replace(moe, layers=(0,) if "mlp.gate.weight" in w.layer else ()))
        self.device, self.dtype = dev, dt
        self.embed, self.rotary = target.embed, target.rotary
        self.target_norm = target.norm
        self.normed_hidden = target.mtp_reads_normed_hidden
        to = lambda t: t.to(device=dev, dtype=dt)
        self.fc = Linear(to(w.fc))
        self.norm_e, self.norm_h, self.norm_out = (to(target.mtp_norm(t)) for t in (w.norm_embedding, w.norm_hidden,
                                                                                     w.norm_out))
        self.layer = target.mtp_layer(self.cfg, w.layer)
        self.lm_head = draft_head(Linear(to(w.head)) if w.head is not None else target.lm_head, lm_head_draft)
        self.hidden_in: torch.Tensor | None = None
        self.hidden_out: torch.Tensor | None = None

    @property
    def cache_specs(self) -> list:
        return [self.layer.cache_spec]

    def from_target(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's kept hidden rows (before its final norm) as the block reads them."""
        return rms_norm(hidden, self.target_norm, self.cfg.rms_eps) if self.normed_hidden else hidden

    @torch.inference_mode()
    def forward(self, batch) -> torch.Tensor:
        eps = self.cfg.rms_eps
        e = rms_norm(embed_rows(self.embed, batch.input_ids).to(self.dtype), self.norm_e, eps)
        h = rms_norm(self.hidden_in.to(self.dtype), self.norm_h, eps)
        x = self.fc(torch.cat([e, h], dim=-1))
        x, residual = self.layer.forward(x, None, 0, batch, self.rotary)
        x = residual + x
        if self.normed_hidden:  # the chain goes on from the normed rows the logits come from
            x = rms_norm(x, self.norm_out, eps)
        self.hidden_out = x
        rows = x if batch.logit_rows is None else x.index_select(0, batch.logit_rows)
        return self.lm_head(rows if self.normed_hidden else rms_norm(rows, self.norm_out, eps)).float()


class MTPProposer:
    name = "mtp"
    default_tokens = DEFAULT_DRAFT_TOKENS["mtp"]
    needs_hidden = True

    def __init__(self, target, runner: ModelRunner, weights: MTPWeights, lm_head_draft: bool = False):
        self.module = MTPModule(target, weights, lm_head_draft)
        target.keep_hidden = True
        # its own one-layer KV cache, addressed by the target sequences' page ids
        self.runner = ModelRunner(self.module, runner.pool.num_pages, runner.kv.kv_dtype, runner.page_size)
        runner.kv.followers.append(self.runner.kv)  # a prefix's copied tail page brings its MTP KV along
        self.target_pool = runner.pool
        self.layout = weights.layout
        self._pending: dict[str, tuple[int, list[int]]] = {}  # request id -> (len(tokens) it was drafted for, drafts)

    def propose(self, requests: list[tuple[Sequence, int]]) -> list[list[int]]:
        out = []
        for seq, k in requests:
            at, drafts = self._pending.pop(seq.request_id, (-1, []))
            out.append(drafts[:k] if at == len(seq.tokens) else [])
        return out

    def observe(self, items: list[tuple[Sequence, int, torch.Tensor]], chain: dict[str, int]) -> None:
        """After a target step: items are (sequence, first position computed, the target's hidden rows of the
        positions it kept); chain: request id -> draft length wanted for the sequences that decode next."""
        entries = []
        for seq, start, rows in items:
            if rows.shape[0]:
                logits = "last" if seq.request_id in chain else None
                entries.append((seq, Work(seq.tokens[start + 1:start + 1 + rows.shape[0]], start, seq.pages, logits),
                                rows))
        if not entries:
            return
        hidden = self.module.from_target(torch.cat([r for _, _, r in entries]))
        logits = self._run([w for _, w, _ in entries], hidden)
        heads, offset = [], 0
        for (seq, w, _), lg in zip(entries, logits):
            offset += len(w.tokens)
            if lg is not None:
                heads.append((seq, offset - 1, lg[-1]))
        self._chain(heads, chain)

    def _chain(self, heads, chain: dict[str, int]) -> None:
        """Greedy drafts for each sequence: the first from the catch-up pass's last row, then one MTP step each."""
        active = []
        for seq, row, logits in heads:
            k = chain[seq.request_id]
            token = greedy_tokens(logits[None])[0]
            self._pending[seq.request_id] = (len(seq.tokens), [token])
            if k > 1 and seq.pages.grow(self.target_pool, len(seq.tokens) + k - 1):
                active.append((seq, k, self.module.hidden_out[row:row + 1].clone()))
        step = 0
        while active:
            step += 1
            works = [Work([self._pending[s.request_id][1][-1]], len(s.tokens) - 2 + step,
                          s.pages) for s, _, _ in active]
            logits = self._run(works, torch.cat([h for _, _, h in active]))
            tokens = greedy_tokens(torch.cat([lg[-1:] for lg in logits]))
            still = []
            for i, ((seq, k, _), token) in enumerate(zip(active, tokens)):
                drafts = self._pending[seq.request_id][1]
                drafts.append(token)
                if len(drafts) < k:
                    still.append((seq, k, self.module.hidden_out[i:i + 1].clone()))
            active = still

    def _run(self, works: list[Work], hidden: torch.Tensor) -> list[torch.Tensor | None]:
        self.module.hidden_in = hidden
        try:
            return self.runner.run(works)
        finally:
            self.module.hidden_in = None

    def verified(self, seq: Sequence) -> None:
        pass  # the next observe() recomputes the MTP KV of every position the target kept

    def release(self, seq: Sequence) -> None:
        self._pending.pop(seq.request_id, None)

    def stats(self) -> dict:
        return {}
