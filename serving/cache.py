"""The running batch's KV cache: one left-padded tensor per layer and kind, rows right-aligned.

Sequences of different lengths decode in one forward: row r holds its `length` keys at the right end of the
(B, kv_heads, T, head_dim) tensors and the attention mask hides the padding on the left. Joining pads the
narrower side; leaving drops rows and trims the columns no remaining row needs.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor


def _left_pad(t: Tensor, width: int) -> Tensor:
    """(B, H, T, D) → (B, H, width, D) with zero keys on the left."""
    return F.pad(t, (0, 0, width - t.shape[2], 0))


class BatchCache:
    """2 × layers tensors (B, kv_heads, T, head_dim) and each row's true length."""

    def __init__(self) -> None:
        self.tensors: list[Tensor] | None = None
        self.lengths: list[int] = []

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def width(self) -> int:
        return self.tensors[0].shape[2] if self.tensors is not None else 0

    def slots(self) -> int:
        """Token slots held, padding included (what the KV budget counts)."""
        return self.rows * self.width

    def attention_mask(self) -> Tensor:
        """(B, width + 1) int64 for one decode step: each row's keys plus its new token are 1, padding 0 (built in
        NumPy: a step's few small tensor ops cost more in torch's dispatch than the work)."""
        lengths = np.asarray(self.lengths, dtype=np.int64)
        columns = np.arange(self.width + 1, dtype=np.int64)[None]
        return torch.from_numpy((columns >= (self.width - lengths)[:, None]).astype(np.int64))

    def join(self, cache: list[Tensor], length: int) -> None:
        """Append one sequence's own cache (batch 1) as the last row."""
        if self.tensors is None:
            self.tensors, self.lengths = cache, [length]
            return
        width = max(self.width, cache[0].shape[2])
        self.tensors = [
            torch.cat((_left_pad(b, width), _left_pad(c, width)), dim=0)
            for b, c in zip(self.tensors, cache, strict=True)
        ]
        self.lengths.append(length)

    def row(self, i: int) -> list[Tensor]:
        """Row i's own cache (batch 1, exactly its length wide), to run it alone."""
        n = self.lengths[i]
        return [t[i : i + 1, :, t.shape[2] - n :] for t in self.tensors]

    def advance(self, presents: list[Tensor]) -> None:
        """After a decode step: the step's presents (one more column) replace the cache; every row grew by one."""
        self.tensors = presents
        self.lengths = [n + 1 for n in self.lengths]

    def leave(self, rows: list[int]) -> None:
        """Drop `rows`; trim the left columns no remaining row needs."""
        if not rows:
            return
        gone = set(rows)
        keep = [i for i in range(self.rows) if i not in gone]
        self.lengths = [self.lengths[i] for i in keep]
        if not keep:
            self.tensors = None
            return
        width = max(self.lengths)
        index = torch.tensor(keep, device=self.tensors[0].device)
        self.tensors = [t.index_select(0, index)[:, :, t.shape[2] - width :] for t in self.tensors]
