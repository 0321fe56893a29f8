"""Hugging Face models: sharp's attention inside transformers, export, serving with tokenizer.json.

No model hub is reachable: every model is built from a config with random weights (a wider init than
transformers' default, so attention is far from uniform and greedy choices are clear) and saved with
save_pretrained; the tokenizer is a byte-level BPE trained here with `tokenizers`.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import onnx
import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

from hf_models import SIZES, VOCAB, _configs, _train_tokenizer, load_eager, write_models  # noqa: E402
from tokenizers import Tokenizer, processors  # noqa: E402

from sharp.exporter import cli as export_cli  # noqa: E402
from sharp.exporter import metadata  # noqa: E402
from sharp.models import hf  # noqa: E402
from sharp.models.tokenizer import BYTES, HFTokenizer  # noqa: E402
from sharp.serving import Client  # noqa: E402
from sharp.serving.api.server import BackgroundServer, ServerConfig  # noqa: E402
from sharp.serving.backends.interface import BackendError  # noqa: E402
from sharp.serving.backends.loading import check_model_path, load_backend  # noqa: E402
from sharp.serving.config import EngineConfig  # noqa: E402
from sharp.serving.engine.engine import Engine  # noqa: E402
from sharp.serving.metrics import ServingMetrics  # noqa: E402


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    return write_models(tmp_path_factory.mktemp("hf"))


@pytest.mark.parametrize("family", list(_configs()))
def test_sharp_attention_matches_transformers_eager_with_padding_and_a_cache(hf_dirs, family):
    eager, ours = load_eager(hf_dirs[family]), hf.load_model(hf_dirs[family])
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (2, 40), generator=g)
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, :5] = 0  # left padding
    with torch.no_grad():
        want = eager(ids, attention_mask=mask).logits
        got = ours(ids, attention_mask=mask, output_attentions=True)
        assert want.abs().max() > 1.0  # logits far from flat: the comparison below is not about a constant
        assert (got.logits - want)[mask.bool()].abs().max() < 1e-4
        ent = torch.stack(got.attentions, 1)  # the entropy travels as the attention "weights"
        assert ent.shape == (2, 2, 4, 40) and bool((ent >= 0).all()) and bool((ent[0, :, :, 0] == 0).all())
        # a cache: prefill 30 tokens, then 10 more in two steps, against the whole sequence at once
        cache = transformers.DynamicCache(config=ours.config)
        ours(ids[:, :30], attention_mask=mask[:, :30], past_key_values=cache, use_cache=True)
        for start in (30, 31):
            stop = start + (1 if start == 30 else 9)
            step = ours(ids[:, start:stop], attention_mask=mask[:, :stop], past_key_values=cache, use_cache=True)
            diff = (step.logits - want[:, start:stop])[mask[:, start:stop].bool()].abs().max()
            assert diff < 1e-4, f"{family}: decode after {start} keys differs by {diff}"


def test_ministral3_query_temperature_is_honoured(hf_dirs):
    """Without the Llama-4-style scaling the logits at positions ≥ 16 would differ: check that they do, so the
    parity above covers the scaling rather than positions where it is 1."""
    path = hf_dirs["ministral3"]
    config = hf.load_config(path)
    flat = hf.load_config(path)
    flat.rope_parameters = {**flat.rope_parameters, "llama_4_scaling_beta": 0.0}
    ids = torch.randint(3, VOCAB, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        scaled = hf.load_model(path, config)(ids).logits
        unscaled = hf.load_model(path, flat)(ids).logits
    assert (scaled[:, :16] - unscaled[:, :16]).abs().max() < 1e-5
    assert (scaled[:, 20:] - unscaled[:, 20:]).abs().max() > 1e-2


def test_adaptive_never_raises_layer0_entropy(hf_dirs):
    path = hf_dirs["llama"]
    sharpened = hf.load_config(path)
    hf.sharpen(sharpened, "adaptive")
    ids = torch.randint(3, VOCAB, (2, 64), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        soft = hf.load_model(path)(ids, output_attentions=True).attentions[0]
        adaptive = hf.load_model(path, sharpened)(ids, output_attentions=True).attentions[0]
    assert bool((adaptive <= soft + 1e-5).all())
    assert float((soft - adaptive).max()) > 1e-3  # and it does sharpen somewhere


@pytest.mark.parametrize(
    "config, says",
    [
        (transformers.Gemma3TextConfig(**SIZES), "sliding-window"),
        (transformers.MistralConfig(**SIZES, sliding_window=64), "sliding-window attention (window 64"),
        (transformers.LlamaConfig(**SIZES, rope_parameters={"rope_type": "dynamic", "factor": 2.0}), "'dynamic'"),
        (
            transformers.LlamaConfig(**SIZES, rope_parameters={"rope_type": "default", "rope_theta": 1e4, "fancy": 1}),
            "unknown RoPE/scaling fields ['fancy']",
        ),
        (transformers.LlamaConfig(**SIZES, use_logn_attn=True), "use_logn_attn"),
        (
            transformers.LlamaConfig(**SIZES, rope_parameters={"rope_theta": 1e4, "llama_4_scaling_beta": 0.1}),
            "transformers' llama ignores it",
        ),
        (transformers.Qwen2Config(**SIZES, use_sliding_window=True, sliding_window=32), "sliding-window"),
        (transformers.BertConfig(), "model_type 'bert' is not supported"),
    ],
)
def test_what_sharp_cannot_reproduce_is_refused_with_the_reason(config, says):
    with pytest.raises(hf.UnsupportedModel) as err:
        hf.check_config(config)
    assert says in str(err.value)


def test_only_inference_time_norms_on_pretrained_models():
    config = transformers.LlamaConfig(**SIZES)
    for norm in ("entmax", "asentmax", "ssa"):
        with pytest.raises(hf.UnsupportedModel, match="learned in training") as refused:
            hf.sharpen(config, norm)
        # the way a transformers model learns them (sharp-train trains SharpLM checkpoints, not this)
        assert f'attn_implementation="sharp" and config.sharp_attention = {{"norm": "{norm}"}}' in str(refused.value)
        assert "sharp-train" not in str(refused.value)
    with pytest.raises(ValueError, match="ssmax needs ssmax_s"):
        hf.sharpen(config, "ssmax")
    hf.sharpen(config, "ssmax", ssmax_s=1.25)
    assert config.sharp_attention == {"norm": "ssmax", "ssmax_s": 1.25}
    hf.sharpen(config, "ssmax")  # the configured norm: kept with its stored value (a saved model re-exported)
    assert config.sharp_attention == {"norm": "ssmax", "ssmax_s": 1.25}
    hf.sharpen(config, "adaptive")  # the weights are softmax's: another inference-time change
    assert config.sharp_attention["norm"] == "adaptive"
    learned = transformers.LlamaConfig(**SIZES, sharp_attention={"norm": "entmax", "alpha": 1.3})
    hf.sharpen(learned, "entmax")
    assert learned.sharp_attention == {"norm": "entmax", "alpha": 1.3}
    with pytest.raises(hf.UnsupportedModel, match="cannot export a entmax model as adaptive"):
        hf.sharpen(learned, "adaptive")


def test_a_directory_whose_config_names_a_learned_norm_exports_with_it(hf_dirs, tmp_path):
    """config.json's sharp_attention (as a model trained with entmax carries it) is the norm sharp-export writes,
    with its value for every head, and the file's check against the PyTorch model passes."""
    src = hf_dirs["llama"]
    model = tmp_path / "entmax-llama"
    shutil.copytree(src, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "sharp_attention": {"norm": "entmax", "alpha": 1.3}}))
    out = tmp_path / "entmax.onnx"
    assert export_cli.main([str(model), "-o", str(out)]) == 0
    meta = metadata.read(out)
    assert meta.norm == "entmax" and meta.layers[0].parameters == {"alpha": [1.3] * 4}


