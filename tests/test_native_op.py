"""The native sharp::SharpAttention library for ONNX Runtime (plugins/onnxruntime): parity with the PyTorch
reference and with the fallback bodies in the same file, for every norm; thread-count independence; edge rows;
proof that the kernel (not the body) ran; errors that name the input; a `--fallback none` file served end to end.

`make install` builds the library; without it these tests skip with the build's reason, except under CI=true,
where a missing library is a failure.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import platform
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from sharp.exporter import fallback
from sharp.exporter.export import ExportSettings, export_model
from sharp.exporter.op_schema import OP_INPUTS
from sharp.models import attend, load, registry
from sharp.models.normalizers import PAPER_POLY
from sharp.models.tokenizer import ByteTokenizer
from sharp.plugins.onnxruntime import NativeOpUnavailable, library_path, norm_table
from sharp.serving import BackgroundServer, Client, Engine, EngineConfig, ServerConfig, ServingMetrics, load_backend
from sharp.serving.backends.interface import BackendError

Tokenizer = ByteTokenizer()


@pytest.fixture(scope="module")
def library() -> str:
    """The built library, or $SHARP_ORT_OP_LIBRARY (e.g. a sanitizer build: build.py --sanitize)."""
    try:
        return os.environ.get("SHARP_ORT_OP_LIBRARY") or library_path()
    except NativeOpUnavailable as e:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must build the native op: {e}")
        pytest.skip(str(e))


# Shapes spanning several query tiles (64 rows) and key blocks (64 keys), with a KV cache (Lq < Lk), GQA and a
# left-padded second sequence.
B, HQ, HKV, D = 2, 4, 2, 16
LQ, LK = 70, 150


def one_op_model(norm: str, causal: bool, fallback_mode: str | None = "dense", inputs=OP_INPUTS, **attrs) -> bytes:
    attrs = dict(norm=norm, causal=int(causal), scale=D**-0.5, poly=list(PAPER_POLY), q_heads=HQ, kv_heads=HKV) | attrs
    if fallback_mode == "streamed":
        attrs["block_size"] = 32
    node = helper.make_node("SharpAttention", list(inputs), ["O", "entropy"], domain="sharp", **attrs)
    node.overload = norm
    kinds = {"key_mask": TensorProto.BOOL}
    graph_inputs = [helper.make_tensor_value_info(n, kinds.get(n, TensorProto.FLOAT), None) for n in inputs if n]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("O", "entropy")]
    functions = fallback.functions([registry.get(norm)], fallback_mode) if fallback_mode else []
    model = helper.make_model(
        helper.make_graph([node], "one_op", graph_inputs, outputs),
        opset_imports=[helper.make_opsetid(d, v) for d, v in (("", 18), ("sharp", 1), ("sharp.fallback", 1))],
        functions=functions,
        ir_version=10,
    )
    return model.SerializeToString()


def session(model: bytes, library: str | None, threads: int = 2, profile: Path | None = None):
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.intra_op_num_threads = threads
    if library:
        opts.register_custom_ops_library(library)
    if profile is not None:
        opts.enable_profiling = True
        opts.profile_file_prefix = str(profile)
    return ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])


def inputs(seed: int = 0, lq: int = LQ, lk: int = LK, spread: float = 2.0) -> dict[str, np.ndarray]:
    g = torch.Generator().manual_seed(seed)
    key_mask = torch.ones(B, lk, dtype=torch.bool)
    key_mask[1, : lk // 3] = False  # the second sequence is left-padded
    x = {
        "Q": torch.randn(B, HQ, lq, D, generator=g) * spread,
        "K": torch.randn(B, HKV, lk, D, generator=g) * spread,
        "V": torch.randn(B, HKV, lk, D, generator=g),
        "key_mask": key_mask,
        "alibi_slopes": torch.tensor([0.5, 0.25, 0.0, 0.0]),
        # Halley with the general power (1.2), the α = 1.5 and α = 2 fast paths, Newton with the general power
        # (1.7). α ≥ 3 is left out: a near-tie row there is ill-conditioned in float32 (docs/op.md).
        "alpha": torch.tensor([1.2, 1.5, 2.0, 1.7]),
        "query_scale": torch.rand(B, HQ, lq, generator=g) + 0.5,
        "ssa_n": torch.tensor([1.0, 1.3, 1.7, 2.0]),
        "ssa_b": torch.tensor([0.5, 1.0, 1.5, 2.0]),
        "ssmax_s": torch.tensor([0.5, 1.0, 1.5, 0.8]),
    }
    return {k: v.numpy() for k, v in x.items()}


def torch_reference(norm: registry.Norm, x: dict[str, np.ndarray], causal: bool) -> tuple[np.ndarray, np.ndarray]:
    """attend(impl="reference") in float64: the oracle both fp32 implementations are held to."""
    t = {k: torch.from_numpy(v).double() if v.dtype == np.float32 else torch.from_numpy(v) for k, v in x.items()}
    out, ent = attend(
        t["Q"],
        t["K"],
        t["V"],
        norm=norm.name,
        causal=causal,
        key_mask=t["key_mask"],
        alibi_slopes=t["alibi_slopes"],
        query_scale=t["query_scale"] if norm.query_scale else None,
        return_entropy=True,
        **{p: t[p] for p in norm.param_names},
    )
    return out.numpy(), ent.numpy()


def test_the_committed_norm_table_is_the_registry():
    committed = (Path(norm_table.__file__).parent / "norm_table.h").read_text()
    assert committed == norm_table.header(), "regenerate: python -m sharp.plugins.onnxruntime.norm_table"


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("norm", registry.all_norms(), ids=lambda n: n.name)
def test_native_matches_reference_and_both_bodies(library, norm, causal):
    x = inputs()
    o_ref, h_ref = torch_reference(norm, x, causal)
    o_nat, h_nat = session(one_op_model(norm.name, causal), library).run(None, x)
    np.testing.assert_allclose(o_nat, o_ref, atol=2e-5, rtol=0)
    np.testing.assert_allclose(h_nat, h_ref, atol=2e-5, rtol=0)
    for mode in fallback.MODES:  # the bodies of the same file, run by stock onnxruntime, held to the same oracle
        o_body, h_body = session(one_op_model(norm.name, causal, mode), None).run(None, x)
        np.testing.assert_allclose(o_body, o_ref, atol=2e-5, rtol=0)
        np.testing.assert_allclose(h_body, h_ref, atol=2e-5, rtol=0)
    assert np.abs(o_nat).max() > 0.1  # a real output, not zeros


@pytest.mark.compile  # three builds of the library: make test-compile
@pytest.mark.parametrize("march", ["x86-64", "x86-64-v3", "x86-64-v4"])
def test_builds_for_other_cpus_agree(library, march, tmp_path, monkeypatch):
    """The library built for another -march (SSE2 only; AVX2; AVX-512) runs and agrees with the oracle: Eigen's
    alignment default follows -march, and a mismatch with the kernel's aligned buffers once aborted on CPUs without
    AVX-512."""
    import sharp.plugins.onnxruntime as native
    from sharp.plugins.onnxruntime import build

    if march != "x86-64" and (missing := native.missing_cpu_flags(march)):
        pytest.skip(f"this CPU cannot run {march} code (it lacks {', '.join(sorted(missing))})")
    monkeypatch.setenv("SHARP_NATIVE_MARCH", march)
    built = str(build.build(tmp_path / "libsharp_ort.so"))
    x = inputs(seed=3)
    for norm in registry.all_norms():
        for causal in (True, False):
            o_ref, h_ref = torch_reference(norm, x, causal)
            o, h = session(one_op_model(norm.name, causal, None), built).run(None, x)
            np.testing.assert_allclose(o, o_ref, atol=2e-5, rtol=0)
            np.testing.assert_allclose(h, h_ref, atol=2e-5, rtol=0)
    x, rounded, room = _fp16_case(1, 1100)  # an fp16 cache: each build's own fp16 conversions (SSE2: scalar)
    for norm in ("softmax", "entmax"):
        o_ref = session(one_op_model(norm, True, None), built).run(None, rounded)[0]
        o, _, pk, _ = session(cache_form_model(norm, None, TensorProto.FLOAT16), built).run(None, room)
        np.testing.assert_allclose(o, o_ref, atol=2e-6, rtol=0)
        np.testing.assert_array_equal(pk[:, :, :1100], x["K"].astype(np.float16))


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the x86-64 variants")
def test_the_widest_variant_this_cpu_runs_is_loaded_and_a_wider_one_refused(library, monkeypatch):
    """libsharp_ort.so is built for the x86-64-v2 baseline, libsharp_ort.x86-64-v3.so for AVX2 and
    libsharp_ort.x86-64-v4.so for AVX-512, each naming its ISA in the file; library_path() loads the widest the CPU's
    flags allow (the baseline where they are unreadable or lack AVX2, and always for a package: portable=True); a
    library built for more than the CPU has is refused with the flags it lacks, never loaded (its first AVX2
    instruction would kill the process)."""
    import sharp.plugins.onnxruntime as native
    from sharp.plugins.onnxruntime import build

    base, wide, widest = (build.VARIANTS[f"x86-64-v{n}"] for n in (2, 3, 4))
    assert base == native.LIBRARY and wide.exists() and widest.exists()
    assert [native.library_isa(p) for p in (base, wide, widest)] == ["x86-64-v2", "x86-64-v3", "x86-64-v4"]
    v2 = frozenset(native._ISA_FLAGS["x86-64-v2"])
    v3 = v2 | native._ISA_FLAGS["x86-64-v3"]
    v4 = v3 | native._ISA_FLAGS["x86-64-v4"]
    cases = ((v4, widest), (v4 - {"avx512bw"}, wide), (v4 - {"avx2"}, base), (v3, wide), (v3 - {"avx2"}, base),
             (v2, base), (frozenset(), base))  # fmt: skip
    for flags, chosen in cases:
        monkeypatch.setattr(native, "cpu_flags", lambda flags=flags: flags)
        assert native.library_path() == str(chosen), sorted(flags)
        assert native.library_path(portable=True) == str(base)
    monkeypatch.setattr(native, "cpu_flags", lambda: v3 - {"avx2", "fma"})
    with pytest.raises(native.NativeOpUnavailable, match=r"built for x86-64-v3 and this CPU lacks avx2, fma: use"):
        native.choose_library(library=str(wide))
    assert native.choose_library(library=str(base))[0] == str(base)
    x = inputs(seed=5)  # the variants this CPU runs compute the same attention
    runs = [p for p in (wide, widest) if not native.missing_cpu_flags(native.library_isa(p))]
    for norm in ("ssa", "entmax"):
        o_base, h_base = session(one_op_model(norm, True, None), str(base)).run(None, x)
        for lib in runs:
            o_wide, h_wide = session(one_op_model(norm, True, None), str(lib)).run(None, x)
            np.testing.assert_allclose(o_wide, o_base, atol=2e-5, rtol=0)
            np.testing.assert_allclose(h_wide, h_base, atol=2e-5, rtol=0)


def test_per_key_exp_and_log_are_vectorised(library):
    """The per-key passes run exp and log on Eigen's packets: the library imports no scalar expf (Eigen 3.4 never
    vectorises `select`, and an exp under a select once ran through libm one key at a time — half the prefill).
    Scalar logf and pow remain, once per row and per threshold bracket."""
    import shutil
    import subprocess

    nm = shutil.which("nm")
    assert nm, "binutils' nm is needed to read the library's imports"
    imports = subprocess.run([nm, "-D", "--undefined-only", library], capture_output=True, text=True, check=True).stdout
    names = {line.split()[-1].split("@")[0] for line in imports.splitlines() if line.strip()}
    assert "logf" in names, sorted(names)  # the parse sees libm's imports
    assert {"expf", "exp", "__expf_finite"} & names == set(), sorted(names)


@pytest.mark.parametrize("norm", registry.all_norms(), ids=lambda n: n.name)
def test_a_long_prefill_over_many_tiles_and_blocks(library, norm):
    """600 queries on 600 keys: ten query tiles, ten 64-key blocks, causal, left padding in the second row."""
    x = inputs(seed=10, lq=600, lk=600)
    o_ref, h_ref = torch_reference(norm, x, True)
    o_nat, h_nat = session(one_op_model(norm.name, True, None), library).run(None, x)
    np.testing.assert_allclose(o_nat, o_ref, atol=2e-5, rtol=0)
    np.testing.assert_allclose(h_nat, h_ref, atol=2e-5, rtol=0)


@pytest.mark.parametrize("norm", registry.all_norms(), ids=lambda n: n.name)
def test_decode_rows_of_a_gqa_group_over_many_key_blocks(library, norm):
    """1 and 3 new queries (a GQA group's 2 and 6 rows: the kernel's per-row matrix-vector path, 512 keys a pass)
    and 5 (10 rows: its GEMM) against 1,100 keys — three passes, the last partial — with left padding."""
    for lq in (1, 3, 5):
        x = inputs(seed=20 + lq, lq=lq, lk=1100)
        o_ref, h_ref = torch_reference(norm, x, True)
        o_nat, h_nat = session(one_op_model(norm.name, True, None), library).run(None, x)
        np.testing.assert_allclose(o_nat, o_ref, atol=2e-5, rtol=0, err_msg=f"lq={lq}")
        np.testing.assert_allclose(h_nat, h_ref, atol=2e-5, rtol=0, err_msg=f"lq={lq}")


@pytest.mark.parametrize("norm", ["softmax", "ssa", "entmax"])
def test_decode_with_a_head_dim_of_no_whole_packets(library, norm):
    """D = 18, a head dim of no whole SIMD packet (SSE's 4, AVX2's 8, AVX-512's 16 floats): the decode path's
    matrix-vector products on 18-float rows, against the oracle over two key blocks."""
    g = torch.Generator().manual_seed(7)
    x = inputs(lq=1, lk=700)
    x["Q"] = (torch.randn(B, HQ, 1, 18, generator=g) * 2).numpy()
    x["K"] = (torch.randn(B, HKV, 700, 18, generator=g) * 2).numpy()
    x["V"] = torch.randn(B, HKV, 700, 18, generator=g).numpy()
    o_ref, h_ref = torch_reference(registry.get(norm), x, True)
    o, h = session(one_op_model(norm, True, None, scale=18**-0.5), library).run(None, x)
    np.testing.assert_allclose(o, o_ref, atol=2e-5, rtol=0)
    np.testing.assert_allclose(h, h_ref, atol=2e-5, rtol=0)


def test_decode_of_every_stacked_row_count(library):
    """1 to 8 stacked rows (one KV head per query head, 1 to 8 new queries): every row count of the decode path
    (kSkinnyRows), against the oracle."""
    for lq in range(1, 9):
        g = torch.Generator().manual_seed(30 + lq)
        x = {k: v for k, v in inputs(lq=lq, lk=600).items() if k in ("key_mask",)}
        x |= {
            "Q": (torch.randn(B, 2, lq, D, generator=g) * 2).numpy(),
            "K": (torch.randn(B, 2, 600, D, generator=g) * 2).numpy(),
            "V": torch.randn(B, 2, 600, D, generator=g).numpy(),
            "alibi_slopes": np.array([0.5, 0.0], np.float32),
            **{k: np.ones(2, np.float32) for k in ("alpha", "ssa_n", "ssa_b", "ssmax_s")},
            "query_scale": np.ones((B, 2, lq), np.float32),
        }
        o_ref, h_ref = torch_reference(registry.get("softmax"), x, True)
        o, h = session(one_op_model("softmax", True, None, q_heads=2, kv_heads=2), library).run(None, x)
        np.testing.assert_allclose(o, o_ref, atol=2e-5, rtol=0, err_msg=f"lq={lq}")
        np.testing.assert_allclose(h, h_ref, atol=2e-5, rtol=0, err_msg=f"lq={lq}")


@pytest.mark.parametrize("norm", ["entmax", "asentmax"])
def test_entmax_alpha_one_heads_are_softmax(library, norm):
    x = inputs(seed=1)
    x["alpha"] = np.array([1.0, 1.0, 1.0, 1.0], np.float32)
    o_nat, h_nat = session(one_op_model(norm, True, None), library).run(None, x)
    soft = dict(x, query_scale=np.ones_like(x["query_scale"]))
    if norm == "asentmax":  # λ still scales the logits
        soft["Q"] = x["Q"] * x["query_scale"][..., None]
        soft["alibi_slopes"] = np.zeros_like(x["alibi_slopes"])
        x_alibi = x["alibi_slopes"]
        assert x_alibi.any()  # (ALiBi is scaled by λ too; compare on heads without it)
        o_nat, h_nat = o_nat[:, 2:], h_nat[:, 2:]
    o_soft, h_soft = torch_reference(registry.get("softmax"), soft, True)
    if norm == "asentmax":
        o_soft, h_soft = o_soft[:, 2:], h_soft[:, 2:]
    np.testing.assert_allclose(o_nat, o_soft, atol=2e-5, rtol=0)
    np.testing.assert_allclose(h_nat, h_soft, atol=2e-5, rtol=0)


@pytest.mark.parametrize("norm", registry.NORMS)
def test_one_and_many_threads_give_identical_results(library, norm):
    x = inputs(seed=2, lq=130, lk=130)
    model = one_op_model(norm, True, None)
    one = session(model, library, threads=1).run(None, x)
    many = session(model, library, threads=4).run(None, x)
    for a, b in zip(one, many, strict=True):
        assert np.array_equal(a, b)


@pytest.mark.parametrize(("alphas", "seed", "bound"), [((1.75, 1.25), 1, 3e-7), ((2.5, 3.0), 4, 5e-7)])
def test_entmax_weights_from_exact_logits_match_the_float64_oracle(library, alphas, seed, bound):
    """V = I makes the output the normalised entmax weights themselves, and small integer q, k with a scale of 1/16
    make every logit exact in fp32: what is left is the threshold search's error (a loose settling rule there reads
    ~7e-7) and the weights' own rounding (~1.5e-7). α = 1.75: Newton's rows with the secant curvature; 1.25: Halley
    with the general power; 2.5 and 3 (rounding of their own: 3.7e-7 before this search too): Newton below k = 1,
    where S summed as d^(k−1)·d put a near-tie key on the wrong side of τ (1.7e-4)."""
    keys = dim = 256
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-2, 3, (1, 2, keys, dim), generator=g).float()
    k = torch.randint(-2, 3, (1, 1, keys, dim), generator=g).float()
    v = torch.eye(keys).reshape(1, 1, keys, dim)
    alpha = torch.tensor(alphas)
    model = one_op_model("entmax", True, None, inputs=("Q", "K", "V", "key_mask", "", "alpha"), q_heads=2,
                         kv_heads=1, scale=dim**-0.5)  # fmt: skip
    feed = {"Q": q.numpy(), "K": k.numpy(), "V": v.numpy(), "key_mask": np.ones((1, keys), bool)}
    out, _ = session(model, library).run(None, feed | {"alpha": alpha.numpy()})
    ref = attend(q.double(), k.double(), v.double(), norm="entmax", causal=True, alpha=alpha.double())
    assert np.abs(out - ref.numpy()).max() <= bound


@pytest.mark.parametrize("norm", registry.NORMS)
def test_edge_rows(library, norm):
    """All-masked rows give zeros; |z| = 1e4 stays finite and matches the reference; Lk = 0 gives zeros."""
    x = inputs(seed=3, spread=1.0)
    x["key_mask"][0] = False
    o, h = session(one_op_model(norm, False, None), library).run(None, x)
    assert np.array_equal(o[0], np.zeros_like(o[0])) and np.array_equal(h[0], np.zeros_like(h[0]))
    assert np.abs(o[1]).max() > 0.1

    # |z| up to ~1e4 with logits exact in float32 (small integers, scale 1), so float32 and the float64 oracle
    # see the same logits and differ only in the normaliser's own arithmetic.
    big = inputs(seed=4)
    rng = np.random.default_rng(4)
    big["Q"] = rng.integers(-40, 41, big["Q"].shape).astype(np.float32)
    big["K"] = rng.integers(-40, 41, big["K"].shape).astype(np.float32)
    big["query_scale"] = np.ones_like(big["query_scale"])
    o, h = session(one_op_model(norm, True, None, scale=1.0), library).run(None, big)
    assert np.isfinite(o).all() and np.isfinite(h).all()
    ref = {k: torch.from_numpy(v).double() if v.dtype == np.float32 else torch.from_numpy(v) for k, v in big.items()}
    o_ref, h_ref = attend(
        ref["Q"],
        ref["K"],
        ref["V"],
        norm=norm,
        causal=True,
        key_mask=ref["key_mask"],
        scale=1.0,
        alibi_slopes=ref["alibi_slopes"],
        query_scale=ref["query_scale"] if registry.get(norm).query_scale else None,
        return_entropy=True,
        **{p: ref[p] for p in registry.get(norm).param_names},
    )
    assert float(np.abs(torch.einsum("bhid,bhjd->bhij", ref["Q"][:, :2], ref["K"]).numpy()).max()) > 5e3
    np.testing.assert_allclose(o, o_ref.numpy(), atol=2e-5, rtol=0)
    np.testing.assert_allclose(h, h_ref.numpy(), atol=2e-5, rtol=0)

    empty = inputs(seed=5, lq=0, lk=0)
    o, h = session(one_op_model(norm, False, None), library).run(None, empty)
    assert o.shape == (B, HQ, 0, D) and h.shape == (B, HQ, 0)


def test_the_kernel_runs_instead_of_the_body(library, tmp_path):
    """ONNX Runtime's profile lists the nodes it ran: with the library, the SharpAttention node itself (the body's
    ops never run); without it, the body's ops and no SharpAttention node."""
    x = inputs(seed=6)
    model = one_op_model("ssa", True, "dense")

    def ran(lib):
        s = session(model, lib, profile=tmp_path / ("native" if lib else "body"))
        s.run(None, x)
        events = json.loads(Path(s.end_profiling()).read_text())
        return {e["args"]["op_name"] for e in events if e.get("cat") == "Node" and "op_name" in e.get("args", {})}

    assert ran(library) == {"SharpAttention"}
    body = ran(None)
    assert "SharpAttention" not in body and {"MatMul", "Softmax"} & body


