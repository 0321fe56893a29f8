"""The request fields vLLM's and SGLang's clients send (and the routers in front of replicas add to every
request), honoured end to end: ignore_eos, min_tokens, stop_token_ids, skip_special_tokens, the stop kept in the
text (include_stop_str_in_output / no_stop_trim), continue_final_message, priority; and the load a replica reports
to routers and the inference gateway (GET /get_load, /metrics/load, the vllm: names)."""

from __future__ import annotations

import time

import grpc
import httpx
import pytest
from helpers import HTTP, EosEveryFourth, SlowEndless, server, serving
from prometheus_client.parser import text_string_to_metric_families

from sharp.models.tokenizer import BYTES
from sharp.serving import Client
from sharp.v1 import generator_pb2 as pb

EOS = BYTES.eos


def post(srv, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{srv.server.http_port}{path}", json=body, timeout=60)


def test_ignore_eos_min_tokens_and_special_tokens(model_files):
    """With an EOS the model picks at every fourth position: a request ends there; ignore_eos goes on to its
    length (EOS spelled `<eos>` only when skip_special_tokens is false); min_tokens keeps EOS out until then."""
    with server(model_files, wrap=EosEveryFourth, **HTTP) as srv, Client(srv.target) as c:
        plain = c.generate("abc", max_new_tokens=12, temperature=0)  # BOS + 3: the second token is at position 5
        assert plain.finish_reason == pb.FINISH_REASON_EOS and list(plain.token_ids)[1:] == [EOS]
        assert plain.text == BYTES.decode(list(plain.token_ids)[:1])  # the ending token has no text
        on = c.generate("abc", max_new_tokens=12, temperature=0, ignore_eos=True)
        assert on.finish_reason == pb.FINISH_REASON_LENGTH and list(on.token_ids).count(EOS) == 3
        assert list(on.token_ids)[:2] == list(plain.token_ids) and "<eos>" not in on.text
        spelled = c.generate("abc", max_new_tokens=12, temperature=0, ignore_eos=True, skip_special_tokens=False)
        assert spelled.text.count("<eos>") == 3 and spelled.token_ids == on.token_ids
        late = c.generate("abc", max_new_tokens=12, temperature=0, min_tokens=6)
        ids = list(late.token_ids)
        assert EOS not in ids[:6] and ids[-1] == EOS and late.finish_reason == pb.FINISH_REASON_EOS
        # token k comes from the decode step fed position k + 2: EOS leads at k = 2, 6, 10; 2 and 6 are masked
        assert ids[0] == plain.token_ids[0] and len(ids) == 10
        http = post(srv, "/v1/completions", {"model": "tiny", "prompt": "abc", "max_tokens": 12, "temperature": 0,
                                             "ignore_eos": True, "skip_special_tokens": False})  # fmt: skip
        assert http.json()["choices"][0]["text"] == spelled.text
        bad = post(srv, "/v1/completions", {"model": "tiny", "prompt": "abc", "max_tokens": 4, "min_tokens": 5})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "min_tokens"


def test_stop_token_ids_and_keeping_what_stopped_the_request(model_files, reference):
    with serving(model_files, server=HTTP) as srv, Client(srv.target) as c:
        ref = reference(BYTES.encode("abc"), 20)  # the model's greedy reply
        stop = ref[4]
        assert stop not in ref[:4]
        r = c.generate("abc", max_new_tokens=20, temperature=0, stop_token_ids=[stop])
        assert list(r.token_ids) == ref[:5] and r.finish_reason == pb.FINISH_REASON_STOP
        assert r.text == BYTES.decode(ref[:4])
        kept = c.generate("abc", max_new_tokens=20, temperature=0, stop_token_ids=[stop], include_stop=True)
        assert kept.text == BYTES.decode(ref[:5])
        masked = c.generate("abc", max_new_tokens=8, temperature=0, stop_token_ids=[stop], min_tokens=6)
        assert list(masked.token_ids)[:4] == ref[:4] and stop not in list(masked.token_ids)[:6]
        bad = post(srv, "/v1/completions", {"model": "tiny", "prompt": "abc", "stop_token_ids": [300]})
        assert bad.status_code == 400 and "stop_token_ids" in bad.json()["error"]["message"]

        ref = reference(BYTES.encode("a"), 8)  # "LU" then other bytes
        text = BYTES.decode(ref[:2])
        body = {"model": "tiny", "prompt": "a", "max_tokens": 8, "temperature": 0, "stop": text[1]}
        assert post(srv, "/v1/completions", body).json()["choices"][0]["text"] == text[0]
        for keep in ({"include_stop_str_in_output": True}, {"no_stop_trim": True}):
            choice = post(srv, "/v1/completions", body | keep).json()["choices"][0]
            assert choice["text"] == text and choice["finish_reason"] == "stop"
        late = post(srv, "/v1/completions", body | {"min_tokens": 3}).json()["choices"][0]
        assert ref[3] == ref[1]  # "U" comes again as the fourth token: the first stop (token 2) is before min_tokens
        assert late["text"] == BYTES.decode(ref[:3]) and late["finish_reason"] == "stop"


def test_chat_template_switches_and_what_is_refused(chat_files):
    with serving(chat_files, server=HTTP) as srv:
        messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "He"}]
        body = {"model": "tiny", "messages": messages, "continue_final_message": True, "add_generation_prompt": False}
        ids = post(srv, "/v1/chat/completions/render", body).json()["token_ids"]
        assert BYTES.decode(ids) == "<|user|>hi\n<|assistant|>He"  # left open: the model continues "He"
        reply = post(srv, "/v1/chat/completions", body | {"max_tokens": 3, "temperature": 0}).json()
        assert reply["usage"]["prompt_tokens"] == len(ids)
        refused = post(srv, "/v1/chat/completions", body | {"add_generation_prompt": True})
        assert refused.status_code == 400 and "continue_final_message" in refused.json()["error"]["message"]
        reasoning = {"separate_reasoning": False, "stream_reasoning": False, "include_reasoning": False}
        plain = {"model": "tiny", "messages": messages[:1], "max_tokens": 4, "temperature": 0}
        want = post(srv, "/v1/chat/completions", plain).json()["choices"][0]["message"]["content"]
        got = post(srv, "/v1/chat/completions", plain | reasoning | {"priority": 3}).json()
        assert got["choices"][0]["message"]["content"] == want  # no reasoning parser: all text is content
        first = post(srv, "/v1/chat/completions", plain | {"priority": -3})  # going first: only where allowed
        error = first.json()["error"]
        assert first.status_code == 400 and error["param"] == "priority" and "--min-priority" in error["message"]
        hidden = post(srv, "/v1/chat/completions", plain | {"return_hidden_states": True})
        assert hidden.status_code == 400 and hidden.json()["error"]["param"] == "return_hidden_states"
        rendered = post(srv, "/v1/completions/render", {"model": "tiny", "prompt": "x", "priority": 7}).json()
        assert rendered[0]["priority"] == 7 and rendered[0]["request_id"].startswith("cmpl-")


