"""The tokenizers a served model can have, behind one interface: sharp's byte tokenizer (its own models) and a
Hugging Face `tokenizer.json` run by the `tokenizers` library (transformers models; transformers itself is not
needed). Every layer — training, checkpoints, export metadata, serving — uses these objects, so a model's ids,
BOS/EOS and detokenization are written down in exactly one place.

Interface: `encode(text, bos)`, `decode(ids)`, `stream(skip_special)` (incremental detokenization: text arrives
only in whole UTF-8 characters), `added_id(text)` (a special or added token's id), `eos_ids`, `bos`, `vocab_size`,
`kind`, `chat_template`, `to_dict()`;
`tokenizer_from_dict` reads one back, `render_chat` turns chat messages into the prompt text the model was tuned on.
"""

from __future__ import annotations

import codecs
import json
from dataclasses import asdict, dataclass, field
from datetime import datetime
from functools import cache, cached_property
from pathlib import Path
from typing import Any, Protocol


class TextStream(Protocol):
    """Detokenizes one sequence as its tokens arrive."""

    def step(self, token: int) -> str: ...

    def finish(self) -> str: ...


class _ByteStream:
    def __init__(self, tokenizer: ByteTokenizer, skip_special: bool):
        self.tokenizer, self.skip_special = tokenizer, skip_special
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def step(self, token: int) -> str:
        if not self.skip_special and token in self.tokenizer.special:
            return self.decoder.decode(b"", final=True) + self.tokenizer.special[token]
        return self.decoder.decode(self.tokenizer.token_bytes(token))

    def finish(self) -> str:
        return self.decoder.decode(b"", final=True)


@dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes are tokens 0–255; BOS = 256, EOS = 257."""

    bos: int = 256
    eos: int = 257
    vocab_size: int = 258
    kind: str = "bytes"

    @property
    def eos_ids(self) -> frozenset[int]:
        return frozenset((self.eos,))

    @property
    def chat_template(self) -> None:
        """sharp's own models are trained on plain text: no chat format."""
        return None

    bos_text = eos_text = ""  # BOS and EOS are ids without text

    @property
    def special(self) -> dict[int, str]:
        """BOS and EOS as tokenizer_json spells them: their text where special tokens are not skipped."""
        return {self.bos: "<bos>", self.eos: "<eos>"}

    def added_id(self, text: str) -> int | None:
        """The id of the special token spelled `text` (BOS, EOS), or None."""
        return next((i for i, t in self.special.items() if t == text), None)

    def encode(self, text: str, bos: bool = True) -> list[int]:
        return ([self.bos] if bos else []) + list(text.encode("utf-8"))

    def token_bytes(self, token: int) -> bytes:
        """The bytes a token stands for (b"" for BOS, EOS and ids outside the byte range)."""
        return bytes((token,)) if 0 <= token < 256 else b""

    def decode(self, ids: list[int]) -> str:
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")

    def stream(self, skip_special: bool = True) -> TextStream:
        return _ByteStream(self, skip_special)

    def to_dict(self) -> dict:
        return asdict(self)

    def tokenizer_json(self) -> str:
        """This tokenizer as a Hugging Face tokenizer.json (byte-level BPE without merges: one token per byte,
        BOS prepended), for runtimes that read that format (onnxruntime-genai)."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

        byte_char = dict(zip(_gpt2_bytes(), _gpt2_chars(), strict=True))  # the ByteLevel pre-tokenizer's alphabet
        vocab = {byte_char[b]: b for b in range(256)}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([self.special[self.bos], self.special[self.eos]])
        tok.post_processor = processors.TemplateProcessing(
            single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", self.bos)]
        )
        return tok.to_str()

    @classmethod
    def from_dict(cls, d: dict) -> ByteTokenizer:
        """The tokenizer a checkpoint or a file's metadata describes; refuses what this one cannot be."""
        if not isinstance(d, dict) or d.get("kind", "bytes") != "bytes":
            raise ValueError(f"tokenizer {d!r:.80}: only the byte tokenizer (kind 'bytes') is supported here")
        tok = cls()
        if any(d.get(k, getattr(tok, k)) != getattr(tok, k) for k in ("bos", "eos")):
            raise ValueError(f"tokenizer {d!r}: the byte tokenizer has bos {tok.bos}, eos {tok.eos}")
        return tok


