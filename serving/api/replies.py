"""The one place a request's events become its reply: completions' and chat's choices (whole, or streamed as
server-sent events as OpenAI streams them) and Responses' items, with their log-probabilities, tool calls, usage
and sharp's attention statistics."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from sharp.serving.api.errors import APIError
from sharp.serving.api.openai_bodies import Generation
from sharp.serving.api.responses_api import Reply, ResponsesRequest
from sharp.serving.api.responses_api import usage as responses_usage
from sharp.serving.api.tools import CallReader, ToolCall, ToolUse
from sharp.serving.engine.output import Delta, Event, Failed, Finished, TokenLogprob
from sharp.serving.requests import GenerationRequest, RequestError
from sharp.serving.spec import ModelSpec

FINISH_REASON = {"eos": "stop", "stop": "stop", "length": "length"}  # OpenAI has no separate end-of-sequence reason
Events = AsyncIterator[tuple[GenerationRequest, int, Event]]  # a request's choices' events (api/calls.py)
LOGPROB_FLOOR = -9999.0  # JSON has no -inf: a token the model rules out is reported at this, as vLLM reports it


def usage(ends: list[Finished]) -> dict:
    """The usage of a request's choices: the prompt counted once (the first choice prefilled it), the tokens of
    every choice generated."""
    first, completion = ends[0], sum(ev.completion_tokens for ev in ends)
    return {
        "prompt_tokens": first.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": first.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": first.cached_tokens},
    }


def extension(ev: Finished, norm: str) -> dict[str, Any]:
    """sharp's fields of a response: the attention statistics, in gRPC's AttentionStats shape."""
    if ev.attention is None:
        return {}
    heads = [dataclasses.asdict(h) for h in ev.attention]
    return {"sharp": {"attention_stats": {"norm": norm, "positions": ev.positions, "heads": heads}}}


def _lp(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


class Logprobs:
    """One choice's log-probabilities in OpenAI's shapes: tokens as strings (a piece that is not UTF-8 alone as
    `bytes:\\xNN…`, chat's `bytes` arrays exact), completions' text offsets into the choice's text (counted by
    decoding the tokens in order, as the text itself is decoded)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.text = tokenizer.stream()
        self.offset = 0

    def string(self, token: int) -> str:
        raw = self.tokenizer.token_bytes(token)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def completion(self, ids: list[int], items: list[TokenLogprob | None]) -> dict[str, Any]:
        """`items[i]` for ids[i]; None: nothing predicts it (a prompt's first token)."""
        offsets = []
        for t in ids:
            offsets.append(self.offset)
            self.offset += len(self.text.step(t))
        return {
            "tokens": [self.string(t) for t in ids],
            "token_logprobs": [None if x is None else _lp(x.logprob) for x in items],
            "top_logprobs": [None if x is None else {self.string(i): _lp(v) for i, v in x.top} for x in items],
            "text_offset": offsets,
        }

    def chat(self, items: list[TokenLogprob]) -> dict[str, Any]:
        def entry(token: int, value: float) -> dict[str, Any]:
            return {
                "token": self.string(token),
                "logprob": _lp(value),
                "bytes": list(self.tokenizer.token_bytes(token)),
            }

        content = [entry(x.token, x.logprob) | {"top_logprobs": [entry(i, v) for i, v in x.top]} for x in items]
        return {"content": content, "refusal": None}


