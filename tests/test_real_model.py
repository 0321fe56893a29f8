"""sharp on a real model: SmolLM2-135M-Instruct, the Q4_1 GGUF `make install` brings (sharp/smollm2.py).

The GGUF is read and exported once per run, by sharp-export itself (its check included); then greedy parity with
transformers' own attention (not sharp's), int8's agreement on real text, and the agents' API answering sensibly
through the openai SDK. On random weights none of these could fail for the right reasons: greedy parity there is a
coin toss between near-equal logits, and a quantized file has no confident positions to get wrong.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import onnx
import pytest
import torch
from helpers import api, greedy_request, run_until_idle, serving

from sharp import smollm2
from sharp.exporter import metadata
from sharp.exporter.check import verify_text
from sharp.exporter.cli import main as export_main
from sharp.exporter.precision import quantize
from sharp.models import gguf
from sharp.plugins.onnxruntime import choose_library
from sharp.serving import Engine, EngineConfig, load_backend
from sharp.serving.engine.output import Delta

pytestmark = pytest.mark.slow

NAME = "SmolLM2-135M-Instruct.Q4_1"  # the GGUF's name, kept by the export whatever -o called the file
PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain in two sentences what a Python list is.",
]
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def real(tmp_path_factory) -> dict:
    """The GGUF read into a Hugging Face directory and exported by `sharp-export FILE.gguf --weights fp32` (the
    dequantized weights, the reference the other precisions are held to), in a cache of this run's own."""
    root = tmp_path_factory.mktemp("real")
    old = os.environ.get("SHARP_CACHE")
    os.environ["SHARP_CACHE"] = str(root / "cache")
    try:
        out = root / "smollm2.onnx"
        # unchecked here: the tests below hold the file to transformers more strictly than the export's check, and
        # the wheel's demo (tests/test_packaging.py) runs a checked export of the same GGUF
        assert export_main([str(smollm2.gguf_path()), "-o", str(out), "--weights", "fp32", "--no-check"]) == 0
        directory = gguf.hf_directory(smollm2.gguf_path())  # what the export read: found in the cache now
    finally:
        if old is None:
            del os.environ["SHARP_CACHE"]
        else:
            os.environ["SHARP_CACHE"] = old
    return {"onnx": out, "dir": directory, "cache": root / "cache"}


def test_a_read_gguf_s_header_comes_from_its_directory_without_parsing_the_file_again(real, monkeypatch):
    """The cached directory keeps the header the file's parse gave; with it there, the file is not parsed (2.7 s)."""
    import gguf as gguf_package

    path = smollm2.gguf_path()
    kept = json.loads((real["dir"] / gguf.HEADER_FILE).read_text())
    parsed = gguf_package.GGUFReader(path)
    types: dict[str, int] = {}
    for tensor in parsed.tensors:
        types[tensor.tensor_type.name] = types.get(tensor.tensor_type.name, 0) + 1
    assert kept == {"architecture": "llama", "tensor_types": types} and types["Q4_1"] == 210
    monkeypatch.setenv("SHARP_CACHE", str(real["cache"]))
    monkeypatch.setattr(gguf_package, "GGUFReader", lambda *a, **k: pytest.fail("the GGUF was parsed again"))
    gguf._read_header.cache_clear()
    assert gguf.read_header(path) == gguf.Header(**kept)
    assert gguf.hf_directory(path) == real["dir"]
    gguf._read_header.cache_clear()


@pytest.fixture(scope="module")
def transformers_model(real):
    """The dequantized weights in transformers with its own attention: the reference sharp is held to."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(real["dir"], dtype=torch.float32).eval()


def _chat_ids(tokenizer, question: str) -> list[int]:
    from sharp.models.tokenizer import render_chat

    return tokenizer.encode(render_chat(tokenizer, [{"role": "user", "content": question}]), bos=False)


def _sharp_greedy(path: Path, prompts: list[list[int]], native: bool) -> list[list[int]]:
    """Greedy tokens of the exported file through sharp's engine (all prompts in one batch)."""
    return _engine_greedy(load_backend(path, native=native), prompts)


def _engine_greedy(be, prompts: list[list[int]]) -> list[list[int]]:
    eng = Engine(be, EngineConfig(max_batch=len(prompts)))
    got: list[list[int]] = [[] for _ in prompts]
    for i, ids in enumerate(prompts):
        req = greedy_request(eng, ids, NEW_TOKENS, ignore_eos=True)
        eng.submit(req, lambda ev, i=i: isinstance(ev, Delta) and got[i].extend(ev.token_ids))
    run_until_idle(eng)
    return got


