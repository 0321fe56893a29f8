"""The torch backend's sampling stage on its device (models/torch_sampling.py, serving/backends/torch_backend.py's
TorchSampler) against the NumPy one every graph backend runs: the same processed logits, the same tokens from the
same seeds, the same log-probabilities and grammar masks — and a torch backend's step hands the engine a tensor on
its device, not host logits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sharp.models import torch_sampling
from sharp.models.sampling import SamplingParams, generator, process, sample_rows, token_logprobs
from sharp.serving.backends.sampler import Sampler
from sharp.serving.backends.torch_backend import TorchSampler

V = 300
PROCESSED = [
    SamplingParams(logit_bias=((3, 100.0), (7, -100.0), (3, 2.5))),  # a repeated id adds both
    SamplingParams(repetition_penalty=1.7),
    SamplingParams(repetition_penalty=0.6),
    SamplingParams(presence_penalty=1.5, frequency_penalty=-0.7),
    SamplingParams(presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=1.3, logit_bias=((0, 5.0),)),
]
SAMPLED = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.4, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=0.9, min_p=0.05),
    SamplingParams(temperature=1.0, top_k=40, top_p=0.5, min_p=0.01),
    SamplingParams(temperature=1.0, top_p=0.0),
]


def _logits(rows: int, seed: int) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((rows, V)) * 3).astype(np.float32)


@pytest.mark.parametrize("params", PROCESSED)
def test_processors_equal_numpys(params):
    """Bias, repetition, frequency and presence penalties give NumPy's float32 values exactly."""
    rng = np.random.default_rng(0)
    row = _logits(1, 1)[0]
    prompt, generated = rng.integers(0, V, 40), rng.integers(0, V, 25)
    want = process(row, params, prompt, generated)
    got = torch_sampling.process(torch.from_numpy(row), params, prompt, generated)
    np.testing.assert_array_equal(got.numpy(), want)
    assert not np.array_equal(want, row)  # each case changes something


def test_the_same_seed_samples_the_same_tokens():
    """Every filter and temperature, row by row in one batch with its own seeded generator: the same tokens as
    NumPy's sampler over 40 steps (the same uniforms drawn), and an unusable row is None in both."""
    params = SAMPLED * 2
    for step in range(40):
        logits = _logits(len(params), 100 + step)
        logits[3, :] = np.nan if step % 2 else -np.inf
        np_gens = [generator(1000 * i + step) for i in range(len(params))]
        torch_gens = [generator(1000 * i + step) for i in range(len(params))]
        want = sample_rows(logits, params, np_gens)
        got = torch_sampling.sample_rows(torch.from_numpy(logits), params, torch_gens)
        assert got == want and got[3] is None
    assert len({t for t in want if t is not None}) > 3  # varied tokens, not one argmax


def test_log_probabilities_equal_numpys():
    logits = _logits(5, 7)
    chosen = [0, 17, 299, 5, 123]
    want = token_logprobs(logits, np.array(chosen), 6)
    got = torch_sampling.token_logprobs(torch.from_numpy(logits), chosen, 6)
    np.testing.assert_allclose(got.chosen, want.chosen, rtol=0, atol=1e-5)
    np.testing.assert_array_equal(got.top_ids, want.top_ids)
    np.testing.assert_allclose(got.top, want.top, rtol=0, atol=1e-5)