@dataclasses.dataclass
class Envelope:
    """The envelope of one response's objects: completions and chat differ only in these names."""

    chat: bool
    request_id: str
    model: str
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    def envelope(self, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        prefix = "chatcmpl-" if self.chat else "cmpl-"
        return {"id": prefix + self.request_id, "object": kind, "created": self.created, "model": self.model}

    def choice(
        self,
        text: str | None,
        finish: str | None,
        chunk: bool,
        role: bool = False,
        logprobs: dict | None = None,
        index: int = 0,
        calls: list[ToolCall] = (),
    ) -> dict[str, Any]:
        """One choice: a completion's text, a chat chunk's delta (`role`: the first, naming it) or a chat message
        (with its tool calls)."""
        if not self.chat:
            body = {"text": text or ""}
        elif chunk:
            body = {"delta": ({"role": "assistant"} if role else {}) | ({} if text is None else {"content": text})}
        else:
            message = {"role": "assistant", "content": text if text or not calls else None, "refusal": None}
            if calls:
                message["tool_calls"] = [_call(c) for c in calls]
            body = {"message": message}
        return {"index": index, **body, "logprobs": logprobs, "finish_reason": finish}

    def call_chunks(self, calls: list[ToolCall], index: int) -> list[dict[str, Any]]:
        """A chat stream's deltas of a choice's tool calls: each call opened (id, name), then its arguments."""
        out = []
        for k, c in enumerate(calls):
            opened = {"index": k, "id": c.id, "type": "function", "function": {"name": c.name, "arguments": ""}}
            for delta in (opened, {"index": k, "function": {"arguments": c.arguments}}):
                out.append({"index": index, "delta": {"tool_calls": [delta]}, "logprobs": None, "finish_reason": None})
        return out


def _call(c: ToolCall) -> dict[str, Any]:
    return {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}


def finish_reason(ev: Finished, calls: list[ToolCall]) -> str:
    """A choice's finish reason: `tool_calls` when it ended on calls (not cut by its budget)."""
    return "tool_calls" if calls and ev.reason != "length" else FINISH_REASON[ev.reason]


@dataclasses.dataclass
class Choice:
    """What one request asked to see of its tokens, and how: echo the prompt, log-probabilities (the choice's
    `logprobs` object per piece of text)."""

    chat: bool
    echo_text: str | None  # the prompt, when echoed
    logprobs: bool
    shapes: Logprobs
    prompt_ids: tuple[int, ...] = ()
    tools: ToolUse | None = None  # chat: the calls are read from the text

    def reader(self) -> CallReader | None:
        return None if self.tools is None else self.tools.reader()

    def piece(self, ev: Delta, first: bool) -> tuple[str, dict | None]:
        """The text and the logprobs object of one Delta (the first: with the echoed prompt)."""
        text = ev.text
        ids, items = list(ev.token_ids), list(ev.logprobs or ())
        if first and self.echo_text is not None:
            text = self.echo_text + text
            ids = list(self.prompt_ids) + ids
            items = [None, *(ev.prompt_logprobs or ()), *items]
        if not self.logprobs:
            return text, None
        return text, self.shapes.chat(items) if self.chat else self.shapes.completion(ids, items)


def join(pieces: list[dict | None], chat: bool) -> dict | None:
    """The logprobs objects of a choice's pieces as one."""
    real = [p for p in pieces if p is not None]
    if not real:
        return None
    if chat:
        return {"content": [c for p in real for c in p["content"]], "refusal": None}
    return {k: [v for p in real for v in p[k]] for k in real[0]}


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


async def first_event(events: Events) -> tuple[GenerationRequest, int, Event]:
    """A request's first event; its refusal, or a failure before any text (the status line can still say so), as
    an APIError."""
    try:
        req, index, first = await anext(events)
    except RequestError as e:
        raise APIError.refused(e) from None
    if isinstance(first, Failed):
        raise APIError.of(first.code, first.message)
    return req, index, first


def rendered(req: GenerationRequest, prefix: str, model: str) -> dict[str, Any]:
    """A validated request in the shape vLLM's render endpoints answer (its GenerateRequest)."""
    sampling = {
        "max_tokens": req.max_new_tokens,
        "min_tokens": req.min_tokens,
        "temperature": req.sampling.temperature,
        "top_p": req.sampling.top_p,
        "top_k": req.sampling.top_k,
        "seed": req.seed,
        "stop": list(req.stop),
        "stop_token_ids": list(req.stop_token_ids),
        "ignore_eos": req.ignore_eos,
        "skip_special_tokens": req.skip_special_tokens,
        "include_stop_str_in_output": req.include_stop,
        "logprobs": req.logprobs,
        "prompt_logprobs": req.prompt_logprobs,
    }
    return {"request_id": prefix + req.request_id, "model": model, "token_ids": list(req.prompt_ids),
            "sampling_params": sampling, "priority": req.priority}  # fmt: skip


async def generate(request: web.Request, body: Generation, events: Events, choice: Choice, spec: ModelSpec
                   ) -> web.StreamResponse:  # fmt: skip
    """A completion or chat request's reply, whole or streamed: its `runs` choices' events (`events`) assembled,
    the best `n` of them kept."""
    runs = body.runs
    async with contextlib.aclosing(events):
        req, index, first = await first_event(events)
        choice.prompt_ids = req.prompt_ids
        choices = [choice] + [dataclasses.replace(choice, shapes=Logprobs(choice.shapes.tokenizer))
                              for _ in range(runs - 1)]  # fmt: skip
        reply = Envelope(choice.chat, req.request_id, spec.name)
        if body.stream:
            return await _stream(request, body, reply, choices, (index, first), events, spec.norm)
        text: list[list[str]] = [[] for _ in range(runs)]
        pieces: list[list[dict | None]] = [[] for _ in range(runs)]
        likelihood, ends = [0.0] * runs, {}
        item: tuple[int, Event] | None = (index, first)
        while item is not None:
            i, ev = item
            if isinstance(ev, Failed):
                raise APIError.of(ev.code, ev.message)
            if isinstance(ev, Finished):
                ends[i] = ev
            else:
                piece, logprobs = choices[i].piece(ev, first=not pieces[i])
                text[i].append(piece)
                pieces[i].append(logprobs)
                likelihood[i] += sum(lp.logprob for lp in ev.logprobs or ())
            item = None if len(ends) == runs else (await anext(events))[1:]
        kept = range(runs) if runs == body.n else sorted(range(runs), key=lambda i: -likelihood[i])[: body.n]
        replies = []
        for k, i in enumerate(kept):
            content, calls = "".join(text[i]), []
            if (reader := choice.reader()) is not None:
                content = reader.push(content)
                rest, calls = reader.finish(cut=ends[i].reason == "length")
                content += rest
            finish = finish_reason(ends[i], calls)
            logprobs = join(pieces[i], choice.chat)
            replies.append(reply.choice(content, finish, chunk=False, logprobs=logprobs, index=k, calls=calls))
        out = reply.envelope(chunk=False) | {
            "choices": replies,
            "usage": usage([ends[i] for i in range(runs)]),
        }
        return web.json_response(out | extension(ends[0], spec.norm))


async def _stream(
    request: web.Request,
    body: Generation,
    reply: Envelope,
    choices: list[Choice],
    first: tuple[int, Event],
    events: Events,
    norm: str,
) -> web.StreamResponse:
    """Server-sent events as OpenAI sends them: a chunk per piece of text (with its choice's index), one with
    each choice's finish reason, one with the usage when stream_options.include_usage, then `data: [DONE]`;
    sharp's extension in the last chunk. Log-probabilities of tokens whose text is held back (a stop string may
    be starting) travel with the next chunk that has text."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    with_usage = body.stream_options is not None and body.stream_options.include_usage
    base = reply.envelope(chunk=True) | ({"usage": None} if with_usage else {})
    runs, chat = len(choices), reply.chat
    if chat:  # the first chunk of each choice names the role
        for i in range(runs):
            await resp.write(sse(base | {"choices": [reply.choice("", None, chunk=True, role=True, index=i)]}))
    held: list[list[dict | None]] = [[] for _ in range(runs)]
    readers = [c.reader() for c in choices]
    sent, ends, failed = [False] * runs, {}, None
    item: tuple[int, Event] | None = first
    while item is not None:
        i, ev = item
        if isinstance(ev, Failed):  # the status line is sent: the error travels as an event, as OpenAI's does
            failed = ev
            break
        if isinstance(ev, Finished):
            ends[i], calls = ev, []
            if readers[i] is not None:
                rest, calls = readers[i].finish(cut=ev.reason == "length")
                if rest:
                    chunk = reply.choice(rest, None, chunk=True, logprobs=join(held[i], chat), index=i)
                    await resp.write(sse(base | {"choices": [chunk]}))
                    held[i] = []
                for chunk in reply.call_chunks(calls, i):
                    await resp.write(sse(base | {"choices": [chunk]}))
            finish = reply.choice(None, finish_reason(ev, calls), chunk=True, logprobs=join(held[i], chat), index=i)
            last = base | {"choices": [finish]}
            if len(ends) < runs:
                await resp.write(sse(last))
        else:
            text, logprobs = choices[i].piece(ev, first=not sent[i])
            if readers[i] is not None:
                text = readers[i].push(text)
            sent[i] = True
            held[i].append(logprobs)
            if text:
                chunk = reply.choice(text, None, chunk=True, logprobs=join(held[i], chat), index=i)
                await resp.write(sse(base | {"choices": [chunk]}))
                held[i] = []
        item = None if len(ends) == runs else (await anext(events))[1:]
    if failed is not None:
        await resp.write(sse(APIError.of(failed.code, failed.message).body()))
    else:
        tail = [last]
        if with_usage:
            tail.append(base | {"choices": [], "usage": usage([ends[i] for i in range(runs)])})
        tail[-1] |= extension(ends[0], norm)
        for chunk in tail:
            await resp.write(sse(chunk))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def respond(request: web.Request, body: ResponsesRequest, tools: ToolUse | None, events: Events, model: str
                  ) -> web.StreamResponse:  # fmt: skip
    """A Responses request's reply, whole or streamed, from its chat's events."""
    async with contextlib.aclosing(events):
        req, _, first = await first_event(events)
        reply = Reply(body, req.request_id, model)
        reader = tools.reader() if tools is not None else None
        if body.stream:
            return await _respond_stream(request, reply, reader, first, events)
        ev, text = first, []
        while not isinstance(ev, Finished):
            if isinstance(ev, Failed):
                raise APIError.of(ev.code, ev.message)
            text.append(ev.text)
            ev = (await anext(events))[2]
        content, calls = "".join(text), []
        if reader is not None:
            content = reader.push(content)
            rest, calls = reader.finish(cut=ev.reason == "length")
            content += rest
        status = "incomplete" if ev.reason == "length" else "completed"  # a cut call too
        reply.text(content)
        reply.end_text(status)
        reply.calls(calls)
        used = responses_usage(ev.prompt_tokens, ev.cached_tokens, ev.completion_tokens)
        return web.json_response(reply.response(status, used, incomplete=status == "incomplete"))


async def _respond_stream(
    request: web.Request,
    reply: Reply,
    reader: CallReader | None,
    ev: Event,
    events: Events,
) -> web.StreamResponse:
    """A Response as OpenAI streams it: created, in progress, the message item's text deltas, each function
    call item, then completed (or incomplete: cut by max_output_tokens) with the whole Response."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)

    async def send(*items: dict[str, Any]) -> None:
        for item in items:
            await resp.write(f"event: {item['type']}\n".encode() + sse(item))

    opened = reply.response("in_progress")
    await send(reply.event("response.created", response=opened), reply.event("response.in_progress",
                                                                            response=opened))  # fmt: skip
    while not isinstance(ev, Finished | Failed):
        await send(*reply.text(reader.push(ev.text) if reader is not None else ev.text))
        ev = (await anext(events))[2]
    if isinstance(ev, Failed):
        error = APIError.of(ev.code, ev.message)
        await send(reply.event("error", code=error.code, message=error.message, param=None))
    else:
        rest, calls = reader.finish(cut=ev.reason == "length") if reader is not None else ("", [])
        status = "incomplete" if ev.reason == "length" else "completed"  # a cut call too
        await send(*reply.text(rest), *reply.end_text(status), *reply.calls(calls))
        used = responses_usage(ev.prompt_tokens, ev.cached_tokens, ev.completion_tokens)
        final = reply.response(status, used, incomplete=status == "incomplete")
        await send(reply.event(f"response.{status}", response=final))
    await resp.write_eof()
    return resp
