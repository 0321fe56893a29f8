"""`sharp-export MODEL --genai -o DIR`: a directory onnxruntime-genai opens as it is.

DIR holds model.onnx, genai_config.json, tokenizer.json + tokenizer_config.json and, when the file is to run
sharp's native kernel (or has no fallback bodies), the op library itself, named in genai_config.json's
`custom_ops_library` (onnxruntime-genai only loads a library from inside the package directory).

The settings that matter, all derived from the file's sharp metadata: decoder type "decoder" (onnxruntime-genai
refuses unknown types), `past_present_share_buffer` true for a file in the op's cache form (its attention writes a
step's keys into the past buffer itself, so onnxruntime-genai binds each present to its past: no step copies the
cache; docs/op.md) and false for the TensorRT form (presents are past + new keys), the KV names of the generation
graph, BOS/EOS/pad ids, the context length.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import onnx

from sharp.exporter import kept_logits
from sharp.exporter.metadata import ModelMetadata
from sharp.models.tokenizer import ByteTokenizer, HFTokenizer

MODEL_FILE = "model.onnx"


def genai_config(meta: ModelMetadata, library_name: str | None) -> dict[str, Any]:
    shape = meta.shape
    tok = meta.tokenizer
    eos = sorted(tok.eos_ids)
    hidden = meta.config.get("hidden_size", meta.config.get("dim", shape.heads * shape.head_dim))
    pad = meta.config.get("pad_token_id")
    session: dict[str, Any] = {"log_id": "sharp", "provider_options": []}
    if library_name:
        session["custom_ops_library"] = library_name
    return {
        "model": {
            "type": "decoder",
            "bos_token_id": tok.bos,
            "eos_token_id": eos,
            "pad_token_id": pad if isinstance(pad, int) else eos[0],
            "context_length": shape.context_length,
            "vocab_size": shape.vocab_size,
            "decoder": {
                "filename": MODEL_FILE,
                "session_options": session,
                "head_size": shape.head_dim,
                "hidden_size": hidden,
                "num_attention_heads": shape.heads,
                "num_key_value_heads": shape.kv_heads,
                "num_hidden_layers": shape.layers,
                "inputs": {
                    "input_ids": "input_ids",
                    "attention_mask": "attention_mask",
                    "position_ids": "position_ids",
                    "past_key_names": "past_key_values.%d.key",
                    "past_value_names": "past_key_values.%d.value",
                },
                "outputs": {
                    "logits": "logits",
                    "present_key_names": "present.%d.key",
                    "present_value_names": "present.%d.value",
                },
            },
        },
        "search": {
            "do_sample": False,
            "num_beams": 1,
            "max_length": shape.context_length,
            "past_present_share_buffer": bool(meta.export.get("kv_in_place", False)),
            "temperature": 1.0,
            "top_k": 50,
            "top_p": 1.0,
            "repetition_penalty": 1.0,
        },
    }


def tokenizer_files(tok: ByteTokenizer | HFTokenizer) -> tuple[str, dict[str, Any]]:
    """tokenizer.json text and tokenizer_config.json of the model's tokenizer."""
    if isinstance(tok, HFTokenizer):
        text = tok.package_json()  # BOS as sharp-serve adds it, stated in the file and in the config alike
        config = {k: v for k, v in (("bos_token", tok.bos_text), ("eos_token", tok.eos_text)) if v}
        config["add_bos_token"] = tok.adds_bos
        if tok.chat_template is not None:  # onnxruntime-genai's apply_chat_template reads it here
            config["chat_template"] = tok.chat_template
    else:
        text = tok.tokenizer_json()
        config = {"bos_token": "<bos>", "eos_token": "<eos>", "add_bos_token": True}
    return text, {**config, "tokenizer_class": "PreTrainedTokenizerFast"}


def write_package(proto: onnx.ModelProto, meta: ModelMetadata, out: Path, library: str | None) -> list[Path]:
    """Write the package into the (new or empty) directory `out`; returns the files written. `proto` loses its
    `logits_to_keep` input first (kept_logits.py): onnxruntime-genai feeds only the inputs it knows."""
    kept_logits.remove(proto)
    out.mkdir(parents=True, exist_ok=True)
    library_name = Path(library).name if library else None
    files = [out / MODEL_FILE, out / "genai_config.json", out / "tokenizer.json", out / "tokenizer_config.json"]
    onnx.save(proto, files[0])
    files[1].write_text(json.dumps(genai_config(meta, library_name), indent=2) + "\n", encoding="utf-8")
    text, config = tokenizer_files(meta.tokenizer)
    files[2].write_text(text, encoding="utf-8")
    files[3].write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    if library:
        files.append(Path(shutil.copy2(library, out / library_name)))
    return files
