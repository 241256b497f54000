"""The recurrent layers' memory: a pool of fixed-size state slots, and what a sequence's state needs around it.

A slot holds one sequence's state for every recurrent layer (tensors [num_slots, *shape] per layer and name). A
running sequence owns one slot. Unlike KV pages, a state has no "forget the last k positions": it only moves
forward. So:

- rollback (rejected draft tokens): before a verification step the sequence's state is copied to a checkpoint
  slot. When drafts are rejected, the checkpoint goes back into the sequence's slot and the sequence rewinds to the
  step's start: the next step recomputes the kept tokens (their KV is rewritten with the same values). One spare
  slot per speculating sequence, not one per draft token (a Qwen3.5-27B state is ~147 MiB);
- prefix reuse: at the deepest page boundary each step reaches, the state there is saved as a snapshot keyed like
  the prefix cache's pages (engine.kv.prefix.page_key over the tokens so far); a sequence keeps only its deepest
  one. Admission may reuse cached KV pages only as deep as the deepest snapshot among them; the snapshot is copied
  into the new sequence's slot. A cached prefix without a snapshot is recomputed, and counted
  (state_snapshot_misses) and logged, never silently used;
- snapshots are kept in slots of the same pool, at most `max_snapshots`, least recently used evicted first; idle
  snapshots give way to running sequences (they count as free for admission)."""
from __future__ import annotations

import heapq
import logging
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from engine.kv.prefix import page_key
from engine.memory.specs import RecurrentSpec

log = logging.getLogger("ninfer.state")

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class StatePool:
    def __init__(self, specs: list[RecurrentSpec], num_slots: int, device: torch.device, scratch: bool = False):
        """`scratch`: one more slot, never handed out, for the dummy rows of static decode batches
        (engine/model/graphs.py): `self.scratch`."""
        self.num_slots, self.device = num_slots, device
        self.scratch = num_slots if scratch else None
        self.layers = [{t.name: torch.zeros((num_slots + scratch, *t.shape), dtype=TORCH_DTYPES[t.dtype],
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
    saves: list[tuple[int, int]] = field(default_factory=list)  # this step: save the state after token i to slot
    snaps: list[tuple[int, bytes, int]] = field(default_factory=list)  # this step: (position, key, slot)
    snapshot: bytes | None = None  # the key of the deepest snapshot this sequence left


class StateMemory:
    def __init__(self, pool: StatePool, page_size: int, max_snapshots: int = 0):
        self.pool, self.page_size, self.max_snapshots = pool, page_size, max_snapshots
        self._snapshots: OrderedDict[bytes, int] = OrderedDict()  # key -> slot, least recently used first
        self._pending = 0  # snapshot slots taken for the step running now, stored or freed after it
        self.counters = dict(state_snapshot_hits=0, state_snapshot_misses=0, state_snapshots_taken=0,
                             state_rollbacks=0)

    # ---- slots ------------------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Slots a sequence can have now: free ones plus idle snapshots (which it would evict)."""
        return self.pool.num_free + len(self._snapshots)

    def _take(self) -> int | None:
        if not self.pool.num_free and self._snapshots:
            self.pool.free([self._snapshots.popitem(last=False)[1]])
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
        if key is None:
            seq.memory.state = SeqState(self._take())
            return
        source = self._snapshots.pop(key)
        slot = self._take()
        if slot is None:  # the last slot is the snapshot itself: the sequence takes it over
            slot, source = source, None
        else:
            self.pool.copy(source, slot)
            self._snapshots[key] = source  # the most recently used now
        seq.memory.state = SeqState(slot)
        self.counters["state_snapshot_hits"] += 1

    def _key(self, seq, pages: int) -> bytes:
        """The chain key of the sequence's first `pages` pages (computed once per page)."""
        keys, ps = seq.memory.keys, self.page_size
        while len(keys) < pages:
            n = len(keys)
            keys.append(page_key(keys[-1] if keys else b"", seq.tokens[n * ps:(n + 1) * ps]))
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
        slot = self._snapshot_slot()
        if slot is not None:
            st.saves.append((pos - start - 1, slot))
            st.snaps.append((pos, key, slot))

    def _snapshot_slot(self) -> int | None:
        """A slot for a new snapshot within the budget: a free one, or the least recently used snapshot's."""
        if len(self._snapshots) + self._pending >= self.max_snapshots:
            if not self._snapshots:
                return None
            slot = self._snapshots.popitem(last=False)[1]
        else:
            slot = self.pool.allocate() if self.pool.num_free else None
        self._pending += slot is not None
        return slot

    def computed(self, seq) -> None:
        """After the step: a snapshot of a position the sequence kept is stored, replacing the sequence's shallower
        one (a later request reuses the deepest prefix it shares); others' slots are freed."""
        st = seq.memory.state
        self._pending -= len(st.snaps)
        for pos, key, slot in st.snaps:
            if pos <= seq.num_computed and key not in self._snapshots:
                if st.snapshot in self._snapshots:
                    self.pool.free([self._snapshots.pop(st.snapshot)])
                self._snapshots[key], st.snapshot = slot, key
                self.counters["state_snapshots_taken"] += 1
            else:
                self.pool.free([slot])
        st.snaps, st.saves = [], []

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
        self.pool.free([st.slot, *([st.checkpoint] if st.checkpoint is not None else []),
                        *(slot for _, _, slot in st.snaps)])
        seq.memory.state = None

    def stats(self) -> dict:
        return dict(self.counters, state_slots_total=self.pool.num_slots, state_slots_free=self.num_free,
                    state_snapshots=len(self._snapshots), state_slot_bytes=self.pool.slot_bytes)
