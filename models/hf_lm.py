"""A Hugging Face decoder (Llama, Mistral / Ministral 3, Qwen2/3) as a SharpLM: its config.json mapped onto
`ModelConfig`, its safetensors weights read into sharp's own modules — no transformers model object is built, so the
torch backend runs the model on its paged KV cache and Triton kernels (gpt-fast's shape: one small model class).

transformers is used for what it owns: reading and checking config.json (`hf.load_config`, the same refusals as
the exporter) and computing the RoPE frequencies of a scaled RoPE once (`ROPE_INIT_FUNCTIONS`: linear, llama3,
yarn), which sharp then keeps as numbers in the config. The normalizer is the one `config.sharp_attention` names
(`AttentionSettings`), with the same parameters an export would get.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import PretrainedConfig

from sharp.models import hf, registry
from sharp.models.config import ModelConfig
from sharp.models.hf import UnsupportedModel
from sharp.models.lm import SharpLM

# The families this runner builds (GPT-2's learned positions and fused c_attn are served by the exporter only).
FAMILIES = ("llama", "mistral", "ministral", "ministral3", "qwen2", "qwen3")
_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")


def config_of(config: PretrainedConfig) -> ModelConfig:
    """The SharpLM config that computes what `config` describes; UnsupportedModel names what it cannot."""
    hf.check_config(config)
    kind = config.model_type
    if kind not in FAMILIES:
        raise UnsupportedModel(
            f"{kind}: the torch backend runs {', '.join(FAMILIES)} (serve {kind} with --backend onnxruntime)"
        )
    if getattr(config, "hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"{kind}: hidden_act {config.hidden_act!r}; the torch backend's MLP is SwiGLU (silu)")
    if getattr(config, "mlp_bias", False):
        raise UnsupportedModel(f"{kind}: mlp_bias; the torch backend's MLP has no biases")
    rope = dict(getattr(config, "rope_parameters", None) or {})
    if float(rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) or 1.0) != 1.0:
        raise UnsupportedModel(f"{kind}: partial_rotary_factor; the torch backend rotates the whole head")
    shape = hf.shape_of(config)
    settings = hf.AttentionSettings.of(config)
    if registry.get(settings.norm).query_scale:
        raise UnsupportedModel(f"{kind}: {settings.norm}'s per-query scale has no weights in a transformers model")
    values = {registry.head_param(name).config_field: value for name, value in settings.params}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    inv_freq, factor = _rope(config, rope_type)
    beta = rope.get("llama_4_scaling_beta")
    attention_bias = bool(getattr(config, "attention_bias", False))
    return ModelConfig(
        vocab_size=shape.vocab_size,
        dim=config.hidden_size,
        layers=shape.layers,
        heads=shape.heads,
        kv_heads=shape.kv_heads,
        head_size=shape.head_dim,
        mlp="swiglu",
        mlp_hidden=config.intermediate_size,
        layer_norm="rmsnorm",
        norm_eps=float(config.rms_norm_eps),
        tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        context_length=shape.context_length,
        norm=settings.norm,
        pos="rope",
        adaptive_poly=settings.poly,
        learn_alpha=False,
        qkv_bias=attention_bias or kind == "qwen2",
        o_bias=attention_bias,
        qk_norm=kind == "qwen3",
        rope_inv_freq=tuple(inv_freq.tolist()),
        rope_attention_factor=factor,
        llama4_beta=float(beta or 0.0),
        llama4_floor=int(rope.get("original_max_position_embeddings") or 8192) if beta else 8192,
        scaled_heads=tuple(layer * shape.heads + head for layer, head in settings.scaled_heads),
        scaled_from=settings.scaled_from,
        **values,
    )


def _rope(config: PretrainedConfig, rope_type: str) -> tuple[torch.Tensor, float]:
    """The RoPE frequencies and attention factor transformers computes for this config (fp32, on the CPU)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type == "default":  # as the model classes compute it (not in ROPE_INIT_FUNCTIONS)
        base = float(config.rope_parameters["rope_theta"])
        dim = hf.shape_of(config).head_dim
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), 1.0
    inv_freq, factor = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    return inv_freq.float(), float(factor)


def _weight_files(path: Path) -> list[Path]:
    if (path / _WEIGHTS[0]).is_file():
        return [path / _WEIGHTS[0]]
    index = path / _WEIGHTS[1]
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        return [path / s for s in shards]
    raise UnsupportedModel(f"{path}: no {' or '.join(_WEIGHTS)} (the torch backend reads safetensors weights only)")


def _name(key: str) -> str | None:
    """transformers' parameter name → SharpLM's (None: not a parameter SharpLM holds)."""
    key = key.removeprefix("model.")
    parts = key.split(".")
    if key == "embed_tokens.weight":
        return "embed.weight"
    if key == "norm.weight":
        return "ln_f.weight"
    if key == "lm_head.weight":
        return "head.weight"
    if parts[0] == "layers" and len(parts) >= 4:
        i, rest = parts[1], ".".join(parts[2:])
        table = {
            "input_layernorm.weight": "ln1.weight",
            "post_attention_layernorm.weight": "ln2.weight",
            "mlp.gate_proj.weight": "mlp.gate.weight",
            "mlp.up_proj.weight": "mlp.up.weight",
            "mlp.down_proj.weight": "mlp.down.weight",
        }
        if rest in table:
            return f"blocks.{i}.{table[rest]}"
        if rest.startswith("self_attn."):
            return f"blocks.{i}.attn.{rest.removeprefix('self_attn.')}"
    return None


def load(path: str | Path, config: PretrainedConfig | None = None) -> SharpLM:
    """The SharpLM of the Hugging Face directory `path` (under `config`, its config.json changed, if given), its
    weights read from safetensors (never unpickled), in fp32 and eval mode on the CPU; UnsupportedModel when it
    cannot run exactly."""
    from safetensors import safe_open

    path = Path(path)
    config = config or hf.load_config(path)
    cfg = config_of(config)
    with torch.device("meta"):
        model = SharpLM(cfg)
    state: dict[str, torch.Tensor] = {}
    unknown = []
    for file in _weight_files(path):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                name = _name(key)
                if name is None:
                    unknown.append(key)
                else:
                    state[name] = f.get_tensor(key).float()
    if cfg.tie_embeddings:
        state.pop("head.weight", None)  # the head is the embedding (a file may hold both, equal)
    for i, block in enumerate(model.blocks):  # the normalizer's parameters come from the config, one value a head
        for p in block.attn.spec.params:
            raw = p.to_raw(float(getattr(cfg, p.config_field)))
            state[f"blocks.{i}.attn.{p.state_name}"] = torch.full((cfg.heads,), raw)
    expected = set(model.state_dict()) - ({"head.weight"} if cfg.tie_embeddings else set())
    missing = sorted(expected - set(state))
    if unknown or missing:
        raise UnsupportedModel(
            f"{path}: weights do not match a {cfg.layers}-layer {config.model_type}"
            f" (not read: {unknown[:4]}, missing: {missing[:4]})"
        )
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_embeddings:
        model.head.weight = model.embed.weight
    meta = [name for name, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if meta:
        raise UnsupportedModel(f"{path}: {meta[:4]} were not read")
    return model.eval()
