"""The normalizer registry is the one table every layer reads: each consumer covers each entry, and a new
normalizer that reuses an existing algorithm needs nothing but its entry."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from devices import ATOL, DEVICE

from sharp.exporter import check as export_check
from sharp.exporter import cli as export_cli
from sharp.exporter import fallback
from sharp.exporter.op_schema import ONE, OP_ATTRIBUTES, OP_INPUTS
from sharp.models import ModelConfig, SharpLM, attend, registry
from sharp.models import train as train_cli
from sharp.models.registry import Family


def _choices(parser, dest: str) -> tuple[str, ...]:
    return tuple(next(a for a in parser._actions if a.dest == dest).choices)


def test_command_lines_offer_exactly_the_registry():
    assert _choices(export_cli.parser(), "norm") == registry.NORMS
    assert _choices(train_cli.parser(), "norm") == registry.NORMS
    flags = {a.dest for a in export_cli.parser()._actions}
    assert {p for n in registry.all_norms() for p in n.change_requires} <= flags


@pytest.mark.parametrize("norm", registry.all_norms(), ids=lambda n: n.name)
def test_every_consumer_covers_the_entry(norm):
    assert {p.name for p in registry.HEAD_PARAMS} <= set(OP_INPUTS)
    for mode in fallback.MODES:
        body, attributes = fallback.BODIES[mode][fallback.algorithm(norm)]
        assert set(fallback.body_inputs(norm)) <= {*OP_INPUTS, ONE}
        assert set(attributes) <= set(OP_ATTRIBUTES)
        assert len(body.to_function_proto().input) == len(fallback.body_inputs(norm))
    attn = SharpLM(ModelConfig(dim=16, layers=1, heads=2, norm=norm.name)).blocks[0].attn
    stored = {k for k, _ in attn.named_parameters()} | {k for k, _ in attn.named_buffers()}
    assert {p.state_name for p in norm.params} <= stored
    assert set(attn.head_params()) == set(norm.param_names)
    assert hasattr(attn, "w_beta") == norm.query_scale
    for source in registry.all_norms():
        assert registry.can_export_as(source.name, norm.name) == (
            source is norm or source.name in norm.inference_time_from
        )


def test_unknown_norms_and_out_of_domain_parameters_are_refused_once():
    with pytest.raises(ValueError, match="unknown norm 'sparsemax'; valid: softmax, adaptive"):
        registry.get("sparsemax")
    with pytest.raises(ValueError, match="ssa_b must be finite and > 0"):
        ModelConfig(norm="ssa", ssa_b=0.0)
    with pytest.raises(ValueError, match="alpha must be > 1 to initialise"):
        ModelConfig(norm="entmax", alpha=1.0)
    q = torch.randn(1, 2, 3, 8)
    with pytest.raises(ValueError, match="ssa_n must be finite and >= 1 for every head"):
        attend(q, q, q, norm="ssa", ssa_n=torch.tensor([1.5, 0.5]))


def test_a_new_normalizer_with_an_existing_algorithm_needs_only_its_entry(monkeypatch, tmp_path):
    """Register a seventh norm (SSMax's algorithm under another name, learned s) and take it through the
    module, every attend implementation, export with both fallbacks, and onnxruntime."""
    ssmax = registry.get("ssmax")
    seventh = dataclasses.replace(ssmax, name="logn", inference_time_from=(), change_requires=())
    monkeypatch.setitem(registry._REGISTRY, "logn", seventh)
    torch.manual_seed(0)
    model = SharpLM(ModelConfig(dim=32, layers=2, heads=4, kv_heads=2, norm="logn", context_length=64)).eval()
    with torch.no_grad():
        for block in model.blocks:
            block.attn.ssmax_s.copy_(torch.linspace(0.5, 1.5, 4))
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 4, 40, 8, generator=g).to(DEVICE) for _ in range(3))
    s = torch.linspace(0.5, 1.5, 4, device=DEVICE)
    ref, ref_h = attend(q, k, v, norm="logn", ssmax_s=s, causal=True, return_entropy=True)
    want, want_h = attend(q, k, v, norm="ssmax", ssmax_s=s, causal=True, return_entropy=True)
    torch.testing.assert_close(ref, want)
    torch.testing.assert_close(ref_h, want_h)
    impls = ["streamed", *(["triton"] if fallback_has_triton() else [])]
    for impl in impls:
        out, ent = attend(q, k, v, norm="logn", ssmax_s=s, causal=True, return_entropy=True, impl=impl, block_size=16)
        torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
        torch.testing.assert_close(ent, ref_h, atol=ATOL, rtol=0)
    from sharp.exporter.export import ExportSettings, export_model

    for mode in fallback.MODES:
        path = tmp_path / f"{mode}.onnx"
        path.write_bytes(
            export_model(model, ExportSettings(norm="logn", fallback=mode, block_size=4)).SerializeToString()
        )
        for _, d_logits, d_entropy in export_check.verify(
            path, model.cfg.shape, True, export_check.sharplm_reference(model)
        ):
            assert d_logits < 1e-4 and d_entropy < 1e-4


def fallback_has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def test_entmax_with_alpha_one_runs_the_softmax_family():
    q = torch.randn(1, 2, 3, 8)
    from sharp.models.problem import build_problem

    kw = dict(causal=True, scale=None, ssa_n=1.5, ssa_b=1.0, ssmax_s=1.0, poly=(), query_scale=None, alibi_slopes=None)
    assert build_problem(q, q, q, norm="entmax", alpha=1.0, **kw).family is Family.SOFTMAX
    assert build_problem(q, q, q, norm="entmax", alpha=1.5, **kw).family is Family.ENTMAX
    with pytest.raises(ValueError, match="cannot mix alpha == 1"):
        _ = build_problem(q, q, q, norm="entmax", alpha=torch.tensor([1.0, 1.5]), **kw).family


def test_the_demo_shows_what_each_norm_does_and_says_so_per_row(capsys):
    """`make demo`'s first tables: every row has the registry's one-line summary; the length-aware norms keep the
    target's weight at 8,192 keys where softmax's falls to ~1/n, and SSA bounds an out-of-range logit's pull where
    softmax hands it everything."""
    from sharp.demo import dispersion

    dispersion()
    table_a, table_b = capsys.readouterr().out.split("(b)")
    for name in registry.NORMS:
        summary = registry.get(name).summary
        assert summary and " ".join(summary.split()) in " ".join(table_a.replace(f"  {name} ", " ").split()), name

    def rows(table: str) -> dict[str, list[str]]:
        return {w[0]: w[1:] for w in (line.split() for line in table.splitlines()) if w and w[0] in registry.NORMS}

    last_weight = {name: float(cells[-2]) for name, cells in rows(table_a.split("\n\n  ")[0]).items()}  # n = 8,192
    assert last_weight["softmax"] < 0.01 and last_weight["ssmax"] > 0.9 and last_weight["asentmax"] > 0.9
    assert last_weight["entmax"] > 30 * last_weight["softmax"]
    deviant_30 = {name: float(cells[-1]) for name, cells in rows(table_b).items()}  # logit 30: weight it takes
    assert deviant_30["softmax"] > 0.99 and deviant_30["ssa"] < 0.2


def test_one_rule_and_one_message_for_changing_a_trained_models_norm():
    """Which norm a trained model may run as is decided once (registry.norm_change_problem), and sharp-export, the
    export API and the Hugging Face path give its message word for word — but for how such a model is trained,
    which differs between a sharp checkpoint (sharp-train) and a transformers model (fine-tuned there)."""
    transformers = pytest.importorskip("transformers")
    from sharp.exporter.export import with_norm
    from sharp.models import hf

    rule = registry.norm_change_problem
    assert (
        rule("ssa", "ssa") is None
        and rule("softmax", "adaptive") is None
        and rule("softmax", "ssmax", ["ssmax_s"]) is None
    )
    assert rule("softmax", "ssmax") == "softmax → ssmax needs ssmax_s (a softmax model never learned ssmax_s)"
    assert rule("softmax", "ssmax", spell=export_cli._flag).startswith("softmax → ssmax needs --ssmax-s (")
    assert rule("ssa", "adaptive") == (
        "cannot export a ssa model as adaptive: adaptive is an inference-time change of softmax models only "
        "(allowed for this model: its own norm)"
    )
    refusal = rule("softmax", "entmax")
    assert refusal == (
        "cannot export a softmax model as entmax: entmax parameters are learned in training; retrain with "
        "sharp-train --norm entmax (allowed for this model: its own norm, adaptive, ssmax (with ssmax_s))"
    )
    # the messages agree with each other: the list names what ssmax needs, and a parameter given without its norm
    # says which norm takes it (it once said "ssmax_s is not a parameter of softmax (its parameters: ())")
    assert rule("softmax", "softmax", ["ssmax_s"], spell=export_cli._flag) == (
        "--ssmax-s is a parameter of ssmax, not of softmax: add --norm ssmax"
    )
    with pytest.raises(hf.UnsupportedModel, match="ssmax_s is a parameter of ssmax, not of softmax: add norm ssmax"):
        hf.sharpen(transformers.LlamaConfig(), "softmax", ssmax_s=1.2)
    model = SharpLM(ModelConfig(dim=16, layers=1, heads=2, norm="softmax"))
    with pytest.raises(export_cli.UsageError) as cli_err:
        export_cli.check_norm_change(model, "entmax", {})
    with pytest.raises(ValueError) as api_err:
        with_norm(model, "entmax")
    with pytest.raises(hf.UnsupportedModel) as hf_err:
        hf.sharpen(transformers.LlamaConfig(), "entmax")
    assert str(cli_err.value) == str(api_err.value) == refusal
    assert str(hf_err.value) == refusal.replace(
        "retrain with sharp-train --norm entmax", hf.FINE_TUNE.format(norm="entmax")
    )


def test_the_spelled_out_signatures_carry_exactly_the_registry_head_parameters():
    """attend's keywords, the sharp::attention torch op's schema, paged_decode's keywords and the ONNX op's inputs
    name the per-head parameters one by one (a typed public signature and a torch.library schema must); this keeps them
    equal to the registry's list and defaults."""
    import inspect

    from sharp.models import op
    from sharp.plugins.triton.paged import paged_decode

    names = {p.name for p in registry.HEAD_PARAMS}
    for fn in (attend, paged_decode):
        params = inspect.signature(fn).parameters
        assert {n for n in params if n in names} == names, fn.__name__
        assert {n: params[n].default for n in names} == registry.HEAD_DEFAULTS, fn.__name__
    schema = {a.name for a in op.sharp_attention._opoverload._schema.arguments}
    assert names <= schema and names <= set(OP_INPUTS)  # the torch op and the ONNX op contract
