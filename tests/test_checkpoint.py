"""Checkpoints: round trip, and every unsafe or wrong file refused with a clear error, never executed."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
from torch import nn

from sharp.models import CheckpointError, MaxRetrieval, MaxRetrievalConfig, ModelConfig, SharpLM, load, save
from sharp.models.checkpoint import read


class _Exploit:
    """Unpickling this would create a file: proof that code ran."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.makedirs, (str(self.marker),))


def _lm() -> SharpLM:
    torch.manual_seed(0)
    return SharpLM(ModelConfig(dim=32, layers=2, heads=4, norm="ssa", pos="nape", context_length=128)).eval()


def test_round_trip_is_exact_and_weights_only_readable(tmp_path):
    model = _lm()
    path = save(model, tmp_path / "model.pt", task="unit", steps=3)
    raw = torch.load(path, weights_only=True)
    assert raw["format"] == "sharp" and raw["version"] == 1 and raw["norm"] == "ssa"
    assert raw["config"]["architecture"] == "SharpLM" and raw["tokenizer"]["kind"] == "bytes"
    assert raw["meta"]["task"] == "unit"
    again = load(path)
    ids = torch.randint(0, 258, (1, 7))
    with torch.no_grad():
        torch.testing.assert_close(again(ids), model(ids), atol=0, rtol=0)
    mr = MaxRetrieval(MaxRetrievalConfig(norm="asentmax", width=16))
    assert isinstance(load(save(mr, tmp_path / "mr.pt")), MaxRetrieval)


def test_arbitrary_pickle_is_refused_and_not_executed(tmp_path):
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.pt"
    torch.save({"format": "sharp", "x": _Exploit(marker)}, evil)
    with pytest.raises(CheckpointError, match="refused"):
        load(evil)
    assert not marker.exists()
    plain = tmp_path / "plain.pkl"
    plain.write_bytes(pickle.dumps(_Exploit(marker)))
    with pytest.raises(CheckpointError):
        load(plain)
    assert not marker.exists()


def test_wrong_files_are_explained(tmp_path):
    with pytest.raises(CheckpointError, match="no such file"):
        load(tmp_path / "missing.pt")
    good = save(_lm(), tmp_path / "m.pt")
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[:2000])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load(truncated)
    other = tmp_path / "linear.pt"
    torch.save(nn.Linear(3, 4).state_dict(), other)
    with pytest.raises(CheckpointError, match="not a sharp checkpoint"):
        load(other)
    payload = torch.load(good, weights_only=True)
    payload["state_dict"]["embed.weight"] = torch.zeros(3, 3)
    torch.save(payload, tmp_path / "mismatch.pt")
    with pytest.raises(CheckpointError, match=r"config says embed.weight is \(258, 32\), the weights hold \(3, 3\)"):
        load(tmp_path / "mismatch.pt")
    payload = torch.load(good, weights_only=True)
    payload["version"] = 99
    torch.save(payload, tmp_path / "future.pt")
    with pytest.raises(CheckpointError, match="version 99"):
        read(tmp_path / "future.pt")
    payload = torch.load(good, weights_only=True)
    payload["config"]["architecture"] = "GPT5"
    torch.save(payload, tmp_path / "arch.pt")
    with pytest.raises(CheckpointError, match="unsupported architecture 'GPT5'"):
        load(tmp_path / "arch.pt")
