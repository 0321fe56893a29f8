"""One validation for generation requests: a transport-neutral `RequestParams` (each API builds it from its own
message) becomes a `GenerationRequest` with every default applied, or a `RequestError` carrying a `Status` and a
message that names the allowed range.

Each field's default is decided here and nowhere else (the proto comments state the same values):
temperature, top_k, top_p, min_p and the penalties from `SamplingParams()`, max_new_tokens from the server's
--default-max-new-tokens, seed a fresh random one, request_id a fresh UUID.
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace

from sharp.models.sampling import MAX_LOGIT_BIAS, MAX_LOGPROBS, SamplingError, SamplingParams
from sharp.serving.grammar import KINDS, GrammarError, compile_grammar
from sharp.serving.status import Status

DEFAULT_SAMPLING = SamplingParams()
MAX_REQUEST_ID = 128
MAX_CACHE_SALT = 1024


class RequestError(Exception):
    """A request that is refused: `code` is the gRPC status the server answers with; `transient`: the same request
    may succeed later (a full queue, HTTP 429), rather than never on this server (HTTP 413 for too large);
    `field`: the request field at fault, in the caller's API's words; `reason`: why, as a word OpenAI's error codes
    use (invalid_value, context_length_exceeded, …)."""

    def __init__(
        self,
        code: Status,
        message: str,
        transient: bool = False,
        field: str | None = None,
        reason: str | None = None,
    ):
        super().__init__(message)
        self.code, self.message, self.transient, self.field, self.reason = code, message, transient, field, reason


def draining_error() -> RequestError:
    """What a request gets from a draining server (the engine's, or its process front's)."""
    return RequestError(Status.UNAVAILABLE, "the server is draining and accepts no new requests; retry elsewhere",
                        transient=True)  # fmt: skip


def queue_full_error(waiting: int) -> RequestError:
    return RequestError(Status.RESOURCE_EXHAUSTED, f"queue full: {waiting} requests waiting (--max-queue)",
                        transient=True)  # fmt: skip


@dataclass(frozen=True)
class Limits:
    """What a request is checked against: the model's and the server's bounds."""

    vocab_size: int
    context_length: int
    kv_bytes_per_token: int
    kv_budget_bytes: int
    max_new_tokens_limit: int
    default_max_new_tokens: int | None  # None: to the end of the context (within the limit and the KV budget)
    max_prompt_bytes: int
    max_stop_strings: int
    max_stop_length: int
    kv_block_tokens: int = 1  # the backend's unit of KV allocation (the torch backend's pages)
    min_priority: int = 0  # the lowest priority a request may ask for (--min-priority)
    max_grammar_bytes: int = 1 << 17  # a schema's, regex's, choices' or grammar's text (--max-grammar-bytes)

    def message_bytes(self) -> int:
        """The largest request message these limits allow (the servers' receive limit)."""
        return (
            self.max_prompt_bytes
            + 4 * self.context_length
            + self.max_stop_strings * (4 * self.max_stop_length + 8)
            + (1 << 16)
        )


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
    logprobs: int | None = None  # alternatives per generated token; None: no log-probabilities
    prompt_logprobs: int | None = None  # the same for the prompt's tokens
    group: int = 0  # several choices of one prompt (n > 1) share a group id; 0: a request alone
    choice: int = 0  # its index among them: choice 0 prefills the prompt, the others start from its cache
    ignore_eos: bool = False  # go on past the model's end-of-sequence token (benchmark harnesses ask)
    min_tokens: int = 0  # until this many are generated, eos and stop_token_ids cannot be sampled, stops are not sought
    stop_token_ids: tuple[int, ...] = ()  # these tokens end the request as a stop string does
    skip_special_tokens: bool = True  # special tokens have no text
    include_stop: bool = False  # the stop string or stop token that ended it stays in the text
    priority: int = 0  # lower is admitted first (vLLM's order); equal priorities in arrival order
    grammar: str | None = None  # structured outputs: the llguidance grammar decoding is constrained to
    cache_salt: str | None = None  # its prompt's cached pages are named apart: found only with the same salt

    def choices(self, n: int) -> list[GenerationRequest]:
        """`n` choices of this request, one group: choice i samples with seed + i (so they differ)."""
        if n == 1:
            return [self]
        group = secrets.randbits(63) or 1
        return [replace(self, group=group, choice=i, seed=(self.seed + i) % 2**63) for i in range(n)]


@dataclass
class RequestParams:
    """What a client asks for, in no transport's shape (vLLM's SamplingParams with the prompt beside it): each API
    builds one from its own message (api/grpc_service.py from the gRPC request, api/openai_api.py from the JSON body)
    and `validate` checks it. None (and the empty defaults) mean the server's default; the field names are the gRPC
    message's, which are the names refusals use unless the API maps them."""

    prompt: str = ""
    input_ids: Sequence[int] = ()
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_k: int = 0
    top_p: float | None = None
    seed: int | None = None
    stop: Sequence[str] = ()
    return_attention_stats: bool = False
    request_id: str = ""
    logprobs: int | None = None  # alternatives per generated token
    prompt_logprobs: int | None = None  # the same for the prompt's tokens
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: Sequence[int] = ()
    skip_special_tokens: bool = True
    include_stop: bool = False
    priority: int = 0
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[int, float] = dataclasses.field(default_factory=dict)
    json_schema: str | None = None  # the JSON text of a schema the output must follow
    regex: str | None = None  # … or a regular expression it must match
    choice: Sequence[str] | None = None  # … or the strings it must be one of
    grammar: str | None = None  # … or a Lark grammar it must follow
    n: int = 1  # choices of this prompt (serving.calls runs them)
    cache_salt: str | None = None  # vLLM's: the prefix cache shares pages only among requests with the same salt

    @property
    def constrained(self) -> bool:
        """Whether it asks for structured output: validating it compiles a grammar (milliseconds to seconds)."""
        return any(getattr(self, k) for k in KINDS)


MAX_CHOICES = 16  # n (and HTTP's best_of): choices of one request
GRPC_NAMES: dict[str, str] = {}  # gRPC's field names are RequestParams' own


def validate(
    msg: RequestParams, limits: Limits, encode, api: str = "grpc", names: dict[str, str] = GRPC_NAMES
) -> GenerationRequest:
    """The typed request for `msg`; `encode(text)` tokenizes a prompt (BOS included). Sizes are checked before
    any work that grows with them (a prompt's bytes before it is tokenized, the id count before the ids). Every API
    builds the same RequestParams, so all are checked here alike; `names` maps its field names to what the caller's
    API calls them, so a refusal names the field the client sent."""
    name = _Names(names)
    if msg.prompt and msg.input_ids:
        raise name.error("prompt", "give either prompt or input_ids, not both")
    if len(msg.request_id) > MAX_REQUEST_ID:
        raise name.error("request_id", f"{{request_id}} of {len(msg.request_id)} characters; at most {MAX_REQUEST_ID}")
    if msg.priority < limits.min_priority:
        raise name.error(
            "priority",
            f"{{priority}} {msg.priority} is below {limits.min_priority}, the lowest this server allows"
            " (--min-priority; lower is admitted first)",
        )
    if msg.cache_salt is not None and not 1 <= len(msg.cache_salt) <= MAX_CACHE_SALT:
        raise name.error("cache_salt", f"{{cache_salt}} must be 1 to {MAX_CACHE_SALT} characters, got"
                         f" {len(msg.cache_salt)}")  # fmt: skip
    if not msg.request_id.isprintable():  # it is written into log lines: a newline or an escape would forge them
        bad = next(c for c in msg.request_id if not c.isprintable())
        raise name.error("request_id", f"{{request_id}} holds U+{ord(bad):04X}; only printable characters are allowed")
    if len(msg.stop) > limits.max_stop_strings:
        raise name.error(
            "stop", f"{len(msg.stop)} {{stop}} strings; at most {limits.max_stop_strings} (--max-stop-strings)"
        )
    for s in msg.stop:
        if len(s) > limits.max_stop_length:
            raise name.error(
                "stop",
                f"a {{stop}} string of {len(s)} characters; at most {limits.max_stop_length} (--max-stop-length)",
            )
    if msg.prompt:
        size = len(msg.prompt) if len(msg.prompt) > limits.max_prompt_bytes else len(msg.prompt.encode("utf-8"))
        if size > limits.max_prompt_bytes:
            raise name.error(
                "prompt", f"{{prompt}} of {size}+ bytes; at most {limits.max_prompt_bytes} (--max-prompt-bytes)"
            )
    elif len(msg.input_ids) > limits.context_length:
        raise name.error(
            "input_ids",
            f"{len(msg.input_ids)} tokens of {{input_ids}} exceed the model's context of {limits.context_length}"
            " tokens",
            Status.OUT_OF_RANGE,
            "context_length_exceeded",
        )
    if len(msg.stop_token_ids) > limits.max_stop_strings:
        raise name.error(
            "stop_token_ids",
            f"{len(msg.stop_token_ids)} {{stop_token_ids}}; at most {limits.max_stop_strings} (--max-stop-strings)",
        )
    if not 1 <= msg.n <= MAX_CHOICES:
        raise name.error("n", f"{{n}} must be in [1, {MAX_CHOICES}], got {msg.n}")
    for field in ("logprobs", "prompt_logprobs"):
        if getattr(msg, field) is not None and not 0 <= getattr(msg, field) <= MAX_LOGPROBS:
            raise name.error(field, f"{{{field}}} must be in [0, {MAX_LOGPROBS}], got {getattr(msg, field)}")
    grammar = None
    given = [k for k in KINDS if getattr(msg, k) is not None]
    if len(given) > 1:
        raise name.error(given[1], f"give one of {{{given[0]}}} and {{{given[1]}}}, not both")
    if given:
        kind = given[0]
        spec = json.dumps(list(msg.choice)) if kind == "choice" else getattr(msg, kind)
        if len(spec) > limits.max_grammar_bytes:  # before any compile: its time grows with the text
            raise name.error(kind, f"{{{kind}}} of {len(spec)} characters; at most {limits.max_grammar_bytes}"
                             " (--max-grammar-bytes)")  # fmt: skip
        try:
            grammar = compile_grammar(kind, spec)
        except GrammarError as e:
            raise name.error(kind, f"{{{kind}}}: {e}") from None
    ids = tuple(encode(msg.prompt)) if msg.prompt else tuple(msg.input_ids)
    if len(msg.logit_bias) > MAX_LOGIT_BIAS:  # before the entries are looked at one by one
        raise name.error("logit_bias", f"{len(msg.logit_bias)} {{logit_bias}} entries; at most {MAX_LOGIT_BIAS}")
    unset = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
    sampling = SamplingParams(
        **{f: getattr(DEFAULT_SAMPLING if getattr(msg, f) is None else msg, f) for f in unset},
        top_k=msg.top_k,
        logit_bias=tuple(sorted(msg.logit_bias.items())),
    )  # fmt: skip
    req = GenerationRequest(
        prompt_ids=ids,
        max_new_tokens=_budget(msg.max_new_tokens, len(ids), limits),
        sampling=sampling,
        seed=secrets.randbits(63) if msg.seed is None else msg.seed,
        stop=tuple(s for s in msg.stop if s),
        attention_stats=msg.return_attention_stats,
        request_id=msg.request_id or uuid.uuid4().hex,
        api=api,
        logprobs=msg.logprobs,
        prompt_logprobs=msg.prompt_logprobs,
        ignore_eos=msg.ignore_eos,
        min_tokens=msg.min_tokens,
        stop_token_ids=tuple(msg.stop_token_ids),
        skip_special_tokens=msg.skip_special_tokens,
        include_stop=msg.include_stop,
        priority=msg.priority,
        grammar=grammar,
        cache_salt=msg.cache_salt,
    )
    _check(req, limits, name)
    return req


@dataclass(frozen=True)
class _Names:
    """Refusals in the words of the caller's API: `{field}` in a message becomes that API's name for it."""

    names: dict[str, str]

    def __call__(self, field: str) -> str:
        return self.names.get(field, field)

    def error(
        self,
        field: str,
        message: str,
        code: Status = Status.INVALID_ARGUMENT,
        reason: str = "invalid_value",
        transient: bool = False,
    ) -> RequestError:
        text = re.sub(r"\{(\w+)\}", lambda m: self(m.group(1)), message)
        return RequestError(code, text, transient, self(field), reason)


def _budget(asked: int | None, prompt: int, limits: Limits) -> int:
    """The tokens a request may generate: what it asked, else the server's default, else all it can use — to the
    end of the context, within --max-new-tokens-limit and what the KV budget holds beside its prompt (so a request
    that says nothing reserves no more than it could fill). At least 1: a prompt that fills the context is refused
    for that."""
    if asked is not None:
        return asked
    if limits.default_max_new_tokens is not None:
        return limits.default_max_new_tokens
    room = min(limits.context_length, limits.kv_budget_bytes // limits.kv_bytes_per_token) - prompt
    return max(1, min(limits.max_new_tokens_limit, room))


def _check(req: GenerationRequest, limits: Limits, name: _Names) -> None:
    """Raise RequestError for a request that can never run, with the allowed range."""
    if not req.prompt_ids:
        raise name.error("prompt", "empty {prompt}: give a non-empty {prompt} or {input_ids}")
    bad = [t for t in req.prompt_ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise name.error("input_ids", f"{{input_ids}} {bad[:3]} outside the vocabulary [0, {limits.vocab_size})")
    lowest = 0 if req.prompt_logprobs is not None else 1  # 0: score the prompt, generate nothing
    scoring = " (0 only when scoring the prompt)" if lowest else ""
    if req.max_new_tokens < lowest:
        raise name.error(
            "max_new_tokens",
            f"{{max_new_tokens}} must be in [{lowest}, {limits.max_new_tokens_limit}]{scoring},"
            f" got {req.max_new_tokens}",
        )
    # the model's context first (what bounds every request), then a limit the server sets (named by its flag)
    total = len(req.prompt_ids) + req.max_new_tokens
    if total > limits.context_length:
        raise name.error(
            "prompt",
            f"{{prompt}} ({len(req.prompt_ids)} tokens) + {{max_new_tokens}} ({req.max_new_tokens}) exceeds the"
            f" model's context of {limits.context_length} tokens",
            Status.OUT_OF_RANGE,
            "context_length_exceeded",
        )
    if req.max_new_tokens > limits.max_new_tokens_limit:
        raise name.error(
            "max_new_tokens",
            f"{{max_new_tokens}} must be in [{lowest}, {limits.max_new_tokens_limit}]{scoring}, got"
            f" {req.max_new_tokens} (the server's limit: --max-new-tokens-limit)",
        )
    if not 0 <= req.min_tokens <= req.max_new_tokens:
        raise name.error(
            "min_tokens",
            f"{{min_tokens}} must be in [0, {{max_new_tokens}}] = [0, {req.max_new_tokens}], got {req.min_tokens}",
        )
    if bad := [t for t, _ in req.sampling.logit_bias if not 0 <= t < limits.vocab_size]:
        raise name.error("logit_bias", f"{{logit_bias}} token {bad[0]} outside the vocabulary [0, {limits.vocab_size})")
    if bad := [t for t in req.stop_token_ids if not 0 <= t < limits.vocab_size]:
        raise name.error(
            "stop_token_ids", f"{{stop_token_ids}} {bad[:3]} outside the vocabulary [0, {limits.vocab_size})"
        )
    try:
        req.sampling.check()
    except SamplingError as e:
        raise name.error(e.field, str(e)) from None
    need = total * limits.kv_bytes_per_token
    if need > limits.kv_budget_bytes:
        raise name.error(
            "prompt",
            f"this request needs {need / 2**20:.1f} MiB of KV cache; the server's budget is"
            f" {limits.kv_budget_bytes / 2**20:g} MiB (--kv-cache-mb)",
            Status.RESOURCE_EXHAUSTED,
            "context_length_exceeded",
        )
