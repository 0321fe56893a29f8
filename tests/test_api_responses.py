"""The Responses API (`POST /v1/responses`), stateless, with the openai SDK: the same text as the chat request it
means, streamed as the event sequence the SDK accumulates, `text.format` as structured outputs (`responses.parse`),
function tools and their outputs sent back, `max_output_tokens` as an incomplete response; what needs stored state
is refused by name."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from helpers import HTTP, WEATHER, api, serving
from pydantic import BaseModel, Field

FLAT_TOOL = {"type": "function", "name": "get_weather", "description": "a forecast", "parameters": WEATHER}


@pytest.fixture(scope="module")
def srv(chat_files):
    with serving(chat_files, server=HTTP) as s:
        yield s


def test_a_response_has_the_text_of_the_chat_it_means(srv):
    oa = api(srv)
    r = oa.responses.create(model="tiny", input="hello", instructions="be brief", max_output_tokens=12,
                            temperature=0)  # fmt: skip
    chat = oa.chat.completions.create(model="tiny", max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}])  # fmt: skip
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "tiny"
    assert r.output_text == chat.choices[0].message.content and r.output_text
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    finished = chat.choices[0].finish_reason == "stop"
    assert r.status == ("completed" if finished else "incomplete")
    if not finished:
        assert r.incomplete_details.reason == "max_output_tokens"


def test_streamed_events_add_up_to_the_response(srv):
    oa = api(srv)
    whole = oa.responses.create(model="tiny", input=[{"role": "user", "content": "tell"}], max_output_tokens=30,
                                temperature=0)  # fmt: skip
    events = list(oa.responses.create(model="tiny", input=[{"role": "user", "content": "tell"}],
                                      max_output_tokens=30, temperature=0, stream=True))  # fmt: skip
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]  # fmt: skip
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text
    with oa.responses.stream(model="tiny", input="tell", max_output_tokens=30, temperature=0) as stream:
        final = None if kinds[-1] != "response.completed" else stream.get_final_response()
        if final is not None:
            assert final.output_text == whole.output_text


def test_the_body_sglang_router_sends_is_the_request_it_means(srv):
    """sglang-router re-serializes a Responses body with its own defaults: `stream: null`, SGLang's sampling
    extensions at their neutral values (`top_k: -1` for off) and `store: true`. Without the last, it is the same
    request; with it, a 400 naming `store` (nothing is stored)."""
    url = f"http://127.0.0.1:{srv.server.http_port}/v1/responses"
    asked = {"model": "tiny", "input": "tell", "max_output_tokens": 12, "temperature": 0.0}
    rewritten = asked | {"stream": None, "top_p": 1.0, "priority": 0, "top_k": -1, "min_p": 0.0,
                         "repetition_penalty": 1.0}  # fmt: skip
    want = httpx.post(url, json=asked, timeout=30)
    got = httpx.post(url, json=rewritten, timeout=30)
    assert got.status_code == want.status_code == 200, got.text
    text = lambda r: [part["text"] for item in r.json()["output"] for part in item["content"]]
    assert text(got) == text(want) and got.json()["status"] == want.json()["status"]
    peaked = httpx.post(url, json=asked | {"temperature": 1.0, "min_p": 1.0}, timeout=30)  # only the top token stays
    assert text(peaked) == text(want), "min_p reaches the sampler"
    penalized = httpx.post(url, json=asked | {"repetition_penalty": 2.0}, timeout=30)
    assert text(penalized) != text(want), "repetition_penalty reaches the sampler"
    refused = httpx.post(url, json=rewritten | {"store": True}, timeout=30)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "store", refused.text
    low = httpx.post(url, json=asked | {"top_k": -2}, timeout=30)  # only -1 means off
    assert low.status_code == 400 and low.json()["error"]["param"] == "top_k", low.text


def test_text_format_is_structured_output(srv):
    class Thing(BaseModel):  # bounded: an unbounded integer sampled at temperature 1 can outrun the token budget
        ok: bool
        size: int = Field(ge=1, le=9)

    oa = api(srv)
    for _ in range(3):
        r = oa.responses.parse(model="tiny", input="a thing", text_format=Thing, temperature=1.0, max_output_tokens=80)
        assert isinstance(r.output_parsed, Thing), r.output_text


def test_function_tools_and_their_outputs_sent_back(srv):
    oa = api(srv)
    r = oa.responses.create(model="tiny", input="weather?", tools=[FLAT_TOOL], tool_choice="required",
                            parallel_tool_calls=False, temperature=1.0, max_output_tokens=200)  # fmt: skip
    calls = [item for item in r.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    history = [{"role": "user", "content": "weather?"}, *r.output,
               {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}]  # fmt: skip
    after = oa.responses.create(model="tiny", input=history, tools=[FLAT_TOOL], max_output_tokens=8, temperature=0)
    assert after.status in ("completed", "incomplete")
    streamed = list(oa.responses.create(model="tiny", input="weather?", tools=[FLAT_TOOL], tool_choice="required",
                                        parallel_tool_calls=False, max_output_tokens=200, stream=True))  # fmt: skip
    done = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and streamed[-1].type == "response.completed"
    jsonschema.validate(json.loads(done[0].arguments), WEATHER)


@pytest.mark.parametrize(
    "change, param",
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"store": True}, "store"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
        ({"input": 5}, "input"),
        ({"input": []}, "input"),  # valid as a Responses body, not as the chat it means (no message)
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [FLAT_TOOL | {"name": "bad name"}]}, "tools[0].name"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"colour": "red"}, "colour"),
        ({"input": [{"role": "user", "content": ""}] * 4097}, "input"),  # more messages than the context has tokens
    ],
)
def test_mistakes_are_400s_in_the_responses_words(srv, change, param):
    body = {"model": "tiny", "input": "x"} | change
    r = httpx.post(f"http://127.0.0.1:{srv.server.http_port}/v1/responses", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
