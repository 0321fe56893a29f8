"""The TensorRT plugin without TensorRT: registered against a stand-in of the `tensorrt.plugin` decorator API that
records what would be registered, and the exact PTX entry, launch parameters and argument order that `aot_impl`
returns are launched (as the same Triton function, in the interpreter) on real inputs against the reference.

What only TensorRT can show — that it accepts the registration and loads the PTX — is not verified here
(docs/tensorrt.md)."""

# No `from __future__ import annotations` here: the stand-in reads annotation objects, as TensorRT's module does.
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from devices import DEVICE

from sharp.models import NORMS, attend
from sharp.plugins.tensorrt import PLUGIN_NAME, KernelManifest, TensorRTUnavailable, import_tensorrt, register
from sharp.plugins.tensorrt.plugin import EXTRAS, float_bits
from sharp.plugins.tensorrt.standin import TRT, Registry, Sym, TensorDesc

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.fixture(scope="module")
def manifest_dir(tmp_path_factory):
    """The TensorRT entry points compiled ahead of time for sm_90 (fp16, head dim 64), as a user would."""
    out = tmp_path_factory.mktemp("trt-kernels")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "sharp.plugins.triton.aot", "--out", str(out), "--dtype", "fp16", "--head-dim", "64"],
        capture_output=True, text=True, env=env, timeout=600, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


@pytest.fixture(scope="module")
def plugin(manifest_dir):
    standin = Registry()
    manifest = register(manifest_dir, trt=TRT, trtp=standin.trtp())
    return standin, manifest


def test_the_plugin_module_imports_without_tensorrt():
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        with pytest.raises(TensorRTUnavailable, match=r"TensorRT >= 10\.10"):
            import_tensorrt()
    else:  # pragma: no cover - only where TensorRT is installed
        pytest.fail("this suite expects no TensorRT; the real registration is in docs/tensorrt.md")


@pytest.mark.compile  # needs the AOT-compiled kernels (manifest_dir)
def test_registration_descriptors_and_type_combinations(plugin):
    standin, manifest = plugin
    assert set(standin.registered) == {("register", PLUGIN_NAME), ("autotune", PLUGIN_NAME), ("aot_impl", PLUGIN_NAME)}
    q = TensorDesc("float16", (Sym.named("B"), Sym.of(4), Sym.named("LQ"), Sym.of(64)))
    k = TensorDesc("float16", (Sym.named("B"), Sym.of(2), Sym.named("LK"), Sym.of(64)))
    describe = standin.registered[("register", PLUGIN_NAME)]
    out, ent = describe(q, k, k, None, None, None, "ssa", 1, 0.125, 4, 2, np.zeros(0, np.float32))
    env = {"B": 3, "LQ": 17, "LK": 40}
    assert out.dtype == "float16" and [s(env) for s in out.shape_expr] == [3, 4, 17, 64]
    assert ent.dtype == "float32" and [s(env) for s in ent.shape_expr] == [3, 4, 17]  # docs/op.md output 1
    combos = standin.registered[("autotune", PLUGIN_NAME)](q, k, k, None, None, None, (out, ent))
    assert [c.spec for c in combos] == ["FP16, FP16, FP16, INT32, FP32, FP32, FP16, FP32"]
    # every norm of the registry has a compiled variant, causal or not
    for norm in NORMS:
        for causal in (False, True):
            assert manifest.find(norm, "fp16", 64, causal)["kernel"].startswith("trt_")


