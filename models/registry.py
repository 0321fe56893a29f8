"""The normalizer registry: the one table of attention normalizers that every layer reads.

Each entry says what a normalizer *is* for everything outside its math: its family (a softmax over transformed
logits, or an entmax threshold), which transform of the logits it applies, its learned per-head parameters
(domain, default, initial value, how a module stores them), whether it takes a per-query scale, which norms a
trained model may be exported as without retraining, and what the op and the file's metadata record.
Validation of a norm name happens here (`get`), once; modules, the streamed path, the kernels' host code, the
exporter's bodies and CLI choices and the server read the entry instead of comparing strings.

Adding a normalizer: write its math in `normalizers.py`, add its entry below, and give every consumer of a
*new* `Transform` or family its algorithm (streamed, Triton, ONNX bodies); docs/design.md walks through it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import Enum
from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the table itself needs no torch: a server that only reads names and slots never imports it
    from torch import Tensor

    from sharp.models.normalizers import Param

PAPER_POLY: tuple[float, ...] = (-0.037, 0.481, -2.3, 4.917, -1.791)
"""Adaptive-temperature softmax's β(H) polynomial, highest power first: the paper's fit (the default of `poly`)."""
ADAPTIVE_THRESHOLD = 0.5
"""Nats: adaptive rows with a lower softmax entropy keep β = 1 (the default of `threshold`)."""


def _math():
    """normalizers.py (torch), imported when a normalizer is first computed."""
    return import_module("sharp.models.normalizers")


class Family(str, Enum):
    """How a row is normalised: online softmax over t = T(z), or entmax's threshold search."""

    SOFTMAX = "softmax"
    ENTMAX = "entmax"


class Transform(str, Enum):
    """The softmax family's logit transform t = T(z) (docs/design.md, "Normalizers")."""

    IDENTITY = "identity"  # t = z
    LOG_N_SCALE = "log_n_scale"  # t = s · log(n_visible) · z          (per-row factor)
    SIGNED_LOG = "signed_log"  # t = sgn(z) · n · log1p(b |z|)          (elementwise)
    ENTROPY_BETA = "entropy_beta"  # t = β(H(softmax z)) · z                 (per-row factor, needs a first pass)
    NONE = "none"  # entmax family: no softmax transform


class Storage(str, Enum):
    """How a module stores a learned per-head parameter (raw tensor → value)."""

    IDENTITY = "identity"  # value = raw
    SOFTPLUS = "softplus"  # value = softplus(raw) > 0
    ONE_PLUS_SOFTPLUS = "one_plus_softplus"  # value = 1 + softplus(raw) > 1


def inverse_softplus(y: float) -> float:
    """x with softplus(x) = y: the raw value that initialises a softplus-parametrised parameter at y."""
    return y + math.log(-math.expm1(-y))


@dataclass(frozen=True)
class HeadParam:
    """A per-head parameter of a normalizer: an `attend` keyword, an op input and a metadata key alike."""

    name: str
    default: float  # used when a caller passes none, and as the neutral value of an unused op slot
    minimum: float  # the domain: value >= minimum, or > minimum when `strict`
    strict: bool
    config_field: str  # ModelConfig field with the initial value
    storage: Storage
    learn_flag: str | None = None  # ModelConfig bool field; False keeps the parameter frozen (a buffer)

    @property
    def domain(self) -> str:
        return "finite" if self.minimum == -math.inf else f"finite and {'>' if self.strict else '>='} {self.minimum:g}"

    def problem(self, value: float) -> str | None:
        """Why `value` is outside the domain, or None."""
        ok = math.isfinite(value) and (value > self.minimum if self.strict else value >= self.minimum)
        return None if ok else f"{self.name} must be {self.domain}, got {value}"

    def init_problem(self, value: float) -> str | None:
        """Why `value` cannot initialise the stored parameter (outside the domain, or not representable:
        1 + softplus(raw) is never exactly 1), or None."""
        if (why := self.problem(value)) is not None:
            return why
        floor = {Storage.ONE_PLUS_SOFTPLUS: 1.0, Storage.SOFTPLUS: 0.0}.get(self.storage)
        if floor is not None and value <= floor:
            return f"{self.name} must be > {floor:g} to initialise a learned parameter, got {value}"
        return None

    def check_tensor(self, value: Tensor) -> None:
        import torch

        v = value.detach()
        ok = bool(torch.isfinite(v).all()) and bool((v > self.minimum if self.strict else v >= self.minimum).all())
        if not ok:
            raise ValueError(f"{self.name} must be {self.domain} for every head")

    @property
    def state_name(self) -> str:
        """The module attribute (and state_dict key suffix) holding the raw tensor."""
        return self.name if self.storage is Storage.IDENTITY else f"{self.name}_raw"

    def to_raw(self, value: float) -> float:
        if self.storage is Storage.IDENTITY:
            return value
        floor = 1.0 if self.storage is Storage.ONE_PLUS_SOFTPLUS else 0.0
        return inverse_softplus(max(value - floor, 1e-3))

    def from_raw(self, raw: Tensor) -> Tensor:
        if self.storage is Storage.IDENTITY:
            return raw
        import torch.nn.functional as F

        return F.softplus(raw) + (1.0 if self.storage is Storage.ONE_PLUS_SOFTPLUS else 0.0)