def _gpt2_bytes() -> list[int]:
    """Byte order of the GPT-2 byte-to-unicode table (printable bytes map to themselves, the rest to 256+)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    return printable + [b for b in range(256) if b not in printable]


def _gpt2_chars() -> list[str]:
    printable = _gpt2_bytes()[:188]
    return [chr(b) for b in printable] + [chr(256 + i) for i in range(256 - len(printable))]


_GPT2_BYTE = dict(zip(_gpt2_chars(), _gpt2_bytes(), strict=True))  # a byte-level piece's character → its byte


class _HFStream:
    def __init__(self, tokenizer: HFTokenizer, skip_special: bool):
        from tokenizers.decoders import DecodeStream

        self.tokenizer, self.skip_special = tokenizer, skip_special
        self.stream = DecodeStream(skip_special_tokens=skip_special)
        self.ids: list[int] = []
        self.sent = 0  # characters returned so far

    def step(self, token: int) -> str:
        self.ids.append(token)
        text = self.stream.step(self.tokenizer.backend, token) or ""
        self.sent += len(text)
        return text

    def finish(self) -> str:
        """What DecodeStream still holds (bytes of an unfinished character), as a whole decode renders it."""
        return self.tokenizer.decode(self.ids, self.skip_special)[self.sent :]


@dataclass(frozen=True)
class HFTokenizer:
    """A tokenizer.json with the model's BOS/EOS. `prepend_bos`: the model wants BOS but the file's
    post-processor does not add it (tokenizer_config.json `add_bos_token`), so encode adds it. `chat_template`: the
    Jinja template of tokenizer_config.json (or chat_template.jinja), None when the model has none."""

    json: str = field(repr=False)
    bos: int | None
    eos: tuple[int, ...]
    vocab_size: int
    prepend_bos: bool = False
    chat_template: str | None = field(default=None, repr=False)
    kind: str = "hf"

    @cached_property
    def backend(self):
        from tokenizers import Tokenizer

        return Tokenizer.from_str(self.json)

    @property
    def eos_ids(self) -> frozenset[int]:
        return frozenset(self.eos)

    def encode(self, text: str, bos: bool = True) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=bos).ids
        if bos and self.prepend_bos and self.bos is not None and ids[:1] != [self.bos]:
            ids = [self.bos, *ids]
        return ids

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special)

    @property
    def adds_bos(self) -> bool:
        """Whether `encode` starts a text with BOS: sharp's one rule for every path (sharp-serve, a --genai
        package, the file's own tokenizer.json): the post-processor's BOS, else tokenizer_config.json's
        `add_bos_token` (`prepend_bos`)."""
        return self.bos is not None and self.encode("a")[:1] == [self.bos]

    def package_json(self) -> str:
        """The tokenizer.json a package ships: this one, with BOS written into its post-processor when `encode`
        prepends it, so a runtime that reads only the file (transformers, onnxruntime-extensions) adds the same."""
        if not self.prepend_bos or self.bos is None:
            return self.json
        from tokenizers import processors

        tok = self.backend.__class__.from_str(self.json)
        bos = self.bos_text
        template = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, self.bos)]
        )
        tok.post_processor = (
            template if tok.post_processor is None else processors.Sequence([tok.post_processor, template])
        )
        return tok.to_str()

    def added_id(self, text: str) -> int | None:
        """The id of the added token (special or not: Mistral's `[TOOL_CALLS]`, Qwen's `<tool_call>`) spelled
        `text`, or None: one token of the vocabulary where the text would otherwise be several pieces."""
        return next((i for i, t in self.backend.get_added_tokens_decoder().items() if t.content == text), None)

    def token_bytes(self, token: int) -> bytes:
        """The bytes a token stands for alone: a byte-level piece mapped back to its bytes, a `<0xNN>` byte-fallback
        piece as that byte, a SentencePiece `▁` as a space, a special token as its text; b"" outside the vocabulary."""
        piece = self.backend.id_to_token(token)
        if piece is None:
            return b""
        if self._byte_level:
            try:
                return bytes(_GPT2_BYTE[c] for c in piece)
            except KeyError:  # an added token spelled outside the byte alphabet
                return piece.encode("utf-8")
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes((int(piece[3:5], 16),))
            except ValueError:
                pass
        return piece.replace("\u2581", " ").encode("utf-8")

    @cached_property
    def _byte_level(self) -> bool:
        """Whether the pieces are spelled in the GPT-2 byte alphabet (a ByteLevel decoder)."""
        return '"ByteLevel"' in json.dumps(json.loads(self.json).get("decoder"))

    @property
    def bos_text(self) -> str:
        """BOS as text (a chat template's `bos_token`), "" for none."""
        return "" if self.bos is None else self.backend.id_to_token(self.bos) or ""

    @property
    def eos_text(self) -> str:
        """The lowest EOS id as text (a chat template's and tokenizer_config.json's `eos_token`), "" for none."""
        return self.backend.id_to_token(min(self.eos)) or "" if self.eos else ""

    def stream(self, skip_special: bool = True) -> TextStream:
        return _HFStream(self, skip_special)

    def tokenizer_json(self) -> str:
        """The tokenizer.json text (as the byte tokenizer writes its own), for runtimes that read that format."""
        return self.json

    def to_dict(self) -> dict:
        """Everything but the tokenizer.json text, which travels beside it (see exporter/metadata.py)."""
        return {
            "kind": self.kind,
            "bos": self.bos,
            "eos": list(self.eos),
            "vocab_size": self.vocab_size,
            "prepend_bos": self.prepend_bos,
            "chat_template": self.chat_template,
        }

    @classmethod
    def from_dict(cls, d: dict, tokenizer_json: str) -> HFTokenizer:
        try:
            tok = cls(
                tokenizer_json,
                None if d.get("bos") is None else int(d["bos"]),
                tuple(int(e) for e in d.get("eos") or ()),
                int(d["vocab_size"]),
                bool(d.get("prepend_bos", False)),
                _template(d.get("chat_template")),
            )
            tok.backend  # noqa: B018 - parse now: a broken tokenizer.json is refused on load, not on first request
        except Exception as e:  # a malformed entry or tokenizer.json, whatever the parser raises
            raise ValueError(f"tokenizer {d!r:.80}: {e}") from None
        return tok

    @classmethod
    def from_dir(cls, path: str | Path, vocab_size: int, bos: int | None, eos: list[int]) -> HFTokenizer:
        """The tokenizer of a transformers model directory: tokenizer.json, tokenizer_config.json's
        `add_bos_token` when the file's own post-processor does not add BOS, and the chat template
        (chat_template.jinja, as transformers writes it now, or tokenizer_config.json's `chat_template`)."""
        path = Path(path)
        text = (path / "tokenizer.json").read_text(encoding="utf-8")
        options = _read_json(path / "tokenizer_config.json")
        tok = cls(text, bos, tuple(eos), vocab_size)
        adds_bos = bos is not None and tok.backend.encode("a", add_special_tokens=True).ids[:1] == [bos]
        prepend = bool(options.get("add_bos_token")) and bos is not None and not adds_bos
        jinja = path / "chat_template.jinja"
        template = jinja.read_text(encoding="utf-8") if jinja.is_file() else _template(options.get("chat_template"))
        return cls(text, bos, tuple(eos), vocab_size, prepend, template)


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _template(value: Any) -> str | None:
    """A chat_template entry: one template, or transformers' list of named ones (the "default" is the chat's)."""
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    if value is not None and not isinstance(value, str):
        raise ValueError(f"chat_template must be a Jinja template string, got {type(value).__name__}")
    return value or None


class ChatTemplateError(ValueError):
    """The model has no chat template, or its template refused the messages (its own raise_exception)."""


@cache
def _compiled(template: str):
    """The template compiled in Jinja's sandbox (a model file's template is data, never trusted code)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])

    def raise_exception(message: str):
        raise ChatTemplateError(message)

    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    return env.from_string(template)


@cache
def takes_tools(template: str) -> bool:
    """Whether a chat template renders the `tools` it is given (transformers passes them; most templates ignore
    them)."""
    from jinja2 import meta

    return "tools" in meta.find_undeclared_variables(_compiled(template).environment.parse(template))


def render_chat(
    tok: Tokenizer,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    continue_final: bool = False,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The prompt text for `messages` ({"role", "content"} dicts, and an assistant's `tool_calls`, a tool's
    `tool_call_id`) with the assistant's turn opened, as transformers' apply_chat_template renders it (`tools` as it
    passes them); encode the result with bos=False (the template writes its own BOS).
    `continue_final`: the last message is the assistant's, left open for the model to continue (the template's
    end-of-turn after it cut off, as vLLM's continue_final_message)."""
    from jinja2 import TemplateError

    if tok.chat_template is None:
        raise ChatTemplateError(
            "this model has no chat template (tokenizer_config.json chat_template): use completions"
        )
    if continue_final and (add_generation_prompt or not messages or messages[-1]["role"] != "assistant"):
        raise ChatTemplateError(
            "continue_final_message needs the last message to be the assistant's and add_generation_prompt: false"
        )
    try:
        text = _compiled(tok.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, bos_token=tok.bos_text,
            eos_token=tok.eos_text, tools=tools,
        )  # fmt: skip
    except TemplateError as e:
        raise ChatTemplateError(f"the model's chat template failed: {e}") from None
    if continue_final:
        final = messages[-1]["content"]
        at = text.rfind(final) if final else -1
        if at < 0:
            why = "is empty" if not final else "is not in the prompt the chat template writes"
            raise ChatTemplateError(f"continue_final_message: the assistant message to continue {why}")
        text = text[: at + len(final)]
    return text


Tokenizer = ByteTokenizer | HFTokenizer


def tokenizer_from_dict(d: dict, tokenizer_json: str | None = None) -> Tokenizer:
    """The tokenizer a file's metadata describes (`tokenizer_json`: the tokenizer.json text for kind "hf")."""
    if isinstance(d, dict) and d.get("kind") == "hf":
        if tokenizer_json is None:
            raise ValueError("tokenizer kind 'hf' but the file carries no tokenizer.json")
        return HFTokenizer.from_dict(d, tokenizer_json)
    return ByteTokenizer.from_dict(d)


BYTES = ByteTokenizer()
