"""`ExportSettings`: what an export writes, each setting a sharp-export flag (exporter/cli.py builds the flags from
these fields) and checked once, here, for the API and the command line alike. Light on purpose — no torch, no
onnxscript — so that sharp-export can refuse a bad command before it loads either."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from sharp.exporter.precision import EXPORTABLE, QUANT_BLOCK, check_block
from sharp.models.registry import NORMS

OPSET = 18  # the standard opset the graph and its fallback bodies are written in
FALLBACKS = ("dense", "streamed", "none")  # the standard-op bodies a file carries (none: a plugin must run it)
KV_TYPES = ("fp32", "fp16")  # the KV cache's element types
STREAMED_BLOCK = 256  # keys per Loop iteration of the streamed fallback bodies, unless set


def flag(default, help: str, *names: str, choices=None, checked: bool = True):
    """A setting that is also a sharp-export flag: `names` (default `--name-with-dashes`; a bool that defaults to
    True is `--no-name`), this default, this help, these choices (held by the settings too unless not `checked`)."""
    return field(default=default, metadata={"help": help, "names": names, "choices": choices, "checked": checked})


@dataclass(frozen=True)
class ExportSettings:
    # the model decides which norms it can be written as (per-layer files say "mixed"; registered norms join NORMS)
    norm: str | None = flag(None, "normalizer in the file (default: the model's)", choices=NORMS, checked=False)
    fallback: str = flag(
        "dense",
        "standard-op bodies: dense (materialises the logits; fastest for short contexts), streamed (a Loop over key"
        " blocks, O(L·block) memory; long contexts), none (the file then needs a sharp plugin)",
        choices=FALLBACKS,
    )
    opset: int = flag(
        OPSET,
        f"ONNX opset the graph is traced at ({OPSET}; converting would inline the custom op away); a file whose RoPE"
        " becomes RotaryEmbedding nodes imports opset 23",
        choices=(OPSET,),
    )
    kv_cache: bool = flag(True, "write a graph without past and present key/value inputs and outputs", "--no-kv-cache")
    dtype: str = flag(
        "fp32",
        "precision of the weights: fp32 (as traced); fp16 or bf16 (the graph computes in it; I/O, the KV cache and the"
        " attention op stay fp32); int8 or int4 (blockwise weight-only MatMulNBits through onnxruntime's quantizer;"
        " int4 keeps the value and down projections at 8 bits; weights already on a 4- or 8-bit grid, as a quantized"
        " GGUF's are, keep theirs exactly — the default for a Q4_0/Q4_1 GGUF is int4, for a Q8_0 one int8). The check"
        " then compares the file with the fp32 model on text against the bounds of docs/op.md and refuses a file"
        " outside them (bf16 needs onnxruntime-gpu for that: the CPU provider cannot run it)",
        "--weights",
        "--dtype",
        choices=EXPORTABLE,
    )
    quant_block: int = flag(QUANT_BLOCK, "weights per quantization scale of int8/int4 (a power of two >= 16)")
    block_size: int = flag(STREAMED_BLOCK, "keys per Loop iteration of --fallback streamed")
    tensorrt: bool = flag(
        False,
        "write the TensorRT form of the op: nodes TensorRT's ONNX parser maps to sharp's AOT plugin (int32 key mask,"
        " packed parameters; docs/tensorrt.md); checked here through its fallback bodies",
    )
    kv_dtype: str = flag(
        "fp32",
        "the KV cache's element type: fp32, or fp16 (half the bytes every decode step reads and half the memory per"
        " token; keys and values rounded to fp16 when written, attention still computed in fp32). The check then"
        " compares the file with the fp32 model on text, as for --weights fp16",
        "--kv-cache-dtype",
        choices=KV_TYPES,
    )

    def __post_init__(self) -> None:
        """Raise ValueError naming the first setting out of range, in backquotes (the CLI names its flag)."""
        for f in fields(self):
            allowed = f.metadata["choices"] if f.metadata["checked"] else None
            if allowed is not None and getattr(self, f.name) not in (*allowed, None):
                raise ValueError(f"`{f.name}` {getattr(self, f.name)!r}; valid: {', '.join(map(str, allowed))}")
        if self.block_size < 1:
            raise ValueError(f"`block_size` must be >= 1, got {self.block_size}")
        check_block(self.quant_block)
        if self.dtype != "fp32" and self.tensorrt:
            raise ValueError(
                f"`dtype` {self.dtype} with `tensorrt`: TensorRT files are fp32 and sharp-build-engine --fp16|--bf16"
                " builds the engine's precision (int8/int4 would be onnxruntime's MatMulNBits, which TensorRT cannot"
                " parse)"
            )
        if self.kv_dtype != "fp32" and not self.kv_cache:
            raise ValueError(f"`kv_dtype` {self.kv_dtype} keeps the cache in the op's cache form, which needs the KV"
                             " cache: drop `kv_cache`")  # fmt: skip
        if self.kv_dtype != "fp32" and self.tensorrt:
            raise ValueError(f"`kv_dtype` {self.kv_dtype} keeps the cache in the op's cache form, which `tensorrt`"
                             " files do not have")  # fmt: skip


def flag_names(f) -> tuple[str, ...]:
    """The command-line names of a settings field."""
    if f.metadata["names"]:
        return f.metadata["names"]
    return (("--no-" if f.default is True else "--") + f.name.replace("_", "-"),)
