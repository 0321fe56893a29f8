"""The Triton kernels as they are built and chosen: ahead-of-time PTX and the sm_90 compile of every JIT
specialisation (marked compile), the GPU selection's refusal without a GPU, the kernel benchmark, the prefill tiles
and their tuner."""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")


import triton
from devices import ATOL, ATOL_LOOSE, DEVICE, device_name
from triton_cases import host, norm_kwargs, problem, qkv
from tritons import compile_env

from sharp.models import attend
from sharp.plugins.triton import tiles
from sharp.plugins.triton.attention import launch_config

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy warnings inside the interpreter


@pytest.mark.compile
@pytest.mark.skipif(sys.platform != "linux", reason="the CUDA backend's ptxas ships for Linux")
def test_ahead_of_time_compile_to_ptx_for_sm90(tmp_path):
    """No GPU needed: the TensorRT plugin is built from exactly these PTX/CUBIN files."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sharp.plugins.triton.aot",
            "--kernels",
            "torch",
            "--arch",
            "90",
            "--out",
            str(tmp_path),
            "--dtype",
            "bf16",
            "fp16",
            "--head-dim",
            "64",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert {m["kernel"] for m in manifest} == {"softmax_family", "entmax"}
    from sharp.plugins.triton.aot import default_ptx_version

    want = "{}.{}".format(*divmod(default_ptx_version(90), 10))
    for m in manifest:
        ptx = (tmp_path / f"{m['variant']}.ptx").read_text()
        assert ".target sm_90" in ptx and f".entry {m['entry']}(" in ptx
        assert f".version {want}\n" in ptx and m["ptx_version"] == want  # ≤ 9.0: what driver 580 loads
        launch = m["launch"]
        assert launch["scratch_bytes"] == 0  # TensorRT passes null for Triton's hidden scratch pointers
        assert launch["block"] == [32 * m["num_warps"], 1, 1]
        assert launch["shared_opt_in"] == (launch["shared_bytes"] > 48 * 1024)
        # one parameter per argument, a tuple argument (a list of types) flattened into one per element
        kinds = [k for k in m["signature"].values() if k != "constexpr"]
        params = sum(len(k) if isinstance(k, list) else 1 for k in kinds)
        assert any(isinstance(k, list) for k in kinds)  # the torch path's kernels take stride and size tuples
        assert launch["arguments"][params:] == ["global_scratch", "profile_scratch"]
        assert len(set(launch["arguments"])) == len(launch["arguments"]) == params + 2
        # the PTX entry takes exactly these parameters, in this order (Triton names them <entry>_param_<i>)
        assert f"{m['entry']}_param_{len(launch['arguments']) - 1}" in ptx
        assert f"{m['entry']}_param_{len(launch['arguments'])}" not in ptx
        assert (tmp_path / f"{m['variant']}.cubin").stat().st_size > 1000
    _launch_through_the_manifest(manifest)


ROOT = Path(__file__).resolve().parents[1]


def _triton_floor() -> str:
    """The oldest Triton the kernels extra admits (pyproject: triton>=X)."""
    return re.search(r'^kernels = \["triton>=([0-9.]+)"\]', (ROOT / "pyproject.toml").read_text(), re.M).group(1)


@pytest.mark.compile
@pytest.mark.skipif(sys.platform != "linux", reason="the CUDA backend's ptxas ships for Linux")
@pytest.mark.parametrize("which", ["newest", "oldest"])
def test_every_kernel_compiles_for_sm90_under_the_jit_specialisations(which, tmp_path):
    """What a GPU compiles: every torch-path launch (prefill, split-K and paged decode, merge) with the values the
    JIT specialises on (divisible by 16, unit constants) and every TensorRT entry point, under the newest Triton
    (the venv's) and the oldest pyproject admits; the PTX ISA is the highest that Triton's ptxas writes, ≤ 9.0."""
    env = compile_env(which)
    args = ["--kernels", "all", "--arch", "90", "--dtype", "bf16", "--head-dim", "128", "--out", str(tmp_path)]
    proc = subprocess.run([sys.executable, "-m", "sharp.plugins.triton.aot", *args], capture_output=True, text=True,
                          env=env, timeout=900, check=False)  # fmt: skip
    assert proc.returncode == 0, "\n".join(line for line in proc.stderr.splitlines() if "FAILED" in line)[-3000:]
    _, version, _, _, ptx = proc.stdout.splitlines()[0].replace(",", "").split()[:5]
    if which == "oldest":
        assert version.startswith(_triton_floor()), (version, _triton_floor())
    else:
        assert version == importlib.metadata.version("triton")
    from sharp.plugins.triton import kernels, paged

    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert {m["kernel"] for m in manifest} == set(kernels.KERNELS) | set(paged.KERNELS)
    assert {m["specialisation"] for m in manifest} == {"aligned", "plain", "jit"}
    for m in manifest:
        assert m["ptx_version"] == ptx and f".version {ptx}\n" in (tmp_path / f"{m['variant']}.ptx").read_text()
    assert float(ptx) <= 9.0 and (version < "3.9" or ptx == "9.0")  # 3.9's ptxas writes 9.4: capped
    jit = {m["variant"]: m for m in manifest}["entmax_threshold_bf16_d128_fast0_jit"]
    assert jit["constexprs"]["LQ"] == 1 and {"LK", "ROWS", "H", "U"} <= set(jit["divisible_by_16"])


def _grid(launch: dict, sizes: dict) -> tuple[int, ...]:
    ceil_div = lambda a, b: -(-a // b)
    return tuple(int(eval(expr, {"__builtins__": {}}, {"ceil_div": ceil_div, **sizes})) for expr in launch["grid"])


def _launch_through_the_manifest(manifest: list[dict]) -> None:
    """What a plugin does with the manifest alone — arguments by name in its order, the grid from its expressions,
    the constexprs it records — for the fp16 prefill variants, in the interpreter, against the reference."""
    from sharp.plugins.triton import kernels

    b, hq, hkv, lq, lk, d = 2, 4, 2, 100, 100, 64  # 2 query blocks × 2 key tiles of 64 per program
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(b, h, n, d, generator=g).half().to(DEVICE) for h, n in ((hq, lq), (hkv, lk), (hkv, lk)))
    bh, dummy = b * hq, torch.zeros(1, device=DEVICE)
    cases = {
        "softmax_family_fp16_d64_causal_entropy_finalize_logn_with_v": ("ssmax", dummy),
        "softmax_family_fp16_d64_causal_entropy_finalize_ssa_with_v": ("ssa", dummy),
        "softmax_family_fp16_d64_adaptive_causal_entropy_finalize_with_v": ("adaptive", dummy),
        "entmax_fp16_d64_causal_entropy_exact_d": ("entmax", dummy),
    }
    entries = {m["variant"]: m for m in manifest}
    for variant, (norm, rowf) in cases.items():
        m = entries[variant]
        out, ent = torch.zeros(bh, lq, d, dtype=torch.float16, device=DEVICE), torch.zeros(bh, lq, device=DEVICE)
        kw = {"ssa_n": 1.5, "ssa_b": 1.0} if norm == "ssa" else {}
        if norm == "ssmax":  # s·log n, n counted in the kernel
            kw = {"ssmax_s": 1.3}
        poly = torch.tensor((-0.037, 0.481, -2.3, 4.917, -1.791), device=DEVICE)
        values = dict(
            Q=q, K=k, V=v, ROWF=rowf, SSMAX_S=torch.full((hq,), 1.3, device=DEVICE),
            SSA_N=torch.full((hq,), 1.5, device=DEVICE), SSA_B=torch.full((hq,), 1.0, device=DEVICE), POLY=poly,
            SLOPES=dummy, LAMBDA=dummy, KMASK=dummy, M_OUT=dummy, L_OUT=dummy, KP_OUT=dummy, ACC_OUT=dummy,
            OUT=out, ENT_OUT=ent, H=hq, GROUP=hq // hkv, LQ=lq, LK=lk, D=d, BH=bh, scale=d**-0.5,
            keys_per_split=128, smb=lk, NPOLY=poly.numel(), beta_threshold=0.5,
            ALPHA=torch.full((hq,), 1.5, device=DEVICE), COUNTS=dummy, max_passes=30,
            tol=4 * torch.finfo(torch.float32).eps,
        )  # fmt: skip
        for name, t in (("q", q), ("k", k), ("v", v)):
            values.update(zip((f"s{name}b", f"s{name}h", f"s{name}{'m' if name == 'q' else 'n'}", f"s{name}d"),
                              t.stride(), strict=True))  # fmt: skip
        launch = m["launch"]
        flat = iter([values[a] for a in launch["arguments"] if a not in ("global_scratch", "profile_scratch")])
        # the entry's parameters in order; Triton's launcher takes a tuple argument (a list in the signature) whole
        args = [tuple(next(flat) for _ in kind) if isinstance(kind, list) else next(flat)
                for kind in m["signature"].values() if kind != "constexpr"]  # fmt: skip
        assert next(flat, None) is None
        kernels.KERNELS[m["kernel"]][_grid(launch, values)](*args, **m["constexprs"])
        o_ref, h_ref = attend(
            q.float(), k.float(), v.float(), norm=norm, causal=True, return_entropy=True,
            poly=tuple(poly.tolist()), **kw,
        )  # fmt: skip
        o = out.view(b, hq, lq, d).float()
        torch.testing.assert_close(o, o_ref, atol=2e-3, rtol=0, msg=variant)
        torch.testing.assert_close(ent.view(b, hq, lq), h_ref, atol=1e-3, rtol=0, msg=variant)


@pytest.mark.skipif(DEVICE.type == "cuda", reason="checks the refusal on a machine without CUDA")
def test_the_gpu_selection_refuses_without_a_gpu():
    """`make test-gpu` cannot do its job without CUDA: it exits non-zero naming why, never "0 selected"."""
    proc = subprocess.run(["make", "-s", "test-gpu", f"GPU_PYTHON={sys.executable}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=False)  # fmt: skip
    assert proc.returncode != 0 and "no CUDA device is visible to torch" in proc.stderr


IN_PROCESS_SMOKE = pytest.mark.skipif(
    not host.interpreting(), reason="--smoke in this process needs Triton's interpreter, chosen before triton was "
    "imported (on a GPU the benchmark's real run is `sharp-bench kernels`; the CLI's own smoke run is tested apart)"
)  # fmt: skip


@IN_PROCESS_SMOKE
@pytest.mark.bench
def test_kernel_benchmark_runs_end_to_end_in_smoke_mode(capsys):
    """The GPU benchmark's whole pipeline at toy sizes (numbers meaningless; nothing written)."""
    from sharp.benchmarks.kernels import run

    assert run(["--smoke", "--check", "--norms", "softmax", "entmax"]) == 0
    out = capsys.readouterr().out
    assert "SDPA-flash softmax" in out and "entmax (NAPE)" in out and "Decode (Lq = 1" in out
    assert "softmax (paged, 16-key pages)" in out and "FlexAttention softmax" in out
    # --check: each sharp kernel row carries its error against the fp32 streamed reference — the entropy (fp32 on
    # chip) to float error, the bf16 output to bf16 rounding (half an ulp of values up to ~4 is 0.016)
    checked = [line.split(" | ")[-1].rstrip(" |") for line in out.splitlines()
               if line.startswith("| 40 |") and ("| softmax |" in line or "| entmax" in line)]  # fmt: skip
    assert len(checked) == 6
    for cell in checked:
        d_out, d_h = (float(x) for x in cell.split(" / "))
        assert d_out < 3e-2 and d_h < ATOL, cell


@pytest.mark.parametrize("norm", ["softmax", "ssmax", "ssa"])
@pytest.mark.parametrize("causal", [False, True])
def test_flex_attention_baseline_computes_the_same_norm(norm, causal):
    """The benchmark's FlexAttention baseline is the same function as sharp's norm (default parameters)."""
    from sharp.benchmarks import kernels as bench
    from sharp.benchmarks.kernels import _flex_runner

    runs = []
    for length in (40, 24, 40):  # one score_mod per norm for the run: a length's parameter must not stick
        q, k, v, _ = qkv(hq=2, hkv=2, lq=length, lk=length, seed=length)
        want = attend(q, k, v, norm=norm, causal=causal, ssa_n=1.5, ssa_b=1.0, ssmax_s=1.0)
        runs.append((_flex_runner(q, k, v, norm, causal, gpu=DEVICE.type == "cuda"), want))
    for run, want in runs[::-1]:
        torch.testing.assert_close(run(), want, atol=ATOL, rtol=0)
    assert sum(key[:2] == (norm, causal) for key in bench._FLEX_MODS) == 1


@IN_PROCESS_SMOKE
def test_kernel_benchmark_reports_a_baseline_that_cannot_run(capsys, monkeypatch):
    """A baseline that fails (FlexAttention out of memory, a compile error) becomes a row with the reason; the run
    goes on and writes its table."""
    from sharp.benchmarks import kernels as bench

    real = bench._flex_runner

    def failing(q, k, v, norm, causal, gpu):
        if norm == "ssa":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 32.00 GiB")
        return real(q, k, v, norm, causal, gpu)

    monkeypatch.setattr(bench, "_flex_runner", failing)
    assert bench.run(["--smoke", "--norms", "softmax", "ssa"]) == 0
    out = capsys.readouterr().out
    reasons = [line for line in out.splitlines() if "| FlexAttention ssa |" in line]
    assert len(reasons) == 2 and all("not run: OutOfMemoryError: CUDA out of memory" in r for r in reasons)
    assert out.count("| FlexAttention softmax |") == 2 and "Decode (Lq = 1" in out


@pytest.mark.parametrize("norm", ["ssa", "adaptive", "entmax"])
def test_every_prefill_tile_computes_the_same_attention(norm):
    """Each tile the tuner may pick (up to 128 × 128) over several key tiles: causal, a padding mask, GQA."""
    q, k, v, qs = qkv(b=2, hq=4, hkv=2, lq=150, lk=150, d=16, seed=4)
    mask = torch.ones(2, 150, dtype=torch.bool, device=DEVICE)
    mask[1, :37] = False  # a left-padded row
    kw = dict(norm_kwargs(norm, 4, qs, per_head=True), causal=True, key_mask=mask)
    o_ref, h_ref = attend(q, k, v, return_entropy=True, **kw)
    p = problem(q, k, v, **kw)
    for tile in tiles.PREFILL_TILES:
        cfg = launch_config(p, tile=tile)
        assert (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.splits) == (tile.block_m, tile.block_n, tile.num_warps, 1)
        o, h = host._run(p, cfg, None)
        torch.testing.assert_close(o, o_ref, atol=ATOL_LOOSE, rtol=0, msg=str(tile))
        torch.testing.assert_close(h, h_ref, atol=ATOL_LOOSE, rtol=0, msg=str(tile))


def test_prefill_tiles_are_tuned_once_per_problem_class(monkeypatch):
    """With tuning on (forced in the interpreter) the first prefill of a class times every candidate, later ones of
    the class reuse the choice, a new length class tunes again, and decode (split keys) is never tuned."""
    from sharp.plugins.triton.tiles import Tile

    monkeypatch.setenv("SHARP_TRITON_AUTOTUNE", "1")
    monkeypatch.setattr(tiles, "PREFILL_TILES", (Tile(16, 16), Tile(32, 32, 8)))
    monkeypatch.setattr(tiles, "_TUNED", {})
    timed = []
    time_ms = tiles._time_ms
    monkeypatch.setattr(tiles, "_time_ms", lambda fn, dev: timed.append(1) or time_ms(fn, dev))
    for lq in (40, 50, 100):  # 40 and 50 share a length class (33–64); 100 does not
        q, k, v, _ = qkv(lq=lq, lk=lq, seed=lq)
        o, h = attend(q, k, v, norm="ssa", causal=True, impl="triton", return_entropy=True)
        o_ref, h_ref = attend(q, k, v, norm="ssa", causal=True, return_entropy=True)
        torch.testing.assert_close(o, o_ref, atol=ATOL_LOOSE, rtol=0)
        torch.testing.assert_close(h, h_ref, atol=ATOL_LOOSE, rtol=0)
    assert len(timed) == 4 and len(tiles._TUNED) == 2
    assert set(tiles._TUNED.values()) <= set(tiles.PREFILL_TILES)
    q, k, v, _ = qkv(lq=1, lk=300)
    attend(q, k, v, norm="ssa", impl="triton")
    assert len(timed) == 4  # decode: split-K, not tuned


def test_tuned_tiles_persist_on_disk_per_gpu_triton_and_class(monkeypatch, tmp_path):
    """A restarted server tunes nothing it tuned before: the choice is stored per (GPU, Triton version, problem
    class) in the tile cache and read back without timing anything; a corrupt file or a tile no longer offered
    is ignored (tuned again), and SHARP_TILE_CACHE=0 keeps tiles in the process only."""

    from sharp.plugins.triton.tiles import Tile

    cache = tmp_path / "tiles.json"
    monkeypatch.setenv("SHARP_TRITON_AUTOTUNE", "1")
    monkeypatch.setenv("SHARP_TILE_CACHE", str(cache))
    monkeypatch.setattr(tiles, "PREFILL_TILES", (Tile(16, 16), Tile(32, 32, 8)))
    timed = []
    time_ms = tiles._time_ms
    monkeypatch.setattr(tiles, "_time_ms", lambda fn, dev: timed.append(1) or time_ms(fn, dev))
    q, k, v, _ = qkv(lq=40, lk=40)

    def prefill() -> Tile:
        monkeypatch.setattr(tiles, "_TUNED", {})  # a new process
        attend(q, k, v, norm="ssa", causal=True, impl="triton")
        (tile,) = tiles._TUNED.values()
        return tile

    first = prefill()
    assert len(timed) == 2
    (key, fields), *more = json.loads(cache.read_text()).items()
    assert not more and json.loads(key)[:2] == [device_name(), triton.__version__] and "ssa" in json.loads(key)[2]
    assert Tile(*fields) == first
    assert prefill() == first and len(timed) == 2  # read back, nothing timed
    cache.write_text("{not json")
    prefill()
    assert len(timed) == 4 and json.loads(cache.read_text())  # tuned again, rewritten
    cache.write_text(json.dumps({key: [64, 64, 4, 3]}))  # a tile this build does not offer
    prefill()
    assert len(timed) == 6
    monkeypatch.setenv("SHARP_TILE_CACHE", "0")
    cache.unlink()
    prefill()
    assert len(timed) == 8 and not cache.exists()


def test_the_tuner_skips_tiles_that_do_not_fit_and_keeps_the_fastest(monkeypatch):
    """Which tile wins is the timer's call; a tile the device cannot hold (OutOfResources at compile) is skipped.
    The runs here are a stand-in for kernel launches: the real ones are timed only on a GPU."""
    from triton.runtime.errors import OutOfResources

    from sharp.plugins.triton.tiles import Tile, tuned_tile

    cands = (Tile(64, 64), Tile(128, 128, 8), Tile(128, 64, 8))
    monkeypatch.setattr(tiles, "PREFILL_TILES", cands)
    monkeypatch.setattr(tiles, "_TUNED", {})
    cost = {cands[0]: 3.0, cands[2]: 1.0}
    monkeypatch.setattr(tiles, "_time_ms", lambda fn, dev: fn() or cost[current[0]])
    current = [None]

    def run_with(tile):
        current[0] = tile
        if tile == cands[1]:
            raise OutOfResources(300_000, 232_448, "shared memory")

    q, k, v, _ = qkv(lq=40, lk=40)
    p = problem(q, k, v)
    assert tuned_tile(host.tile_class(p), p.q.device, run_with) == cands[2]
    monkeypatch.setattr(tiles, "PREFILL_TILES", (cands[1],))
    monkeypatch.setattr(tiles, "_TUNED", {})
    with pytest.raises(RuntimeError, match="no prefill tile"):
        tuned_tile(host.tile_class(p), p.q.device, run_with)
