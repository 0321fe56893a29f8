"""The package as a user installs it: a wheel built from the tracked files, installed outside the source tree,
finds its demo models and runs the demo; without them the demo fails loudly."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(args, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=600, check=False, **kw)


def test_wheel_installed_outside_the_tree_runs_the_demo(tmp_path):
    src = tmp_path / "src"  # a copy of the tracked files: the build never writes into the checkout
    tracked = _run(["git", "ls-files"], cwd=ROOT).stdout.split()
    for name in tracked:
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, src / name)
    built = _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(src)]
    )
    assert built.returncode == 0, built.stderr[-2000:]
    wheel = next(tmp_path.glob("sharp_attention-*.whl"))
    site = tmp_path / "site"
    installed = _run([sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(site), str(wheel)])
    assert installed.returncode == 0, installed.stderr[-2000:]
    env = {**os.environ, "PYTHONPATH": str(site)}
    work = tmp_path / "elsewhere"
    work.mkdir()
    probe = (
        "import sharp; from sharp.models.checkpoint import zoo_model; print(sharp.__file__); print(zoo_model('ssa'))"
    )
    where = _run([sys.executable, "-c", probe], cwd=work, env=env)
    assert where.returncode == 0, where.stderr
    assert all(line.startswith(str(site)) for line in where.stdout.split()), where.stdout

    demo = _run([sys.executable, "-m", "sharp.demo"], cwd=work, env=env)
    assert demo.returncode == 0, demo.stderr[-2000:]
    assert "check passed" in demo.stdout and "sharp-serve exited with 0" in demo.stdout

    (site / "sharp" / "models" / "zoo" / "ssa.pt").unlink()
    broken = _run([sys.executable, "-m", "sharp.demo"], cwd=work, env=env)
    assert broken.returncode != 0
    assert "ssa.pt is missing" in broken.stderr and "skipped" not in broken.stdout