def test_sharp_export_cli_on_a_model_directory(hf_dirs, tmp_path, capsys):
    out = tmp_path / "llama.onnx"
    assert export_cli.main([str(hf_dirs["llama"]), "--norm", "ssmax", "--ssmax-s", "1.2", "-o", str(out)]) == 0
    said = capsys.readouterr().out
    assert "2 × sharp::SharpAttention[ssmax]" in said and "check passed" in said
    assert "opset 23, RoPE as 4 RotaryEmbedding nodes" in said
    meta = metadata.read(out)
    assert meta.architecture == "transformers" and meta.norm == "ssmax"
    assert meta.layers[0].parameters == {"ssmax_s": [1.2] * 4}
    assert (meta.shape.layers, meta.shape.kv_heads, meta.shape.head_dim) == (2, 2, 16)
    assert isinstance(meta.tokenizer, HFTokenizer) and meta.tokenizer.eos == (2,)
    assert meta.config["model_type"] == "llama" and meta.config["sharp_attention"]["norm"] == "ssmax"
    for args, says in (
        (["--norm", "entmax"], "learned in training"),
        (["--norm", "ssmax"], "ssmax needs ssmax_s"),
    ):
        assert export_cli.main([str(hf_dirs["llama"]), *args, "-o", str(tmp_path / "x.onnx")]) == 2
        err = capsys.readouterr().err.strip()
        assert says in err and "\n" not in err
    (tmp_path / "empty").mkdir()
    assert export_cli.main([str(tmp_path / "empty"), "-o", str(tmp_path / "x.onnx")]) == 2
    assert "without config.json" in capsys.readouterr().err


