"""The environment of a subprocess that compiles the kernels under the venv's Triton ("newest") or the oldest one
the kernels extra admits ("oldest", unpacked by `make triton-oldest`; CI must have it)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

OLDEST_TRITON = Path(__file__).resolve().parents[1] / "build" / "triton-oldest"


def compile_env(which: str) -> dict[str, str]:
    """os.environ without TRITON_INTERPRET (the interpreter cannot compile), the oldest Triton first on the path."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if which == "oldest":
        if not (OLDEST_TRITON / "triton").is_dir():
            if os.environ.get("CI") == "true":
                pytest.fail("CI must run `make triton-oldest` before the tests")
            pytest.skip("the oldest supported Triton is not unpacked here: make triton-oldest")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(OLDEST_TRITON), env.get("PYTHONPATH")]))
    return env
