"""Real clients against a real sharp-serve on loopback: the official `openai` SDK (sync and async, streamed and not,
a conversation carried on with the SDK's own reply objects), LangChain's `ChatOpenAI`, and lm-evaluation-harness's
`local-completions` model scoring and generating on a task written here (no download), its loglikelihoods checked
against the model's own log-softmax in PyTorch."""

from __future__ import annotations

import asyncio
import json

import grpc
import httpx
import numpy as np
import openai
import pytest
from helpers import HTTP, _log_softmax, api, serving

from sharp.models import load
from sharp.models.tokenizer import render_chat
from sharp.serving import Client
from sharp.serving.kv.prefix import common_prefix


def test_openai_sdk_sync_and_async_carry_a_conversation_with_its_own_reply_objects(chat_files, reference):
    with serving(chat_files, server=HTTP) as srv:
        oa = api(srv)
        tok = srv.server.engine.tokenizer
        messages: list[dict] = [{"role": "system", "content": "be brief"}]
        kept: list[list[int]] = []  # what each turn left in the prefix cache: its prompt and its reply but the last
        for turn in ("hi", "and then?", "bye"):
            messages.append({"role": "user", "content": turn})
            reply = oa.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0)
            ids = tok.encode(render_chat(tok, [{"role": m["role"], "content": m["content"]} for m in messages]),
                             bos=False)  # fmt: skip
            answer = reference(ids, 5)
            assert reply.choices[0].message.content == tok.decode(answer)
            hit = max((common_prefix(np.array(k), np.array(ids), len(ids) - 1) for k in kept), default=0)
            assert reply.usage.prompt_tokens_details.cached_tokens == hit and (hit > 0) == bool(kept)
            kept.append(ids + answer[:-1])
            messages.append(reply.choices[0].message.model_dump())  # refusal, annotations, audio, tool_calls: None
        assert set(messages[-1]) >= {"refusal", "tool_calls", "audio"} and len(messages) == 7

        async def run() -> tuple[str, str]:
            aoa = openai.AsyncOpenAI(base_url=oa.base_url, api_key="none", max_retries=0)
            whole = await aoa.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0)
            stream = await aoa.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0,
                                                       stream=True, stream_options={"include_usage": True})  # fmt: skip
            chunks = [ch async for ch in stream]
            parts = [ch.choices[0].delta.content or "" for ch in chunks if ch.choices]
            assert whole.usage.prompt_tokens_details.cached_tokens < whole.usage.prompt_tokens - 1
            assert chunks[-1].usage.prompt_tokens_details.cached_tokens == whole.usage.prompt_tokens - 1
            done = await aoa.completions.create(model="tiny", prompt="x = ", max_tokens=4, temperature=0)
            assert done.choices[0].text == oa.completions.create(model="tiny", prompt="x = ", max_tokens=4,
                                                                 temperature=0).choices[0].text  # fmt: skip
            await aoa.close()
            return whole.choices[0].message.content, "".join(parts)

        whole, streamed = asyncio.run(run())
        assert whole == streamed
        sync = oa.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0)
        assert sync.choices[0].message.content == whole


def test_cache_salt_keeps_each_tenants_prefix_to_itself_on_every_api(chat_files):
    """vLLM's cache_salt as the openai SDK sends it (extra_body) on chat, completions and Responses, and over gRPC:
    cached_tokens counts only what requests with the same salt left (the prefix-cache oracle closed)."""
    messages = [{"role": "user", "content": "the secret is 4711; what is it?"}]
    with serving(chat_files, server=HTTP) as srv, Client(srv.target) as c:
        oa = api(srv)

        def cached(salt: str | None, kind: str = "chat") -> int:
            extra = {} if salt is None else {"cache_salt": salt}
            if kind == "chat":
                r = oa.chat.completions.create(model="tiny", messages=messages, max_tokens=2, extra_body=extra)
                return r.usage.prompt_tokens_details.cached_tokens
            if kind == "completions":
                r = oa.completions.create(model="tiny", prompt="the secret is 4711", max_tokens=2, extra_body=extra)
                return r.usage.prompt_tokens_details.cached_tokens
            if kind == "responses":
                r = oa.responses.create(model="tiny", input=messages, max_output_tokens=2, extra_body=extra)
                return r.usage.input_tokens_details.cached_tokens
            return c.generate("the secret is 4711", max_new_tokens=2, **extra).usage.cached_tokens

        assert cached("alice") == 0
        assert cached("mallory") == 0 and cached(None) == 0  # another salt, or none: nothing of alice's prompt
        assert cached("alice") > 0 and cached("alice", "responses") > 0
        assert cached("bob", "completions") == 0 and cached("bob", "completions") > 0
        assert cached("eve", "grpc") == 0 and cached("bob", "grpc") > 0  # the same text, bob's salt: bob's pages
        r = httpx.post(f"http://127.0.0.1:{srv.server.http_port}/v1/chat/completions", timeout=30,
                       json={"model": "tiny", "messages": messages, "cache_salt": ""})  # fmt: skip
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text


