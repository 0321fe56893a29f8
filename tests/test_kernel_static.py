"""`sharp-bench kernels --static`: the SASS reader on a hand-written listing, and the kernels' per-element budgets
read from their sm_90 code under the newest and the oldest supported Triton (no GPU)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("triton")

from tritons import compile_env

from sharp.benchmarks import sass

LISTING = """\
	//## File "/k.py", line 10
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
	//## File "/k.py", line 20 inlined at "/k.py", line 40
	//## File "/k.py", line 40
        /*0010*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ ;
        /*0020*/                   FFMA R2, R3, R4, -R5 ;
        /*0030*/                   MUFU.EX2 R2, R2 ;
.L_x_2:
        /*0040*/                   SHFL.BFLY PT, R7, R2, 0x1, 0x1f ;
        /*0050*/              @!P1 BRA `(.L_x_2) ;
        /*0060*/                   LDL R9, [R1] ;
	//## File "/k.py", line 21 inlined at "/k.py", line 44
	//## File "/k.py", line 44
        /*0070*/              @!P0 BRA `(.L_x_1) ;
        /*0080*/                   EXIT ;
"""


def test_the_reader_finds_loops_their_nesting_classes_and_call_sites():
    instrs, labels = sass.parse(LISTING)
    assert [i.opcode for i in instrs][:4] == ["MOV", "HGMMA", "FFMA", "MUFU"]
    loops = sass.loops(instrs, labels)
    assert [(lp.start, lp.end) for lp in loops] == [(0x10, 0x70), (0x40, 0x50)]
    outer, inner = loops
    assert inner.outer is outer and outer.inner == [inner]
    assert sass.key_loops(loops) == []  # the innermost loop has no tensor-core op and no load
    counts = outer.counts()
    assert counts["tensor"] == 1 and counts["mufu"] == 1 and counts["fp32"] == 1 and counts["shuffle"] == 1
    assert counts["memory"] == 1 and outer.spills() == 1  # LDL: a spill reload
    here = {"k.py": "/here/k.py"}  # a cached compile of the same file elsewhere is matched by name
    assert sass.call_chain(outer, here) == [("/here/k.py", 21), ("/here/k.py", 44)]  # innermost first
    assert sass.call_chain(outer, {"j.py": "/j.py"}) == []
    assert sass.body_lines(outer, here) == {("/here/k.py", 20), ("/here/k.py", 21)}  # each instruction's innermost line
    outer.inner.clear()  # alone, the outer loop is innermost and has a tensor-core op: a key loop
    assert sass.key_loops([outer]) == [outer]


def _hgmma_loop(*shapes: tuple[int, int]) -> sass.Loop:
    """A loop body of (N, count) warpgroup MMAs of 64 × N × 16."""
    body = [sass.Instr(4 * n, "HGMMA", f"/*{n:04x}*/ HGMMA.64x{keys}x16.F32.BF16 R24, gdesc[UR4], RZ ;", ())
            for n, (keys, count) in enumerate((k, c) for k, c in shapes for _ in range(c))]  # fmt: skip
    return sass.Loop(body, body[-1])


def test_keys_per_iteration_come_from_the_qk_product():
    """Q·Kᵀ issues head_dim / 16 MMAs of 64 × keys: its N is the loop's keys, whatever else the loop multiplies."""
    assert _hgmma_loop((64, 8), (128, 4), (16, 4)).hgmma_keys(128) == 64  # Q·Kᵀ, P·V, P·e₀ over 64 keys
    assert _hgmma_loop((128, 8)).hgmma_keys(128) == 128  # a sweep over 128 keys without V
    assert _hgmma_loop((128, 16)).hgmma_keys(128) == 128  # Q·Kᵀ and P·V of one shape at 128 keys
    assert _hgmma_loop((32, 8), (128, 2)).hgmma_keys(128) == 32
    assert _hgmma_loop((128, 4)).hgmma_keys(128) is None  # P·V alone: the launch's tile is the loop's
    assert sass.Loop([], sass.Instr(0, "BRA", "", ())).hgmma_keys(128) is None


def test_keys_per_iteration_of_a_loop_without_the_product_come_from_its_loads():
    """The threshold kernel's sweeps read 4 bytes per score element and ptxas may unroll them (its max sweep walks 4
    tiles a turn): the bytes a thread loads per iteration count its elements — each LDG by its width."""
    texts = ["@P2 LDG.E.128 R4, desc[UR12][R16.64] ;"] * 4 + [
        "LDG.E.64 R8, desc[UR4][R2.64] ;",
        "LDG.E.U16 R9, desc[UR4][R2.64] ;",
        "LDG.E R10, desc[UR4][R2.64] ;",
        "LDGSTS.E.BYPASS.128 [R3+0x4000], desc[UR6][R4.64] ;",  # a pipelined tile load into shared memory
        "FMNMX R25, R25, R8, !PT ;",
    ]
    opcodes = [t.split()[1 if t.startswith("@") else 0].split(".")[0] for t in texts]
    body = [sass.Instr(16 * n, op, t, ()) for n, (op, t) in enumerate(zip(opcodes, texts, strict=True))]
    assert sass.Loop(body, body[-1]).loaded_bytes() == 4 * 16 + 8 + 2 + 4 + 16


