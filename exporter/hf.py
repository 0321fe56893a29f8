"""Lower a Hugging Face transformers decoder (a model directory) to the same generation graph as a SharpLM.

The model runs with `attn_implementation="sharp"` (models/hf.py), so each attention layer is one
`torch.ops.sharp.attention` call that the common tracer (export.trace) turns into a `sharp::SharpAttention`
node; the KV cache travels as flat past/present tensors (a transformers DynamicCache is rebuilt from them inside
the graph), and the per-head entropy the attention returns in place of its weights becomes `attention_entropy`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import onnx
import torch
from torch import Tensor, nn
from transformers import DynamicCache, PretrainedConfig

from sharp.exporter.export import ExportSettings, finalize, trace
from sharp.exporter.metadata import LayerAttention, ModelMetadata
from sharp.models import hf
from sharp.models.tokenizer import HFTokenizer


class HFGenerationGraph(nn.Module):
    """Flat tensor I/O with the Optimum / onnxruntime-genai names around a transformers causal LM."""

    def __init__(self, model: nn.Module, kv_cache: bool):
        super().__init__()
        self.model = model
        self.kv_cache = kv_cache

    def forward(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, *past: Tensor):
        cache = DynamicCache(config=self.model.config) if self.kv_cache else None
        for i in range(len(past) // 2):
            cache.update(past[2 * i], past[2 * i + 1], i)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=self.kv_cache,
            output_attentions=True,
        )
        presents = [t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)] if cache else []
        return (out.logits, *presents, torch.stack(out.attentions, 1))


def reference(model: nn.Module, ids: Tensor) -> tuple[Tensor, Tensor]:
    """Logits and entropy (B, layers, heads, L) of the PyTorch model on a whole sequence."""
    with torch.no_grad():
        out = model(input_ids=ids, output_attentions=True, use_cache=False)
    return out.logits, torch.stack(out.attentions, 1)


def special_ids(path: Path, config: PretrainedConfig) -> tuple[int | None, list[int]]:
    """BOS and the EOS ids (generation_config.json's list when present, and config.json's)."""
    eos: list[int] = []
    generation = path / "generation_config.json"
    sources = [json.loads(generation.read_text(encoding="utf-8"))] if generation.is_file() else []
    sources.append({"eos_token_id": config.eos_token_id, "bos_token_id": config.bos_token_id})
    bos = next((s["bos_token_id"] for s in sources if isinstance(s.get("bos_token_id"), int)), None)
    for s in sources:
        value = s.get("eos_token_id")
        for e in value if isinstance(value, list) else [value]:
            if isinstance(e, int) and e not in eos:
                eos.append(e)
    return bos, eos


def load_tokenizer(path: Path, config: PretrainedConfig) -> HFTokenizer:
    """The model directory's tokenizer.json with its BOS/EOS; ValueError when there is none."""
    if not (path / "tokenizer.json").is_file():
        raise ValueError(
            f"{path} has no tokenizer.json (sharp-serve needs one; a slow tokenizer can be converted with "
            "transformers: AutoTokenizer.from_pretrained(dir).save_pretrained(dir))"
        )
    bos, eos = special_ids(path, config)
    return HFTokenizer.from_dir(path, config.vocab_size, bos, eos)


def metadata(model: nn.Module, tokenizer: HFTokenizer, settings: ExportSettings) -> ModelMetadata:
    return config_metadata(model.config, tokenizer, {k: v for k, v in asdict(settings).items() if k != "norm"})


def config_metadata(
    config: PretrainedConfig, tokenizer: HFTokenizer, export: dict, name: str | None = None
) -> ModelMetadata:
    """The metadata of a transformers model: its config.json, its sizes, its normalizer per layer, its tokenizer
    (an export's; the torch backend's, which serves the directory as it is)."""
    shape = hf.shape_of(config)
    attention = hf.AttentionSettings.of(config)
    layer = LayerAttention(attention.norm, attention.head_values(shape.heads))
    config_dict = json.loads(config.to_json_string(use_diff=False))
    return ModelMetadata(
        config_dict, [layer] * shape.layers, tokenizer, export, architecture="transformers", hf_shape=shape, name=name
    )


def _division_form(norm: nn.Module) -> Callable[[Tensor], Tensor]:
    """An RMSNorm's forward as x / sqrt(mean(x²) + eps) · weight: the form onnxruntime fuses into one
    SimplifiedLayerNormalization node (transformers writes x · rsqrt(…), five nodes a norm in every step)."""

    def forward(hidden_states: Tensor) -> Tensor:
        x = hidden_states.float()
        scaled = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
        return norm.weight * scaled.to(hidden_states.dtype)

    return forward


@contextmanager
def fusable_norms(model: nn.Module) -> Iterator[int]:
    """While tracing, every RMSNorm of the model that computes exactly the division form (checked on random input,
    so a variant such as (1 + weight) keeps its own forward) runs in that form; yields how many were swapped."""
    swapped = []
    probe = torch.Generator().manual_seed(0)
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not (type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon")):
            continue
        if not isinstance(weight, Tensor) or weight.dim() != 1:
            continue
        form = _division_form(module)
        x = torch.randn(4, weight.shape[0], generator=probe).to(weight.dtype) * 3
        with torch.no_grad():
            if torch.allclose(module(x), form(x), rtol=1e-5, atol=1e-6):
                module.forward = form
                swapped.append(module)
    try:
        yield len(swapped)
    finally:
        for module in swapped:
            del module.forward


def export_hf(model: nn.Module, tokenizer: HFTokenizer, settings: ExportSettings) -> onnx.ModelProto:
    """The ONNX ModelProto of a transformers causal LM running sharp's attention."""
    model = model.eval()
    shape = hf.shape_of(model.config)
    with fusable_norms(model):
        proto = trace(HFGenerationGraph(model, settings.kv_cache), shape, settings)
    return finalize(proto, metadata(model, tokenizer, settings), settings)
