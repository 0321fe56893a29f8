"""Tool calling, independent of the HTTP shapes: how a model writes its calls (a format, chosen from its chat template
or by `--tool-call-parser`), the grammar that makes `tool_choice: "required"` or a named function hold on any model,
the calls read back from the text — whole, or as a stream whose content is sent while no call has begun — and the
system block that tells a model whose template takes no tools which ones it has.

A call is the function's name and its arguments as JSON text, as OpenAI returns them; its id is made here.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field, replace
from typing import Any, Literal

TOOL_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")  # OpenAI's names, plus `.` and `:` that MCP servers' names use
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
COMPACT = {"whitespace_flexible": False}  # llguidance's JSON without free whitespace: a call's length is bounded


def call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True)
class Tool:
    """One function the model may call: its name, what it does, the JSON schema of its arguments."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] = field(default_factory=lambda: dict(NO_PARAMETERS))

    def for_template(self) -> dict[str, Any]:
        """As transformers passes tools to a chat template (OpenAI's function-tool shape)."""
        fn = {"name": self.name, "parameters": self.parameters}
        return {"type": "function", "function": fn | ({"description": self.description} if self.description else {})}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text
    id: str = field(default_factory=call_id)


@dataclass(frozen=True)
class Format:
    """How a family of models writes tool calls: each call a JSON object `{"name": …, <arguments_key>: {…}}`,
    wrapped by `open`/`close`, calls separated by `between`, the whole list behind `lead` (e.g. Mistral's
    `[TOOL_CALLS][…]`). `at_start`: calls only where the reply begins (Llama 3 writes bare JSON)."""

    name: str
    arguments_key: str
    open: str = ""
    close: str = ""
    between: str = ""
    lead: str = ""
    tail: str = ""
    at_start: bool = False
    markers: tuple[str, ...] = ()  # what shows that the calls have begun
    strip: tuple[str, ...] = ()  # markers that are not JSON, dropped before the calls are read
    tokens: tuple[str, ...] = ()  # the format's tags that a model's vocabulary may hold as one added token
    token_ids: tuple[tuple[str, int], ...] = ()  # those the served model's does hold (`bound`), with their ids

    def bound(self, tokenizer) -> Format:
        """This format for a served model: its tags that are added tokens of the vocabulary (`added_id`) are
        written by a forced call's grammar as those tokens — as the model writes them — not as text pieces."""
        ids = tuple((t, i) for t in self.tokens if (i := tokenizer.added_id(t)) is not None)
        return replace(self, token_ids=ids)

    def render(self, calls: list[tuple[str, Any]]) -> str:
        """Earlier calls (name, arguments) as the model writes them, for a history a template cannot render."""
        body = self.between.join(
            self.open + json.dumps({"name": n, self.arguments_key: a}, ensure_ascii=False) + self.close
            for n, a in calls
        )
        return self.lead + body + self.tail

    def grammar(self, tools: list[Tool], parallel: bool) -> str:
        """A Lark grammar (llguidance's, with `%json`) of one call, or several when `parallel`, to these tools."""
        alternatives = [
            {
                "type": "object",
                "properties": {"name": {"const": t.name}, self.arguments_key: t.parameters},
                "required": ["name", self.arguments_key],
                "additionalProperties": False,
            }
            for t in tools
        ]
        schema = json.dumps({"anyOf": alternatives, "x-guidance": COMPACT})
        call = f"{self._piece(self.open)} call {self._piece(self.close)}".strip()
        more = f" ({self._piece(self.between)} {call})*" if parallel else ""
        start = f"{self._piece(self.lead)} {call}{more} {self._piece(self.tail)}"
        return f"start: {start}\ncall: %json {schema}\n".replace("  ", " ")

    def _piece(self, text: str) -> str:
        """`text` as a Lark sequence: its bound tags as their tokens (`<[id]>`), the rest as literal text."""
        if not text or not self.token_ids:
            return _lit(text)
        ids = dict(self.token_ids)
        parts = re.split("(" + "|".join(map(re.escape, ids)) + ")", text)
        return " ".join(f"<[{ids[p]}]>" if p in ids else _lit(p) for p in parts if p)

    def parse(self, text: str) -> tuple[str, list[ToolCall]] | None:
        """The content before the calls and the calls, or None when the text holds no well-formed calls."""
        if (split := self._split(text)) is None:
            return None
        content, rest = split
        objects = _objects(rest, self)
        if not objects:
            return None
        calls = []
        for obj in objects:
            name, args = obj.get("name"), obj.get(self.arguments_key, obj.get("arguments", obj.get("parameters")))
            if not isinstance(name, str) or not isinstance(args, dict):
                return None
            calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
        return content, calls

    def parse_cut(self, text: str, name: str | None = None) -> tuple[str, list[ToolCall]] | None:
        """A reply cut by its token budget inside its calls: the content before them, the calls written whole, and
        the one cut short with its name and the arguments' text as far as it got (as OpenAI returns a cut call: a
        client's JSON parse of those arguments fails, so it is never mistaken for a finished call or an answer).
        `name`: the one function a forced reply calls, for a call cut before its name. None when the cut call's name
        is not known."""
        if (split := self._split(text)) is None:
            return None
        content, rest = split
        objects, tail = _objects_until_cut(rest, self)
        calls = [
            ToolCall(o["name"], json.dumps(o.get(self.arguments_key, {}), ensure_ascii=False))
            for o in objects
            if isinstance(o.get("name"), str)
        ]
        written = re.search(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"', tail)
        if written is not None:
            name = json.loads(f'"{written[1]}"')
        if tail and name is not None:
            args = re.search(rf'"{re.escape(self.arguments_key)}"\s*:\s*', tail)
            calls.append(ToolCall(name, tail[args.end() :] if args else ""))
        elif not tail.strip() and not calls and name is not None:  # cut before the call's JSON began
            calls.append(ToolCall(name, ""))
        return (content, calls) if calls else None

    def _split(self, text: str) -> tuple[str, str] | None:
        """The content before the calls, and the calls' text without the markers that are not JSON; None when the
        calls do not begin."""
        at = self._begin(text)
        if at is None:
            return None
        content, rest = text[:at], text[at:].strip()
        for m in self.strip:
            if rest.startswith(m):
                rest = rest[len(m) :].lstrip()
        return content, rest

    def _begin(self, text: str) -> int | None:
        """Where the calls begin in `text`, if they do."""
        if self.at_start:
            stripped = len(text) - len(text.lstrip())
            return stripped if any(text[stripped:].startswith(m) for m in self.markers) else None
        found = [i for m in self.markers if (i := text.find(m)) >= 0]
        return min(found) if found else None

    def could_begin(self, text: str) -> int:
        """The length of the end of `text` that could still become the start of the calls (held back in a stream)."""
        if self.at_start:
            head = text.lstrip()
            return len(text) if any(m.startswith(head) for m in self.markers) else 0
        return max((k for m in self.markers for k in range(1, len(m)) if text.endswith(m[:k])), default=0)


def _lit(s: str) -> str:
    return json.dumps(s) if s else ""


def _objects_until_cut(text: str, fmt: Format) -> tuple[list[dict], str]:
    """The whole JSON objects at the start of a cut call list, and the text from the first one that does not parse."""
    decoder, out, i = json.JSONDecoder(), [], 0
    wraps = [w for w in (fmt.open.strip(), fmt.close.strip()) if w]
    while i < len(text):
        while i < len(text) and text[i] in " \t\r\n;,[]":
            i += 1
        if i < len(text) and (wrap := next((w for w in wraps if text.startswith(w, i)), None)):
            i += len(wrap)
            continue
        try:
            value, end = decoder.raw_decode(text, i)
        except ValueError:
            return out, text[i:]
        out += [v for v in (value if isinstance(value, list) else [value]) if isinstance(v, dict)]
        i = end
    return out, ""


def _objects(text: str, fmt: Format) -> list[dict] | None:
    """The JSON objects of a call list: each wrapped (`<tool_call>{…}</tool_call>`…), a JSON array, or objects
    separated by `;`, `,` or whitespace."""
    decoder, out, i = json.JSONDecoder(), [], 0
    wraps = [w for w in (fmt.open.strip(), fmt.close.strip()) if w]
    while True:
        while i < len(text) and text[i] in " \t\r\n;,":
            i += 1
        if i < len(text) and (wrap := next((w for w in wraps if text.startswith(w, i)), None)):
            i += len(wrap)
            continue
        if i >= len(text):
            return out
        try:
            value, i = decoder.raw_decode(text, i)
        except ValueError:
            return None
        values = value if isinstance(value, list) else [value]
        if not all(isinstance(v, dict) for v in values):
            return None
        out += values


FORMATS = {
    f.name: f
    for f in (
        Format(
            "hermes",
            "arguments",
            "<tool_call>\n",
            "\n</tool_call>",
            "\n",
            markers=("<tool_call>",),
            tokens=("<tool_call>", "</tool_call>"),
        ),
        Format(
            "llama3_json",
            "parameters",
            between="; ",
            at_start=True,
            markers=("<|python_tag|>", "{"),
            strip=("<|python_tag|>",),
            tokens=("<|python_tag|>",),
        ),
        Format(
            "mistral",
            "arguments",
            between=", ",
            lead="[TOOL_CALLS][",
            tail="]",
            markers=("[TOOL_CALLS]",),
            strip=("[TOOL_CALLS]",),
            tokens=("[TOOL_CALLS]",),
        ),
    )
}
DEFAULT_FORMAT = "hermes"  # Qwen's, Hermes', and the default system block's


def format_for(template: str | None, chosen: str | None = None) -> Format:
    """The format `--tool-call-parser` names, else the one the chat template writes (its markers), else Hermes'."""
    if chosen:
        return FORMATS[chosen]
    text = template or ""
    if "[TOOL_CALLS]" in text:
        return FORMATS["mistral"]
    if "<|python_tag|>" in text or "ipython" in text:
        return FORMATS["llama3_json"]
    return FORMATS[DEFAULT_FORMAT]


def system_block(tools: list[Tool], fmt: Format) -> str:
    """What a model whose chat template takes no tools is told (a system message): the tools and how to call them."""
    listing = "\n".join(json.dumps(t.for_template(), ensure_ascii=False) for t in tools)
    example = fmt.render([("function_name", {"argument": "value"})])
    return (
        "You may call one or more functions to help with the user's request. The functions:\n"
        f"{listing}\nTo call functions, answer with each call written as:\n{example}"
    )


Choice = Literal["none", "auto", "required"] | str  # or the name of the one function to call


@dataclass(frozen=True)
class ToolUse:
    """A chat request's tools, its tool_choice, and how the model writes calls."""

    tools: tuple[Tool, ...]
    choice: Choice
    parallel: bool
    fmt: Format

    @property
    def forced(self) -> list[Tool] | None:
        """The tools the reply must call one of (`required`, or the named one); None when the model chooses."""
        if self.choice == "required":
            return list(self.tools)
        if self.choice in ("auto", "none"):
            return None
        return [t for t in self.tools if t.name == self.choice]

    def grammar(self) -> str | None:
        """The grammar of a forced reply: one call to the named function (as vLLM and OpenAI answer a named
        tool_choice), or under `required` one call or several when parallel calls are allowed."""
        forced = self.forced
        return None if forced is None else self.fmt.grammar(forced, self.parallel and self.choice == "required")

    def reader(self) -> CallReader | None:
        """A reader of one choice's text, or None when calls are not read (`tool_choice: "none"`)."""
        if self.choice == "none":
            return None
        forced = self.forced
        name = forced[0].name if forced is not None and len(forced) == 1 else None
        return CallReader(self.fmt, self.parallel, forced is not None, name)


class CallReader:
    """One choice's text as it arrives: content passes through until calls may have begun (text that could be their
    start is held back); from there on the text is kept, and read as calls at the end. A text that turns out to hold
    no well-formed calls is content after all."""

    def __init__(self, fmt: Format, parallel: bool, forced: bool, name: str | None = None):
        self.fmt, self.parallel, self.forced, self.name = fmt, parallel, forced, name
        self.text, self.sent, self.calling = "", 0, forced

    def push(self, piece: str) -> str:
        """Add text; returns the content that is now safe to send."""
        self.text += piece
        if not self.calling:
            begin = self.fmt._begin(self.text)
            if begin is not None:
                self.calling = True
                return self._send(begin)
            return self._send(len(self.text) - self.fmt.could_begin(self.text))
        return ""

    def finish(self, cut: bool = False) -> tuple[str, list[ToolCall]]:
        """The content not yet sent, and the calls (at most one unless parallel calls are allowed). `cut`: the
        reply ran out of tokens, so its last call may be cut short (`Format.parse_cut`)."""
        parsed = self.fmt.parse(self.text) if self.calling else None
        if parsed is None and cut and self.calling:
            parsed = self.fmt.parse_cut(self.text, self.name)
            if parsed is None and self.forced:  # a forced reply's markup is never an answer
                parsed = ("", [])
        if parsed is None:
            return self._send(len(self.text)), []
        content, calls = parsed
        rest = content[self.sent :] if len(content) > self.sent else ""
        self.sent = len(self.text)
        return rest, calls if self.parallel else calls[:1]

    def _send(self, upto: int) -> str:
        out = self.text[self.sent : upto] if upto > self.sent else ""
        self.sent = max(self.sent, upto)
        return out
