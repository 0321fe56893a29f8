"""SharpLM: a small pre-norm decoder-only LM (nanoGPT-sized) whose attention normalizer is chosen per model
or per layer, with a built-in byte-level tokenizer so nothing is ever downloaded."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from sharp.models.config import ModelConfig
from sharp.models.kvcache import PagedLayer, PagedStep
from sharp.models.layers import MLP, KVCache, SharpAttention, make_layer_norm
from sharp.models.sampling import SamplingParams, generator, process, sample
from sharp.models.tokenizer import BYTES


@dataclass
class LMOutput:
    logits: Tensor  # (B, L, V)
    cache: list[KVCache] | list[PagedLayer]
    entropy: Tensor | None  # (B, layers, heads, L) nats, when asked


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, norm: str, layer: int = 0):
        super().__init__()
        self.ln1, self.ln2 = make_layer_norm(cfg), make_layer_norm(cfg)
        self.attn = SharpAttention(cfg, norm, layer=layer)
        self.mlp = MLP(cfg)

    def forward(self, x, positions, cache, key_mask, impl, entropy=True):
        a, new_cache, ent = self.attn(self.ln1(x), positions, cache, key_mask, impl, entropy)
        x = x + a
        return x + self.mlp(self.ln2(x)), new_cache, ent


class SharpLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg, n, i) for i, n in enumerate(cfg.layer_norms()))
        self.ln_f = make_layer_norm(cfg)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, input_ids: Tensor) -> Tensor:
        """input_ids (B, L) → logits (B, L, V)."""
        return self.step(input_ids).logits

    def step(
        self,
        input_ids: Tensor,
        cache: list[KVCache] | PagedStep | None = None,
        positions: Tensor | None = None,
        key_mask: Tensor | None = None,
        return_entropy: bool = False,
        impl: str = "reference",
        last_logits: bool = False,
    ) -> LMOutput:
        """One forward over new tokens after an optional cache (prefill when cache is None, else decode).

        positions (B, L) default to past_length + arange(L); key_mask (B, past + L) marks real keys. With a
        `PagedStep` (a paged KV cache; positions required) each layer writes its new keys into the sequences' pages;
        the caller commits the step once it succeeded. `last_logits`: the logits of the last token only (B, 1, V) —
        a long prompt's head over every position is a fifth of its matmuls and L·V numbers nobody reads.
        """
        b, length = input_ids.shape
        paged = isinstance(cache, PagedStep)
        if positions is None:
            if paged:
                raise ValueError("a paged step needs the tokens' positions")
            past = cache[0][0].shape[2] if cache else 0
            positions = (torch.arange(length, device=input_ids.device) + past).expand(b, length)
        x = self.embed(input_ids)
        new_cache, entropies = [], []
        for i, block in enumerate(self.blocks):
            layer_cache = cache.layer(i) if paged else cache[i] if cache else None
            x, c, ent = block(x, positions, layer_cache, key_mask, impl, return_entropy)
            new_cache.append(c)
            entropies.append(ent)
        logits = self.head(self.ln_f(x[:, -1:] if last_logits else x))
        return LMOutput(logits, new_cache, torch.stack(entropies, dim=1) if return_entropy else None)

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        params: SamplingParams | None = None,
        seed: int | None = None,
        eos: int | None = BYTES.eos,
    ) -> list[int]:
        """Sample up to max_new_tokens after the prompt with the KV cache; stops at `eos`."""
        params = params or SamplingParams()
        params.check()
        if not prompt_ids:
            raise ValueError("generate needs at least one prompt token")
        if len(prompt_ids) + max_new_tokens > self.cfg.context_length:
            raise ValueError(
                f"prompt ({len(prompt_ids)}) + max_new_tokens ({max_new_tokens}) exceeds the context limit "
                f"{self.cfg.context_length}"
            )
        device = self.embed.weight.device
        rng = generator(seed)
        out = self.step(torch.tensor([prompt_ids], device=device))
        tokens: list[int] = []
        prompt = np.asarray(prompt_ids, np.int64)
        for _ in range(max_new_tokens):
            logits = out.logits[:, -1].float().cpu().numpy()
            if params.processes:  # the serving engine's processors, on the same history
                logits = process(logits[0], params, prompt, np.asarray(tokens, np.int64))[None]
            nxt = int(sample(logits, params, rng)[0])
            tokens.append(nxt)
            if eos is not None and nxt == eos:
                break
            out = self.step(torch.tensor([[nxt]], device=device), cache=out.cache)
        return tokens

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
