"""The HTTP API's refusals and failures in OpenAI's error shape: the one table from a `Status` to an HTTP status, the
request fields' names in a refusal (a pydantic error's location as the JSON path the client sent), and the one
model check."""

from __future__ import annotations

import typing
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ValidationError

from sharp.serving.api.openai_bodies import ChatRequest, CompletionRequest
from sharp.serving.api.responses_api import ResponsesRequest
from sharp.serving.requests import RequestError
from sharp.serving.status import Status

ERROR_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
    504: "timeout",
}


HTTP_STATUS = {  # docs/serving.md has the table
    Status.INVALID_ARGUMENT: 400,
    Status.OUT_OF_RANGE: 400,
    Status.RESOURCE_EXHAUSTED: 413,
    Status.UNAVAILABLE: 503,
    Status.INTERNAL: 500,
}


def http_status(code: Status, transient: bool = False) -> int:
    """The HTTP status of a refusal or failure: a full queue passes (429); a request larger than the KV budget
    never fits (413)."""
    return 429 if code is Status.RESOURCE_EXHAUSTED and transient else HTTP_STATUS[code]


class APIError(Exception):
    """A refusal or failure, answered in OpenAI's error shape."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        param: str | None = None,
        outcome: str = "invalid_argument",
    ):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.outcome = outcome  # the Status it is counted under (sharp_requests_total's status label)

    @classmethod
    def of(cls, code: Status, message: str) -> APIError:
        """A failure's Status as OpenAI's error: its HTTP status, the status's name as the code."""
        return cls(http_status(code), message, code.value, None, code.value)

    @classmethod
    def refused(cls, e: RequestError) -> APIError:
        """The one validation's refusal as OpenAI's error: its HTTP status, its field as the param, its reason (or
        the status's name) as the code."""
        return cls(http_status(e.code, e.transient), e.message, e.reason or e.code.value, e.field, e.code.value)

    def body(self) -> dict[str, Any]:
        kind = ERROR_TYPE.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else {}
        if self.status in (429, 503):
            headers["Retry-After"] = "1"
        return web.json_response(self.body(), status=self.status, headers=headers)


def not_served(model: str) -> APIError:
    """The refusal of a request for a model this server does not serve."""
    return APIError(404, f"model {model!r} is not served here; GET /v1/models lists it", "model_not_found", "model",
                    "not_found")  # fmt: skip


STRUCTURED_NAMES = {k: f"structured_outputs.{k}" for k in ("regex", "choice", "grammar")}
COMPLETION_NAMES = {"max_new_tokens": "max_tokens", "input_ids": "prompt", "prompt_logprobs": "logprobs",
                    "json_schema": "structured_outputs.json"} | STRUCTURED_NAMES  # fmt: skip
CHAT_NAMES = {"prompt": "messages", "input_ids": "messages", "logprobs": "top_logprobs",
              "json_schema": "response_format"} | STRUCTURED_NAMES  # fmt: skip
JSON_DEPTH = 200  # levels of arrays and objects inside a body that its parser (pydantic-core) reads
UNION_HINTS = {  # what a field of several shapes takes, for a value that fits none of them
    "prompt": "a string, an array of token ids, or an array of one string or one token-id array",
    "input": "a string or an array of input items",
    "content": "a string or an array of content parts",
    "stop": "a string or an array of strings",
    "tool_choice": '\'none\', \'auto\', \'required\' or {"type": "function", "function": {"name": …}}',
    "function_call": "a string or an object",
}


def _field_names(*models: type[BaseModel]) -> frozenset[str]:
    names, todo = set(), list(models)
    while todo:
        model = todo.pop()
        for name, info in model.model_fields.items():
            names.add(name)
            kinds, seen = [info.annotation], []
            while kinds:  # the annotation, its union's members, their items
                kind = kinds.pop()
                seen.append(kind)
                kinds += typing.get_args(kind)
            todo += [t for t in seen if isinstance(t, type) and issubclass(t, BaseModel)]
    return frozenset(names)


FIELDS = _field_names(CompletionRequest, ChatRequest, ResponsesRequest)


def validation_refusal(e: ValidationError) -> APIError:
    """The first problem pydantic found, in the request's own words: a JSON path (`messages[1].content`), never
    the validator's union branches or internals."""
    first = e.errors(include_url=False)[0]
    where, union, loc = "", False, first["loc"]
    unknown = first["type"] == "extra_forbidden"  # the last item is the unknown field's own name
    for i, part in enumerate(loc):
        if unknown and i == len(loc) - 1:
            where += f".{part}" if where else str(part)
            continue
        if isinstance(part, int):
            where += f"[{part}]"
        elif part in FIELDS and not (union and part in ("str", "int")):
            where += f".{part}" if where else part
        else:
            union = True  # a branch of a union (str, list[int], function-after[…], …)
    where = where or "body"
    last = where.rsplit(".", 1)[-1].split("[")[0]
    if unknown:
        return APIError(400, f"{where}: unknown field", "unknown_parameter", where)
    if first["type"] == "json_invalid":
        if "recursion limit" in str(first.get("ctx", {}).get("error", "")):
            deep = f"the body nests arrays and objects more than {JSON_DEPTH} levels deep, the parser's limit"
            return APIError(400, deep, "nesting_too_deep")
        return APIError(400, "the body is not valid JSON", "invalid_json", None)
    if union and last in UNION_HINTS:
        return APIError(400, f"{where}: must be {UNION_HINTS[last]}", "invalid_type", where)
    why = first["msg"].replace("Input should be", "must be").replace("Field required", "required")
    code = "missing_required_parameter" if first["type"] == "missing" else "invalid_type"
    return APIError(400, f"{where}: {why}", code, where)
