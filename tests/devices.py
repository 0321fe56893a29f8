"""Where the kernel tests run: the GPU when torch sees one, else Triton's CPU interpreter (conftest turns it on).
One place, so that `make test` checks the compiled kernels on a CUDA machine and the interpreter elsewhere."""

from __future__ import annotations

import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# fp32 error bounds against attend(impl="reference"). The interpreter runs the kernels in numpy's fp32 with the
# C library's exp/log (≤ 1e-5 from the reference at these sizes); compiled for a GPU, exp2/log2 lower to the
# hardware's approximate instructions and sums run in another order (measured up to 3e-5 on an H100).
ATOL = 1e-5 if DEVICE.type == "cpu" else 4e-5
ATOL_LOOSE = 2e-5 if DEVICE.type == "cpu" else 4e-5  # tests whose CPU bound was already 2e-5


def on_device(value, device: torch.device = DEVICE):
    """Tensors (alone, in a list or tuple, or as the values of a dict) moved to `device`; anything else as it is."""
    if isinstance(value, dict):
        return {k: on_device(v, device) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(on_device(v, device) for v in value)
    return value.to(device) if isinstance(value, torch.Tensor) else value


def device_name(device: torch.device = DEVICE) -> str:
    """What the tile cache records as the device: the GPU's name, or "cpu"."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