def _transformers_greedy(model, ids: list[int]) -> list[int]:
    """NEW_TOKENS greedy tokens, end of turn included and gone past (as sharp's ignore_eos does)."""
    out, past, x = [], None, torch.tensor([ids])
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            step = model(input_ids=x, past_key_values=past, use_cache=True)
            past, token = step.past_key_values, int(step.logits[0, -1].argmax())
            out.append(token)
            x = torch.tensor([[token]])
    return out


def test_the_gguf_is_read_with_its_own_config_tokenizer_and_chat_template(real):
    config = json.loads((real["dir"] / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"], config["num_key_value_heads"]) == ("llama", 30, 3)
    assert config["rope_parameters"]["rope_theta"] == 100000.0 and config["tie_word_embeddings"] is True
    meta = metadata.read(real["onnx"])
    tok = meta.tokenizer
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    assert tok.eos_ids == {2} and tok.encode("Paris", bos=True) == tok.encode("Paris", bos=False)  # no BOS added
    assert meta.shape.context_length == 8192 and meta.norm == "softmax"


@pytest.fixture(scope="module")
def greedy(real, transformers_model) -> tuple[list[list[int]], list[list[int]]]:
    """The chat prompts' ids and transformers' greedy tokens after them."""
    tok = metadata.read(real["onnx"]).tokenizer
    prompts = [_chat_ids(tok, p) for p in PROMPTS]
    return prompts, [_transformers_greedy(transformers_model, ids) for ids in prompts]


def test_greedy_tokens_equal_transformers_for_64_tokens(real, greedy):
    """fp32 export, native op and the file's own fallback bodies: transformers' greedy tokens on three chat
    prompts (a wrong RoPE θ, an untied head, an off-by-one KV head or a lost chat template fails this)."""
    tok = metadata.read(real["onnx"]).tokenizer
    prompts, want = greedy
    assert tok.decode(want[0]).startswith("The capital of France is Paris.")
    assert _sharp_greedy(real["onnx"], prompts, native=True) == want
    assert _sharp_greedy(real["onnx"], prompts[:2], native=False) == want[:2]  # the fallback bodies: slower, two


def test_the_torch_backend_serves_the_gguf_with_transformers_greedy_tokens(real, greedy, monkeypatch):
    """`sharp-serve FILE.gguf --backend torch` (a GPU node's path): the GGUF's directory read into sharp's own
    modules, on the paged cache, in one batch: transformers' greedy tokens, under the GGUF's name."""
    monkeypatch.setenv("SHARP_CACHE", str(real["cache"]))  # the directory the fixture read, not read again
    be = load_backend(smollm2.gguf_path(), "torch")
    assert be.spec.name == NAME and be.spec.tokenizer.chat_template
    prompts, want = greedy
    assert [_chat_ids(be.spec.tokenizer, p) for p in PROMPTS] == prompts  # the same tokenizer and template
    assert _engine_greedy(be, prompts) == want


def test_int8_weights_agree_with_fp32_on_real_text(real, tmp_path):
    """The int8 file against the fp32 model on held-out text, by the export's own check: what it measured on the
    real model (top-1 96.9% of all 544 positions, 100% of the 262 confident ones, mean KL 3e-3; on 2×512 tokens of
    the same text perplexity 10.41 against fp32's 10.45)."""
    from sharp.exporter import hf as hf_export
    from sharp.models import hf

    int8 = tmp_path / "int8.onnx"
    onnx.save(quantize(onnx.load(real["onnx"]), "int8"), int8)
    model = hf.load_model(real["dir"])
    shape = metadata.read(real["onnx"]).shape
    library, _ = choose_library(True)
    rows = verify_text(int8, shape, True, lambda ids: hf_export.reference(model, ids), library)
    total = dict(rows)["all"]
    assert total.confident >= 100 and total.confident_top1 >= 0.99
    assert total.top1 >= 0.95 and total.kl <= 0.005  # the export check's own int8 bound on KL
    fp32 = verify_text(real["onnx"], shape, True, lambda ids: hf_export.reference(model, ids), library)
    assert dict(fp32)["all"].top1 == 1.0 and dict(fp32)["all"].kl < 1e-6  # the measure itself: fp32 is exact


def test_the_files_own_q4_1_weights_are_served_as_they_are(real, tmp_path):
    """int4 of the GGUF (its default) keeps llama.cpp's blocks: every projection a 4-bit MatMulNBits on the file's own
    grid, the tied head 8-bit on its Q8_0 grid. In fp32 dot products (accuracy level 0) the logits are the
    dequantized model's within fp32 rounding; as served (level 4: int8 activations, as llama.cpp's Q4_1 kernels)
    within the int8 bound with room (measured: mean KL 3.8e-3, 100% top-1 where fp32 is confident). Re-quantizing
    the same weights onto onnxruntime's own grid instead measured mean KL 0.19, 78.6% top-1: the check refused it."""
    from sharp.exporter import hf as hf_export
    from sharp.models import hf

    proto = quantize(onnx.load(real["onnx"]), "int4")
    nbits = [n for n in proto.graph.node if n.op_type == "MatMulNBits"]
    widths = sorted(next(a.i for a in n.attribute if a.name == "bits") for n in nbits)
    assert widths == [4] * 120 + [8]  # 30 layers × (qkv, o, gate/up, down) at 4 bits; the head at 8
    model = hf.load_model(real["dir"])
    shape = metadata.read(real["onnx"]).shape
    library, _ = choose_library(True)
    reference = lambda ids: hf_export.reference(model, ids)
    served = tmp_path / "int4.onnx"
    onnx.save(proto, served)
    total = dict(verify_text(served, shape, True, reference, library))["all"]
    assert total.kl <= 5e-3 and total.confident_top1 >= 0.99
    for node in nbits:
        next(a for a in node.attribute if a.name == "accuracy_level").i = 0
    exact = tmp_path / "int4-fp32-dots.onnx"
    onnx.save(proto, exact)
    total = dict(verify_text(exact, shape, True, reference, library))["all"]
    assert total.max_logit_error <= 1e-3 and total.kl <= 1e-8 and total.top1 == 1.0


@pytest.fixture(scope="module")
def served(real):
    with serving({"onnxruntime": real["onnx"]}, server={"http_port": 0}, max_batch=4) as srv:
        yield srv


def test_a_chat_answer_is_a_real_answer(served):
    client = api(served)
    assert [m.id for m in client.models.list()] == [NAME]  # served from smollm2.onnx, named as the GGUF
    reply = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=32, temperature=0
    )
    assert "Paris" in reply.choices[0].message.content and reply.choices[0].finish_reason == "stop"


def test_a_json_schema_answer_is_valid_and_sensible(served):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    }
    reply = api(served).chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON with the key city."}],
        response_format={"type": "json_schema", "json_schema": {"name": "capital", "schema": schema, "strict": True}},
        max_tokens=40,
        temperature=0,
    )
    assert json.loads(reply.choices[0].message.content) == {"city": "Paris"}


