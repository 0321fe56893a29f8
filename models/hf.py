"""Hugging Face transformers models with sharp's attention: `attn_implementation="sharp"`.

Importing this module registers an attention function and a mask function under the name "sharp" with
transformers' `AttentionInterface` / `AttentionMaskInterface`. The mask function hands the attention the 2-D
key mask (batch, keys) instead of a 4-D additive mask — sharp's op takes a key mask and places the queries at
the last positions — and the attention function calls `torch.ops.sharp.attention`, so the same model runs in
PyTorch and exports to one `sharp::SharpAttention` node per layer.

Which normalizer runs is part of the model's config (`config.sharp_attention`, written to config.json): a
pretrained softmax model may only take the inference-time changes the registry allows (adaptive, ssmax). The
per-token entropy of every head comes back as the attention "weights": `output_attentions=True` returns it,
(batch, heads, queries) per layer.

What the model's own modules do before attention — RoPE and its scaling, Llama-4-style query temperature
(Ministral 3's `llama_4_scaling_beta`), q/k norms — runs unchanged as transformers implements it. What sharp
cannot reproduce exactly (sliding or chunked windows, logit soft-capping, run-time-dependent RoPE, remote-code
scaling fields) is refused by `check_config` with the reason, never silently dropped.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM, PretrainedConfig
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function

from sharp.models import normalizers as nz
from sharp.models import registry
from sharp.models.config import ModelShape, scaled_heads_problem
from sharp.models.op import attend_op
from sharp.models.positional import head_length_scale

IMPLEMENTATION = "sharp"
CONFIG_KEY = "sharp_attention"  # {"norm": ..., "poly": [...], <per-head parameter>: value, "scaled_heads": ...}
SCALED_KEYS = ("scaled_heads", "scaled_from")  # length-scaled heads: [[layer, head], ...] and the keys it starts at
# How a transformers model learns a norm's parameters: sharp-train trains SharpLM checkpoints only.
FINE_TUNE = (
    'fine-tune the model in transformers with attn_implementation="sharp" and config.sharp_attention = {{"norm":'
    ' "{norm}"}} (docs/hf.md), then export the saved directory'
)

# Decoder families whose attention modules were checked against transformers' eager attention (tests/test_hf.py).
SUPPORTED = ("llama", "mistral", "ministral", "ministral3", "qwen2", "qwen3", "gpt2")
# Families refused with the reason (anything else is refused as untested).
REFUSED = {
    "gemma2": "Gemma 2 soft-caps attention logits and alternates sliding-window layers; sharp's op has neither",
    "gemma3_text": "Gemma 3 interleaves sliding-window layers; sharp's op has no window",
    "gemma3": "Gemma 3 interleaves sliding-window layers; sharp's op has no window",
    "llama4": "Llama 4 uses chunked local attention on its RoPE layers; sharp's op has no chunk mask",
    "qwen": "Qwen-1 (remote code) applies logn attention scaling in code transformers does not ship; it is not loaded",
}
# RoPE variants computed once from the config. "dynamic" and "longrope" change the frequencies with the run-time
# sequence length in Python: an exported graph would freeze them at the traced length.
STATIC_ROPE = ("default", "linear", "llama3", "yarn")
ROPE_KEYS = frozenset(
    {
        "rope_type",
        "type",
        "rope_theta",
        "factor",
        "low_freq_factor",
        "high_freq_factor",
        "original_max_position_embeddings",
        "beta_fast",
        "beta_slow",
        "attention_factor",
        "mscale",
        "mscale_all_dim",
        "truncate",
        "partial_rotary_factor",
        "llama_4_scaling_beta",  # Ministral 3: queries × 1 + β·log(1 + floor(pos / original_max_position_embeddings))
    }
)
# The families whose transformers modules apply `llama_4_scaling_beta` to the queries.
LLAMA4_SCALED = ("ministral3",)
# Length-dependent attention fields of other implementations: refused when set, never silently dropped.
FOREIGN_SCALING = ("use_logn_attn", "use_dynamic_ntk", "logn_attn", "attn_temperature_tuning", "attn_logit_softcapping")


class UnsupportedModel(ValueError):
    """The model cannot run with sharp's attention exactly; the message says why."""


