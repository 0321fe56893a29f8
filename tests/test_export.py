"""sharp-export: the file's op structure, numbers in stock onnxruntime, cached decoding, and every CLI error."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from sharp.exporter import metadata
from sharp.exporter.check import sharplm_reference, verify
from sharp.exporter.cli import main
from sharp.models import MaxRetrieval, MaxRetrievalConfig, ModelConfig, SharpLM, registry, save


def _model(norm: str, pos: str = "rope", **kw) -> SharpLM:
    torch.manual_seed(0)
    cfg = ModelConfig(dim=32, layers=2, heads=4, kv_heads=2, norm=norm, pos=pos, context_length=128, **kw)
    model = SharpLM(cfg).eval()
    with torch.no_grad():  # move learned parameters off their init so wrong wiring would show
        for name, p in model.named_parameters():
            if name.endswith(("alpha_raw", "ssa_n_raw", "ssa_b_raw", "ssmax_s")):
                p.add_(torch.linspace(-0.3, 0.3, p.numel()))
    return model


def _export(tmp_path: Path, model: SharpLM, *args: str) -> Path:
    ckpt = save(model, tmp_path / "model.pt")
    out = tmp_path / "model.onnx"
    assert main([str(ckpt), "-o", str(out), *args]) == 0
    return out


@pytest.mark.parametrize(
    ("norm", "pos"),
    [
        ("softmax", "rope"),
        ("adaptive", "rope"),
        ("ssmax", "alibi"),
        ("entmax", "nape"),
        ("asentmax", "nape"),
        ("ssa", "rope"),
    ],
)
@pytest.mark.parametrize("fallback", ["dense", "streamed"])
def test_each_norm_exports_as_custom_op_and_matches_pytorch(tmp_path, norm, pos, fallback, capsys):
    model = _model(norm, pos)
    # streamed with 3-key blocks: the checks' 9- and 10-key rows span several blocks, the last one partial
    out = _export(tmp_path, model, "--fallback", fallback, "--block-size", "3")
    assert "check passed" in capsys.readouterr().out
    proto = onnx.load(out)
    ops = [n for n in proto.graph.node if n.domain == "sharp"]
    assert len(ops) == 2 and all(n.op_type == "SharpAttention" and n.overload == f"cache.{norm}" for n in ops)
    assert not [n for n in proto.graph.node if n.op_type == "Concat" and n.output[0].startswith("present.")]
    attrs = {a.name for a in ops[0].attribute}
    assert {"norm", "causal", "scale", "poly", "q_heads", "kv_heads"} <= attrs
    assert ("block_size" in attrs) == (fallback == "streamed")
    bodies = {(f.domain, f.name, f.overload) for f in proto.functions}
    assert ("sharp", "SharpAttention", f"cache.{norm}") in bodies and ("sharp", "SharpAttention", norm) not in bodies
    assert metadata.read(proto).export["kv_in_place"] is True
    meta = metadata.read(proto)
    assert [p.key for p in proto.metadata_props] == ["sharp"]  # one entry, the norm written once per layer
    assert meta.norm == norm and [layer.norm for layer in meta.layers] == [norm, norm]
    assert all(set(layer.parameters) == set(registry.get(norm).param_names) for layer in meta.layers)
    assert meta.model_config().to_dict() == model.cfg.to_dict()
    # independent of the CLI's own check: unseen lengths and a past cache, in a fresh session
    for _, d_logits, d_entropy in verify(out, model.cfg.shape, True, sharplm_reference(model)):
        assert d_logits < 1e-4 and d_entropy < 1e-4


def test_cached_decoding_through_onnx_equals_full_recomputation(tmp_path):
    model = _model("entmax", "nape")
    out = _export(tmp_path, model, "--no-check")
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    ids = np.random.default_rng(0).integers(0, 256, (2, 10))

    def run(tokens, past, start):
        b, length = tokens.shape
        feed = {
            "input_ids": tokens,
            "attention_mask": np.ones((b, start + length), np.int64),
            "position_ids": np.broadcast_to(np.arange(start, start + length), (b, length)).copy(),
        }
        for i in range(2):
            feed[f"past_key_values.{i}.key"], feed[f"past_key_values.{i}.value"] = past[2 * i], past[2 * i + 1]
        feed["logits_to_keep"] = np.array([1 if length == 1 else 0])  # a step: its one position; else every one
        return sess.run(None, feed)

    empty = [np.zeros((2, 2, 0, 8), np.float32)] * 4
    full = run(ids, empty, 0)
    step = run(ids[:, :6], empty, 0)
    logits, entropy = [step[0]], [step[-1]]
    for t in range(6, 10):
        step = run(ids[:, t : t + 1], step[1:-1], t)
        logits.append(step[0])
        entropy.append(step[-1])
    np.testing.assert_allclose(np.concatenate(logits, 1), full[0], atol=1e-5)
    np.testing.assert_allclose(np.concatenate(entropy, -1), full[-1], atol=1e-5)
    assert full[-1].shape == (2, 2, 4, 10)  # attention_entropy (B, layers, heads, L)


@pytest.mark.parametrize("native", [True, False], ids=["native", "fallback-bodies"])
def test_an_fp16_kv_cache_file(tmp_path, capsys, native):
    """`--kv-cache-dtype fp16`: the pasts and presents are float16 (metadata says so), the check judges the file
    against the fp32 model by fp16's bound, and a decode over fp16 pasts stays within that of the fp32 file."""
    model = _model("asentmax", "rope")
    out = _export(tmp_path, model, "--kv-cache-dtype", "fp16", *([] if native else ["--no-native"]))
    assert "check passed (fp16" in capsys.readouterr().out
    proto = onnx.load(out)
    kv = [v for v in (*proto.graph.input, *proto.graph.output) if v.name.startswith(("past_key_values.", "present."))]
    assert len(kv) == 8 and {v.type.tensor_type.elem_type for v in kv} == {onnx.TensorProto.FLOAT16}
    assert metadata.read(proto).kv_dtype == "fp16" and metadata.read(proto).kv_numpy_dtype is np.float16
    fp32 = tmp_path / "fp32"
    fp32.mkdir()
    wide = _export(fp32, model, "--no-check")
    ids = np.random.default_rng(1).integers(0, 256, (2, 12))
    got = {}
    names = [f"past_key_values.{i}.{kind}" for i in range(2) for kind in ("key", "value")]
    for path, dtype in ((out, np.float16), (wide, np.float32)):
        sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])

        def run(tokens, past, start, sess=sess):
            n = tokens.shape[1]
            feed = {"input_ids": tokens, "attention_mask": np.ones((2, start + n), np.int64),
                    "position_ids": np.tile(np.arange(start, start + n), (2, 1)),
                    "logits_to_keep": np.array([1])}  # fmt: skip
            return sess.run(None, {**feed, **dict(zip(names, past, strict=True))})

        first = run(ids[:, :11], [np.zeros((2, 2, 0, 8), dtype)] * 4, 0)
        assert all(p.dtype == dtype for p in first[1:-1])
        got[dtype] = run(ids[:, 11:], first[1:-1], 11)[0]
    diff = np.abs(got[np.float16] - got[np.float32]).max()
    assert 0 < diff < 1e-2  # rounded keys, not the fp32 ones