ALPHA = HeadParam("alpha", 1.5, 1.0, False, "alpha", Storage.ONE_PLUS_SOFTPLUS, learn_flag="learn_alpha")
SSA_N = HeadParam("ssa_n", 1.5, 1.0, False, "ssa_n", Storage.ONE_PLUS_SOFTPLUS)
SSA_B = HeadParam("ssa_b", 1.0, 0.0, True, "ssa_b", Storage.SOFTPLUS)
SSMAX_S = HeadParam("ssmax_s", 1.0, -math.inf, False, "ssmax_s", Storage.IDENTITY)
HEAD_PARAMS: tuple[HeadParam, ...] = (ALPHA, SSA_N, SSA_B, SSMAX_S)
"""Every per-head parameter slot, in the op's input order (docs/op.md)."""
HEAD_DEFAULTS: dict[str, float] = {p.name: p.default for p in HEAD_PARAMS}
"""Each per-head parameter's default, as `attend` keywords (benchmarks and tests use the normalizers' defaults)."""


@dataclass(frozen=True)
class Norm:
    """One normalizer's entry."""

    name: str
    family: Family
    transform: Transform
    params: tuple[HeadParam, ...]
    probs: Callable[..., Tensor]  # (x, dim, **params, poly, threshold) → p: the exact math (normalizers.py)
    query_scale: bool = False  # takes a per-query scale λ (B, Hq, Lq) on the logits
    uses_poly: bool = False  # reads the adaptive polynomial (an op attribute, a config field)
    inference_time_from: tuple[str, ...] = ()  # norms whose trained models may be exported as this one
    change_requires: tuple[str, ...] = ()  # parameters the user must give for such a change (no trained value)
    summary: str = ""  # what it does to a row, in one line (the demo's legend)

    @property
    def param_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)

    def op_inputs(self) -> tuple[str, ...]:
        """The optional op inputs this norm reads besides Q, K, V, key_mask and alibi_slopes."""
        return (*self.param_names, *(("query_scale",) if self.query_scale else ()))


def _entmax(x: Tensor, dim: int, alpha: Param = ALPHA.default, **_) -> Tensor:
    return _math().entmax(x, alpha, dim)


def _adaptive(x: Tensor, dim: int, poly=PAPER_POLY, threshold: float = ADAPTIVE_THRESHOLD, **_) -> Tensor:
    return _math().adaptive_softmax(x, dim, poly, threshold)


