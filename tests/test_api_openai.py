"""The OpenAI-compatible HTTP API: the official `openai` client (and raw httpx where a malformed body is the point)
against real sharp-serve servers on loopback, beside real gRPC clients on the same server and engine.

The chat model is the test suite's tiny model with a tokenizer.json form of its byte tokenizer and a chat template
written into the file's metadata (the way a transformers export carries them; conftest.py's `chat_files`), so chat runs
without a model hub.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
import re
import signal
import ssl
import threading
import time

import httpx
import openai
import pytest
from conftest import CHAT_TEMPLATE
from google.protobuf import json_format
from helpers import (
    BREAKS_PREFILL,
    HTTP,
    Bystander,
    RaisesForMarkedRows,
    SlowEndless,
    _log_softmax,
    _wait_idle,
    api,
    sample_value,
    scrape,
    server,
    serving,
    start_sharp_serve,
)

from sharp.exporter.genai import tokenizer_files
from sharp.models.tokenizer import BYTES, ChatTemplateError, HFTokenizer, render_chat
from sharp.serving import Client
from sharp.serving.client_cli import client_main
from sharp.v1 import generator_pb2 as pb

TEMPLATE = CHAT_TEMPLATE
PROMPT = "def main():\n"


def post(srv, path: str, body, **headers) -> httpx.Response:
    url = f"http://127.0.0.1:{srv.server.http_port}/v1/{path}"
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(url, content=content, headers={"content-type": "application/json", **headers}, timeout=60)


def test_completions_equal_grpc_and_sharp_client_streamed_or_not(model_files, reference, capsys):
    with serving(model_files, server=HTTP) as srv, Client(srv.target) as c:
        grpc_reply = c.generate(PROMPT, max_new_tokens=16, temperature=0)
        ids = BYTES.encode(PROMPT)
        assert list(grpc_reply.token_ids) == reference(ids, 16)
        assert (
            client_main(["--target", srv.target, "generate", PROMPT, "--max-new-tokens", "16", "--temperature", "0"])
            == 0
        )
        assert capsys.readouterr().out == grpc_reply.text + "\n"

        oa = api(srv)
        model = oa.models.list().data[0].id
        assert model == srv.server.engine.spec.name == "tiny"
        r = oa.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0)
        assert r.choices[0].text == grpc_reply.text and r.object == "text_completion"
        assert r.choices[0].finish_reason == "length"
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(grpc_reply.token_ids))
        assert r.usage.total_tokens == len(ids) + 16
        by_ids = oa.completions.create(model=model, prompt=ids, max_tokens=16, temperature=0)
        assert by_ids.choices[0].text == grpc_reply.text

        chunks = list(
            oa.completions.create(
                model=model,
                prompt=PROMPT,
                max_tokens=16,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == grpc_reply.text
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
        assert all(ch.usage is None for ch in chunks[:-1])
        plain = list(oa.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0, stream=True))
        assert all(ch.usage is None and ch.choices for ch in plain)  # no usage chunk unless asked for

        seeded = [
            oa.completions.create(model=model, prompt="x", max_tokens=12, seed=5, extra_body={"top_k": 50}).choices[0]
            for _ in range(2)
        ]
        assert seeded[0].text == seeded[1].text == c.generate("x", max_new_tokens=12, seed=5, top_k=50).text


def test_chat_renders_the_model_template_and_runs_the_rendered_tokens(chat_files, reference):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    with serving(chat_files, server=HTTP) as srv:
        tok = srv.server.engine.tokenizer
        rendered = render_chat(tok, messages)
        assert rendered == "<bos><|system|>be brief\n<|user|>hi\n<|assistant|>"
        ids = tok.encode(rendered, bos=False)
        assert ids == [BYTES.bos, *b"<|system|>be brief\n<|user|>hi\n<|assistant|>"]  # BOS once, special
        with Client(srv.target) as c:
            grpc_reply = c.generate(ids, max_new_tokens=12, temperature=0)
        assert list(grpc_reply.token_ids) == reference(ids, 12)
        expected = grpc_reply.text

        oa = api(srv)
        r = oa.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
        assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
        assert r.choices[0].message.content == expected
        assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 12
        parts = [{"role": "system", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]}]
        as_parts = oa.chat.completions.create(
            model="tiny", messages=parts + messages[1:], max_completion_tokens=12, temperature=0
        )
        assert as_parts.choices[0].message.content == expected

        chunks = list(
            oa.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0, stream=True)
        )
        assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == expected
        assert chunks[-1].choices[0].finish_reason == "length"

        with pytest.raises(openai.BadRequestError) as err:  # the template's own refusal
            oa.chat.completions.create(model="tiny", messages=[{"role": "tool", "content": "x"}])
        assert "cannot open with a tool" in err.value.message


def test_chat_without_a_template_is_refused_with_the_reason(model_files):
    with serving(model_files, server=HTTP) as srv:
        with pytest.raises(openai.BadRequestError) as err:
            api(srv).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
        assert err.value.status_code == 400 and "no chat template" in err.value.message
        assert sample_value(scrape(srv), "sharp_requests", "sharp_requests_total", api="http") == 1


def test_chat_template_travels_in_the_tokenizer_and_from_a_model_directory(tmp_path):
    (tmp_path / "tokenizer.json").write_text(BYTES.tokenizer_json())
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": [{"name": "default", "template": TEMPLATE}]})
    )
    tok = HFTokenizer.from_dir(tmp_path, BYTES.vocab_size, BYTES.bos, [BYTES.eos])
    assert tok.chat_template == TEMPLATE
    again = HFTokenizer.from_dict(tok.to_dict(), tok.json)
    assert tokenizer_files(again)[1]["chat_template"] == TEMPLATE  # --genai packages carry it for onnxruntime-genai
    assert render_chat(again, [{"role": "user", "content": "q"}]) == "<bos><|user|>q\n<|assistant|>"
    (tmp_path / "chat_template.jinja").write_text("{{ eos_token }}{{ messages[0]['content'] }}")  # the newer file wins
    assert (
        render_chat(
            HFTokenizer.from_dir(tmp_path, BYTES.vocab_size, BYTES.bos, [BYTES.eos]), [{"role": "user", "content": "q"}]
        )
        == "<eos>q"
    )
    with pytest.raises(ChatTemplateError, match="no chat template"):
        render_chat(BYTES, [{"role": "user", "content": "q"}])
    sandboxed = dataclasses.replace(tok, chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError, match="template failed"):  # the sandbox refuses what a template must not do
        render_chat(sandboxed, [{"role": "user", "content": "q"}])


def test_entropy_extension_equals_grpc_attention_stats(model_files):
    with serving(model_files, server=HTTP) as srv, Client(srv.target) as c:
        stats = c.generate(PROMPT, max_new_tokens=8, temperature=0, attention_stats=True).attention_stats
        want = json_format.MessageToDict(
            stats, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
        )
        oa = api(srv)
        ask = {"sharp": {"attention_stats": True}}
        r = oa.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, extra_body=ask)
        streams = [
            list(oa.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, stream=True, **kw))
            for kw in ({"extra_body": ask}, {"extra_body": ask, "stream_options": {"include_usage": True}})
        ]
        assert streams[1][-1].usage is not None  # the last chunk is the usage chunk: the statistics come in it
        assert all("sharp" not in (ch.model_extra or {}) for chunks in streams for ch in chunks[:-1])
        last = [chunks[-1].model_extra["sharp"]["attention_stats"] for chunks in streams]
        for got in (r.model_extra["sharp"]["attention_stats"], *last):
            assert (
                (got["norm"], got["positions"])
                == (want["norm"], want["positions"])
                == ("ssa", len(BYTES.encode(PROMPT)) + 7)
            )
            assert len(got["heads"]) == len(want["heads"]) == 4
            for g, w in zip(got["heads"], want["heads"], strict=True):
                assert (g["layer"], g["head"]) == (w["layer"], w["head"])
                assert g["mean_entropy"] == pytest.approx(w["mean_entropy"], abs=1e-6)
                assert g["mean_normalized_entropy"] == pytest.approx(w["mean_normalized_entropy"], abs=1e-6)
        assert "sharp" not in (oa.completions.create(model="tiny", prompt="x", max_tokens=2).model_extra or {})


def test_bearer_token_and_tls_guard_the_http_api_as_they_guard_grpc(model_files):
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    config = HTTP | dict(
        auth_token="s3cret", tls_cert=cert.cert_chain_pems[0].bytes(), tls_key=cert.private_key_pem.bytes()
    )
    with serving(model_files, server=config) as srv:
        trust = ssl.create_default_context(cadata=ca.cert_pem.bytes().decode())
        for token in ("wrong", "s3cre"):
            with pytest.raises(openai.AuthenticationError) as err:
                api(srv, token, "https", http_client=httpx.Client(verify=trust)).models.list()
            assert err.value.status_code == 401 and err.value.response.headers["www-authenticate"] == "Bearer"
        bare = httpx.get(f"https://127.0.0.1:{srv.server.http_port}/v1/models", verify=trust)
        assert bare.status_code == 401 and bare.json()["error"]["type"] == "authentication_error"
        oa = api(srv, "s3cret", "https", http_client=httpx.Client(verify=trust))
        assert oa.completions.create(model="tiny", prompt="x", max_tokens=2).usage.completion_tokens >= 1
        with pytest.raises(httpx.HTTPError):  # plaintext cannot talk to the TLS port
            httpx.get(f"http://127.0.0.1:{srv.server.http_port}/v1/models", headers={"authorization": "Bearer s3cret"})


BAD = [  # body changes, status, what the message says, the param it names, OpenAI's code
    ({"temperature": -1}, 400, ">= 0", "temperature", "invalid_value"),
    ({"temperature": "hot"}, 400, "temperature: must be a valid number", "temperature", "invalid_type"),
    ({"max_tokens": "ten"}, 400, "max_tokens: must be a valid integer", "max_tokens", "invalid_type"),
    ({"max_tokens": True}, 400, "max_tokens", "max_tokens", "invalid_type"),
    ({"max_tokens": 0}, 400, "max_tokens: 0 only with echo", "max_tokens", "unsupported_value"),
    ({"max_tokens": 1001}, 400, "max_tokens must be in [1, 1000]", "max_tokens", "invalid_value"),
    ({"top_p": 1.5}, 400, "[0, 1]", "top_p", "invalid_value"),
    ({"seed": -1}, 400, "seed", "seed", "invalid_type"),
    ({"prompt": [300]}, 400, "prompt [300] outside the vocabulary", "prompt", "invalid_value"),
    ({"prompt": [[1], [2]]}, 400, "one prompt per request", "prompt", "unsupported_value"),
    ({"prompt": {"text": "x"}}, 400, "prompt: must be a string, an array of token ids", "prompt", "invalid_type"),
    ({"prompt": ""}, 400, "empty prompt", "prompt", "invalid_value"),
    ({"prompt": "x" * 3500, "max_tokens": 1000}, 400, "context of 4096", "prompt", "context_length_exceeded"),
    ({"prompt": [1] * 5000}, 400, "exceed the model's context", "prompt", "context_length_exceeded"),
    ({"prompt": ["a", "b"]}, 400, "one prompt per request", "prompt", "unsupported_value"),
    ({"n": 17}, 400, "n must be in [1, 16]", "n", "invalid_value"),
    ({"n": 0}, 400, "n must be in [1, 16]", "n", "invalid_value"),
    ({"n": 3, "best_of": 2}, 400, "best_of must be in [n, 16]", "best_of", "unsupported_value"),
    ({"best_of": 3, "stream": True}, 400, "best_of > n cannot be streamed", "best_of", "unsupported_value"),
    ({"logprobs": 21}, 400, "logprobs must be in [0, 20]", "logprobs", "invalid_value"),
    ({"stop": ["s"] * 17}, 400, "at most 16", "stop", "invalid_value"),
    ({"stop": 3}, 400, "stop: must be a string or an array of strings", "stop", "invalid_type"),
    ({"stream_options": {"include_usage": True}}, 400, "only allowed with stream", "stream_options", None),
    ({"frobnicate": 1}, 400, "frobnicate: unknown field", "frobnicate", "unknown_parameter"),
    ({"sharp": {"attention_stats": "yes"}}, 400, "sharp.attention_stats", "sharp.attention_stats", "invalid_type"),
    ({"store": True}, 400, "store: true is not supported", "store", "unsupported_value"),
    ({"model": "gpt-4"}, 404, "'gpt-4' is not served here", "model", "model_not_found"),
]
CHAT_BAD = [  # chat body changes (messages: system, user), what the message says, the param it names
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                {"type": "input_audio", "text": "b", "input_audio": {}}]}]},
     "'input_audio' content parts are not supported", "messages[0].content[1]"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "'image_url' content parts are not supported", "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": 5}]}, "must be a string or an array of content parts",
     "messages[0].content"),
    ({"messages": [{"role": "user", "content": "hi", "colour": "red"}]}, "unknown field", "messages[0].colour"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "must be 'system', 'developer'", "messages[0].role"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]},
     "required", "messages[0].tool_calls[0].function"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [{"id": "1", "function": {"name": "f",
      "arguments": "{}"}}]}]}, "tool_calls belong to assistant messages", "messages[0].tool_calls"),
    ({"response_format": {"type": "json_schema"}}, "needs json_schema.schema", "response_format"),
    ({"tools": [{"type": "retrieval"}]}, "must be 'function'", "tools[0].type"),
    ({"tool_choice": "required"}, "tool_choice 'required' or a named function needs tools", "tool_choice"),
    ({"tool_choice": "always"}, "must be 'none', 'auto', 'required' or", "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions and function_call are deprecated", "functions"),
    ({"top_logprobs": 3}, "top_logprobs needs logprobs: true", "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 30}, "top_logprobs must be in [0, 20]", "top_logprobs"),
    ({"max_completion_tokens": 2000}, "max_completion_tokens must be in [1, 1000]", "max_completion_tokens"),
    ({"max_tokens": 2000}, "max_tokens must be in [1, 1000]", "max_tokens"),
    ({"messages": [{"role": "user", "content": "x" * 3500}], "max_tokens": 1000}, "context of 4096", "messages"),
]  # fmt: skip


def test_bad_requests_get_their_status_in_openai_shape_and_the_server_stays_healthy(model_files):
    with serving(model_files, server=HTTP, max_new_tokens_limit=1000) as srv:
        for change, status, says, param, code in BAD:
            for stream in (False,) if "stream_options" in change else (False, True):
                r = post(srv, "completions", {"model": "tiny", "prompt": "ok", "stream": stream} | change)
                assert r.status_code == status, (change, r.text)
                error = r.json()["error"]
                assert says in error["message"], (change, error)
                assert error["type"] == "invalid_request_error" and set(error) == {"message", "type", "param", "code"}
                assert (error["param"], error["code"]) == (param, code or error["code"]), (change, error)
                assert not re.search(r"\.str\b|list\[|function-|constrained", error["message"]), error
        for body, status in ((b"{not json", 400), (b'{"model": "tiny"}', 400), (b"x" * (8 << 20), 413)):
            r = post(srv, "completions", body)
            assert r.status_code == status and "error" in r.json(), r.text
        assert post(srv, "completions", {"model": "tiny"}).json()["error"]["message"] == "prompt: required"
        assert post(srv, "embeddings", {}).status_code == 404
        assert httpx.get(f"http://127.0.0.1:{srv.server.http_port}/v1/completions").status_code == 405
        with pytest.raises(openai.BadRequestError):  # the client's own exception classes work on our answers
            api(srv).completions.create(model="tiny", prompt="x", temperature=-1)
        assert api(srv).completions.create(model="tiny", prompt="fine", max_tokens=3).usage.completion_tokens >= 1
        m = scrape(srv)
        count = lambda status: sample_value(m, "sharp_requests", "sharp_requests_total", api="http", status=status)
        assert count("not_found") == 2 and count("out_of_range") == 4 and count("ok") == 1
        # each twice but stream_options; three malformed bodies; the client's own
        assert count("invalid_argument") == 2 * (len(BAD) - 3) - 1 + 3 + 1
        assert sample_value(m, "sharp_requests", "sharp_requests_total", api="grpc") == 0


def test_chat_refuses_what_changes_the_output_naming_the_field(chat_files):
    base = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    with serving(chat_files, server=HTTP, max_new_tokens_limit=1000) as srv:
        for change, says, param in CHAT_BAD:
            r = post(srv, "chat/completions", base | change)
            assert r.status_code == 400, (change, r.text)
            error = r.json()["error"]
            assert says in error["message"] and error["param"] == param, (change, error)


def test_fields_clients_send_at_their_neutral_values_are_accepted(chat_files):
    """What the SDK's objects, LangChain and agent frameworks send back, and standard fields at values that change
    nothing, give the same text as the bare request."""
    messages = [
        {"role": "system", "content": "be brief", "name": "rules"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo", "refusal": None, "annotations": [], "audio": None,
         "function_call": None, "tool_calls": []},
        {"role": "user", "content": [{"type": "text", "text": "and?"}]},
    ]  # fmt: skip
    neutral = {
        "response_format": {"type": "text"}, "tool_choice": "none", "tools": [], "parallel_tool_calls": True,
        "store": False, "metadata": {"k": "v"}, "logprobs": False, "top_logprobs": 0, "service_tier": "auto",
        "user": "u", "safety_identifier": "s", "prompt_cache_key": "p", "modalities": ["text"], "n": 1,
        "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": {}, "stream_options": None,
    }  # fmt: skip
    with serving(chat_files, server=HTTP) as srv:
        bare = {"model": "tiny", "messages": messages, "max_tokens": 6, "temperature": 0}
        want = post(srv, "chat/completions", bare).json()["choices"][0]["message"]["content"]
        r = post(srv, "chat/completions", bare | neutral)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == want
        for top_p in (0, 0.0):  # OpenAI's range is [0, 1]: 0 keeps the most likely token only (greedy)
            hot = bare | {"temperature": 1.5, "top_p": top_p, "seed": 3}
            assert post(srv, "chat/completions", hot).json()["choices"][0]["message"]["content"] == want
        ok = post(srv, "completions", {"model": "tiny", "prompt": "x", "max_tokens": 2, "best_of": 1, "suffix": ""})
        assert ok.status_code == 200, ok.text


class SlowSteps(SlowEndless):
    """SlowEndless, and each decode step takes 5 ms more: a 1,500-token stream outlasts a 1 s drain deadline however
    fast the machine (the engine alone runs this model's steps in well under a millisecond)."""

    def forward(self, input_ids, *args, **kw):
        if input_ids.shape[1] == 1:
            time.sleep(0.005)
        return super().forward(input_ids, *args, **kw)


def test_kv_budget_queue_and_drain_get_413_429_and_503(model_files):
    engine = dict(max_batch=1, max_queue=1, kv_cache_mb=1.5)
    with server(model_files, SlowSteps, engine=engine, drain_timeout=1.0, **HTTP) as srv:
        oa = api(srv)
        with pytest.raises(openai.APIStatusError) as err:
            oa.completions.create(model="tiny", prompt="x" * 3000, max_tokens=1000)
        assert err.value.status_code == 413 and "KV cache" in err.value.message
        running = oa.completions.create(model="tiny", prompt="long", max_tokens=1500, stream=True)
        next(iter(running))
        queued = cf.ThreadPoolExecutor(1).submit(oa.completions.create, model="tiny", prompt="queued", max_tokens=2)
        while sample_value(scrape(srv), "sharp_queue_size", "sharp_queue_size") < 1:
            time.sleep(0.01)
        with pytest.raises(openai.RateLimitError) as err:
            oa.completions.create(model="tiny", prompt="one too many", max_tokens=2)
        assert err.value.status_code == 429 and "queue full" in err.value.message
        assert err.value.response.headers["retry-after"] == "1"
        drain = threading.Thread(target=srv.drain)
        drain.start()
        while not srv.server.engine.draining:
            time.sleep(0.01)
        for call in (oa.models.list, lambda: oa.completions.create(model="tiny", prompt="late", max_tokens=2)):
            with pytest.raises(openai.APIStatusError) as err:
                call()
            assert err.value.status_code == 503 and "draining" in err.value.message
        with pytest.raises(openai.APIError, match="drain deadline"):  # a stream the deadline ends says why
            list(running)
        with pytest.raises(openai.APIStatusError) as err:  # the queued one never got a token: a status, not a stream
            queued.result(timeout=30)
        assert err.value.status_code == 503
        drain.join(timeout=30)


def _wait_until_cancelled(srv, cancelled: int) -> dict:
    """The metrics once `cancelled` HTTP requests were counted cancelled and nothing runs (a gauge read mid-step
    can still say a cancelled request's prefill had not begun, so the count is what is waited for)."""
    deadline = time.time() + 30
    while time.time() < deadline:
        m = scrape(srv)
        done = sample_value(m, "sharp_requests", "sharp_requests_total", api="http", status="cancelled") >= cancelled
        if done and sample_value(m, "sharp_running_requests", "sharp_running_requests") == 0:
            break
        time.sleep(0.02)
    assert sample_value(m, "sharp_requests", "sharp_requests_total", api="http", status="cancelled") == cancelled
    assert sample_value(m, "sharp_running_requests", "sharp_running_requests") == 0
    assert sample_value(m, "sharp_kv_cache_usage_ratio", "sharp_kv_cache_usage_ratio") == 0
    return m


def test_a_client_that_disconnects_mid_stream_or_mid_wait_frees_its_slot_and_cache(model_files):
    # SlowSteps: 3,000 tokens take 15 s or more, so the 1 s client deadline expires however fast the machine
    # (with SlowEndless alone a quick machine finished the whole answer inside it)
    with server(model_files, SlowSteps, **HTTP) as srv:
        stream = api(srv).completions.create(model="tiny", prompt="endless", max_tokens=3000, stream=True)
        chunks = iter(stream)
        next(chunks), next(chunks)
        assert sample_value(scrape(srv), "sharp_running_requests", "sharp_running_requests") == 1
        stream.close()
        _wait_until_cancelled(srv, 1)
        with pytest.raises(openai.APITimeoutError):  # a whole-answer request whose client gives up waiting
            api(srv).with_options(timeout=1.0).completions.create(model="tiny", prompt="endless", max_tokens=3000)
        m = _wait_until_cancelled(srv, 2)
        assert sample_value(m, "sharp_requests", "sharp_requests_total", api="http", status="ok") == 0
        assert srv.server.calls.inflight == 0 and srv.server.engine.idle()


def test_model_failure_is_a_500_for_that_request_only(model_files, reference):
    with server(model_files, RaisesForMarkedRows, **HTTP) as srv, Bystander(srv.target, "bystander", 40) as b:
        oa = api(srv)
        for stream in (False, True):
            with pytest.raises(openai.InternalServerError) as err:
                oa.completions.create(model="tiny", prompt=[7, BREAKS_PREFILL, 9], max_tokens=4, stream=stream)
            assert err.value.status_code == 500 and "the model failed on this request" in err.value.message
        assert oa.completions.create(model="tiny", prompt="after", max_tokens=3).usage.completion_tokens >= 1
        b.check(reference)
        m = scrape(srv)
        assert sample_value(m, "sharp_requests", "sharp_requests_total", api="http", status="internal") == 2


def test_http_and_grpc_streams_interleave_in_one_batch_and_metrics_add_up(model_files, reference):
    prompts = [f"row {i}: " + "y" * i for i in range(8)]
    with serving(model_files, server=HTTP, max_batch=8) as srv, Client(srv.target) as c:
        oa = api(srv)

        def over_http(p):
            chunks = list(
                oa.completions.create(
                    model="tiny",
                    prompt=p,
                    max_tokens=24,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
            n = chunks[-1].usage.completion_tokens
            assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == ("length" if n == 24 else "stop")
            return "".join(ch.choices[0].text for ch in chunks if ch.choices), n

        def over_grpc(p):
            chunks = list(c.generate_stream(p, max_new_tokens=24, temperature=0))
            return "".join(ch.text for ch in chunks), chunks[-1].usage.completion_tokens

        with cf.ThreadPoolExecutor(8) as ex:
            futures = [ex.submit(over_grpc if i % 2 else over_http, p) for i, p in enumerate(prompts)]
            results = [f.result(timeout=120) for f in futures]
        tokens = {"http": 0, "grpc": 0}
        for i, (p, (text, n)) in enumerate(zip(prompts, results, strict=True)):
            want = reference(BYTES.encode(p), 24)
            assert text == BYTES.decode(want) and n == len(want)
            tokens["grpc" if i % 2 else "http"] += n
        assert any(n < 24 for _, n in results[::2]), "an HTTP row should end by EOS (its finish_reason is checked)"
        m = scrape(srv)
        steps = sample_value(m, "sharp_batch_size", "sharp_batch_size_count")
        assert sample_value(m, "sharp_batch_size", "sharp_batch_size_sum") / steps > 1
        for api_name in ("http", "grpc"):
            assert sample_value(m, "sharp_requests", "sharp_requests_total", api=api_name, status="ok") == 4
            assert (
                sample_value(m, "sharp_generation_tokens", "sharp_generation_tokens_total", api=api_name)
                == tokens[api_name]
            )
            prompt_tokens = sum(
                len(BYTES.encode(p)) for i, p in enumerate(prompts) if (i % 2 == 0) == (api_name == "http")
            )
            prefilled = sample_value(m, "sharp_prompt_tokens", "sharp_prompt_tokens_total", api=api_name)
            cached = sample_value(m, "sharp_prefix_cache_hits", "sharp_prefix_cache_hits_total", api=api_name)
            assert (
                prefilled + cached
                == prompt_tokens
                == sample_value(m, "sharp_prefix_cache_queries", "sharp_prefix_cache_queries_total", api=api_name)
            )
            assert (
                sample_value(
                    m, "sharp_time_to_first_token_seconds", "sharp_time_to_first_token_seconds_count", api=api_name
                )
                == 4
            )
        assert sample_value(m, "sharp_requests", "sharp_requests_total") == 8


def test_sharp_serve_sigterm_drains_http_and_grpc_together(model_files):
    proc, line = start_sharp_serve(model_files["onnxruntime"], "--http-port", "0")
    try:
        port = re.search(r" on 127\.0\.0\.1:(\d+)", line).group(1)
        http = re.search(r"OpenAI API http://127\.0\.0\.1:(\d+)/v1", line).group(1)
        oa = openai.OpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key="none", max_retries=0)
        with Client(f"127.0.0.1:{port}") as c:
            grpc_stream = c.generate_stream("sigterm", max_new_tokens=400, temperature=0)
            http_stream = iter(
                oa.completions.create(model="tiny", prompt="sigterm", max_tokens=400, temperature=0, stream=True)
            )
            next(grpc_stream), next(http_stream)
            proc.send_signal(signal.SIGTERM)
            grpc_rest, http_rest = list(grpc_stream), list(http_stream)
            assert grpc_rest[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED
            assert http_rest[-1].choices[0].finish_reason in ("stop", "length")
        assert proc.wait(timeout=30) == 0
        with pytest.raises(openai.APIConnectionError):  # both ports are closed
            oa.models.list()
    finally:
        proc.kill()


def test_logprobs_and_echo_equal_the_models_own_log_softmax(model_files):
    """Completions echo and score the prompt (in chunks: prefill_chunk 16 < the prompt), report generated tokens'
    log-probabilities and top alternatives, streamed or not, and gRPC carries the same numbers."""
    from sharp.models import load

    model = load(model_files["torch"])
    prompt = "def main():\n    return sorted(x for x in range(10))\n"
    ids = BYTES.encode(prompt)
    with serving(model_files, server=HTTP, prefill_chunk=16) as srv:
        oa = api(srv)
        scored = oa.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=3)
        choice = scored.choices[0]
        assert choice.text == prompt and scored.usage.completion_tokens == 0 and choice.finish_reason == "length"
        ref = _log_softmax(model, ids)
        lp = choice.logprobs
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and len(lp.tokens) == len(ids)
        want = [ref[i - 1, ids[i]].item() for i in range(1, len(ids))]
        assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
        for i in range(1, len(ids)):
            top = ref[i - 1].topk(3)
            got = lp.top_logprobs[i]
            assert list(got.values()) == pytest.approx(top.values.tolist(), abs=1e-4)
            assert list(got) == [_token_string(t) for t in top.indices.tolist()]
        assert lp.tokens == [_token_string(t) for t in ids] and lp.tokens[1] == "d"
        assert [prompt[o : o + 1] for o in lp.text_offset[1:]] == list(prompt) and lp.text_offset[0] == 0
        assert srv.server.engine.idle() and srv.server.engine.backend.kv_usage() == 0  # nothing held after scoring

        made = oa.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0, logprobs=2)
        gen = made.choices[0].logprobs
        new = BYTES.encode(prompt) + [c for t in gen.tokens for c in _token_bytes(t)]
        full = _log_softmax(model, new)
        assert len(gen.tokens) == 8 and gen.text_offset[0] == 0
        assert gen.token_logprobs == pytest.approx([full[len(ids) - 1 + i, new[len(ids) + i]].item() for i in range(8)],
                                                   abs=1e-4)  # fmt: skip
        assert all(max(top.values()) == tok for tok, top in zip(gen.token_logprobs, gen.top_logprobs, strict=True))
        busy = iter(oa.completions.create(model="tiny", prompt="x", max_tokens=300, temperature=0, stream=True))
        next(busy)  # a row that asks for nothing shares the decode steps (and is the batch's first row)
        beside = oa.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0, logprobs=2)
        busy.close()
        _wait_idle(srv)  # the closed stream's row leaves the batch: the requests below decode alone, as `made` did
        assert beside.choices[0].logprobs.token_logprobs == pytest.approx(gen.token_logprobs, abs=1e-5)
        assert beside.choices[0].logprobs.top_logprobs == gen.top_logprobs or all(
            list(a) == list(b) for a, b in zip(beside.choices[0].logprobs.top_logprobs, gen.top_logprobs, strict=True)
        )
        chunks = list(oa.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0, logprobs=2,
                                            echo=True, stream=True))  # fmt: skip
        streamed = [
            t for ch in chunks for t in (ch.choices[0].logprobs.token_logprobs if ch.choices[0].logprobs else [])
        ]
        assert streamed == [None, *lp.token_logprobs[1:], *gen.token_logprobs]
        assert "".join(ch.choices[0].text for ch in chunks) == prompt + made.choices[0].text

        echoed = oa.completions.create(model="tiny", prompt=ids, max_tokens=2, temperature=0, echo=True)
        assert echoed.choices[0].text.startswith(prompt) and echoed.choices[0].logprobs is None

        with Client(srv.target) as c:
            stub_reply = c.stub.Generate(pb.GenerateRequest(input_ids=ids, max_new_tokens=0, prompt_logprobs=1))
        assert [x.logprob for x in stub_reply.prompt_logprobs] == pytest.approx(want, abs=1e-4)
        assert [x.token_id for x in stub_reply.prompt_logprobs] == ids[1:] and not stub_reply.token_ids
        assert [x.top[0].token_id for x in stub_reply.prompt_logprobs] == ref[:-1].argmax(-1).tolist()


