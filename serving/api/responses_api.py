"""OpenAI's Responses API (`POST /v1/responses`), stateless: a body becomes the chat request it means (`input` and
`instructions` as messages, `text.format` as response_format, flat function tools as chat's), which runs as chat
does; its reply is written back as a Response — output items (a message of output text, function calls), usage,
status — and, streamed, as the event sequence the openai SDK accumulates (`response.created` …
`response.output_text.delta` … `response.completed`). Nothing is stored: `store: true` and `previous_response_id`
are refused by name.
"""

from __future__ import annotations

import secrets
import time
from typing import Any, Literal

from pydantic import ConfigDict, Field

from sharp.serving.api.openai_bodies import Body, ChatRequest, Int32, Refusal
from sharp.serving.api.tools import ToolCall

RENAMED = {  # a chat field's refusal, in the Responses request's words
    "messages": "input",
    "response_format": "text.format",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
}


class InputPart(Body):
    model_config = ConfigDict(extra="allow", strict=True)  # input_image, input_file: refused by type
    type: str
    text: str | None = None


class InputItem(Body):
    """One item of `input`: a message (`type` "message" or absent), a function call the model made earlier, or its
    output sent back."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["message", "function_call", "function_call_output"] = "message"
    role: Literal["user", "system", "developer", "assistant"] | None = None
    content: str | list[InputPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | None = None
    id: str | None = None  # what the SDK sends back of an earlier response's items
    status: str | None = None

    def refused(self, where: str) -> Refusal | None:
        needs = {"message": ("role",), "function_call": ("call_id", "name", "arguments"),
                 "function_call_output": ("call_id", "output")}[self.type]  # fmt: skip
        for name in needs:
            if getattr(self, name) is None:
                return f"{where}.{name}", f"a {self.type} item needs {name}"
        for i, part in enumerate(self.content if isinstance(self.content, list) else ()):
            if part.type not in ("input_text", "output_text", "text") or part.text is None:
                return f"{where}.content[{i}]", f"{part.type!r} content is not supported (text only)"
        return None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text or "" for p in self.content or ())


class FunctionTool(Body):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(Body):
    type: Literal["function"]
    name: str


class TextFormat(Body):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(Body):
    format: TextFormat | None = None
    verbosity: str | None = None


class ResponsesRequest(Body):
    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: Int32 | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = None  # null: not streamed (sglang-router sends it so)
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    store: bool | None = None
    background: bool | None = None
    include: list[str] | None = None
    truncation: Literal["disabled"] | None = None
    max_tool_calls: Int32 | None = None
    # accepted, changing nothing: who asks, where to bill, what to tag
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    reasoning: dict[str, Any] | None = None  # sharp runs no reasoning: only empty
    # vLLM's and SGLang's sampling extensions, as on chat (sglang-router adds them to every Responses body)
    top_k: Int32 = 0
    min_p: float | None = None
    repetition_penalty: float | None = None
    priority: Int32 = 0
    cache_salt: str | None = None

    def refused(self) -> Refusal | None:
        if self.previous_response_id is not None:
            return "previous_response_id", "previous_response_id is not supported: nothing is stored; send the input"
        if self.store:
            return "store", "store: true is not supported: the server keeps no responses"
        if self.background:
            return "background", "background: true is not supported"
        if self.include:
            return "include", "include is not supported"
        if self.max_tool_calls is not None:
            return "max_tool_calls", "max_tool_calls is not supported"
        if self.reasoning:
            return "reasoning", "reasoning options are not supported"
        fmt = self.text.format if self.text else None
        if fmt is not None and fmt.type == "json_schema" and fmt.schema_ is None:
            return "text.format", "text.format json_schema needs schema"
        for i, item in enumerate(self.input if isinstance(self.input, list) else ()):
            if (refusal := item.refused(f"input[{i}]")) is not None:
                return refusal
        return None

    def chat(self) -> dict[str, Any]:
        """The chat request's body that means the same."""
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        items = [InputItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        for item in items:
            if item.type == "message":
                messages.append({"role": item.role, "content": item.text()})
            elif item.type == "function_call":
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}  # fmt: skip
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant":  # calls made together: one turn
                    last.setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            else:
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        body: dict[str, Any] = {"model": self.model, "messages": messages, "stream": bool(self.stream),
                                "parallel_tool_calls": self.parallel_tool_calls, "top_k": self.top_k,
                                "priority": self.priority}  # fmt: skip
        for name, value in (("max_completion_tokens", self.max_output_tokens), ("temperature", self.temperature),
                            ("top_p", self.top_p), ("min_p", self.min_p), ("cache_salt", self.cache_salt),
                            ("repetition_penalty", self.repetition_penalty)):  # fmt: skip
            if value is not None:
                body[name] = value
        if self.tools:
            body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                             for t in self.tools]  # fmt: skip
        if self.tool_choice is not None:
            choice = self.tool_choice
            named = not isinstance(choice, str)
            body["tool_choice"] = {"type": "function", "function": {"name": choice.name}} if named else choice
        fmt = self.text.format if self.text else None
        if fmt is not None and fmt.type == "json_schema":
            schema = {"name": fmt.name or "response", "schema": fmt.schema_}
            body["response_format"] = {"type": "json_schema", "json_schema": schema}
        elif fmt is not None:
            body["response_format"] = {"type": fmt.type}
        return body

    def as_chat(self) -> ChatRequest:
        return ChatRequest.model_validate(self.chat())


