"""Hugging Face models on the torch backend (models/hf_lm.py): the directory's safetensors read into a SharpLM and
served on the paged KV cache — the path a GPU node takes (Triton kernels there; here the reference and streamed
attention, so everything but speed is checked).

The models are test_hf's: every family built from a config with random weights (a wide init, so attention is far
from uniform), the same byte-level BPE tokenizer.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

from devices import DEVICE  # noqa: E402
from helpers import api, greedy_request, run_until_idle, sample_value, scrape  # noqa: E402
from hf_models import SIZES, VOCAB, load_eager, write_model, write_models  # noqa: E402

from sharp.exporter import cli as export_cli  # noqa: E402
from sharp.models import hf, hf_lm, registry  # noqa: E402
from sharp.serving import Engine, EngineConfig, load_backend  # noqa: E402
from sharp.serving.api.server import BackgroundServer, ServerConfig  # noqa: E402
from sharp.serving.backends.interface import BackendError  # noqa: E402
from sharp.serving.backends.loading import check_model_path, default_backend  # noqa: E402
from sharp.serving.engine.output import Delta, Finished  # noqa: E402
from sharp.serving.metrics import ServingMetrics  # noqa: E402

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "ministral3"]  # llama3 RoPE; plain; biases, tied; q/k norms; YaRN + β


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    return write_models(tmp_path_factory.mktemp("hf_torch"))


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_transformers_eager(dirs, family):
    """60 positions: past Ministral 3's query-temperature floor (16) and YaRN's original context (16)."""
    ours, eager = hf_lm.load(dirs[family]), load_eager(dirs[family])
    ids = torch.randint(3, VOCAB, (2, 60), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = eager(ids).logits, ours(ids)
    assert want.abs().max() > 1.0
    assert (got - want).abs().max() < 1e-4


def test_what_each_family_adds_is_read(dirs):
    """The config's particulars reach the model: biases (Qwen2), q/k norms (Qwen3), tied embeddings, a head_dim
    that is not hidden / heads, the scaled RoPE's own frequencies and factor, Llama 4's β."""
    cfg = {f: hf_lm.load(dirs[f]).cfg for f in FAMILIES}
    assert cfg["qwen2"].qkv_bias and not cfg["qwen2"].o_bias and cfg["qwen2"].tie_embeddings
    assert cfg["qwen3"].qk_norm and not cfg["llama"].qk_norm
    assert all(c.head_dim == 16 for c in cfg.values())
    base = 10000.0 ** (-torch.arange(0, 16, 2).float() / 16)
    assert torch.tensor(cfg["llama"].rope_inv_freq)[-1] < base[-1] / 7  # llama3 scaling: low frequencies / 8
    assert cfg["ministral3"].rope_attention_factor > 1 and cfg["ministral3"].llama4_beta == pytest.approx(0.1)
    assert cfg["ministral3"].llama4_floor == 16


@pytest.mark.parametrize(
    ("change", "breaks"),
    [
        ({"rope_inv_freq": None}, "RoPE scaling ignored"),
        ({"llama4_beta": 0.0}, "query temperature ignored"),
    ],
)
def test_dropping_a_particular_changes_the_logits(dirs, change, breaks):
    """What the parity test would catch: each of these, dropped, moves the logits far beyond its tolerance."""
    model = hf_lm.load(dirs["ministral3"])
    ids = torch.randint(3, VOCAB, (1, 60), generator=torch.Generator().manual_seed(1))
    broken = hf_lm.SharpLM(type(model.cfg)(**{**model.cfg.to_dict(), **change}))
    broken.load_state_dict(model.state_dict(), strict=False)
    with torch.no_grad():
        assert (broken(ids) - model(ids)).abs().max() > 1e-2, breaks


def test_gpt2_and_other_families_are_refused_with_the_way_out(dirs, tmp_path):
    with pytest.raises(BackendError, match=r"the torch backend runs llama.*serve gpt2 with --backend onnxruntime"):
        load_backend(dirs["gpt2"], "torch")
    bad = tmp_path / "bad"
    shutil.copytree(dirs["llama"], bad)
    (bad / "model.safetensors").unlink()
    with pytest.raises(BackendError, match=r"no model\.safetensors"):
        load_backend(bad, "torch")


def test_a_hugging_face_directory_is_torch_s_on_a_gpu_and_onnxruntime_s_on_the_cpu(dirs, tmp_path):
    assert default_backend(dirs["llama"], "cuda") == "torch"
    assert default_backend(dirs["llama"], "cpu") == "onnxruntime"
    assert check_model_path(dirs["llama"], "torch") == dirs["llama"]
    onnx_file = tmp_path / "m.onnx"
    onnx_file.write_bytes(b"")
    assert default_backend(onnx_file, "cuda") == "onnxruntime"


def _generate(eng: Engine, ids: list[int], n: int, **kw) -> tuple[list[int], Delta, Finished]:
    out: list = []
    eng.submit(greedy_request(eng, ids, n, **kw), out.append)
    run_until_idle(eng)
    deltas = [e for e in out if isinstance(e, Delta)]
    total = deltas[0]
    for d in deltas[1:]:
        total = total + d
    assert isinstance(out[-1], Finished), out[-1]
    return total.token_ids, total, out[-1]


@pytest.mark.parametrize("family", ["qwen3", "mistral", "llama"])
def test_greedy_tokens_equal_transformers_for_64_tokens(dirs, family):
    be = load_backend(dirs[family], "torch")
    assert be.spec.name == family and be.spec.metadata.architecture == "transformers"
    eng = Engine(be, EngineConfig(prefill_chunk=16))  # prefill in chunks, then decode on the pages
    eager = load_eager(dirs[family])
    eager.generation_config.eos_token_id = None  # 64 tokens on both sides (ignore_eos: EOS is a token like another)
    for prompt in ("def main():\n", "The quick brown fox jumps over the lazy dog and"):
        ids = eng.tokenizer.encode(prompt)
        got, _, _ = _generate(eng, ids, 64, ignore_eos=True)
        with torch.no_grad():
            want = eager.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False, pad_token_id=0)
        want = want[0, len(ids) :].tolist()
        assert len(want) == 64 and got == want


def test_the_triton_kernels_serve_it_as_the_reference_does(dirs, tmp_path):
    """A Qwen3 shape with 6 query heads on 2 KV heads (a group of 3, as SmolLM2's 9 on 3) and q/k norms through the
    Triton prefill and paged-decode kernels (the GPU's path; here Triton's interpreter): two sequences of different
    lengths, chunked prefill, batched decode — the reference attention's greedy tokens. (Every norm's kernels on the
    paged cache: tests/test_kv_pages.py; this is the Hugging Face model's way to them.)"""
    pytest.importorskip("triton")
    config = transformers.Qwen3Config(**{**SIZES, "num_attention_heads": 6, "num_key_value_heads": 2})
    source = write_model(tmp_path / "qwen3-g3", config)
    prompts = [[1, *range(10, 30)], [1, *range(60, 67)]]  # 21 and 8 tokens: a prefill of two chunks and of one
    runs = {}
    for impl in (None, "triton"):
        be = load_backend(source, "torch", DEVICE.type, impl=impl, dtype="fp32")
        eng = Engine(be, EngineConfig(prefill_chunk=16, max_batch=2))
        got: list[list[int]] = [[], []]
        for i, ids in enumerate(prompts):
            put = lambda ev, out=got[i]: isinstance(ev, Delta) and out.extend(ev.token_ids)
            eng.submit(greedy_request(eng, ids, 6, ignore_eos=True), put)
        run_until_idle(eng)
        runs[impl] = got
    assert runs["triton"] == runs[None] and all(len(t) == 6 for t in runs[None])


def _with_norm(source: Path, out: Path, norm: str) -> Path:
    """A copy of the directory whose config names `norm` (a model fine-tuned with it, as far as serving knows)."""
    shutil.copytree(source, out)
    config = json.loads((out / "config.json").read_text())
    params = {name: 0.9 * registry.head_param(name).default for name in registry.get(norm).param_names}
    config[hf.CONFIG_KEY] = {"norm": norm, **params}  # not the defaults: the values must reach the model
    (out / "config.json").write_text(json.dumps(config))
    return out


NORMS = [n.name for n in registry.all_norms() if not n.query_scale]


@pytest.mark.parametrize("norm", NORMS)
def test_every_norm_serves_what_its_onnxruntime_export_serves(dirs, tmp_path, norm):
    """The same directory on both backends: the prompt's log-probabilities at every position, the greedy tokens and
    the per-head mean entropies agree within the export check's tolerances."""
    source = _with_norm(dirs["qwen3"], tmp_path / "qwen3", norm)
    assert export_cli.main([str(source), "-o", str(tmp_path / "m.onnx"), "--no-check"]) == 0  # held to torch below
    ids = [1, *range(10, 70)]
    runs = {}
    for backend, path in (("onnxruntime", tmp_path / "m.onnx"), ("torch", source)):
        be = load_backend(path, backend)
        eng = Engine(be, EngineConfig(prefill_chunk=24))
        asked = dict(prompt_logprobs=0, logprobs=0, return_attention_stats=True, ignore_eos=True)
        runs[backend] = _generate(eng, ids, 12, **asked)
    (ort_ids, ort, ort_end), (pt_ids, pt, pt_end) = runs["onnxruntime"], runs["torch"]
    assert pt_ids == ort_ids
    for a, b in zip(ort.prompt_logprobs + ort.logprobs, pt.prompt_logprobs + pt.logprobs, strict=True):
        assert a.token == b.token and abs(a.logprob - b.logprob) < 1e-3
    for a, b in zip(ort_end.attention, pt_end.attention, strict=True):
        assert (a.layer, a.head) == (b.layer, b.head) and abs(a.mean_entropy - b.mean_entropy) < 1e-3


def test_served_over_the_openai_api_with_prefix_cache_n_structured_outputs_and_entropy(dirs, tmp_path):
    """What agents and the metrics use, on the torch backend serving a Hugging Face directory (with a chat
    template: the directory's own, read as the exporter reads it)."""
    source = tmp_path / "llama"
    shutil.copytree(dirs["llama"], source)
    template = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    (source / "chat_template.jinja").write_text(template, encoding="utf-8")
    be = load_backend(source, "torch")
    eng = Engine(be, EngineConfig(kv_cache_mb=8), ServingMetrics(be.spec, entropy="head"))
    with BackgroundServer(eng, ServerConfig(port=0, metrics_port=0, http_port=0)) as srv:
        client = api(srv)
        prompt = "The quick brown fox jumps over the lazy dog and " * 4
        first = client.completions.create(model="llama", prompt=prompt, max_tokens=8, temperature=0)
        again = client.completions.create(model="llama", prompt=prompt, max_tokens=8, temperature=0)
        assert again.choices[0].text == first.choices[0].text
        assert again.usage.prompt_tokens_details.cached_tokens >= 16  # whole pages found, not prefilled again
        many = client.completions.create(model="llama", prompt=prompt, max_tokens=6, n=3, temperature=1.0, seed=3)
        assert len(many.choices) == 3
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
        reply = client.chat.completions.create(
            model="llama",
            messages=[{"role": "user", "content": "a number"}],
            max_tokens=40,
            temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": True}},
        )
        if reply.choices[0].finish_reason == "stop":  # a random model may run out of tokens; what it wrote is a prefix
            assert isinstance(json.loads(reply.choices[0].message.content)["a"], int)
        else:
            assert reply.choices[0].message.content.startswith('{"a"')
        m = scrape(srv)  # every head of every layer has its entropy histogram, and it counted the positions
        entropy = "sharp_attention_entropy_nats"
        assert {(s.labels["layer"], s.labels["head"]) for s in m[entropy].samples} == {
            (str(layer), str(head)) for layer in range(2) for head in range(4)
        }
        assert sample_value(m, entropy, f"{entropy}_count", layer="1", head="3") > 0


@pytest.mark.bench
def test_hf_serve_benchmark_smoke_runs_both_sides_and_reports_parity(tmp_path):
    """`sharp-bench hf-serve --smoke` (the GPU check's serving step, on CPU with a tiny shape): every section is
    written, fp32 greedy tokens agree with transformers', both sides' throughput and TTFT are reported."""
    from sharp.benchmarks import hfserve

    page = tmp_path / "bench.md"
    page.write_text("# Benchmarks\n")
    assert hfserve.run(["--smoke", "--write", str(page)]) == 0
    text = page.read_text()
    assert text.count("greedy tokens equal ✓") == 3 and "✗" not in text
    assert text.count(hfserve.TITLE) == 1  # the section has its heading, as every other section of the page
    for title in ("**Throughput**", "**TTFT**", "**Decode after 128 tokens**"):
        assert text.count(title) == 1  # one table per measure, grown by a row per concurrency, not one per row
    for c in (1, 3):  # both concurrencies, both sides measured
        rows = [line for line in text.splitlines() if line.startswith(f"| {c} |")]
        assert len(rows) == 1 and all(
            float(x.strip().rstrip("×").replace(",", "")) > 0 for x in rows[0].split("|")[2:5]
        )


@pytest.mark.bench
def test_hf_serve_gives_transformers_a_manager_per_concurrency(tmp_path):
    """transformers sizes a continuous-batching manager for the requests of the call that makes it: the benchmark's
    untimed round of each concurrency makes a new one, its timed rounds reuse that one (a manager made for one
    request and reused for 16 ran them at a fraction of its speed on the H200)."""
    from sharp.benchmarks import hfserve

    directory = hfserve.write_model(tmp_path / "model", hfserve.TINY, 256)
    model = hfserve._transformers(directory, torch.float32, "cpu", "sdpa")
    managers = []
    for count, warm_up in ((1, True), (1, False), (3, True), (3, False)):
        tokens, _ = hfserve.transformers_batch(model, hfserve._prompts(count, 8, 512), 2, "cpu", warm_up=warm_up)
        assert [len(t) for t in tokens] == [2] * count
        managers.append(model._cached_continuous_batching_manager)
    assert managers[1] is managers[0] and managers[3] is managers[2] and managers[2] is not managers[0]


def test_decode_graphs_pad_to_buckets_and_serve_what_eager_serves(dirs):
    """The CUDA-graph path (serving/backends/graphs.py) on CPU: the same static buffers, buckets and padding, run
    eagerly at each replay. Five sequences of different lengths join and leave: steps of 5, 4, … sequences replay
    the buckets 8, 4, 2, 1, padded rows on the scratch page, and every sequence's greedy tokens equal the eager
    backend's (a padded row writing into a real page, or a stale block table, changes them)."""
    prompts = [[1, *range(10, 10 + n)] for n in (40, 3, 17, 25, 9)]
    lengths = [14, 6, 10, 3, 8]
    runs = {}
    for graphs in (False, True):
        be = load_backend(dirs["qwen3"], "torch", graphs=graphs)
        eng = Engine(be, EngineConfig(prefill_chunk=16, max_batch=8))
        got: list[list[int]] = [[] for _ in prompts]
        ends: list = [None] * len(prompts)

        def sink(i: int, got=got, ends=ends):
            def put(ev) -> None:
                if isinstance(ev, Delta):
                    got[i].extend(ev.token_ids)
                elif isinstance(ev, Finished):
                    ends[i] = [round(h.mean_entropy, 4) for h in ev.attention or []]

            return put

        for i, (ids, n) in enumerate(zip(prompts, lengths, strict=True)):  # two ask for entropy: both graph kinds
            eng.submit(greedy_request(eng, ids, n, ignore_eos=True, return_attention_stats=i in (1, 3)), sink(i))
        run_until_idle(eng)
        runs[graphs] = got, ends
        if graphs:
            replayed = {key: g.replays for key, g in be.graphs.graphs.items()}
            assert {size for size, _ in replayed} >= {8, 2, 1} and all(replayed.values())
            assert {with_entropy for _, with_entropy in replayed} == {True, False}
            assert be.cache.scratch == be.cache.allocator.num_pages  # the scratch page is no sequence's
    assert runs[True] == runs[False] and [len(t) for t in runs[True][0]] == lengths
    assert runs[True][1][1] and runs[True][1][3]  # the entropies (their decode steps') agree too


def test_a_decode_graph_that_cannot_be_captured_leaves_the_backend_serving_eagerly(dirs, monkeypatch):
    """A capture the GPU refuses (an op that cannot be captured) turns graphs off with the reason, once; the step
    that tried it, and every later one, runs eagerly and generates the eager backend's tokens."""
    from sharp.serving.backends import graphs

    def refuse(self, g, entropy):
        raise RuntimeError("operation not permitted when stream is capturing\nmore")

    want = _one_greedy(load_backend(dirs["mistral"], "torch", graphs=False))
    monkeypatch.setattr(graphs.DecodeGraphs, "_capture", refuse)
    be = load_backend(dirs["mistral"], "torch", graphs=True)
    assert _one_greedy(be, capture=True) == want
    assert be.graphs.disabled.startswith("capturing the decode graph of 1 sequences failed: operation not permitted")
    assert not be.graphs.graphs


def _one_greedy(be, capture: bool = False) -> list[int]:
    eng = Engine(be, EngineConfig(prefill_chunk=16))
    if capture:
        be.graphs.capture = True  # as on a GPU: the (refusing) capture runs
    tokens, _, _ = _generate(eng, [1, *range(10, 30)], 8, ignore_eos=True)
    return tokens
