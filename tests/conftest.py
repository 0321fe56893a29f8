"""Test-wide setup. Without a GPU the Triton kernels run in Triton's CPU interpreter, which must be chosen
before triton is first imported. On a GPU, prefill tiles are not tuned (every tile is checked by its own test, and
the tuner's tests turn it on) and nothing is written to the user's tile cache."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("SHARP_TRITON_AUTOTUNE", "0")
os.environ.setdefault("SHARP_TILE_CACHE", "0")
