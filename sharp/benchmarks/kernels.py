"""`sharp-bench kernels`: the Triton kernels against PyTorch SDPA (flash backend) in the same run, on a GPU.

Prefill: forward time and effective TFLOP/s per norm (4·B·H·Lq·Lk·D FLOPs, halved when causal), with the
SDPA-flash softmax baseline and FlexAttention (compiled; softmax, ssmax and SSA as score_mods, output only — no
entropy) measured on the same inputs; entmax also with NAPE-style ALiBi heads, where
its support is local and whole key blocks are skipped (block sparsity and threshold passes reported).
Decode: one query per sequence over a long cache, contiguous and paged; achieved K+V read
bandwidth against a measured device copy bandwidth. Medians via triton.testing.do_bench. `--check` adds each
prefill kernel's largest output and entropy error against the fp32 streamed reference on the same inputs.
`--smoke` runs the same pipeline at toy sizes on the CPU (in Triton's interpreter, which it turns on) to check the
script, writing only to a page named with --write. Decode runs first; the section is written after each decode length
and each prefill case, so a run cut short by a time limit leaves what it measured.
"""

from __future__ import annotations

import functools
import math
import os
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from tqdm import tqdm

from sharp.benchmarks.harness import (
    BenchParser,
    add_output,
    command_line,
    markdown_table,
    output_page,
    today,
    write_section,
)
from sharp.models import registry
from sharp.models.normalizers import PAPER_POLY
from sharp.models.positional import nape_slopes
from sharp.models.problem import build_problem
from sharp.models.registry import NORMS
from sharp.models.streamed import StreamStats


def _median_ms(fn: Callable[[], object], gpu: bool) -> float:
    """The median over do_bench's repeats on a GPU; one call on the CPU, where the smoke run's interpreter makes
    every number meaningless and a repeat only costs the test suite time."""
    if gpu:
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=10, rep=50, return_mode="median"))
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def _problem(q, k, v, norm: str, causal: bool, query_scale=None, alibi_slopes=None):
    """A benchmark problem with the normalizers' default parameters."""
    return build_problem(
        q,
        k,
        v,
        norm=norm,
        causal=causal,
        scale=None,
        **registry.HEAD_DEFAULTS,
        poly=PAPER_POLY,
        query_scale=query_scale if registry.get(norm).query_scale else None,
        alibi_slopes=alibi_slopes,
    )


def _reference_error(problem, out: torch.Tensor, ent: torch.Tensor) -> str:
    """max |Δ output| / max |Δ entropy| of a kernel's result against the fp32 streamed reference."""
    from sharp.models import attend

    p = problem
    ref_out, ref_ent = attend(
        p.q.float(), p.k.float(), p.v.float(), norm=p.norm.name, causal=p.causal, **registry.HEAD_DEFAULTS,
        poly=PAPER_POLY, query_scale=p.query_scale, alibi_slopes=p.alibi_slopes, impl="streamed",
        block_size=min(4096, p.lk), return_entropy=True,
    )  # fmt: skip
    return f"{(out.float() - ref_out).abs().max():.1e} / {(ent.float() - ref_ent).abs().max():.1e}"