def _count(x: object) -> bool:
    """An integer, as JSON gives one (a bool is not)."""
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class AttentionSettings:
    """The normalizer a transformers model runs, as stored in `config.sharp_attention`."""

    norm: str = "softmax"
    poly: tuple[float, ...] = nz.PAPER_POLY
    params: tuple[tuple[str, float], ...] = ()  # per-head parameters given as one value for all heads
    # the (layer, head) pairs whose queries × max(1, log n / log scaled_from) (ModelConfig.scaled_heads)
    scaled_heads: tuple[tuple[int, int], ...] = ()
    scaled_from: int = 512

    def __post_init__(self) -> None:
        if not all(
            isinstance(pair, tuple) and len(pair) == 2 and all(_count(x) and x >= 0 for x in pair)
            for pair in self.scaled_heads
        ):
            raise ValueError("scaled_heads must be [layer, head] pairs of integers >= 0")
        if len(set(self.scaled_heads)) != len(self.scaled_heads):
            raise ValueError("scaled_heads names a head twice")
        if not (_count(self.scaled_from) and self.scaled_from >= 2):
            raise ValueError(f"scaled_from must be an integer >= 2 keys, got {self.scaled_from!r:.40}")
        entry = registry.get(self.norm)
        for name, value in self.params:
            if name not in entry.param_names:
                raise ValueError(f"{name} is not a parameter of {self.norm} (its parameters: {entry.param_names})")
            if (why := registry.head_param(name).problem(value)) is not None:
                raise ValueError(why)
        # a pretrained (softmax) model's change of norm: the registry's one rule
        if registry.can_export_as("softmax", self.norm) and (
            why := registry.norm_change_problem("softmax", self.norm, dict(self.params), train=FINE_TUNE)
        ):
            raise ValueError(why)
        if not all(math.isfinite(c) for c in self.poly):
            raise ValueError(f"poly must be finite numbers, got {list(self.poly)}")

    @classmethod
    def of(cls, config: PretrainedConfig) -> AttentionSettings:
        d = getattr(config, CONFIG_KEY, None) or {}
        if not isinstance(d, dict):
            raise ValueError(f"config.{CONFIG_KEY} must be an object, got {d!r:.60}")
        norm = d.get("norm", "softmax")
        params = tuple((k, float(v)) for k, v in d.items() if k not in ("norm", "poly", *SCALED_KEYS))
        heads = d.get("scaled_heads", [])
        if not isinstance(heads, list | tuple) or not all(isinstance(p, list | tuple) for p in heads):
            raise ValueError(f"scaled_heads must be a list of [layer, head] pairs, got {heads!r:.60}")
        poly = tuple(float(c) for c in d.get("poly", nz.PAPER_POLY))
        return cls(norm, poly, params, tuple(tuple(p) for p in heads), d.get("scaled_from", 512))

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"norm": self.norm, **dict(self.params)}
        if registry.get(self.norm).uses_poly:
            d["poly"] = list(self.poly)
        if self.scaled_heads:
            d["scaled_heads"], d["scaled_from"] = [list(p) for p in self.scaled_heads], self.scaled_from
        return d

    def layer_scaled(self, layer: int, heads: int) -> Tensor | None:
        """The (heads,) mask of layer `layer`'s length-scaled heads (None: the layer has none)."""
        chosen = [h for lay, h in self.scaled_heads if lay == layer]
        if not chosen:
            return None
        mask = torch.zeros(heads, dtype=torch.bool)
        mask[chosen] = True
        return mask

    def head_values(self, heads: int) -> dict[str, list[float]]:
        """Per-head parameter values, as the file's metadata records them."""
        return {name: [value] * heads for name, value in self.params}


def sharpen(
    config: PretrainedConfig,
    norm: str,
    poly: tuple[float, ...] | None = None,
    scaled: tuple[tuple[tuple[int, int], ...], int] | None = None,
    **values: float,
) -> None:
    """Set the normalizer of the model to `norm`: the one its config already names (kept with its stored values when
    nothing new is given), or an inference-time change the registry allows from what the weights were trained
    with — softmax, unless the config names a learned norm (entmax, SSA, …), which admits only itself. `scaled`
    (heads, from) sets the length-scaled heads (any norm takes them); None keeps the config's."""
    current = AttentionSettings.of(config)
    given = [name for name, value in values.items() if value is not None]
    heads, start = scaled if scaled is not None else (current.scaled_heads, current.scaled_from)
    if norm == current.norm and not given and poly is None:
        if scaled is None:
            return
        settings = dataclasses.replace(current, scaled_heads=tuple(heads), scaled_from=start)
    else:
        trained = "softmax" if registry.can_export_as("softmax", current.norm) else current.norm
        if (why := registry.norm_change_problem(trained, norm, given, train=FINE_TUNE)) is not None:
            raise UnsupportedModel(why)
        params = tuple((k, float(v)) for k, v in values.items() if v is not None)
        settings = AttentionSettings(norm, tuple(poly) if poly else nz.PAPER_POLY, params, tuple(heads), start)
    setattr(config, CONFIG_KEY, settings.to_dict())
    check_config(config)  # the heads within the model's layers and heads


def shape_of(config: PretrainedConfig) -> ModelShape:
    """The sizes serving and export need, from a transformers config."""
    heads = config.num_attention_heads
    return ModelShape(
        layers=config.num_hidden_layers,
        heads=heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        vocab_size=config.vocab_size,
        context_length=config.max_position_embeddings,
    )


