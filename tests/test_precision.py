"""sharp-export --weights int8|int4: onnxruntime's MatMulNBits quantizer, the precision check, serving the files.

The trained zoo model is the subject: agreement with fp32 means something only for a model that predicts text."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import onnx
import pytest

from sharp.exporter import metadata, precision
from sharp.exporter.check import sharplm_reference, verify_text
from sharp.exporter.cli import main as export_main
from sharp.exporter.precision import BOUNDS, Agreement, Bound, PrecisionError, quantize
from sharp.models import load
from sharp.models.checkpoint import zoo_dir
from sharp.serving import BackgroundServer, Client, Engine, EngineConfig, ServerConfig, ServingMetrics, load_backend

ZOO = zoo_dir() / "ssa.pt"
DOCS = Path(__file__).resolve().parents[1] / "docs"


@pytest.fixture(scope="module")
def zoo_files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("precision")
    files = {}
    for weights in ("fp32", "fp16", "int8", "int4"):
        files[weights] = d / f"zoo-{weights}.onnx"
        assert export_main([str(ZOO), "-o", str(files[weights]), "--weights", weights]) == 0
    return files


def _bits(proto: onnx.ModelProto, modules: dict[str, str]) -> dict[str, int]:
    """module:node → bits of each MatMulNBits node (`modules`: the fp32 file's MatMul names → their modules)."""
    out = {}
    for node in proto.graph.node:
        if node.op_type == "MatMulNBits":
            attrs = {a.name: a.i for a in node.attribute}
            assert attrs["block_size"] == 32 and attrs["accuracy_level"] == 4
            # a name the fp32 file lacks is a projection it fused and int4 keeps apart: v (8 bits, unlike q·k)
            out[modules.get(node.name.rsplit("_Q", 1)[0], "v_proj") + ":" + node.name] = attrs["bits"]
    return out


def test_integer_files_are_quantized_by_the_recipe_and_say_so(zoo_files):
    """int8: every projection at 8 bits; int4: 4 bits but v and down at 8 — and q·k·v, gate·up fused into one MatMul
    each (exporter/siblings.py) only where their bits agree: v stays apart under int4."""
    fp32 = zoo_files["fp32"].stat().st_size
    modules = {n.name: precision._module(n) for n in precision.weight_matmuls(onnx.load(str(zoo_files["fp32"])))}
    assert sorted(modules.values()) == sorted(["down", "gate", "o_proj", "q_proj"] * 4)  # q·k·v and gate·up fused
    assert zoo_files["int8"].stat().st_size <= 0.55 * fp32 and zoo_files["int4"].stat().st_size <= 0.3 * fp32
    for weights, want in (("int8", lambda m: 8), ("int4", lambda m: 8 if m in ("v_proj", "down") else 4)):
        proto = onnx.load(str(zoo_files[weights]))
        assert metadata.read(proto).precision == weights and metadata.read(proto).export["quant_block"] == 32
        assert precision.weight_matmuls(proto) == []  # no projection left in fp32
        bits = _bits(proto, modules)
        # per layer (4): q·k·v, o, gate·up, down; under int4 v apart from q·k (the tied head is fp32)
        assert len(bits) == 4 * (4 if weights == "int8" else 5)
        assert all(b == want(name.split(":")[0]) for name, b in bits.items()), bits
        assert sorted(bits.values()).count(8) == (16 if weights == "int8" else 8)
        assert [m.split(":")[0] for m in bits].count("v_proj") == (0 if weights == "int8" else 4)
    assert metadata.read(onnx.load(str(zoo_files["fp32"]))).precision == "fp32"


def test_agreement_with_fp32_on_the_zoo_models_validation_text(zoo_files):
    """The goals: int8 top-1 agreement ≥ 99% and int4 ≥ 95% over the held-out text's positions, both within the
    bounds the export check applies."""
    model = load(ZOO)
    for weights, goal in (("int8", 0.99), ("int4", 0.95)):
        rows = verify_text(zoo_files[weights], model.cfg.shape, True, sharplm_reference(model))
        total = rows[-1][1]
        assert total.positions == 2 * 256 + 32 and total.top1 >= goal, (weights, total)
        assert total.problems(BOUNDS[weights]) == []
    fp32 = verify_text(zoo_files["fp32"], model.cfg.shape, True, sharplm_reference(model))[-1][1]
    assert fp32.top1 == 1 and fp32.kl < 1e-6  # the yardstick itself: the fp32 file is the model


def test_a_file_outside_its_bound_is_refused_and_not_written(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(precision.QUANTIZED, "int4", 2)  # 2-bit projections: far outside int4's bound
    out = tmp_path / "lossy.onnx"
    assert export_main([str(ZOO), "-o", str(out), "--weights", "int4"]) == 1
    err = capsys.readouterr().err
    assert re.search(r"check FAILED \(int4\): mean KL [\d.e+-]+ > 5e-02", err) and f"{out} not written" in err
    assert list(tmp_path.iterdir()) == []


def test_agreement_measures(tmp_path):
    rng = np.random.default_rng(0)
    ref = rng.normal(size=(50, 16)) * 4
    same = Agreement.of(ref, ref, np.ones(50), np.ones(50))
    assert (same.top1, same.kl, same.max_logit_error, same.entropy_error) == (1, 0, 0, 0)
    flipped = ref.copy()
    flipped[:, [0, 1]] = flipped[:, [1, 0]]  # swaps the top token wherever 0 or 1 was the argmax
    a = Agreement.of(ref, flipped, np.zeros(50), np.full(50, 0.5))
    p = np.exp(ref - ref.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    kl = (p * (np.log(p) - np.log(p[:, [1, 0, *range(2, 16)]]))).sum(-1).mean()
    assert a.kl == pytest.approx(kl) and a.entropy_error == 0.5
    moved = np.isin(ref.argmax(-1), [0, 1])
    assert a.top1 == pytest.approx(1 - moved.mean()) and a.confident == int((p.max(-1) >= 0.5).sum())
    bound = Bound(kl=kl * 1.01, top1=0.0, entropy=0.5)
    assert a.problems(bound) == []
    assert [s.split()[0] for s in a.problems(Bound(kl=kl * 0.99, top1=1.0, entropy=0.49))] == ["mean", "top-1", "mean"]
    nan = Agreement.of(ref, np.full_like(ref, np.nan), np.zeros(50), np.zeros(50))
    assert len(nan.problems(Bound(1e9, 0.0, 1e9))) >= 1  # NaN logits never pass


def test_fp16_computes_in_half_but_keeps_io_attention_and_rotary_angles_in_fp32(zoo_files):
    proto = onnx.shape_inference.infer_shapes(onnx.load(str(zoo_files["fp16"])))
    assert metadata.read(proto).precision == "fp16"
    types = {vi.name: vi.type.tensor_type.elem_type for vi in (*proto.graph.value_info, *proto.graph.input)}
    types |= {i.name: i.data_type for i in proto.graph.initializer}
    half, single = onnx.TensorProto.FLOAT16, onnx.TensorProto.FLOAT
    weights = [types[n.input[1]] for n in proto.graph.node if n.op_type == "MatMul" and n.input[1] in types]
    # every projection — q·k·v, o, gate·up, down in each of 4 layers — and the tied head's Transpose
    assert len(weights) == 17 and set(weights) == {half}
    attention = [n for n in proto.graph.node if n.op_type == "SharpAttention"]
    assert len(attention) == 4 and all(types[n.input[i]] == single for n in attention for i in range(3))
    trig = [n for n in proto.graph.node if n.op_type in ("Cos", "Sin")]
    assert trig and all(types[n.input[0]] == single for n in trig)  # angles of 4,000 rad need fp32
    assert {o.type.tensor_type.elem_type for o in proto.graph.output} == {single}  # logits, entropy, presents


def test_bf16_files_round_from_fp32_and_pass_the_checker(tmp_path, capsys):
    import torch

    ties = torch.from_numpy(np.array([0x3F808000, 0x3F818000, 0xBF808000], np.uint32).view(np.float32))
    x = torch.cat([torch.randn(1000) * torch.logspace(-30, 30, 1000), ties])  # exact halves: to the even neighbour
    got = precision._bf16(x.numpy(), "x")
    want = x.to(torch.bfloat16).view(torch.int16).numpy().astype(np.uint16)
    assert np.array_equal(np.frombuffer(got.raw_data, np.uint16), want)  # round to nearest even, as torch does
    out = tmp_path / "zoo-bf16.onnx"
    assert export_main([str(ZOO), "-o", str(out), "--weights", "bf16", "--no-check"]) == 0
    onnx.checker.check_model(str(out), full_check=True)
    proto = onnx.load(str(out))
    assert metadata.read(proto).precision == "bf16"
    kinds = {i.data_type for i in proto.graph.initializer if len(i.dims) == 2}
    assert onnx.TensorProto.BFLOAT16 in kinds and onnx.TensorProto.FLOAT16 not in kinds


def test_the_bounds_are_the_documented_ones():
    """docs/op.md's precision table is the code's BOUNDS (a bound widened in one place fails here)."""
    text = (DOCS / "op.md").read_text()
    for weights, b in BOUNDS.items():
        row = re.search(rf"^\| {weights} \|([^\n]+)$", text, re.M)
        assert row, f"docs/op.md has no precision row for {weights}"
        cells = [c.strip() for c in row.group(1).split("|")]
        assert cells[:3] == [f"≤ {b.kl:g}", f"≥ {b.top1:.0%}", f"≤ {b.entropy:g}"], cells


def test_precision_mistakes_exit_2_with_one_line(tmp_path, capsys):
    out = tmp_path / "x.onnx"
    for args, says in (
        (["--weights", "int4", "--tensorrt"], "TensorRT cannot parse"),
        (["--weights", "fp16", "--tensorrt"], "TensorRT files are fp32"),
        (["--weights", "bf16"], "add --no-check to write it unchecked"),
        (["--weights", "int8", "--quant-block", "24"], "power of two >= 16"),
        (["--weights", "int4", "--quant-block", "8"], "power of two >= 16"),
        (["--quant-block", "64"], "--weights fp32 has none"),
    ):
        assert export_main([str(ZOO), "-o", str(out), *args]) == 2, args
        err = capsys.readouterr().err.strip()
        assert says in err and len(err.splitlines()) == 1, err
    assert not out.exists()
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Relu", ["x"], ["y"])],
        "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2])],
    )
    with pytest.raises(PrecisionError, match="no MatMul with a constant weight"):
        quantize(onnx.helper.make_model(graph), "int4")


def test_int4_serves_and_its_genai_package_generates_the_same_greedy_tokens(zoo_files, tmp_path):
    og = pytest.importorskip("onnxruntime_genai", reason="the genai extra (onnxruntime-genai) is not installed")
    package = tmp_path / "zoo-int4-genai"
    assert export_main([str(ZOO), "--genai", "--weights", "int4", "-o", str(package)]) == 0
    assert metadata.read(onnx.load(str(package / "model.onnx"))).precision == "int4"
    assert json.loads((package / "genai_config.json").read_text())["model"]["type"] == "decoder"
    be = load_backend(zoo_files["int4"], "onnxruntime")
    engine = Engine(be, EngineConfig(), ServingMetrics(be.spec, entropy="off"))
    with BackgroundServer(engine, ServerConfig(port=0, metrics_port=None)) as srv, Client(srv.target) as c:
        info = c.info()
        assert info.precision == "int4" and not info.attention.startswith("attention")
        prompt = "class Queue:\n    def "
        ids = c.tokenize(prompt, add_bos=False)
        served = list(c.generate(prompt, max_new_tokens=24, temperature=0).token_ids)
    model = og.Model(str(package))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=1 + len(ids) + 24, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens([256, *ids])  # the BOS sharp-serve prepends
    got = []
    while not generator.is_done():
        generator.generate_next_token()
        got.append(int(generator.get_next_tokens()[0]))
    assert got == served and len(set(served)) > 3
