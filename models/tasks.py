"""Synthetic sequence tasks for length-generalisation (Vasylenko et al., Appendix G) and byte-level text.

Each batch is (input_ids, targets) for next-token training: targets[t] is the token expected after
input_ids[t], or IGNORE where nothing is graded. Tokens live in the byte vocabulary of SharpLM: content
symbols are 0…alphabet−1 and the task delimiters are distinct bytes above them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from sharp.models.corpus import VALIDATION

IGNORE = -100
BOS = 256
# delimiters (bytes outside any alphabet we use)
SEP, KV, QUERY, WRITE, READ, IGN = 200, 201, 202, 203, 204, 205
LM_TASKS = ("copy", "mqmtar", "flip-flop", "text")


@dataclass
class Batch:
    input_ids: Tensor  # (B, L)
    targets: Tensor  # (B, L), IGNORE where not graded

    def graded(self) -> Tensor:
        return self.targets != IGNORE


def _shift(seq: Tensor, graded: Tensor) -> Batch:
    """Turn full sequences and a mask of graded *positions* into (inputs, next-token targets)."""
    inputs, nxt = seq[:, :-1], seq[:, 1:]
    return Batch(inputs, torch.where(graded[:, 1:], nxt, IGNORE))


def copy_batch(batch: int, n: int, g: torch.Generator, alphabet: int = 16) -> Batch:
    """BOS x_1…x_n SEP x_1…x_n: reproduce the n symbols after the separator."""
    x = torch.randint(0, alphabet, (batch, n), generator=g)
    seq = torch.cat((torch.full((batch, 1), BOS), x, torch.full((batch, 1), SEP), x), dim=1)
    graded = torch.zeros_like(seq, dtype=torch.bool)
    graded[:, n + 2 :] = True
    return _shift(seq, graded)


def flip_flop_batch(batch: int, n: int, g: torch.Generator, p_read: float = 0.1, p_write: float = 0.1) -> Batch:
    """n instruction/bit pairs (write, read or ignore); the bit after a read must equal the last written bit
    (Liu et al.'s flip-flop language). The first instruction is a write."""
    u = torch.rand(batch, n, generator=g)
    instr = torch.where(u < p_write, WRITE, torch.where(u < p_write + p_read, READ, IGN))
    instr[:, 0] = WRITE
    bits = torch.randint(0, 2, (batch, n), generator=g)
    last = bits.clone()
    for t in range(1, n):  # carry the last written bit forward
        last[:, t] = torch.where(instr[:, t] == WRITE, bits[:, t], last[:, t - 1])
    bits = torch.where(instr == READ, last, bits)
    seq = torch.stack((instr, bits), dim=2).reshape(batch, 2 * n)
    seq = torch.cat((torch.full((batch, 1), BOS), seq), dim=1)
    graded = torch.zeros_like(seq, dtype=torch.bool)
    graded[:, 2::2] = instr == READ  # the bit position right after each read instruction
    return _shift(seq, graded)


def mqmtar_batch(batch: int, pairs: int, g: torch.Generator, queries: int = 4, alphabet: int = 64) -> Batch:
    """Multi-query multi-token associative recall: `k k KV v v` pairs (2-token keys and values, distinct keys),
    then `QUERY k k KV v v` for `queries` of them; the two value tokens of each query are graded."""
    rows, graded_rows = [], []
    for _ in range(batch):
        codes = torch.randperm(alphabet * alphabet, generator=g)[:pairs]
        keys = torch.stack((codes // alphabet, codes % alphabet), dim=1)
        vals = torch.randint(0, alphabet, (pairs, 2), generator=g)
        ctx = torch.cat((keys, torch.full((pairs, 1), KV), vals), dim=1).reshape(-1)
        pick = torch.randperm(pairs, generator=g)[:queries]
        qs = torch.cat((torch.full((queries, 1), QUERY), keys[pick], torch.full((queries, 1), KV), vals[pick]), 1)
        seq = torch.cat((torch.tensor([BOS]), ctx, qs.reshape(-1)))
        graded = torch.zeros_like(seq, dtype=torch.bool)
        start = 1 + ctx.numel()
        for j in range(queries):
            graded[start + 6 * j + 4 : start + 6 * j + 6] = True
        rows.append(seq)
        graded_rows.append(graded)
    return _shift(torch.stack(rows), torch.stack(graded_rows))


class TextData:
    """Random windows of a byte file (train on the first 90%, evaluate on the rest)."""

    def __init__(self, path: str | Path):
        data = Path(path).read_bytes()
        if len(data) < 1024:
            raise ValueError(f"{path}: {len(data)} bytes of text; need at least 1024")
        t = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)
        cut = int(len(t) * VALIDATION)
        self.train, self.val = t[:cut], t[cut:]

    def batch(self, batch: int, length: int, g: torch.Generator, split: str = "train") -> Batch:
        data = self.train if split == "train" else self.val
        length = min(length, len(data) - 2)
        starts = torch.randint(0, len(data) - length - 1, (batch,), generator=g)
        seq = torch.stack([data[s : s + length + 1] for s in starts.tolist()])
        return Batch(seq[:, :-1], seq[:, 1:])


def task_batch(task: str, batch: int, size: int, g: torch.Generator, text: TextData | None = None) -> Batch:
    """One batch of an LM task; `size` is the task's length knob (symbols, pairs or tokens)."""
    if task == "copy":
        return copy_batch(batch, size, g)
    if task == "flip-flop":
        return flip_flop_batch(batch, size, g)
    if task == "mqmtar":
        return mqmtar_batch(batch, size, g)
    if task == "text":
        if text is None:
            raise ValueError("task 'text' needs --data FILE")
        return text.batch(batch, size, g)
    raise ValueError(f"unknown task {task!r}; valid: {', '.join(LM_TASKS)}")
