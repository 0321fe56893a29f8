"""The running batch's KV cache: one left-padded tensor per layer and kind, each sequence in a slot (a row).

Sequences of different lengths decode in one forward: slot s holds its `length` keys at the right end of the
(slots, kv_heads, width, head_dim) tensors and the attention mask hides the padding on the left. A sequence that
leaves frees its slot without moving anyone's data, and the next one to join is written into that slot: only the
joining sequence's own keys are copied. Sequences that need a new slot (none is free, or they are longer than the
batch is wide) wait in `settle`, which adds all of them in one copy of the batch before the next decode and drops
free slots on the way; free slots are also dropped once they outnumber the live ones. So a step's host time does
not grow with rows × width each time a sequence comes or goes. A free slot is decoded with the others (one token
at position 0 that sees only itself; nobody reads its output) until it is reused or dropped.

In place (a file in the op's cache form, docs/op.md): the tensors are buffers with room beyond the batch's width
(`capacity` keys); a decode step's attention writes each slot's new key into column `width` of the same buffers,
and `advance` only moves the width — no step copies the cache. A prefill writes in place too, into the sequence's
own buffers as wide as its reservation, so a sequence that settles into an empty batch brings its buffers along:
the batch takes them as they are, with no copy before its first decode step. When the width reaches the capacity,
`reserve` moves the batch into buffers with a quarter more room (at least 64 keys): amortised, a copy per width/4 steps.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import numpy as np

Tensor = Any  # a NumPy array on the host (onnxruntime), a torch tensor where the backend keeps its cache on CUDA


def _torch(t: Tensor) -> bool:
    """Whether `t` is a torch tensor: torch is imported only by backends that hand the cache torch tensors."""
    return not isinstance(t, np.ndarray)


def concat(ts: list[Tensor]) -> Tensor:
    """Tensors joined along the batch axis."""
    if _torch(ts[0]):
        import torch

        return torch.cat(ts)
    return np.concatenate(ts)


def contiguous(t: Tensor) -> Tensor:
    return t.contiguous() if _torch(t) else np.ascontiguousarray(t)


def _left_pad(t: Tensor, width: int) -> Tensor:
    """(B, H, T, D) → (B, H, width, D) with zero keys on the left."""
    if _torch(t):
        import torch.nn.functional as F

        return F.pad(t, (0, 0, width - t.shape[2], 0))
    return np.pad(t, ((0, 0), (0, 0), (width - t.shape[2], 0), (0, 0)))


GROWTH, MIN_ROOM = 4, 64  # in place: a full buffer grows by a quarter of its width, at least 64 keys


def _into(sources: tuple[np.ndarray, ...], width: int, room: int) -> np.ndarray:
    """The rows of `sources` stacked in a zeroed buffer of `room` keys, each right-aligned at column `width`."""
    first = sources[0]
    out = np.zeros((sum(s.shape[0] for s in sources), first.shape[1], room, first.shape[3]), first.dtype)
    row = 0
    for s in sources:
        out[row : row + s.shape[0], :, width - s.shape[2] : width] = s
        row += s.shape[0]
    return out


def roomy(t: Tensor, keys: int) -> bool:
    """Whether `t` is a sequence's own cache as a view of the first columns of a buffer (batch 1) with room for
    `keys` keys: an in-place prefill's (GraphBackend.prefill), whose buffer the batch can take as it is."""
    base = getattr(t, "base", None)
    return (
        isinstance(t, np.ndarray)
        and isinstance(base, np.ndarray)
        and base.ndim == 4
        and base.shape[0] == 1
        and base.shape[1::2] == t.shape[1::2]
        and base.shape[2] >= keys
        and t.ctypes.data == base.ctypes.data
    )