def test_the_stand_in_refuses_signatures_tensorrt_refuses():
    """The stand-in is the instrument the plugin is tested with, so its signature checks must bite: an autotune
    returning a bare `list`, an aot_impl without a return annotation or with its arguments out of order, an
    attribute annotated differently, attributes before tensors."""
    from sharp.plugins.tensorrt.standin import LaunchParams, SignatureError, SymExprs

    trtp = Registry().trtp()

    @trtp.register("t::ok")
    def describe(x: TensorDesc, n: int) -> tuple[TensorDesc]:
        return (x.like(),)

    def autotune_bare(x, n, outputs) -> list:
        return []

    def aot_unannotated(x, n, outputs, tactic):
        return b"", b"", LaunchParams(), SymExprs()

    def aot_misordered(x, outputs, n, tactic) -> tuple[bytes, bytes, LaunchParams, SymExprs]:
        return b"", b"", LaunchParams(), SymExprs()

    def aot_float_attr(x, n: float, outputs, tactic) -> tuple[bytes, bytes, LaunchParams, SymExprs]:
        return b"", b"", LaunchParams(), SymExprs()

    for decorator, fn in ((trtp.autotune, autotune_bare), (trtp.aot_impl, aot_unannotated),
                          (trtp.aot_impl, aot_misordered), (trtp.aot_impl, aot_float_attr)):  # fmt: skip
        with pytest.raises(SignatureError):
            decorator("t::ok")(fn)

    def attrs_first(n: int, x: TensorDesc) -> TensorDesc:
        return x

    with pytest.raises(SignatureError, match="before the attributes"):
        trtp.register("t::bad")(attrs_first)


@pytest.mark.compile  # needs the AOT-compiled kernels (manifest_dir)
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("causal", [False, True])
def test_aot_impl_hands_over_a_launch_that_computes_the_op(plugin, norm, causal):
    """The PTX entry and bytes, the grid/block/shared memory and the extras come back as the manifest says, and
    launching the same Triton function with exactly TensorRT's argument order — inputs, extras evaluated for the
    runtime shapes, outputs — gives `attend`'s output and entropy (GQA 4:2, left padding, 2 query blocks)."""
    from sharp.plugins.tensorrt.launch_check import aot_launch, tensorrt_form_inputs
    from sharp.plugins.triton import kernels

    standin, manifest = plugin
    inputs, ref = tensorrt_form_inputs(norm, 2, 4, 2, 70, 100, 64, torch.float16, DEVICE, seed=len(norm) + causal)
    launch = aot_launch(standin, manifest, norm, causal, inputs, kv_heads=2, scale=64**-0.5)
    entry = launch.entry
    assert entry is manifest.find(norm, "fp16", 64, causal)
    assert launch.name == entry["entry"].encode() and f".entry {entry['entry']}(".encode() in launch.ptx
    assert launch.ptx == (manifest.directory / f"{entry['variant']}.ptx").read_bytes()
    assert launch.block == entry["launch"]["block"][0] and launch.shared == entry["launch"]["shared_bytes"]
    assert launch.grid == (2, 8, 1)  # ⌈70/64⌉ query blocks × B·Hq
    extras = launch.arguments[len(inputs) : len(inputs) + len(EXTRAS)]
    assert extras[EXTRAS.index("scale_bits")] == float_bits(64**-0.5) and extras[EXTRAS.index("LK")] == 100
    # TensorRT's order — inputs, extras, outputs — into the same Triton function, in the interpreter
    kernels.KERNELS[entry["kernel"]][launch.grid](*launch.arguments, **entry["constexprs"])
    o_ref, h_ref = attend(*(inputs[n].float() for n in "QKV"), causal=causal, return_entropy=True, **ref)
    torch.testing.assert_close(launch.out.float(), o_ref, atol=2e-3, rtol=0)
    torch.testing.assert_close(launch.entropy, h_ref, atol=2e-3, rtol=0)


