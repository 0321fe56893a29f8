"""GGUF files (llama.cpp's format, as llama.cpp, Ollama and vLLM users have them) read as Hugging Face directories.

A GGUF file is only read, never executed. Its header is checked with the `gguf` package (architecture, every tensor
within the file); transformers' GGUF loader then dequantizes the tensors and rebuilds the config, the tokenizer and
its chat template, and the result is written once as a Hugging Face model directory under sharp's cache, named by the
file's bytes (models/cache.py). From there on a GGUF is exported, checked and served as that directory is.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache, partial
from pathlib import Path

from sharp.models import cache

MAGIC = b"GGUF"
# general.architecture values that transformers reads from GGUF and whose model type sharp exports (models/hf.py).
ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


class GGUFError(ValueError):
    """The file is not a complete GGUF of a supported architecture; the message says what was found."""


def is_gguf(path: Path) -> bool:
    """Whether `path` is a file that starts as a GGUF does (or is named like one: such a file must be one)."""
    if not path.is_file():
        return False
    with path.open("rb") as f:
        return f.read(4) == MAGIC or path.suffix.lower() == ".gguf"


def find(path: Path) -> Path | None:
    """The GGUF file `path` names: the file itself, or the one .gguf of a directory without config.json; None when
    `path` is neither. A directory with several is refused, naming them."""
    if path.is_dir():
        if (path / "config.json").is_file():
            return None
        files = sorted(p for p in path.glob("*.gguf") if p.is_file())
        if len(files) > 1:
            names = ", ".join(p.name for p in files)
            raise GGUFError(f"{path} holds {len(files)} GGUF files ({names}); name the one to use")
        return files[0] if files else None
    return path if is_gguf(path) else None


@dataclass(frozen=True)
class Header:
    architecture: str
    tensor_types: dict[str, int]  # GGML type name (Q4_1, F32, …) → how many tensors


HEADER_FILE = "gguf_header.json"  # a read file's header, kept in its directory: gguf-py parses every field to give it


def read_header(path: Path) -> Header:
    """The architecture and tensor types of a GGUF file, after checking that it is one, whole, of an architecture
    sharp serves; raises GGUFError saying what is wrong. Read once per file version in a process, and not at all
    once its directory is cached (the same bytes passed these checks when it was written): the reader parses every
    field, the vocabulary's included (2.7 s for SmolLM2's)."""
    stat = path.stat()
    return _read_header(path.resolve(), stat.st_size, stat.st_mtime_ns)


@lru_cache(maxsize=8)
def _read_header(path: Path, size: int, mtime_ns: int) -> Header:
    with path.open("rb") as f:
        if f.read(4) != MAGIC:
            raise GGUFError(f"{path}: not a GGUF file (it does not start with the bytes GGUF)")
    kept = _directory(path) / HEADER_FILE
    if kept.is_file():
        return Header(**json.loads(kept.read_text(encoding="utf-8")))
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
        arch = reader.fields["general.architecture"].contents()
        size = path.stat().st_size
        for tensor in reader.tensors:  # the reader maps tensors lazily: a cut file can pass its header
            if tensor.data_offset + tensor.n_bytes > size:
                raise ValueError(f"tensor {tensor.name} ends past the end of the file")
    except KeyError:
        raise GGUFError(f"{path}: a GGUF without general.architecture") from None
    except Exception as e:  # whatever the reader raises on a cut or corrupt file
        raise GGUFError(f"{path}: not a complete GGUF file, truncated or corrupt ({type(e).__name__}: {e})") from None
    if arch not in ARCHITECTURES:
        raise GGUFError(
            f"{path}: a GGUF of architecture {arch!r}; sharp reads GGUF files of {', '.join(ARCHITECTURES)}"
        )
    types: dict[str, int] = {}
    for tensor in reader.tensors:
        types[tensor.tensor_type.name] = types.get(tensor.tensor_type.name, 0) + 1
    _parsed.update(path=path, reader=reader)  # the directory's writer, if one follows, parses nothing again
    return Header(str(arch), types)


_parsed: dict = {}  # the last reader _read_header made, until hf_directory takes (or drops) it


def _directory(path: Path) -> Path:
    """Where the file's directory is cached (its bytes hashed once per file version in a process: 0.14 s for 93 MB)."""
    stat = path.stat()
    return cache.root() / "gguf" / _content_key(path.resolve(), stat.st_size, stat.st_mtime_ns)


