"""Next-token sampling shared by `SharpLM.generate` and the serving engine: greedy, temperature, top-k, top-p,
min-p; and the logits processors of a request's history (`process`: logit bias, repetition, frequency and presence
penalties), which the engine applies to the rows that ask, before sampling.

In NumPy on host logits (B, V) with NumPy generators: a step's logits are small, torch's dispatch cost more than the
work on them, and an ONNX server need not import torch at all (docs/serving.md, "A lean server")."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


class SamplingError(ValueError):
    """A sampling setting out of its range; `field` names it (a refusal names the field the client sent)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy; top_k 0 and top_p 1 disable those filters, top_p 0 keeps only the most likely
    token. These defaults are the defaults of every generation request (the server's and `SharpLM.generate`'s
    alike)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0  # drop tokens less likely than min_p × the most likely one's probability (0: off)
    presence_penalty: float = 0.0  # OpenAI's: subtracted once from a token generated before
    frequency_penalty: float = 0.0  # OpenAI's: subtracted per time a token was generated before
    repetition_penalty: float = 1.0  # CTRL's (vLLM, transformers): a seen token's logit divided (> 0) or multiplied
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, added to its logit)

    def check(self) -> None:
        """Raise SamplingError (a ValueError naming its field) saying what is wrong and what is allowed (the token
        ids of logit_bias are the vocabulary's, checked by the caller that knows it)."""
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise SamplingError("temperature", f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise SamplingError("top_k", f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        for name in ("top_p", "min_p"):
            if not math.isfinite(getattr(self, name)) or not 0 <= getattr(self, name) <= 1:
                raise SamplingError(name, f"{name} must be in [0, 1], got {getattr(self, name)}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not math.isfinite(getattr(self, name)) or not -2 <= getattr(self, name) <= 2:
                raise SamplingError(name, f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not math.isfinite(self.repetition_penalty) or not 0 < self.repetition_penalty <= 2:
            raise SamplingError(
                "repetition_penalty",
                f"repetition_penalty must be in (0, 2] (1 disables it), got {self.repetition_penalty}",
            )
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise SamplingError(
                "logit_bias", f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS}"
            )
        for token, bias in self.logit_bias:
            if not math.isfinite(bias) or not -100 <= bias <= 100:
                raise SamplingError("logit_bias", f"logit_bias of token {token} must be in [-100, 100], got {bias}")

    @property
    def greedy(self) -> bool:
        return self.temperature < TEMPERATURE_FLOOR

    @property
    def truncates(self) -> bool:
        """Whether a sampled (not greedy) row drops tokens by their rank or probability — top-k, top-p, min-p —
        so that which survive depends on the tokens masked before: such a row cannot sample first and check."""
        return not self.greedy and bool(self.top_k or self.top_p < 1 or self.min_p)

    @property
    def processes(self) -> bool:
        """Whether `process` changes anything for these parameters (the rows that need nothing cost nothing)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
                    or self.logit_bias)  # fmt: skip


MAX_LOGIT_BIAS = 300  # entries, as OpenAI allows


def process(logits: np.ndarray, params: SamplingParams, prompt: np.ndarray, generated: np.ndarray) -> np.ndarray:
    """One row of logits (V,) after the processors of its history, in vLLM's order: the bias added; then the
    repetition penalty on every token of the prompt and of the generated text (a positive logit divided by it, a
    negative one multiplied); then, over the generated tokens only, the frequency penalty times each token's count
    and the presence penalty once per token present. Returns a new array."""
    out = np.array(logits, np.float32)
    if params.logit_bias:
        ids, bias = zip(*params.logit_bias, strict=True)
        np.add.at(out, np.asarray(ids), np.asarray(bias, np.float32))
    if params.repetition_penalty != 1:
        seen = np.unique(np.concatenate([prompt, generated]).astype(np.int64))
        vals = out[seen]
        out[seen] = np.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
    if (params.presence_penalty or params.frequency_penalty) and len(generated):
        counts = np.bincount(generated, minlength=len(out))[: len(out)]
        out -= counts * np.float32(params.frequency_penalty) + (counts > 0) * np.float32(params.presence_penalty)
    return out


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
    greedy = [i for i, p in enumerate(params) if p.greedy and not bad[i]]
    out: list[int | None] = [None] * len(params)
    if greedy:
        rows = logits if len(greedy) == len(params) else logits[greedy]
        for i, token in zip(greedy, rows.argmax(-1).tolist(), strict=True):
            out[i] = token
    for i, p in enumerate(params):
        if not bad[i] and not p.greedy:
            out[i] = int(sample(logits[i : i + 1], p, generators[i])[0])
    return out


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator | None = None) -> np.ndarray:
    """logits (B, V) → token ids (B,). Raises ValueError for logits a distribution cannot come from (NaN, +inf,
    or every logit −inf), so the caller can end just that sequence."""
    logits = np.asarray(logits)
    if unusable_rows(logits).any():
        raise ValueError("the model produced non-finite logits")
    if params.greedy:
        return logits.argmax(-1)
    scores = logits.astype(np.float64) / params.temperature
    if params.min_p:
        probs = _softmax(scores)
        scores = np.where(probs < params.min_p * probs.max(-1, keepdims=True), -np.inf, scores)
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