def _prefill_rows(args, device, dtype, gpu: bool, case: tuple[int, int, bool]) -> list[list[str]]:
    """The rows of one prefill case (length, head dim, causal): SDPA, FlexAttention and every norm."""
    from sharp.plugins.triton.attention import run_problem

    length, d, causal = case
    rows = []
    heads = max(1, args.head_budget // d)
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(1, heads, length, d, device=device, dtype=dtype, generator=g) for _ in range(3))
    flops = 4 * heads * length * length * d * (0.5 if causal else 1.0)
    base_ms = _median_ms(lambda q=q, k=k, v=v, causal=causal: _sdpa(q, k, v, causal, gpu), gpu)
    rows.append(
        [
            f"{length:,}",
            str(d),
            "causal" if causal else "full",
            "SDPA-flash softmax",
            f"{base_ms:.2f}",
            f"{_host_ms(lambda q=q, k=k, v=v, causal=causal: _sdpa(q, k, v, causal, gpu), gpu):.3f}",
            f"{flops / base_ms / 1e9:.0f}",
            "1.00×",
            "—",
            "—",
            "—",
        ]
    )
    for norm in (n for n in FLEX_NORMS if n in args.norms):
        try:
            run_flex = _flex_runner(q, k, v, norm, causal, gpu)
            run_flex()  # compile
            ms = _median_ms(run_flex, gpu)
        except Exception as e:  # a baseline that cannot run is reported, never ends the run
            reason = f"not run: {type(e).__name__}: {str(e).strip().splitlines()[0][:120] if str(e) else ''}"
            rows.append([f"{length:,}", str(d), "causal" if causal else "full", f"FlexAttention {norm}", "—",
                         "—", "—", "—", "—", "—", reason])  # fmt: skip
            if gpu:
                torch.cuda.empty_cache()
            continue
        rows.append([f"{length:,}", str(d), "causal" if causal else "full", f"FlexAttention {norm}", f"{ms:.2f}",
                     f"{_host_ms(run_flex, gpu):.3f}", f"{flops / ms / 1e9:.0f}", f"{base_ms / ms:.2f}×", "—",
                     "—", "—"])  # fmt: skip
    variants = [(n, False) for n in args.norms] + [("entmax", True)] * ("entmax" in args.norms)
    for norm, nape in variants:
        lam = torch.rand(1, heads, length, device=device, generator=g) + 1.0
        problem = _problem(q, k, v, norm, causal, lam, nape_slopes(heads).to(device) if nape else None)
        stats = StreamStats()
        out, ent = run_problem(problem, stats=stats)  # warm-up compile + one measured set of stats
        error = _reference_error(problem, out, ent) if args.check else "—"
        ms = _median_ms(lambda p=problem: run_problem(p), gpu)
        is_entmax = registry.get(norm).family is registry.Family.ENTMAX
        sparse = f"{stats.block_sparsity:.0%}" if is_entmax else "—"
        passes = str(stats.threshold_passes) if is_entmax else "—"
        label = norm + (" (NAPE)" if nape else "")
        rows.append(
            [
                f"{length:,}",
                str(d),
                "causal" if causal else "full",
                label,
                f"{ms:.2f}",
                f"{_host_ms(lambda p=problem: run_problem(p), gpu):.3f}",
                f"{flops / ms / 1e9:.0f}",
                f"{base_ms / ms:.2f}×",
                sparse,
                passes,
                error,
            ]
        )
    return rows


FLEX_NORMS = ("softmax", "ssmax", "ssa")  # what FlexAttention can express as a score_mod (no entropy output)


def flex_score_mod(norm: str, causal: bool, log_n: torch.Tensor):
    """The score_mod that makes FlexAttention compute `norm` with the registry's default parameters (ssmax: logits
    × s log n, n = the keys a query sees — `log_n`, a captured 0-d tensor, when not causal; SSA: n sgn(x) log(1 +
    b|x|)), or None for softmax."""
    s, n, b_ = registry.SSMAX_S.default, registry.SSA_N.default, registry.SSA_B.default
    if norm == "softmax":
        return None
    if norm == "ssmax":
        if causal:
            return lambda score, b, h, q_idx, kv_idx: score * (s * torch.log((q_idx + 1).to(score.dtype)))
        return lambda score, b, h, q_idx, kv_idx: score * (s * log_n)
    if norm == "ssa":
        return lambda score, b, h, q_idx, kv_idx: n * torch.sign(score) * torch.log1p(b_ * score.abs())
    raise ValueError(f"FlexAttention baseline for {norm!r}: only {', '.join(FLEX_NORMS)}")


# One score_mod per (norm, causal, device) for the whole run, its length-dependent parameter a captured tensor
# updated in place: torch.compile then compiles once per shape. A new closure per call made it recompile every time
# until its recompile limit, then fall back to the unfused path, which materialises the scores (32 GiB at 32K keys).
_FLEX_MODS: dict[tuple, tuple] = {}


