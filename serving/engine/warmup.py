"""Warm-up before a server reports SERVING: run the shapes serving will run, so that kernel compiles and tile tuning
(seconds to minutes cold on a GPU) happen before the first request instead of inside it.

Serving runs prompts in chunks of `prefill_chunk` tokens — full chunks, then one shorter remainder of any length —
and decode steps of one token per running sequence. The prefill tiles are tuned per power-of-two class of query
rows and of keys, and the JIT compiles a variant per specialisation (unit or multiple-of-16 sizes, entropy on or
off). So warm-up prefills, for each chunk class r (prefill_chunk, then halving down to 1), a sequence up to the
longest length that fits the context and the KV budget, with a chunk of r rows ending at every power-of-two key
count; decodes each alone, with and without entropy; and finally decodes two sequences as a batch. Every sequence
is released: the cache is empty afterwards.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np

from sharp.serving.backends.interface import Backend

log = logging.getLogger("sharp.serving")


class WarmUpError(RuntimeError):
    """The model failed on a warm-up shape: a server that cannot run it must not report SERVING."""


@dataclass(frozen=True)
class WarmUp:
    seconds: float
    prefill_chunks: int
    decode_steps: int
    longest: int  # tokens of the longest warm-up sequence (the context length, or what the KV budget holds)


def chunk_classes(prefill_chunk: int) -> list[int]:
    """prefill_chunk, then the powers of two below it down to 1: one query-row length per class a chunk can have."""
    top = (prefill_chunk - 1).bit_length()  # 2**top >= prefill_chunk > 2**(top - 1)
    return [prefill_chunk, *(1 << i for i in range(top - 1, -1, -1))]


def schedule(length: int, chunk: int, rows: int) -> list[int]:
    """Chunk sizes (each ≤ chunk) that prefill `length` tokens with a chunk of exactly `rows` ending at every power
    of two ≥ rows and at `length` (unless that chunk would overlap the one ending at the power of two below it)."""
    ends = sorted({1 << i for i in range(length.bit_length()) if rows <= 1 << i <= length} | {length})
    sizes, pos = [], 0
    for end in ends:
        if end - rows < pos:
            continue
        while pos < end - rows:
            sizes.append(min(chunk, end - rows - pos))
            pos += sizes[-1]
        sizes.append(rows)
        pos = end
    while pos < length:  # rows > length: plain chunks
        sizes.append(min(chunk, length - pos))
        pos += sizes[-1]
    return sizes


class _Runner:
    """Backend calls on warm-up sequences, counted; a failure names the shape."""

    def __init__(self, backend: Backend, vocab: int):
        self.backend, self.vocab = backend, vocab
        self.chunks = self.steps = 0

    def prefill(self, seq: Hashable, sizes: list[int], entropy: bool) -> int:
        pos = 0
        for n in sizes:
            ids = (np.arange(pos, pos + n, dtype=np.int64) % self.vocab)[None]
            try:
                self.backend.prefill(seq, ids, pos, entropy)
            except Exception as e:
                raise WarmUpError(f"prefill of {n} tokens after {pos} failed: {type(e).__name__}: {e}") from e
            pos += n
            self.chunks += 1
        self.backend.join(seq)
        return pos

    def decode(self, seqs: list[Hashable], entropy: bool) -> None:
        tokens = np.ones((len(seqs), 1), np.int64)
        out = self.backend.decode(seqs, tokens, entropy)
        if out.failed:
            raise WarmUpError(f"a decode step of {len(seqs)} sequences failed")
        self.steps += 1


def _longest(backend: Backend, context: int) -> int:
    """The longest warm-up sequence (two decode steps included) the context and the KV budget hold."""
    n = context
    while n > 2 and not backend.reserve(("warm-up", "probe"), n):
        n //= 2
    backend.release(("warm-up", "probe"))
    if n <= 2:
        raise WarmUpError("the KV budget does not hold a warm-up sequence of 3 tokens")
    return n - 2


def warm_up(backend: Backend, prefill_chunk: int) -> WarmUp:
    """Run every chunk class at every key class up to the longest sequence that fits, then batched decode."""
    start = time.perf_counter()
    run = _Runner(backend, backend.spec.vocab_size)
    longest = _longest(backend, backend.spec.context_length)
    try:
        for i, rows in enumerate(chunk_classes(prefill_chunk)):
            seq = ("warm-up", rows)
            backend.reserve(seq, longest + 2)
            run.prefill(seq, schedule(longest, prefill_chunk, rows), entropy=i % 2 == 0)
            run.decode([seq], entropy=True)
            run.decode([seq], entropy=False)
            backend.release(seq)
        pair = [("warm-up", "a"), ("warm-up", "b")]
        for seq, n in zip(pair, (min(33, longest), min(50, longest)), strict=True):
            backend.reserve(seq, n + 2)
            run.prefill(seq, [min(prefill_chunk, n - p) for p in range(0, n, prefill_chunk)], entropy=False)
        run.decode(pair, entropy=True)
        run.decode(pair, entropy=False)
    finally:
        backend.clear()  # nothing of the warm-up stays in the cache, whatever failed
    report = WarmUp(time.perf_counter() - start, run.chunks, run.steps, longest)
    log.info(
        "warm-up: %.1f s (%d prefill chunks, %d decode steps, sequences up to %d tokens)",
        report.seconds, report.prefill_chunks, report.decode_steps, report.longest,
    )  # fmt: skip
    return report
