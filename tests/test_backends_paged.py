"""The torch backend serves from a paged KV cache: continuous batching with copy-free join and leave, a budget
counted in pages, every page back in the pool after finishing, cancelling or failing, a failed batched step run
again row by row without disturbing the others, and the Triton paged kernels (CPU interpreter) in the engine.

The engine is stepped by hand over the real torch backend and checked token for token against `SharpLM.generate`;
the only stand-in is a wrapper that makes the model raise on one marked request (a broken model cannot be trained
on purpose here).
"""

from __future__ import annotations

import argparse

import pytest
import torch
from devices import DEVICE
from helpers import greedy_request, run_until_idle

from sharp.models import ModelConfig, SharpLM
from sharp.serving import Engine, EngineConfig, RequestError, load_backend
from sharp.serving.config import PAGE_SIZE
from sharp.serving.engine.output import Delta, Failed, Finished
from sharp.serving.status import Status

MARK = 250  # a prompt holding this id makes the wrapped model raise in every decode step it is part of
REFUSED = 249  # ... makes its prefill raise


def _collect(eng: Engine, prompts: dict[str, tuple[list[int], int]]) -> tuple[dict, dict, dict]:
    tokens = {name: [] for name in prompts}
    ends = {}

    def sink(name):
        def put(ev):
            if isinstance(ev, Delta):
                tokens[name].extend(ev.token_ids)
            else:
                ends[name] = ev

        return put

    seqs = {name: eng.submit(greedy_request(eng, ids, n), sink(name)) for name, (ids, n) in prompts.items()}
    return tokens, ends, seqs


def _pages(be) -> int:
    return be.cache.allocator.num_pages - be.cache.allocator.free_pages


def test_continuous_batching_on_pages_is_copy_free_and_returns_every_page(model_files, reference):
    be = load_backend(model_files["torch"], "torch")
    eng = Engine(be, EngineConfig(prefill_chunk=48, kv_cache_mb=1))
    pools = [t.data_ptr() for t in (*be.cache.keys, *be.cache.values)]
    prompts = {
        "long": ([256, *range(30, 130)], 30),  # 101 prompt tokens: three prefill chunks, pages 7
        "short": ([256, 5, 6], 4),  # finishes while the others run
        "mid": ([256, *range(60, 80)], 20),
        "gone": ([256, 9, 9, 9], 100),  # cancelled after a few steps
        "one": ([256, 4], 1),  # done at its prefill's token: it never joins the batch
    }
    tokens, ends, seqs = _collect(eng, prompts)
    tables_seen = {}
    for step in range(200):
        if eng.idle():
            break
        eng.step()
        for seq in eng.scheduler.running:  # a running sequence's pages never move while others join and leave
            table = list(be.cache.tables[seq])
            before = tables_seen.setdefault(id(seq), table)
            assert table == before
        if step == 6:
            eng.cancel(seqs["gone"])
        want = sum(be.cache.pages_for(s.reserved) for s in (*eng.scheduler.prefilling, *eng.scheduler.running))
        assert _pages(be) == want  # each admitted sequence holds the pages of prompt + max_new_tokens
        assert eng.metrics.kv_usage._value.get() == pytest.approx(want / be.cache.allocator.num_pages)
    assert eng.idle() and _pages(be) == 0 and not be.cache.tables
    assert [t.data_ptr() for t in (*be.cache.keys, *be.cache.values)] == pools  # no pool was reallocated
    for name in ("long", "short", "mid", "one"):
        ids, n = prompts[name]
        assert isinstance(ends[name], Finished)
        assert tokens[name] == reference(ids, n)[: len(tokens[name])] and len(tokens[name]) > 0
    assert "gone" not in ends and 0 < len(tokens["gone"]) < 100