def test_langchain_chat_openai_invokes_streams_and_keeps_history(chat_files):
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
    from langchain_openai import ChatOpenAI

    with serving(chat_files, server=HTTP) as srv:
        oa = api(srv)
        llm = ChatOpenAI(model="tiny", base_url=str(oa.base_url), api_key="none", temperature=0, max_tokens=5,
                         max_retries=0)  # fmt: skip
        history = [SystemMessage("be brief"), HumanMessage("hi")]
        first = llm.invoke(history)
        direct = oa.chat.completions.create(model="tiny", max_tokens=5, temperature=0,
                                            messages=[{"role": "system", "content": "be brief"},
                                                      {"role": "user", "content": "hi"}])  # fmt: skip
        assert first.content == direct.choices[0].message.content
        assert first.usage_metadata["output_tokens"] == 5
        assert "".join(chunk.content for chunk in llm.stream(history)) == first.content
        history += [first, HumanMessage("more")]  # the AIMessage goes back as LangChain serializes it
        second = llm.invoke(history)
        again = oa.chat.completions.create(model="tiny", max_tokens=5, temperature=0, messages=[
            {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": first.content}, {"role": "user", "content": "more"}])  # fmt: skip
        assert isinstance(second, AIMessage) and second.content == again.choices[0].message.content


DOCS = [{"q": "def main():", "a": " return 0"}, {"q": "hello", "a": " world"}, {"q": "x = 1", "a": "\nprint(x)"}]


def _task(tmp_path, name: str, output: str, extra: str) -> None:
    (tmp_path / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tmp_path / 'docs.jsonl'}\n"
        f"test_split: test\noutput_type: {output}\ndoc_to_text: '{{{{q}}}}'\ndoc_to_target: '{{{{a}}}}'\n{extra}"
    )


@pytest.mark.slow
def test_lm_eval_local_completions_scores_and_generates(chat_files, model_files, tmp_path, monkeypatch):
    """lm-eval asks /tokenizer_info and /tokenize (its remote tokenizer), scores with echo + logprobs and generates
    until a stop string; each loglikelihood equals the continuation's log-probability under the model in PyTorch."""
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    import lm_eval
    from lm_eval.tasks import TaskManager

    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    metrics = "metric_list:\n  - metric: {}\n    aggregation: {}\n    higher_is_better: {}\n"
    _task(tmp_path, "sharp_ll", "loglikelihood", metrics.format("acc", "mean", "true"))
    until = "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 8\n"
    _task(tmp_path, "sharp_gen", "generate_until", until + metrics.format("exact_match", "mean", "true"))
    model = load(model_files["torch"])
    with serving(chat_files, server=HTTP) as srv:
        url = f"http://127.0.0.1:{srv.server.http_port}/v1/completions"
        out = lm_eval.simple_evaluate(
            model="local-completions",
            model_args=f"model=tiny,base_url={url},tokenizer_backend=remote,max_retries=1",
            tasks=["sharp_ll", "sharp_gen"],
            task_manager=TaskManager(include_path=str(tmp_path)),
            log_samples=True,
        )
        oa = api(srv)
        for sample in out["samples"]["sharp_gen"]:
            q = sample["doc"]["q"]
            direct = oa.completions.create(model="tiny", prompt=list(q.encode()), max_tokens=8, temperature=0,
                                           stop=["\n"], seed=1234)  # fmt: skip
            assert sample["resps"][0][0] == direct.choices[0].text
    assert {"sharp_ll", "sharp_gen"} <= set(out["results"])
    assert len(out["samples"]["sharp_ll"]) == len(DOCS)
    for sample in out["samples"]["sharp_ll"]:
        context, continuation = (x.encode() for x in sample["arguments"][0])
        ids = list(context + continuation)  # the byte tokenizer, no BOS (lm-eval's add_bos_token is off)
        ref = _log_softmax(model, ids)
        want = sum(ref[i - 1, ids[i]].item() for i in range(len(context), len(ids)))
        greedy = all(ref[i - 1].argmax().item() == ids[i] for i in range(len(context), len(ids)))
        (got, got_greedy), = sample["resps"][0]  # fmt: skip
        assert got == pytest.approx(want, abs=1e-4) and got_greedy == greedy


def test_openai_sdk_n_choices_and_best_of_share_one_prefill(chat_files, reference):
    """n = 3: three choices of one prompt, indexed, the prompt prefilled once (usage counts it once, the later
    choices start from its cache); streamed, each chunk names its choice; best_of = 3, n = 1 returns the choice
    whose tokens are the most likely, as three requests alone with seeds s, s + 1, s + 2 rank them."""
    with serving(chat_files, server=HTTP) as srv:
        oa = api(srv)
        prompt = "def main(): return"
        ids = srv.server.engine.tokenizer.encode(prompt)
        r = oa.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0, n=3)
        assert [c.index for c in r.choices] == [0, 1, 2]
        want = srv.server.engine.tokenizer.decode(reference(ids, 6))
        assert all(c.text == want for c in r.choices)  # greedy: every choice the same
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 18)
        sampled = oa.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=1, seed=5, n=3)
        texts = [c.text for c in sampled.choices]
        assert len(set(texts)) > 1
        for i, text in enumerate(texts):  # choice i samples as a request alone with seed + i
            alone = oa.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=1, seed=5 + i)
            assert alone.choices[0].text == text
        stream = oa.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                            temperature=1, seed=3, n=2, stream=True,
                                            stream_options={"include_usage": True})  # fmt: skip
        parts: dict[int, str] = {0: "", 1: ""}
        finished = set()
        for ch in stream:
            for c in ch.choices:
                parts[c.index] += c.delta.content or ""
                if c.finish_reason:
                    finished.add(c.index)
            usage = ch.usage or None
        whole = oa.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                           temperature=1, seed=3, n=2)  # fmt: skip
        assert finished == {0, 1} and [parts[0], parts[1]] == [c.message.content for c in whole.choices]
        assert usage.completion_tokens == 10 and usage.prompt_tokens_details.cached_tokens > 0
        best = oa.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=1, seed=11, best_of=3)
        scored = []
        for i in range(3):
            alone = oa.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=1, seed=11 + i,
                                          logprobs=0)  # fmt: skip
            scored.append((sum(alone.choices[0].logprobs.token_logprobs), alone.choices[0].text))
        assert len(best.choices) == 1 and best.choices[0].text == max(scored)[1]
        assert best.choices[0].logprobs is None and best.usage.completion_tokens == 24
        # gRPC's n: the same choices, one prefill (the prompt counted once), each streamed chunk naming its choice
        with Client(srv.target) as c:
            r = c.generate(prompt, max_new_tokens=8, temperature=1.0, seed=5, n=3, logprobs=0)
            assert [ch.index for ch in r.choices] == [0, 1, 2] and [ch.text for ch in r.choices] == texts
            assert r.text == texts[0] and list(r.token_ids) == list(r.choices[0].token_ids)
            assert all(len(ch.logprobs) == len(ch.token_ids) for ch in r.choices)
            assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 24)
            streamed: dict[int, str] = {0: "", 1: "", 2: ""}
            ends = []
            for chunk in c.generate_stream(prompt, max_new_tokens=8, temperature=1.0, seed=5, n=3):
                streamed[chunk.index] += chunk.text
                if chunk.finish_reason:
                    ends.append(chunk.index)
            assert sorted(ends) == [0, 1, 2] and list(streamed.values()) == texts
            assert len(c.generate(prompt, max_new_tokens=2).choices) == 0  # n unset: one, in the top-level fields
            with pytest.raises(grpc.RpcError) as e:
                c.generate(prompt, n=17)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "n must be in [1, 16]" in e.value.details()