@pytest.fixture(scope="module")
def exported(hf_dirs, tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("hf-onnx")
    files = {}
    for family in ("llama", "gpt2"):
        files[family] = out / f"x-{family}.onnx"  # not the model's name: the file keeps its directory's
        assert export_cli.main([str(hf_dirs[family]), "-o", str(files[family])]) == 0
    return files


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_sharp_serve_greedy_equals_transformers_generate(hf_dirs, exported, family):
    backend = load_backend(exported[family])
    assert backend.spec.name == family  # the id is the exported directory's name, whatever -o called the file
    engine = Engine(backend, EngineConfig(), ServingMetrics(backend.spec))
    eager = load_eager(hf_dirs[family])
    tok = Tokenizer.from_file(str(hf_dirs[family] / "tokenizer.json"))
    prompts = ["def main():\n", "The quick brown fox jumps over the lazy dog and", "Zoë 🎉"]
    with BackgroundServer(engine, ServerConfig(port=0, metrics_port=0)) as srv, Client(srv.target) as c:
        ids = {p: c.tokenize(p, add_bos=True) for p in prompts}
        assert ids[prompts[0]] == tok.encode(prompts[0]).ids  # the model's own template adds <s>
        # concurrent requests of different lengths share a left-padded batch
        futures = [c.stub.Generate.future(_request(p)) for p in prompts]
        for prompt, future in zip(prompts, futures, strict=True):
            r = future.result()
            with torch.no_grad():
                want = eager.generate(torch.tensor([ids[prompt]]), max_new_tokens=20, do_sample=False, pad_token_id=0)[
                    0, len(ids[prompt]) :
                ].tolist()
            assert list(r.token_ids) == want
            assert r.text == tok.decode(want, skip_special_tokens=True)
            streamed = "".join(ch.text for ch in c.generate_stream(prompt, max_new_tokens=20, temperature=0))
            assert streamed == r.text
        info = c.info()
        assert (info.layers, info.heads, info.context_length) == (2, 4, 512)


def _request(prompt: str):
    from sharp.serving.api.client import make_request

    return make_request(prompt, max_new_tokens=20, temperature=0)


def test_streamed_detokenization_never_splits_a_character(hf_dirs):
    tok = HFTokenizer.from_dir(hf_dirs["llama"], VOCAB, 1, [2])
    text = "数学 🎉 ✓ Ελληνικά crème brûlée — русский"
    ids = tok.encode(text, bos=False)
    assert len(ids) > len(text.split())  # multi-byte characters span several tokens
    stream = tok.stream()
    pieces = [stream.step(i) for i in ids]
    assert "".join(pieces) + stream.finish() == text
    assert all("\ufffd" not in p for p in pieces) and "" in pieces  # held back while a character is incomplete


def test_byte_tokenizer_as_tokenizer_json_encodes_and_decodes_the_same():
    tok = Tokenizer.from_str(BYTES.tokenizer_json())
    for text in ("", "hello wörld", "数学 🎉\n\t ✓", " leading space", "\x00\x7f"):
        assert tok.encode(text).ids == BYTES.encode(text)
        assert tok.decode(BYTES.encode(text)[1:]) == text
    assert tok.token_to_id("<bos>") == BYTES.bos and tok.token_to_id("<eos>") == BYTES.eos


def test_metadata_of_a_transformers_file_round_trips_and_is_checked(exported):
    import onnx

    proto = onnx.load(str(exported["llama"]), load_external_data=False)
    meta = metadata.read(proto)
    metadata.check_graph(meta, *metadata.graph_io(proto))
    assert meta.tokenizer.encode("def") == HFTokenizer.from_dict(meta.tokenizer.to_dict(), meta.tokenizer.json).encode(
        "def"
    )
    entry = json.loads(next(p.value for p in proto.metadata_props if p.key == metadata.KEY))
    for change, says in (
        ({"architecture": "jax"}, "architecture 'jax'"),
        ({"shape": {**entry["shape"], "kv_heads": 3}}, "not a multiple of kv_heads"),
        ({"tokenizer": {**entry["tokenizer"], "vocab_size": "many"}}, "does not describe a model"),
    ):
        with pytest.raises(metadata.MetadataError) as err:
            metadata.parse(json.dumps({**entry, **change}), meta.tokenizer.json)
        assert says in str(err.value)
    with pytest.raises(metadata.MetadataError, match=r"carries no tokenizer\.json"):
        metadata.parse(json.dumps(entry))
    with pytest.raises(BackendError, match="sharp-export"):
        load_backend(exported["llama"].parent)  # a directory is not a servable file


def test_rope_is_one_rotary_embedding_per_tensor_and_a_file_without_rope_keeps_its_opset(hf_dirs, exported):
    """A Llama's rotate-half RoPE (six nodes for each of a layer's queries and keys as traced) is one opset-23
    RotaryEmbedding each in the file, graph and fallback functions then importing opset 23 (the tokens and the
    export check that prove it computes the same are the other tests of this file); GPT-2 (learned positions)
    has none and stays at opset 18."""
    import onnx

    layers = transformers.AutoConfig.from_pretrained(hf_dirs["llama"]).num_hidden_layers
    for family, ropes, opset in (("llama", 2 * layers, 23), ("gpt2", 0, 18)):
        proto = onnx.load(str(exported[family]), load_external_data=False)
        kinds = [n.op_type for n in proto.graph.node]
        assert kinds.count("RotaryEmbedding") == ropes and metadata.read(proto).export["rotary_embedding"] == ropes
        assert (kinds.count("Neg"), kinds.count("Cos"), kinds.count("Sin")) == ((0, 1, 1) if ropes else (0, 0, 0))
        versions = {i.version for g in [proto.opset_import, *(f.opset_import for f in proto.functions)]
                    for i in g if i.domain == ""}  # fmt: skip
        assert versions == {opset}


def test_sibling_projections_are_one_matmul_each(hf_dirs, exported):
    """A Llama layer's q/k/v projections are one MatMul and its gate/up another (exporter/siblings.py; that the
    file computes what transformers does is this file's other tests); GPT-2's attention is one Conv1D already."""
    import onnx

    layers = transformers.AutoConfig.from_pretrained(hf_dirs["llama"]).num_hidden_layers
    for family, fused, matmuls in (("llama", 3 * layers, 4 * layers + 1), ("gpt2", 0, None)):
        proto = onnx.load(str(exported[family]), load_external_data=False)
        assert metadata.read(proto).export["sibling_matmuls_fused"] == fused
        kinds = [n.op_type for n in proto.graph.node]
        assert kinds.count("Split") >= (2 * layers if fused else 0)
        if matmuls is not None:  # q·k·v, o, gate·up, down per layer, and the head
            assert kinds.count("MatMul") == matmuls


def _genai_greedy(package: Path, ids: list[int], n: int) -> list[int]:
    og = pytest.importorskip("onnxruntime_genai", reason="the genai extra (onnxruntime-genai) is not installed")
    model = og.Model(str(package))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(ids) + n, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(ids)
    out = []
    while not generator.is_done():
        generator.generate_next_token()
        out.append(int(generator.get_next_tokens()[0]))
    return out


def test_genai_package_of_a_transformers_model_generates_transformers_greedy_tokens(hf_dirs, tmp_path):
    og = pytest.importorskip("onnxruntime_genai", reason="the genai extra (onnxruntime-genai) is not installed")
    package = tmp_path / "llama-genai"
    assert export_cli.main([str(hf_dirs["llama"]), "--norm", "adaptive", "--genai", "-o", str(package)]) == 0
    config = json.loads((package / "genai_config.json").read_text())
    assert config["search"]["past_present_share_buffer"] is True and config["model"]["eos_token_id"] == [2]
    library = config["model"]["decoder"]["session_options"].get("custom_ops_library")
    assert library is None or (package / library).is_file()  # sharp's kernel travels inside the package
    prompt = "The quick brown fox"
    tok = HFTokenizer.from_dir(hf_dirs["llama"], VOCAB, 1, [2])
    ids = tok.encode(prompt)
    genai_tok = og.Tokenizer(og.Model(str(package)))
    genai_tok.update_options(add_special_tokens="true")  # genai adds none unless told (docs/hf.md)
    assert list(genai_tok.encode(prompt)) == ids and ids[0] == config["model"]["bos_token_id"]
    sharpened = hf.load_config(hf_dirs["llama"])
    hf.sharpen(sharpened, "adaptive")
    with torch.no_grad():
        want = (
            hf.load_model(hf_dirs["llama"], sharpened)
            .generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, pad_token_id=0)[0, len(ids) :]
            .tolist()
        )
    assert _genai_greedy(package, ids, 16) == want
    inputs = {i.name for i in onnx.load(package / "model.onnx", load_external_data=False).graph.input}
    assert "logits_to_keep" not in inputs and "input_ids" in inputs  # onnxruntime-genai feeds what it knows
    assert check_model_path(package, "onnxruntime") == package / "model.onnx"  # sharp-serve takes the package
    backend = load_backend(package)
    assert backend.spec.name == "llama" and backend.spec.norm == "adaptive"  # named as its source, not "model"
    del backend
    _one_bos_rule(package, tmp_path / "source")


