"""Test-wide setup. Without a GPU the Triton kernels run in Triton's CPU interpreter, which must be chosen
before triton is first imported."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
