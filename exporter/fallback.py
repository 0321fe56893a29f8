"""Which fallback body runs each normalizer: one small factory per (norm, dense | streamed).

A norm's algorithm comes from the registry (its family and, for the softmax family, its logit transform);
the tables below map each algorithm to its body and the attributes that body reads, and the body's inputs are
the op's fixed slots named by the registry entry (its parameters, then its per-query scale for entmax).
A new normalizer with an existing algorithm needs nothing here.
"""

from __future__ import annotations

from collections.abc import Iterable

import onnx
from onnxscript.values import OnnxFunction

from sharp.exporter import body_parts, dense, streamed
from sharp.exporter.op_schema import ONE, op_function
from sharp.models.registry import Family, Norm, Transform

MODES = ("dense", "streamed")
_COMMON = ("Q", "K", "V", "key_mask", "alibi_slopes")
_ATTRS = ("scale", "causal")

# algorithm → (body, attributes it reads), per mode; an algorithm is a softmax-family Transform or Family.ENTMAX
BODIES: dict[str, dict[Transform | Family, tuple[OnnxFunction, tuple[str, ...]]]] = {
    "dense": {
        Transform.IDENTITY: (dense.DenseSoftmax, _ATTRS),
        Transform.LOG_N_SCALE: (dense.DenseLogNScale, _ATTRS),
        Transform.SIGNED_LOG: (dense.DenseSignedLog, _ATTRS),
        Transform.ENTROPY_BETA: (dense.DenseEntropyBeta, (*_ATTRS, "poly", "threshold")),
        Family.ENTMAX: (dense.DenseEntmax, (*_ATTRS, "max_iters")),
    },
    "streamed": {
        Transform.IDENTITY: (streamed.StreamedSoftmax, (*_ATTRS, "block_size")),
        Transform.LOG_N_SCALE: (streamed.StreamedLogNScale, (*_ATTRS, "block_size")),
        Transform.SIGNED_LOG: (streamed.StreamedSignedLog, (*_ATTRS, "block_size")),
        Transform.ENTROPY_BETA: (streamed.StreamedEntropyBeta, (*_ATTRS, "poly", "threshold", "block_size")),
        Family.ENTMAX: (streamed.StreamedEntmax, (*_ATTRS, "max_iters", "block_size")),
    },
}
HELPERS = {
    "dense": (*body_parts.PARTS, *dense.HELPERS),
    "streamed": (*body_parts.PARTS, *streamed.HELPERS),
}


def algorithm(norm: Norm) -> Transform | Family:
    return Family.ENTMAX if norm.family is Family.ENTMAX else norm.transform


def body_inputs(norm: Norm) -> tuple[str, ...]:
    """The op slots the norm's body takes, in order: the common five, the norm's parameters, and for the entmax
    family its per-query scale (the constant 1 when the norm has none)."""
    if norm.family is Family.ENTMAX:
        return (*_COMMON, *norm.param_names, "query_scale" if norm.query_scale else ONE)
    if norm.query_scale:
        raise ValueError(f"no fallback body for a per-query scale on the softmax family ({norm.name})")
    return (*_COMMON, *norm.param_names)


def op_overload(norm: Norm, mode: str) -> onnx.FunctionProto:
    """`(sharp, SharpAttention, overload=norm.name)` running the norm's body of `mode`."""
    body, attributes = BODIES[mode][algorithm(norm)]
    return op_function(norm, body.name, body_inputs(norm), attributes)


def functions(norms: Iterable[Norm], mode: str) -> list[onnx.FunctionProto]:
    """The local functions a file with nodes of `norms` needs: one overload per norm, their bodies, the parts."""
    norms = list(norms)
    used = {BODIES[mode][algorithm(n)][0].name: BODIES[mode][algorithm(n)][0] for n in norms}
    return [
        *(op_overload(n, mode) for n in norms),
        *(f.to_function_proto() for f in used.values()),
        *(h.to_function_proto() for h in HELPERS[mode]),
    ]