def test_chat_logprobs_in_openais_shape_with_exact_bytes(chat_files, reference):
    messages = [{"role": "user", "content": "hi"}]
    with serving(chat_files, server=HTTP, prefix_cache_mb=0) as srv:  # both prefilled alike: equal to the bit
        oa = api(srv)
        r = oa.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=2)  # fmt: skip
        content = r.choices[0].logprobs.content
        ids = srv.server.engine.tokenizer.encode(render_chat(srv.server.engine.tokenizer, messages), bos=False)
        made = reference(ids, 6)
        assert [bytes(c.bytes) for c in content] == [bytes([t]) for t in made]
        assert all(c.top_logprobs[0].logprob == c.logprob and len(c.top_logprobs) == 2 for c in content)
        assert b"".join(bytes(c.bytes) for c in content).decode("utf-8", "replace") == r.choices[0].message.content
        chunks = list(oa.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                                 logprobs=True, stream=True))  # fmt: skip
        streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
        assert [c.logprob for c in streamed] == [c.logprob for c in content]
        assert all(c.top_logprobs == [] for c in streamed)
        plain = oa.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
        assert plain.choices[0].logprobs is None


def _token_string(token: int) -> str:
    raw = BYTES.token_bytes(token)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def _token_bytes(text: str) -> bytes:
    if text.startswith("bytes:"):
        return bytes(int(text[i + 2 : i + 4], 16) for i in range(6, len(text), 4))
    return text.encode()