@lru_cache(maxsize=8)
def _content_key(path: Path, size: int, mtime_ns: int) -> str:
    return cache.content_key(path)


def hf_directory(path: Path, say=print) -> Path:
    """The Hugging Face directory of a GGUF file, written into the cache the first time (dequantized fp32 weights
    as model.safetensors, config.json, generation_config.json, tokenizer.json, the chat template), then found by
    the file's bytes."""
    header = read_header(path)
    out = _directory(path)
    reader = _parsed.pop("reader", None) if _parsed.get("path") == path.resolve() else None
    _parsed.clear()
    if (out / "config.json").is_file():
        return out
    say(f"reading {path} (GGUF) into {out}")
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _write_hf_directory(path, tmp, reader)
        (tmp / HEADER_FILE).write_text(json.dumps(dataclasses.asdict(header)), encoding="utf-8")
        tmp.rename(out)  # whole or absent: config.json marks a finished entry
    except FileExistsError:
        pass  # another process wrote the same entry meanwhile
    except OSError as e:
        if not (out / "config.json").is_file():
            raise GGUFError(f"{path}: cannot write its directory into {out.parent}: {e.strerror}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write_hf_directory(path: Path, out: Path, reader=None) -> None:
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    out.mkdir(parents=True)
    where, name = str(path.parent), path.name
    with _quiet_single_reader(path, reader):
        config = AutoConfig.from_pretrained(where, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, config=config, dtype="float32")
        tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
    config = model.config
    tied = getattr(config, "tie_word_embeddings", False)
    weights = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    save_file(weights, str(out / "model.safetensors"))  # a tied head as the embedding alone, as Hugging Face writes it
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights written are plain fp32
    config.architectures = [type(model).__name__]  # what other tools read (llama.cpp's converter needs it)
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    tokenizer.save_pretrained(out)


@contextmanager
def _quiet_single_reader(path: Path, reader=None) -> Iterator[None]:
    """transformers' GGUF loader as sharp runs it: the file parsed once for config, weights and tokenizer (it parses
    it anew for each, 2.4 s a time for SmolLM2's vocabulary), gguf-py's tensor-name map built once per architecture
    (transformers asks for it again for every submodule: 397 times, 6 s, for SmolLM2), and its dequantizing bar (a
    bare tqdm, not under transformers' progress-bar switch) kept off sharp's commands' output."""
    import gguf as gguf_package
    import transformers.modeling_gguf_pytorch_utils as loader

    readers: dict[str, object] = {}
    if reader is not None:  # under the name transformers asks for (the directory and the file name joined)
        readers[os.path.join(str(path.parent), path.name)] = reader
    reader_type, bar, name_map = gguf_package.GGUFReader, loader.tqdm, gguf_package.get_tensor_name_map

    def one_reader(path, *args, **kwargs):
        key = os.fspath(path)
        if args or kwargs or key not in readers:
            readers[key] = reader_type(path, *args, **kwargs)
        return readers[key]

    gguf_package.GGUFReader = one_reader
    gguf_package.get_tensor_name_map = lru_cache(maxsize=None)(name_map)  # transformers imports it at each call
    loader.tqdm = partial(bar, disable=True)
    try:
        yield
    finally:
        gguf_package.GGUFReader, loader.tqdm, gguf_package.get_tensor_name_map = reader_type, bar, name_map