def test_a_forced_tool_call_names_the_city_and_its_result_is_used(served):
    client = api(served)
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The current weather in a city",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                    "additionalProperties": False,  # as strict tools (and pydantic's) say: no invented fields
                },
            },
        }
    ]
    messages = [{"role": "user", "content": "What is the weather like in Berlin today?"}]
    reply = client.chat.completions.create(
        model=NAME,
        messages=messages,
        tools=tools,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=60,
        temperature=0,
    )
    call = reply.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Berlin"}
    assert reply.choices[0].finish_reason == "tool_calls"
    messages += [
        reply.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_celsius": 31, "sky": "sunny"})},
    ]
    answer = client.chat.completions.create(model=NAME, messages=messages, tools=tools, max_tokens=60,
                                            temperature=0)  # fmt: skip
    assert not answer.choices[0].message.tool_calls and "31 degrees" in answer.choices[0].message.content


def test_cached_tokens_n_streaming_and_logprobs(served):
    client = api(served)
    long = "Tell me about the history of Paris. " * 20
    messages = [{"role": "user", "content": long}]
    first = client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0)
    again = client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 16
    assert again.choices[0].message.content == first.choices[0].message.content
    stream = client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == first.choices[0].message.content
    many = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=8, temperature=1.0, seed=1, n=3, logprobs=True, top_logprobs=2
    )
    assert sorted(c.index for c in many.choices) == [0, 1, 2]
    for choice in many.choices:
        entries = choice.logprobs.content
        assert len(entries) == 8 and all(e.logprob <= 0 and len(e.top_logprobs) == 2 for e in entries)


