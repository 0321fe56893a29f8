"""The Triton kernels the torch path and the TensorRT plugin launch, by name (docs/attention.md); the host side is
in `attention.py` and `paged.py`, ahead-of-time compilation in `aot.py`.

Grid of the contiguous kernels: (query blocks, B·Hq, key splits). A program owns BLOCK_M query rows of one head and
the key range of its split, walks that range in BLOCK_N tiles and finishes the rows (one split: prefill,
FlashAttention-2 style) or writes their partial state, which `_merge_softmax_kernel` merges (many splits: decode,
flash-decoding style). Masking is explicit: rows ≥ Lq, keys ≥ Lk, head-dim lanes ≥ D and causally hidden keys all
read as −inf logits or 0. The rooms:

- `common`: a program's rows and key range, tile loads and products, per-row logit factors, column partials;
- `softmax`: the softmax family's online walk and kernel;
- `threshold`: the entmax threshold search;
- `entmax`: entmax prefill, every sweep in one program;
- `decode`: split-K decode's entmax kernels and the merge of split states;
- `tensorrt`: the TensorRT entry points.
"""

from __future__ import annotations

from sharp.plugins.triton.decode import (
    _entmax_logits_kernel,
    _entmax_output_kernel,
    _entmax_threshold_kernel,
    _merge_softmax_kernel,
)
from sharp.plugins.triton.entmax import _entmax_kernel
from sharp.plugins.triton.softmax import _softmax_family_kernel
from sharp.plugins.triton.tensorrt import _trt_entmax_kernel, _trt_softmax_family_kernel

KERNELS = {
    "softmax_family": _softmax_family_kernel,
    "entmax": _entmax_kernel,
    "entmax_logits": _entmax_logits_kernel,
    "entmax_threshold": _entmax_threshold_kernel,
    "entmax_output": _entmax_output_kernel,
    "merge_softmax": _merge_softmax_kernel,
    "trt_softmax_family": _trt_softmax_family_kernel,
    "trt_entmax": _trt_entmax_kernel,
}
