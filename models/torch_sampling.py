"""`sampling.py`'s processors, sampler and log-probabilities on torch tensors, on the device the logits are on: the
torch backend samples where its model ran, and only token ids and the asked-for log-probabilities cross to the host
(a step's (rows × vocab) logits do not). Each function is its NumPy twin's algorithm, in the same precision and
order, and draws the same uniforms from the request's NumPy generator — so a seed gives the same tokens on every
backend. Kept apart from sampling.py so that the graph backends' server never imports torch."""

from __future__ import annotations

import numpy as np
import torch

from sharp.models.sampling import Logprobs, SamplingParams


def process(row: torch.Tensor, params: SamplingParams, prompt: np.ndarray, generated: np.ndarray) -> torch.Tensor:
    """`sampling.process` of one row (V,) on its device: bias, then the repetition penalty over prompt and
    generated tokens, then the frequency and presence penalties over the generated ones. Returns a new tensor."""
    out = row.to(torch.float32, copy=True)
    dev = out.device
    if params.logit_bias:
        ids, bias = zip(*params.logit_bias, strict=True)
        out.index_add_(0, torch.tensor(ids, device=dev), torch.tensor(bias, dtype=torch.float32, device=dev))
    if params.repetition_penalty != 1:
        seen = torch.from_numpy(np.unique(np.concatenate([prompt, generated]).astype(np.int64))).to(dev)
        vals = out[seen]
        out[seen] = torch.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
    if (params.presence_penalty or params.frequency_penalty) and len(generated):
        counts = torch.bincount(torch.from_numpy(np.asarray(generated, np.int64)).to(dev), minlength=len(out))
        counts = counts[: len(out)].to(torch.float32)
        out -= counts * np.float32(params.frequency_penalty) + (counts > 0) * np.float32(params.presence_penalty)
    return out


def sample_rows(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[np.random.Generator | None]
) -> list[int | None]:
    """`sampling.sample_rows` on the device: one token per row of logits (B, V), None for an unusable row; the
    greedy rows in one argmax, every token read back in one transfer."""
    bad = ~torch.isfinite(logits.max(-1).values)
    picks = logits.argmax(-1)
    for i, p in enumerate(params):
        if not p.greedy:
            picks[i] = _sample(logits[i], p, generators[i])
    return [None if t < 0 else t for t in torch.where(bad, -1, picks).tolist()]


def _sample(row: torch.Tensor, params: SamplingParams, rng: np.random.Generator | None) -> torch.Tensor:
    """One row's token as `sampling.sample` draws it: float64 scores, min-p, top-k, top-p, inverse CDF at the
    generator's next uniform. A 0-d tensor. (An unusable row draws one too, where NumPy's draws none: it ends
    there, so its stream is not read again.)"""
    scores = row.to(torch.float64) / params.temperature
    if params.min_p:
        probs = torch.softmax(scores, -1)
        scores = torch.where(probs < params.min_p * probs.max(), -torch.inf, scores)
    if params.top_k:
        kth = torch.topk(scores, min(params.top_k, scores.shape[-1])).values[-1]
        scores = torch.where(scores < kth, -torch.inf, scores)
    if params.top_p < 1:
        ranked, order = torch.sort(scores, descending=True, stable=True)
        probs = torch.softmax(ranked, -1)
        drop = (torch.cumsum(probs, -1) - probs) >= params.top_p
        drop[0] = False
        scores = scores.scatter(0, order, torch.where(drop, -torch.inf, ranked))
    cdf = torch.cumsum(torch.softmax(scores, -1), -1)
    u = (rng if rng is not None else np.random.default_rng()).random(1)[0]
    return torch.clamp((cdf <= u * cdf[-1]).sum(), max=cdf.shape[-1] - 1)


def token_logprobs(logits: torch.Tensor, chosen: list[int], top: int) -> Logprobs:
    """`sampling.token_logprobs` on the device: the log-softmax at the chosen ids and each row's `top` largest;
    only those cross to the host."""
    x = logits.to(torch.float32)
    peak = x.max(-1, keepdim=True).values
    lse = peak + torch.log(torch.exp(x - peak).sum(-1, keepdim=True, dtype=torch.float64)).to(torch.float32)
    rows = torch.arange(len(x), device=x.device)
    picked = (x[rows, torch.tensor(chosen, device=x.device)] - lse[:, 0]).cpu().numpy()
    top = min(top, x.shape[-1])
    if top == 0:
        return Logprobs(picked, np.empty((len(x), 0), np.int64), np.empty((len(x), 0), np.float32))
    vals, ids = torch.topk(x, top, -1)
    return Logprobs(picked, ids.cpu().numpy(), (vals - lse).cpu().numpy())


def unpack_allowed(bits: np.ndarray, vocab: int, device: torch.device) -> torch.Tensor:
    """(rows, V) bool from a grammar's bitmask (rows, ⌈V/32⌉) int32 — one bit per token, lowest first — unpacked on
    the device (only the bitmask, 1/32 of the logits' size, crosses)."""
    words = torch.from_numpy(bits).to(device)
    shifts = torch.arange(32, device=device, dtype=torch.int32)
    return ((words[..., None] >> shifts) & 1).reshape(len(bits), -1)[:, :vocab] != 0
