"""Which heads of a model retrieve: the attention each head puts on a passkey while the model writes it.

A model retrieves a fact through a few heads; at lengths past those it was trained on comfortably, exactly those heads
disperse (docs/quality.md). Length-scaling only them (`--scaled-heads`, models/positional.head_length_scale) sharpens
the retrieval and leaves the rest of the model as trained. This finds them on the model itself: for passkey prompts
(sharp-bench quality's), the key is teacher-forced after the prompt, and each head's weight on the key's tokens inside
the prompt is read from the model's own attention — its normalizer, whatever it is — by attending a second time with
the values replaced by an indicator of those tokens (the output is then the weight they get, exactly).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

Prompt = tuple[list[int], str]  # the prompt's token ids, the key


def occurrences(seq: list[int], sub: list[int]) -> list[int]:
    """Where `sub` starts inside `seq`."""
    n = len(sub)
    return [i for i in range(len(seq) - n + 1) if seq[i : i + n] == sub]


@torch.inference_mode()
def key_attention(model, prompts: list[Prompt], key_ids: Callable[[str], list[int]]) -> Tensor:
    """The mean weight (layers, heads) each head puts on the key's tokens in the prompt, over the queries that write
    the key (teacher-forced) and over the prompts whose key the tokenizer writes the same inside the prompt."""
    blocks = model.blocks
    mass = torch.zeros(len(blocks), model.cfg.heads)
    used = 0
    for ids, key in prompts:
        answer = key_ids(key)
        starts = occurrences(ids, answer)
        if not starts:  # the prompt tokenized the key otherwise: its positions are unknown
            continue
        where = torch.zeros(len(ids) + len(answer) - 1)
        for s in starts:
            where[s : s + len(answer)] = 1.0
        rows = slice(len(ids) - 1, len(ids) + len(answer) - 1)  # the queries whose next token is the key's
        originals = [b.attn.attention for b in blocks]
        for i, block in enumerate(blocks):
            block.attn.attention = _probe(originals[i], where, rows, mass[i])
        try:
            model.step(torch.tensor([ids + answer[:-1]], device=model.embed.weight.device), impl="reference")
        finally:
            for block, original in zip(blocks, originals, strict=True):
                block.attn.attention = original
        used += 1
    if not used:
        raise ValueError("no prompt holds its key as the answer tokenizes it; the heads cannot be found")
    return mass / used


def _probe(attention, where: Tensor, rows: slice, into: Tensor):
    """`attention` that also adds, for each head, the mean weight the `rows` queries put on the keys `where` marks."""

    def attend(q, k, v, **kw):
        out = attention(q, k, v, **kw)
        indicator = where[: k.shape[2]].to(v.device, v.dtype).view(1, 1, -1, 1).expand(k.shape[0], k.shape[1], -1, 1)
        weight, _ = attention(q, k, indicator.contiguous(), **{**kw, "entropy": False})
        into.add_(weight[0, :, rows, 0].float().mean(-1).cpu())
        return out

    return attend


def top_heads(mass: Tensor, count: int) -> list[tuple[int, int, float]]:
    """The `count` heads with the most weight on the key: (layer, head, weight), most first."""
    flat = mass.flatten()
    order = torch.argsort(flat, descending=True, stable=True)[:count]
    heads = mass.shape[1]
    return [(int(i) // heads, int(i) % heads, float(flat[i])) for i in order]