@pytest.mark.bench
def test_quality_quick_scores_softmax_and_a_setting_that_destroys_attention(real, tmp_path):
    """`sharp-bench quality --quick` on the real model (its directory: the GGUF read once by the fixture): softmax
    finds the passkey at ~600 tokens in ≥ 80% of the trials, a setting that flattens attention (SSMax with s =
    0.003: logits × ~0.02) in ≤ 20% — and its entropy by position is the uniform one, softmax's well below."""
    from sharp.benchmarks import quality

    page = tmp_path / "quality.md"
    assert quality.run([str(real["dir"]), "--quick", "--write", str(page)]) == 0
    text = page.read_text()
    hits = {m[0]: int(m[1]) for m in re.findall(r"^\| (softmax|flat) \| (\d)/5 ", text, re.M)}
    assert hits["softmax"] >= 4 and hits["flat"] <= 1, text
    entropy = text.split("**Attention entropy", 1)[1]
    rows = {m[0]: float(m[1]) for m in re.findall(r"^\| (softmax|flat) \| ([\d.]+) ", entropy, re.M)}
    assert rows["flat"] > 0.95 and rows["softmax"] < 0.8, entropy
    logp = text.split("**Mean log-probability of the key**", 1)[1].split("**Perplexity", 1)[0]
    scores = {m[0]: float(m[1]) for m in re.findall(r"^\| (softmax|flat) \| (-?[\d.]+) ", logp, re.M)}
    assert -1.0 < scores["softmax"] <= 0 and scores["flat"] < scores["softmax"] - 3, logp  # sure of it, or lost
    assert page.with_suffix(".png").stat().st_size > 1000  # the plot


@pytest.mark.bench
def test_find_heads_names_the_heads_that_retrieve_and_the_export_flags(real, capsys):
    """`sharp-bench quality --find-heads 3` on the real model: its retrieval heads (layer 21 head 8 and layer 18 head
    6 put over 0.7 of their weight on the key while the model writes it, docs/quality.md) and the flags that export
    them length-scaled."""
    from sharp.benchmarks import quality

    assert quality.run([str(real["dir"]), "--find-heads", "3"]) == 0
    said = capsys.readouterr().out
    weights = {m[0]: float(m[1]) for m in re.findall(r"^\| (\d+\.\d+) \| ([\d.]+) \|", said, re.M)}
    assert len(weights) == 3 and weights["21.8"] > 0.7 and weights["18.6"] > 0.7, said
    assert f"--scaled-heads {' '.join(weights)} --scaled-from {quality.SCALED_FROM}" in said


@pytest.mark.bench
def test_quality_scores_a_later_stretch_of_the_text_from_its_own_start(real, tmp_path, capsys):
    """`--text-from N` scores the text's tokens N… as a text of their own (the later stretch within a short context):
    its first bin differs from the text's own start, and a stretch past the text's end exits 2 saying its size."""
    from sharp.benchmarks import quality

    pages = {}
    for start in (0, 2000):
        page = tmp_path / f"q{start}.md"
        argv = ["--settings", "softmax", "--lengths", "--text", "128", "--text-from", str(start), "--write", str(page)]
        assert quality.run([str(real["dir"]), *argv]) == 0
        pages[start] = page.read_text()
    assert "from its token 2,000):" in pages[2000] and "from its token" not in pages[0]
    first = r"^\| softmax \| ([\d.]+) \|"  # the first bin's perplexity
    ppl = {k: re.search(first, t.split("**Perplexity", 1)[1], re.M)[1] for k, t in pages.items()}
    assert ppl[0] != ppl[2000], ppl
    with pytest.raises(SystemExit) as e:
        quality.run([str(real["dir"]), "--lengths", "--text", "128", "--text-from", "10000000", "--no-write"])
    assert e.value.code == 2 and "the text has" in capsys.readouterr().err


@pytest.mark.bench
def test_quality_llama_server_answers_the_same_passkeys_as_sharp_softmax(real, tmp_path, monkeypatch):
    """`sharp-bench quality --llama-server` at ~600 tokens: llama-server, on the same GGUF and the same token ids,
    finds the passkey as sharp's softmax does (≥ 4/5 each), and so with YaRN 2× (its own --rope-scaling flags, which
    it takes); the page says the intervals overlap for both. Needs llama-server (`make peers`; CI does not build it):
    skipped, not passed, without it."""
    from sharp.benchmarks import peers, quality

    if not (peers.LLAMA_CPP / "llama-server").exists():
        pytest.skip("llama-server is not built (make peers)")
    monkeypatch.setenv("SHARP_CACHE", str(real["cache"]))  # the GGUF's directory the fixture read
    page = tmp_path / "quality.md"
    argv = ["--settings", "softmax", "yarn@2", "--lengths", "600", "--trials", "5", "--text", "512", "--llama-server"]
    assert quality.run([*argv, "--write", str(page)]) == 0
    text = page.read_text()
    rows = r"^\| (softmax|yarn@2|llama-server \((?:softmax|yarn@2)\)) \| (\d)/5 "
    hits = {m[0]: int(m[1]) for m in re.findall(rows, text, re.M)}
    assert len(hits) == 4 and min(hits.values()) >= 4, text
    for name in ("softmax", "yarn@2"):
        assert f"{quality.peer_name(name)} and sharp's {name}: the intervals overlap at every length" in text
    assert "<!-- sharp-bench quality --llama-server -->" in text
    assert page.with_name("quality-llama-server.png").stat().st_size > 1000