def _one_bos_rule(package: Path, source: Path) -> None:
    """sharp's encode, onnxruntime-genai's on the package and transformers' on the package agree on BOS for every
    way tokenizer_config.json's `add_bos_token` (absent, false, true) and the post-processor (BOS or none) combine —
    the package states sharp's decision in its config and, when BOS comes from the config alone, in its file."""
    import onnxruntime_genai as og

    from sharp.exporter.genai import tokenizer_files

    source.mkdir()
    prompt = "The quick brown fox"
    for template in (True, False):
        backend = _train_tokenizer()
        if not template:
            backend.post_processor = None
        backend.save(str(source / "tokenizer.json"))
        for add_bos in (None, False, True):
            options = {"bos_token": "<s>", "eos_token": "</s>"}
            if add_bos is not None:
                options["add_bos_token"] = add_bos
            (source / "tokenizer_config.json").write_text(json.dumps(options))
            ours = HFTokenizer.from_dir(source, VOCAB, 1, [2])
            want = ours.encode(prompt)
            assert (want[0] == 1) == (template or bool(add_bos)), (template, add_bos)
            text, package_config = tokenizer_files(ours)
            (package / "tokenizer.json").write_text(text)
            (package / "tokenizer_config.json").write_text(json.dumps(package_config))
            assert package_config["add_bos_token"] == ours.adds_bos == (want[0] == 1)
            genai = og.Tokenizer(og.Model(str(package)))
            genai.update_options(add_special_tokens="true")
            assert list(genai.encode(prompt)) == want, (template, add_bos)
            assert transformers.AutoTokenizer.from_pretrained(str(package)).encode(prompt) == want, (template, add_bos)
            if template:  # the source as transformers reads it: its post-processor's BOS, whatever the config says
                assert transformers.AutoTokenizer.from_pretrained(str(source)).encode(prompt) == want


