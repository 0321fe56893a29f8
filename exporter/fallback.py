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
from sharp.exporter.settings import FALLBACKS
from sharp.models.registry import Family, Norm, Transform

MODES = tuple(m for m in FALLBACKS if m != "none")  # the bodies written here
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
    """The local functions a file with nodes of `norms` needs: one overload per norm, their bodies, and the parts
    those call (another norm's parts stay out of the file)."""
    norms = list(norms)
    used = {BODIES[mode][algorithm(n)][0].name: BODIES[mode][algorithm(n)][0] for n in norms}
    roots = [op_overload(n, mode) for n in norms]
    pool = [*roots, *(f.to_function_proto() for f in used.values()), *(h.to_function_proto() for h in HELPERS[mode])]
    return _reachable(roots, pool)


def _key(domain: str, name: str, overload: str) -> tuple[str, str, str]:
    return domain, name, overload


def _calls(nodes: Iterable[onnx.NodeProto]) -> Iterable[tuple[str, str, str]]:
    """The (domain, op, overload) of every node, Loop and If bodies included."""
    for node in nodes:
        yield _key(node.domain, node.op_type, node.overload)
        for attr in node.attribute:
            for graph in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else attr.graphs:
                yield from _calls(graph.node)


def _reachable(roots: list[onnx.FunctionProto], pool: list[onnx.FunctionProto]) -> list[onnx.FunctionProto]:
    """The functions of `pool` that `roots` call, directly or through others, in pool order."""
    by_key = {_key(f.domain, f.name, f.overload): f for f in pool}
    keep: set[tuple[str, str, str]] = set()
    todo = list(roots)
    while todo:
        f = todo.pop()
        key = _key(f.domain, f.name, f.overload)
        if key not in keep:
            keep.add(key)
            todo.extend(by_key[k] for k in _calls(f.node) if k in by_key)
    return [f for f in pool if _key(f.domain, f.name, f.overload) in keep]