def test_routes_clients_and_probes_call(chat_files):
    """GET /v1/models/{id} (the SDK's models.retrieve), /health and /metrics beside the API (open without the
    token, as on their own ports), vLLM's /tokenize, /detokenize and /tokenizer_info (lm-eval's remote tokenizer)."""
    with serving(chat_files, server=HTTP | {"auth_token": "s3cret"}) as srv:
        base = f"http://127.0.0.1:{srv.server.http_port}"
        oa = api(srv, "s3cret")
        model = oa.models.retrieve("tiny")
        assert model.id == "tiny" and model.object == "model"
        with pytest.raises(openai.NotFoundError):
            oa.models.retrieve("gpt-4")
        assert httpx.get(f"{base}/health").status_code == 200
        metrics = httpx.get(f"{base}/metrics")
        assert metrics.status_code == 200 and "sharp_requests_total" in metrics.text
        assert re.search(r"^sharp_queue_capacity(\{[^}]*\})? 256\.0$", metrics.text, re.M)
        auth = {"authorization": "Bearer s3cret"}
        assert httpx.post(f"{base}/tokenize", json={"prompt": "hi"}).status_code == 401
        tok = httpx.post(f"{base}/tokenize", json={"prompt": "hi<eos>", "add_special_tokens": False}, headers=auth)
        assert tok.json() == {"count": 3, "max_model_len": 4096, "tokens": [ord("h"), ord("i"), BYTES.eos]}
        with_bos = httpx.post(f"{base}/tokenize", json={"prompt": "hi"}, headers=auth).json()["tokens"]
        assert with_bos == [BYTES.bos, ord("h"), ord("i")]
        assert httpx.post(f"{base}/detokenize", json={"tokens": with_bos}, headers=auth).json() == {"prompt": "hi"}
        bad = httpx.post(f"{base}/detokenize", json={"tokens": [9999]}, headers=auth)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
        info = httpx.get(f"{base}/tokenizer_info", headers=auth).json()
        assert (info["eos_token"], info["bos_token"], info["chat_template"]) == ("<eos>", "<bos>", TEMPLATE)
        srv.server.engine.draining = True
        assert httpx.get(f"{base}/health").status_code == 503
        srv.server.engine.draining = False
        assert httpx.get(f"{base}/health").status_code == 200