_REGISTRY: dict[str, Norm] = {
    n.name: n
    for n in (
        Norm(
            "softmax",
            Family.SOFTMAX,
            Transform.IDENTITY,
            (),
            lambda x, dim, **_: _math().softmax(x, dim),
            summary="e^z normalised: with bounded logits every weight is Θ(1/n), so the target's share falls with n",
        ),
        Norm(
            "adaptive",
            Family.SOFTMAX,
            Transform.ENTROPY_BETA,
            (),
            _adaptive,
            uses_poly=True,
            inference_time_from=("softmax",),
            summary="softmax(β·z), β = poly(H) of the row's entropy (the paper's fit): sharper for H in 0.85–5.9 nats; "
            "past that range β = 1, i.e. softmax",
        ),
        Norm(
            "ssmax",
            Family.SOFTMAX,
            Transform.LOG_N_SCALE,
            (SSMAX_S,),
            lambda x, dim, ssmax_s=SSMAX_S.default, **_: _math().ssmax(x, ssmax_s, dim),
            inference_time_from=("softmax",),
            change_requires=("ssmax_s",),
            summary="softmax(s·log n·z): the logit scale grows with the keys a query sees, so the target keeps its "
            "weight (s = 1)",
        ),
        Norm(
            "entmax",
            Family.ENTMAX,
            Transform.NONE,
            (ALPHA,),
            _entmax,
            summary="α-entmax (α = 1.5): keys below a threshold get exactly zero weight, so the row disperses far "
            "more slowly",
        ),
        Norm(
            "asentmax",
            Family.ENTMAX,
            Transform.NONE,
            (ALPHA,),
            _entmax,
            query_scale=True,
            summary="α-entmax of λ·z, λ growing with log n (here 1 + 0.5·log(n + 2); trained models learn it per "
            "query): stays sparse",
        ),
        Norm(
            "ssa",
            Family.SOFTMAX,
            Transform.SIGNED_LOG,
            (SSA_N, SSA_B),
            lambda x, dim, ssa_n=SSA_N.default, ssa_b=SSA_B.default, **_: _math().ssa(x, ssa_n, ssa_b, dim),
            summary="softmax(sgn(z)·n·log(1 + b|z|)) (n = 1.5, b = 1, the paper's init): polynomial scores, flatter "
            "than softmax on bounded logits; what it bounds is one out-of-range logit's pull (table b)",
        ),
    )
}

NORMS: tuple[str, ...] = tuple(_REGISTRY)


def get(name: str) -> Norm:
    """The entry of `name`; the one place an unknown norm is refused."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown norm {name!r}; valid: {', '.join(NORMS)}") from None


def all_norms() -> tuple[Norm, ...]:
    return tuple(_REGISTRY.values())


def can_export_as(trained: str, target: str) -> bool:
    """A model trained with `trained` may be exported with `target` (its own, or an inference-time change)."""
    return trained == target or trained in get(target).inference_time_from


def norm_change_problem(
    trained: str,
    target: str,
    given: Iterable[str] = (),
    spell: Callable[[str], str] = str,
    train: str = "retrain with sharp-train --norm {norm}",
) -> str | None:
    """Why a model trained with `trained` cannot run as `target` given the change parameters named in `given`, or
    None: the one rule (and message) of sharp-export, the export API and the Hugging Face path. `spell` writes a
    parameter as the caller's user gives it (e.g. a command-line flag); `train` says how that kind of model is
    trained with a norm (its `{norm}` filled in)."""
    goal = get(target)
    for p in given:  # a change parameter of another norm: say which norm takes it
        if p not in goal.change_requires and p not in goal.param_names:
            users = [n.name for n in all_norms() if p in n.change_requires]
            if users:
                norms = " or ".join(users)
                return f"{spell(p)} is a parameter of {norms}, not of {target}: add {spell('norm')} {users[0]}"
    if trained == target:
        return None
    if trained not in goal.inference_time_from:
        allowed = "".join(
            f", {n.name}" + (f" (with {', '.join(n.change_requires)})" if n.change_requires else "")
            for n in all_norms()
            if trained in n.inference_time_from
        )
        why = (
            f"{target} is an inference-time change of {' or '.join(goal.inference_time_from)} models only"
            if goal.inference_time_from
            else f"{target} parameters are learned in training; {train.format(norm=target)}"
        )
        return f"cannot export a {trained} model as {target}: {why} (allowed for this model: its own norm{allowed})"
    missing = [p for p in goal.change_requires if p not in set(given)]
    if missing:
        return (
            f"{trained} → {target} needs {', '.join(map(spell, missing))} "
            f"(a {trained} model never learned {', '.join(missing)})"
        )
    return None


def head_param(name: str) -> HeadParam:
    for p in HEAD_PARAMS:
        if p.name == name:
            return p
    raise ValueError(f"unknown normalizer parameter {name!r}; valid: {', '.join(p.name for p in HEAD_PARAMS)}")


def normalize(
    x: Tensor,
    norm: str,
    *,
    dim: int = -1,
    poly: tuple[float, ...] | Tensor = PAPER_POLY,
    threshold: float = ADAPTIVE_THRESHOLD,
    **params: Param,
) -> Tensor:
    """The normalizer `norm` over `dim`; `params` are its per-head parameters (others are ignored).
    For a norm with a per-query scale the logits must already carry it (see `attend`)."""
    return get(norm).probs(x, dim, poly=poly, threshold=threshold, **params)
