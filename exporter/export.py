"""Lower a SharpLM to ONNX: one `sharp::SharpAttention` node per layer plus standard-op fallback bodies.

Pipeline: the model's attention layers call `torch.ops.sharp.attention` (models/op.py); torch.onnx.export
(dynamo=True) translates that op into a schema-only node (op_schema.py); a post-pass then
gives the file its contract form (docs/op.md): op_type `SharpAttention` with `overload = norm`, the
fallback bodies (fallback.py) in the private `sharp.fallback` domain, the op's attributes and the model metadata.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import asdict

import onnx
import torch
from onnx import helper
from torch import Tensor, nn

from sharp.exporter import cache_form, fallback, kept_logits, rotary, siblings, tensorrt
from sharp.exporter.metadata import ModelMetadata
from sharp.exporter.op_schema import FALLBACK, SHARP, translate
from sharp.exporter.precision import HALF, QUANTIZED, fusion_key, quantize, to_half
from sharp.exporter.settings import ExportSettings
from sharp.models import registry
from sharp.models.config import ModelShape, scaled_heads_problem
from sharp.models.layers import use_custom_op
from sharp.models.lm import SharpLM


class GenerationGraph(nn.Module):
    """Flat tensor I/O with the Optimum / onnxruntime-genai names; one graph for prefill and decode."""

    def __init__(self, model: SharpLM, kv_cache: bool):
        super().__init__()
        self.model = use_custom_op(model)
        self.kv_cache = kv_cache

    def forward(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, *past: Tensor):
        cache = [(past[2 * i], past[2 * i + 1]) for i in range(len(past) // 2)] if self.kv_cache else None
        out = self.model.step(
            input_ids, cache=cache, positions=position_ids, key_mask=attention_mask.to(torch.bool), return_entropy=True
        )
        presents = [t for kv in out.cache for t in kv] if self.kv_cache else []
        return (out.logits, *presents, out.entropy)


def io_names(layers: int, kv_cache: bool) -> tuple[list[str], list[str]]:
    inputs = ["input_ids", "attention_mask", "position_ids"]
    outputs = ["logits"]
    if kv_cache:
        for i in range(layers):
            inputs += [f"past_key_values.{i}.key", f"past_key_values.{i}.value"]
            outputs += [f"present.{i}.key", f"present.{i}.value"]
    return inputs, [*outputs, "attention_entropy"]


def example_inputs(
    shape: ModelShape, kv_cache: bool, batch: int = 2, length: int = 5, past: int = 3
) -> tuple[Tensor, ...]:
    past = past if kv_cache else 0
    ids = torch.randint(0, shape.vocab_size, (batch, length))
    mask = torch.ones(batch, past + length, dtype=torch.int64)
    pos = (torch.arange(length) + past).expand(batch, length).contiguous()
    kv = [torch.randn(batch, shape.kv_heads, past, shape.head_dim) for _ in range(2 * shape.layers)] if kv_cache else []
    return (ids, mask, pos, *kv)


def _dynamic_shapes(layers: int, kv_cache: bool) -> tuple:
    batch, seq = torch.export.Dim("batch", min=1, max=1024), torch.export.Dim("sequence", min=1, max=1 << 20)
    total = torch.export.Dim.AUTO
    shapes = ({0: batch, 1: seq}, {0: batch, 1: total}, {0: batch, 1: seq})
    if not kv_cache:
        return shapes
    return (*shapes, tuple({0: batch, 2: torch.export.Dim.AUTO} for _ in range(2 * layers)))  # *past: one entry


# onnxscript's rewrite rule that turns Slices of one tensor into a Split: torch.onnx's optimizer runs it with its
# other default rules, and on SmolLM2's 30 layers it matched nothing and took 7 of the optimizer's 9.5 s (the graph
# out was node for node the same without it; a one-off measurement). A Split there would also hide the rotate-half
# Slices that rotary.py fuses.
SLOW_UNUSED_RULE = "SlicesSplit"


@contextlib.contextmanager
def _without_rewrite_rule(name: str):
    """torch.onnx's optimizer (onnxscript's `optimize_ir`, which reads the default rules when it runs) without the
    rule `name`; as it is when onnxscript keeps its rules elsewhere."""
    from onnxscript import rewriter

    rules = getattr(rewriter, "_DEFAULT_REWRITE_RULES", None)
    if rules is None:
        yield
        return
    rewriter._DEFAULT_REWRITE_RULES = tuple(r for r in rules if getattr(r, "name", None) != name)
    try:
        yield
    finally:
        rewriter._DEFAULT_REWRITE_RULES = rules


def trace(graph: nn.Module, shape: ModelShape, settings: ExportSettings) -> onnx.ModelProto:
    """torch.onnx.export of a generation graph (flat I/O, `io_names`) whose attention calls sharp's op."""
    inputs, outputs = io_names(shape.layers, settings.kv_cache)
    with torch.no_grad(), _without_rewrite_rule(SLOW_UNUSED_RULE):
        program = torch.onnx.export(
            graph.eval(),
            example_inputs(shape, settings.kv_cache),
            dynamo=True,
            input_names=inputs,
            output_names=outputs,
            dynamic_shapes=_dynamic_shapes(shape.layers, settings.kv_cache),
            custom_translation_table={torch.ops.sharp.attention.default: translate},
            # The optimizer and the version converter inline local functions; the translation therefore emits
            # schema-only SharpAttention nodes and `finalize` attaches the bodies after both have run.
            opset_version=settings.opset,
            optimize=True,
            verbose=False,
        )
    return program.model_proto


def export_model(model: SharpLM, settings: ExportSettings) -> onnx.ModelProto:
    """The ONNX ModelProto of `model` (each layer keeps its own norm)."""
    model = model.eval()
    proto = trace(GenerationGraph(model, settings.kv_cache), model.cfg.shape, settings)
    use_custom_op(model, on=False)
    return finalize(proto, ModelMetadata.from_model(model, asdict(settings)), settings)


def finalize(proto: onnx.ModelProto, meta: ModelMetadata, settings: ExportSettings) -> onnx.ModelProto:
    """Give the exported file its contract form (docs/op.md) and metadata."""
    shape = meta.shape
    norms_used = set()
    for node in proto.graph.node:
        if node.domain == SHARP.domain and node.op_type == "SharpAttention":
            norm = next(a.s.decode() for a in node.attribute if a.name == "norm")
            norms_used.add(norm)
            node.overload = norm  # the fallback body of this norm (plugins ignore the overload)
            node.attribute.extend(
                [helper.make_attribute("q_heads", shape.heads), helper.make_attribute("kv_heads", shape.kv_heads)]
            )
            if settings.fallback == "streamed":
                node.attribute.append(helper.make_attribute("block_size", settings.block_size))
    in_place = settings.kv_cache and not settings.tensorrt  # TensorRT engines own their I/O buffers
    if in_place:
        cache_form.rewrite(proto)
        kept_logits.add(proto)  # a prefill chunk's logits at its last position only (kept_logits.py)
    meta.export["kv_in_place"] = in_place
    functions = [f for f in proto.functions if f.domain not in (SHARP.domain, FALLBACK.domain)]
    if settings.fallback != "none":
        norms = [registry.get(n) for n in sorted(norms_used)]
        bodies = fallback.functions(norms, settings.fallback)
        if in_place:  # the cache-form overloads take the plain ones' place (they carry those nodes themselves)
            bodies = [f for f in bodies if (f.domain, f.name) != (SHARP.domain, "SharpAttention")]
            bodies += cache_form.functions(norms, settings.fallback)
        functions += bodies
    del proto.functions[:]
    proto.functions.extend(functions)
    imports = {o.domain: o for o in proto.opset_import}
    imports[SHARP.domain] = helper.make_opsetid(SHARP.domain, 1)
    if settings.fallback != "none":
        imports[FALLBACK.domain] = helper.make_opsetid(FALLBACK.domain, 1)
    del proto.opset_import[:]
    proto.opset_import.extend(imports.values())
    proto.ir_version = min(proto.ir_version, 10)
    if not settings.tensorrt:  # RoPE as one RotaryEmbedding per tensor (opset 23); TensorRT keeps the traced nodes
        proto = rotary.fuse(proto)
    meta.export["rotary_embedding"] = rotary.count(proto)
    # a layer's q/k/v and gate/up projections as one MatMul each (what the quantizer treats apart stays apart);
    # the TensorRT form keeps the traced nodes, as it does RoPE's
    apart = fusion_key(proto, settings.dtype, settings.quant_block)
    fused = 0 if settings.tensorrt else siblings.fuse(proto, apart=apart)
    meta.export["sibling_matmuls_fused"] = fused
    if settings.tensorrt:
        mode = settings.fallback if settings.fallback != "none" else None
        tensorrt.rewrite(proto, mode, settings.block_size)
    name_dimensions(proto)
    if settings.dtype in QUANTIZED:
        proto = quantize(proto, settings.dtype, settings.quant_block)
    elif settings.dtype in HALF:
        proto = to_half(proto, settings.dtype)
    if in_place:  # last: the precision converters see the fp32 cache the graph was traced with
        cache_form.store_as(proto, settings.kv_dtype)
    meta.write(proto)
    return proto


# The dynamic dimensions torch.export leaves unnamed (s53, s69 …), by where they appear in the generation graph
_DIM_NAMES = {"attention_mask": (1, "total_sequence"), "past_key_values.": (2, "past_sequence")}


def name_dimensions(proto: onnx.ModelProto) -> None:
    """Name the graph's generated dynamic dimensions as users read them — `batch`, `sequence`, `past_sequence`,
    `total_sequence` — in every input, output and value_info (a present's length becomes `past_sequence +
    sequence`)."""
    rename: dict[str, str] = {}
    for vi in proto.graph.input:
        for prefix, (axis, name) in _DIM_NAMES.items():
            if vi.name.startswith(prefix) and len(vi.type.tensor_type.shape.dim) > axis:
                generated = vi.type.tensor_type.shape.dim[axis].dim_param
                if re.fullmatch(r"s\d+", generated):
                    rename[generated] = name
    if not rename:
        return
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, rename)) + r")\b")
    for vi in (*proto.graph.input, *proto.graph.output, *proto.graph.value_info):
        for dim in vi.type.tensor_type.shape.dim:
            if dim.dim_param:
                dim.dim_param = pattern.sub(lambda m: rename[m.group(1)], dim.dim_param)


def with_norm(
    model: SharpLM,
    norm: str,
    poly: tuple[float, ...] | None = None,
    scaled: tuple[tuple[tuple[int, int], ...], int] | None = None,
    **values: float | None,
) -> SharpLM:
    """`model` with the normalizer `norm`: its own, or an inference-time change the registry allows
    (`values` give the parameters the model never learned, e.g. ssmax_s; the rule: registry.norm_change_problem).
    `scaled` ((layer, head) pairs, from) sets the length-scaled heads (ModelConfig.scaled_heads)."""
    target = registry.get(norm)
    cfg = model.cfg
    changes = {registry.head_param(k).config_field: v for k, v in values.items() if v is not None}
    if poly is not None:
        changes["adaptive_poly"] = list(poly)
    if scaled is not None:
        heads, changes["scaled_from"] = scaled
        if (why := scaled_heads_problem(heads, cfg.layers, cfg.heads)) is not None:
            raise ValueError(why)
        changes["scaled_heads"] = [lay * cfg.heads + h for lay, h in heads]
    if norm == cfg.norm and scaled is None:
        checked = type(cfg).from_dict({**cfg.to_dict(), **changes})  # ModelConfig validates the new values
        cfg.adaptive_poly = checked.adaptive_poly  # the layers share this config object
        return model
    given = [name for name, value in values.items() if value is not None]
    if norm != cfg.norm and (why := registry.norm_change_problem(cfg.norm, norm, given)) is not None:
        raise ValueError(why)
    overrides = {"norm": norm, "layer_norms_override": None} if norm != cfg.norm else {}
    new_cfg = type(cfg).from_dict({**cfg.to_dict(), **overrides, **changes})
    twin = SharpLM(new_cfg)
    missing, unexpected = twin.load_state_dict(model.state_dict(), strict=False)
    new_params = tuple(p.state_name for p in target.params)
    if unexpected or any(not k.endswith(new_params) for k in missing):
        raise ValueError(
            f"cannot move {cfg.norm} weights to {norm}: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    return twin.eval()