@pytest.mark.parametrize(
    ("isa", "kv"), [("portable", "fp32"), ("this-cpu", "fp32"), (None, "fp32"), ("this-cpu", "fp16"), (None, "fp16")]
)
def test_genai_package_of_a_sharplm_model_uses_the_byte_tokenizer(tmp_path, isa, kv):
    """With sharp's kernel in the package — the baseline build, or with --genai-isa this-cpu the widest this CPU
    runs — and without (None: the cache form's fallback bodies), onnxruntime-genai's shared past/present buffers
    give the model's own greedy tokens; also with the buffers in float16 (--kv-cache-dtype fp16)."""
    from sharp.plugins.onnxruntime import library_isa, library_path

    og = pytest.importorskip("onnxruntime_genai", reason="the genai extra (onnxruntime-genai) is not installed")
    from sharp.models import ModelConfig, SharpLM, save
    from sharp.models.sampling import GREEDY

    torch.manual_seed(0)
    model = SharpLM(ModelConfig(vocab_size=258, dim=32, layers=2, heads=2, norm="ssa", context_length=256))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.2)
    save(model, tmp_path / "tiny.pt")
    package = tmp_path / "tiny-genai"
    flags = {"portable": [], "this-cpu": ["--genai-isa", "this-cpu"], None: ["--no-native"]}[isa]
    flags += ["--kv-cache-dtype", kv]
    assert export_cli.main([str(tmp_path / "tiny.pt"), "--genai", "-o", str(package), *flags]) == 0
    past = next(i for i in onnx.load(package / "model.onnx").graph.input if i.name.startswith("past_key_values."))
    assert past.type.tensor_type.elem_type == {"fp32": onnx.TensorProto.FLOAT, "fp16": onnx.TensorProto.FLOAT16}[kv]
    config = json.loads((package / "genai_config.json").read_text())
    assert config["search"]["past_present_share_buffer"] is True
    shipped = config["model"]["decoder"]["session_options"].get("custom_ops_library")
    assert (shipped is not None) == (isa is not None)
    if isa is not None:
        want = library_path(portable=isa == "portable")
        assert library_isa(package / shipped) == library_isa(want) and shipped == Path(want).name
    prompt = "def main(): ✓"
    assert list(og.Tokenizer(og.Model(str(package))).encode(prompt)) == BYTES.encode(prompt, bos=False)
    ids = BYTES.encode(prompt)
    assert _genai_greedy(package, ids, 20) == model.generate(ids, 20, GREEDY)


