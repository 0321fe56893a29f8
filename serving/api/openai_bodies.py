"""The bodies of the OpenAI-compatible API's requests (serving.openai_api): each field checked by pydantic (strict
types, unknown fields refused as OpenAI refuses them), then `refused()` for what a field's type cannot say, and
`to_params()` to the engine's transport-neutral request. OpenAI fields sharp does not do are accepted only at their
neutral value, so a request never silently gets something other than what it asked for."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from sharp.serving.api.tools import TOOL_NAME, Format, Tool, ToolUse
from sharp.serving.grammar import schema_text
from sharp.serving.requests import MAX_CHOICES, RequestParams

Int32 = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]
Seed = Annotated[int, Field(ge=0, lt=2**64)]


# ---- request bodies ------------------------------------------------------------------------------------------
class Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TokenizeRequest(Body):
    """vLLM's /tokenize body (text prompts)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class DetokenizeRequest(Body):
    model: str | None = None
    tokens: list[TokenId]


class StreamOptions(Body):
    include_usage: bool = False
    include_obfuscation: bool = False  # a padding field of OpenAI's streams: nothing to pad here


class SharpOptions(Body):
    attention_stats: bool = False


class JsonSchemaFormat(Body):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str = "response"
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # `schema` is pydantic's own name
    strict: bool | None = None  # sharp always decodes to the schema (llguidance), strict or not
    description: str | None = None


class ResponseFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def schema(self) -> str | None:
        """The JSON text of the schema the output must follow; None for text."""
        if self.type == "text":
            return None
        return schema_text(None if self.type == "json_object" else self.json_schema.schema_)


class StructuredOutputs(Body):
    """vLLM's `structured_outputs` extension: the output follows one of these."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    json_: dict[str, Any] | None = Field(None, alias="json")  # a JSON schema (`json` is pydantic's own name)
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark

    def put(self, msg: RequestParams) -> None:
        if self.json_ is not None or self.json_object:
            msg.json_schema = schema_text(self.json_)
        msg.regex, msg.choice, msg.grammar = self.regex, self.choice, self.grammar


Refusal = tuple[str, str]  # (field, why): a field set to something sharp does not do


class Generation(Body):
    """The fields completions and chat share. Fields OpenAI has that sharp does not do are accepted only at their
    neutral value, so a request never silently gets something other than what it asked for."""

    model: str
    max_tokens: Int32 | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int32 = 0  # an extension, as vLLM names it
    seed: Seed | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> added to its logit
    # accepted, changing nothing: who asks, where to bill, what to keep for them (nothing is kept)
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    # vLLM's and SGLang's extensions (what their clients, and the routers in front of replicas, send)
    ignore_eos: bool = False
    min_tokens: Int32 = 0
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False  # vLLM's name
    no_stop_trim: bool = False  # SGLang's name for the same
    priority: Int32 = 0
    cache_salt: str | None = None  # vLLM's: pages of the prefix cache shared only with the same salt
    repetition_penalty: float | None = None
    min_p: float | None = None
    return_hidden_states: bool = False
    structured_outputs: StructuredOutputs | None = None
    sharp: SharpOptions = SharpOptions()

    def refused(self) -> Refusal | None:
        for key in self.logit_bias or {}:
            if not key.isdecimal() or not key.isascii():
                return "logit_bias", f"logit_bias keys are token ids (strings of digits), got {key[:20]!r}"
        if self.store:
            return "store", "store: true is not supported: the server keeps no completions"
        if self.return_hidden_states:
            return "return_hidden_states", "return_hidden_states: true is not supported"
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options is only allowed with stream: true"
        return None

    @property
    def runs(self) -> int:
        """Choices generated for this request (all returned)."""
        return self.n

    def params(self, max_tokens: int | None) -> RequestParams:
        """Every field but the prompt, as the engine's transport-neutral request."""
        msg = RequestParams(
            max_new_tokens=max_tokens,
            temperature=self.temperature,
            top_k=0 if self.top_k == -1 else self.top_k,  # -1: off, as vLLM and SGLang also spell it
            top_p=self.top_p,
            seed=self.seed,
            stop=[self.stop] if isinstance(self.stop, str) else self.stop or [],
            return_attention_stats=self.sharp.attention_stats,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            stop_token_ids=self.stop_token_ids or (),
            skip_special_tokens=self.skip_special_tokens,
            include_stop=self.include_stop_str_in_output or self.no_stop_trim,
            priority=self.priority,
            cache_salt=self.cache_salt,
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
            n=self.n,
        )
        if self.structured_outputs is not None:
            self.structured_outputs.put(msg)
        return msg