def _load_families(srv, path: str = "/metrics/load") -> dict:
    text = httpx.get(f"http://127.0.0.1:{srv.server.http_port}{path}").text
    return {f.name: f for f in text_string_to_metric_families(text)}


def _value(families, name: str) -> float:
    (sample,) = [s for s in families[name].samples if s.name == name]
    return sample.value


def test_the_load_a_replica_reports_rises_with_requests_and_falls_back(model_files):
    """What routers and the endpoint picker read: running and waiting requests and the KV cache *used* (not
    reserved), under sharp's names and vLLM's, on the lean path; it falls back to 0 when the requests end."""
    with server(model_files, wrap=SlowEndless, engine={"max_batch": 1, "kv_cache_mb": 8}, names="vllm",
                **HTTP) as srv, Client(srv.target) as c:  # fmt: skip
        base = f"http://127.0.0.1:{srv.server.http_port}"
        idle = _load_families(srv)
        assert _value(idle, "vllm:num_requests_running") == 0 and _value(idle, "sharp_kv_cache_used_ratio") == 0
        (info,) = idle["vllm:cache_config_info"].samples
        assert int(info.labels["num_gpu_blocks"]) == _value(idle, "sharp_kv_cache_blocks") > 0
        assert not any("entropy" in name for name in idle)  # the lean path leaves the histograms out
        for name, family in idle.items():  # what pickers read as gauges is typed so
            assert family.type == "gauge" or name.startswith("vllm:prefix_cache"), (name, family.type)
        assert any("entropy" in name for name in _load_families(srv, "/metrics"))
        streams = [c.generate_stream("load", max_new_tokens=4000, temperature=0)]
        next(streams[0])  # running first: the second waits behind it (max_batch 1)
        streams.append(c.generate_stream("load", max_new_tokens=4000, temperature=0))
        deadline = time.monotonic() + 30
        while (load := httpx.get(f"{base}/get_load").json())["num_waiting_reqs"] < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert load["load"] == 2 and load["num_reqs"] == 1
        busy = _load_families(srv)
        reserved = _value(_load_families(srv, "/metrics"), "sharp_kv_cache_usage_ratio")
        used = _value(busy, "vllm:kv_cache_usage_perc")
        assert 0 < used < reserved <= 1  # tokens held so far, below the prompt + max_new_tokens reserved
        assert _value(busy, "vllm:num_requests_waiting") == 1 == _value(busy, "sharp_queue_size")
        for s in streams:
            s.cancel()
        while httpx.get(f"{base}/get_load").json()["load"] and time.monotonic() < deadline:
            time.sleep(0.05)
        after = _load_families(srv)
        assert _value(after, "vllm:num_requests_running") == 0 and _value(after, "vllm:kv_cache_usage_perc") == 0


