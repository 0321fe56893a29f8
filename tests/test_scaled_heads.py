"""Length-scaled heads (`scaled_heads`, `--scaled-heads`): chosen heads' queries × max(1, log n / log from) at n keys,
every other head as trained — the same in sharp's own modules (the torch backend), in transformers' attention hook,
and in the exported file."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

from hf_models import _configs, write_model  # noqa: E402

from sharp.exporter import cli as export_cli  # noqa: E402
from sharp.exporter import metadata  # noqa: E402
from sharp.models import ModelConfig, hf, hf_lm  # noqa: E402
from sharp.models.positional import head_length_scale  # noqa: E402

FROM = 8  # the tests' prompts run well past it


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("scaled") / "llama", _configs()["llama"])


def test_the_factor_is_one_up_to_from_then_log_n_over_log_from_on_the_chosen_heads_only():
    keys = torch.tensor([[1, 2, 8, 9, 64, 4096]])
    f = head_length_scale(keys, torch.tensor([False, True, False]), 8)
    assert f.shape == (1, 3, 6, 1)
    assert torch.equal(f[0, 0, :, 0], torch.ones(6)) and torch.equal(f[0, 2, :, 0], torch.ones(6))
    want = [1.0, 1.0, 1.0, math.log(9) / math.log(8), 2.0, 4.0]
    assert torch.allclose(f[0, 1, :, 0], torch.tensor(want), rtol=1e-6)


def _config(llama, heads=((1, 2), (0, 0))):
    config = hf.load_config(llama)
    hf.sharpen(config, "softmax", scaled=(heads, FROM))
    return config


def test_sharp_modules_and_the_transformers_hook_compute_the_same_scaled_model(llama):
    config = _config(llama)
    assert config.sharp_attention == {"norm": "softmax", "scaled_heads": [[1, 2], [0, 0]], "scaled_from": FROM}
    ids = torch.randint(3, 300, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = hf_lm.load(llama, config).step(ids).logits
        theirs = hf.load_model(llama, config)(ids).logits
        plain = hf.load_model(llama)(ids).logits
    assert torch.allclose(ours, theirs, atol=1e-4)
    # as trained while a query sees at most FROM keys; changed after
    assert torch.allclose(theirs[:, :FROM], plain[:, :FROM], atol=1e-6)
    assert (theirs[:, FROM + 4 :] - plain[:, FROM + 4 :]).abs().amax() > 1e-2


def test_a_left_padded_row_counts_its_own_keys(llama):
    """The hook counts the keys a query sees from the mask: a padded row gets the factor of its unpadded self."""
    model = hf.load_model(llama, _config(llama))
    ids = torch.randint(3, 300, (1, 30), generator=torch.Generator().manual_seed(2))
    padded = torch.cat([torch.zeros(1, 6, dtype=torch.long), ids], 1)
    mask = torch.cat([torch.zeros(1, 6, dtype=torch.long), torch.ones(1, 30, dtype=torch.long)], 1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        alone = model(ids).logits
        row = model(padded, attention_mask=mask, position_ids=positions).logits[:, 6:]
    assert torch.allclose(alone, row, atol=1e-4)


def test_sharp_export_writes_and_checks_a_model_with_scaled_heads(llama, tmp_path, capsys):
    out = tmp_path / "scaled.onnx"
    argv = [str(llama), "--scaled-heads", "1.2", "0.0", "--scaled-from", str(FROM), "-o", str(out)]
    assert export_cli.main(argv) == 0
    assert "check passed" in capsys.readouterr().out
    meta = metadata.read(out)
    assert meta.config["sharp_attention"]["scaled_heads"] == [[1, 2], [0, 0]]
    assert meta.config["sharp_attention"]["scaled_from"] == FROM
    # config.json's own entry is exported as it stands, with another norm beside it
    model = tmp_path / "model"
    shutil.copytree(llama, model)
    config = json.loads((model / "config.json").read_text())
    entry = {"norm": "softmax", "scaled_heads": [[1, 3]], "scaled_from": FROM}
    (model / "config.json").write_text(json.dumps({**config, "sharp_attention": entry}))
    assert export_cli.main([str(model), "--norm", "ssmax", "--ssmax-s", "0.3", "-o", str(tmp_path / "b.onnx")]) == 0
    kept = metadata.read(tmp_path / "b.onnx").config["sharp_attention"]
    assert kept["norm"] == "ssmax" and kept["scaled_heads"] == [[1, 3]]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--scaled-heads", "1x2"], "each head is LAYER.HEAD"),
        (["--scaled-heads", "2.0"], "scaled_heads 2.0: the model has layers 0–1 and heads 0–3"),
        (["--scaled-heads", "0.4"], "scaled_heads 0.4: the model has layers 0–1 and heads 0–3"),
        (["--scaled-heads", "0.1", "0.1"], "names a head twice"),
        (["--scaled-heads", "0.1", "--scaled-from", "1"], "--scaled-from 1: it must be >= 2"),
        (["--scaled-from", "64"], "give --scaled-heads too"),
    ],
)
def test_bad_scaled_heads_exit_2_with_one_line(llama, tmp_path, capsys, args, says):
    assert export_cli.main([str(llama), *args, "-o", str(tmp_path / "x.onnx")]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and "\n" not in err
    assert not (tmp_path / "x.onnx").exists()


def test_a_sharplm_checkpoint_exports_with_scaled_heads(model_files, tmp_path, capsys):
    out = tmp_path / "tiny.onnx"
    argv = [str(model_files["torch"]), "--scaled-heads", "1.1", "--scaled-from", "4", "-o", str(out)]
    assert export_cli.main(argv) == 0
    assert "check passed" in capsys.readouterr().out
    assert metadata.read(out).config["scaled_heads"] == [3] and metadata.read(out).config["scaled_from"] == 4


def test_model_config_refuses_heads_outside_the_model_and_a_start_below_two():
    with pytest.raises(ValueError, match=r"scaled_heads must be layer·heads \+ head in \[0, 8\)"):
        ModelConfig(layers=2, heads=4, scaled_heads=(8,))
    with pytest.raises(ValueError, match="scaled_from must be >= 2"):
        ModelConfig(scaled_from=1)
    with pytest.raises(ValueError, match="scaled_heads must be tuple"):
        ModelConfig(scaled_heads=(1.5,))
    with pytest.raises(ValueError, match="scaled_heads must be"):
        hf.AttentionSettings.of(transformers.LlamaConfig(sharp_attention={"scaled_heads": [1, 2]}))
    for entry in ({"scaled_heads": [[True, 1]]}, {"scaled_heads": [[0, 1, 2]]}, {"scaled_heads": [[0, -1]]}):
        with pytest.raises(ValueError, match=r"\[layer, head\] pairs of integers >= 0"):
            hf.AttentionSettings.of(transformers.LlamaConfig(sharp_attention=entry))
    with pytest.raises(ValueError, match="scaled_from must be an integer >= 2"):
        entry = {"scaled_heads": [[0, 1]], "scaled_from": 1.5}
        hf.AttentionSettings.of(transformers.LlamaConfig(sharp_attention=entry))


def test_key_attention_is_each_heads_softmax_weight_on_the_key_while_the_key_is_written():
    """The finder's weight against softmax computed here from the queries and keys the layers attend with: the rows
    that predict the key's tokens, the columns where the key sits in the prompt (both of its places)."""
    from sharp.benchmarks.retrieval_heads import key_attention, top_heads
    from sharp.models import SharpLM

    torch.manual_seed(0)
    model = SharpLM(ModelConfig(vocab_size=50, dim=32, layers=2, heads=4, kv_heads=2)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.3)
    ids = torch.randint(10, 50, (30,)).tolist()
    ids[5:8] = ids[20:23] = [3, 4, 9]  # the key, twice, as the passkey's needle holds it
    answer = [3, 4, 9]
    got = key_attention(model, [(ids, "k"), ([11] * 30, "absent")], lambda key: answer if key == "k" else [7])
    seen = []

    def spy(attention):
        def attend(q, k, v, **kw):
            seen.append((q, k))
            return attention(q, k, v, **kw)

        return attend

    for block in model.blocks:
        block.attn.attention = spy(block.attn.attention)
    with torch.no_grad():
        model.step(torch.tensor([ids + answer[:-1]]))
    for layer, (q, k) in enumerate(seen):
        k = k.repeat_interleave(2, dim=1)
        logits = (q @ k.transpose(-1, -2))[0] / 8**0.5
        logits = logits.masked_fill(torch.ones(32, 32, dtype=torch.bool).triu(1), float("-inf"))
        weights = logits.softmax(-1)[:, 29:32][..., [5, 6, 7, 20, 21, 22]].sum(-1).mean(-1)
        assert torch.allclose(got[layer], weights, atol=1e-5), layer
    best = top_heads(got, 3)
    assert [w for *_, w in best] == sorted(got.flatten().tolist(), reverse=True)[:3]
    assert got[best[0][0], best[0][1]] == best[0][2]
    with pytest.raises(ValueError, match="no prompt holds its key"):
        key_attention(model, [([11] * 30, "absent")], lambda key: [7])