def renamed(field: str | None) -> str | None:
    """A chat field's name as the Responses request calls it."""
    if field is None:
        return None
    head, dot, rest = field.partition(".")
    root = head.split("[")[0]
    if root in RENAMED:
        return RENAMED[root] + head[len(root) :] + dot + rest
    return field.replace(".function.", ".") if field.startswith("tools[") else field


class Reply:
    """A Response being written: its id and settings, its output items as they are made, and the events that tell a
    stream of them (each numbered)."""

    def __init__(self, body: ResponsesRequest, request_id: str, model: str):
        self.body, self.id, self.model = body, "resp_" + request_id, model
        self.created = int(time.time())
        self.output: list[dict[str, Any]] = []
        self.sequence = 0
        self.message: dict[str, Any] | None = None  # the message item, while its text streams

    def response(self, status: str, usage: dict | None = None, incomplete: bool = False) -> dict[str, Any]:
        b = self.body
        fmt = b.text.format.model_dump(by_alias=True, exclude_none=True) if b.text and b.text.format else None
        choice = (
            b.tool_choice if isinstance(b.tool_choice, str) or b.tool_choice is None else b.tool_choice.model_dump()
        )
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens,
            "model": self.model,
            "output": list(self.output),
            "parallel_tool_calls": b.parallel_tool_calls,
            "previous_response_id": None,
            "store": False,
            "temperature": b.temperature,
            "top_p": b.top_p,
            "text": {"format": fmt or {"type": "text"}},
            "tool_choice": choice or "auto",
            "tools": [t.model_dump() for t in b.tools or ()],
            "truncation": "disabled",
            "metadata": b.metadata or {},
            "usage": usage,
        }

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def text(self, delta: str) -> list[dict[str, Any]]:
        """The events of a piece of output text (the first opens the message item and its part)."""
        if not delta:
            return []
        out = []
        if self.message is None:
            self.message = {"type": "message", "id": "msg_" + secrets.token_hex(12), "status": "in_progress",
                            "role": "assistant", "content": []}  # fmt: skip
            self.output.append(self.message)
            out.append(self.event("response.output_item.added", output_index=len(self.output) - 1,
                                  item=self.message | {"content": []}))  # fmt: skip
            self.message["content"].append({"type": "output_text", "text": "", "annotations": [], "logprobs": []})
            out.append(self.event("response.content_part.added", item_id=self.message["id"],
                                  output_index=len(self.output) - 1, content_index=0,
                                  part=dict(self.message["content"][0])))  # fmt: skip
        self.message["content"][0]["text"] += delta
        out.append(self.event("response.output_text.delta", item_id=self.message["id"],
                              output_index=self._index(self.message), content_index=0, delta=delta,
                              logprobs=[]))  # fmt: skip
        return out

    def end_text(self, status: str) -> list[dict[str, Any]]:
        """The events that close the message item (none when no text was written)."""
        m = self.message
        if m is None:
            return []
        m["status"] = status
        at, part = self._index(m), m["content"][0]
        return [
            self.event("response.output_text.done", item_id=m["id"], output_index=at, content_index=0,
                       text=part["text"], logprobs=[]),
            self.event("response.content_part.done", item_id=m["id"], output_index=at, content_index=0, part=part),
            self.event("response.output_item.done", output_index=at, item=m),
        ]  # fmt: skip

    def calls(self, calls: list[ToolCall]) -> list[dict[str, Any]]:
        """The function-call items, and the events that stream each: added, its arguments, done."""
        out = []
        for c in calls:
            item = {"type": "function_call", "id": "fc_" + secrets.token_hex(12), "call_id": c.id, "name": c.name,
                    "arguments": c.arguments, "status": "completed"}  # fmt: skip
            self.output.append(item)
            at = len(self.output) - 1
            out += [
                self.event("response.output_item.added", output_index=at,
                           item=item | {"arguments": "", "status": "in_progress"}),
                self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=at,
                           delta=c.arguments),
                self.event("response.function_call_arguments.done", item_id=item["id"], output_index=at,
                           name=c.name, arguments=c.arguments),
                self.event("response.output_item.done", output_index=at, item=item),
            ]  # fmt: skip
        return out

    def _index(self, item: dict) -> int:
        return next(i for i, x in enumerate(self.output) if x is item)


def usage(prompt: int, cached: int, completion: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }
