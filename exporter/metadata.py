"""The one metadata schema of files written by sharp-export, and the one function that reads it.

A file carries a single metadata entry, key `sharp`, holding JSON:

    {"schema": 1, "sharp_version": "0.1.0",
     "config": {...ModelConfig without its norm fields...},
     "layers": [{"norm": "ssa", "parameters": {"ssa_n": [per head], "ssa_b": [...]}}, ...],
     "tokenizer": {"kind": "bytes", "bos": 256, "eos": 257, "vocab_size": 258},
     "export": {"fallback": "dense", "opset": 18, "kv_cache": true, "dtype": "fp32", "quant_block": 32,
                "block_size": 256}}

`export.dtype` is the weights' precision (fp32, int8, int4; exporter/precision.py), `quant_block` the weights per
scale of the integer ones; `kv_dtype` the KV cache's element type (fp32, or fp16 in the op's cache form: the past
inputs and present outputs are then float16).

A transformers model (sharp-export HF_DIR) adds `"architecture": "transformers"`, its config.json as `config`,
the sizes serving needs as `shape` ({"layers", "heads", "kv_heads", "head_dim", "vocab_size", "context_length"})
and a tokenizer of kind "hf" ({"bos", "eos": [...], "vocab_size", "prepend_bos", "chat_template": the Jinja text or
null}) whose tokenizer.json text is the
second entry, key `sharp.tokenizer.json` — the file is self-contained: serving needs nothing beside it.

`name` (optional) is the model's own name, kept from what was exported (a directory's name, a file's stem) so a
server's model id stays the model's whatever the file is called (`NAME`: the ids a server accepts).

The normalizer is written once, per layer, with that layer's parameters; the model-wide norm is derived.
Serving, benchmarks and tests read files through `read`, which checks the schema before anything is built.
"""

from __future__ import annotations

import json
import mmap
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx

from sharp import __version__
from sharp.models import registry
from sharp.models.config import ModelConfig, ModelShape
from sharp.models.tokenizer import BYTES, HFTokenizer, Tokenizer, tokenizer_from_dict

if TYPE_CHECKING:  # reading a file's metadata needs no torch (a server of ONNX files never imports it)
    from sharp.models.lm import SharpLM

KEY = "sharp"
TOKENIZER_KEY = "sharp.tokenizer.json"
SCHEMA = 1
ARCHITECTURES = ("sharplm", "transformers")
_NORM_FIELDS = ("norm", "layer_norms_override")
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}")  # a model id: what a client may send as `model`
NAME_RULE = "1-128 characters of letters, digits and ._:/@+- starting with a letter or digit"


class MetadataError(ValueError):
    """The file's sharp metadata is missing or unusable; the message says what and what was expected."""


@dataclass(frozen=True)
class LayerAttention:
    norm: str
    parameters: dict[str, list[float]] = field(default_factory=dict)  # per-head values by parameter name


@dataclass(frozen=True)
class ModelMetadata:
    config: dict[str, Any]  # ModelConfig fields except the norm ones (those are in `layers`); config.json for HF
    layers: list[LayerAttention]
    tokenizer: Tokenizer = BYTES
    export: dict[str, Any] = field(default_factory=dict)  # ExportSettings except the norm; {} for a checkpoint
    sharp_version: str = __version__
    architecture: str = "sharplm"
    hf_shape: ModelShape | None = None  # the sizes of a transformers model (a SharpLM's come from its config)
    name: str | None = None  # the exported model's own name (NAME), the served id unless the server is told another

    @property
    def shape(self) -> ModelShape:
        return self.hf_shape if self.architecture == "transformers" else self.model_config().shape

    @property
    def precision(self) -> str:
        """The weights' precision (files from before precisions existed are fp32)."""
        return str(self.export.get("dtype", "fp32"))

    @property
    def kv_dtype(self) -> str:
        """The KV cache's element type: fp32 or fp16 in a file (files from before it was a choice are fp32); a torch
        backend's --dtype."""
        return str(self.export.get("kv_dtype", "fp32"))

    @property
    def kv_numpy_dtype(self) -> type:
        return {"fp32": np.float32, "fp16": np.float16}[self.kv_dtype]

    @property
    def norm(self) -> str:
        """The model's normalizer, or "mixed" when layers differ."""
        norms = {layer.norm for layer in self.layers}
        return norms.pop() if len(norms) == 1 else "mixed"

    def model_config(self) -> ModelConfig:
        """The SharpLM ModelConfig the metadata describes (validated by ModelConfig itself)."""
        if self.architecture != "sharplm":
            raise MetadataError(f"a {self.architecture} model has no SharpLM config")
        norms = [layer.norm for layer in self.layers]
        same = len(set(norms)) == 1
        return ModelConfig.from_dict({**self.config, "norm": norms[0], "layer_norms_override": None if same else norms})

    @classmethod
    def from_model(cls, model: SharpLM, export: dict[str, Any] | None = None) -> ModelMetadata:
        config = {k: v for k, v in model.cfg.to_dict().items() if k not in _NORM_FIELDS}

        def values(t) -> list[float]:
            return [round(float(x), 6) for x in t.detach().cpu()]

        layers = [
            LayerAttention(b.attn.norm, {k: values(v) for k, v in b.attn.head_params().items()}) for b in model.blocks
        ]
        return cls(config, layers, BYTES, {k: v for k, v in (export or {}).items() if k != "norm"})

    def to_json(self) -> str:
        d = {
            "schema": SCHEMA,
            "sharp_version": self.sharp_version,
            "config": self.config,
            "layers": [{"norm": layer.norm, "parameters": layer.parameters} for layer in self.layers],
            "tokenizer": self.tokenizer.to_dict(),
            "export": self.export,
        }
        if self.architecture != "sharplm":
            d.update(architecture=self.architecture, shape=asdict(self.hf_shape))
        if self.name is not None:
            d["name"] = self.name
        return json.dumps(d)

    def write(self, proto: onnx.ModelProto) -> None:
        """Replace the file's metadata with this entry (and the tokenizer.json of an HF tokenizer)."""
        del proto.metadata_props[:]
        proto.metadata_props.append(onnx.StringStringEntryProto(key=KEY, value=self.to_json()))
        if isinstance(self.tokenizer, HFTokenizer):
            proto.metadata_props.append(onnx.StringStringEntryProto(key=TOKENIZER_KEY, value=self.tokenizer.json))


def source_name(path: Path) -> str | None:
    """The name an export keeps of what it was exported from: a directory's name, a file's stem; None when that is
    no valid model id (NAME)."""
    path = Path(path)
    name = path.resolve().name if path.is_dir() else path.stem
    return name if NAME.fullmatch(name) else None


def named(proto: onnx.ModelProto, name: str | None) -> None:
    """Rewrite the file's metadata with the model's name."""
    replace(read(proto), name=name).write(proto)


def parse(text: str, tokenizer_json: str | None = None) -> ModelMetadata:
    """The metadata in a `sharp` entry's JSON (and the `sharp.tokenizer.json` entry, if any); MetadataError names
    the field that is wrong."""
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise MetadataError(f"metadata '{KEY}' is not JSON ({e.msg})") from None
    if not isinstance(d, dict):
        raise MetadataError(f"metadata '{KEY}' must be a JSON object, got {type(d).__name__}")
    if d.get("schema") != SCHEMA:
        raise MetadataError(f"metadata schema {d.get('schema')!r}; this sharp reads schema {SCHEMA} (re-export)")
    for name, kind in (("config", dict), ("layers", list), ("tokenizer", dict), ("export", dict)):
        if not isinstance(d.get(name), kind):
            raise MetadataError(f"metadata field '{name}' must be a {kind.__name__}, got {d.get(name)!r:.60}")
    architecture = d.get("architecture", "sharplm")
    if architecture not in ARCHITECTURES:
        raise MetadataError(f"metadata architecture {architecture!r}; valid: {', '.join(ARCHITECTURES)}")
    name = d.get("name")
    if name is not None and not (isinstance(name, str) and NAME.fullmatch(name)):
        raise MetadataError(f"metadata name {name!r:.60}: {NAME_RULE}")
    layers = []
    for i, layer in enumerate(d["layers"]):
        if not isinstance(layer, dict) or not isinstance(layer.get("norm"), str):
            raise MetadataError(f"metadata layers[{i}] must be an object with a 'norm' string")
        layers.append(LayerAttention(layer["norm"], dict(layer.get("parameters") or {})))
    try:
        hf_shape = ModelShape(**d["shape"]) if architecture == "transformers" else None
        tokenizer = tokenizer_from_dict(d["tokenizer"], tokenizer_json)
        meta = ModelMetadata(
            d["config"], layers, tokenizer, d["export"], str(d.get("sharp_version")), architecture, hf_shape, name
        )
        cfg = meta.shape
        for layer in layers:
            registry.get(layer.norm)
    except (TypeError, ValueError) as e:
        raise MetadataError(f"metadata does not describe a model: {e}") from None
    if len(layers) != cfg.layers:
        raise MetadataError(f"metadata lists {len(layers)} layers; its config has {cfg.layers}")
    for i, layer in enumerate(layers):
        for name, values in layer.parameters.items():
            numbers = isinstance(values, list) and all(isinstance(v, int | float) for v in values)
            if not isinstance(name, str) or not numbers or len(values) != cfg.heads:
                raise MetadataError(
                    f"metadata layers[{i}].parameters.{name} must be {cfg.heads} numbers (one per head)"
                )
    return meta


def read(proto_or_path: onnx.ModelProto | str | Path) -> ModelMetadata:
    """The sharp metadata of an ONNX model; a path is scanned for it without parsing the graph (`file_properties`)."""
    if isinstance(proto_or_path, onnx.ModelProto):
        props = {p.key: p.value for p in proto_or_path.metadata_props}
    else:
        props = file_properties(proto_or_path)
    if KEY not in props:
        raise MetadataError("no sharp metadata; expected an ONNX file written by sharp-export")
    return parse(props[KEY], props.get(TOKENIZER_KEY))


_METADATA_FIELD = onnx.ModelProto.DESCRIPTOR.fields_by_name["metadata_props"].number  # 14


def file_properties(path: str | Path) -> dict[str, str]:
    """The metadata_props of the ONNX file at `path`, read by walking the ModelProto's top-level fields and skipping
    the rest unread: `onnx.load` would parse the whole graph, inline weights included — a second copy of a 450 MB
    model in the server's peak memory before onnxruntime loads its own. Raises MetadataError for bytes that are not
    a protobuf message."""
    props: dict[str, str] = {}
    if Path(path).stat().st_size == 0:
        raise MetadataError(f"{path}: an empty file, not an ONNX model")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        pos, end = 0, len(data)
        while pos < end:
            tag, pos = _varint(data, pos)
            field_number, wire = tag >> 3, tag & 7
            if wire == 0:
                _, pos = _varint(data, pos)
            elif wire == 1:
                pos += 8
            elif wire == 5:
                pos += 4
            elif wire == 2:
                size, pos = _varint(data, pos)
                if field_number == _METADATA_FIELD:
                    entry = onnx.StringStringEntryProto.FromString(data[pos : pos + size])
                    props[entry.key] = entry.value
                pos += size
            else:
                raise MetadataError(f"{path}: not an ONNX file (protobuf wire type {wire} at byte {pos})")
        if pos != end:
            raise MetadataError(f"{path}: not an ONNX file (a field runs past the end)")
    return props


def _varint(data, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if pos >= len(data) or shift > 63:
            raise MetadataError("not an ONNX file (a truncated or overlong varint)")
        byte = data[pos]
        value |= (byte & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if not byte & 0x80:
            return value, pos


Dims = list[int | None]  # a tensor's dimensions, None where dynamic


def graph_io(proto: onnx.ModelProto) -> tuple[dict[str, Dims], dict[str, Dims]]:
    """The graph's inputs and outputs: name → dimensions."""

    def dims(vi) -> Dims:
        return [d.dim_value if d.HasField("dim_value") else None for d in vi.type.tensor_type.shape.dim]

    return {i.name: dims(i) for i in proto.graph.input}, {o.name: dims(o) for o in proto.graph.output}


def check_graph(meta: ModelMetadata, inputs: dict[str, Dims], outputs: dict[str, Dims]) -> None:
    """The metadata agrees with the graph it describes (`inputs`, `outputs`: name → dimensions, from `graph_io` or
    an onnxruntime session): I/O names, layer count, vocabulary and cache shapes."""
    cfg = meta.shape
    for name in ("input_ids", "attention_mask", "position_ids"):
        if name not in inputs:
            raise MetadataError(f"the graph has no input '{name}'; expected a generation graph from sharp-export")
    for name in ("logits", "attention_entropy"):
        if name not in outputs:
            raise MetadataError(f"the graph has no output '{name}'; expected a generation graph from sharp-export")
    vocab = outputs["logits"][-1:]
    if vocab and vocab[0] is not None and vocab[0] != cfg.vocab_size:
        raise MetadataError(f"metadata vocab_size {cfg.vocab_size}, but the graph's logits have {vocab[0]} entries")
    past = sorted(n for n in inputs if n.startswith("past_key_values."))
    if meta.export.get("kv_cache") and len(past) != 2 * cfg.layers:
        raise MetadataError(f"metadata says {cfg.layers} layers, the graph has {len(past)} past key/value inputs")
    for name in past:
        dims = inputs[name]
        expected = {1: ("kv_heads", cfg.kv_heads), 3: ("head_dim", cfg.head_dim)}
        for axis, (field_name, value) in expected.items():
            if len(dims) != 4 or (dims[axis] is not None and dims[axis] != value):
                raise MetadataError(f"metadata {field_name} {value} does not match input {name} of shape {dims}")


def plan_metadata_path(plan: Path) -> Path:
    """Where a TensorRT engine's sharp metadata lives: beside the plan (sharp-build-engine writes it)."""
    return plan.with_name(plan.name + ".json")


def read_plan(plan: Path) -> ModelMetadata:
    """The sharp metadata sharp-build-engine wrote beside an engine (the export's entries, same schema)."""
    path = plan_metadata_path(plan)
    if not path.is_file():
        raise MetadataError(f"{path.name} not found beside it; build engines with sharp-build-engine")
    props = json.loads(path.read_text())
    if not isinstance(props, dict) or KEY not in props:
        raise MetadataError(f"{path.name} holds no sharp metadata; rebuild the engine with sharp-build-engine")
    return parse(props[KEY], props.get(TOKENIZER_KEY))
