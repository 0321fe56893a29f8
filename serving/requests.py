"""One validation for generation requests: a `GenerateRequest` message becomes a `GenerationRequest` with every
default applied, or a `RequestError` carrying the gRPC status and a message that names the allowed range.

Each field's default is decided here and nowhere else (the proto comments state the same values):
temperature, top_k and top_p from `SamplingParams()`, max_new_tokens from the server's
--default-max-new-tokens, seed a fresh random one, request_id a fresh UUID.
"""

from __future__ import annotations

import secrets
import uuid
from dataclasses import dataclass

import grpc

from sharp.models.sampling import SamplingParams
from sharp.v1 import generator_pb2 as pb

DEFAULT_SAMPLING = SamplingParams()
MAX_REQUEST_ID = 128


class RequestError(Exception):
    """A request that is refused: `code` is the gRPC status the server answers with; `transient`: the same request
    may succeed later (a full queue, HTTP 429), rather than never on this server (HTTP 413 for too large)."""

    def __init__(self, code: grpc.StatusCode, message: str, transient: bool = False):
        super().__init__(message)
        self.code, self.message, self.transient = code, message, transient


@dataclass(frozen=True)
class Limits:
    """What a request is checked against: the model's and the server's bounds."""

    vocab_size: int
    context_length: int
    kv_bytes_per_token: int
    kv_budget_bytes: int
    max_new_tokens_limit: int
    default_max_new_tokens: int
    max_prompt_bytes: int
    max_stop_strings: int
    max_stop_length: int


@dataclass(frozen=True)
class GenerationRequest:
    """A validated request: every field set, every value in range."""

    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams
    seed: int
    stop: tuple[str, ...]
    attention_stats: bool
    request_id: str
    api: str = "grpc"  # the door it came in by (serving.stats.APIS), for the metrics


def validate(msg: pb.GenerateRequest, limits: Limits, encode, api: str = "grpc") -> GenerationRequest:
    """The typed request for `msg`; `encode(text)` tokenizes a prompt (BOS included). Sizes are checked before
    any work that grows with them (a prompt's bytes before it is tokenized, the id count before the ids). The HTTP
    API builds the same message from its JSON body, so both are checked here alike."""
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    if msg.prompt and msg.input_ids:
        raise RequestError(invalid, "give either prompt or input_ids, not both")
    if len(msg.request_id) > MAX_REQUEST_ID:
        raise RequestError(invalid, f"request_id of {len(msg.request_id)} characters; at most {MAX_REQUEST_ID}")
    if len(msg.stop) > limits.max_stop_strings:
        raise RequestError(
            invalid, f"{len(msg.stop)} stop strings; at most {limits.max_stop_strings} (--max-stop-strings)"
        )
    for s in msg.stop:
        if len(s) > limits.max_stop_length:
            raise RequestError(
                invalid, f"a stop string of {len(s)} characters; at most {limits.max_stop_length} (--max-stop-length)"
            )
    if msg.prompt:
        size = len(msg.prompt) if len(msg.prompt) > limits.max_prompt_bytes else len(msg.prompt.encode("utf-8"))
        if size > limits.max_prompt_bytes:
            raise RequestError(
                invalid, f"prompt of {size}+ bytes; at most {limits.max_prompt_bytes} (--max-prompt-bytes)"
            )
    elif len(msg.input_ids) > limits.context_length:
        raise RequestError(
            grpc.StatusCode.OUT_OF_RANGE,
            f"{len(msg.input_ids)} input_ids exceed the model's context of {limits.context_length} tokens",
        )
    ids = tuple(encode(msg.prompt)) if msg.prompt else tuple(msg.input_ids)
    sampling = SamplingParams(
        temperature=msg.temperature if msg.HasField("temperature") else DEFAULT_SAMPLING.temperature,
        top_k=msg.top_k,
        top_p=msg.top_p if msg.HasField("top_p") else DEFAULT_SAMPLING.top_p,
    )
    req = GenerationRequest(
        prompt_ids=ids,
        max_new_tokens=msg.max_new_tokens if msg.HasField("max_new_tokens") else limits.default_max_new_tokens,
        sampling=sampling,
        seed=msg.seed if msg.HasField("seed") else secrets.randbits(63),
        stop=tuple(s for s in msg.stop if s),
        attention_stats=msg.return_attention_stats,
        request_id=msg.request_id or uuid.uuid4().hex,
        api=api,
    )
    _check(req, limits)
    return req


def _check(req: GenerationRequest, limits: Limits) -> None:
    """Raise RequestError for a request that can never run, with the allowed range."""
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    if not req.prompt_ids:
        raise RequestError(invalid, "empty prompt: give a non-empty prompt or input_ids")
    bad = [t for t in req.prompt_ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise RequestError(invalid, f"input_ids {bad[:3]} outside the vocabulary [0, {limits.vocab_size})")
    if not 1 <= req.max_new_tokens <= limits.max_new_tokens_limit:
        raise RequestError(
            invalid, f"max_new_tokens must be in [1, {limits.max_new_tokens_limit}], got {req.max_new_tokens}"
        )
    try:
        req.sampling.check()
    except ValueError as e:
        raise RequestError(invalid, str(e)) from None
    total = len(req.prompt_ids) + req.max_new_tokens
    if total > limits.context_length:
        raise RequestError(
            grpc.StatusCode.OUT_OF_RANGE,
            f"prompt ({len(req.prompt_ids)} tokens) + max_new_tokens ({req.max_new_tokens}) exceeds the"
            f" model's context of {limits.context_length} tokens",
        )
    need = total * limits.kv_bytes_per_token
    if need > limits.kv_budget_bytes:
        raise RequestError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"this request needs {need / 2**20:.1f} MiB of KV cache; the server's budget is"
            f" {limits.kv_budget_bytes / 2**20:g} MiB (--kv-cache-mb)",
        )