def test_a_token_the_model_rules_out_is_reported_at_the_floor_in_valid_json():
    from sharp.serving.api.replies import LOGPROB_FLOOR, Logprobs
    from sharp.serving.engine.output import TokenLogprob

    ruled_out = TokenLogprob(ord("a"), float("-inf"), [(ord("b"), 0.0), (ord("c"), float("-inf"))])
    shapes = Logprobs(BYTES)
    for got in (shapes.completion([ord("a")], [ruled_out]), shapes.chat([ruled_out])):
        text = json.dumps(got, allow_nan=False)  # raises on -inf: JSON has no infinities
        assert str(LOGPROB_FLOOR) in text and "Infinity" not in text


def test_each_request_leaves_one_access_line_with_its_numbers_and_never_its_text(model_files, caplog):
    """One INFO line per request on logger sharp.access, as vLLM and llama-server log: id, API, status, prompt,
    completion and cached tokens, TTFT and total time — for a success, a refusal and a cancel, on both APIs."""
    secret = "do not log me"
    with serving(model_files, server=HTTP) as srv, Client(srv.target) as c, caplog.at_level("INFO", "sharp.access"):
        c.generate(secret, max_new_tokens=5, temperature=0, request_id="grpc-ok")
        post(srv, "completions", {"model": "tiny", "prompt": secret, "max_tokens": 3}, **{"X-Request-Id": "http-ok"})
        post(srv, "completions", {"model": "tiny", "prompt": secret, "max_tokens": -1})
        _wait_idle(srv)
    lines = [r.getMessage() for r in caplog.records if r.name == "sharp.access"]
    assert len(lines) == 3 and not any(secret in line for line in lines), lines
    ok = {line.split()[0]: line for line in lines if " ok " in line}
    prompt = len(BYTES.encode(secret))
    assert re.fullmatch(rf"grpc-ok grpc ok prompt_tokens={prompt} completion_tokens=5 cached_tokens=\d+"
                        r" ttft=[\d.]+ms total=[\d.]+ms", ok["grpc-ok"])  # fmt: skip
    assert f"http-ok http ok prompt_tokens={prompt} completion_tokens=3" in ok["http-ok"]
    assert any(line.startswith("- http invalid_argument") for line in lines)