@pytest.mark.compile  # needs the AOT-compiled kernels (manifest_dir)
def test_the_tensorrt_entmax_entry_settles_in_three_threshold_passes(plugin):
    """The TensorRT form's threshold search is the torch path's: seeded (`_seed`) and stepping to its class model's
    root. Its output after at most 3 threshold passes per program is its output with the pass cap it launches with,
    bit for bit (causal, α = 1.5 and 2.5, logits of σ = 1, a left-padded row; fp16 in the interpreter) — where the
    form's earlier search, unseeded and without the model, took up to 4 passes at α = 1.5 and 10 at 2.5 on such rows
    (N(0, 1) logits, 1,024 tokens: 3.72 / 4 and 8.28 / 10 per program)."""
    from sharp.models.streamed import MAX_THRESHOLD_PASSES
    from sharp.plugins.tensorrt.launch_check import aot_launch, tensorrt_form_inputs
    from sharp.plugins.triton import kernels

    standin, manifest = plugin
    inputs, _ = tensorrt_form_inputs("entmax", 2, 2, 2, 128, 128, 64, torch.float16, DEVICE, seed=3)
    inputs["PARAMS"][:4] = torch.tensor([0.0, 0.0, 1.5, 2.5])  # ALiBi slopes, then α, per head (PACKED_HEAD_PARAMS)
    launch = aot_launch(standin, manifest, "entmax", True, inputs, kv_heads=2, scale=64**-0.5)
    fn = kernels.KERNELS[launch.entry["kernel"]]
    cap = fn.arg_names.index("max_passes")
    outputs = []
    for passes in (3, MAX_THRESHOLD_PASSES):
        args = [*launch.arguments[:cap], passes, *launch.arguments[cap + 1 :]]
        fn[launch.grid](*args, **launch.entry["constexprs"])
        outputs.append((launch.out.clone(), launch.entropy.clone()))
    assert MAX_THRESHOLD_PASSES > 3
    assert torch.equal(outputs[0][0], outputs[1][0]) and torch.equal(outputs[0][1], outputs[1][1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_launch_checks_output_tolerance_is_the_rounding_bound(dtype):
    """The GPU check's bound on the output is what a kernel's rounding can cost — weights rounded to V's dtype before
    P·V, the output rounded to it — and a defect such as a lost causal mask lies far outside it."""
    from sharp.models.normalizers import entmax
    from sharp.plugins.tensorrt.launch_check import output_tolerance

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 256, 64, generator=g).to(dtype) for _ in range(3))
    logits = (q.float() @ k.float().transpose(-1, -2)) * 64**-0.5
    causal = torch.ones(256, 256, dtype=torch.bool).tril()
    for p in (
        torch.softmax(logits.masked_fill(~causal, float("-inf")), -1),
        entmax(logits.masked_fill(~causal, float("-inf")), alpha=1.5),
    ):
        exact = p @ v.float()
        rounded = (p.to(dtype).float() @ v.float()).to(dtype).float()
        assert 0 < (rounded - exact).abs().max() <= output_tolerance(v)
    unmasked = torch.softmax(logits, -1) @ v.float()
    assert (
        unmasked - torch.softmax(logits.masked_fill(~causal, float("-inf")), -1) @ v.float()
    ).abs().max() > 10 * output_tolerance(v)