def test_the_budget_is_counted_in_pages(model_files):
    be = load_backend(model_files["torch"], "torch")
    per_page = PAGE_SIZE * be.kv_bytes_per_token
    eng = Engine(be, EngineConfig(kv_cache_mb=10.5 * per_page / 2**20))  # 10 pages (the half page is not usable)
    assert be.cache.allocator.num_pages == 10 and eng.limits.kv_budget_bytes == 10 * per_page
    # 4 + 60 = 64 tokens = 4 pages each: two fit together, the third waits for pages
    tokens, ends, _ = _collect(eng, {k: ([256, 1, 2, 3], 60) for k in "abc"})
    eng.step()
    sched = eng.scheduler
    assert len(sched.prefilling) + len(sched.running) == 2 and len(sched.waiting) == 1 and _pages(be) == 8
    for _ in range(500):
        if eng.idle():
            break
        eng.step()
        assert _pages(be) <= 10
    assert sorted(ends) == ["a", "b", "c"] and _pages(be) == 0
    assert tokens["a"] == tokens["b"] == tokens["c"]  # same greedy request, alone or beside others
    greedy_request(eng, [256] * 100, 60)  # 160 tokens = the whole pool: accepted
    with pytest.raises(RequestError) as err:
        greedy_request(eng, [256] * 100, 61)  # 161 tokens need an 11th page
    assert err.value.code is Status.RESOURCE_EXHAUSTED and "--kv-cache-mb" in err.value.message


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
def test_a_failed_batched_step_reruns_row_by_row_and_ends_only_the_failing_row(model_files, reference, backend):
    """Two bystanders decode beside a row the model fails on. On the paged cache the stand-in raises after the model
    ran (every layer wrote its keys into the pages): the rows run again alone, writing the same slots. On the graph
    backends' shared cache it raises before, as a failing forward does. Either way the bystanders' tokens stay
    exactly the model's own, in their order, and every reservation is returned."""
    be = load_backend(model_files[backend], backend)
    batches, decode_rows = [], []

    def marked(seqs) -> bool:
        decode_rows.append(len(seqs))
        if any(MARK in s.request.prompt_ids for s in seqs):
            batches.append(len(seqs))
            return True
        return False

    if backend == "torch":
        real_step = be.model.step

        def breaks_after_writing(ids, cache=None, **kw):
            out = real_step(ids, cache=cache, **kw)
            if ids.shape[1] == 1 and marked(cache.seqs):
                raise RuntimeError("non-finite keys")
            return out

        be.model.step = breaks_after_writing
    else:
        real_step = be._decode_step

        def breaks(seqs, tokens, entropy):
            if marked(seqs):
                raise RuntimeError("non-finite keys")
            return real_step(seqs, tokens, entropy)

        be._decode_step = breaks
    if backend == "torch":
        real_prefill = be.prefill

        def refuses_prompt(seq, ids, start, entropy, scores=False):
            out = real_prefill(seq, ids, start, entropy, scores)
            if REFUSED in ids:
                raise RuntimeError("prefill refused")
            return out

        be.prefill = refuses_prompt
    else:  # the graph backends prefill these four prompts in one forward: that forward refuses, after it ran
        real_forward = be.forward

        def refuses_prompt(input_ids, *args, **kw):
            out = real_forward(input_ids, *args, **kw)
            if input_ids.shape[1] > 1 and (input_ids == REFUSED).any():
                raise RuntimeError("prefill refused")
            return out

        be.forward = refuses_prompt
    eng = Engine(be, EngineConfig())
    prompts = {
        "first": ([256, 7, 8, 9], 12),
        "broken": ([256, MARK, 1], 12),
        "last": ([256, 40, 41], 12),
        "refused": ([256, REFUSED, 2], 12),  # its prefill raises after the model ran: its room must come back
    }
    tokens, ends, _ = _collect(eng, prompts)
    run_until_idle(eng, 500)
    assert isinstance(ends["refused"], Failed) and "prefill" in ends["refused"].message
    assert batches[0] == 3 and 1 in batches  # batched beside the bystanders first, then alone
    assert decode_rows.count(1) == 3 and decode_rows[-1] == 2  # one round alone, then the survivors batch again
    assert isinstance(ends["broken"], Failed) and ends["broken"].code is Status.INTERNAL
    assert "decode" in ends["broken"].message
    for name in ("first", "last"):
        assert isinstance(ends[name], Finished)
        assert tokens[name] == reference(prompts[name][0], 12)
    assert be.kv_usage() == 0
    assert not (be.cache.tables if backend == "torch" else be._reserved)  # every reservation returned


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_triton_paged_kernels_in_the_engine(model_files, reference, dtype):
    """The torch backend with impl='triton' (on the GPU when there is one, else the CPU interpreter): prefill
    chunks and batched decode steps of sequences with different lengths run the paged kernel and generate the
    model's own tokens (fp32 reference), with fp32 and with bf16 weights and cache — the precision the backend serves
    in on CUDA (the model's top-2 logit gaps are far wider than bf16's error)."""
    pytest.importorskip("triton")
    be = load_backend(model_files["torch"], "torch", DEVICE.type, impl="triton", dtype=dtype)
    assert be.cache is None and be.model.head.weight.dtype == be.dtype
    eng = Engine(be, EngineConfig(prefill_chunk=16))
    assert be.cache.keys[0].dtype == be.dtype and be.kv_bytes_per_token == be.spec.kv_bytes_per_token(be.dtype.itemsize)
    assert be.spec.kv_dtype == be.spec.precision == dtype  # what the start-up line says
    prompts = {"a": ([256, *range(70, 90)], 6), "b": ([256, 3, 4], 6)}
    tokens, ends, _ = _collect(eng, prompts)
    run_until_idle(eng, 500)
    for name, (ids, n) in prompts.items():
        assert isinstance(ends[name], Finished)
        assert tokens[name] == reference(ids, n)[: len(tokens[name])] and len(tokens[name]) > 0