def check_config(config: PretrainedConfig) -> None:
    """Raise UnsupportedModel unless sharp's attention reproduces this model's attention exactly."""
    kind = getattr(config, "model_type", "?")
    if kind in REFUSED:
        raise UnsupportedModel(f"{kind}: {REFUSED[kind]}")
    if kind not in SUPPORTED:
        raise UnsupportedModel(f"model_type {kind!r} is not supported (supported: {', '.join(SUPPORTED)})")
    for name in FOREIGN_SCALING:
        if getattr(config, name, None):
            raise UnsupportedModel(f"{kind}: config field {name} is set; sharp does not implement it for {kind}")
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", True) is False:
        window = None
    if layer_types != {"full_attention"} or (window is not None and window < config.max_position_embeddings):
        raise UnsupportedModel(
            f"{kind}: sliding-window attention (window {window}, layer types {sorted(layer_types)}); "
            "sharp's op attends to every key"
        )
    rope = getattr(config, "rope_parameters", None) or {}
    if isinstance(rope, dict) and rope:
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in STATIC_ROPE:
            raise UnsupportedModel(
                f"{kind}: RoPE type {rope_type!r} recomputes its frequencies from the run-time length, which an "
                f"exported graph would freeze (supported: {', '.join(STATIC_ROPE)})"
            )
        unknown = sorted(set(rope) - ROPE_KEYS)
        if unknown:
            raise UnsupportedModel(f"{kind}: unknown RoPE/scaling fields {unknown}; refusing rather than dropping them")
        if rope.get("llama_4_scaling_beta") and kind not in LLAMA4_SCALED:
            raise UnsupportedModel(
                f"{kind}: llama_4_scaling_beta is set, but transformers' {kind} ignores it (only"
                f" {', '.join(LLAMA4_SCALED)} apply it); refusing rather than exporting a model that differs"
            )
    settings = AttentionSettings.of(config)  # a malformed sharp_attention entry is refused here too
    shape = shape_of(config)
    if (why := scaled_heads_problem(settings.scaled_heads, shape.layers, shape.heads)) is not None:
        raise UnsupportedModel(why)


def load_config(path: str | Path) -> PretrainedConfig:
    """The checked config of a transformers model directory."""
    config = AutoConfig.from_pretrained(str(path))
    check_config(config)
    return config


def load_model(path: str | Path, config: PretrainedConfig | None = None) -> torch.nn.Module:
    """A causal LM from a transformers directory, in fp32 with sharp's attention."""
    config = config or load_config(path)
    model = AutoModelForCausalLM.from_pretrained(str(path), config=config, attn_implementation=IMPLEMENTATION)
    return model.float().eval()


def key_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=causal_mask_function,
    attention_mask: Tensor | None = None,
    device: torch.device | str = "cpu",
    **_: Any,
) -> Tensor:
    """transformers' mask hook for "sharp": the (batch, keys) padding mask; causality is the op's own."""
    if mask_function is not causal_mask_function:
        raise UnsupportedModel(f"mask {getattr(mask_function, '__name__', mask_function)}: sharp's op is causal only")
    if attention_mask is None:
        return torch.ones(batch_size, kv_length, dtype=torch.bool, device=device)
    return attention_mask[:, kv_offset : kv_offset + kv_length].to(device=device, dtype=torch.bool)


def sharp_attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, Tensor]:
    """transformers' attention hook for "sharp": (B, Hq, Lq, D) queries against (B, Hkv, Lk, D) keys/values;
    returns the output as (B, Lq, Hq, D) and each query's attention entropy (B, Hq, Lq) as the "weights"."""
    for name in ("softcap", "sliding_window", "s_aux", "sinks"):
        if kwargs.get(name) is not None:
            raise UnsupportedModel(f"{type(module).__name__} passes {name}; sharp's op does not implement it")
    if dropout:
        raise UnsupportedModel("attention dropout > 0: sharp's attention has none (call model.eval())")
    batch, _, _, _ = query.shape
    if attention_mask is None:
        attention_mask = torch.ones(batch, key.shape[2], dtype=torch.bool, device=query.device)
    if attention_mask.dim() != 2:
        raise UnsupportedModel(f"a {attention_mask.dim()}-D attention mask; sharp takes the 2-D key mask")
    settings = AttentionSettings.of(module.config)
    heads = query.shape[1]
    values = {name: torch.full((heads,), v, device=query.device) for name, v in settings.params}
    scaled = settings.layer_scaled(getattr(module, "layer_idx", 0), heads)
    if scaled is not None:  # the keys each query sees: the last positions of the mask's running count
        keys = attention_mask.to(torch.int64).cumsum(-1)[:, -query.shape[2] :]
        query = query * head_length_scale(keys, scaled.to(query.device), settings.scaled_from).to(query.dtype)
    out, entropy = attend_op(
        query,
        key,
        value,
        norm=settings.norm,
        key_mask=attention_mask.to(torch.bool),
        alibi_slopes=None,
        scale=scaling if scaling is not None else query.shape[-1] ** -0.5,
        poly=settings.poly,
        causal=getattr(module, "is_causal", True),
        **values,
    )
    return out.transpose(1, 2).contiguous(), entropy


def register() -> None:
    """Make `attn_implementation="sharp"` available (idempotent)."""
    AttentionInterface.register(IMPLEMENTATION, sharp_attention_forward)
    AttentionMaskInterface.register(IMPLEMENTATION, key_mask)


register()