@pytest.mark.compile  # needs the AOT-compiled kernels (manifest_dir)
def test_the_gpu_launch_check_needs_a_gpu(manifest_dir, capsys):
    """What verifies the PTX launch on a GPU (docs/tensorrt.md) says so and exits 2 where there is none."""
    from sharp.plugins.tensorrt.launch_check import main

    if torch.cuda.is_available():  # pragma: no cover - on a GPU it runs the real check
        assert main(["--kernels", str(manifest_dir), "--lengths", "300"]) == 0
    else:
        assert main(["--kernels", str(manifest_dir)]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.compile  # needs the AOT-compiled kernels (manifest_dir)
def test_aot_impl_refuses_what_was_not_compiled(plugin):
    standin, _ = plugin
    aot_impl = standin.registered[("aot_impl", PLUGIN_NAME)]
    empty = np.zeros(0, np.float32)
    for dtype, d, why in (("float16", 128, "head_dim=128"), ("float32", 64, "dtype=fp32")):
        q = TensorDesc(dtype, (Sym.named("B"), Sym.of(4), Sym.named("LQ"), Sym.of(d)))
        with pytest.raises(LookupError, match=why):
            aot_impl(q, q, q, None, None, None, "softmax", 1, 0.1, 4, 4, empty, (), 0)
    q = TensorDesc("float16", (Sym.named("B"), Sym.of(4), Sym.named("LQ"), Sym.named("D")))
    with pytest.raises(ValueError, match=r"head dim .* must be fixed"):
        aot_impl(q, q, q, None, None, None, "softmax", 1, 0.1, 4, 4, empty, (), 0)


@pytest.mark.compile  # needs the AOT-compiled kernels (manifest_dir)
def test_a_manifest_in_another_argument_order_is_refused(manifest_dir, tmp_path):
    entries = json.loads((manifest_dir / "manifest.json").read_text())
    entries[0]["launch"]["arguments"][3:5] = entries[0]["launch"]["arguments"][4:2:-1]
    (tmp_path / "manifest.json").write_text(json.dumps(entries))
    with pytest.raises(ValueError, match="not TensorRT's order"):
        KernelManifest.load(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"sharp\.plugins\.triton\.aot"):
        KernelManifest.load(tmp_path / "missing")


@pytest.mark.compile  # needs the AOT-compiled kernels (manifest_dir)
def test_compiled_variants_move_tiles_with_vector_and_async_copies_and_never_spill(manifest_dir):
    """Head dim compile-time, contiguous layouts, 16-byte aligned pointers: no scalar 2-byte global loads (the
    v1 kernels issued 192 per tile), cp.async tiles, no local memory in the PTX, and no ptxas spill inside a key loop
    (SASS). Outside them the entmax entry points keep a few registers on the stack (the causal ones: the class model's
    per-row search, once per threshold pass); the softmax family none."""
    import triton

    from sharp.benchmarks import sass
    from sharp.plugins.triton.aot import default_ptx_version

    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    cuobjdump, nvdisasm = (os.path.join(bin_dir, tool) for tool in ("cuobjdump", "nvdisasm"))
    entries = json.loads((manifest_dir / "manifest.json").read_text())
    assert len(entries) == 12  # 6 entry variants (softmax, ssmax, ssa, adaptive, entmax, asentmax) × causal
    want = "{}.{}".format(*divmod(default_ptx_version(90), 10))  # 9.0 under Triton 3.9, 8.7 under 3.6
    for e in entries:
        ptx = (manifest_dir / f"{e['variant']}.ptx").read_text()
        assert f".version {want}\n" in ptx and e["launch"]["pointer_alignment"] == 16
        assert "ld.global.b16" not in ptx and "ld.global.u16" not in ptx, e["variant"]
        assert "cp.async" in ptx and "ld.global.v4" in ptx, e["variant"]
        assert "local_depot" not in ptx, e["variant"]
        cubin = (manifest_dir / f"{e['variant']}.cubin").read_bytes()
        usage = subprocess.run([cuobjdump, "--dump-resource-usage", str(manifest_dir / f"{e['variant']}.cubin")],
                               capture_output=True, text=True, check=True).stdout  # fmt: skip
        assert " LOCAL:0 " in usage, (e["variant"], usage)
        loops = sass.key_loops(sass.loops(*sass.parse(sass.disassemble(cubin, nvdisasm))))
        assert loops and all(lp.spills() == 0 for lp in loops), (e["variant"], [lp.spills() for lp in loops])
        if e["kernel"] != "trt_entmax":
            assert " STACK:0 " in usage, (e["variant"], usage)


# ---- sharp-export --tensorrt ----------------------------------------------------------------------------------------
NORM_POS = [("softmax", "rope"), ("adaptive", "rope"), ("ssmax", "alibi"), ("entmax", "nape"), ("asentmax", "nape"),
            ("ssa", "rope")]  # fmt: skip


def _trt_model(norm: str, pos: str):
    from sharp.models import ModelConfig, SharpLM

    torch.manual_seed(0)  # head dim 64: the compiled fp16 variants of the fixture
    cfg = ModelConfig(dim=128, layers=2, heads=2, kv_heads=1, norm=norm, pos=pos, context_length=128)
    model = SharpLM(cfg).eval()
    with torch.no_grad():  # parameters off their init, different per head, so a wrong slot would show
        for name, p in model.named_parameters():
            if name.endswith(("alpha_raw", "ssa_n_raw", "ssa_b_raw", "ssmax_s")):
                p.add_(torch.linspace(-0.3, 0.3, p.numel()))
            if name.endswith(("q_proj.weight", "k_proj.weight")):  # logits of a few units, not ≈ 0: SSA's
                p.mul_(4.0)  # n·log(1 + b|z|) ≈ n·b·z near 0 would not tell n from b
    return model


def _export_trt(tmp_path, model, *args: str):
    from sharp.exporter.cli import main
    from sharp.models import save

    ckpt = save(model, tmp_path / "model.pt")
    out = tmp_path / "model.trt.onnx"
    assert main([str(ckpt), "-o", str(out), "--tensorrt", *args]) == 0
    return out


@pytest.mark.parametrize(("norm", "pos"), NORM_POS)
def test_tensorrt_form_nodes_are_what_the_parser_maps_to_the_plugin_and_run_through_their_fallback(
    tmp_path, norm, pos, capsys
):
    import onnx

    from sharp.exporter import metadata
    from sharp.exporter.check import sharplm_reference, verify

    model = _trt_model(norm, pos)
    out = _export_trt(tmp_path, model)
    assert "TensorRT form" in capsys.readouterr().out  # and the CLI's own check passed (exit 0)
    proto = onnx.load(out)
    assert proto.ir_version <= 10 and {o.domain: o.version for o in proto.opset_import}[""] == 18
    producers = {o for n in proto.graph.node for o in n.output}
    kinds = {n.output[0]: n for n in proto.graph.node}
    ops = [n for n in proto.graph.node if n.domain == "sharp"]
    assert len(ops) == 2
    for node in ops:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert node.op_type == "SharpAttention" and attrs["plugin_namespace"] == b"sharp" and attrs["aot"] == 1
        assert set(attrs) == {"plugin_namespace", "aot", "norm", "causal", "scale", "q_heads", "kv_heads", "poly"}
        assert attrs["norm"] == norm.encode() and node.overload == f"tensorrt.{norm}"
        assert len(node.input) == 6 and all(node.input)  # no empty (optional) plugin inputs
        cast = kinds[node.input[3]]
        assert cast.op_type == "Cast" and onnx.helper.get_attribute_value(cast.attribute[0]) == onnx.TensorProto.INT32
        assert kinds[node.input[4]].op_type == "Concat" and len(kinds[node.input[4]].input) == 6
        assert node.input[5] in producers or node.input[5] in {i.name for i in proto.graph.initializer}
    assert metadata.read(proto).export["tensorrt"] is True
    # the file runs in a fresh onnxruntime session through the form's fallback bodies and matches PyTorch
    for _, d_logits, d_entropy in verify(out, model.cfg.shape, True, sharplm_reference(model)):
        assert d_logits < 1e-4 and d_entropy < 1e-4


@pytest.mark.compile  # needs the AOT-compiled kernels (manifest_dir)
@pytest.mark.parametrize(("norm", "pos"), [n for n in NORM_POS if n[0] != "softmax"])
def test_the_plugin_computes_the_exported_layer_from_the_files_own_tensors(plugin, tmp_path, norm, pos):
    """Everything but TensorRT, end to end: the TensorRT-form file's layer-0 plugin inputs (as its own graph
    computes them in onnxruntime), the plugin's aot_impl for those shapes and attributes, and the compiled variant's
    Triton function launched with TensorRT's argument order (fp16, in the interpreter) give the layer's output."""
    import onnx
    import onnxruntime as ort

    from sharp.plugins.triton import kernels

    standin, _ = plugin
    out = _export_trt(tmp_path, _trt_model(norm, pos), "--no-check")
    proto = onnx.load(out)
    node = next(n for n in proto.graph.node if n.domain == "sharp")
    del proto.graph.output[:]  # expose the plugin node's inputs and outputs
    proto.graph.output.extend(onnx.helper.make_empty_tensor_value_info(n) for n in [*node.input, *node.output])
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    b, length = 2, 37
    feeds = {
        "input_ids": np.random.default_rng(0).integers(0, 258, (b, length)).astype(np.int64),
        "attention_mask": np.ones((b, length), np.int64),
        "position_ids": np.tile(np.arange(length), (b, 1)),
    }
    feeds["attention_mask"][1, :5] = 0  # a left-padded row
    for i in sess.get_inputs():
        if i.name.startswith("past_key_values"):
            feeds[i.name] = np.zeros((b, 1, 0, 64), np.float32)
    values = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds), strict=True))
    q, k, v, mask, params, qscale = (torch.from_numpy(values[n]).to(DEVICE) for n in node.input)
    o_ref, h_ref = (torch.from_numpy(values[n]).to(DEVICE) for n in node.output)
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}

    def shape(t):  # static shapes: every dim known
        return tuple(Sym.of(s) for s in t.shape)

    name, _, launch, extras = standin.registered[("aot_impl", PLUGIN_NAME)](
        TensorDesc("float16", shape(q)), TensorDesc("float16", shape(k)), None, None, None, None,
        attrs["norm"].decode(), attrs["causal"], attrs["scale"], attrs["q_heads"], attrs["kv_heads"],
        np.asarray(attrs["poly"], np.float32), (), 0,
    )  # fmt: skip
    entry = next(e for e in plugin[1].entries if e["entry"].encode() == name and attrs["norm"].decode() in e["norms"]
                 and e["constexprs"]["CAUSAL"] == bool(attrs["causal"]))  # fmt: skip
    grid = tuple(Sym.of(g)({}) for g in (launch.grid_x, launch.grid_y, launch.grid_z))
    o = torch.zeros(q.shape, dtype=torch.float16, device=DEVICE)
    h = torch.zeros(q.shape[:3], device=DEVICE)
    args = [q.half(), k.half(), v.half(), mask, params, qscale, *(Sym.of(e)({}) for e in extras), o, h]
    kernels.KERNELS[entry["kernel"]][grid](*args, **entry["constexprs"])
    assert mask.dtype == torch.int32 and params.dtype == torch.float32
    torch.testing.assert_close(o.float(), o_ref, atol=5e-3, rtol=0)
    torch.testing.assert_close(h, h_ref, atol=5e-3, rtol=0)


