"""`EngineConfig`: the engine's settings, each a sharp-serve flag of the same name (serving/cli.py builds the flags
from these fields)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from sharp.serving.kv.names import PAGE_SIZE
from sharp.serving.requests import Limits
from sharp.serving.spec import ModelSpec

DEFAULT_KV_MB = 256  # the least default KV budget; a model whose one full context needs more gets that
PROMPT_BYTES_PER_TOKEN = 16  # the default prompt limit: more bytes than this per context token is never a prompt


def option(default, help: str):
    """A config field that is also a sharp-serve flag: `--name-with-dashes`, this default, this help."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class EngineConfig:
    """The engine's settings; each is a sharp-serve flag of the same name (serving/cli.py builds them from here)."""

    max_batch: int = option(32, "sequences decoded together")
    max_queue: int = option(256, "waiting requests; more get RESOURCE_EXHAUSTED (HTTP 429)")
    kv_cache_mb: float | None = option(
        None,
        f"KV-cache budget (torch: a pool of {PAGE_SIZE}-token pages allocated at start; onnxruntime/tensorrt:"
        f" padding included); default: {DEFAULT_KV_MB} MiB or one request of the model's whole context, whichever"
        " is larger",
    )
    prefix_cache_mb: float | None = option(
        None,
        "prefix cache: finished requests' KV caches kept for later prompts that start the same (torch: unused pages"
        " of the pool, counted free; onnxruntime/tensorrt: host memory beside the KV budget); default: --kv-cache-mb,"
        " 0: off",
    )
    prefill_chunk: int = option(256, "prompt tokens per engine step")
    max_new_tokens_limit: int | None = option(
        None,
        "per request (default: none but the model's context and the KV budget, which bound every request, as in vLLM"
        " and llama-server)",
    )
    default_max_new_tokens: int | None = option(
        None,
        "when a request does not say (default: to the end of the context, within --max-new-tokens-limit and the KV"
        " budget, as vLLM and llama-server do)",
    )
    max_prompt_bytes: int | None = option(None, "UTF-8 bytes of a text prompt (default: 16 × the model's context)")
    max_stop_strings: int = option(16, "stop strings per request")
    max_stop_length: int = option(256, "characters of one stop string")
    max_grammar_bytes: int = option(
        1 << 17,
        "characters of a request's JSON schema, regular expression, choices or grammar: compiling one takes time that"
        " grows with it (a 260 KB schema took 8 s), spent in a worker, never on the event loop or an engine step",
    )
    min_priority: int = option(
        0,
        "the lowest `priority` a request may ask for (lower is admitted first, as in vLLM): by default a client can"
        " only defer its own requests; lower it (e.g. -10) to let clients ask to go first",
    )
    priority_aging: float = option(
        1.0,
        "seconds of waiting that improve a waiting request's priority by 1, so a request is never starved by a flood"
        " of better-priority ones (it waits at most about the priority gap times this); 0: strict priority",
    )

    def check(self) -> None:
        """Raise ValueError naming the first setting out of range (in backquotes: the CLI names its flag)."""
        for f in fields(self):
            value = getattr(self, f.name)
            if (f.type.startswith("int") and value is None and f.type.endswith("None")) or f.name == "min_priority":
                continue
            if f.type.startswith("int") and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"`{f.name}` must be an integer >= 1, got {value!r}")
        kv = self.kv_cache_mb
        if kv is not None and not (isinstance(kv, int | float) and math.isfinite(kv) and kv > 0):
            raise ValueError(f"`kv_cache_mb` must be a finite number > 0, got {kv!r}")
        if isinstance(self.min_priority, bool) or not isinstance(self.min_priority, int):
            raise ValueError(f"`min_priority` must be an integer, got {self.min_priority!r}")
        aging = self.priority_aging
        if not (isinstance(aging, int | float) and math.isfinite(aging) and aging >= 0):
            raise ValueError(f"`priority_aging` must be a finite number >= 0 (0: strict priority), got {aging!r}")
        mb = self.prefix_cache_mb
        if mb is not None and not (isinstance(mb, int | float) and math.isfinite(mb) and mb >= 0):
            raise ValueError(f"`prefix_cache_mb` must be a finite number >= 0, got {mb!r}")
        limit = self.max_new_tokens_limit
        if self.default_max_new_tokens is not None and limit is not None and self.default_max_new_tokens > limit:
            raise ValueError(
                f"`default_max_new_tokens` ({self.default_max_new_tokens}) must be <= `max_new_tokens_limit`"
                f" ({self.max_new_tokens_limit})"
            )

    def kv_cache_bytes(self, spec: ModelSpec, kv_bytes_per_token: int) -> int:
        """The KV budget in bytes: --kv-cache-mb, else the default, which always holds one request of the model's
        whole context (in whole pages: what the paged pool needs)."""
        if self.kv_cache_mb is not None:
            return int(self.kv_cache_mb * 2**20)
        pages = -(-spec.context_length // PAGE_SIZE)
        return max(DEFAULT_KV_MB * 2**20, pages * PAGE_SIZE * kv_bytes_per_token)

    def prefix_cache_bytes(self, kv_cache_bytes: int) -> int:
        """The prefix cache's budget in bytes (0: off); by default as large as the KV budget."""
        if self.prefix_cache_mb is None:
            return kv_cache_bytes
        return int(self.prefix_cache_mb * 2**20)

    def limits(self, spec: ModelSpec, kv_bytes_per_token: int, kv_budget_bytes: int, block_tokens: int = 1) -> Limits:
        """What requests are checked against: this configuration's bounds and the served model's; ValueError (the
        setting in backquotes) for a default no request to this model could use."""
        limit = self.max_new_tokens_limit or spec.context_length
        if self.default_max_new_tokens is not None and self.default_max_new_tokens > limit:
            raise ValueError(
                f"`default_max_new_tokens` ({self.default_max_new_tokens}) must be <= {limit}, the model's context"
                + (" (and `max_new_tokens_limit`)" if self.max_new_tokens_limit else "")
            )
        return Limits(
            vocab_size=spec.vocab_size,
            context_length=spec.context_length,
            kv_bytes_per_token=kv_bytes_per_token,
            kv_budget_bytes=kv_budget_bytes,
            max_new_tokens_limit=self.max_new_tokens_limit or spec.context_length,
            default_max_new_tokens=self.default_max_new_tokens,
            max_prompt_bytes=self.max_prompt_bytes or PROMPT_BYTES_PER_TOKEN * spec.context_length,
            max_stop_strings=self.max_stop_strings,
            max_stop_length=self.max_stop_length,
            kv_block_tokens=block_tokens,
            min_priority=self.min_priority,
            max_grammar_bytes=self.max_grammar_bytes,
        )