def _static(which: str) -> dict:
    env = compile_env(which)
    proc = subprocess.run([sys.executable, "-m", "sharp.benchmarks.kernels_static"], capture_output=True, text=True,
                          env=env, timeout=900, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def _report(path: str, norm: str, shared: int, per_element: float, kv_bytes: float | None, per_kv_byte: float | None):
    from sharp.benchmarks.kernels_static import Entry, KeyLoop, Report

    loop = KeyLoop("k:1", per_element, {}, False, False, False, 0, 64, kv_bytes, per_kv_byte)
    return Report(Entry(norm, path, "k", {}), 128, 0, shared, [loop])


def test_budget_failures_name_each_bound_exceeded():
    """The held bounds, on made-up reports beside a floor: a prefill program's shared memory (two programs an SM),
    decode's bytes and instructions per KV byte — paged decode's bytes with room for its block-table requests (32 B a
    key), not for a second K or V row."""
    from sharp.benchmarks.kernels_static import DECODE_INSTRUCTIONS_PER_KV_BYTE as BUDGET
    from sharp.benchmarks.kernels_static import KV_KEY_BYTES, TWO_PROGRAMS_SHARED, budget_failures

    floor = _report("floor", "floor", 114_688, 11.7, None, None)
    within = [floor, _report("prefill", "ssa", TWO_PROGRAMS_SHARED, 15.0, None, None),
              _report("decode", "softmax", 70_000, 35.0, KV_KEY_BYTES, BUDGET),
              _report("paged", "softmax", 40_000, 72.0, KV_KEY_BYTES + 32, BUDGET)]  # fmt: skip
    assert budget_failures(within) == []
    over = [floor, _report("tensorrt", "softmax", TWO_PROGRAMS_SHARED + 1, 20.0, None, None),
            _report("decode", "ssa", 70_000, 39.0, KV_KEY_BYTES + 1, 0.04),
            _report("decode", "ssmax", 70_000, 35.0, KV_KEY_BYTES, BUDGET * 1.01),
            _report("paged", "ssa", 40_000, 108.0, KV_KEY_BYTES + 32, BUDGET * 1.01),
            _report("paged", "entmax (logits)", 20_000, 36.0, KV_KEY_BYTES + 33, 0.04)]  # fmt: skip
    failures = budget_failures(over)
    assert len(failures) == 5, failures
    assert "tensorrt softmax: 115,713 B of shared memory" in failures[0]
    assert "decode ssa: 513 bytes loaded per key" in failures[1]
    assert failures[2].startswith("decode ssmax:") and failures[3].startswith("paged ssa:"), failures
    assert "paged entmax (logits): 545 bytes loaded per key" in failures[4]


@pytest.mark.compile
@pytest.mark.skipif(sys.platform != "linux", reason="the CUDA backend's ptxas and nvdisasm ship for Linux")
@pytest.mark.parametrize("which", ["newest", "oldest"])
def test_key_loops_stay_within_what_ci_holds(which):
    """Instructions per score element of every prefill kernel against the floor's at the default problem class
    (each goal, or its guard where the goal is not met), and no key loop spills; the loops
    are found where the kernels have them."""
    from sharp.benchmarks.kernels_static import PREFILL_PATHS, SOFTMAX_ABSOLUTE, TWO_PROGRAMS_SHARED

    got = _static(which)
    rows = {(r["path"], r["norm"]): r for r in got["rows"]}
    assert 8 < got["floor"] < 16, got["floor"]  # the floor's loop was found and is a FlashAttention loop
    assert got["failures"] == [], got["failures"]
    for (path, norm), r in rows.items():
        assert r["loops"], f"{path} {norm}: no key loop found"
        assert r["loop_spills"] == 0, f"{path} {norm} spills in a key loop"
        if r["held"] is not None:
            assert r["ratio"] <= r["held"], f"{path} {norm}: {r['ratio']:.2f}× the floor > {r['held']}×"
    for norm in ("softmax", "ssmax", "ssa", "adaptive"):  # the softmax family meets its goals without entropy
        r = rows[("prefill", norm + " (no entropy)")]
        assert r["ratio"] <= r["goal"], (norm, r["ratio"])
    assert rows[("prefill", "softmax (no entropy)")]["per_element"] <= SOFTMAX_ABSOLUTE
    # two prefill programs share an H100 SM (the floor's 112 KB fits; so must every prefill launch)
    shared = {(path, norm): r["shared"] for (path, norm), r in rows.items() if path in PREFILL_PATHS}
    assert TWO_PROGRAMS_SHARED == 115_712 and all(0 < b <= TWO_PROGRAMS_SHARED for b in shared.values()), shared
    # interior passes over K: one for softmax, ssmax and SSA; adaptive's two; entmax's max, threshold (×P), output
    interior = {norm: [(lp["repeated"]) for lp in rows[("prefill", norm)]["loops"] if not lp["edge"]]
                for norm in ("softmax", "ssmax", "ssa", "adaptive", "entmax α=1.5")}  # fmt: skip
    assert interior == {"softmax": [False], "ssmax": [False], "ssa": [False], "adaptive": [False, False],
                        "entmax α=1.5": [False, True, False]}, interior  # fmt: skip
    # the general α's threshold sweep twice: select-free for a head whose power exponent is positive, and selecting
    # (taken instead, not summed) for the others; split-K decode (rows of several heads) and TensorRT have one
    kinds = [("prefill", "entmax per-head α"), ("prefill", "asentmax"), ("prefill", "entmax α=1.5"),
             ("decode", "entmax (threshold)"), ("tensorrt", "entmax")]  # fmt: skip
    repeated = {kind: [lp["selected"] for lp in rows[kind]["loops"] if lp["repeated"] and not lp["edge"]]
                for kind in kinds}  # fmt: skip
    assert repeated == {("prefill", "entmax per-head α"): [False, True], ("prefill", "asentmax"): [False, True],
                        ("prefill", "entmax α=1.5"): [False], ("decode", "entmax (threshold)"): [False],
                        ("tensorrt", "entmax"): [False]}, repeated  # fmt: skip
    for norm in ("entmax α=1.5", "entmax per-head α", "asentmax"):  # without entropy the output sweep forms no
        # floored log and no Σ w log w (compared there: the other sweeps' schedules move by an instruction per tile)
        with_entropy, without = ([lp["per_element"] for lp in rows[("prefill", n)]["loops"] if not lp["edge"]][-1]
                                 for n in (norm, norm + " (no entropy)"))  # fmt: skip
        assert with_entropy - without >= 2 - 1e-9, (norm, with_entropy, without)
    sweeps = [lp["keys"] for lp in rows[("prefill", "entmax α=1.5")]["loops"] if not lp["edge"]]
    assert sweeps == [128, 128, 64], sweeps  # entmax's max and threshold sweeps walk twice the launch's keys
    # decode reads each key's K and V row once for the KV head's four query heads (packed), K alone for adaptive's
    # statistics and entmax's logits (its outputs: V and the fp32 logits of the four rows); the budgets hold
    kv = {norm: {lp["kv_bytes_per_key"] for lp in rows[("decode", norm)]["loops"] if not lp["edge"]}
          for norm in ("softmax", "ssa", "adaptive (statistics)", "entmax (logits)", "entmax (output)")}  # fmt: skip
    assert kv["softmax"] == kv["ssa"] == {512} and kv["adaptive (statistics)"] == kv["entmax (logits)"] == {256}, kv
    assert max(kv["entmax (output)"]) <= 256 + 16 * 4, kv  # V, and the logits of the tile's 16 rows (4 bytes each)
    edges = {norm: sum(lp["edge"] for lp in rows[("prefill", norm)]["loops"]) for norm in ("softmax", "adaptive")}
    assert edges == {"softmax": 1, "adaptive": 2}, edges  # the diagonal tiles walk apart, with their masks


@pytest.mark.parametrize(
    ("args", "env", "says"),
    [
        (["--static", "--check"], {}, "--static reads compiled code only"),
        (["--static"], {"TRITON_INTERPRET": "1"}, "unset TRITON_INTERPRET"),
    ],
)
def test_the_static_command_refuses_what_it_cannot_do(args, env, says):
    """A mistake is one line and exit 2, before anything compiles."""
    cli = "import sys; from sharp.benchmarks import main; sys.exit(main(sys.argv[1:]))"  # sharp-bench
    proc = subprocess.run([sys.executable, "-c", cli, "kernels", *args, "--no-write"],
                          capture_output=True, text=True, env={**compile_env("newest"), **env}, timeout=300,
                          check=False)  # fmt: skip
    assert proc.returncode == 2, proc.stdout[-500:] + proc.stderr[-500:]
    assert says in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
