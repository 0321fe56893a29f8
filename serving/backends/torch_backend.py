"""The torch backend: a sharp model.pt (SharpLM), a Hugging Face directory or a GGUF file (read into a SharpLM by
models/hf_lm.py) on a paged KV cache (backends/interface.py: the interface)."""

from __future__ import annotations

from collections.abc import Hashable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from sharp.exporter import metadata
from sharp.models import gguf, registry, torch_sampling
from sharp.serving.backends.graphs import DecodeGraphs
from sharp.serving.backends.interface import DTYPES, Backend, BackendError, Hit, Prefix, StepResult
from sharp.serving.backends.sampler import Sampler
from sharp.serving.kv.names import PAGE_SIZE
from sharp.serving.kv.pages import OutOfPages, PagedKVCache
from sharp.serving.spec import ModelSpec

if TYPE_CHECKING:
    from sharp.models.lm import SharpLM

# On CPU, from this many keys on the torch backend runs the streamed attention (O(n) memory) instead of the
# reference, whose (queries × keys) logits grow quadratically with the prompt.
STREAMED_FROM_KEYS = 1024
# ... except a decode step whose logits (sequences × query heads × keys) stay under this many: there the reference's
# few matrix products beat the streamed blocks (SharpLM zoo shape, 4K keys, 2 cores: softmax 3.9 against 26 ms a
# step, entmax 16 against 210 ms) and its logits take at most 64 MiB.
REFERENCE_DECODE_LOGITS = 1 << 24
TORCH_DTYPES = dict(zip(DTYPES, (torch.float32, torch.bfloat16, torch.float16), strict=True))


class TorchSampler(Sampler):
    """The sampling stage's operations on logits left on the model's device (models/torch_sampling.py): a step's
    (rows × vocab) logits stay there, and only token ids, the asked-for log-probabilities and the grammar bitmasks
    cross."""

    def __init__(self, device: torch.device):
        self.device = device

    def empty(self, vocab):
        return torch.empty(0, vocab, device=self.device)

    def concat(self, parts):
        return torch.cat(parts)

    def copy(self, logits):
        return logits.clone()

    def rows(self, logits, rows):
        return logits[torch.tensor(rows, device=logits.device)]

    def process(self, logits, i, params, prompt, generated):
        logits[i] = torch_sampling.process(logits[i], params, prompt, generated)

    def ban(self, logits, i, ids):
        logits[i, torch.tensor(ids, dtype=torch.int64, device=logits.device)] = -torch.inf

    def mask(self, logits, rows, bits):
        allowed = torch_sampling.unpack_allowed(bits, logits.shape[1], self.device)
        index = torch.tensor(rows, device=logits.device)
        logits[index] = logits[index].masked_fill(~allowed, -torch.inf)

    def sample_rows(self, logits, params, generators):
        return torch_sampling.sample_rows(logits, params, generators)

    def token_logprobs(self, logits, rows, picked, top):
        return torch_sampling.token_logprobs(logits[torch.tensor(rows, device=logits.device)], picked, top)


def _checkpoint(path: Path, export: dict) -> tuple[SharpLM, metadata.ModelMetadata]:
    """A sharp checkpoint's SharpLM and metadata."""
    from sharp.models import CheckpointError, SharpLM, load

    try:
        model = load(path)
    except CheckpointError as e:
        raise BackendError(str(e)) from e
    if not isinstance(model, SharpLM):
        raise BackendError(f"{path}: a {type(model).__name__} checkpoint; only SharpLM language models generate")
    return model, metadata.ModelMetadata.from_model(model, export)


def _transformers(path: Path, export: dict) -> tuple[SharpLM, metadata.ModelMetadata]:
    """A Hugging Face directory's (or a GGUF file's, read once into one in the cache) SharpLM and metadata: the
    directory's own tokenizer and chat template, its name the directory's (the GGUF file's stem)."""
    from sharp.exporter.hf import config_metadata, load_tokenizer
    from sharp.models import hf, hf_lm

    name = metadata.source_name(path)
    try:
        directory = gguf.hf_directory(path) if gguf.is_gguf(path) else path
        config = hf.load_config(directory)
        model = hf_lm.load(directory, config)
        tokenizer = load_tokenizer(directory, config)
    except (ValueError, OSError) as e:  # UnsupportedModel, GGUFError and a missing tokenizer.json are ValueErrors
        raise BackendError(str(e)) from None
    return model, config_metadata(config, tokenizer, export, name)


