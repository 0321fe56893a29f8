"""Where a step's logits become tokens: the array operations the executor's sampling stage runs on them. NumPy's
(`Sampler`) for host logits — the graph backends', whose outputs are host arrays; the torch backend brings its own
(`TorchSampler`, backends/torch_backend.py) for logits left on its device. The stage itself — which rows need which
processor, the grammar, the log-probabilities — is the executor's, once for both."""

from __future__ import annotations

import sys

import numpy as np

from sharp.models.sampling import Logprobs, SamplingParams, process, sample_rows, token_logprobs


class Sampler:
    """NumPy on host logits (rows, V)."""

    def empty(self, vocab: int):
        return np.empty((0, vocab), np.float32)

    def concat(self, parts: list):
        return np.concatenate(parts)

    def copy(self, logits):
        return logits.copy()

    def rows(self, logits, rows: list[int]):
        """A copy of rows `rows`."""
        return logits[rows]

    def process(self, logits, i: int, params: SamplingParams, prompt: np.ndarray, generated: np.ndarray) -> None:
        """Row i after its request's bias and penalties (models/sampling.py `process`), in place."""
        logits[i] = process(logits[i], params, prompt, generated)

    def ban(self, logits, i: int, ids: list[int]) -> None:
        logits[i, ids] = -np.inf

    def mask(self, logits, rows: list[int], bits: np.ndarray) -> None:
        """Rows `rows` set to −inf, in place, at every token their grammar's bitmask (grammar.py `allowed_bits`:
        row i of bits is rows[i]'s) does not allow next — unpacked and applied at once."""
        banned = allowed(~bits, logits.shape[1])
        if rows == list(range(rows[0], rows[0] + len(rows))):  # as a view: no gather, no write back
            np.putmask(logits[rows[0] : rows[0] + len(rows)], banned, -np.inf)
            return
        block = logits[rows]
        np.putmask(block, banned, -np.inf)
        logits[rows] = block

    def sample_rows(self, logits, params: list[SamplingParams], generators: list) -> list[int | None]:
        return sample_rows(logits, params, generators)

    def token_logprobs(self, logits, rows: list[int], picked: list[int], top: int) -> Logprobs:
        return token_logprobs(logits[rows], np.array(picked), top)


def allowed(bits: np.ndarray, vocab: int) -> np.ndarray:
    """(rows, vocab) bool from bitmasks (rows, ⌈vocab/32⌉) int32 of one bit per token, lowest first."""
    words = bits if sys.byteorder == "little" else bits.byteswap()  # as little-endian bytes: token order
    return np.unpackbits(words.view(np.uint8), axis=-1, count=vocab, bitorder="little").view(bool)  # 0 or 1
