"""The kernels at GPU sizes (4K–32K keys): fused prefill, split-K decode, paged decode and the torch backend serving
a long prompt, against `attend(impl="reference")`. Selected by `make test-gpu` (`pytest -m gpu`), left out of
`make test`, and they need a CUDA device. Tiles are fixed (no tuning): tuning is timed, not tested, here."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from devices import ATOL, DEVICE

from sharp.models import NORMS, ModelConfig, SharpLM, attend, save
from sharp.plugins.tensorrt.launch_check import ENTROPY_TOLERANCE, output_tolerance
from sharp.plugins.triton.paged import paged_decode

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
    pytest.mark.skipif(DEVICE.type != "cuda", reason="GPU sizes need a CUDA device (make test-gpu)"),
]

HQ, HKV, D = 8, 2, 128  # GQA 4:1 at a production head dim
ROWS = 64  # query rows checked per end of a long prefill: the reference's cost stays O(ROWS · Lk)


@pytest.fixture(autouse=True)
def _fixed_tiles(monkeypatch):
    monkeypatch.setenv("SHARP_TRITON_AUTOTUNE", "0")


def _params(norm: str, b: int, lq: int) -> dict:
    """Per-head parameters (ALiBi included) so that no head is like another; λ for the entmax family."""
    g = torch.Generator().manual_seed(len(norm))
    kw = {
        "alibi_slopes": torch.linspace(0.02, 0.0, HQ),
        "alpha": torch.linspace(1.3, 2.0, HQ),
        "ssa_n": torch.linspace(1.0, 2.0, HQ),
        "ssa_b": torch.linspace(0.5, 1.5, HQ),
        "ssmax_s": torch.linspace(0.5, 1.5, HQ),
    }
    if norm == "asentmax":
        kw["query_scale"] = torch.rand(b, HQ, lq, generator=g) + 0.5
    return {k: v.to(DEVICE) for k, v in kw.items()}


def _qkv(b: int, lq: int, lk: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    q = torch.randn(b, HQ, lq, D, generator=g, device=DEVICE).to(dtype)
    k = torch.randn(b, HKV, lk, D, generator=g, device=DEVICE).to(dtype)
    v = torch.randn(b, HKV, lk, D, generator=g, device=DEVICE).to(dtype)
    return q, k, v


def _close(out: torch.Tensor, ent: torch.Tensor, o_ref: torch.Tensor, h_ref: torch.Tensor, v: torch.Tensor, msg: str):
    """fp32 inputs: the GPU's fp32 bound; half inputs: the output's rounding bound from V and the dtype's entropy
    bound (the same rules launch_check applies)."""
    o_tol = ATOL if v.dtype == torch.float32 else output_tolerance(v)
    h_tol = ATOL if v.dtype == torch.float32 else ENTROPY_TOLERANCE[v.dtype]
    torch.testing.assert_close(out.float(), o_ref, atol=o_tol, rtol=0, msg=msg)
    torch.testing.assert_close(ent, h_ref, atol=h_tol, rtol=0, msg=msg)


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize(("dtype", "length"), [(torch.bfloat16, 16384), (torch.float32, 4096)])
def test_long_prefill_matches_the_reference(norm, dtype, length):
    """One fused causal prefill over `length` keys (hundreds of tiles per row); the first and last ROWS rows checked,
    and a key-padding mask on the second sequence."""
    q, k, v = _qkv(2, length, length, dtype, seed=length)
    mask = torch.ones(2, length, dtype=torch.bool, device=DEVICE)
    mask[1, : length // 8] = False
    kw = _params(norm, 2, length)
    out, ent = attend(q, k, v, norm=norm, causal=True, key_mask=mask, return_entropy=True, impl="triton", **kw)
    for rows in (slice(0, ROWS), slice(length - ROWS, length)):
        for b in (0, 1):
            one = {n: t[b : b + 1] if n == "query_scale" else t for n, t in kw.items()}
            seen = mask[b : b + 1, : rows.stop]
            o_ref, h_ref = attend(
                q[b : b + 1, :, rows].float(), k[b : b + 1, :, : rows.stop].float(),
                v[b : b + 1, :, : rows.stop].float(), norm=norm, causal=True, key_mask=seen, return_entropy=True,
                **{n: t[:, :, rows] if n == "query_scale" else t for n, t in one.items()},
            )  # fmt: skip
            _close(out[b : b + 1, :, rows], ent[b : b + 1, :, rows], o_ref, h_ref, v, f"{norm} rows {rows} seq {b}")


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_split_k_decode_at_32k_keys(norm, dtype):
    """Decode (one query row per sequence, four sequences) over 32K keys: flash-decoding splits and the merge."""
    q, k, v = _qkv(4, 1, 32768, dtype, seed=1)
    kw = _params(norm, 4, 1)
    out, ent = attend(q, k, v, norm=norm, causal=True, return_entropy=True, impl="triton", **kw)
    o_ref, h_ref = attend(q.float(), k.float(), v.float(), norm=norm, causal=True, return_entropy=True, **kw)
    _close(out, ent, o_ref, h_ref, v, norm)


def _pages(k: torch.Tensor, page: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, Hkv, L, D) keys on a shuffled pool of `page`-key pages: the pool (P, Hkv, page, D) and the block table."""
    b, hkv, length, d = k.shape
    n = length // page
    order = torch.randperm(b * n, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    pool = torch.empty(b * n, hkv, page, d, dtype=k.dtype, device=DEVICE)
    pool[order] = k.reshape(b, hkv, n, page, d).permute(0, 2, 1, 3, 4).reshape(b * n, hkv, page, d)
    return pool, order.reshape(b, n).to(torch.int32)


@pytest.mark.parametrize("norm", NORMS)
def test_paged_decode_at_32k_keys(norm):
    """Four sequences of 32K, 20K, 4K + 3 and 1 keys on a shuffled pool of 16-key pages (the serving cache's), bf16."""
    lengths = [32768, 20480, 4099, 1]
    q, k, v = _qkv(4, 1, 32768, torch.bfloat16, seed=2)
    (k_pages, table), (v_pages, _) = _pages(k, 16, 3), _pages(v, 16, 3)
    kw = _params(norm, 4, 1)
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    out, ent = paged_decode(q, k_pages, v_pages, table, seq_lens, norm=norm, **kw)
    for b, n in enumerate(lengths):
        one = {name: t[b : b + 1] if name == "query_scale" else t for name, t in kw.items()}
        o_ref, h_ref = attend(q[b : b + 1].float(), k[b : b + 1, :, :n].float(), v[b : b + 1, :, :n].float(),
                              norm=norm, causal=True, return_entropy=True, **one)  # fmt: skip
        _close(out[b : b + 1], ent[b : b + 1], o_ref, h_ref, v, f"{norm} sequence {b} ({n} keys)")


def test_the_torch_backend_serves_a_long_prompt_on_the_gpu(tmp_path):
    """The serving path on CUDA: a 6,000-token prompt prefilled in the engine's 256-token chunks (dense prefill
    kernel over the paged cache) and 8 decode steps (paged kernel) give the logits the CPU reference backend gives
    for the same tokens (fp32 weights and cache on both)."""
    from sharp.serving import load_backend

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=258, dim=128, layers=2, heads=4, kv_heads=2, norm="ssa", context_length=8192)
    save(SharpLM(cfg), tmp_path / "long.pt")
    prompt = torch.randint(0, 258, (1, 6000), generator=torch.Generator().manual_seed(1))
    tokens = torch.randint(0, 258, (8,), generator=torch.Generator().manual_seed(2)).tolist()
    seen = {}
    for device, impl in (("cpu", "reference"), ("cuda", None)):
        be = load_backend(tmp_path / "long.pt", "torch", device, impl=impl, dtype="fp32")
        be.allocate(64 * 2**20)
        assert be.reserve("s", prompt.shape[1] + len(tokens))
        logits = []
        for start in range(0, prompt.shape[1], 256):
            out = be.prefill("s", prompt[:, start : start + 256].numpy(), start, entropy=False)
        logits.append(out.logits.cpu())  # the torch backend leaves its logits on the device
        be.join("s")
        for t in tokens:
            logits.append(be.decode(["s"], np.array([[t]]), entropy=False).logits.cpu())
        be.release("s")
        assert be.kv_usage() == 0
        seen[device] = torch.cat(logits)
    # two layers of attention, each within the fp32 bound, through MLPs and the head: 5e-4 is ~10× that, while a
    # wrong key, mask or position moves logits by O(0.1)
    torch.testing.assert_close(seen["cuda"], seen["cpu"], atol=5e-4, rtol=0)