@pytest.mark.bench
def test_long_context_benchmark_runs_end_to_end_in_smoke_mode(capsys, tmp_path):
    """`sharp-bench long-context` serves through the real backend and engine (numbers meaningless on CPU; nothing
    written); softmax joins the norms asked for as the baseline, and without a GPU the full run refuses (exit 2)."""
    from sharp.benchmarks.longctx import SHAPES, TRANSFORMERS, _body, run

    page = tmp_path / "benchmarks.md"
    assert run(["--smoke", "--norms", "ssa", "--write", str(page)]) == 0
    out, err = capsys.readouterr()
    assert page.read_text().count("| demo |") == 3 and "Partial" not in page.read_text()  # written cell by cell
    progress = {"softmax": ["built", "loaded", "warm-up", "run"], "ssa": ["built", "loaded", "warm-up", "run"],
                TRANSFORMERS: ["built", "warm-up", "run"]}  # fmt: skip
    for norm, want in progress.items():  # on stderr: a load, a warm-up and the repeats (1 in smoke) per row
        label = f"demo {norm} 300: "
        assert [line.split(label)[1].split(" ")[0] for line in err.splitlines() if label in line] == want, norm
    rows = [line for line in out.splitlines() if line.startswith("| demo |")]
    assert [r.split(" | ")[2] for r in rows] == ["softmax", "ssa", TRANSFORMERS]  # the peer: the same shape in HF
    assert all(r.split(" | ")[8] == "4" for r in rows)  # every run generated its 4 tokens
    # the section is written after each cell: one cut short says how much it holds
    args = argparse.Namespace(prompt=[300], prefill_chunk=128, new_tokens=4, repeats=1, command="`x`")
    cells = [r.strip("| ").split(" | ") for r in rows]
    assert "Partial: 1 of 3 cells" in _body(args, cells[:1], "CPU", 3) and "Partial" not in _body(args, cells, "CPU", 3)
    assert all(r.split(" | ")[9].rstrip(" |") == "n/a (CPU)" for r in rows)  # no GPU memory to report, and no "nan"
    if not torch.cuda.is_available():  # (with one, run([]) is the real 131K-token benchmark)
        assert run([]) == 2 and "no CUDA GPU" in capsys.readouterr().out
    cfg = ModelConfig(**SHAPES["llama-1b"])
    with torch.device("meta"):
        params = SharpLM(cfg).num_params()
    assert 1.2e9 < params < 1.3e9 and cfg.head_dim == 64  # Llama-3.2-1B's shape
