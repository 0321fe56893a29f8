"""Next-token sampling shared by `SharpLM.generate` and the serving engine: greedy, temperature, top-k, top-p.

In NumPy on host logits (B, V) with NumPy generators: a step's logits are small, torch's dispatch cost more than the
work on them, and an ONNX server need not import torch at all (docs/serving.md, "A lean server")."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy; top_k 0 and top_p 1 disable those filters, top_p 0 keeps only the most likely
    token. These defaults are the defaults of every generation request (the server's and `SharpLM.generate`'s
    alike)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def check(self) -> None:
        """Raise ValueError saying what is wrong and what is allowed."""
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not math.isfinite(self.top_p) or not 0 <= self.top_p <= 1:
            raise ValueError(f"top_p must be in [0, 1], got {self.top_p}")


GREEDY = SamplingParams(temperature=0.0)
TEMPERATURE_FLOOR = 1e-4
"""Temperatures below this sample greedily: there a logit gap of 0.01 already has odds of e^100, and dividing by
a tinier temperature would overflow float32."""


def generator(seed: int | None) -> np.random.Generator:
    """A request's random stream: seeded (any integer ≥ 0, up to 2⁶⁴ − 1) or fresh from the OS."""
    return np.random.default_rng(seed)


def unusable_rows(logits: np.ndarray) -> np.ndarray:
    """(B,) bool: rows a distribution cannot come from (NaN, +inf, or every logit −inf): exactly the rows whose
    maximum is not finite (the maximum propagates NaN), in one reduction."""
    return ~np.isfinite(logits.max(-1))


def sample_rows(
    logits: np.ndarray, params: list[SamplingParams], generators: list[np.random.Generator | None]
) -> list[int | None]:
    """One token per row of logits (B, V), row i with params[i] and generators[i]; None for an unusable row.
    Exactly `sample` row by row, but the checks and every greedy row cost one batched operation each (a serving
    step's rows are mostly greedy)."""
    bad = unusable_rows(logits).tolist()
    greedy = [i for i, p in enumerate(params) if p.temperature < TEMPERATURE_FLOOR and not bad[i]]
    out: list[int | None] = [None] * len(params)
    if greedy:
        rows = logits if len(greedy) == len(params) else logits[greedy]
        for i, token in zip(greedy, rows.argmax(-1).tolist(), strict=True):
            out[i] = token
    for i, p in enumerate(params):
        if not bad[i] and p.temperature >= TEMPERATURE_FLOOR:
            out[i] = int(sample(logits[i : i + 1], p, generators[i])[0])
    return out


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator | None = None) -> np.ndarray:
    """logits (B, V) → token ids (B,). Raises ValueError for logits a distribution cannot come from (NaN, +inf,
    or every logit −inf), so the caller can end just that sequence."""
    logits = np.asarray(logits)
    if unusable_rows(logits).any():
        raise ValueError("the model produced non-finite logits")
    if params.temperature < TEMPERATURE_FLOOR:
        return logits.argmax(-1)
    scores = logits.astype(np.float64) / params.temperature
    if params.top_k:
        cut = scores.shape[-1] - min(params.top_k, scores.shape[-1])
        kth = np.partition(scores, cut, axis=-1)[..., cut : cut + 1]  # the k-th largest score of each row
        scores = np.where(scores < kth, -np.inf, scores)
    if params.top_p < 1:
        order = np.argsort(-scores, axis=-1, kind="stable")
        ranked = np.take_along_axis(scores, order, -1)
        probs = _softmax(ranked)
        # drop a token when the mass strictly before it already reaches top_p (the top token always stays)
        drop = (np.cumsum(probs, -1) - probs) >= params.top_p
        drop[..., 0] = False
        np.put_along_axis(scores, order, np.where(drop, -np.inf, ranked), -1)
    cdf = np.cumsum(_softmax(scores), -1)
    rng = rng if rng is not None else generator(None)
    u = rng.random(len(cdf))[:, None] * cdf[:, -1:]
    # the first token whose cumulative mass passes u: a token of weight 0 is never drawn
    return np.minimum((cdf <= u).sum(-1), cdf.shape[-1] - 1)


MAX_LOGPROBS = 20  # alternatives per token a request may ask for (OpenAI's bound)


@dataclass(frozen=True)
class Logprobs:
    """Rows of log-probabilities: each row's chosen token's (R,) and its `top` most likely tokens' ids and
    log-probabilities (R, top), most likely first."""

    chosen: np.ndarray
    top_ids: np.ndarray
    top: np.ndarray


def token_logprobs(logits: np.ndarray, chosen: np.ndarray, top: int) -> Logprobs:
    """The log-softmax of logits (R, V) at `chosen` (R,) ids, and each row's `top` largest, in one batched pass
    (no loop over rows): the model's own distribution, before temperature, top-k and top-p."""
    x = np.asarray(logits, np.float32)
    peak = x.max(-1, keepdims=True)
    lse = peak + np.log(np.exp(x - peak).sum(-1, keepdims=True, dtype=np.float64)).astype(np.float32)
    rows = np.arange(len(x))
    picked = x[rows, chosen] - lse[:, 0]
    top = min(top, x.shape[-1])
    if top == 0:
        return Logprobs(picked, np.empty((len(x), 0), np.int64), np.empty((len(x), 0), np.float32))
    ids = np.argpartition(-x, top - 1, axis=-1)[:, :top]
    vals = np.take_along_axis(x, ids, -1)
    order = np.argsort(-vals, axis=-1, kind="stable")
    ids = np.take_along_axis(ids, order, -1)
    return Logprobs(picked, ids, np.take_along_axis(vals, order, -1) - lse)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)
