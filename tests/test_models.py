"""SharpAttention, SharpLM, MaxRetrieval, positional encodings, sampling and padding masks."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from sharp.models import NORMS, ModelConfig, SamplingParams, SharpLM, attend
from sharp.models.max_retrieval import MaxRetrieval, MaxRetrievalConfig, max_retrieval_batch
from sharp.models.positional import POSITIONAL, alibi_slopes, apply_rope, nape_slopes, rope_angles
from sharp.models.sampling import GREEDY, generator, sample, sample_rows
from sharp.models.tokenizer import ByteTokenizer


def _lm(norm="softmax", pos="rope", **kw) -> SharpLM:
    torch.manual_seed(0)
    cfg = ModelConfig(
        dim=32, layers=2, heads=4, kv_heads=kw.pop("kv_heads", 2), norm=norm, pos=pos, context_length=64, **kw
    )
    return SharpLM(cfg).eval()


@pytest.mark.parametrize(("norm", "pos"), list(itertools.product(NORMS, POSITIONAL)))
def test_kv_cache_decoding_equals_full_recomputation(norm, pos):
    model = _lm(norm, pos)
    ids = torch.randint(0, 258, (2, 11))
    with torch.no_grad():
        full = model.step(ids, return_entropy=True)
        out = model.step(ids[:, :5], return_entropy=True)
        logits, ents = [out.logits], [out.entropy]
        for t in range(5, 11):
            out = model.step(ids[:, t : t + 1], cache=out.cache, return_entropy=True)
            logits.append(out.logits)
            ents.append(out.entropy)
    assert full.logits.shape == (2, 11, 258) and full.entropy.shape == (2, 2, 4, 11)
    torch.testing.assert_close(torch.cat(logits, 1), full.logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.cat(ents, -1), full.entropy, atol=1e-5, rtol=0)


@pytest.mark.parametrize("norm", ["softmax", "ssmax"])
def test_a_row_scaled_model_runs_on_sdpa_with_the_last_logits_only(norm):
    """impl="sdpa" through a whole model (RoPE, GQA, a dense cache) gives the reference's logits, and
    `last_logits` the last position's alone: what the quality harness's passkeys run on."""
    model = _lm(norm)
    ids = torch.randint(0, 258, (2, 11))
    with torch.no_grad():
        full = model.step(ids)
        last = model.step(ids[:, :7], impl="sdpa", last_logits=True)
        nxt = model.step(ids[:, 7:], cache=last.cache, impl="sdpa")  # 4 queries after 7 cached keys: a masked chunk
    assert last.logits.shape == (2, 1, 258)
    torch.testing.assert_close(last.logits[:, 0], full.logits[:, 6], atol=1e-5, rtol=0)
    torch.testing.assert_close(nxt.logits, full.logits[:, 7:], atol=1e-5, rtol=0)


@pytest.mark.parametrize("norm", NORMS)
def test_gradients_reach_every_normalizer_parameter(norm):
    model = _lm(norm, "nape").train()
    ids = torch.randint(0, 258, (2, 9))
    F.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
    names = {
        "entmax": ["alpha_raw"],
        "asentmax": ["alpha_raw", "w_beta.weight", "w_gamma.weight"],
        "ssa": ["ssa_n_raw", "ssa_b_raw"],
        "ssmax": ["ssmax_s"],
    }.get(norm, [])
    for block in model.blocks:
        for name in names:
            grad = block.attn.get_parameter(name).grad
            assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0, name
    assert all(p.grad is not None for p in model.parameters())


def test_per_layer_normalizers_and_head_params():
    model = _lm(layer_norms_override=["ssa", "entmax"])
    assert [b.attn.norm for b in model.blocks] == ["ssa", "entmax"]
    p = model.blocks[0].attn.head_params()
    torch.testing.assert_close(p["ssa_n"], torch.full((4,), 1.5))
    torch.testing.assert_close(p["ssa_b"], torch.full((4,), 1.0))
    torch.testing.assert_close(model.blocks[1].attn.head_params()["alpha"], torch.full((4,), 1.5))


def test_config_errors_are_explained():
    with pytest.raises(ValueError, match="not a multiple of heads"):
        ModelConfig(dim=30, heads=4)
    with pytest.raises(ValueError, match="norm 'sparse'"):
        ModelConfig(norm="sparse")
    with pytest.raises(ValueError, match="unknown model config keys: colour"):
        ModelConfig.from_dict({"colour": 1})


def test_rope_makes_scores_depend_on_relative_position_only():
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)

    def score(i, j):
        ci, si = rope_angles(torch.tensor([[i]]), 16)
        cj, sj = rope_angles(torch.tensor([[j]]), 16)
        return float((apply_rope(q, ci, si) * apply_rope(k, cj, sj)).sum())

    assert score(7, 3) == pytest.approx(score(104, 100), abs=1e-4)
    assert score(7, 3) != pytest.approx(score(7, 5), abs=1e-3)
    c1, _s1 = rope_angles(torch.tensor([[8.0]]), 16, scaling=4.0)
    c2, _s2 = rope_angles(torch.tensor([[2.0]]), 16)
    torch.testing.assert_close(c1, c2)  # linear scaling divides positions


def test_alibi_and_nape_slopes():
    s = alibi_slopes(8)
    torch.testing.assert_close(s, torch.tensor([2.0 ** (-(i + 1)) for i in range(8)]))
    assert alibi_slopes(6).shape == (6,) and (alibi_slopes(6) > 0).all()
    torch.testing.assert_close(nape_slopes(4), torch.tensor([1.0, 0.5, 0.0, 0.0]))


def test_alibi_penalises_distance():
    """With positive slopes, a far key gets less weight than a near one with the same content."""
    q = torch.ones(1, 1, 1, 4)
    k = torch.ones(1, 1, 6, 4)
    v = torch.arange(6.0).view(1, 1, 6, 1).expand(1, 1, 6, 4).contiguous()
    out = attend(q, k, v, causal=True, alibi_slopes=torch.tensor([1.0]))
    assert out[0, 0, 0, 0] > 4.0  # weighted towards the latest keys (index 5)


def test_key_mask_matches_sdpa_and_left_padding_matches_unpadded():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 5, 8, generator=g) for _ in range(3))
    mask = torch.tensor([[True] * 5, [False, False, True, True, True]])
    expect = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :])
    torch.testing.assert_close(attend(q, k, v, key_mask=mask), expect, atol=1e-6, rtol=0)
    for norm in NORMS:
        kw = dict(
            norm=norm,
            key_mask=mask,
            causal=True,
            return_entropy=True,
            query_scale=torch.ones(2, 2, 5) if norm == "asentmax" else None,
        )
        o_ref, h_ref = attend(q, k, v, **kw)
        o_str, h_str = attend(q, k, v, impl="streamed", block_size=2, **kw)
        torch.testing.assert_close(o_str[1, :, 2:], o_ref[1, :, 2:], atol=1e-5, rtol=0)
        torch.testing.assert_close(h_str[1, :, 2:], h_ref[1, :, 2:], atol=1e-5, rtol=0)
    # a left-padded sequence in a batch gives the same logits as the sequence alone
    model = _lm("ssmax", "rope")
    ids = torch.randint(0, 256, (1, 6))
    padded = torch.cat((torch.zeros(1, 3, dtype=torch.long), ids), 1)
    batch = torch.cat((padded, torch.randint(0, 256, (1, 9))))
    key_mask = torch.tensor([[False] * 3 + [True] * 6, [True] * 9])
    positions = torch.stack((torch.clamp(torch.arange(9) - 3, min=0), torch.arange(9)))
    with torch.no_grad():
        alone = model(ids)
        both = model.step(batch, positions=positions, key_mask=key_mask).logits
    torch.testing.assert_close(both[0, 3:], alone[0], atol=1e-5, rtol=0)


def test_generate_greedy_seeded_and_limits():
    model = _lm()
    tok = ByteTokenizer()
    prompt = tok.encode("hi")
    a = model.generate(prompt, 8, GREEDY)
    assert a == model.generate(prompt, 8, GREEDY) and 1 <= len(a) <= 8
    p = SamplingParams(temperature=1.0, top_k=20, top_p=0.9)
    assert model.generate(prompt, 8, p, seed=3) == model.generate(prompt, 8, p, seed=3)
    with pytest.raises(ValueError, match="exceeds the context limit 64"):
        model.generate(prompt, 63)
    with pytest.raises(ValueError, match="top_p must be in"):
        model.generate(prompt, 3, SamplingParams(top_p=1.5))
    assert tok.decode(tok.encode("héllo")) == "héllo"


def test_sampling_filters():
    logits = np.array([[1.0, 3.0, 2.0, -1.0]], dtype=np.float32)
    g = generator(0)
    assert int(sample(logits, SamplingParams(temperature=0.0))[0]) == 1
    assert all(int(sample(logits, SamplingParams(top_k=1), g)[0]) == 1 for _ in range(20))
    assert all(int(sample(logits, SamplingParams(top_p=0.01), g)[0]) == 1 for _ in range(20))
    assert all(int(sample(logits, SamplingParams(top_p=0.0), g)[0]) == 1 for _ in range(20))  # OpenAI's 0: argmax
    drawn = [int(sample(logits, SamplingParams(top_k=2), g)[0]) for _ in range(2000)]
    assert set(drawn) == {1, 2}
    assert 0.66 < drawn.count(1) / 2000 < 0.80  # e³ / (e³ + e²) = 0.731
    # top_p keeps the smallest prefix whose mass reaches it: p = (0.657, 0.242, 0.089, 0.012) by rank → {1, 2} at 0.8
    drawn = {int(sample(logits, SamplingParams(top_p=0.8), g)[0]) for _ in range(300)}
    assert drawn == {1, 2}
    free = [int(sample(logits, SamplingParams(), g)[0]) for _ in range(4000)]
    assert set(free) == {0, 1, 2, 3}
    assert 0.60 < free.count(1) / 4000 < 0.72  # softmax: 0.657
    hot = [int(sample(logits, SamplingParams(temperature=0.25), g)[0]) for _ in range(400)]
    assert hot.count(1) / 400 > 0.95  # temperature 0.25: e⁸ : e⁴ → 0.982
    masked = np.array([[-np.inf, 0.0, -np.inf, 0.0]], dtype=np.float32)
    assert {int(sample(masked, SamplingParams(), g)[0]) for _ in range(200)} == {1, 3}
    seeded = [sample(logits, SamplingParams(), generator(7)).tolist() for _ in range(2)]
    assert seeded[0] == seeded[1]
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=float("nan")).check()
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=-1).check()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_batched_sampling_is_sample_row_by_row_and_names_unusable_rows(dtype):
    inf, nan = float("inf"), float("nan")
    logits = np.array(
        [
            [1.0, 3.0, 2.0, -1.0],
            [nan, 1.0, 0.0, 0.0],
            [inf, 1.0, 0.0, 0.0],
            [-inf, -inf, -inf, -inf],
            [-inf, 0.5, -inf, 0.2],  # masked logits are fine
            [0.3, 0.1, 0.9, 0.2],
            [0.3, 0.1, 0.9, 0.2],
        ],
        dtype=dtype,
    )
    params = [GREEDY, GREEDY, SamplingParams(), SamplingParams(), GREEDY, SamplingParams(top_k=2), GREEDY]
    generators = [generator(i) for i in range(len(params))]
    got = sample_rows(logits, params, generators)
    assert got[:5] == [1, None, None, None, 1] and got[6] == 2
    again = [generator(i) for i in range(len(params))]
    assert got[5] == int(sample(logits[5:6], params[5], again[5])[0])  # the same draw sample() makes
    for row in (1, 2, 3):
        with pytest.raises(ValueError, match="non-finite"):
            sample(logits[row : row + 1], GREEDY)
    ties = np.array([[2.0, 5.0, 5.0, 1.0], [7.0, 0.0, 7.0, 7.0]], dtype=dtype)
    assert sample_rows(ties, [GREEDY, GREEDY], [None, None]) == [1, 0] == sample(ties, GREEDY).tolist()


@pytest.mark.parametrize("norm", NORMS)
def test_max_retrieval_model(norm):
    torch.manual_seed(0)
    model = MaxRetrieval(MaxRetrievalConfig(norm=norm, width=32))
    x, q, y = max_retrieval_batch(8, 12)
    assert x.shape == (8, 12, 11) and y.shape == (8,)
    assert (y == x[..., 1:].argmax(-1).gather(1, x[..., 0].argmax(1, keepdim=True)).squeeze(1)).all()
    logits, ent = model(x, q, return_entropy=True)
    assert logits.shape == (8, 10) and ent.shape == (8,)
    logits.sum().backward()
    if norm == "softmax":  # inference-time sharpening changes the attention
        _, ent_ad = model(x, q, norm="adaptive", return_entropy=True)
        assert (ent_ad <= ent + 1e-6).all()


def test_token_logprobs_are_the_log_softmax_and_its_top_k_in_order():
    import torch

    from sharp.models.sampling import token_logprobs

    logits = np.random.default_rng(0).normal(0, 4, (5, 300)).astype(np.float32)
    logits[2, 7] = -np.inf  # a token the model rules out
    chosen = np.array([3, 0, 7, 299, 150])
    lp = token_logprobs(logits, chosen, 4)
    ref = torch.log_softmax(torch.from_numpy(logits).double(), -1)
    assert np.allclose(lp.chosen, ref[np.arange(5), chosen].numpy(), atol=1e-5) and lp.chosen[2] == -np.inf
    top = ref.topk(4)
    assert (lp.top_ids == top.indices.numpy()).all() and np.allclose(lp.top, top.values.numpy(), atol=1e-5)
    assert token_logprobs(logits, chosen, 0).top.shape == (5, 0)
