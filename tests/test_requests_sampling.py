"""The sampling controls agents and model cards ask for — logit_bias, presence, frequency and repetition
penalties, min_p — against NumPy references of their formulas, and served: through both APIs, on the rows that ask
only, the same tokens alone or in a batch under a fixed seed."""

from __future__ import annotations

import concurrent.futures as cf

import httpx
import numpy as np
import pytest
from helpers import HTTP, serving

from sharp.models import load
from sharp.models.sampling import SamplingParams, process, sample
from sharp.models.tokenizer import BYTES
from sharp.serving import Client


def reference_process(logits, params: SamplingParams, prompt, generated):
    """The formulas, token by token: bias; repetition penalty over prompt and output (divide a positive logit,
    multiply a negative one); frequency × count and presence once, over the output."""
    out = [float(x) for x in logits]
    for token, bias in params.logit_bias:
        out[token] += bias
    for token in set(prompt) | set(generated):
        out[token] = (
            out[token] / params.repetition_penalty if out[token] > 0 else out[token] * params.repetition_penalty
        )
    for token in set(generated):
        out[token] -= params.frequency_penalty * list(generated).count(token) + params.presence_penalty
    return np.array(out, np.float32)


@pytest.mark.parametrize("seed", range(6))
def test_processors_equal_their_formulas(seed):
    rng = np.random.default_rng(seed)
    vocab = 50
    logits = rng.normal(0, 3, vocab).astype(np.float32)
    prompt, generated = rng.integers(0, vocab, 7), rng.integers(0, vocab, 12)
    params = SamplingParams(
        presence_penalty=float(rng.uniform(-2, 2)),
        frequency_penalty=float(rng.uniform(-2, 2)),
        repetition_penalty=float(rng.uniform(0.5, 2)),
        logit_bias=((3, 5.0), (int(generated[0]), -2.5)),
    )
    got = process(logits, params, prompt, generated)
    np.testing.assert_allclose(got, reference_process(logits, params, prompt, generated), rtol=1e-5, atol=1e-5)
    assert not np.shares_memory(got, logits) and params.processes and not SamplingParams().processes


def test_min_p_keeps_the_tokens_at_least_that_fraction_as_likely_as_the_best():
    logits = np.log(np.array([[0.5, 0.3, 0.1, 0.06, 0.04]]))
    drawn = {int(sample(logits, SamplingParams(min_p=0.25), np.random.default_rng(i))[0]) for i in range(300)}
    assert drawn == {0, 1}  # the cut is 0.25 × 0.5 = 0.125
    drawn = {int(sample(logits, SamplingParams(min_p=0.15), np.random.default_rng(i))[0]) for i in range(300)}
    assert drawn == {0, 1, 2}  # 0.075


def test_bad_values_are_refused_naming_the_field(model_files):
    cases = [
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"temperature": -1}, "temperature"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"258": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ]
    with serving(model_files, server=HTTP) as srv:
        for extra, field in cases:
            r = httpx.post(f"http://127.0.0.1:{srv.server.http_port}/v1/completions",
                           json={"model": "tiny", "prompt": "x", "max_tokens": 2} | extra, timeout=30)  # fmt: skip
            error = r.json()["error"]
            assert r.status_code == 400 and field in error["message"] and error["param"] == field, (extra, r.text)


def test_served_controls_equal_the_models_own_and_a_bias_forces_or_bans(model_files):
    """Served greedy tokens with penalties equal SharpLM.generate's with the same parameters (the engine passes
    each row its prompt and output); a +100 bias makes a token every token, −100 keeps the greedy one out."""
    model = load(model_files["torch"])
    ids = BYTES.encode("def main():\n")
    with serving(model_files, server=HTTP) as srv, Client(srv.target) as c:
        for params in (
            SamplingParams(temperature=0, repetition_penalty=1.8),
            SamplingParams(temperature=0, presence_penalty=1.5, frequency_penalty=0.5),
        ):
            want = model.generate(ids, 24, params)
            fields = {k: getattr(params, k) for k in ("repetition_penalty", "presence_penalty", "frequency_penalty")}
            got = c.generate("def main():\n", max_new_tokens=24, temperature=0, **fields)
            assert list(got.token_ids) == want, params
            assert want != model.generate(ids, 24, SamplingParams(temperature=0))  # the penalty changed something
        forced = c.generate("def main():\n", max_new_tokens=6, temperature=1.0, seed=1, logit_bias={ord("z"): 100})
        assert forced.text == "zzzzzz"
        greedy = model.generate(ids, 1, SamplingParams(temperature=0))[0]
        banned = c.generate("def main():\n", max_new_tokens=1, temperature=0, logit_bias={greedy: -100})
        assert banned.token_ids[0] != greedy
        body = {"model": "tiny", "prompt": "def main():\n", "max_tokens": 6, "logit_bias": {str(ord("q")): 100}}
        r = httpx.post(f"http://127.0.0.1:{srv.server.http_port}/v1/completions", json=body, timeout=30)
        assert r.json()["choices"][0]["text"] == "qqqqqq"


def test_a_seeded_request_samples_the_same_alone_or_in_a_batch(model_files):
    """Processors and sampling are per row: a request's tokens do not depend on what else is in the batch."""
    ask = {"max_new_tokens": 20, "temperature": 1.0, "seed": 7, "presence_penalty": 1.0, "min_p": 0.05,
           "repetition_penalty": 1.3, "logit_bias": {ord("e"): 3.0}}  # fmt: skip
    with serving(model_files) as srv, Client(srv.target) as c:
        alone = list(c.generate("batch me", **ask).token_ids)
        with cf.ThreadPoolExecutor(6) as pool:
            others = [pool.submit(c.generate, f"other {i}", max_new_tokens=40, temperature=0.7, seed=i,
                                  frequency_penalty=0.5) for i in range(5)]  # fmt: skip
            beside = pool.submit(c.generate, "batch me", **ask)
            assert list(beside.result().token_ids) == alone
            for f in others:
                f.result()
