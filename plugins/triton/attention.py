"""Host side of the Triton kernels: launch configuration (prefill tiles tuned on first use, by tiles.py), split-K
merging, adaptive's β and entmax's τ loop.

Semantics are exactly `attend`'s (the problem comes from `sharp.models.problem`); the per-row state algebra (the
streamed PyTorch oracle's `merge_softmax_states`, merged on the device by `_merge_softmax_kernel`) and the threshold
step (`refine_threshold`) are the oracle's own.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace

import numpy as np
import torch
import triton
import triton.language as tl
from torch import Tensor

from sharp.models.attention import attend
from sharp.models.normalizers import ADAPTIVE_THRESHOLD, Param, adaptive_beta
from sharp.models.problem import AttentionProblem
from sharp.models.registry import Family, Transform
from sharp.models.streamed import (
    MAX_THRESHOLD_PASSES,
    StreamStats,
    finish_entmax_state,
    threshold_tol,
)
from sharp.plugins.triton.decode import (
    _entmax_logits_kernel,
    _entmax_output_kernel,
    _entmax_threshold_kernel,
    _merge_softmax_kernel,
)
from sharp.plugins.triton.entmax import _entmax_kernel
from sharp.plugins.triton.softmax import _softmax_family_kernel
from sharp.plugins.triton.tiles import Tile, tuned_tile

_NEG_INF = float("-inf")
# Enough programs to fill an H100/H200 (132 SMs) about twice when a single sequence decodes (split-K and paged).
TARGET_PROGRAMS = 264


def dot_f32(t: Tensor) -> bool:
    """The kernels' DOT_F32: upcast to fp32 and use IEEE dots for fp32 inputs, and always off CUDA (the CPU
    interpreter, where a bf16 tl.dot does not run)."""
    return t.dtype == torch.float32 or t.device.type != "cuda"


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def _loop_probe(X, n):
    acc = 0.0
    for _ in range(tl.program_id(0), n):  # a loop bound derived from the program id, as every kernel has
        acc += 1.0
    tl.store(X, acc)


@functools.cache
def interpreter_problem() -> str | None:
    """Why Triton's CPU interpreter cannot run the kernels here, or None (also when not interpreting). Triton 3.6's
    interpreter makes loop bounds Python ints from 1-element arrays, which numpy >= 2.5 refuses (3.9's does not)."""
    if not interpreting():
        return None
    try:
        _loop_probe[(1,)](torch.zeros(1), 2)
    except Exception as e:  # the interpreter wraps the cause several times; name the innermost
        while e.__cause__ is not None:
            e = e.__cause__
        return (f"Triton {triton.__version__}'s CPU interpreter does not run with numpy {np.__version__} ({e}); "
                "use numpy < 2.5 or Triton >= 3.9 for CPU runs")  # fmt: skip
    return None


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes, schedule and the key split; `splits > 1` is flash-decoding (partial states merged by a kernel).
    `packed` (decode): a program's rows are one KV head's GROUP × Lq queries, so it reads each key and value once for
    all of them (grid (1, B·Hkv, splits))."""

    block_m: int
    block_n: int
    block_d: int
    splits: int
    keys_per_split: int
    dot_f32: bool  # upcast to fp32 and use IEEE dots: fp32 inputs, and always in the CPU interpreter
    num_warps: int = 4
    num_stages: int = 2
    packed: bool = False


def launch_config(
    p: AttentionProblem, block_size: int | None = None, splits: int | None = None, tile: Tile | None = None
) -> LaunchConfig:
    """Prefill: 64×64 tiles (or `tile`), one split. Decode (Lq ≤ 16): a KV head's GROUP × Lq queries a program
    (at least 16 rows) and enough key splits to fill the GPU."""
    small = p.lq <= 16
    block_m = max(16, 1 << (p.group * p.lq - 1).bit_length()) if small else 16 if interpreting() else 64
    block_n = block_size or (16 if interpreting() else 64)
    if tile is not None and not small:
        block_m, block_n = tile.block_m, tile.block_n
    block_n = max(16, 1 << (block_n - 1).bit_length())
    block_d = max(16, 1 << (p.q.shape[-1] - 1).bit_length())
    n_kblocks = -(-p.lk // block_n)
    if splits is None:  # at least TARGET_PROGRAMS: whole key blocks per split, rounded down
        programs = p.batch * (p.heads // p.group) if small else -(-p.lq // block_m) * p.batch * p.heads
        splits = max(1, min(n_kblocks, -(-TARGET_PROGRAMS // programs))) if small else 1
        keys_per_split = max(1, n_kblocks // splits) * block_n
    else:
        splits = max(1, min(splits, n_kblocks))
        keys_per_split = -(-n_kblocks // splits) * block_n
    splits = -(-p.lk // keys_per_split)
    cfg = LaunchConfig(block_m, block_n, block_d, splits, keys_per_split, dot_f32(p.q), packed=small)
    return replace(cfg, num_warps=tile.num_warps, num_stages=tile.num_stages) if tile is not None and not small else cfg


def grid(p: AttentionProblem, cfg: LaunchConfig) -> tuple[int, int, int]:
    """The split kernels' grid: (query blocks, B·Hq, splits), or packed (1, B·Hkv, splits)."""
    if cfg.packed:
        return 1, p.batch * (p.heads // p.group), cfg.splits
    return -(-p.lq // cfg.block_m), p.batch * p.heads, cfg.splits


def autotuning(device: torch.device) -> bool:
    """Whether prefill tiles are tuned: on CUDA unless SHARP_TRITON_AUTOTUNE=0; SHARP_TRITON_AUTOTUNE=1 forces it
    (in the CPU interpreter it then times wall clock — for tests of the tuner, not for choosing tiles)."""
    setting = os.environ.get("SHARP_TRITON_AUTOTUNE", "")
    if setting in ("0", "1"):
        return setting == "1"
    return device.type == "cuda" and not interpreting()


def tile_class(p: AttentionProblem) -> tuple:
    """What the tuner keys a prefill's tile on: norm, dtype, head dim, causality, entmax's fast path, the optional
    inputs, and the query and key lengths by power-of-two class (tiles are retuned per doubling, not per length)."""
    fast = _alpha_fast_path(p.alpha) if p.family is Family.ENTMAX else 0
    return (
        p.norm.name, p.q.dtype, p.q.shape[-1], p.causal, fast, p.alibi_slopes is not None,
        p.query_scale is not None, p.key_mask is not None, _length_class(p.lq), _length_class(p.lk),
    )  # fmt: skip


def _length_class(n: int) -> int:
    return max(0, (n - 1).bit_length())


def head_vector(value: Param, heads: int, device: torch.device) -> Tensor:
    """A parameter (float, (Hq,) or broadcastable (1, Hq, 1, 1) tensor) as the kernels read it: (Hq,) fp32. A float
    is filled on the device: a tensor made from host data is copied from pageable memory, and PyTorch waits for
    that copy — every launch would then wait for the work queued before it (on an H200, each call of a norm with float
    parameters took as long to issue as its kernel ran)."""
    if not isinstance(value, Tensor):
        return torch.full((heads,), float(value), dtype=torch.float32, device=device)
    t = value.to(device=device, dtype=torch.float32)
    return (t.reshape(heads) if t.numel() == heads else t.expand(1, heads, 1, 1).reshape(heads)).contiguous()


@functools.lru_cache(maxsize=16)
def device_constants(values: tuple[float, ...], device: torch.device) -> Tensor:
    """Constants the kernels read through a pointer (adaptive's polynomial), copied to `device` once: a copy per
    launch would synchronise as `head_vector` explains. Kernels only read it."""
    return torch.tensor(values, dtype=torch.float32, device=device)


class _Launcher:
    """Common launch arguments of one problem (strides, per-head tensors, constexpr flags)."""

    def __init__(self, p: AttentionProblem, cfg: LaunchConfig, entropy: bool = True):
        self.p, self.cfg, self.entropy = p, cfg, entropy
        dev = p.q.device
        self.bh = p.batch * p.heads
        self.grid = grid(p, cfg)
        self.dummy = torch.zeros(1, dtype=torch.float32, device=dev)
        self.slopes = p.alibi_slopes.float().contiguous() if p.alibi_slopes is not None else self.dummy
        self.lam = p.query_scale.float().contiguous() if p.query_scale is not None else self.dummy  # λ
        # padding keys: (B, Lk) int8, 1 = present (bool pointers are not portable across Triton versions)
        self.kmask = p.key_mask.to(torch.int8).contiguous() if p.key_mask is not None else self.dummy
        self.flags = dict(
            CAUSAL=p.causal,
            HAS_ALIBI=p.alibi_slopes is not None,
            HAS_LAMBDA=p.query_scale is not None,
            HAS_KMASK=p.key_mask is not None,
            DOT_F32=cfg.dot_f32,
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            BLOCK_D=cfg.block_d,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
        # the kernels' tuple arguments: each tensor's (batch, head, position, dim) strides, then the key mask's batch
        # stride; the problem's sizes; the split-K layout of the partial states
        self.strides = (p.q.stride(), p.k.stride(), p.v.stride(), p.lk)
        self.sizes = (p.heads, p.group, p.lq, p.lk, p.q.shape[-1])
        self.split = (self.bh, cfg.keys_per_split)

    def per_head(self, value: Param) -> Tensor:
        return head_vector(value, self.p.heads, self.p.q.device)

    def rows(self, *extra: int, fill: float = 0.0) -> Tensor:
        """A (splits, B·Hq, Lq, *extra) fp32 buffer for partial per-row state."""
        shape = (self.cfg.splits, self.bh, self.p.lq, *extra)
        return torch.full(shape, fill, dtype=torch.float32, device=self.p.q.device)

    def unflatten(self, t: Tensor) -> Tensor:
        """(B·Hq, Lq, …) → (B, Hq, Lq, …)."""
        return t.reshape(self.p.batch, self.p.heads, *t.shape[1:])


def _softmax_family(
    run: _Launcher, rowf: Tensor | None, ssa: bool, with_v: bool, adaptive: bool = False, logn: bool = False
) -> tuple[Tensor | None, Tensor]:
    """One launch. With one split and V (prefill) the kernel finishes the output and entropy itself; otherwise it
    writes per-split partial states that `merge_splits` merges (split-K decode, or adaptive's statistics pass)."""
    p, cfg = run.p, run.cfg
    finalize = cfg.splits == 1 and with_v
    entropy = run.entropy or not with_v  # a statistics launch exists for its entropy
    if finalize:
        m = big_lam = kp = acc = run.dummy
        out = torch.empty(run.bh, p.lq, cfg.block_d, dtype=p.q.dtype, device=p.q.device)
        ent = torch.empty(run.bh, p.lq, dtype=torch.float32, device=p.q.device) if entropy else run.dummy
    else:
        m, big_lam, kp = run.rows(fill=_NEG_INF), run.rows(), run.rows()  # per split: m, Λ, K'
        acc = run.rows(cfg.block_d) if with_v else run.dummy
        out = ent = run.dummy
    ssmax_s = run.per_head(p.ssmax_s) if logn else run.dummy
    ssa_n = run.per_head(p.ssa_n) if ssa else run.dummy
    ssa_b = run.per_head(p.ssa_b) if ssa else run.dummy
    poly = device_constants(p.poly, p.q.device) if adaptive else run.dummy
    _softmax_family_kernel[run.grid](
        p.q,
        p.k,
        p.v,
        run.kmask,
        *run.strides,
        (
            rowf if rowf is not None else run.dummy,
            ssmax_s,
            ssa_n,
            ssa_b,
            run.slopes,
            run.lam,
            poly,
            poly.numel() if adaptive else 0,
            ADAPTIVE_THRESHOLD,
        ),
        p.scale,
        (out, ent, m, big_lam, kp, acc),
        run.sizes,
        run.split,
        SSA=ssa,
        HAS_ROWF=rowf is not None,
        LOGN=logn,
        ADAPTIVE=adaptive,
        FINALIZE=finalize,
        WITH_V=with_v,
        ENTROPY=entropy,
        PACKED=cfg.packed,
        **run.flags,
    )
    if finalize:
        return out[..., : p.v.shape[-1]].float(), ent if entropy else None
    out = torch.empty(run.bh, p.lq, cfg.block_d, dtype=torch.float32, device=p.q.device) if with_v else run.dummy
    ent = torch.empty(run.bh, p.lq, dtype=torch.float32, device=p.q.device)
    merge_splits(m, big_lam, kp, acc, out, ent, cfg.block_d, with_v)
    return (out[..., : p.v.shape[-1]] if with_v else None), ent


MERGE_ROWS = 16  # rows per program of the split merge


def merge_splits(m: Tensor, lam: Tensor, kp: Tensor, acc: Tensor, out: Tensor, ent: Tensor, block_d: int,
                 with_v: bool) -> None:  # fmt: skip
    """Merge per-split softmax states ((splits, rows) m, Λ, K' and (splits, rows, block_d) acc) into `out` (its
    dtype) and `ent`, on the device in one launch: the host's tensor ops (the streamed oracle's merge_softmax_states
    and finish_softmax_state) took about twenty, and split-K decode was host-bound on an H200."""
    splits, rows = m.shape[0], m.numel() // m.shape[0]
    _merge_softmax_kernel[(triton.cdiv(rows, MERGE_ROWS),)](
        m, lam, kp, acc, out, ent, rows, splits, WITH_V=with_v, BLOCK_R=MERGE_ROWS, BLOCK_D=block_d
    )  # fmt: skip


def _softmax_family_transform(run: _Launcher, stats: StreamStats) -> tuple[Tensor, Tensor]:
    """One launch over t = T(z); the entropy-dependent β takes two sweeps — in one program for prefill, as two
    launches (statistics, then output) when the keys are split."""
    p = run.p
    kind = p.norm.transform
    if kind is Transform.SIGNED_LOG:
        out, ent = _softmax_family(run, None, ssa=True, with_v=True)
    elif kind is Transform.LOG_N_SCALE:  # s·log n with n counted on chip
        out, ent = _softmax_family(run, None, ssa=False, with_v=True, logn=True)
    elif kind is Transform.ENTROPY_BETA and run.cfg.splits == 1:  # both sweeps in one program, β on chip
        out, ent = _softmax_family(run, None, ssa=False, with_v=True, adaptive=True)
        stats.key_passes += 1
    elif kind is Transform.ENTROPY_BETA:  # split-K: the entropy needs every split's state first
        _, h = _softmax_family(run, None, ssa=False, with_v=False)
        stats.key_passes += 1
        out, ent = _softmax_family(run, adaptive_beta(h, p.poly).contiguous(), ssa=False, with_v=True)
    elif kind in (Transform.IDENTITY, Transform.NONE):  # NONE: entmax with α = 1, i.e. softmax
        out, ent = _softmax_family(run, None, ssa=False, with_v=True)
    else:
        raise ValueError(f"no Triton kernel for transform {kind}")
    stats.key_passes += 1
    return out, ent


def _alpha_fast_path(alpha: Param) -> int:
    """The kernels' FAST constexpr: 2 when every head has α = 1.5, 1 when α = 2 (powers without exp/log), else 0.
    Only a Python float decides it — reading a tensor's values would synchronise with the device."""
    if isinstance(alpha, float):
        return {1.5: 2, 2.0: 1}.get(alpha, 0)
    return 0


def triton_version() -> tuple[int, int]:
    """(major, minor) of the Triton that compiles: what the version-dependent choices and guards read."""
    major, minor = triton.__version__.split(".")[:2]
    return int(major), int(minor)


def entmax_stages(stages: int) -> int:
    """Pipeline stages of an entmax prefill launch whose tile asks for `stages`: at most 2, so that two programs share
    an SM. At the first tile (64×64, bf16, D = 128) 3 stages take 119 KB of shared memory — three of the threshold
    sweeps' 128-key K tiles, Q, the shift rows of both tile widths and e₀ — over the 113 KB (115,712 B) that two
    programs may each take on an H100 / H200; 2 take 87 KB. Under Triton 3.6 the general path (FAST = 0) also
    spills at 3 (its diagonal threshold loops: the class model's maxima held across the threshold loop) and not at
    2 (`sharp-bench kernels --static` holds both under each supported Triton)."""
    return min(stages, 2)


THRESHOLD_TOL = threshold_tol(torch.float32)  # the kernels work in fp32
# Split-K decode's threshold kernel: one row per program — a decode step has B·Hq rows (32 for one sequence of 32
# heads), and 16 a program kept all but 2 of an H200's 132 SMs idle (paged entmax took 0.60 ms at 32K keys where
# ssmax's one launch took 0.075) — over tiles of 512 keys, which are also its class model's key classes.
THRESHOLD_ROWS = 1
THRESHOLD_KEYS = 512


def find_thresholds(u: Tensor, alpha: Tensor, umax: Tensor, tau: Tensor, counts: Tensor, heads: int, lq: int,
                    lk: int, rows: int, fast: int, count: bool) -> None:  # fmt: skip
    """Each of `rows` rows' max and entmax threshold τ from its logits u = (α − 1)·z (rows × lk), into `umax` and
    `tau`; with `count`, each program's passes into `counts`. Split-K and paged decode's threshold step, in one
    launch of THRESHOLD_ROWS rows a program."""
    _entmax_threshold_kernel[(triton.cdiv(rows, THRESHOLD_ROWS),)](
        u, alpha, umax, tau, counts, heads, lq, lk, rows, MAX_THRESHOLD_PASSES, THRESHOLD_TOL,
        FAST=fast, COUNT=count, BLOCK_R=THRESHOLD_ROWS, BLOCK_N=THRESHOLD_KEYS,
    )  # fmt: skip


def _entmax(run: _Launcher, stats: StreamStats | None) -> tuple[Tensor, Tensor]:
    """One launch with one key split (prefill; without `run.entropy` it forms no log w and returns no entropy);
    split-K decode is three launches (logits → τ per row on chip → partial outputs) and device-side sums. Never a
    host synchronisation unless `stats` asks for the counts."""
    p, cfg = run.p, run.cfg
    alpha = run.per_head(p.alpha)
    fast = _alpha_fast_path(p.alpha)
    count = stats is not None
    if cfg.splits == 1:
        out = torch.empty(run.bh, p.lq, cfg.block_d, dtype=p.q.dtype, device=p.q.device)
        ent = torch.empty(run.bh, p.lq, dtype=torch.float32, device=p.q.device) if run.entropy else run.dummy
        blocks = (-(-p.lq // cfg.block_m), run.bh)  # the one-launch kernel's programs: query blocks of a head each
        counts = torch.zeros(run.bh, blocks[0], 2, dtype=torch.int32, device=p.q.device) if count else run.dummy
        _entmax_kernel[blocks](
            p.q, p.k, p.v, run.kmask, alpha, run.slopes, run.lam, out, ent, counts, *run.strides, run.sizes, p.scale,
            (MAX_THRESHOLD_PASSES, THRESHOLD_TOL),
            FAST=fast, COUNT=count, ENTROPY=run.entropy, EXACT_D=p.q.shape[-1] == cfg.block_d,
            **{**run.flags, "num_stages": entmax_stages(cfg.num_stages)},
        )  # fmt: skip
        if count:
            per_program = counts[..., 0].flatten().tolist()
            _count(stats, p, cfg, per_program, int(counts[..., 1].sum()))
        return out[..., : p.v.shape[-1]].float(), ent if run.entropy else None
    u = torch.empty(run.bh, p.lq, p.lk, dtype=torch.float32, device=p.q.device)
    _entmax_logits_kernel[run.grid](
        p.q, p.k, alpha, run.slopes, run.lam, run.kmask, u, p.q.stride(), p.k.stride(), run.sizes, p.scale,
        cfg.keys_per_split, p.lk, PACKED=cfg.packed, **run.flags,
    )  # fmt: skip
    rows = run.bh * p.lq
    umax = torch.empty(run.bh, p.lq, dtype=torch.float32, device=p.q.device)
    tau = torch.empty_like(umax)
    programs = triton.cdiv(rows, THRESHOLD_ROWS)
    counts = torch.zeros(programs, dtype=torch.int32, device=p.q.device) if count else run.dummy
    find_thresholds(u, alpha, umax, tau, counts, p.heads, p.lq, p.lk, rows, fast, count)
    zsum, plogp, acc = run.rows(), run.rows(), run.rows(cfg.block_d)
    skipped = torch.zeros(cfg.splits, run.bh, run.grid[0], dtype=torch.int32, device=p.q.device)
    flags = {k: run.flags[k] for k in ("CAUSAL", "DOT_F32", "BLOCK_M", "BLOCK_N", "BLOCK_D", "num_warps", "num_stages")}
    _entmax_output_kernel[run.grid](
        u, p.v, alpha, umax, tau, zsum, plogp, acc, skipped, p.v.stride(), run.sizes, run.split, FAST=fast,
        PACKED=cfg.packed, **flags,
    )  # fmt: skip
    if count:
        _count(stats, p, cfg, counts.tolist(), int(skipped.sum()))
    return finish_entmax_state(zsum.sum(0), plogp.sum(0), acc.sum(0)[..., : p.v.shape[-1]])


def _count(stats: StreamStats, p: AttentionProblem, cfg: LaunchConfig, per_program: list[int], skipped: int) -> None:
    """Fold the kernels' counters into `stats` (key passes: max, threshold passes, output; each program's threshold
    passes)."""
    passes = max(per_program, default=0)
    stats.program_threshold_passes += per_program
    stats.key_passes += passes + 2
    stats.threshold_passes = max(stats.threshold_passes, passes)
    stats.per_chunk_threshold_passes.append(passes)
    stats.tiles_total += _visible_tiles(p, cfg)
    stats.tiles_skipped += skipped


def _visible_tiles(p: AttentionProblem, cfg: LaunchConfig) -> int:
    """Key tiles the output pass visits, over all programs (for the block-sparsity ratio)."""
    total = 0
    for qb in range(-(-p.lq // cfg.block_m)):
        last = min((qb + 1) * cfg.block_m, p.lq) + (p.lk - p.lq) if p.causal else p.lk
        for s in range(cfg.splits):
            lo = s * cfg.keys_per_split
            hi = min(lo + cfg.keys_per_split, p.lk, last)
            total += max(0, -(-(hi - lo) // cfg.block_n))
    return total * p.batch * (p.heads // p.group if cfg.packed else p.heads)


def run_problem(
    p: AttentionProblem,
    block_size: int | None = None,
    splits: int | None = None,
    stats: StreamStats | None = None,
    entropy: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """Output (B, Hq, Lq, Dv) fp32 and entropy (B, Hq, Lq) for a validated problem. `stats` (optional) collects
    the entmax kernels' pass and skip counters — reading them synchronises with the device. Without `entropy` the
    one-launch kernels (softmax family and entmax prefill) skip its work (ENTROPY=False) and None may come back in
    its place."""
    if p.q.device.type != "cuda" and not interpreting():
        raise ValueError("impl='triton' needs CUDA tensors (or TRITON_INTERPRET=1 set before importing triton)")
    if p.v.shape[-1] != p.q.shape[-1]:
        raise ValueError(f"impl='triton' needs v's head dim equal to q's, got {p.v.shape[-1]} and {p.q.shape[-1]}")
    if not 1 <= p.q.shape[-1] <= 256:
        raise ValueError(f"impl='triton' supports head dims up to 256, got {p.q.shape[-1]}")
    cfg = launch_config(p, block_size, splits)
    if cfg.splits == 1 and block_size is None and autotuning(p.q.device):  # prefill: the measured tile
        tile = tuned_tile(tile_class(p), p.q.device, lambda t: _run(p, launch_config(p, tile=t), None, entropy))
        cfg = launch_config(p, tile=tile)
    return _run(p, cfg, stats, entropy)


def _run(
    p: AttentionProblem, cfg: LaunchConfig, stats: StreamStats | None, entropy: bool = True
) -> tuple[Tensor, Tensor | None]:
    run = _Launcher(p, cfg, entropy)
    if p.family is Family.ENTMAX:
        out, ent = _entmax(run, stats)
    else:
        out, ent = _softmax_family_transform(run, stats if stats is not None else StreamStats())
    return run.unflatten(out), None if ent is None else run.unflatten(ent)


def attend_impl(problem: AttentionProblem, block_size: int, entropy: bool = True) -> tuple[Tensor, Tensor | None]:
    """Entry point for `attend(..., impl="triton")` (group `sharp.attention_impls`)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (problem.q, problem.k, problem.v)):
        raise ValueError("impl='triton' is forward-only (inference); train with impl='reference'")
    with torch.no_grad():
        return run_problem(problem, block_size, entropy=entropy)


def attention(q: Tensor, k: Tensor, v: Tensor, **kwargs) -> Tensor | tuple[Tensor, Tensor]:
    """`attend(..., impl="triton")`: the same keywords and semantics (see sharp.models.attend)."""
    return attend(q, k, v, impl="triton", **kwargs)
