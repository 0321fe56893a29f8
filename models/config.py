"""ModelConfig: every architectural choice of a SharpLM, in plain types so checkpoints stay weights-only."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

from sharp.models import registry
from sharp.models.registry import PAPER_POLY

POSITIONAL = ("rope", "alibi", "nope", "nape")
"""The positional encodings a config may name (models/positional.py computes them)."""

MLPS = ("swiglu", "gelu")
MAX_WEIGHTS = 1 << 36  # a config beyond this is a typo or an attack, not a model to build on this machine
LAYER_NORMS = ("rmsnorm", "layernorm")


def scaled_heads_problem(pairs, layers: int, heads: int) -> str | None:
    """Why (layer, head) pairs of length-scaled heads do not fit a model of `layers` × `heads` (None: they do)."""
    outside = [f"{lay}.{h}" for lay, h in pairs if lay >= layers or h >= heads]
    if not outside:
        return None
    return f"scaled_heads {', '.join(outside)}: the model has layers 0–{layers - 1} and heads 0–{heads - 1}"


@dataclass(frozen=True)
class ModelShape:
    """The sizes serving and the exporter's checks need, whatever the architecture (SharpLM or transformers)."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise ValueError(f"bad model shape: {name} must be an integer >= 1, got {value!r:.40}")
        if self.heads % self.kv_heads:
            raise ValueError(f"bad model shape: heads {self.heads} is not a multiple of kv_heads {self.kv_heads}")


