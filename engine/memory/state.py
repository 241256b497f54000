"""The recurrent layers' memory: a pool of fixed-size state slots, and what a sequence's state needs around it.

A slot holds one sequence's state for every recurrent layer (tensors [num_slots, *shape] per layer and name). A
running sequence owns one slot. Unlike KV pages, a state has no "forget the last k positions": it only moves
forward. So:

- rollback (rejected draft tokens): before a verification step the sequence's state is copied to a checkpoint
  slot. When drafts are rejected, the checkpoint goes back into the sequence's slot and the sequence rewinds to the
  step's start: the next step recomputes the kept tokens (their KV is rewritten with the same values). One spare
  slot per speculating sequence, not one per draft token (a Qwen3.5-27B state is ~147 MiB);
- prefix reuse: at the deepest page boundary each step reaches, the state there is saved as a snapshot keyed like
  the prefix cache's pages (engine.memory.kv.prefix.page_key over the tokens so far); a sequence keeps two: the
  deepest within its prompt (the same prompt sent again: a regenerated answer, another sampling) and the deepest of
  all (the next turn of the conversation, which holds the answer). Admission may reuse cached KV pages only as deep as the deepest snapshot among them; the snapshot is copied
  into the new sequence's slot. A cached prefix without a snapshot is recomputed, and counted
  (state_snapshot_misses) and logged, never silently used;
- snapshots live in host memory (page-locked on CUDA), outside the pool: at most `max_snapshots` of them, least
  recently used evicted first, their buffers reused. The model writes a snapshot straight into its buffer at the
  page boundary inside a step, so the device holds only the running sequences' slots and their checkpoints."""
from __future__ import annotations

import heapq
import logging
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from engine.memory.kv.prefix import key_tokens, page_key
from engine.memory.dtypes import float_format
from engine.memory.specs import RecurrentSpec

log = logging.getLogger("ninfer.state")


Snapshot = list  # one state outside the pool: per recurrent layer, {tensor name: tensor of one slot's shape}


class StatePool:
    def __init__(self, specs: list[RecurrentSpec], num_slots: int, device: torch.device, scratch: bool = False):
        """`scratch`: one more slot, never handed out, for the dummy rows of static decode batches
        (engine/model/graphs.py): `self.scratch`."""
        self.num_slots, self.device = num_slots, device
        self.scratch = num_slots if scratch else None
        self.layers = [{t.name: torch.zeros((num_slots + scratch, *t.shape), dtype=getattr(torch, float_format(t.dtype).torch_name),
                                            device=device) for t in spec.tensors} for spec in specs]
        self.slot_bytes = sum(spec.nbytes for spec in specs)
        self._free = list(range(num_slots))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        """A zeroed slot (the state before any token)."""
        if not self._free:
            raise MemoryError("no free recurrent-state slot")
        slot = heapq.heappop(self._free)
        self.zero(slot)
        return slot

    def free(self, slots) -> None:
        for slot in slots:
            heapq.heappush(self._free, slot)

    def zero(self, slot: int) -> None:
        for tensors in self.layers:
            for t in tensors.values():
                t[slot].zero_()

    def copy(self, src: int, dst: int) -> None:
        for tensors in self.layers:
            for t in tensors.values():
                t[dst].copy_(t[src])

    def host_buffer(self) -> Snapshot:
        """Room for one state in host memory (page-locked where the pool is on CUDA, for fast copies)."""
        pin = torch.device(self.device).type == "cuda"
        return [{name: torch.empty(t.shape[1:], dtype=t.dtype, pin_memory=pin) for name, t in tensors.items()}
                for tensors in self.layers]

    def store(self, slot: int, snap: Snapshot) -> None:
        for tensors, dst in zip(self.layers, snap):
            for name, t in tensors.items():
                dst[name].copy_(t[slot])

    def load(self, snap: Snapshot, slot: int) -> None:
        for tensors, src in zip(self.layers, snap):
            for name, t in tensors.items():
                t[slot].copy_(src[name])

    def read(self, slots: list[int]) -> list[dict[str, torch.Tensor]]:
        """Copies of these slots' states (every layer), for `write` to put back."""
        index = torch.tensor(slots, device=self.device)
        return [{name: t.index_select(0, index) for name, t in tensors.items()} for tensors in self.layers]

    def write(self, slots: list[int], saved: list[dict[str, torch.Tensor]]) -> None:
        for tensors, old in zip(self.layers, saved):
            for name, t in tensors.items():
                t[slots] = old[name]


@dataclass
class SeqState:
    """One sequence's part of the state pool."""
    slot: int
    checkpoint: int | None = None  # a spare slot for speculation: the state before a verification step
    verify: tuple[int, int] | None = None  # this step verifies drafts: (its start, tokens computed)
    saves: list[tuple[int, Snapshot]] = field(default_factory=list)  # this step: the state after token i, saved
    snaps: list[tuple[int, bytes, Snapshot]] = field(default_factory=list)  # this step: (position, key, buffer)
    snapshot: bytes | None = None  # the key of the deepest snapshot this sequence left
    prompt_snapshot: bytes | None = None  # ... and of the deepest within its prompt (may be the same)