def test_genai_option_never_writes_over_anything(hf_dirs, tmp_path, capsys):
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    for out, says in ((busy, "not an empty directory"), (hf_dirs["llama"] / "pkg", "inside) the input model")):
        assert export_cli.main([str(hf_dirs["llama"]), "--genai", "-o", str(out)]) == 2
        assert says in capsys.readouterr().err
    assert (busy / "keep.txt").read_text() == "mine" and not (hf_dirs["llama"] / "pkg").exists()


def test_bos_and_eos_come_from_the_model_directory(tmp_path):
    from sharp.exporter.hf import special_ids

    tok = _train_tokenizer()
    tok.post_processor = None  # no template: BOS only through tokenizer_config.json's add_bos_token
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": True}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, 7]}))
    config = transformers.LlamaConfig(**{**SIZES, "eos_token_id": [2, 9]})  # 2 twice: listed once
    bos, eos = special_ids(tmp_path, config)
    assert (bos, eos) == (1, [2, 7, 9])
    prepending = HFTokenizer.from_dir(tmp_path, VOCAB, bos, eos)
    assert prepending.prepend_bos and prepending.encode("def")[0] == 1 and prepending.encode("def", bos=False)[0] != 1
    assert prepending.eos_ids == {2, 7, 9}
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(tmp_path / "tokenizer.json"))
    templated = HFTokenizer.from_dir(tmp_path, VOCAB, bos, eos)
    assert not templated.prepend_bos and templated.encode("def")[:2] != [1, 1]  # BOS once, from the template
    (tmp_path / "tokenizer.json").unlink()
    from sharp.exporter.hf import load_tokenizer

    with pytest.raises(ValueError, match="no tokenizer"):
        load_tokenizer(tmp_path, config)


def test_rms_norms_export_in_the_form_onnxruntime_fuses_and_only_those_that_compute_it(hf_dirs, exported, tmp_path):
    """Every RMSNorm of a Llama export (two per layer and the final one) becomes one SimplifiedLayerNormalization in
    onnxruntime's optimized graph — five nodes fewer each in every step — while a norm computing something else
    (a (1 + weight) variant) keeps its own forward."""
    import collections

    import onnx
    import onnxruntime as ort

    from sharp.exporter.hf import fusable_norms
    from sharp.plugins.onnxruntime import library_path

    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    options.register_custom_ops_library(library_path())
    ort.InferenceSession(str(exported["llama"]), options, providers=["CPUExecutionProvider"])
    kinds = collections.Counter(n.op_type for n in onnx.load(str(tmp_path / "optimized.onnx")).graph.node)
    layers = transformers.AutoConfig.from_pretrained(hf_dirs["llama"]).num_hidden_layers
    assert kinds["SimplifiedLayerNormalization"] == 2 * layers + 1 and kinds["ReduceMean"] == 0

    class OffsetRMSNorm(torch.nn.Module):  # Gemma's form: x / rms · (1 + weight)
        def __init__(self):
            super().__init__()
            self.weight, self.variance_epsilon = torch.nn.Parameter(torch.full((8,), 0.5)), 1e-6

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon) * (1 + self.weight)

    norm = OffsetRMSNorm()
    with fusable_norms(torch.nn.Sequential(norm)) as swapped:
        assert swapped == 0 and "forward" not in vars(norm)


