"""The executor: a step's model calls on the backend — one batched prefill of the plan's chunks, one batched decode
step of the running sequences — timed into the step's statistics. The backend owns the KV cache and the batching
of what it is given (serving/backends.py)."""

from __future__ import annotations

import time

import numpy as np

from sharp.serving.backends import Backend, Chunk, StepResult
from sharp.serving.scheduler import Sequence
from sharp.serving.stats import StepStats


class Executor:
    def __init__(self, backend: Backend):
        self.backend = backend

    def prefill(self, chunks: list[Chunk], entropy: bool, stats: StepStats) -> list[StepResult | None]:
        """One result per chunk; None where the model failed on that prompt (it ends alone)."""
        began = time.perf_counter()
        results = self.backend.prefill_many(chunks, entropy)
        stats.forward_seconds += time.perf_counter() - began
        return results

    def decode(self, seqs: list[Sequence], entropy: bool, stats: StepStats) -> StepResult:
        """One token for each of `seqs`, fed its newest token."""
        tokens = np.array([[s.generated[-1]] for s in seqs], np.int64)
        began = time.perf_counter()
        out = self.backend.decode(seqs, tokens, entropy)
        stats.forward_seconds += time.perf_counter() - began
        stats.decode_batch = len(seqs)
        return out
