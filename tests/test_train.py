"""sharp-train: a short run learns, resuming continues where it stopped, CLI mistakes exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sharp.models import load
from sharp.models.max_retrieval import max_retrieval_batch
from sharp.models.train import main, parse, train


def test_max_retrieval_learns(tmp_path, capsys):
    out = tmp_path / "mr.pt"
    assert main(["max-retrieval", "--steps", "300", "--batch", "64", "--dim", "64", "--out", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    model = load(out)
    meta = torch.load(out, weights_only=True)["meta"]
    assert meta["final_loss"] < 0.7 * meta["first_loss"]
    x, q, y = max_retrieval_batch(512, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        accuracy = (model(x, q).argmax(-1) == y).float().mean().item()
    assert accuracy > 0.3  # chance is 0.1


def test_copy_lm_loss_falls(tmp_path):
    args = parse(
        [
            "copy",
            "--steps",
            "120",
            "--batch",
            "16",
            "--dim",
            "32",
            "--layers",
            "1",
            "--norm",
            "ssa",
            "--size",
            "3",
            "6",
            "--lr",
            "3e-3",
            "--out",
            str(tmp_path / "c.pt"),
        ]
    )
    result = train(args, progress=False)
    first, last = sum(result.losses[:10]) / 10, sum(result.losses[-10:]) / 10
    assert last < 0.8 * first


def test_resume_continues_from_the_saved_step(tmp_path):
    out = tmp_path / "r.pt"
    base = ["max-retrieval", "--steps", "10", "--batch", "8", "--dim", "16", "--save-every", "6", "--out", str(out)]
    first = train(parse(base), progress=False)  # interrupted run: saves at step 6 only
    assert len(first.losses) == 10 and (tmp_path / "r.pt.resume.pt").is_file()
    resumed = train(parse([*base, "--resume"]), progress=False)
    assert len(resumed.losses) == 4  # steps 6..9


@pytest.mark.parametrize(
    "argv",
    [
        ["juggling"],
        ["copy", "--norm", "sparsemax"],
        ["text"],
        ["copy", "--norm", "entmax", "--alpha", "1.0"],
        ["copy", "--size", "9", "3"],
        ["max-retrieval", "--pos", "alibi"],
    ],
)
def test_cli_mistakes_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_resume_without_state_exits_2(tmp_path, capsys):
    assert main(["copy", "--steps", "2", "--resume", "--out", str(tmp_path / "none.pt")]) == 2
    assert "not found" in capsys.readouterr().err


def test_resume_refuses_a_state_file_holding_python_objects_in_one_line(tmp_path, capsys):
    """A .resume.pt is read weights-only like a checkpoint: objects are refused (never run), one line, exit 2."""
    base = ["copy", "--steps", "2", "--save-every", "1", "--out", str(tmp_path / "r.pt")]
    assert main(base) == 0
    capsys.readouterr()
    torch.save({"step": 1, "optimizer": {}, "generator": Path("not a tensor")}, tmp_path / "r.pt.resume.pt")
    assert main([*base, "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert "refused" in err and "the .resume.pt sharp-train writes" in err and len(err.splitlines()) == 1
    torch.save({"weights": torch.zeros(2)}, tmp_path / "r.pt.resume.pt")
    assert main([*base, "--resume"]) == 2
    assert "is not a sharp-train resume file" in capsys.readouterr().err