class TorchBackend(Backend):
    """A SharpLM in PyTorch — a sharp `model.pt`, or a Hugging Face directory or GGUF file read into one — on a
    paged KV cache. On CUDA the attention runs the Triton kernels (decode steps and short chunks read the pages
    directly; long prefill chunks run the prefill kernels over the sequence's keys, a view of the pool when its
    pages are consecutive); on CPU the reference or, from
    STREAMED_FROM_KEYS keys, the streamed attention over the same keys (not for a decode step whose logits are small:
    REFERENCE_DECODE_LOGITS).
    `impl` overrides that choice (e.g. "triton" in the CPU interpreter); `dtype` is the weights' and the cache's
    (default fp32 on CPU, bf16 on CUDA). With `sparse` an entmax-family model's decode reads only the pages that can
    carry weight — the torch implementations (models/sparse_decode.py) and the Triton paged kernel alike — the cache
    keeping page summaries for it; off by default: in eager torch its extra steps cost more than the pages it skips
    save (docs/benchmarks.md), and on a GPU it is not measured yet."""

    block_tokens = PAGE_SIZE

    def __init__(
        self,
        path: Path,
        device: str = "cpu",
        impl: str | None = None,
        dtype: str | None = None,
        graphs: bool | None = None,
        sparse: bool = False,
    ):
        if device == "cuda" and not torch.cuda.is_available():
            raise BackendError("--device cuda: no CUDA device is visible to torch")
        dtype = dtype or ("bf16" if device == "cuda" else "fp32")
        if dtype not in DTYPES:
            raise BackendError(f"unknown dtype {dtype!r}; valid: {', '.join(DTYPES)}")
        path = Path(path)
        export = {"dtype": dtype, "kv_dtype": dtype}  # pages in --dtype
        model, meta = _transformers(path, export) if path.is_dir() or gguf.is_gguf(path) else _checkpoint(path, export)
        self.device, self.dtype = torch.device(device), TORCH_DTYPES[dtype]
        self.sampler = TorchSampler(self.device)
        self.model = model.to(self.device, self.dtype).eval()
        self.impl = impl
        if impl is not None:
            self.attention = f"attention: impl={impl!r} (torch, {device})"
        elif device == "cuda":
            self.attention = "attention: sharp's Triton kernels (paged decode, fused prefill)"
        else:
            self.attention = f"attention: torch reference, streamed from {STREAMED_FROM_KEYS} keys"
        self.spec = ModelSpec(meta.name or path.stem, "torch", meta)
        self.kv_bytes_per_token = self.spec.kv_bytes_per_token(self.dtype.itemsize)
        zeros = any(registry.get(b.attn.norm).family == registry.Family.ENTMAX for b in self.model.blocks)
        self.sparse = sparse and zeros
        if self.sparse:  # the page summaries: 2 fp32 vectors per page and KV head in every layer
            s = self.spec
            self.kv_bytes_per_token += -(-2 * s.head_dim * 4 * s.kv_heads * s.layers // PAGE_SIZE)
            self.attention += "; entmax decode skips the pages that provably get zero weight"
        self.cache: PagedKVCache | None = None
        # decode from CUDA graphs (graphs.py); not a sparse decode, whose pages read depend on the data
        self.use_graphs = (device == "cuda" if graphs is None else graphs) and not self.sparse
        self.graphs: DecodeGraphs | None = None
        self._named: dict[Hashable, list[int]] = {}  # pages a running sequence named (withdrawn if it fails)

    def allocate(self, budget_bytes, prefix_bytes=0):
        pages = budget_bytes // (PAGE_SIZE * self.kv_bytes_per_token)
        if pages < 1:
            raise BackendError(
                f"a KV budget of {budget_bytes} bytes holds no page of {PAGE_SIZE} tokens"
                f" ({PAGE_SIZE * self.kv_bytes_per_token} bytes)"
            )
        s = self.spec
        keep = min(pages, prefix_bytes // (PAGE_SIZE * self.kv_bytes_per_token))  # cached pages nobody holds
        self.cache = PagedKVCache(
            s.layers, s.kv_heads, s.head_dim, pages, PAGE_SIZE, self.device, self.dtype, keep, bounds=self.sparse
        )
        if self.use_graphs:
            capture = self.device.type == "cuda"  # elsewhere the same buffers and padding, run eagerly (tests)
            impl = self.impl or ("triton" if capture else "reference")
            self.graphs = DecodeGraphs(self.model, self.cache, -(-s.context_length // PAGE_SIZE), impl, capture)
        return pages * PAGE_SIZE * self.kv_bytes_per_token

    def admit(self, seq, prompt, tokens, reuse, entropy):
        """The prompt's full pages already cached (hashes chained from the first page) are shared, not prefilled;
        a hit is whole pages within all but the prompt's last token."""
        cache, hit = self.cache, Hit()
        best = (len(prompt) - 1) // PAGE_SIZE if reuse else 0  # pages a hit could save at most
        if cache.pages_for(tokens) - best > cache.allocator.free_pages:
            return None  # no hit could make it fit: say so before hashing the prompt (it may ask every step)
        if reuse and cache.allocator.keep:
            digests = prompt.names(len(prompt) - 1)
            usable = (lambda page: page in cache.page_entropy) if entropy else None
            hit.tokens = cache.share(seq, digests, usable)
            if hit.tokens and entropy:
                hit.entropy = np.concatenate([cache.page_entropy[p] for p in cache.tables[seq]], -1)
        try:
            cache.reserve(seq, tokens)
        except OutOfPages:
            cache.free(seq)
            return None
        return hit

    def cache_info(self):
        keep = self.cache.allocator.keep
        mib = keep * PAGE_SIZE * self.kv_bytes_per_token / 2**20
        return f"prefix cache up to {keep} pages ({mib:g} MiB) of the pool" if keep else "prefix cache off"

    def reserve(self, seq, tokens):
        try:
            self.cache.reserve(seq, tokens)
        except OutOfPages:
            return False
        return True

    def join(self, seq, keep=None):
        self._publish(seq, keep)

    def release(self, seq, keep=None):
        self._publish(seq, keep)
        named = self._named.pop(seq, [])
        if keep is None:  # it failed: what it offered while running is withdrawn
            self.cache.allocator.unregister(named)
        self.cache.free(seq)

    def clear(self):
        for named in self._named.values():  # a failure nobody could attribute: nothing running is offered
            self.cache.allocator.unregister(named)
        self._named.clear()
        self.cache.clear()

    def _publish(self, seq: Hashable, keep: Prefix | None) -> None:
        """Name the sequence's full pages (those named already stay as they are)."""
        if keep is not None and self.cache.allocator.keep:
            named = self.cache.publish(seq, keep.pages.names(), keep.entropy)
            self._named.setdefault(seq, []).extend(named)

    def kv_usage(self):
        return self.cache.allocator.usage()

    def _attention(self, keys: int, decoding: int = 0) -> str:
        """The attention implementation of a step over `keys` keys; `decoding` the rows of a decode step (0: a
        prefill chunk)."""
        if self.impl is not None:
            return self.impl
        if self.device.type == "cuda":
            return "triton"
        small = decoding * self.spec.heads * keys <= REFERENCE_DECODE_LOGITS
        return "streamed" if keys >= STREAMED_FROM_KEYS and not (decoding and small) else "reference"

    @torch.inference_mode()
    def _run(
        self, seqs: list[Hashable], ids: np.ndarray, positions: np.ndarray, entropy: bool, scores: bool = False
    ) -> StepResult:
        step = self.cache.step(seqs, ids.shape[1])
        out = self.model.step(
            torch.from_numpy(ids).to(self.device),
            cache=step,
            positions=torch.from_numpy(positions).to(self.device),
            return_entropy=entropy,
            impl=self._attention(step.longest, len(seqs) if ids.shape[1] == 1 else 0),
            last_logits=not scores,  # a prompt's head over its every position only when its scores are asked
        )
        step.commit()  # only a step that ran through every layer counts; a failed one can run again
        ent = out.entropy.float().cpu().numpy() if entropy else None
        every = out.logits[0].float().cpu().numpy() if scores else None
        skipped = None
        if step.sparse:
            skipped = np.full(self.spec.layers, np.nan)
            for layer, read in step.sparse.items():
                skipped[layer] = read.skipped
        return StepResult(out.logits[:, -1].float(), ent, scores=every, pages_skipped=skipped)  # logits on device

    def prefill(self, seq, ids, start, entropy, scores=False):
        positions = np.arange(start, start + ids.shape[1], dtype=np.int64)[None]
        return self._run([seq], ids, positions, entropy, scores)

    def _decode_step(self, seqs, tokens, entropy):
        positions = np.array([[self.cache.lengths[s]] for s in seqs], np.int64)
        if self.graphs is not None:
            with torch.inference_mode():
                ran = self.graphs.run(seqs, torch.from_numpy(tokens), torch.from_numpy(positions), entropy)
            if ran is not None:  # the graph's outputs are overwritten by its next replay: the step keeps a copy
                logits, ent = ran
                ent = ent.float().cpu().numpy() if entropy else None
                return StepResult(logits.float().clone(), ent)
        return self._run(seqs, tokens, positions, entropy)