class BatchCache:
    """2 × layers tensors (slots, kv_heads, capacity, head_dim), each slot's owner and true length (0: free), and
    the sequences waiting in `settle` for a new slot. Keys occupy columns [0, width); capacity == width unless in
    place."""

    def __init__(self, in_place: bool = False, limit: int | None = None) -> None:
        self.in_place = in_place
        self.limit = limit  # in place: the most keys (all slots together) larger buffers may hold
        self._width = 0  # in place: the columns in use (the buffers hold `capacity`)
        self.tensors: list[Tensor] | None = None
        self.owners: list[Hashable | None] = []
        self.lengths: list[int] = []
        self._slot: dict[Hashable, int] = {}
        self._pending: dict[Hashable, tuple[list[Tensor], int]] = {}

    def __contains__(self, key: Hashable) -> bool:
        return key in self._slot or key in self._pending

    @property
    def width(self) -> int:
        if self.tensors is None:
            return 0
        return self._width if self.in_place else self.tensors[0].shape[2]

    @property
    def capacity(self) -> int:
        return self.tensors[0].shape[2] if self.tensors is not None else 0

    @property
    def live(self) -> int:
        return len(self._slot) + len(self._pending)

    @property
    def free(self) -> int:
        return len(self.owners) - len(self._slot)

    def slots(self) -> int:
        """Token slots held, padding and free slots included, pending sequences as they will be held (what the KV
        budget counts)."""
        width = max([self.capacity, *(n for _, n in self._pending.values())])
        return (len(self.owners) + len(self._pending)) * width

    def index(self, keys: list[Hashable]) -> list[int]:
        """The slots of `keys`, in their order (after `settle`)."""
        return [self._slot[k] for k in keys]

    def attention_mask(self) -> np.ndarray:
        """(slots, width + 1) int64 for one decode step: each slot's keys plus its new token are 1, padding 0."""
        lengths = np.asarray(self.lengths, dtype=np.int64)
        columns = np.arange(self.width + 1, dtype=np.int64)[None]
        return (columns >= (self.width - lengths)[:, None]).astype(np.int64)

    def positions(self) -> np.ndarray:
        """(slots, 1) int64: the position of each slot's next token."""
        return np.asarray(self.lengths, dtype=np.int64)[:, None]

    def join(self, key: Hashable, cache: list[Tensor], length: int) -> None:
        """Take one sequence's own cache (batch 1, `length` keys wide): into a free slot now if it is as wide as the
        batch, else into a new slot at the next `settle`."""
        if not self.free or length > self.width:
            self._pending[key] = (cache, length)
            return
        slot, width = self.owners.index(None), self.width
        for t, c in zip(self.tensors, cache, strict=True):  # columns past the width are nobody's (in place)
            t[slot, :, : width - length] = 0  # a left-behind key of a failed row must not reach a new one
            t[slot, :, width - length : width] = c[0]
        self.owners[slot], self.lengths[slot] = key, length
        self._slot[key] = slot

    def settle(self) -> None:
        """Before a decode step: give the pending sequences their slots in one copy of the batch (dropping the
        free slots in it), or drop the free slots once they outnumber the live ones."""
        if self._pending or self.free > self.live:
            self._rebuild()

    def compact(self) -> None:
        """Drop the free slots (one copy of the live ones)."""
        if self.free:
            self._rebuild()

    def _rebuild(self) -> None:
        """The live slots, then the pending sequences, in new tensors with no free slot (one copy)."""
        keep = [i for i, owner in enumerate(self.owners) if owner is not None]
        owners = [self.owners[i] for i in keep] + list(self._pending)
        lengths = [self.lengths[i] for i in keep] + [n for _, n in self._pending.values()]
        width = max(lengths)
        caches = [c for c, _ in self._pending.values()]
        if keep:
            caches.insert(0, [t if len(keep) == len(self.owners) else t[keep] for t in self.tensors])
        if keep and self.in_place:  # live keys end at the width (not the buffers' end), within its last `width`
            caches[0] = [t[:, :, max(0, self.width - width) : self.width] for t in caches[0]]
        if self.in_place and not keep and len(caches) == 1 and all(roomy(c, width + 1) for c in caches[0]):
            self.tensors = [c.base for c in caches[0]]  # one sequence prefilled in place: its buffers, no copy
            self._width = width
        elif self.in_place:
            room = width + max(MIN_ROOM, width // GROWTH)
            if self.limit:  # never past the KV budget for the room (one more column always)
                room = max(width + 1, min(room, self.limit // len(owners)))
            self.tensors = [_into(sources, width, room) for sources in zip(*caches, strict=True)]
            self._width = width
        elif len(caches) == 1 and caches[0][0].shape[2] == width:
            self.tensors = caches[0]  # nothing to add: no second copy
        else:
            self.tensors = [concat([_left_pad(c[k], width) for c in caches]) for k in range(len(caches[0]))]
        self.owners, self.lengths, self._pending = owners, lengths, {}
        self._slot = {owner: i for i, owner in enumerate(owners)}

    def row(self, key: Hashable) -> list[Tensor]:
        """The sequence's own cache (batch 1, exactly its length wide), to run it alone."""
        if key in self._pending:
            return self._pending[key][0]
        i, n, w = self._slot[key], self.lengths[self._slot[key]], self.width
        return [contiguous(t[i : i + 1, :, w - n : w]) for t in self.tensors]

    def reserve(self) -> None:
        """In place, before a decode step: room for one more column (a move into larger buffers when full)."""
        if self.in_place and self.tensors is not None and self.width == self.capacity:
            self._rebuild()

    def advance(self, presents: list[Tensor]) -> None:
        """After a decode step: every live slot grew by one, free ones stay empty. The step's presents (one more
        column) replace the cache, or, in place, are the cache's own buffers with column `width` written."""
        if self.in_place:
            if any(p is not t and p.shape != t.shape for p, t in zip(presents, self.tensors, strict=True)):
                raise RuntimeError("an in-place decode step returned presents that are not the cache's buffers")
            self._width += 1
        else:
            self.tensors = presents
        self.lengths = [n + 1 if owner is not None else 0 for owner, n in zip(self.owners, self.lengths, strict=True)]

    def leave(self, key: Hashable) -> None:
        """Free the sequence's slot; trim the left columns no live slot needs (a view, not a copy)."""
        if self._pending.pop(key, None) is not None:
            return
        slot = self._slot.pop(key, None)
        if slot is None:
            return
        self.owners[slot], self.lengths[slot] = None, 0
        if not self._slot:
            self.tensors, self.owners, self.lengths, self._width = None, [], [], 0
            return
        need = max(self.lengths)
        if need < self.width and not self.in_place:  # (in place a view would not be contiguous: kept until settle)
            self.tensors = [t[:, :, t.shape[2] - need :] for t in self.tensors]