def test_max_tokens_is_bounded_by_the_context_unless_the_server_sets_a_limit(model_files):
    """Without --max-new-tokens-limit a request may ask for the rest of the model's context (as vLLM and
    llama-server bound it); asking past the context is `context_length_exceeded` naming the context, even with
    max_tokens alone too large; a limit the server sets is named by its flag."""
    with serving(model_files) as srv, Client(srv.target) as c:
        assert c.info().max_new_tokens_limit == 4096  # the context
        with pytest.raises(grpc.RpcError) as err:
            c.generate("ok", max_new_tokens=5000)
        assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE and "context of 4096" in err.value.details()
    with serving(model_files, max_new_tokens_limit=100) as srv, Client(srv.target) as c:
        assert c.info().max_new_tokens_limit == 100
        with pytest.raises(grpc.RpcError) as err:
            c.generate("ok", max_new_tokens=101)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "--max-new-tokens-limit" in err.value.details()


def test_a_request_without_max_tokens_generates_to_the_end_of_what_it_can_use(model_files):
    """As vLLM and llama-server: no max_tokens runs to the end of the context or the end-of-sequence token —
    within --max-new-tokens-limit and what the KV budget holds beside its prompt (which it reserves); a number
    given by --default-max-new-tokens still applies; ModelInfo says 0 for "to the end"."""
    from sharp.serving.backends.loading import load_backend

    per_token = load_backend(model_files["onnxruntime"]).kv_bytes_per_token
    prompt = list(range(10, 60))  # 50 tokens
    cases = [
        ({}, 4096 - 50, "the context"),
        ({"max_new_tokens_limit": 30}, 30, "the limit"),
        ({"kv_cache_mb": 90 * per_token / 2**20}, 40, "the KV budget"),
        ({"default_max_new_tokens": 7}, 7, "the server's default"),
    ]
    for config, want, why in cases:
        with serving(model_files, **config) as srv, Client(srv.target) as c:
            r = c.generate(prompt, ignore_eos=True)
            assert (r.usage.completion_tokens, r.finish_reason) == (want, pb.FINISH_REASON_LENGTH), why
            assert c.info().default_max_new_tokens == config.get("default_max_new_tokens", 0)
    with serving(model_files) as srv, Client(srv.target) as c:  # a prompt one short of the context: one token
        assert c.generate([65] * 4095, ignore_eos=True).usage.completion_tokens == 1