def test_omitted_optional_inputs_in_the_middle(library):
    """docs/op.md allows empty names for optional inputs: a hole before a given slot still works."""
    x = inputs(seed=7)
    names = [n if n in ("Q", "K", "V", "ssa_n", "ssa_b") else "" for n in OP_INPUTS]
    feeds = {n: x[n] for n in names if n}
    o, h = session(one_op_model("ssa", True, None, inputs=names), library).run(None, feeds)
    ref = dict(x, key_mask=np.ones_like(x["key_mask"]), alibi_slopes=np.zeros_like(x["alibi_slopes"]))
    o_ref, h_ref = torch_reference(registry.get("ssa"), ref, True)
    np.testing.assert_allclose(o, o_ref, atol=2e-5, rtol=0)
    np.testing.assert_allclose(h, h_ref, atol=2e-5, rtol=0)


BAD = {
    "Q of rank 3": (lambda x: x.update(Q=x["Q"][0]), "input Q must have rank 4"),
    "K heads": (lambda x: x.update(K=x["K"][:, :1], V=x["V"][:, :1]), "K has 1 heads, the node says kv_heads 2"),
    "V length": (
        lambda x: x.update(V=x["V"][:, :, :-1]),
        "input V has shape (2, 2, 149, 16), expected (2, 2, 150, 16)",
    ),
    "Q heads": (lambda x: x.update(Q=x["Q"][:, :3]), "Q has 3 heads, the node says q_heads 4"),
    "Lq > Lk": (lambda x: x.update(Q=np.concatenate([x["Q"]] * 3, 2)), "Q has 210 rows but K only 150 keys"),
    "key_mask shape": (lambda x: x.update(key_mask=x["key_mask"][:, 1:]), "input key_mask has shape (2, 149)"),
    "alibi shape": (lambda x: x.update(alibi_slopes=x["alibi_slopes"][:2]), "input alibi_slopes has shape (2,)"),
    "param shape": (lambda x: x.update(ssa_n=x["ssa_n"][:1]), "input ssa_n has shape (1,), expected (4,)"),
    "D mismatch": (lambda x: x.update(K=x["K"][..., :8]), "input K has shape (2, 2, 150, 8), expected (2, 2, 150, 16)"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_inputs_get_an_error_naming_them(library, case):
    x = inputs(seed=8)
    change, message = BAD[case]
    change(x)
    s = session(one_op_model("ssa", True, None), library)
    with pytest.raises(Exception, match="SharpAttention") as err:
        s.run(None, x)
    assert message in str(err.value)


def test_bad_attributes_fail_at_load(library):
    with pytest.raises(Exception, match="unknown norm 'nope'"):
        session(one_op_model("nope", True, None), library)
    with pytest.raises(Exception, match="q_heads 4 must be a positive multiple of kv_heads 3"):
        session(one_op_model("softmax", True, None, kv_heads=3), library)


def _served_tokens(path: Path, prompts: list[str], n: int, **backend) -> list[list[int]]:
    be = load_backend(path, **backend)
    engine = Engine(be, EngineConfig(), ServingMetrics(be.spec, entropy="head"))
    with (
        BackgroundServer(engine, ServerConfig(port=0, metrics_port=None)) as srv,
        Client(srv.target) as c,
        cf.ThreadPoolExecutor(len(prompts)) as pool,  # concurrent: batched decode with left padding
    ):
        calls = [pool.submit(c.generate, p, max_new_tokens=n, temperature=0) for p in prompts]
        return [list(f.result().token_ids) for f in calls]


def test_a_fallback_none_file_is_served_end_to_end(library, model_files, reference, tmp_path, monkeypatch):
    """A file with no fallback body runs only through the kernel: sharp-serve's greedy tokens equal the PyTorch
    model's, as do those of the same model's dense-fallback file served with --no-native."""
    bare = tmp_path / "bare.onnx"
    onnx.save(export_model(load(model_files["torch"]), ExportSettings(norm="ssa", fallback="none")), bare)
    prompts = ["the kernel", "a longer prompt for the batch", "x"]
    want = [reference(Tokenizer.encode(p), 24) for p in prompts]
    assert _served_tokens(bare, prompts, 24) == want
    assert _served_tokens(model_files["onnxruntime"], prompts, 24, native=False) == want
    monkeypatch.delenv("SHARP_ORT_OP_LIBRARY", raising=False)
    with pytest.raises(BackendError, match="native kernel switched off"):
        load_backend(bare, native=False)


def test_an_fp16_kv_cache_file_is_served(library, model_files, reference, tmp_path):
    """A file with `--kv-cache-dtype fp16` served (batched decode in place over fp16 buffers, natively and through
    its fallback bodies): the PyTorch model's greedy tokens, at half the KV bytes per token."""
    half = tmp_path / "half.onnx"
    onnx.save(export_model(load(model_files["torch"]), ExportSettings(norm="ssa", kv_dtype="fp16")), half)
    prompts = ["the kernel", "a longer prompt for the batch", "x"]
    want = [reference(Tokenizer.encode(p), 24) for p in prompts]
    assert _served_tokens(half, prompts, 24) == want
    assert _served_tokens(half, prompts, 24, native=False) == want
    assert 2 * load_backend(half).kv_bytes_per_token == load_backend(model_files["onnxruntime"]).kv_bytes_per_token
    assert load_backend(half).spec.kv_dtype == "fp16"  # the start-up line's "fp16 KV cache"


def test_adaptive_reads_the_threshold_attribute(library):
    """With the default polynomial β = 1 below H ≈ 0.85 anyway, so the threshold is tested at 1.5: the kernel
    must agree with the body given the same attribute, and differ from the default."""
    x = inputs(seed=9)
    o_nat, h_nat = session(one_op_model("adaptive", True, None, threshold=1.5), library).run(None, x)
    o_body, h_body = session(one_op_model("adaptive", True, "dense", threshold=1.5), None).run(None, x)
    np.testing.assert_allclose(o_nat, o_body, atol=2e-5, rtol=0)
    np.testing.assert_allclose(h_nat, h_body, atol=2e-5, rtol=0)
    o_default, _ = session(one_op_model("adaptive", True, None), library).run(None, x)
    assert np.abs(o_default - o_nat).max() > 1e-2


def cache_form_model(
    norm: str,
    fallback_mode: str | None,
    kv: int = TensorProto.FLOAT,
    summary: bool = False,
    scale: float = D**-0.5,
    given: tuple[str, ...] = OP_INPUTS,
) -> bytes:
    """One attention node in the cache form (exporter/cache_form.py): this step's K/V, the past buffers (of type
    `kv`), W; `summary`: also the key summary's slots (overload summary.<norm>); op slots not `given` are empty."""
    from sharp.exporter import cache_form

    attrs = dict(norm=norm, causal=1, scale=scale, poly=list(PAPER_POLY), q_heads=HQ, kv_heads=HKV)
    names = [n if n in given else "" for n in OP_INPUTS]
    names += [*cache_form.CACHE_INPUTS, *(cache_form.SUMMARY_INPUTS if summary else ())]
    outputs = ["O", "entropy", *cache_form.CACHE_OUTPUTS, *(cache_form.SUMMARY_OUTPUTS if summary else ())]
    node = helper.make_node("SharpAttention", names, outputs, domain="sharp", **attrs)
    node.overload = cache_form.overload(norm, summary)
    kinds = {"key_mask": TensorProto.BOOL, "past_length": TensorProto.INT64, "summary_length": TensorProto.INT64,
             "past_key": kv, "past_value": kv, "present_key": kv, "present_value": kv}  # fmt: skip
    graph_inputs = [helper.make_tensor_value_info(n, kinds.get(n, TensorProto.FLOAT), None) for n in names if n]
    graph_outputs = [helper.make_tensor_value_info(n, kinds.get(n, TensorProto.FLOAT), None) for n in outputs]
    entry = registry.get(norm)
    functions = []
    if fallback_mode:
        functions = [
            *fallback.functions([entry], fallback_mode),
            *cache_form.functions([entry], fallback_mode, summary),
        ]
    model = helper.make_model(
        helper.make_graph([node], "cache_form", graph_inputs, graph_outputs),
        opset_imports=[helper.make_opsetid(d, v) for d, v in (("", 18), ("sharp", 1), ("sharp.fallback", 1))],
        functions=functions,
        ir_version=10,
    )
    return model.SerializeToString()


def _cache_inputs(x: dict[str, np.ndarray], w: int, room: int, dtype=np.float32) -> dict[str, np.ndarray]:
    """x's keys after the first W as this step's, the W before them in buffers of `room` keys (garbage after W)."""
    feed = dict(x)
    buffers = {}
    for name, past in (("K", "past_key"), ("V", "past_value")):
        full = x[name]
        buffer = np.full((B, HKV, room, D), 7.0, dtype)  # columns past W hold nobody's keys
        buffer[:, :, :w] = full[:, :, :w]
        buffers[past] = buffer
        feed[name] = np.ascontiguousarray(full[:, :, w:])
    return {**feed, **buffers, "past_length": np.array([w], np.int64)}


def _run_in_place(sess, feed: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """O and entropy of a cache-form session run as sharp-serve runs it: each present bound to its past's own
    memory (I/O binding), so the kernel writes into the caller's arrays."""
    binding = sess.io_binding()
    for name, value in feed.items():
        if name not in ("past_key", "past_value"):
            binding.bind_cpu_input(name, value)
    binding.bind_output("O")
    binding.bind_output("entropy")
    for past, present in (("past_key", "present_key"), ("past_value", "present_value")):
        shared = ort.OrtValue.ortvalue_from_numpy(feed[past])
        binding.bind_ortvalue_input(past, shared)
        binding.bind_ortvalue_output(present, shared)
    sess.run_with_iobinding(binding)
    o, h = (v.numpy() for v in binding.get_outputs()[:2])  # in binding order
    return o, h


@pytest.mark.parametrize("norm", registry.all_norms(), ids=lambda n: n.name)
def test_cache_form_writes_in_place_and_attends_as_the_concat_did(library, norm):
    """The cache form equals the plain op over past + new keys, natively and through its fallback body; its
    presents are the past with the new keys at [W, W + Lq) — fed a buffer with room and given the past's own memory
    as present (I/O binding), the kernel writes exactly those columns and nothing else."""
    x = inputs(lq=LQ, lk=LK)
    w = LK - LQ
    exact = _cache_inputs(x, w, w)  # S = W: a plain run, presents = past + new
    refs = {lib: session(one_op_model(norm.name, True), lib).run(None, x) for lib in (library, None)}
    for lib, mode in ((library, None), (None, "dense")):  # each against the plain op of the same implementation
        o_ref, h_ref = refs[lib]
        o, h, pk, pv = session(cache_form_model(norm.name, mode), lib).run(None, exact)
        np.testing.assert_allclose(o, o_ref, atol=2e-6, rtol=0)
        np.testing.assert_allclose(h, h_ref, atol=2e-6, rtol=0)
        np.testing.assert_array_equal(pk, x["K"])
        np.testing.assert_array_equal(pv, x["V"])
    room = _cache_inputs(x, w, LK + 9)  # a buffer with room: presents as long as it
    o, _, pk, _ = session(cache_form_model(norm.name, "dense"), None).run(None, room)
    np.testing.assert_allclose(o, refs[None][0], atol=2e-6, rtol=0)
    assert pk.shape[2] == LK + 9 and (pk[:, :, :LK] == x["K"]).all() and (pk[:, :, LK:] == 7.0).all()
    o, h = _run_in_place(session(cache_form_model(norm.name, None), library), room)
    np.testing.assert_allclose(o, refs[library][0], atol=2e-6, rtol=0)
    np.testing.assert_allclose(h, refs[library][1], atol=2e-6, rtol=0)
    for past, full in (("past_key", x["K"]), ("past_value", x["V"])):  # written in the caller's own array
        assert (room[past][:, :, :LK] == full).all() and (room[past][:, :, LK:] == 7.0).all()


def _fp16_case(lq: int, lk: int) -> tuple[dict, dict, dict]:
    """Inputs; the same with K and V rounded to fp16 (the plain op's feed); the cache form's feed over fp16
    buffers with 9 spare columns."""
    x = inputs(lq=lq, lk=lk)
    rounded = {**x, **{kv: x[kv].astype(np.float16).astype(np.float32) for kv in ("K", "V")}}
    return x, rounded, _cache_inputs(x, lk - lq, lk + 9, np.float16)


@pytest.mark.parametrize(
    ("lq", "lk"), [(LQ, LK), (LQ, 1100), (1, 1100)], ids=["prefill", "prefill-3-key-blocks", "decode-3-key-blocks"]
)
@pytest.mark.parametrize("norm", registry.all_norms(), ids=lambda n: n.name)
def test_an_fp16_cache_attends_as_fp32_over_keys_rounded_to_fp16(library, norm, lq, lk):
    """`--kv-cache-dtype fp16`: the cache form over float16 buffers stores this step's keys rounded to nearest
    and attends — natively (a prefill's GEMMs, the decode path's matrix-vector products) and through its fallback
    body — as the fp32 op over the same keys rounded to fp16: held to the float64 oracle over them as every
    implementation is, and to the plain fp32 op of the same implementation at 2e-6 where both sum P·V in the same
    order (the native kernel widens an fp16 cache 512 keys at a time, so a prefill over more keys sums per block
    where the fp32 op runs one GEMM); in place, only the new columns change."""
    x, rounded, room = _fp16_case(lq, lk)
    w = lk - lq
    o_oracle, h_oracle = torch_reference(norm, rounded, True)
    same_order = lq == 1 or lk <= 512
    for lib, mode in ((library, None), (None, "dense")):
        o, h, pk, pv = session(cache_form_model(norm.name, mode, TensorProto.FLOAT16), lib).run(None, room)
        np.testing.assert_allclose(o, o_oracle, atol=2e-5, rtol=0)
        np.testing.assert_allclose(h, h_oracle, atol=2e-5, rtol=0)
        if same_order or lib is None:
            o_ref, h_ref = session(one_op_model(norm.name, True), lib).run(None, rounded)
            np.testing.assert_allclose(o, o_ref, atol=2e-6, rtol=0)
            np.testing.assert_allclose(h, h_ref, atol=2e-6, rtol=0)
        assert pk.dtype == np.float16 and pk.shape[2] == lk + 9
        np.testing.assert_array_equal(pk[:, :, :lk], x["K"].astype(np.float16))  # round to nearest even
        np.testing.assert_array_equal(pv[:, :, :lk], x["V"].astype(np.float16))
        assert (pk[:, :, lk:] == 7.0).all()
    before = {past: room[past].copy() for past in ("past_key", "past_value")}
    o, _ = _run_in_place(session(cache_form_model(norm.name, None, TensorProto.FLOAT16), library), room)
    np.testing.assert_allclose(o, o_oracle, atol=2e-5, rtol=0)
    for past, new in (("past_key", x["K"]), ("past_value", x["V"])):  # the new columns, in the caller's array
        np.testing.assert_array_equal(room[past][:, :, w:lk], new[:, :, w:].astype(np.float16))
        changed = room[past] != before[past]
        assert not changed[:, :, :w].any() and not changed[:, :, lk:].any()


# Exact sparse entmax decode: the rows of a decode step (few stacked rows) read the values of their support only.
SPARSE_KEYS = 1100  # three 512-key passes, 18 64-key blocks
SPARSE_ALPHAS = np.array([1.2, 1.5, 2.0, 1.7], np.float32)  # per head: the general powers and both fast paths


def _sparse_logits(case: str) -> tuple[np.ndarray, np.ndarray]:
    """Logits z (exact in float32: q is a unit vector, scale 1, so z = K[:, 0]) and the key mask of one row."""
    rng = np.random.default_rng(11)
    n = SPARSE_KEYS
    z = np.full(n, -50.0, np.float32)
    mask = np.ones(n, bool)
    if case == "dominant":  # one key far above the rest: support of one, every other key below the floor
        z = (rng.standard_normal(n) * 0.5).astype(np.float32)
        z[500] = 10.0
    elif case == "inside-the-floor":  # a second key just above max − 1/(α−1) for α = 2: a tiny weight, kept
        z[100], z[900] = 0.0, -0.995
    elif case == "all-equal":  # nothing can be skipped
        z[:] = 0.0
    elif case == "ties-at-tau":  # α = 2: two keys at 0 put τ at −0.5 exactly, where 300 keys sit (weight 0)
        z[[10, 1000]] = 0.0
        z[rng.choice(np.arange(20, 990), 300, replace=False)] = -0.5
    elif case == "just-above-tau":  # α = 2: keys a hair above where τ would be without them (weights ~1e-4)
        z[[10, 1000]] = 0.0
        z[rng.choice(np.arange(20, 990), 5, replace=False)] = -0.4996
        z[rng.choice(np.arange(20, 990), 300, replace=False)] = -0.5
    elif case == "counted-band":  # α = 2: keys in the floor's counted packets (16 of every 64) a hair above a
        # level, −1/8, where τ* ≈ −0.267 lies below the next level down, −1/4: an estimate that weighed them at
        # their band's upper edge would put the floor at −1/4, above τ*
        z[192] = 0.0
        z[[325, 389, 453, 517, 581]] = -0.12
    elif case == "straddling":  # one support key per 64-key block, the others just below τ of the α = 1.5 head
        z[:] = -0.49
        z[7::64] = 0.0
    elif case == "holes":  # masked keys, the row's largest among them, spread over every block
        z = (rng.standard_normal(n) * 2).astype(np.float32)
        mask[::3] = False
        z[300] = 9.0
        mask[300] = False
    return z, mask


def _sparse_oracle(norm: str, x: dict[str, np.ndarray], v: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
    """attend() in float64 at scale 1 (`v`: other values, e.g. the identity, whose output is the weights)."""
    t = {k: torch.from_numpy(a).double() if a.dtype == np.float32 else torch.from_numpy(a) for k, a in x.items()}
    out, ent = attend(t["Q"], t["K"], t["V"] if v is None else torch.from_numpy(v).double(), norm=norm, causal=True,
                      key_mask=t["key_mask"], scale=1.0, alibi_slopes=t["alibi_slopes"], alpha=t["alpha"],
                      query_scale=t["query_scale"] if registry.get(norm).query_scale else None,
                      return_entropy=True)  # fmt: skip
    return out.numpy(), ent.numpy()


def _sparse_feed(case: str, lq: int, scale: float) -> dict[str, np.ndarray]:
    """Batch 1, 4 query heads over 2 KV heads (GQA), D = 16; the last query row's logits are `case`'s row on every
    head (times ASEntmax's λ = `scale`)."""
    z, mask = _sparse_logits(case)
    rng = np.random.default_rng(12)
    k = rng.standard_normal((1, HKV, SPARSE_KEYS, D)).astype(np.float32)
    k[..., 0] = z
    v = rng.standard_normal((1, HKV, SPARSE_KEYS, D)).astype(np.float32)
    q = rng.standard_normal((1, HQ, lq, D)).astype(np.float32)
    q[:, :, -1] = 0.0
    q[:, :, -1, 0] = 1.0
    return {
        "Q": q, "K": k, "V": v, "key_mask": mask[None], "alibi_slopes": np.zeros(HQ, np.float32),
        "alpha": SPARSE_ALPHAS, "query_scale": np.full((1, HQ, lq), scale, np.float32),
    }  # fmt: skip


SPARSE_CASES = [
    "dominant",
    "inside-the-floor",
    "all-equal",
    "ties-at-tau",
    "just-above-tau",
    "counted-band",
    "straddling",
    "holes",
]


@pytest.mark.parametrize("norm", ["entmax", "asentmax"])
@pytest.mark.parametrize("case", SPARSE_CASES)
def test_sparse_entmax_decode_is_exact_and_reads_only_the_support(library, norm, case):
    """A decode row (the per-row path) and the same row among a prefill tile's rows (the GEMM path, which scatters
    the weights) agree within 1e-6, and each with the float64 oracle (outputs within 2e-6, ~1e-6 measured at the
    ties; entropies within the op's 2e-5: fp32 log-sums over up to 1,100 keys); with every value outside the
    oracle's support set to NaN the decode row is unchanged: it never read them (0·NaN would show)."""
    names = ("Q", "K", "V", "key_mask", "alibi_slopes", "alpha", "query_scale")
    model = one_op_model(norm, True, None, inputs=names, scale=1.0)
    sess = session(model, library)
    lam = 1.25 if norm == "asentmax" else 1.0
    rows = {}
    for lq in (1, 9):  # 2 stacked rows: per-row decode; 18: a GEMM tile
        x = _sparse_feed(case, lq, lam)
        o_ref, h_ref = _sparse_oracle(norm, x)
        o, h = sess.run(None, x)
        rows[lq] = o[:, :, -1], h[:, :, -1]
        np.testing.assert_allclose(o[:, :, -1], o_ref[:, :, -1], atol=2e-6, rtol=0, err_msg=f"lq={lq}")
        np.testing.assert_allclose(h[:, :, -1], h_ref[:, :, -1], atol=2e-5, rtol=0, err_msg=f"lq={lq}")
    for got, gemm in zip(rows[1], rows[9], strict=True):  # sparse decode against the dense GEMM path
        np.testing.assert_allclose(got, gemm, atol=1e-6, rtol=0)
    x = _sparse_feed(case, 1, lam)
    eye = np.broadcast_to(np.eye(SPARSE_KEYS, dtype=np.float32), (1, HKV, SPARSE_KEYS, SPARSE_KEYS))
    weights, _ = _sparse_oracle(norm, x, eye)  # V = I: each head's weights over the keys
    support = (weights[0, :, -1] > 0).reshape(HKV, HQ // HKV, SPARSE_KEYS).any(axis=1)  # per KV head, any of its heads
    assert support.any(axis=1).all() and ((~support).any() or case == "all-equal")  # something to poison
    poisoned = x | {"V": np.where(support[None, :, :, None], x["V"], np.nan).astype(np.float32)}
    o, h = sess.run(None, poisoned)
    np.testing.assert_allclose(o[:, :, -1], rows[1][0], atol=1e-6, rtol=0)
    np.testing.assert_array_equal(h[:, :, -1], rows[1][1])


@pytest.mark.parametrize("norm", registry.all_norms(), ids=lambda n: n.name)
def test_a_decode_step_split_over_key_chunks_keeps_each_rows_edge_cases(library, norm):
    """A decode step over 1,100 keys: the softmax family's runs a task per 512-key chunk (the chunks' sums rescaled
    to the row's max), every other norm a task per KV head. Row by row, as one pass over the whole row gives: a
    sequence whose only visible keys lie in the last chunk (the first two see nothing); a +inf logit in the middle
    chunk (NaN row) beside a −inf one (that key hidden); a NaN key. One and four threads give the same bits."""
    x = inputs(seed=40, lq=1, lk=1100)
    x["key_mask"][0, :1030] = False  # sequence 0 sees its last 70 keys only, all in chunk 3
    x["K"][1, 1, 700] = 0.0
    x["K"][1, 1, 700, 3] = np.inf  # KV head 1 of sequence 1: query head 2 reads +inf there, head 3 −inf
    x["Q"][1, 2, 0, 3], x["Q"][1, 3, 0, 3] = 1.0, -1.0
    x["K"][1, 0, 900, 5] = np.nan  # KV head 0 of sequence 1: query heads 0 and 1 read NaN there
    o_ref, h_ref = torch_reference(norm, x, True)
    model = one_op_model(norm.name, True, None)
    one = session(model, library, threads=1).run(None, x)
    many = session(model, library, threads=4).run(None, x)
    for a, b in zip(one, many, strict=True):
        np.testing.assert_array_equal(a, b)
    o, h = many
    assert np.isnan(o[1, :3]).all() and np.isnan(h[1, :3]).all()  # +inf and NaN rows are NaN, as the oracle's
    assert np.isnan(o_ref[1, :3]).all()
    np.testing.assert_allclose(o[0], o_ref[0], atol=2e-5, rtol=0)
    np.testing.assert_allclose(h[0], h_ref[0], atol=2e-5, rtol=0)
    if norm.transform != registry.Transform.LOG_N_SCALE:  # SSMax's n: the kernel counts the mask's keys (whole
        # rows too), the oracle the finite logits, so a key at −inf by its own logit counts for one, not the other
        np.testing.assert_allclose(o[1, 3], o_ref[1, 3], atol=2e-5, rtol=0)
        np.testing.assert_allclose(h[1, 3], h_ref[1, 3], atol=2e-5, rtol=0)
    assert np.isfinite(o[1, 3]).all() and np.isfinite(h[1, 3])


# Sparse entmax decode over pages (docs/op.md, "The key summary"): the cache form's per-page key minima and maxima
# bound each page's logits; a decode row reads only the pages whose bound is above a lower bound of its threshold.
PAGE = 16


def summary_model(
    norm: str, fallback_mode: str | None = None, kv: int = TensorProto.FLOAT, summary: bool = True, scale: float = 1.0
) -> bytes:
    """The cache-form node with (or without) the key summary's slots, the slots the entmax family does not read
    empty."""
    given = tuple(n for n in OP_INPUTS if n not in ("ssa_n", "ssa_b", "ssmax_s"))
    return cache_form_model(norm, fallback_mode, kv, summary, scale, given)


def page_summary(keys: np.ndarray, end: int) -> np.ndarray:
    """The exact summary of a (B, Hkv, S, D) buffer's keys [0, end): per page their minima and maxima, (B, Hkv,
    ⌈S/16⌉, 2, D); pages from `end` on are zeros (nobody's keys)."""
    b, h, s, d = keys.shape
    out = np.zeros((b, h, -(-s // PAGE), 2, d), np.float32)
    for page in range(-(-end // PAGE)):
        block = keys[:, :, page * PAGE : min(end, page * PAGE + PAGE)].astype(np.float32)
        out[:, :, page, 0], out[:, :, page, 1] = block.min(2), block.max(2)
    return out


def _paged_feed(case: str, norm: str) -> dict[str, np.ndarray]:
    """`case`'s decode row (tests above) in the cache form: the first W = n − 1 keys in the past buffers with their
    summary, the last key this step's. `negative-query`: the dominant row with q = −e0 over K[..., 0] = −z (the
    same logits, so a bound that drops kmin shows); `alibi`: the straddling row with ALiBi on two heads (a slope of
    0.02: a page's bound moves by 0.3 between its first and last key); ASEntmax runs
    with λ = −1.25 on `holes` and `dominant` (the lower bound of q·k is then the one that counts)."""
    base = {"negative-query": "dominant", "alibi": "straddling"}.get(case, case)
    lam = 1.25 if norm == "asentmax" else 1.0
    if norm == "asentmax" and case in ("holes", "dominant"):
        lam = -1.25
    x = _sparse_feed(base, 1, lam)
    if lam < 0:  # the same logits: λ·q·k with q·k negated
        x["K"][..., 0] *= -1
    if case == "negative-query":
        x["Q"][..., 0] *= -1
        x["K"][..., 0] *= -1
    if case == "alibi":
        x["alibi_slopes"] = np.array([0.02, 0.0, -0.02, 0.0], np.float32)
    w = SPARSE_KEYS - 1
    feed = {k: v for k, v in x.items()}
    for name, past in (("K", "past_key"), ("V", "past_value")):
        feed[past] = np.ascontiguousarray(x[name][:, :, :w])
        feed[name] = np.ascontiguousarray(x[name][:, :, w:])
    feed["past_length"] = np.array([w], np.int64)
    feed["past_key_summary"] = page_summary(feed["past_key"], w)
    feed["summary_length"] = np.array([w], np.int64)
    return feed


def _skippable_pages(feed: dict[str, np.ndarray], norm: str) -> np.ndarray:
    """Pages of the past the kernel must skip by its read policy (docs/op.md), worked in float64: each query head
    reads its 8 best pages by bound and the query's own, takes the threshold τ of the visible keys read (a lower
    bound of the one the kernel takes over its whole group's pages), and while it keeps more than 4× the pages read,
    reads 4× more. A page is named when, for every query head of its KV head, its bound is below that τ (by 0.05)
    and below the last page read's bound (by 0.01: the kernel's bounds carry a rounding allowance that can reorder
    near-ties). (Hkv, pages) bool."""
    x = {**feed, "K": np.concatenate([feed["past_key"], feed["K"]], 2)}
    n = x["K"].shape[2]
    summary = page_summary(x["K"], n)
    pages = summary.shape[2]
    skip = np.ones((HKV, pages), bool)
    for h in range(HQ):
        kv, alpha = h // (HQ // HKV), float(x["alpha"][h])
        lam = float(x["query_scale"][0, h, 0]) if registry.get(norm).query_scale else 1.0
        q = x["Q"][0, h, 0].astype(np.float64)
        slope = float(x["alibi_slopes"][h])
        z = lam * (x["K"][0, kv].astype(np.float64) @ q + slope * (np.arange(n) - (n - 1)))
        u = np.where(x["key_mask"][0], (alpha - 1) * z, -np.inf)
        kmin, kmax = summary[0, kv, :, 0].astype(np.float64), summary[0, kv, :, 1].astype(np.float64)
        dot = np.maximum(kmin * q, kmax * q).sum(1) if lam >= 0 else np.minimum(kmin * q, kmax * q).sum(1)
        first = np.arange(pages) * PAGE - (n - 1)
        at = np.stack([slope * first, slope * np.minimum(first + PAGE - 1, 0)])
        bound = (alpha - 1) * lam * (dot + (at.max(0) if lam >= 0 else at.min(0)))
        order = np.argsort(-bound, kind="stable")
        read = 8
        while True:
            seen = np.zeros(pages, bool)
            seen[order[:read]] = seen[-1] = True
            w = u[np.repeat(seen, PAGE)[:n]]
            w = w[np.isfinite(w)]
            lo, hi = w.max() - 1, w.max()
            for _ in range(100):
                mid = (lo + hi) / 2
                lo, hi = (mid, hi) if (np.clip(w - mid, 0, None) ** (1 / (alpha - 1))).sum() >= 1 else (lo, mid)
            if (bound > lo).sum() <= 4 * read or read >= pages:
                break
            read = min(pages, 4 * read)
        skip[kv] &= (bound < lo - 0.05) & (bound < bound[order[read - 1]] - 0.01)  # margins: the kernel's rounding
    skip[:, -1] = False
    return skip


PAGED_CASES = [*SPARSE_CASES, "negative-query", "alibi"]
# the least share of pages _skippable_pages names (the rows of −50 filler tie every page's bound: none named)
PROVABLY_OUT = {
    "dominant": 0.8,
    "negative-query": 0.8,
    "alibi": 0.3,
    "straddling": 0.3,
    "holes": 0.3,
    "ties-at-tau": 0.05,
}


@pytest.mark.parametrize("norm", ["entmax", "asentmax"])
@pytest.mark.parametrize("case", PAGED_CASES)
def test_paged_entmax_decode_equals_dense_and_never_reads_the_pages_it_skips(library, norm, case):
    """With the key summary, a decode row equals the same row without it (every key read) within 1e-6 in output
    and entropy (relative: the threshold search runs over another candidate set, so a sum of ~40 weights rounds
    differently), and the float64 oracle within the op's 2e-5; with the keys of every page the oracle bounds out
    set to NaN (their summary kept), the row is unchanged: those pages were never read (a NaN logit would show)."""
    feed = _paged_feed(case, norm)
    dense_feed = {k: v for k, v in feed.items() if k not in ("past_key_summary", "summary_length")}
    o_dense, h_dense = session(summary_model(norm, summary=False), library).run(None, dense_feed)[:2]
    sess = session(summary_model(norm), library)
    o, h = sess.run(None, feed)[:2]
    np.testing.assert_allclose(o, o_dense, atol=1e-6, rtol=0)
    np.testing.assert_allclose(h, h_dense, atol=1e-6, rtol=1e-6)  # an entropy near 3: 1e-6 is 4 of its fp32 ulps
    x = {
        **feed,
        "K": np.concatenate([feed["past_key"], feed["K"]], 2),
        "V": np.concatenate([feed["past_value"], feed["V"]], 2),
    }
    o_ref, h_ref = _sparse_oracle(
        norm, {k: x[k] for k in ("Q", "K", "V", "key_mask", "alibi_slopes", "alpha", "query_scale")}
    )
    np.testing.assert_allclose(o, o_ref, atol=2e-5, rtol=0)  # the op's bound (dense: 3.4e-6 on `alibi`)
    np.testing.assert_allclose(h, h_ref, atol=2e-5, rtol=0)
    skip = _skippable_pages(feed, norm)
    assert skip.mean() >= PROVABLY_OUT.get(case, 0.0), skip.mean()  # pages the oracle can name (ties aside)
    poisoned = feed["past_key"].copy()
    for kv, page in zip(*np.nonzero(skip), strict=True):
        poisoned[0, kv, page * PAGE : (page + 1) * PAGE] = np.nan
    o_p, h_p = sess.run(None, feed | {"past_key": poisoned})[:2]
    np.testing.assert_array_equal(o_p, o)
    np.testing.assert_array_equal(h_p, h)


@pytest.mark.parametrize("kv", [TensorProto.FLOAT, TensorProto.FLOAT16], ids=["fp32", "fp16"])
def test_the_key_summary_follows_every_write_in_place(library, kv):
    """A prefill, then decode steps, as sharp-serve runs them: the presents and the summary bound to the pasts' own
    memory, summary_length the keys the summary already covered. After every step the summary holds the exact
    minima and maxima of each page's stored keys, and each step's output equals the same step without a summary."""
    dtype = np.float16 if kv == TensorProto.FLOAT16 else np.float32
    rng = np.random.default_rng(21)
    n, prefill, room = 180, 150, 200
    k = rng.standard_normal((1, HKV, n, D)).astype(np.float32)
    k[..., 0] *= 4.0
    v = rng.standard_normal((1, HKV, n, D)).astype(np.float32)
    q = rng.standard_normal((1, HQ, n, D)).astype(np.float32) * 0.1
    q[..., 0] = 3.0
    params = {
        "alibi_slopes": np.zeros(HQ, np.float32),
        "alpha": SPARSE_ALPHAS,
        "query_scale": np.ones((1, HQ, n), np.float32),
    }
    buffers = {name: np.full((1, HKV, room, D), 7.0, dtype) for name in ("past_key", "past_value")}
    summary = np.zeros((1, HKV, room // PAGE + 1, 2, D), np.float32)
    sess, dense = (
        session(summary_model("entmax", kv=kv), library),
        session(summary_model("entmax", kv=kv, summary=False), library),
    )
    w, covered = 0, 0
    for lq in [prefill] + [1] * (n - prefill):
        feed = {"Q": q[:, :, w : w + lq], "K": k[:, :, w : w + lq], "V": v[:, :, w : w + lq],
                "key_mask": np.ones((1, w + lq), bool), "past_length": np.array([w], np.int64),
                "alibi_slopes": params["alibi_slopes"], "alpha": params["alpha"],
                "query_scale": params["query_scale"][:, :, w : w + lq]}  # fmt: skip
        want = dense.run(None, {**feed, **{p: b.copy() for p, b in buffers.items()}})[:2]
        binding = sess.io_binding()
        for name, value in {**feed, "summary_length": np.array([covered], np.int64)}.items():
            binding.bind_cpu_input(name, value)
        binding.bind_output("O")
        binding.bind_output("entropy")
        for past, present, value in (("past_key", "present_key", buffers["past_key"]),
                                     ("past_value", "present_value", buffers["past_value"]),
                                     ("past_key_summary", "present_key_summary", summary)):  # fmt: skip
            shared = ort.OrtValue.ortvalue_from_numpy(value)
            binding.bind_ortvalue_input(past, shared)
            binding.bind_ortvalue_output(present, shared)
        sess.run_with_iobinding(binding)
        o, h = (x.numpy() for x in binding.get_outputs()[:2])
        np.testing.assert_allclose(o, want[0], atol=1e-6, rtol=0)
        np.testing.assert_allclose(h, want[1], atol=1e-6, rtol=0)
        w += lq
        covered = w
        pages = -(-w // PAGE)
        np.testing.assert_array_equal(summary[:, :, :pages], page_summary(buffers["past_key"], w)[:, :, :pages])


def test_the_fallback_body_writes_a_summary_that_bounds_every_key(library):
    """Without the library the cache form's body writes the summary too: pages of whole written keys equal the
    kernel's, and every key [0, W + L) lies within its page's bounds (the body also bounds the columns past W + L);
    outputs equal the kernel's."""
    rng = np.random.default_rng(22)
    lk, w, room = 300, 297, 333
    k = rng.standard_normal((B, HKV, lk, D)).astype(np.float32)
    v = rng.standard_normal((B, HKV, lk, D)).astype(np.float32)
    x = inputs(seed=9, lq=3, lk=lk)
    feed = _cache_inputs(x | {"K": k, "V": v}, w, room)
    feed = {n: a for n, a in feed.items() if n not in ("ssa_n", "ssa_b", "ssmax_s")}
    feed["past_key_summary"] = np.zeros((B, HKV, -(-room // PAGE), 2, D), np.float32)
    feed["summary_length"] = np.array([0], np.int64)
    native = session(summary_model("asentmax", scale=D**-0.5), library).run(None, feed)
    body = session(summary_model("asentmax", "dense", scale=D**-0.5), None).run(None, feed)
    np.testing.assert_allclose(body[0], native[0], atol=2e-5, rtol=0)  # the bodies' bound (above)
    whole = lk // PAGE
    np.testing.assert_array_equal(body[4][:, :, :whole], native[4][:, :, :whole])
    np.testing.assert_array_equal(
        native[4][:, :, : -(-lk // PAGE)], page_summary(native[2], lk)[:, :, : -(-lk // PAGE)]
    )
    page = np.arange(lk) // PAGE
    assert (body[4][:, :, page, 0] <= k).all() and (body[4][:, :, page, 1] >= k).all()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda f: f.update(summary_length=np.array([f["past_length"][0] + 1], np.int64)),
            "summary_length 298 must be in [0, 297]",
        ),
        (lambda f: f.update(past_key_summary=f["past_key_summary"][:, :, 1:]), "input past_key_summary has shape"),
        (lambda f: f.pop("summary_length"), "the key summary needs past_key_summary and summary_length together"),
    ],
    ids=["length past W", "pages", "length missing"],
)
def test_a_bad_key_summary_gets_an_error_naming_it(library, change, message):
    x = inputs(seed=10, lq=3, lk=300)
    feed = {n: a for n, a in _cache_inputs(x, 297, 300).items() if n not in ("ssa_n", "ssa_b", "ssmax_s")}
    feed["past_key_summary"] = np.zeros((B, HKV, 19, 2, D), np.float32)
    feed["summary_length"] = np.array([0], np.int64)
    change(feed)
    names = summary_model("entmax")
    if "summary_length" not in feed:  # the slot left empty in the node
        proto = onnx.load_from_string(names)
        proto.graph.node[0].input[list(proto.graph.node[0].input).index("summary_length")] = ""
        proto.graph.input.remove(next(i for i in proto.graph.input if i.name == "summary_length"))
        names = proto.SerializeToString()
    with pytest.raises(Exception, match="SharpAttention") as err:
        session(names, library).run(None, feed)
    assert message in str(err.value)