@pytest.mark.parametrize("weights", ["int8", "fp16"])
def test_a_transformers_model_exports_checks_and_serves_at_a_lower_precision(hf_dirs, tmp_path, weights):
    out = tmp_path / f"llama-{weights}.onnx"
    assert export_cli.main([str(hf_dirs["llama"]), "-o", str(out), "--weights", weights]) == 0
    backend = load_backend(out)
    engine = Engine(backend, EngineConfig(), ServingMetrics(backend.spec))
    with BackgroundServer(engine, ServerConfig(port=0, metrics_port=None)) as srv, Client(srv.target) as c:
        assert c.info().precision == weights
        r = c.generate("The quick brown fox", max_new_tokens=8, temperature=0, stop=[])
        assert r.usage.completion_tokens == 8


def _readme_recipe() -> tuple[str, str]:
    """The README's "your Hugging Face model" commands: its shell block and its Python block."""
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    after = text.split("<!-- recipe:", 1)[1]
    shell = after.split("```bash\n", 1)[1].split("```", 1)[0]
    python = after.split("```python\n", 1)[1].split("```", 1)[0]
    return shell.strip(), python


def test_the_readme_recipe_serves_a_hugging_face_directory(hf_dirs, tmp_path):
    """`sharp-serve ./my-llama --http-port 8000`, then the openai SDK, exactly as the README has them — followed
    twice on one machine, the second server beside the first with another HTTP port, and nothing else added: the
    directory is exported once, checked, into the cache and served under its own name; the second start finds the
    export by the directory's content, and its defaulted gRPC port, taken by the first (or anyone), yields to a free
    one; neither opens a metrics port of its own (/metrics is on the HTTP port)."""
    import os
    import signal
    import socket
    import subprocess
    import sys

    shutil.copytree(hf_dirs["llama"], tmp_path / "my-llama")
    shell, python = _readme_recipe()

    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    env = {
        **os.environ,
        "SHARP_CACHE": str(tmp_path / "cache"),
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }

    def start(port: int) -> tuple[subprocess.Popen, list[str]]:
        command = "exec " + shell.split("#")[0].replace("8000", str(port))
        proc = subprocess.Popen(command, shell=True, cwd=tmp_path, env=env, stdout=subprocess.PIPE, text=True)
        lines = []
        while not (lines and lines[-1].startswith("sharp-serve: my-llama (")):
            line = proc.stdout.readline()
            assert line, f"sharp-serve ended: {lines}"
            lines.append(line)
        return proc, lines

    def ask(port: int) -> None:
        called = subprocess.run([sys.executable, "-c", python.replace("8000", str(port))], capture_output=True,
                                text=True, timeout=120)  # fmt: skip
        assert called.returncode == 0, called.stderr[-2000:]

    def stop(proc: subprocess.Popen) -> None:  # SIGTERM drains: exit 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0

    first, second = None, None
    try:
        first, lines = start(port := free_port())
        assert lines[0].startswith("sharp-serve: exporting my-llama once (checked) into ")
        assert any("check passed" in line for line in lines) and "metrics http" not in lines[-1]
        ask(port)
        exports = list((tmp_path / "cache" / "exports").glob("*/model.onnx"))
        assert len(exports) == 1
        second, again = start(other := free_port())  # the same content: found, not exported again
        assert f"sharp-serve: my-llama exported before: {exports[0]}\n" in again
        assert again[0].startswith("sharp-serve: 127.0.0.1:50051 (the default --port) is taken; listening on a free")
        grpc_ports = [re.search(r" on 127\.0\.0\.1:(\d+)", said[-1])[1] for said in (lines, again)]
        assert grpc_ports[0] != grpc_ports[1] and "metrics http" not in again[-1], again
        ask(other)
    finally:
        for proc in (first, second):
            if proc is not None:
                stop(proc)


def test_the_export_cache_key_follows_the_directory_content(hf_dirs, tmp_path):
    from sharp.models.cache import content_key

    model = shutil.copytree(hf_dirs["llama"], tmp_path / "m")
    key = content_key(model)
    (model / ".cache").mkdir()
    (model / ".cache" / "download.lock").write_text("a download tool's own state")
    assert content_key(model) == key  # hidden files are not the model
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "rope_theta": 20000.0}))
    assert content_key(model) != key