def _flex_runner(q, k, v, norm: str, causal: bool, gpu: bool):
    """A closure running FlexAttention for `norm` (compiled on GPU, eager on CPU)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    length = q.shape[2]
    key = (norm, causal, q.device)
    if key not in _FLEX_MODS:
        log_n = torch.zeros((), dtype=torch.float32, device=q.device)
        _FLEX_MODS[key] = (flex_score_mod(norm, causal, log_n), log_n)
    mod, log_n = _FLEX_MODS[key]
    mask = None
    if causal:
        mask = create_block_mask(_causal, None, None, length, length, device=q.device)
    flex = _compiled_flex() if gpu else flex_attention

    def run():
        log_n.fill_(math.log(length))
        return flex(q, k, v, score_mod=mod, block_mask=mask)

    return run


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


@functools.cache
def _compiled_flex():
    """flex_attention compiled once for the run; a shape it cannot compile raises (reported as the row's reason)
    instead of silently running unfused."""
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.config.recompile_limit = 64  # one compile per (shape, mask, norm) of a full run: ~50
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    return torch.compile(flex_attention, dynamic=False)


def _host_ms(fn: Callable[[], object], gpu: bool, calls: int = 20) -> float:
    """Host time per call: the wall time to issue `calls` calls back to back, before waiting for the device. Above the
    kernel time, the GPU waits for Python (launch overhead, lookups, allocations). One call on the CPU (smoke)."""
    calls = calls if gpu else 1
    if gpu:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) * 1e3 / calls
    if gpu:
        torch.cuda.synchronize()
    return host


def _sdpa(q, k, v, causal: bool, gpu: bool):
    if gpu:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _copy_bandwidth(device, gpu: bool, nbytes: int) -> float:
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src), gpu)
    return 2 * nbytes / ms / 1e6  # GB/s, read + write


def _decode_rows(args, device, dtype, gpu: bool, lk: int, copy_gbs: float) -> list[list[str]]:
    """The decode rows at `lk` keys: every norm contiguous (split-K) and paged, the entmax family also sparse."""
    from sharp.plugins.triton.attention import launch_config, run_problem

    rows = []
    hq, hkv, d = args.decode_heads, args.decode_kv_heads, args.decode_head_dim
    g = torch.Generator(device=device).manual_seed(1)
    q = torch.randn(1, hq, 1, d, device=device, dtype=dtype, generator=g)
    k, v = (torch.randn(1, hkv, lk, d, device=device, dtype=dtype, generator=g) for _ in range(2))
    kv_bytes = 2 * hkv * lk * d * k.element_size()
    for norm in tqdm(args.norms, desc=f"decode {lk:,}", unit="norm"):
        problem = _problem(q, k, v, norm, True, torch.ones(1, hq, 1, device=device))
        run_problem(problem)
        splits = launch_config(problem).splits
        ms = _median_ms(lambda p=problem: run_problem(p), gpu)
        host = _host_ms(lambda p=problem: run_problem(p), gpu)
        gbs = kv_bytes / ms / 1e6
        rows.append([f"{lk:,}", norm, str(splits), f"{ms:.3f}", f"{host:.3f}", f"{gbs:,.0f}",
                     f"{gbs / copy_gbs:.0%}"])  # fmt: skip
        rows += _paged_rows(q, k, v, norm, args.page_size, copy_gbs, kv_bytes, gpu)
    return rows


PREFILL_HEADER = ["L", "D", "mask", "kernel", "ms", "host ms", "TFLOP/s", "× SDPA", "block sparsity", "passes",
                  "max Δ out / H"]  # fmt: skip
PLANTED_KEYS = 16  # the sparse paged row's keys that hold the weight, spread over the sequence


def _paged_rows(q, k, v, norm: str, page: int, copy_gbs: float, kv_bytes: int, gpu: bool) -> list[list[str]]:
    """The same decode through the paged kernel: the keys scattered over a shuffled page pool. For the entmax
    family also its sparse decode (page bounds) on the same keys with PLANTED_KEYS keys per KV head along the
    group's mean query, which take the weight: the pages skipped and the time it takes (N(0, 1) keys alone give
    no page a bound below τ, so they would time the bounds' overhead only)."""
    rows = [_paged_row(q, k, v, norm, page, copy_gbs, kv_bytes, gpu, False)]
    if registry.get(norm).family is registry.Family.ENTMAX:
        hkv, lk, d = k.shape[1:]
        planted = k.clone()
        mean = q[0, :, 0].float().view(hkv, -1, d).mean(1)  # (Hkv, D)
        at = torch.linspace(0, lk - 1, PLANTED_KEYS, device=k.device).long()
        planted[0, :, at] = (mean / mean.norm(dim=-1, keepdim=True) * 8 * d**0.5)[:, None].to(k.dtype)
        rows.append(_paged_row(q, planted, v, norm, page, copy_gbs, kv_bytes, gpu, True))
    return rows


def _paged_row(q, k, v, norm: str, page: int, copy_gbs: float, kv_bytes: int, gpu: bool, sparse: bool) -> list[str]:
    """One paged decode's row; `sparse`: with the pool's page bounds, the share of pages skipped in its name."""
    from sharp.plugins.triton.paged import paged_decode

    hkv, lk, d = k.shape[1:]
    pages = -(-lk // page)
    order = torch.randperm(pages, device=q.device)
    pool_k = torch.zeros(pages, hkv, page, d, device=q.device, dtype=k.dtype)
    pool_v = torch.zeros_like(pool_k)
    padded = pages * page - lk
    pool_k[order] = F.pad(k[0], (0, 0, 0, padded)).view(hkv, pages, page, d).transpose(0, 1)
    pool_v[order] = F.pad(v[0], (0, 0, 0, padded)).view(hkv, pages, page, d).transpose(0, 1)
    table = order.to(torch.int32)[None]
    lengths = torch.tensor([lk], dtype=torch.int32, device=q.device)
    heads = q.shape[1]
    kw = {name: torch.full((heads,), value, device=q.device) for name, value in registry.HEAD_DEFAULTS.items()}
    kw["poly"] = PAPER_POLY
    if registry.get(norm).query_scale:
        kw["query_scale"] = torch.ones(q.shape[:3], device=q.device)
    name = f"{norm} (paged, {page}-key pages)"
    if sparse:
        kw["page_bounds"] = torch.stack((pool_k.float().amin(2), pool_k.float().amax(2))).transpose(1, 2).contiguous()
        kw["pages_read"] = read = torch.zeros(1, hkv, dtype=torch.int32, device=q.device)
    paged_decode(q, pool_k, pool_v, table, lengths, norm=norm, **kw)
    if sparse:
        name = f"{norm} (paged, {page}-key pages, sparse: {PLANTED_KEYS} planted keys, "
        name += f"{1 - int(read.sum()) / (pages * hkv):.0%} of pages skipped)"
    ms = _median_ms(lambda: paged_decode(q, pool_k, pool_v, table, lengths, norm=norm, **kw), gpu)
    host = _host_ms(lambda: paged_decode(q, pool_k, pool_v, table, lengths, norm=norm, **kw), gpu)
    gbs = kv_bytes / ms / 1e6
    return [f"{lk:,}", name, "auto", f"{ms:.3f}", f"{host:.3f}", f"{gbs:,.0f}", f"{gbs / copy_gbs:.0%}"]


def _body(args, head: str, prefill: list, decode: list, copy_gbs: float, done: int, cases: int) -> str:
    partial = "" if done == cases else f" **Partial: {done} of {cases} prefill cases measured so far.**"
    return "\n".join(
        [
            "## Triton kernels on GPU",
            "",
            head + partial,
            "bf16, one sequence, heads = 1024 / D; median of triton.testing.do_bench. TFLOP/s counts 4·H·L²·D"
            " (half of it when causal) for every norm, so it is comparable across rows; × SDPA = SDPA time / ours."
            " Entmax block sparsity = key tiles skipped in the output pass; passes = threshold passes."
            " FlexAttention rows compute the output only (sharp's kernels also return the per-head entropy)."
            " host ms = wall time to issue one call (20 back to back, before waiting for the GPU): above ms, Python"
            " is the bottleneck.",
            "",
            markdown_table(PREFILL_HEADER, prefill),
            "",
            f"Decode (Lq = 1, Hq = {args.decode_heads}, Hkv = {args.decode_kv_heads}, D = {args.decode_head_dim}):"
            f" K+V bytes read per call / time, against a measured device copy bandwidth of {copy_gbs:,.0f} GB/s.",
            "",
            markdown_table(["keys", "norm", "splits", "ms", "host ms", "GB/s", "of copy"], decode),
        ]
    )


def run(argv: list[str] | None = None) -> int:
    ap = BenchParser(prog="sharp-bench kernels", description=__doc__)
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32768, 65536, 131072])
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--head-budget", type=int, default=1024, help="heads = head_budget // D (one sequence)")
    ap.add_argument("--norms", nargs="+", default=list(NORMS), choices=NORMS, metavar="NORM")
    ap.add_argument("--decode-lengths", type=int, nargs="+", default=[32768, 65536, 131072])
    ap.add_argument("--decode-heads", type=int, default=32)
    ap.add_argument("--decode-kv-heads", type=int, default=8)
    ap.add_argument("--decode-head-dim", type=int, default=128)
    ap.add_argument("--copy-bytes", type=int, default=2**31)
    ap.add_argument("--page-size", type=int, default=64, help="keys per page of the paged decode rows")
    ap.add_argument("--smoke", action="store_true",
                    help="toy sizes on CPU in the Triton interpreter; writes only to a --write page")  # fmt: skip
    ap.add_argument("--check", action="store_true", help="prefill errors against the fp32 streamed reference")
    ap.add_argument(
        "--static",
        action="store_true",
        help="no GPU: the key loops' SASS instructions per score element, against the floor and budgets",
    )
    ap.add_argument("--threshold-passes", type=float, default=3.0, metavar="P",
                    help="--static: entmax threshold passes counted in the per-element sum")  # fmt: skip
    add_output(ap)
    args = ap.parse_args(argv)
    args.command = command_line("kernels", [] if argv is None else list(argv))
    if args.static:
        if args.smoke or args.check:
            ap.error("--static reads compiled code only: it takes no --smoke or --check")
        from sharp.benchmarks import kernels_static

        return kernels_static.run(args)
    gpu = torch.cuda.is_available() and not args.smoke
    if args.smoke:
        if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
            if "triton" in sys.modules:  # imported by the embedding program before the interpreter could be chosen
                ap.error("--smoke runs in Triton's interpreter, which must be chosen before triton is imported")
            os.environ["TRITON_INTERPRET"] = "1"  # the user asked for the CPU run: choose it for them
        from sharp.plugins.triton.attention import interpreter_problem

        if (problem := interpreter_problem()) is not None:
            ap.error(f"--smoke: {problem}")
        args.lengths, args.head_dims, args.head_budget = [40], [16], 32
        args.decode_lengths, args.decode_heads, args.decode_kv_heads, args.decode_head_dim = [100], 4, 2, 16
        args.copy_bytes, args.page_size = 2**20, 16
        args.no_write = args.no_write or args.write is None  # only to a page named with --write
    elif not gpu:
        print("sharp-bench kernels: no CUDA GPU here; use --smoke to check the script on CPU", flush=True)
        return 2
    device = "cuda" if gpu else "cpu"
    dtype = torch.bfloat16
    import triton  # after the interpreter is chosen

    from sharp.plugins.triton.attention import autotuning

    tiles = "tuned per class (the first call of each)" if autotuning(torch.device(device)) else (
        "the default 64×64, untuned (SHARP_TRITON_AUTOTUNE=0)")  # fmt: skip
    name = torch.cuda.get_device_name() if gpu else "CPU (Triton interpreter, smoke run: numbers meaningless)"
    head = f"Measured {today()} on {name}, torch {torch.__version__}, Triton {triton.__version__}."
    head += f" Command: {args.command}. Prefill tiles: {tiles}."
    page = output_page(args)
    cases = [(length, d, causal) for length in args.lengths for d in args.head_dims for causal in (False, True)]
    copy_gbs = _copy_bandwidth(device, gpu, args.copy_bytes)
    decode: list[list[str]] = []
    prefill: list[list[str]] = []
    # decode first, then prefill; the section is written after each decode length and each prefill case, so a run
    # cut short keeps what it measured
    for lk in args.decode_lengths:
        decode += _decode_rows(args, device, dtype, gpu, lk, copy_gbs)
        if page is not None:
            write_section("kernels", _body(args, head, prefill, decode, copy_gbs, 0, len(cases)), page)
    for done, case in enumerate(tqdm(cases, desc="prefill", unit="case"), 1):
        prefill += _prefill_rows(args, device, dtype, gpu, case)
        if page is not None:
            write_section("kernels", _body(args, head, prefill, decode, copy_gbs, done, len(cases)), page)
    print(_body(args, head, prefill, decode, copy_gbs, len(cases), len(cases)))
    return 0
