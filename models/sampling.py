"""Next-token sampling shared by `SharpLM.generate` and the serving engine: greedy, temperature, top-k, top-p."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy; top_k 0 and top_p 1 disable those filters. These defaults are the defaults of
    every generation request (the server's and `SharpLM.generate`'s alike)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def check(self) -> None:
        """Raise ValueError saying what is wrong and what is allowed."""
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not math.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


GREEDY = SamplingParams(temperature=0.0)
TEMPERATURE_FLOOR = 1e-4
"""Temperatures below this sample greedily: there a logit gap of 0.01 already has odds of e^100, and dividing by
a tinier temperature would overflow float32."""


def unusable_rows(logits: Tensor) -> Tensor:
    """(B,) bool: rows a distribution cannot come from (NaN, +inf, or every logit −inf): exactly the rows whose
    maximum is not finite (max propagates NaN), in one reduction."""
    return ~torch.isfinite(logits.amax(-1))


def sample_rows(
    logits: Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> list[int | None]:
    """One token per row of logits (B, V), row i with params[i] and generators[i]; None for an unusable row.
    Exactly `sample` row by row, but the checks and every greedy row cost one batched operation each (a serving
    step's rows are mostly greedy). On CPU those run in NumPy: on a step's (B, V) logits, fresh from the model,
    torch's dispatch cost several times the work (~100 µs against ~30 µs per step, measured in the engine)."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64):
        x = logits.detach().numpy()
        bad = (~np.isfinite(x.max(-1))).tolist()  # the maximum propagates NaN, as torch's amax does
        argmax = lambda rows: x[rows].argmax(-1).tolist()
    else:
        bad = unusable_rows(logits).tolist()
        argmax = lambda rows: logits[rows].argmax(-1).tolist()
    greedy = [i for i, p in enumerate(params) if p.temperature < TEMPERATURE_FLOOR and not bad[i]]
    out: list[int | None] = [None] * len(params)
    if greedy:
        for i, token in zip(greedy, argmax(greedy if len(greedy) < len(params) else slice(None)), strict=True):
            out[i] = token
    for i, p in enumerate(params):
        if not bad[i] and p.temperature >= TEMPERATURE_FLOOR:
            out[i] = int(sample(logits[i : i + 1], p, generators[i]))
    return out


def sample(logits: Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> Tensor:
    """logits (B, V) → token ids (B,). Raises ValueError for logits a distribution cannot come from (NaN, +inf,
    or every logit −inf), so the caller can end just that sequence."""
    if bool(unusable_rows(logits).any()):
        raise ValueError("the model produced non-finite logits")
    if params.temperature < TEMPERATURE_FLOOR:
        return logits.argmax(-1)
    scores = logits.float() / params.temperature
    if params.top_k:
        kth = torch.topk(scores, min(params.top_k, scores.shape[-1]), dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1:
        sorted_scores, order = torch.sort(scores, descending=True, dim=-1)
        probs = torch.softmax(sorted_scores, dim=-1)
        # drop a token when the mass strictly before it already reaches top_p (the top token always stays)
        drop = (probs.cumsum(-1) - probs) >= params.top_p
        sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
        scores = torch.full_like(scores, float("-inf")).scatter(-1, order, sorted_scores)
    probs = torch.softmax(scores, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