class CompletionRequest(Generation):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    echo: bool = False
    best_of: int | None = None
    logprobs: int | None = None
    suffix: str | None = None

    def refused(self) -> Refusal | None:
        if isinstance(self.prompt, list) and len(self.prompt) > 1 and isinstance(self.prompt[0], str | list):
            return "prompt", "one prompt per request (send several requests, they batch together)"
        if self.best_of is not None and not self.n <= self.best_of <= MAX_CHOICES:
            return "best_of", f"best_of must be in [n, {MAX_CHOICES}]"
        if self.best_of not in (None, self.n) and self.stream:
            return "best_of", "best_of > n cannot be streamed (the best choices are known at the end)"
        if self.suffix:
            return "suffix", "suffix (insertion) is not supported"
        if self.max_tokens == 0 and not self.echo:
            return "max_tokens", "max_tokens: 0 only with echo: true (to score the prompt)"
        return super().refused()

    @property
    def runs(self) -> int:
        """Choices generated: best_of, of which the n most likely are returned."""
        return self.best_of or self.n

    @property
    def single_prompt(self) -> str | list[int]:
        """The prompt: a string or token ids (a batch of one unwrapped)."""
        nested = isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str | list)
        return self.prompt[0] if nested else self.prompt

    def to_params(self) -> RequestParams:
        msg = self.params(self.max_tokens)
        prompt = self.single_prompt
        if isinstance(prompt, str):
            msg.prompt = prompt
        else:
            msg.input_ids = prompt
        msg.logprobs = self.logprobs
        if self.runs > self.n and msg.logprobs is None:
            msg.logprobs = 0  # best_of ranks the choices by their tokens' log-probabilities (not shown)
        if self.echo and (self.logprobs is not None or self.max_tokens == 0):
            msg.prompt_logprobs = self.logprobs or 0  # max_tokens 0 runs the prompt only: as a scoring request
        return msg


class ContentPart(Body):
    model_config = ConfigDict(extra="allow", strict=True)  # image_url, input_audio, file: refused by type
    type: str
    text: str | None = None