def test_per_layer_norms_and_no_kv_cache(tmp_path):
    model = _model("ssa", "alibi", layer_norms_override=["ssa", "adaptive"])
    out = _export(tmp_path, model, "--no-kv-cache")
    proto = onnx.load(out)
    assert [n.overload for n in proto.graph.node if n.domain == "sharp"] == ["ssa", "adaptive"]
    assert [i.name for i in proto.graph.input] == ["input_ids", "attention_mask", "position_ids"]


def test_allowed_norm_changes_on_a_softmax_model(tmp_path, capsys):
    model = _model("softmax")
    out = _export(tmp_path, model, "--norm", "adaptive", "--poly", "-0.05", "0.5", "-2.0", "4.5", "-1.5")
    assert [n.overload for n in onnx.load(out).graph.node if n.domain == "sharp"] == ["cache.adaptive"] * 2
    out = _export(tmp_path, model, "--norm", "ssmax", "--ssmax-s", "0.4")
    assert metadata.read(onnx.load(out)).layers[0].parameters["ssmax_s"] == [0.4] * 4
    assert capsys.readouterr().out.count("check passed") == 2


def test_fallback_none_needs_a_plugin(tmp_path):
    out = _export(tmp_path, _model("ssa"), "--fallback", "none")
    proto = onnx.load(out)
    assert not [f for f in proto.functions if f.domain.startswith("sharp")]
    with pytest.raises(Exception, match="SharpAttention"):
        ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize(
    ("setup", "args", "message"),
    [
        ("missing", [], "no such file or directory (expected a sharp checkpoint such as model.pt, a GGUF file, or a"),
        ("mistyped", [], "; did you mean "),
        ("garbage", [], "not a torch file (expected a sharp checkpoint"),
        ("truncated", [], "not a readable torch file (truncated or corrupt"),
        ("ssa", ["--block-size", "0"], "--block-size must be >= 1, got 0"),
        ("ssa", ["--weights", "int8", "--tensorrt"], "--weights int8 with --tensorrt: TensorRT files are fp32"),
        ("ssa", ["--norm", "softmax"], "cannot export a ssa model as softmax"),
        ("entmax", ["--norm", "ssa"], "ssa parameters are learned in training; retrain with sharp-train --norm ssa"),
        ("ssa", ["--norm", "adaptive"], "adaptive is an inference-time change of softmax models only (allowed for"),
        ("nan-alpha", [], "blocks.1.attn: alpha must be finite and >= 1 for every head"),
        ("read-only", [], "is a read-only file; choose another output path"),
        ("ssa", ["--genai", "-o", "OUT/x.onnx"], "--genai writes a package directory"),
        ("ssa", ["--genai-isa", "this-cpu"], "--genai-isa chooses the op library a --genai package ships; add --genai"),
        ("softmax", ["--norm", "ssmax"], "needs --ssmax-s"),
        ("max-retrieval", [], "is not a language model"),
        ("ssa", ["-o", "/nonexistent-dir/x.onnx"], "not a writable directory"),
        ("ssa", ["--kv-cache-dtype", "fp16", "--no-kv-cache"], "needs the KV cache: drop --no-kv-cache"),
        ("ssa", ["--kv-cache-dtype", "fp16", "--tensorrt"], "--tensorrt files do not have"),
    ],
)
def test_cli_errors_exit_2_with_one_line(tmp_path, capsys, setup, args, message):
    path = tmp_path / "model.pt"
    if setup == "garbage":
        path.write_bytes(b"\x00\x01 definitely not a checkpoint \xff" * 16)
    elif setup == "truncated":
        save(_model("ssa"), path)
        path.write_bytes(path.read_bytes()[:300])
    elif setup == "mistyped":
        save(_model("ssa"), path)
        path = tmp_path / "modle.pt"
    elif setup == "max-retrieval":
        save(MaxRetrieval(MaxRetrievalConfig(width=8)), path)
    elif setup == "nan-alpha":  # stored parameters outside their domain: refused where the checkpoint is read
        save(_model("entmax"), path)
        payload = torch.load(path, weights_only=True)
        payload["state_dict"]["blocks.1.attn.alpha_raw"][0] = float("nan")
        torch.save(payload, path)
    elif setup != "missing":
        save(_model("ssa" if setup == "read-only" else setup), path)
    if setup == "read-only":
        (tmp_path / "model.onnx").write_bytes(b"keep me")
        (tmp_path / "model.onnx").chmod(0o444)
    args = [a.replace("OUT", str(tmp_path)) for a in args]
    assert main([str(path), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    if setup == "read-only":
        assert (tmp_path / "model.onnx").read_bytes() == b"keep me"
    assert not (tmp_path / "x.onnx").exists()


def test_unknown_norm_lists_the_valid_ones_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path / "m.pt"), "--norm", "sparsemax"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--norm: invalid choice: 'sparsemax'" in err and "softmax" in err and len(err.strip().splitlines()) == 1


def test_a_bad_path_is_refused_before_torch_loads():
    """The command line and the model path are judged before torch (seconds to import) is: a new process that is
    refused has not imported it."""
    code = "import sys; from sharp.exporter.cli import main; print(main(['/none/m.pt']), 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["2", "False"]


def test_an_output_that_cannot_be_replaced_is_one_line_and_kept(tmp_path, capsys):
    """An existing -o that the file system will not let go (here an immutable file) ends in one line, exit 2, the
    old file kept and no temporary left behind."""
    path, out = tmp_path / "model.pt", tmp_path / "model.onnx"
    save(_model("ssa"), path)
    out.write_bytes(b"keep me")
    if subprocess.run(["chattr", "+i", str(out)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i needs root and a file system with attributes")
    try:
        assert main([str(path), "--no-check"]) == 2
    finally:
        subprocess.run(["chattr", "-i", str(out)], check=True)
    err = capsys.readouterr().err.strip()
    assert err == f"sharp-export: -o {out}: cannot be replaced (Operation not permitted); choose another output path"
    assert out.read_bytes() == b"keep me" and sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx", "model.pt"]


def test_the_command_prints_only_its_own_lines(tmp_path):
    """Library chatter (missing optional packages, deprecations, renamed axes) is silenced at the CLI."""
    ckpt = save(_model("ssa"), tmp_path / "model.pt")
    proc = subprocess.run(
        [sys.executable, "-m", "sharp.exporter.cli", str(ckpt), "-o", str(tmp_path / "m.onnx")],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0 and proc.stderr == ""
    lines = proc.stdout.splitlines()
    assert lines[-2].startswith("check passed") and lines[-1].startswith("wrote ")  # checked before it is written
    assert all(re.match(r"(wrote|check|prefill|decode) ", line) for line in lines), lines


def _called(nodes) -> set[str]:
    names = set()
    for node in nodes:
        names.add(node.op_type)
        for attr in node.attribute:
            for graph in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else attr.graphs:
                names |= _called(graph.node)
    return names


@pytest.mark.parametrize(("norm", "fallback"), [("softmax", "dense"), ("entmax", "streamed"), ("ssa", "streamed")])
def test_files_name_their_dimensions_and_carry_only_the_functions_they_call(tmp_path, norm, fallback):
    """Dynamic dimensions read batch / sequence / past_sequence / total_sequence (not torch's s53), and a file holds
    no helper its norm's body never calls (a softmax file has none of entmax's threshold parts)."""
    proto = onnx.load(_export(tmp_path, _model(norm), "--fallback", fallback, "--no-check"))
    dims = {d.dim_param for vi in (*proto.graph.input, *proto.graph.output) for d in vi.type.tensor_type.shape.dim}
    assert not any(re.search(r"\bs\d+\b", d) for d in dims), dims
    assert {"batch", "sequence", "past_sequence", "total_sequence"} <= dims
    assert "present_sequence" in dims  # the cache form: a present is as long as its buffer
    assert "kept_sequence" in dims  # logits at the last `logits_to_keep` positions (kept_logits.py)
    called = _called(proto.graph.node).union(*(_called(f.node) for f in proto.functions))
    assert all(f.name in called for f in proto.functions), [f.name for f in proto.functions if f.name not in called]
    assert ("ThresholdSums" in {f.name for f in proto.functions}) == (norm == "entmax")


def test_onnxruntime_fuses_every_rmsnorm_into_one_node(tmp_path):
    """The exported RMSNorm is the pattern onnxruntime's optimizer rewrites into one SimplifiedLayerNormalization
    node (each unfused norm is five or six small elementwise nodes, a decode step's main per-node cost)."""
    model = _model("softmax")
    path = _export(tmp_path, model, "--no-check")
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    ops = [n.op_type for n in onnx.load(options.optimized_model_filepath).graph.node]
    norms = 2 * model.cfg.layers + 1  # before attention and MLP in each block, then the final one
    assert ops.count("SimplifiedLayerNormalization") == norms, sorted(set(ops))
    assert not {"Sqrt", "Reciprocal", "Pow", "ReduceMean"} & set(ops)
