"""The Hugging Face models the tests build (no hub: configs with random weights, a wider init than transformers'
default so attention is far from uniform and greedy choices are clear) and the byte-level BPE tokenizer trained
here with `tokenizers`: tests/test_hf.py, test_hf_torch.py and test_deploy.py use them."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

VOCAB = 320
SIZES = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
    initializer_range=0.15,
)
CORPUS = [
    "def main():\n    return sum(x * x for x in range(10))\n",
    "The quick brown fox jumps over the lazy dog. Zoë's café serves crème brûlée — naïve! ",
    "数学 is mathematics; 🎉 celebrations and ✓ checks; Ελληνικά and русский текст. ",
]


def _configs() -> dict[str, transformers.PretrainedConfig]:
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 32.0, "original_max_position_embeddings": 16}
    llama3 = {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    return {
        "llama": transformers.LlamaConfig(**SIZES, rope_parameters=llama3),
        "mistral": transformers.MistralConfig(**SIZES, sliding_window=None),
        "qwen2": transformers.Qwen2Config(**SIZES, tie_word_embeddings=True),  # q/k/v biases, tied embeddings
        "qwen3": transformers.Qwen3Config(**SIZES),  # q/k norms
        # Llama-4-style query temperature on every layer: 1 + 0.1·log(1 + floor(pos / 16)), active from position 16.
        "ministral3": transformers.Ministral3Config(**SIZES, rope_parameters={**yarn, "llama_4_scaling_beta": 0.1}),
        "gpt2": transformers.GPT2Config(
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=512,
            vocab_size=VOCAB,
            bos_token_id=1,
            eos_token_id=2,
            initializer_range=0.15,
        ),
    }


def _train_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<pad>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tok


def write_model(path: Path, config: transformers.PretrainedConfig, tok: Tokenizer | None = None) -> Path:
    """A model of `config` with seeded random weights saved at `path`, with the tokenizer's tokenizer.json."""
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    (tok or _train_tokenizer()).save(str(path / "tokenizer.json"))
    return path


def write_models(root: Path) -> dict[str, Path]:
    """Every family of `_configs` as a directory under `root`."""
    tok = _train_tokenizer()
    return {name: write_model(root / name, config, tok) for name, config in _configs().items()}


def load_eager(path: Path):
    """The directory's model in transformers with its eager attention (the reference)."""
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="eager").eval()