class FunctionDef(Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments; none: no arguments
    strict: bool | None = None  # a forced call always follows the schema; an `auto` one is the model's own text


class ToolDef(Body):
    type: Literal["function"]
    function: FunctionDef

    def tool(self) -> Tool:
        fn = self.function
        return Tool(fn.name, fn.description) if fn.parameters is None else Tool(fn.name, fn.description, fn.parameters)


class FunctionName(Body):
    name: str


class NamedToolChoice(Body):
    type: Literal["function"]
    function: FunctionName


class CalledFunction(Body):
    name: str
    arguments: str  # a JSON object's text, as the reply gave it


class MessageToolCall(Body):
    """A call of an earlier assistant reply, sent back with the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool's result: the call it answers
    # what clients send back from a reply (the SDK's model_dump, LangChain, agent frameworks): accepted when empty
    refusal: str | None = None
    annotations: list[dict[str, Any]] | None = None
    audio: dict[str, Any] | None = None
    function_call: dict[str, Any] | None = None

    def refused(self, where: str) -> Refusal | None:
        for i, part in enumerate(self.content if isinstance(self.content, list) else ()):
            if part.type != "text" or part.text is None:
                return f"{where}.content[{i}]", f"{part.type!r} content parts are not supported (text only)"
        for name in ("function_call", "audio"):
            if getattr(self, name):
                return f"{where}.{name}", f"{name} in messages is not supported (send tool_calls)"
        for i, call in enumerate(self.tool_calls or ()):
            if self.role != "assistant":
                return f"{where}.tool_calls", "tool_calls belong to assistant messages"
            if not isinstance(_json_object(call.function.arguments), dict):
                return f"{where}.tool_calls[{i}].function.arguments", "arguments must be a JSON object's text"
        return None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text or "" for p in self.content or ())

    def for_template(self, fmt: Format, native: bool) -> dict[str, Any]:
        """As a chat template reads it: a template that takes tools gets the calls (arguments as objects, as
        transformers passes them); any other gets them written into the content as the model writes calls."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        out |= {"name": self.name} if self.name else {}
        out |= {"tool_call_id": self.tool_call_id} if self.tool_call_id else {}
        calls = [(c.id, c.function.name, _json_object(c.function.arguments)) for c in self.tool_calls or ()]
        if calls and native:
            out["tool_calls"] = [{"id": i, "type": "function", "function": {"name": n, "arguments": a}}
                                 for i, n, a in calls]  # fmt: skip
        elif calls:
            out["content"] += fmt.render([(n, a) for _, n, a in calls])
        return out


def _json_object(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


class ChatRequest(Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int32 | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    web_search_options: dict[str, Any] | None = None
    add_generation_prompt: bool = True  # vLLM's extensions: how the chat template renders the messages
    continue_final_message: bool = False
    # SGLang's and vLLM's reasoning switches: they separate a reasoning parser's output, and sharp runs none (all
    # text is content), so any value gives the same reply
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    include_reasoning: bool = True

    def refused(self) -> Refusal | None:
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs: true"
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            return "max_tokens", "give max_completion_tokens or max_tokens, not both"
        rf = self.response_format
        if rf is not None and rf.type == "json_schema" and (rf.json_schema is None or rf.json_schema.schema_ is None):
            return "response_format", "response_format json_schema needs json_schema.schema"
        if self.functions or self.function_call not in (None, "none", "auto"):
            return "functions", "functions and function_call are deprecated and not supported: send tools"
        if (refusal := self._tools_refused()) is not None:
            return refusal
        if self.modalities not in (None, ["text"]) or self.audio:
            return "modalities", "only text output is supported"
        for name in ("prediction", "reasoning_effort", "web_search_options"):
            if getattr(self, name):
                return name, f"{name} is not supported"
        for i, m in enumerate(self.messages):
            if (refusal := m.refused(f"messages[{i}]")) is not None:
                return refusal
        if self.max_completion_tokens == 0 or self.max_tokens == 0:
            return "max_completion_tokens", "max_completion_tokens must be >= 1"
        return super().refused()

    def _tools_refused(self) -> Refusal | None:
        names = [t.function.name for t in self.tools or ()]
        for i, name in enumerate(names):
            if not TOOL_NAME.fullmatch(name):
                return f"tools[{i}].function.name", f"a tool's name is 1-64 of a-z A-Z 0-9 _ . : -, got {name[:70]!r}"
            if name in names[:i]:
                return f"tools[{i}].function.name", f"two tools are named {name!r}"
        if self.tool_choice not in (None, "none", "auto"):
            if not names:
                return "tool_choice", "tool_choice 'required' or a named function needs tools"
            if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
                return "tool_choice", f"tool_choice names {self.tool_choice.function.name!r}, which is not in tools"
            if self.structured_outputs is not None or (self.response_format and self.response_format.type != "text"):
                return (
                    "tool_choice",
                    "a forced tool call decides the output's form: give it or response_format, not both",
                )
        return None

    def tool_use(self, fmt: Format) -> ToolUse | None:
        """The request's tools and how the reply may call them (None without tools)."""
        if not self.tools:
            return None
        choice = self.tool_choice or "auto"
        name = choice if isinstance(choice, str) else choice.function.name
        return ToolUse(tuple(t.tool() for t in self.tools), name, self.parallel_tool_calls, fmt)

    def to_params(self, prompt: str, tools: ToolUse | None = None) -> RequestParams:
        msg = self.params(self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens)
        msg.prompt = prompt
        if self.logprobs:
            msg.logprobs = self.top_logprobs or 0
        if self.response_format is not None:
            msg.json_schema = self.response_format.schema()
        if tools is not None:
            msg.grammar = tools.grammar() or msg.grammar
            if tools.choice != "none" and "skip_special_tokens" not in self.model_fields_set:
                msg.skip_special_tokens = False  # a call's marker may be a special token ([TOOL_CALLS]): keep it
        return msg