def test_tensorrt_form_without_fallback_bodies_and_refused_combinations(tmp_path, capsys):
    import onnx

    from sharp.exporter.cli import main
    from sharp.models import save

    out = _export_trt(tmp_path, _trt_model("ssa", "rope"), "--fallback", "none")
    proto = onnx.load(out)
    assert not [f for f in proto.functions if f.domain.startswith("sharp")]
    onnx.checker.check_model(proto, full_check=True)
    ckpt = save(_trt_model("ssa", "rope"), tmp_path / "m2.pt")
    assert main([str(ckpt), "--tensorrt", "--genai", "-o", str(tmp_path / "pkg")]) == 2
    assert "--tensorrt files are for TensorRT" in capsys.readouterr().err


# ---- sharp-build-engine and sharp-serve --backend tensorrt: everything before TensorRT itself ----------------------
@pytest.fixture(scope="module")
def trt_file(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trt-file")
    return _export_trt(tmp, _trt_model("ssmax", "alibi"), "--no-check")


@pytest.mark.compile  # needs the AOT-compiled kernels (manifest_dir)
def test_build_engine_checks_everything_before_needing_tensorrt(trt_file, manifest_dir, tmp_path, capsys):
    from sharp.exporter.build_engine import main

    plan = tmp_path / "model.plan"
    std = tmp_path / "standard.onnx"
    from sharp.exporter.cli import main as export_main
    from sharp.models import save

    assert export_main([str(save(_trt_model("ssa", "rope"), tmp_path / "m.pt")), "-o", str(std), "--no-check"]) == 0
    (tmp_path / "junk.onnx").write_bytes(b"not onnx")
    cases = [
        ([str(tmp_path / "missing.onnx"), "-o", str(plan)], "no such file"),
        ([str(tmp_path / "junk.onnx"), "-o", str(plan)], "not an ONNX file"),
        ([str(std), "-o", str(plan), "--kernels", str(manifest_dir)], "re-export with `sharp-export MODEL --tensorrt`"),
        ([str(trt_file), "-o", str(trt_file), "--kernels", str(manifest_dir)], "is the input"),
        ([str(trt_file), "-o", str(plan), "--kernels", str(tmp_path / "none")], "manifest.json not found"),
        ([str(trt_file), "-o", str(plan), "--kernels", str(manifest_dir), "--bf16"], "dtype=bf16"),
        ([str(trt_file), "-o", str(plan), "--kernels", str(manifest_dir), "--max-context", "4096"], "--max-context"),
        ([str(trt_file), "-o", str(plan), "--kernels", str(manifest_dir), "--max-batch", "0"], "--max-batch"),
        ([str(trt_file), "-o", str(plan), "--fp16", "--bf16"], "not allowed with"),
        # a valid request: every check passes, and only then is TensorRT needed
        ([str(trt_file), "-o", str(plan), "--kernels", str(manifest_dir)], "TensorRT is not installed"),
    ]
    for argv, message in cases:
        try:
            code = main(argv)
        except SystemExit as e:  # argparse's own errors (one line too)
            code = e.code
        assert code == 2, (argv, code)
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, (argv, err)
    assert not plan.exists()


def test_optimization_profiles_cover_the_generation_graph(trt_file):
    import onnx

    from sharp.exporter import metadata
    from sharp.exporter.build_engine import PROFILES, profile_for, profiles

    proto = onnx.load(trt_file)
    meta = metadata.read(proto)
    ranges = profiles(meta, max_batch=8, max_context=128)
    assert list(ranges) == list(PROFILES)
    assert profile_for(37, 0) == 0 and profile_for(1, 17) == 1 and profile_for(5, 40) == 0  # a later prefill chunk
    for graph_input in proto.graph.input:
        rank = len(graph_input.type.tensor_type.shape.dim)
        for dims in ranges.values():
            d = dims["past" if graph_input.name.startswith("past_key_values.") else graph_input.name]
            assert len(d.min) == len(d.opt) == len(d.max) == rank
            assert all(a <= b <= c for a, b, c in zip(d.min, d.opt, d.max, strict=True))
    prefill, decode = ranges["prefill"], ranges["decode"]
    assert prefill["past"].min[2] == 0 and prefill["past"].max[2] == 127 and prefill["input_ids"].max == (8, 128)
    assert decode["input_ids"].max == (8, 1) and decode["past"].max[2] == 127
    assert decode["attention_mask"].min[1] == decode["past"].min[2] + 1  # mask covers past + the new token
    assert decode["attention_mask"].max[1] == decode["past"].max[2] + 1


def test_serving_an_engine_needs_its_metadata_then_tensorrt(trt_file, tmp_path, capsys):
    import onnx

    from sharp.exporter.metadata import plan_metadata_path, read_plan
    from sharp.serving.cli import serve_main

    plan = tmp_path / "model.plan"
    plan.write_bytes(b"engine bytes")
    assert serve_main([str(plan), "--backend", "tensorrt", "--device", "cuda"]) == 2
    assert "model.plan.json not found beside it" in capsys.readouterr().err
    props = {p.key: p.value for p in onnx.load(trt_file).metadata_props}
    plan_metadata_path(plan).write_text(json.dumps(props))
    assert read_plan(plan).norm == "ssmax"
    assert serve_main([str(plan), "--backend", "tensorrt"]) == 2
    assert "runs on --device cuda" in capsys.readouterr().err
    assert serve_main([str(plan), "--backend", "tensorrt", "--device", "cuda"]) == 2
    assert "TensorRT is not installed" in capsys.readouterr().err


def test_a_tensorrt_form_file_serves_by_default_and_says_how(tmp_path, capsys):
    """What sharp exports runs where sharp says it runs: sharp-serve on a --tensorrt file, native library on by
    default, runs its fallback bodies (the native kernel takes the standard form) and says so, and generates the
    checkpoint's own greedy tokens."""
    from sharp.models.sampling import GREEDY
    from sharp.plugins.onnxruntime import NativeOpUnavailable, library_path
    from sharp.serving import Engine, EngineConfig, load_backend
    from sharp.serving.engine.output import Delta, Finished
    from sharp.serving.requests import GenerationRequest

    try:
        library_path()
    except NativeOpUnavailable as e:  # the case this test is about needs the native library present
        pytest.fail(f"the native onnxruntime library is not built here: {e}")
    model = _trt_model("ssa", "rope")
    out = _export_trt(tmp_path, model)
    assert "TensorRT-form file; the native kernel takes the standard form" in capsys.readouterr().out
    be = load_backend(out, "onnxruntime")
    assert "fallback bodies (a TensorRT-form file" in be.attention
    engine = Engine(be, EngineConfig())
    got, done = [], []
    prompt = (1, 17, 42, 5)
    request = GenerationRequest(prompt, 8, GREEDY, seed=0, stop=(), attention_stats=False, request_id="trt")
    engine.submit(request, lambda ev: got.extend(ev.token_ids) if isinstance(ev, Delta) else done.append(ev))
    for _ in range(100):
        if engine.idle():
            break
        engine.step()
    assert isinstance(done[0], Finished) and got == model.generate(list(prompt), 8, GREEDY)
