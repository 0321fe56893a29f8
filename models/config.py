"""ModelConfig: every architectural choice of a SharpLM, in plain types so checkpoints stay weights-only."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from sharp.models import registry
from sharp.models.normalizers import PAPER_POLY
from sharp.models.positional import POSITIONAL

MLPS = ("swiglu", "gelu")
LAYER_NORMS = ("rmsnorm", "layernorm")


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

    def __post_init__(self) -> None:
        self.kv_heads = self.kv_heads or self.heads
        self.adaptive_poly = tuple(float(c) for c in self.adaptive_poly)
        problems = []
        if self.dim % self.heads:
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
        if problems:
            raise ValueError("bad model config: " + "; ".join(problems))

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    def layer_norms(self) -> list[str]:
        """The normalizer of each layer."""
        return list(self.layer_norms_override) if self.layer_norms_override else [self.norm] * self.layers

    def to_dict(self) -> dict:
        d = asdict(self)
        d["adaptive_poly"] = list(self.adaptive_poly)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown model config keys: {', '.join(unknown)}")
        return cls(**d)
