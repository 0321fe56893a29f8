"""Safe checkpoints: one `model.pt`, a dict of plain types and tensors, always read with
`torch.load(weights_only=True)` so nothing in a file can run code; anything else is refused with a reason."""

from __future__ import annotations

import pickle
from importlib.resources import files
from pathlib import Path

import torch
from torch import nn

from sharp import __version__
from sharp.models.config import ModelConfig
from sharp.models.lm import SharpLM
from sharp.models.max_retrieval import MaxRetrieval, MaxRetrievalConfig
from sharp.models.tokenizer import BYTES

FORMAT = "sharp"
VERSION = 1
ARCHITECTURES = {"SharpLM": (SharpLM, ModelConfig), "MaxRetrieval": (MaxRetrieval, MaxRetrievalConfig)}


def zoo_dir() -> Path:
    """Where the demo models live: package data of sharp.models (a source checkout or an installed wheel)."""
    return Path(str(files("sharp.models") / "zoo"))


def zoo_model(name: str) -> Path:
    """The demo model `name` ("ssa", "softmax"); FileNotFoundError says how to get it."""
    path = zoo_dir() / f"{name}.pt"
    if not path.is_file():
        raise FileNotFoundError(f"demo model {path} is missing: reinstall sharp-attention or run `make zoo`")
    return path


class CheckpointError(ValueError):
    """The file is not a usable sharp checkpoint; the message says what was found and what was expected."""


def save(model: nn.Module, path: str | Path, **meta) -> Path:
    """Write `model` with its config, tokenizer and `meta` (training provenance: plain types only)."""
    arch = type(model).__name__
    if arch not in ARCHITECTURES:
        raise TypeError(f"cannot save {arch}; sharp checkpoints hold: {', '.join(ARCHITECTURES)}")
    cfg = model.cfg
    payload = {
        "format": FORMAT,
        "version": VERSION,
        "config": {"architecture": arch, **cfg.to_dict()},
        "state_dict": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
        "tokenizer": BYTES.to_dict() if arch == "SharpLM" else None,
        "norm": cfg.norm,
        "meta": {"sharp_version": __version__, **meta},
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(payload, tmp)
    tmp.replace(path)  # never leave a half-written model.pt behind
    return path


def load_tensors(path: Path, expected: str = "a sharp checkpoint written by sharp.models.save") -> object:
    """torch.load, weights only (nothing user-supplied is unpickled into code), its failures as CheckpointError."""
    with open(path, "rb") as f:
        head = f.read(4)
    if head != b"PK\x03\x04" and head[:1] != b"\x80":  # neither torch's zip format nor its legacy pickle
        raise CheckpointError(f"{path}: not a torch file (expected {expected})")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        globals_ = [line.strip() for line in str(e).splitlines() if "GLOBAL" in line]
        if not globals_:  # the unpickler met bytes that are no pickle at all
            raise CheckpointError(f"{path}: not a readable torch file (truncated or corrupt)") from None
        raise CheckpointError(
            f"{path}: refused — it holds Python objects that a weights-only load never executes ({globals_[0]}); "
            f"expected {expected}"
        ) from None
    except Exception as e:  # a weights-only load runs no code; anything it raises means "not a torch file"
        raise CheckpointError(f"{path}: not a readable torch file (truncated or corrupt: {type(e).__name__})") from None


def read(path: str | Path) -> dict:
    """Load and validate the checkpoint dict without building a model."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file (expected a sharp model.pt)")
    payload = load_tensors(path)
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        found = f"a dict with keys {sorted(payload)[:6]}" if isinstance(payload, dict) else type(payload).__name__
        raise CheckpointError(f"{path}: not a sharp checkpoint (found {found}; expected format='{FORMAT}')")
    if not isinstance(payload.get("version"), int) or payload["version"] > VERSION:
        raise CheckpointError(f"{path}: checkpoint version {payload.get('version')!r}; this sharp reads <= {VERSION}")
    for key in ("config", "state_dict", "norm", "meta"):
        if key not in payload:
            raise CheckpointError(f"{path}: sharp checkpoint lacks '{key}'")
    for key, kind in (("config", dict), ("state_dict", dict)):
        if not isinstance(payload[key], kind):
            raise CheckpointError(f"{path}: '{key}' must be a {kind.__name__}, got {type(payload[key]).__name__}")
    bad = [k for k, v in payload["state_dict"].items() if not (isinstance(k, str) and isinstance(v, torch.Tensor))]
    if bad:
        raise CheckpointError(f"{path}: state_dict entries must be named tensors; {bad[0]!r:.40} is not")
    return payload


def _check_shapes(path: Path, cfg, state: dict) -> None:
    """The weights that fix a SharpLM's size agree with its config (a lying config is refused, not built)."""
    if not isinstance(cfg, ModelConfig):
        return
    want = {"embed.weight": (cfg.vocab_size, cfg.dim)}
    for i in range(cfg.layers):
        want[f"blocks.{i}.attn.q_proj.weight"] = (cfg.heads * cfg.head_dim, cfg.dim)
        want[f"blocks.{i}.attn.k_proj.weight"] = (cfg.kv_heads * cfg.head_dim, cfg.dim)
    for key, shape in want.items():
        got = tuple(state[key].shape) if key in state else None
        if got != shape:
            raise CheckpointError(f"{path}: config says {key} is {shape}, the weights hold {got}")


def load(path: str | Path) -> nn.Module:
    """Build the model a checkpoint describes and load its weights (strictly), in eval mode on the CPU."""
    payload = read(path)
    config = dict(payload["config"])
    arch = config.pop("architecture", "SharpLM")
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"{path}: unsupported architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}")
    model_cls, cfg_cls = ARCHITECTURES[arch]
    try:
        cfg = cfg_cls.from_dict(config)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: {str(e).removeprefix('bad model config: ')}") from None
    _check_shapes(path, cfg, payload["state_dict"])  # before anything of the config's size is allocated
    model = model_cls(cfg)
    try:
        result = model.load_state_dict(payload["state_dict"], strict=False)
    except RuntimeError as e:  # shape mismatches
        raise CheckpointError(
            f"{path}: weights do not match the {arch} config ({str(e).splitlines()[-1].strip()})"
        ) from None
    if result.missing_keys or result.unexpected_keys:
        raise CheckpointError(
            f"{path}: weights do not match the {arch} config (missing {result.missing_keys[:4]}, "
            f"unexpected {result.unexpected_keys[:4]})"
        )
    for name, module in model.named_modules():  # learned or stored normalizer parameters inside their domains
        if hasattr(module, "head_params"):
            for value, p in zip(module.head_params().values(), module.spec.params, strict=True):
                try:
                    p.check_tensor(value)
                except ValueError as e:
                    raise CheckpointError(f"{path}: {name}: {e}") from None
    return model.eval()