@pytest.mark.parametrize("backend", ["onnxruntime", "torch"])
def test_a_scaled_model_serves_the_greedy_tokens_of_sharp_modules_in_a_left_padded_batch(llama, tmp_path, backend):
    """Served from config.json's entry — exported for onnxruntime (its in-place cache, prompts of different lengths
    batched together), read as it is by the torch backend (its paged cache) — a length-scaled model writes the
    greedy tokens sharp's modules write alone, past the keys the scaling starts at."""
    from sharp.models.sampling import GREEDY
    from sharp.serving import Client
    from sharp.serving.api.client import make_request
    from sharp.serving.api.server import BackgroundServer, ServerConfig
    from sharp.serving.backends.loading import load_backend
    from sharp.serving.config import EngineConfig
    from sharp.serving.engine.engine import Engine
    from sharp.serving.metrics import ServingMetrics

    model = tmp_path / "scaled"
    shutil.copytree(llama, model)
    config = json.loads((model / "config.json").read_text())
    entry = {"norm": "softmax", "scaled_heads": [[1, 2], [0, 0], [1, 0]], "scaled_from": 4}
    (model / "config.json").write_text(json.dumps({**config, "sharp_attention": entry}))
    path = model
    if backend == "onnxruntime":
        path = tmp_path / "scaled.onnx"
        assert export_cli.main([str(model), "-o", str(path)]) == 0
    served = load_backend(path, backend)
    engine = Engine(served, EngineConfig(), ServingMetrics(served.spec))
    ours = hf_lm.load(model)
    plain = hf_lm.load(llama)
    prompts = ["def main():\n", "The quick brown fox jumps over the lazy dog and", "Zoë 🎉"]
    differs = 0
    with BackgroundServer(engine, ServerConfig(port=0, metrics_port=0)) as srv, Client(srv.target) as c:
        futures = {p: c.stub.Generate.future(make_request(p, max_new_tokens=24, temperature=0)) for p in prompts}
        for prompt, future in futures.items():
            ids = c.tokenize(prompt, add_bos=True)
            want = ours.generate(ids, 24, GREEDY, eos=None)
            assert list(future.result().token_ids) == want[: len(future.result().token_ids)], prompt
            differs += want != plain.generate(ids, 24, GREEDY, eos=None)
    assert differs  # the scaling changed what the model writes: the comparison above could fail