def test_a_directory_sharp_export_refuses_ends_sharp_serve_with_its_one_line(tmp_path):
    """sharp-serve DIR passes sharp-export's own refusal on, as one line and exit 2, and keeps nothing in the cache."""
    import os
    import subprocess
    import sys

    model = tmp_path / "not-a-llama"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    env = {**os.environ, "SHARP_CACHE": str(tmp_path / "cache")}
    cmd = [sys.executable, "-m", "sharp.serving.cli", str(model), "--port", "0", "--metrics-port", "-1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"sharp-serve: {model}: not exported: "), err
    assert err[0].count(str(model)) == 1 and "does not recognize this architecture" in err[0]
    assert not list((tmp_path / "cache").rglob("*.onnx"))


TOOLS_TEMPLATE = """{%- if tools %}<|im_start|>system
You may call functions.
<tools>
{%- for t in tools %}
{{ t | tojson }}
{%- endfor %}
</tools><|im_end|>
{% endif %}
{%- for m in messages %}<|im_start|>{{ m.role }}
{{ m.content }}{% for c in m.tool_calls or [] %}<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def test_tools_on_a_llama_whose_template_renders_them(hf_dirs, tmp_path):
    """A random-weight Llama exported from its directory with a Qwen-style chat template that renders tools:
    through the openai SDK and LangChain, forced calls (required, LangChain's "any") are well-formed calls whose
    arguments validate against the tool's schema at temperature 1, and a tool result sent back is answered."""
    import jsonschema
    import openai
    from langchain_openai import ChatOpenAI

    model_dir = tmp_path / "llama-tools"
    shutil.copytree(hf_dirs["llama"], model_dir)
    (model_dir / "chat_template.jinja").write_text(TOOLS_TEMPLATE, encoding="utf-8")
    assert export_cli.main([str(model_dir), "-o", str(tmp_path / "llama.onnx")]) == 0
    schema = {"type": "object", "properties": {"city": {"enum": ["Oslo", "Rome"]},
              "days": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["city", "days"],
              "additionalProperties": False}  # fmt: skip
    tools = [
        {"type": "function", "function": {"name": "get_weather", "description": "a forecast", "parameters": schema}}
    ]
    backend = load_backend(tmp_path / "llama.onnx")
    engine = Engine(backend, EngineConfig(), ServingMetrics(backend.spec))
    with BackgroundServer(engine, ServerConfig(port=0, metrics_port=None, http_port=0)) as srv:
        base = f"http://127.0.0.1:{srv.server.http_port}/v1"
        oa = openai.OpenAI(base_url=base, api_key="none")
        messages = [{"role": "user", "content": "weather in Oslo?"}]
        for seed in range(4):
            r = oa.chat.completions.create(model="llama-tools", messages=messages, tools=tools, tool_choice="required",
                                           parallel_tool_calls=False, temperature=1.0, seed=seed,
                                           max_tokens=100)  # fmt: skip
            assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
            (call,) = r.choices[0].message.tool_calls
            assert call.function.name == "get_weather"
            jsonschema.validate(json.loads(call.function.arguments), schema)
        history = [*messages, r.choices[0].message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]  # fmt: skip
        answer = oa.chat.completions.create(model="llama-tools", messages=history, max_tokens=8, seed=0)  # context 512
        assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")

        llm = ChatOpenAI(model="llama-tools", base_url=base, api_key="none", temperature=1.0, max_tokens=100, seed=1)
        msg = llm.bind_tools(tools, tool_choice="any", parallel_tool_calls=False).invoke("weather?")
        assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather", msg
        jsonschema.validate(msg.tool_calls[0]["args"], schema)


def test_sharp_export_of_a_directory_prints_only_its_own_lines(hf_dirs, tmp_path):
    """transformers' weight-loading progress bar is library chatter: sharp-export's output is its own lines."""
    import subprocess
    import sys

    out = tmp_path / "m.onnx"
    proc = subprocess.run([sys.executable, "-m", "sharp.exporter.cli", str(hf_dirs["llama"]), "-o", str(out)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0 and out.exists(), proc.stderr
    assert "%|" not in proc.stderr + proc.stdout and "Loading" not in proc.stderr, proc.stderr[-500:]
