"""The fallback bodies on their own: one `sharp::SharpAttention` node per file, every norm × dense/streamed, run
in stock onnxruntime against attend(impl="reference") — GQA, a KV cache, causal, key-mask padding, ALiBi,
per-head parameters, and entmax's α well above 2 (where the threshold steps need their safeguard)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from sharp.exporter import fallback
from sharp.exporter.op_schema import OP_INPUTS
from sharp.models import attend, registry
from sharp.models.normalizers import PAPER_POLY

B, HQ, HKV, LQ, LK, D = 2, 4, 2, 7, 19, 8


def _session(norm: registry.Norm, mode: str, causal: bool) -> ort.InferenceSession:
    attrs = dict(norm=norm.name, causal=int(causal), scale=D**-0.5, poly=list(PAPER_POLY), q_heads=HQ, kv_heads=HKV)
    if mode == "streamed":
        attrs["block_size"] = 4  # several blocks, the last one partial
    node = helper.make_node("SharpAttention", list(OP_INPUTS), ["O", "entropy"], domain="sharp", **attrs)
    node.overload = norm.name
    kinds = {"key_mask": TensorProto.BOOL}
    inputs = [helper.make_tensor_value_info(n, kinds.get(n, TensorProto.FLOAT), None) for n in OP_INPUTS]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("O", "entropy")]
    model = helper.make_model(
        helper.make_graph([node], "one_op", inputs, outputs),
        opset_imports=[helper.make_opsetid(d, v) for d, v in (("", 18), ("sharp", 1), ("sharp.fallback", 1))],
        functions=fallback.functions([norm], mode),
        ir_version=10,
    )
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def _inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    key_mask = torch.ones(B, LK, dtype=torch.bool)
    key_mask[1, :5] = False  # the second sequence is left-padded
    return {
        "Q": torch.randn(B, HQ, LQ, D, generator=g) * 2,
        "K": torch.randn(B, HKV, LK, D, generator=g) * 2,
        "V": torch.randn(B, HKV, LK, D, generator=g),
        "key_mask": key_mask,
        "alibi_slopes": torch.tensor([0.5, 0.25, 0.0, 0.0]),
        "alpha": torch.tensor([1.2, 1.5, 2.0, 3.0]),
        "query_scale": torch.rand(B, HQ, LQ, generator=g) + 0.5,
        "ssa_n": torch.tensor([1.0, 1.3, 1.7, 2.0]),
        "ssa_b": torch.tensor([0.5, 1.0, 1.5, 2.0]),
        "ssmax_s": torch.tensor([0.5, 1.0, 1.5, 0.8]),
    }


@pytest.mark.parametrize("mode", fallback.MODES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("norm", registry.all_norms(), ids=lambda n: n.name)
def test_body_matches_reference(norm, mode, causal):
    x = _inputs()
    sess = _session(norm, mode, causal)
    out, ent = sess.run(None, {k: v.numpy() for k, v in x.items()})
    params = {p: x[p] for p in norm.param_names}
    o_ref, h_ref = attend(
        x["Q"],
        x["K"],
        x["V"],
        norm=norm.name,
        causal=causal,
        key_mask=x["key_mask"],
        alibi_slopes=x["alibi_slopes"],
        query_scale=x["query_scale"] if norm.query_scale else None,
        return_entropy=True,
        **params,
    )
    np.testing.assert_allclose(out, o_ref.numpy(), atol=2e-5, rtol=0)
    np.testing.assert_allclose(ent, h_ref.numpy(), atol=2e-5, rtol=0)