class StateMemory:
    def __init__(self, pool: StatePool, page_size: int, max_snapshots: int = 0):
        self.pool, self.page_size, self.max_snapshots = pool, page_size, max_snapshots
        self._snapshots: OrderedDict[bytes, Snapshot] = OrderedDict()  # key -> buffer, least recently used first
        self._spare: list[Snapshot] = []  # buffers of evicted or unused snapshots, reused before allocating
        self._pending = 0  # snapshot buffers taken for the step running now, stored or spared after it
        self.counters = dict(state_snapshot_hits=0, state_snapshot_misses=0, state_snapshots_taken=0,
                             state_rollbacks=0)

    # ---- slots ------------------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return self.pool.num_free

    def _take(self) -> int | None:
        return self.pool.allocate() if self.pool.num_free else None

    def can_admit(self) -> bool:
        return self.num_free >= 1

    # ---- admission ----------------------------------------------------------------------------------------------
    def usable(self, keys: list[bytes]) -> int:
        """Of the matched cached pages (their chain keys), how many may be reused: as deep as the deepest snapshot."""
        for depth in range(len(keys), 0, -1):
            if keys[depth - 1] in self._snapshots:
                return depth
        self.counters["state_snapshot_misses"] += 1
        log.info("a cached prefix of %d tokens has no recurrent-state snapshot: it is recomputed",
                 len(keys) * self.page_size)
        return 0

    def admit(self, seq) -> None:
        """Gives the admitted sequence a slot: the snapshot at seq.num_computed (reused pages), or a zeroed one."""
        key = self._key(seq, seq.num_computed // self.page_size) if seq.num_computed else None
        if key is not None and key not in self._snapshots:
            raise RuntimeError(f"{seq.request_id}: no state snapshot at {seq.num_computed} tokens")
        seq.memory.state = SeqState(self._take())
        if key is not None:
            self._snapshots.move_to_end(key)  # the most recently used now
            self.pool.load(self._snapshots[key], seq.memory.state.slot)
            self.counters["state_snapshot_hits"] += 1

    def _key(self, seq, pages: int) -> bytes:
        """The chain key of the sequence's first `pages` pages (computed once per page)."""
        keys, ps, tokens = seq.memory.keys, self.page_size, key_tokens(seq)
        while len(keys) < pages:
            n = len(keys)
            keys.append(page_key(keys[-1] if keys else b"", tokens[n * ps:(n + 1) * ps]))
        return keys[pages - 1]

    # ---- around a step ------------------------------------------------------------------------------------------
    def reserve_drafts(self, seq) -> bool:
        """A checkpoint slot for the sequence's next verification step; False when the pool has none."""
        st = seq.memory.state
        if st.checkpoint is None:
            st.checkpoint = self._take()
        return st.checkpoint is not None

    def before_step(self, seq, start: int, n: int, verify: bool = False) -> None:
        """Before the step computes tokens [start, start + n): a verification step checkpoints the state; states at
        each page boundary of known tokens are saved as snapshots."""
        st = seq.memory.state
        st.saves, st.snaps, st.verify = [], [], None
        if verify:
            self.pool.copy(st.slot, st.checkpoint)
            st.verify = (start, n)
        if not self.max_snapshots:
            return
        ps = self.page_size
        pos = min(start + n, len(seq.tokens)) // ps * ps  # the deepest page boundary of known tokens this step
        if pos <= start:
            return
        key = self._key(seq, pos // ps)
        if key in self._snapshots:
            self._snapshots.move_to_end(key)
            return
        snap = self._snapshot_buffer()
        if snap is not None:
            st.saves.append((pos - start - 1, snap))
            st.snaps.append((pos, key, snap))

    def _snapshot_buffer(self) -> Snapshot | None:
        """A buffer for a new snapshot within the budget: a spare one, a new one, or the least recently used
        snapshot's."""
        if len(self._snapshots) + self._pending >= self.max_snapshots:
            if not self._snapshots:
                return None
            snap = self._snapshots.popitem(last=False)[1]
        else:
            snap = self._spare.pop() if self._spare else self.pool.host_buffer()
        self._pending += 1
        return snap

    def computed(self, seq) -> None:
        """After the step: a snapshot of a position the sequence kept is stored; it replaces the sequence's
        shallower deepest one, and within the prompt its shallower prompt one (a later request reuses the deepest
        prefix it shares); the others' buffers are spared."""
        st = seq.memory.state
        self._pending -= len(st.snaps)
        for pos, key, snap in st.snaps:
            if pos <= seq.num_computed and key not in self._snapshots:
                in_prompt = pos <= len(seq.prompt)
                self._drop(st.snapshot, keep=None if in_prompt else st.prompt_snapshot)
                if in_prompt:
                    self._drop(st.prompt_snapshot)
                    st.prompt_snapshot = key
                self._snapshots[key], st.snapshot = snap, key
                self.counters["state_snapshots_taken"] += 1
            else:
                self._spare.append(snap)
        st.snaps, st.saves = [], []

    def _drop(self, key: bytes | None, keep: bytes | None = None) -> None:
        if key is not None and key != keep and key in self._snapshots:
            self._spare.append(self._snapshots.pop(key))

    def rollback(self, seq) -> None:
        """After a verification step that rejected drafts: the checkpoint goes back into the sequence's slot, and
        the sequence rewinds to the step's start (its kept tokens are computed again next step)."""
        st = seq.memory.state
        if st is None or st.verify is None:
            return
        start, n = st.verify
        st.verify = None
        if seq.num_computed < start + n:
            self.pool.copy(st.checkpoint, st.slot)
            seq.num_computed = start
            self.counters["state_rollbacks"] += 1

    def release(self, seq) -> None:
        st = seq.memory.state
        if st is None:
            return
        self._pending -= len(st.snaps)
        self._spare.extend(snap for _, _, snap in st.snaps)
        self.pool.free([st.slot, *([st.checkpoint] if st.checkpoint is not None else [])])
        seq.memory.state = None

    def stats(self) -> dict:
        return dict(self.counters, state_slots_total=self.pool.num_slots, state_slots_free=self.num_free,
                    state_snapshots=len(self._snapshots),
                    state_snapshot_host_bytes=(len(self._snapshots) + self._pending + len(self._spare))
                    * self.pool.slot_bytes, state_slot_bytes=self.pool.slot_bytes)