@dataclass
class ModelConfig:
    vocab_size: int = 258  # bytes + BOS + EOS (ByteTokenizer)
    dim: int = 128
    layers: int = 4
    heads: int = 4
    kv_heads: int | None = None  # None = heads (MHA); fewer = GQA
    mlp: str = "swiglu"
    mlp_hidden: int | None = None  # None: 4·dim for gelu, 8/3·dim (rounded to 8) for swiglu
    layer_norm: str = "rmsnorm"
    tie_embeddings: bool = True
    context_length: int = 1024
    norm: str = "softmax"
    layer_norms_override: list[str] | None = None  # per-layer normalizer names, overriding `norm`
    pos: str = "rope"
    rope_base: float = 10000.0
    rope_scaling: float = 1.0
    alpha: float = 1.5  # entmax α at init (per head, learned when learn_alpha)
    learn_alpha: bool = True
    ssa_n: float = 1.5
    ssa_b: float = 1.0
    ssmax_s: float = 1.0
    asentmax_delta: float = 1.0
    asentmax_s_gamma: float = 2.0
    adaptive_poly: tuple[float, ...] = PAPER_POLY
    # What a Hugging Face decoder (Llama, Mistral, Qwen2/3) adds to the plain SharpLM (models/hf_lm.py reads them):
    head_size: int | None = None  # None: dim // heads (Qwen3: 128 with any dim)
    qkv_bias: bool = False  # Qwen2's biased q/k/v projections
    o_bias: bool = False
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head's query and key before RoPE
    norm_eps: float | None = None  # None: 1e-6 for rmsnorm, 1e-5 for layernorm
    rope_inv_freq: tuple[float, ...] | None = None  # the model's own frequencies (scaled RoPE), head_dim / 2 of them
    rope_attention_factor: float = 1.0  # YaRN's factor on cos and sin
    llama4_beta: float = 0.0  # queries × 1 + β·log(1 + ⌊pos / llama4_floor⌋) after RoPE (Llama 4, Ministral 3)
    llama4_floor: int = 8192
    # Length scaling of chosen heads: the queries of head `layer·heads + head` for each index here are multiplied by
    # max(1, log n / log scaled_from) with n the keys the query sees (SSMax's factor floored at 1): the heads that
    # retrieve stay as sharp past scaled_from keys as they were at it; every other head is unchanged.
    scaled_heads: tuple[int, ...] = ()
    scaled_from: int = 512

    def __post_init__(self) -> None:
        _check_types(self)  # first, so the checks below compare numbers with numbers
        self.kv_heads = self.kv_heads or self.heads
        self.adaptive_poly = tuple(float(c) for c in self.adaptive_poly)
        self.scaled_heads = tuple(self.scaled_heads)
        problems = []
        for name in ("vocab_size", "dim", "layers", "heads", "kv_heads", "context_length", "llama4_floor"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("mlp_hidden", "head_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1 or null, got {getattr(self, name)}")
        for name in ("rope_base", "rope_scaling", "rope_attention_factor"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                problems.append(f"{name} must be a finite number > 0, got {getattr(self, name)}")
        for name in ("asentmax_delta", "asentmax_s_gamma"):
            if not math.isfinite(getattr(self, name)):
                problems.append(f"{name} must be finite, got {getattr(self, name)}")
        if self.norm_eps is not None and not (math.isfinite(self.norm_eps) and self.norm_eps > 0):
            problems.append(f"norm_eps must be a finite number > 0 or null, got {self.norm_eps}")
        if not (math.isfinite(self.llama4_beta) and self.llama4_beta >= 0):
            problems.append(f"llama4_beta must be a finite number >= 0, got {self.llama4_beta}")
        if self.scaled_from < 2:
            problems.append(f"scaled_from must be >= 2 keys, got {self.scaled_from}")
        if not all(0 <= i < self.layers * self.heads for i in self.scaled_heads):
            problems.append(f"scaled_heads must be layer·heads + head in [0, {self.layers * self.heads})")
        if len(set(self.scaled_heads)) != len(self.scaled_heads):
            problems.append("scaled_heads names a head twice")
        if not self.adaptive_poly or not all(math.isfinite(c) for c in self.adaptive_poly):
            problems.append(f"adaptive_poly must be one or more finite coefficients, got {list(self.adaptive_poly)}")
        if problems:
            raise ValueError("bad model config: " + "; ".join(problems))
        if self.rope_inv_freq is not None:
            self.rope_inv_freq = tuple(float(f) for f in self.rope_inv_freq)
            if len(self.rope_inv_freq) * 2 != self.head_dim or not all(
                math.isfinite(f) and f > 0 for f in self.rope_inv_freq
            ):
                problems.append(f"rope_inv_freq must be head_dim / 2 = {self.head_dim / 2:g} finite numbers > 0")
        if self.head_size is None and self.dim % self.heads:
            problems.append(f"dim {self.dim} is not a multiple of heads {self.heads}")
        if self.heads % self.kv_heads:
            problems.append(f"heads {self.heads} is not a multiple of kv_heads {self.kv_heads}")
        if self.mlp not in MLPS:
            problems.append(f"mlp {self.mlp!r} not in {MLPS}")
        if self.layer_norm not in LAYER_NORMS:
            problems.append(f"layer_norm {self.layer_norm!r} not in {LAYER_NORMS}")
        if self.pos not in POSITIONAL:
            problems.append(f"pos {self.pos!r} not in {POSITIONAL}")
        norms = []
        for n in self.layer_norms():
            try:
                norms.append(registry.get(n))
            except ValueError as e:
                problems.append(str(e))
        if self.layer_norms_override is not None and len(self.layer_norms_override) != self.layers:
            problems.append(
                f"layer_norms_override has {len(self.layer_norms_override)} entries for {self.layers} layers"
            )
        for p in dict.fromkeys(p for n in norms for p in n.params):  # initial values of the parameters in use
            if (why := p.init_problem(float(getattr(self, p.config_field)))) is not None:
                problems.append(why)
        if self.num_weights() > MAX_WEIGHTS:
            problems.append(f"{self.num_weights():,} weights; sharp builds models of at most {MAX_WEIGHTS:,}")
        if problems:
            raise ValueError("bad model config: " + "; ".join(problems))

    def num_weights(self) -> int:
        """The parameter count this config describes (before building anything)."""
        d, hd = self.dim, self.head_dim
        hidden = self.mlp_hidden or (4 * d if self.mlp == "gelu" else 8 * ((8 * d // 3 + 7) // 8))
        attn = d * (self.heads * hd) * 2 + d * (self.kv_heads * hd) * 2  # biases and q/k norms: negligible
        mlp = d * hidden * (3 if self.mlp == "swiglu" else 2)
        embed = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        return embed + self.layers * (attn + mlp)

    @property
    def head_dim(self) -> int:
        return self.head_size or self.dim // self.heads

    @property
    def shape(self) -> ModelShape:
        return ModelShape(self.layers, self.heads, self.kv_heads, self.head_dim, self.vocab_size, self.context_length)

    def layer_norms(self) -> list[str]:
        """The normalizer of each layer."""
        return list(self.layer_norms_override) if self.layer_norms_override else [self.norm] * self.layers

    def to_dict(self) -> dict:
        d = asdict(self)
        d["adaptive_poly"] = list(self.adaptive_poly)
        d["scaled_heads"] = list(self.scaled_heads)
        if self.rope_inv_freq is not None:
            d["rope_inv_freq"] = list(self.rope_inv_freq)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown model config keys: {', '.join(unknown)}")
        return cls(**d)


_INT, _FLOAT = (int,), (int, float)


def _check_types(cfg: ModelConfig) -> None:
    """Each field holds the type its annotation names (JSON and checkpoints carry anything); one line per field."""
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        kind = f.type
        if kind.endswith("| None") and value is None:
            continue
        base = kind.removesuffix(" | None")
        if base == "int":
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif base == "float":
            ok = isinstance(value, _FLOAT) and not isinstance(value, bool)
        elif base == "bool":
            ok = isinstance(value, bool)
        elif base == "str":
            ok = isinstance(value, str)
        elif base == "tuple[int, ...]":
            ok = isinstance(value, list | tuple) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        elif base == "list[str]":
            ok = isinstance(value, list | tuple) and all(isinstance(v, str) for v in value)
        else:  # tuple[float, ...]
            ok = isinstance(value, list | tuple) and all(
                isinstance(v, _FLOAT) and not isinstance(v, bool) for v in value
            )
        if not ok:
            raise ValueError(f"bad model config: {f.name} must be {kind}, got {value!r:.60}")