def test_grammar_bitmasks_unpack_in_token_order():
    """The bitmask's bit j of word w is token 32·w + j, as NumPy's unpack reads it (a vocabulary not a multiple of
    32 included)."""
    bits = np.random.default_rng(3).integers(-(2**31), 2**31, (3, (V + 31) // 32), dtype=np.int64).astype(np.int32)
    allowed = torch_sampling.unpack_allowed(bits, V, torch.device("cpu")).numpy()
    want = np.unpackbits(bits.view(np.uint8), axis=-1, count=V, bitorder="little").astype(bool)
    np.testing.assert_array_equal(allowed, want)


def test_the_torch_sampler_is_the_numpy_sampler_on_device_tensors():
    """TorchSampler's operations, as the executor calls them, leave the same logits and tokens as NumPy's Sampler."""
    logits = _logits(4, 11)
    host, dev = Sampler(), TorchSampler(torch.device("cpu"))
    a, b = host.copy(logits), dev.copy(torch.from_numpy(logits))
    for ops, x in ((host, a), (dev, b)):
        ops.process(x, 1, PROCESSED[3], np.arange(5), np.array([2, 2, 9]))
        ops.ban(x, 2, [4, 8])
    np.testing.assert_array_equal(b.numpy(), a)
    assert np.isneginf(a[2, [4, 8]]).all() and not np.isneginf(logits).any()
    params = [SAMPLED[1], SAMPLED[3], SAMPLED[0], SAMPLED[2]]
    want = host.sample_rows(a, params, [generator(i) for i in range(4)])
    assert dev.sample_rows(b, params, [generator(i) for i in range(4)]) == want
    assert dev.token_logprobs(b, [0, 3], [want[0], want[3]], 2).top_ids.tolist() == (
        host.token_logprobs(a, [0, 3], [want[0], want[3]], 2).top_ids.tolist()
    )
    bits = np.random.default_rng(0).integers(-(2**31), 2**31, (2, (V + 31) // 32)).astype(np.int32)
    for rows in ([0, 2], [1, 2], [3]):  # apart, together (a view of the rows), alone
        for ops, x in ((host, a), (dev, b)):
            ops.mask(x, rows, bits[: len(rows)])
        np.testing.assert_array_equal(b.numpy(), a)
        bit = lambda r, t: (int(bits[r, t // 32]) >> (t % 32)) & 1
        for r, row in enumerate(rows):
            assert all(np.isneginf(a[row, t]) for t in range(V) if not bit(r, t)), rows
    assert np.array_equal(dev.rows(b, [3, 1]).numpy(), host.rows(a, [3, 1])) and np.shares_memory(a, a[1:3])


def test_a_torch_backend_samples_on_its_device_under_every_control(model_files):
    """End to end on sharp-serve's torch backend (on loopback, the openai SDK): a step hands the engine its logits as
    a tensor on the model's device; a grammar, penalties, a bias, min_tokens and log-probabilities all apply there —
    each output matches its regular expression, the banned token never appears, and a seed gives the same text
    alone as beside other requests."""
    import concurrent.futures
    import re

    from helpers import HTTP, api, serving

    from sharp.serving import load_backend
    from sharp.serving.kv.names import PageNames

    backend = load_backend(model_files["torch"], "torch")
    backend.allocate(1 << 20)
    backend.admit("s", PageNames([1, 2, 3]), 8, False, False)
    step = backend.prefill("s", np.array([[1, 2, 3]]), 0, False)
    assert isinstance(step.logits, torch.Tensor) and step.logits.device == backend.device
    pattern = r"[a-f]{4}-[0-9]{3}"
    body = {"temperature": 1.0, "max_tokens": 12, "logprobs": 2, "presence_penalty": 1.5,
            "logit_bias": {str(ord("a")): -100}, "extra_body": {"structured_outputs": {"regex": pattern},
                                                                  "min_tokens": 2}}  # fmt: skip
    with serving(model_files, backend="torch", server=HTTP) as srv:
        oa = api(srv)
        ask = lambda seed: oa.completions.create(model="tiny", prompt="code", seed=seed, **body).choices[0]
        alone = [ask(seed) for seed in range(6)]
        for c in alone:
            assert re.fullmatch(pattern, c.text) and "a" not in c.text, c.text
            assert len(c.logprobs.tokens) >= len(c.text) and all(len(t) == 2 for t in c.logprobs.top_logprobs)
        assert len({c.text for c in alone}) > 2
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            together = list(pool.map(ask, range(6)))
        assert [c.text for c in together] == [c.text for c in alone]
