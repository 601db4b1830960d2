"""The OpenAI-compatible server, live on a free loopback port (tiny random llama).

The official `openai` client drives completions, chat, streaming, n, stop, seeds and logprobs; raw
HTTP (httpx) drives every error case, disconnects and a bounded load test. The server runs in a
thread of this process (uvicorn on a socket bound to 127.0.0.1:0) and is stopped at the end of
the module; one test starts `jpa serve` itself and stops it with SIGTERM.
"""

import asyncio
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
FastAPI = pytest.importorskip("fastapi").FastAPI
pytest.importorskip("prometheus_client")

from jpa import models  # noqa: E402
from jpa.engine import AsyncEngine, EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from jpa.server import attach, build_app  # noqa: E402
from jpa.testing.procs import fast_compile_env  # noqa: E402
from server_util import serving  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NAME = "tiny"
PROMPTS = ["The paged cache", "hello there", "continuous batching keeps slots busy", "jax"]
MAX_N = 4
MAX_LEN = 2048


class Live:
    def __init__(self, url, aengine, tokenizer, reference, gpt):
        self.url, self.aengine, self.tok, self.reference, self.gpt = url, aengine, tokenizer, reference, gpt
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)

    def metrics(self) -> dict:
        text = httpx.get(f"{self.url}/metrics").text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, value = line.rsplit(" ", 1)
                out[key] = float(value)
        return out

    def wait_idle(self, timeout=15.0) -> dict:
        """Metrics once nothing runs and the pool is whole (the engine checked it on the device)."""
        t0 = time.monotonic()
        while True:
            m = self.metrics()
            if m["jpa_num_requests_running"] == 0 and m["jpa_num_requests_waiting"] == 0 and m["jpa_kv_pool_whole"]:
                return m
            assert time.monotonic() - t0 < timeout, f"server not idle: {m}"
            time.sleep(0.01)


@pytest.fixture(scope="module")
def live():
    model, tok = models.load("tiny-llama", seed=1)
    # Long requests (LONG below) must outlive the client's disconnect by far: max_model_len 2048,
    # and a pool that holds 8 of them at once (no preemption).
    eng = LLMEngine(models.GPTForEngine(model), tok, EngineConfig(max_seqs=8, page_size=16, num_pages=1100,
                                                                  steps_per_call=4, max_model_len=MAX_LEN))
    # Offline greedy results (and the compilations the server then reuses).
    reference = dict(zip(PROMPTS, eng.generate(PROMPTS, SamplingParams(max_new_tokens=24, greedy=True,
                                                                         ignore_eos=True))))
    with AsyncEngine(eng, max_waiting=32) as aengine:
        app = build_app(aengine, tok, model_name=NAME, max_n=MAX_N)
        with serving(app) as url:
            yield Live(url, aengine, tok, reference, model)


GREEDY = dict(temperature=0, max_tokens=24, extra_body={"ignore_eos": True})


# ---------------------------------------------------------------------- the openai client

def test_models_and_health(live):
    assert [m.id for m in live.client.models.list().data] == [NAME]
    assert httpx.get(f"{live.url}/health").json() == {"status": "ok"}
    r = httpx.get(f"{live.url}/v1/models/{NAME}")
    assert r.status_code == 200 and r.json()["max_model_len"] == MAX_LEN


def test_completion_equals_offline_engine(live):
    for p in PROMPTS[:2]:
        r = live.client.completions.create(model=NAME, prompt=p, **GREEDY)
        ref = live.reference[p]
        assert r.choices[0].text == ref.completion and r.choices[0].finish_reason == "length"
        assert r.usage.prompt_tokens == len(live.tok.encode(p)) and r.usage.completion_tokens == 24
        assert r.object == "text_completion" and r.model == NAME


def test_streaming_completion_equals_non_streaming(live):
    p = PROMPTS[2]
    stream = live.client.completions.create(model=NAME, prompt=p, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY)
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == live.reference[p].completion
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24


def test_chat_streaming_and_not(live):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a river."}]
    kw = dict(model=NAME, messages=msgs, temperature=0, max_tokens=20)
    r = live.client.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.message.role == "assistant" and c.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == len(live.tok.encode(live.tok.render_chat(msgs)))
    chunks = list(live.client.chat.completions.create(stream=True, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == c.message.content
    assert chunks[-1].choices[0].finish_reason == c.finish_reason
    assert all(ch.object == "chat.completion.chunk" and ch.id == chunks[0].id for ch in chunks)


def test_n_choices(live):
    p = PROMPTS[0]
    kw = dict(model=NAME, prompt=p, max_tokens=12, temperature=1.0, seed=7, n=2, extra_body={"ignore_eos": True})
    r = live.client.completions.create(**kw)
    assert sorted(c.index for c in r.choices) == [0, 1]
    texts = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    assert texts[0] != texts[1], "choices sample with different seeds"
    streamed = ["", ""]
    for ch in live.client.completions.create(stream=True, **kw):
        for c in ch.choices:
            streamed[c.index] += c.text
    assert streamed == texts
    # The n choices are one engine request with n samples: the prompt is prefilled once (a prefix
    # cache hit could only lower that) and the samples copy the shared partial last page on write.
    eng = live.aengine.engine
    before, copies = eng.stats.prefill_tokens, eng.runner.cow_copies
    g = live.client.completions.create(model=NAME, prompt=p, n=2, **GREEDY)
    assert [c.text for c in g.choices] == [live.reference[p].completion] * 2
    n_prompt = len(live.tok.encode(p))
    assert eng.stats.prefill_tokens - before <= n_prompt
    assert eng.runner.cow_copies - copies == (1 if n_prompt % eng.config.page_size else 0)
    # A list of prompts with n: choices prompt-major.
    b = live.client.completions.create(model=NAME, prompt=PROMPTS[:2], n=2, **GREEDY)
    assert [c.text for c in sorted(b.choices, key=lambda c: c.index)] == \
        [live.reference[q].completion for q in PROMPTS[:2] for _ in range(2)]


def test_stop_strings(live):
    # Seeded sampling gives the same text every time (and more varied text than this random model's
    # greedy output); the stop string is a piece of it that first occurs past its start.
    # The stop string is a printable ASCII character (this model also emits bytes that are not
    # UTF-8 on their own) that first occurs past the start.
    for seed in range(20):
        kw = dict(model=NAME, prompt=PROMPTS[1], max_tokens=24, temperature=1.0, seed=seed,
                  extra_body={"ignore_eos": True})
        ref = live.client.completions.create(**kw).choices[0].text
        cuts = [i for i in range(2, len(ref)) if ref[i].isascii() and ref[i].isalnum() and ref.find(ref[i]) == i]
        if cuts:
            break
    cut = cuts[0]
    stop = ref[cut]
    r = live.client.completions.create(stop=[stop, "never-appears"], **kw)
    assert r.choices[0].text == ref[:cut] and r.choices[0].finish_reason == "stop"
    chunks = list(live.client.completions.create(stop=stop, stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == ref[:cut]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seed_reproducibility(live):
    kw = dict(model=NAME, prompt=PROMPTS[3], max_tokens=16, temperature=1.0, top_p=0.9,
              extra_body={"ignore_eos": True, "top_k": 50})
    a = live.client.completions.create(seed=123, **kw).choices[0].text
    b = live.client.completions.create(seed=123, **kw).choices[0].text
    c = live.client.completions.create(seed=124, **kw).choices[0].text
    assert a == b and a != c


def test_logprobs(live):
    p = PROMPTS[0]
    r = live.client.completions.create(model=NAME, prompt=p, logprobs=0, **GREEDY)
    lp = r.choices[0].logprobs
    ref = live.reference[p]
    assert len(lp.token_logprobs) == len(ref.token_ids) == 24
    assert lp.token_logprobs == pytest.approx(list(ref.logprobs), abs=1e-4)
    assert "".join(lp.tokens) == ref.completion
    chat = live.client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}],
                                               logprobs=True, max_tokens=8, temperature=0.7, seed=1)
    content = chat.choices[0].logprobs.content
    assert content and all(t.logprob <= 0 for t in content)
    assert len(content) <= chat.usage.completion_tokens


def test_sampling_controls_through_the_openai_client(live):
    """Each control changes outputs as specified: a token banned by logit_bias -100 never appears,
    frequency_penalty lowers repeats, min_tokens holds a stop token back, and top_logprobs are the
    engine's (greedy: the model's own distribution) in OpenAI's shapes on both endpoints."""
    p = PROMPTS[1]
    ref = live.reference[p]
    banned = sorted(set(ref.token_ids))
    r = live.client.completions.create(model=NAME, prompt=p, logit_bias={str(t): -100 for t in banned}, **GREEDY)
    ids = live.tok.encode(r.choices[0].text)
    assert r.choices[0].text != ref.completion and not set(ids) & set(banned)
    rep = lambda ids: len(ids) - len(set(ids))  # noqa: E731
    r = live.client.completions.create(model=NAME, prompt=p, frequency_penalty=2.0, **GREEDY)
    assert rep(live.tok.encode(r.choices[0].text)) < rep(list(ref.token_ids))
    first = ref.token_ids[0]
    stop = dict(temperature=0, max_tokens=24, extra_body={"stop_token_ids": [first]})
    r = live.client.completions.create(model=NAME, prompt=p, **stop)
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 1 and r.choices[0].text == ""
    r = live.client.completions.create(model=NAME, prompt=p, **{**stop, "extra_body": {"stop_token_ids": [first],
                                                                                       "min_tokens": 5}})
    assert r.usage.completion_tokens >= 6 or r.choices[0].finish_reason == "length"
    # top_logprobs: completions ({text: logprob} per token), chat (token, logprob, bytes).
    r = live.client.completions.create(model=NAME, prompt=p, logprobs=3, **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.top_logprobs) == 24 and all(len(t) <= 3 for t in lp.top_logprobs)
    for tok_lp, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert max(top.values()) == pytest.approx(tok_lp, abs=1e-5)   # greedy: the token is the top one
    chat = live.client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": p}], logprobs=True,
                                               top_logprobs=5, **GREEDY)
    for t in chat.choices[0].logprobs.content:
        assert len(t.top_logprobs) == 5 and t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-5)
        assert [a.logprob for a in t.top_logprobs] == sorted((a.logprob for a in t.top_logprobs), reverse=True)
        assert all(bytes(a.bytes) == live.tok.token_bytes(a.token) if hasattr(live.tok, "token_bytes") else True
                   for a in t.top_logprobs)


# ---------------------------------------------------------------------- bad input (raw HTTP)

BAD = [
    # (body, expected param, fragment of the message)
    ({"model": NAME, "prompt": "hi", "max_tokens": -5}, "max_tokens", "greater than or equal to 0"),
    ({"model": NAME, "prompt": "hi", "max_tokens": 0}, "max_tokens", "needs 'echo': true"),
    ({"model": NAME, "prompt": "hi", "max_tokens": "5"}, "max_tokens", "valid integer"),
    ({"model": NAME, "prompt": "hi", "temperature": -0.1}, "temperature", "greater than or equal to 0"),
    ({"model": NAME, "prompt": "hi", "top_p": 0}, "top_p", "greater than 0"),
    ({"model": NAME, "prompt": "hi", "top_p": 1.5}, "top_p", "less than or equal to 1"),
    ({"model": NAME, "prompt": "hi", "top_k": -2}, "top_k", "greater than or equal to -1"),
    ({"model": NAME, "prompt": "hi", "n": 0}, "n", "greater than or equal to 1"),
    ({"model": NAME, "prompt": "hi", "n": MAX_N + 1}, "n", f"must be <= {MAX_N}"),
    ({"model": NAME, "prompt": "hi", "seed": -2 ** 63 - 1}, "seed", "greater than or equal to"),
    ({"model": NAME, "prompt": "hi", "best_of": 2}, "best_of", "not supported"),
    ({"model": NAME, "prompt": ""}, "prompt", "empty"),
    ({"model": NAME, "prompt": []}, "prompt", "empty"),
    ({"model": NAME, "prompt": ["ok", ""]}, "prompt", "empty"),
    ({"model": NAME, "prompt": 5}, "prompt", "must be a string, a list of strings"),
    ({"model": NAME, "prompt": [1, 2, 512]}, "prompt", "token ids must be in [0, 512)"),
    ({"model": NAME}, "prompt", "'prompt' is required"),
    ({"prompt": "hi"}, "model", "'model' is required"),
    ({"model": NAME, "prompt": "hi", "max_tokens": MAX_LEN - 1}, "max_tokens", f"maximum context length is {MAX_LEN}"),
    ({"model": NAME, "prompt": "x" * MAX_LEN}, "prompt", f"maximum context length is {MAX_LEN}"),
    ({"model": NAME, "prompt": "hi", "stop": ""}, "stop", "'stop' must be"),
    ({"model": NAME, "prompt": "hi", "stop": ["a"] * 17}, "stop", "'stop' must be"),
    ({"model": NAME, "prompt": "hi", "logprobs": 21}, "logprobs", "less than or equal to 20"),
    ({"model": NAME, "prompt": "hi", "presence_penalty": 2.5}, "presence_penalty", "presence_penalty must be"),
    ({"model": NAME, "prompt": "hi", "echo": "yes"}, "echo", "valid boolean"),
    ({"model": NAME, "prompt": "hi", "stream": "yes"}, "stream", "valid boolean"),
    # Known fields: strict types and values, whatever unknown fields are allowed.
    ({"model": NAME, "prompt": "hi", "temperature": "0.5"}, "temperature", "valid number"),
    ({"model": NAME, "prompt": "hi", "store": "yes"}, "store", "valid boolean"),
    ({"model": NAME, "prompt": "hi", "metadata": {"k": 1}}, "metadata", "metadata.k"),
    ({"model": NAME, "prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nope"}}}}, "response_format", "'response_format.json_schema.schema'"),
    ({"model": NAME, "prompt": "hi", "response_format": {"type": "xml"}}, "response_format", "response_format.type"),
    ({"model": NAME, "prompt": "hi", "skip_special_tokens": 0}, "skip_special_tokens", "valid boolean"),
    ({"model": NAME, "prompt": "hi", "include_stop_str_in_output": "true"}, "include_stop_str_in_output",
     "valid boolean"),
    # Device-side sampling controls: out-of-range values are refused by name.
    ({"model": NAME, "prompt": "hi", "frequency_penalty": -3}, "frequency_penalty", "frequency_penalty must be"),
    ({"model": NAME, "prompt": "hi", "repetition_penalty": 0}, "repetition_penalty", "repetition_penalty must be"),
    ({"model": NAME, "prompt": "hi", "min_p": 1.5}, "min_p", "min_p must be"),
    ({"model": NAME, "prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias", "logit_bias must"),
    ({"model": NAME, "prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias", "keys must be token ids"),
    ({"model": NAME, "prompt": "hi", "logit_bias": {"512": 1}}, "logit_bias", "token ids must be in [0, 512)"),
    ({"model": NAME, "prompt": "hi", "min_tokens": 40, "max_tokens": 4}, "min_tokens", "min_tokens must be"),
    ({"model": NAME, "prompt": "hi", "stop_token_ids": [-1]}, "stop_token_ids", "token ids must be in [0, 512)"),
    ({"model": NAME, "prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs", "less than or equal to 20"),
    ({"model": NAME, "prompt": "hi", "prompt_logprobs": -1}, "prompt_logprobs", "greater than or equal to 0"),
    ({"model": NAME, "prompt": "hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs",
     "not available with 'stream'"),
    ({"model": NAME, "prompt": "hi", "use_beam_search": True}, "use_beam_search", "not supported"),
    ({"model": NAME, "prompt": "hi", "guided_json": {"type": "nope"}}, "guided_json", "'guided_json'"),
    ({"model": NAME, "prompt": "hi", "structured_outputs": {"structural_tag": "x"}}, "structured_outputs",
     "not supported"),
    ({"model": NAME, "prompt": "hi", "suffix": "end"}, "suffix", "not supported"),
    ({"model": NAME, "prompt": "hi", "min_p": "0"}, "min_p", "valid number"),
]

BAD_CHAT = [
    ({"model": NAME, "messages": []}, "messages", "at least 1 item"),
    ({"model": NAME, "messages": [{"role": "robot", "content": "hi"}]}, "messages", "messages.0.role"),
    ({"model": NAME, "messages": [{"role": "user"}]}, "messages", "'messages.0.content' is required"),
    ({"model": NAME, "messages": [{"role": "user", "content": 3}]}, "messages", "'messages.0.content' must be"),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}, "top_logprobs",
     "needs 'logprobs': true"),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
     "top_logprobs", "less than or equal to 20"),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
      "max_completion_tokens": 5}, "max_tokens", "not both"),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi" * MAX_LEN}]}, "prompt", "maximum context length"),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function":
      {"name": "no spaces"}}]}, "tools", "tools.0.function.name"),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "tool_choice": "auto"}, "tool_choice",
     "needs 'tools'"),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema",
      "json_schema": {"name": "x"}}}, "response_format", "'response_format.json_schema.schema' is required"),
    ({"model": NAME, "messages": [{"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}]}, "messages",
     "messages.0.tool_calls"),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi", "tool_calls": [{"function": {
        "name": "f", "arguments": "{}"}}]}]}, "messages", "only assistant messages make tool calls"),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "continue_final_message": True},
     "continue_final_message", "not supported"),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "presence_penalty": 3}, "presence_penalty",
     "presence_penalty must be"),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "logprobs": 1}, "logprobs", "valid boolean"),
]


def _check_error(r, status, param, fragment):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param, err
    assert fragment in err["message"], err


@pytest.mark.parametrize("body,param,fragment", BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_bad_completion_request_is_400(live, body, param, fragment):
    _check_error(httpx.post(f"{live.url}/v1/completions", json=body), 400, param, fragment)


@pytest.mark.parametrize("body,param,fragment", BAD_CHAT, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD_CHAT)])
def test_bad_chat_request_is_400(live, body, param, fragment):
    _check_error(httpx.post(f"{live.url}/v1/chat/completions", json=body), 400, param, fragment)


def test_malformed_and_unknown(live):
    errors = lambda status: live.metrics().get(f'jpa_http_errors_total{{status="{status}"}}', 0.0)  # noqa: E731
    before = errors(400), errors(404)
    for path in ("/v1/completions", "/v1/chat/completions"):
        r = httpx.post(f"{live.url}{path}", content=b'{"model": "tiny", "prompt": ', 
                       headers={"content-type": "application/json"})
        _check_error(r, 400, None, "malformed JSON")
        _check_error(httpx.post(f"{live.url}{path}", json=[1, 2]), 400, None, "JSON object")
    _check_error(httpx.post(f"{live.url}/v1/completions", json={"model": "gpt-4", "prompt": "hi"}), 404, "model",
                 "does not exist")
    _check_error(httpx.post(f"{live.url}/v1/chat/completions",
                            json={"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}),
                 404, "model", "does not exist")
    _check_error(httpx.get(f"{live.url}/v1/models/gpt-4"), 404, "model", "does not exist")
    _check_error(httpx.get(f"{live.url}/v1/nothing"), 404, None, "Not Found")
    # ... and the server is unharmed.
    assert live.client.completions.create(model=NAME, prompt=PROMPTS[0], **GREEDY).choices[0].text == \
        live.reference[PROMPTS[0]].completion
    assert (errors(400) - before[0], errors(404) - before[1]) == (4, 4)   # each counted once, by its status


def test_unknown_fields_are_ignored_and_logged_once(live, caplog):
    """What SDKs and routers add (vllm-router: no_stop_trim, skip_special_tokens, separate_reasoning,
    ...; SDKs: store, metadata, response_format text, tools []) does not change the answer; a field
    no model declares is ignored and logged once per name, nested ones included."""
    p = PROMPTS[1]
    extra = {"ignore_eos": True, "no_stop_trim": False, "skip_special_tokens": True, "echo": False,
             "return_hidden_states": False, "frobnicate_x": 1, "store": True, "metadata": {"who": "test"},
             "response_format": {"type": "text"}, "stream_options": None}
    with caplog.at_level(logging.WARNING, logger="jpa.server"):
        for _ in range(2):
            r = live.client.completions.create(model=NAME, prompt=p, temperature=0, max_tokens=24, extra_body=extra)
            assert r.choices[0].text == live.reference[p].completion
        msgs = [{"role": "user", "content": "hi", "refusal_x": None}]
        chat_extra = {"no_stop_trim": False, "continue_final_message": False, "separate_reasoning": True,
                      "stream_reasoning": True, "include_reasoning": True, "tools": [], "parallel_tool_calls": False,
                      "skip_special_tokens": True}
        kw = dict(model=NAME, messages=msgs, temperature=0, max_tokens=8, store=False, metadata={"a": "b"},
                  response_format={"type": "text"}, extra_body=chat_extra)
        a = live.client.chat.completions.create(**kw)
        b = live.client.chat.completions.create(**{**kw, "messages": [{"role": "user", "content": "hi"}],
                                                   "extra_body": {}})
        assert a.choices[0].message.content == b.choices[0].message.content
        chunks = list(live.client.chat.completions.create(
            stream=True, stream_options={"include_usage": True, "continuous_usage_stats_x": False}, **kw))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == a.choices[0].message.content
    logged = [r.getMessage() for r in caplog.records if r.name == "jpa.server"]
    for name in ("frobnicate_x", "return_hidden_states", "include_reasoning",
                 "messages[].refusal_x", "stream_options.continuous_usage_stats_x"):
        assert sum(f"'{name}'" in m for m in logged) == 1, (name, logged)
    # Declared fields are never reported as unknown.
    assert not any(f"'{name}'" in m for m in logged for name in ("no_stop_trim", "store", "metadata", "tools",
                                                                 "separate_reasoning"))


# ---------------------------------------------------------------------- defects of issue 23

def _post_raw(url, path, body: bytes):
    """POSTs bytes as they are (a lone-surrogate escape or NaN survives; httpx's json= would not)."""
    return httpx.post(f"{url}{path}", content=body, headers={"content-type": "application/json"}, timeout=30)


def test_lone_surrogates_are_400_naming_the_field(live):
    """"\ud800" is valid JSON but not Unicode: a 400 naming the field, never a 500 or an exception text."""
    cases = [
        ("/v1/completions", b'{"model": "tiny", "prompt": "a\\ud800b"}', "prompt", "'prompt'"),
        ("/v1/completions", b'{"model": "tiny", "prompt": ["ok", "x\\udfff"]}', "prompt", "'prompt.1'"),
        ("/v1/completions", b'{"model": "t\\ud800iny", "prompt": "hi"}', "model", "'model'"),
        ("/v1/completions", b'{"model": "tiny", "prompt": "hi", "\\ud800x": 1}', None, "'\\ud800x'"),
        ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800"}]}',
         "messages", "'messages.0.content'"),
        ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", '
                                 b'"text": "\\udbff"}]}]}', "messages", "'messages.0.content.0.text'"),
        ("/tokenize", b'{"model": "tiny", "prompt": "\\ud800"}', "prompt", "'prompt'"),
    ]
    for path, body, param, where in cases:
        r = _post_raw(live.url, path, body)
        _check_error(r, 400, param, "lone UTF-16 surrogate")
        msg = r.json()["error"]["message"]
        assert msg.startswith(where) and "Error" not in msg and "Traceback" not in msg, msg
    # A correctly paired surrogate escape is ordinary text.
    r = _post_raw(live.url, "/v1/completions", b'{"model": "tiny", "prompt": "\\ud83d\\ude00", "max_tokens": 2}')
    assert r.status_code == 200, r.text


def test_a_bug_is_a_500_without_the_exception_text(live, caplog):
    class Broken(_SpyTokenizer):
        broken = False

        def id_to_token(self, t):
            if self.broken:
                raise RuntimeError("secret /path/of/the/server")
            return None

    tok = Broken(live.tok)
    app = build_app(live.aengine, tok, model_name=NAME)
    tok.broken = True
    with serving(app) as url, caplog.at_level(logging.ERROR, logger="jpa.server"):
        r = httpx.post(f"{url}/tokenize", json={"prompt": "hi", "return_token_strs": True},
                       headers={"X-Request-Id": "bug-1"})
        _check_error(r, 500, None, "internal server error (request id bug-1)")
        assert "secret" not in r.text and r.headers["x-request-id"] == "bug-1"
        logged = [rec for rec in caplog.records if rec.name == "jpa.server" and rec.exc_info]
        assert logged and "secret" in str(logged[-1].exc_info[1])
        assert httpx.post(f"{url}/tokenize", json={"prompt": "hi"}).status_code == 200


def test_non_finite_numbers_name_their_field(live):
    for value in (b"Infinity", b"-Infinity", b"NaN"):
        for field in (b"temperature", b"top_p", b"presence_penalty"):
            body = b'{"model": "tiny", "prompt": "hi", "' + field + b'": ' + value + b"}"
            r = _post_raw(live.url, "/v1/completions", body)
            _check_error(r, 400, field.decode(), "finite number")


def test_stream_options_need_stream(live):
    body = {"model": NAME, "prompt": "hi", "max_tokens": 2, "stream_options": {"include_usage": True}}
    for stream in (False, None):
        b = {**body, "stream": stream} if stream is not None else body
        _check_error(httpx.post(f"{live.url}/v1/completions", json=b), 400, "stream_options", "'stream': true")
    chat = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": False}}
    _check_error(httpx.post(f"{live.url}/v1/chat/completions", json=chat), 400, "stream_options", "'stream': true")
    with httpx.stream("POST", f"{live.url}/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200 and "[DONE]" in r.read().decode()


def test_seeds_are_used_as_given(live):
    """Seeds the engine can take (seed + n - 1 < 2**31) are used as given; any other 64-bit seed is
    folded into the engine's key, never wrapped modulo 2**31 (0, 2**31 and 2**32 gave the same text)
    (more in test_server_hardening.test_64_bit_seeds_are_folded_into_the_key)."""
    kw = {"model": NAME, "prompt": PROMPTS[3], "max_tokens": 8, "temperature": 1.0, "ignore_eos": True}
    texts = []
    for seed, n in ((0, 1), (2 ** 31, 1), (2 ** 32, 1), (2 ** 63, 1), (2 ** 31 - 1, 2), (2 ** 31 - 3, 4)):
        r = httpx.post(f"{live.url}/v1/completions", json={**kw, "seed": seed, "n": n})
        assert r.status_code == 200, r.text
        texts.append(r.json()["choices"][0]["text"])
    assert len(set(texts[:4])) == 4, texts
    top = httpx.post(f"{live.url}/v1/completions", json={**kw, "seed": 2 ** 31 - 1})
    assert top.status_code == 200, top.text
    two = httpx.post(f"{live.url}/v1/completions", json={**kw, "seed": 2 ** 31 - 2, "n": 2}).json()
    assert [c["text"] for c in sorted(two["choices"], key=lambda c: c["index"])][1] == top.json()["choices"][0]["text"]


def _stream_completion(url, body) -> tuple[str, list, list, list]:
    """(text, tokens, text_offset, token_logprobs) of a streamed completion with logprobs, chunk by chunk."""
    text, tokens, offsets, lps = "", [], [], []
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            c = json.loads(line[6:])["choices"][0]
            text += c["text"]
            if c["logprobs"]:
                tokens.append(c["logprobs"]["tokens"])
                offsets.append(c["logprobs"]["text_offset"])
                lps.append(c["logprobs"]["token_logprobs"])
    return text, tokens, offsets, lps


def test_logprob_tokens_follow_incremental_detokenization(live):
    """The tiny model's tokens are bytes: a multi-byte character spans tokens. Each token's text is
    what it adds to the text ("" for leading bytes, the whole character for the last), never
    U+FFFD; "".join(tokens) == text; text_offset indexes the text and continues across streamed
    chunks; chat `bytes` are each token's real byte."""
    msgs = [{"role": "user", "content": "say something"}]
    prompt = live.tok.render_chat(msgs)        # the chat endpoint's prompt, as a completion prompt
    body = {"model": NAME, "prompt": prompt, "max_tokens": 48, "temperature": 1.0, "ignore_eos": True, "logprobs": 0}
    for seed in range(200):
        r = httpx.post(f"{live.url}/v1/completions", json={**body, "seed": seed}).json()
        text = r["choices"][0]["text"]
        wide = [c for c in text if ord(c) > 127 and c != "\ufffd"]
        if wide:
            break
    else:
        pytest.fail("no seed gave a multi-byte character")
    body["seed"] = seed
    lp = r["choices"][0]["logprobs"]
    tokens, offsets = lp["tokens"], lp["text_offset"]
    assert "".join(tokens) == text
    assert len(tokens) == len(lp["token_logprobs"]) == r["usage"]["completion_tokens"] == 48
    assert offsets == [sum(map(len, tokens[:i])) for i in range(len(tokens))] and max(offsets) <= len(text)
    c = wide[0]
    # The token that completes the character carries all of it (after a U+FFFD for a stray byte
    # before it, if any); its leading bytes carry nothing (not U+FFFD each).
    k = next(i for i, t in enumerate(tokens) if c in t)
    lead = len(c.encode("utf-8")) - 1
    assert tokens[k].endswith(c) and tokens[k - lead:k] == [""] * lead, tokens
    # Streamed: the same tokens and offsets, the offsets continuing across chunks.
    s_text, s_tokens, s_offsets, s_lps = _stream_completion(live.url, body)
    assert s_text == text and sum(s_tokens, []) == tokens and sum(s_offsets, []) == offsets
    assert sum(s_lps, []) == pytest.approx(lp["token_logprobs"], abs=1e-5)
    assert len(s_offsets) > 2 and offsets[-1] > 0   # several chunks, offsets not restarting at 0 in each
    # Cut by a stop string inside the text: the tokens still join to the (shorter) text.
    cut = text.index(c)
    r2 = httpx.post(f"{live.url}/v1/completions", json={**body, "stop": [c]}).json()["choices"][0]
    assert r2["text"] == text[:cut] and "".join(r2["logprobs"]["tokens"]) == r2["text"]
    s2 = _stream_completion(live.url, {**body, "stop": [c]})
    assert s2[0] == text[:cut] and "".join(sum(s2[1], [])) == s2[0]
    # Chat: the same sampled tokens (same prompt ids and seed); bytes are the real bytes.
    chat = live.client.chat.completions.create(model=NAME, messages=msgs, max_tokens=48, temperature=1.0,
                                               seed=seed, logprobs=True, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert chat.choices[0].message.content == text and [t.token for t in content] == tokens
    assert content[k].bytes == list(c.encode("utf-8")[-1:])
    assert [t.bytes for t in content[k - lead:k]] == [[b] for b in c.encode("utf-8")[:-1]]
    assert all(t.bytes == list(t.token.encode()) for t in content if t.token.isascii() and t.token)
    assert all(len(t.bytes) <= 1 for t in content)   # byte tokens (or nothing: ids that decode to "")
    streamed = [t for ch in live.client.chat.completions.create(
        model=NAME, messages=msgs, max_tokens=48, temperature=1.0, seed=seed, logprobs=True, stream=True,
        extra_body={"ignore_eos": True}) if ch.choices and ch.choices[0].logprobs
        for t in ch.choices[0].logprobs.content]
    assert [(t.token, t.bytes) for t in streamed] == [(t.token, t.bytes) for t in content]


def test_token_bytes_of_a_byte_level_bpe():
    """TokenBytes on a byte-level BPE vocabulary (SmolLM2's kind, built small here): a piece maps
    back to its bytes, partial characters included; a special token contributes nothing."""
    from jpa.server.logprobs import ChoiceTokens, TokenBytes, _byte_alphabet
    from jpa.models.tokenizer import Tokenizer

    alphabet = sorted(_byte_alphabet(), key=_byte_alphabet().get)      # the 256 byte pieces, by byte
    tokens = alphabet + ["Ã©", "<|im_end|>"]                            # + "é" merged, + a control token
    tok = Tokenizer(tokens, ["Ã ©"], [1] * 257 + [3], bos_token_id=257, eos_token_id=257)
    tb = TokenBytes(tok)
    ids = tok.encode("aé€")
    assert [tb(t) for t in ids] == [b"a", "é".encode(), b"\xe2", b"\x82", b"\xac"]
    assert tb(257) == b""
    ct = ChoiceTokens(tok, tb)
    out = ct.feed(ids + [257], [0.0] * 6, "aé€", True)
    assert [(t[0], t[1], t[3]) for t in out] == [("a", b"a", 0), ("é", "é".encode(), 1), ("", b"\xe2", 2),
                                                 ("", b"\x82", 2), ("€", b"\xac", 2), ("", b"", 3)]


# ---------------------------------------------------------------------- echo, prompt_logprobs, text options

def _dense_log_softmax(live, ids) -> np.ndarray:
    """f32[len(ids), vocab]: the served model's log_softmax over a dense forward pass (no cache)."""
    logits = models.forward_dense(live.gpt, jnp.asarray([ids], jnp.int32))[0]
    return np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1))


def _fresh_prompt() -> str:
    """A fresh ASCII prompt with a two- and a three-byte character (tokens that are parts of one)."""
    rng = np.random.default_rng()
    words = ["".join(chr(97 + x) for x in rng.integers(0, 26, rng.integers(2, 8))) for _ in range(8)]
    return " ".join(words[:4]) + " é " + " ".join(words[4:]) + " €"


def test_echo_with_logprobs_and_no_tokens_scores_the_prompt(live):
    """lm-eval's loglikelihood request (echo, logprobs, max_tokens 0) with the openai client: the text
    is the prompt; its tokens' logprobs equal a dense forward pass (the first null); tokens join to
    the text and text_offset indexes it; nothing is generated or counted."""
    prompt = _fresh_prompt()
    ids = live.tok.encode(prompt)
    r = live.client.completions.create(model=NAME, prompt=prompt, echo=True, logprobs=3, max_tokens=0, temperature=0)
    (c,) = r.choices
    assert c.text == prompt and c.finish_reason == "length"
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 0
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == len(lp.top_logprobs) == len(ids)
    assert "".join(lp.tokens) == prompt and "\ufffd" not in prompt
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(ids))]
    lsm = _dense_log_softmax(live, ids)
    want = lsm[np.arange(len(ids) - 1), ids[1:]]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(want.tolist(), abs=1e-4)
    for row, top in zip(lsm[:-1], lp.top_logprobs[1:]):
        assert 1 <= len(top) <= 3 and max(top.values()) == pytest.approx(float(row.max()), abs=1e-4)
    # A token-id prompt echoes its decoded text, and the same scores.
    t = live.client.completions.create(model=NAME, prompt=ids, echo=True, logprobs=0, max_tokens=0)
    assert t.choices[0].text == prompt and t.choices[0].logprobs.token_logprobs == lp.token_logprobs
    assert t.choices[0].logprobs.top_logprobs is None
    # Streamed: one chunk with the prompt, its scores and finish_reason "length".
    text, tokens, offsets, lps = _stream_completion(live.url, {"model": NAME, "prompt": prompt, "echo": True,
                                                               "logprobs": 3, "max_tokens": 0})
    assert text == prompt and sum(tokens, []) == lp.tokens and sum(offsets, []) == lp.text_offset
    assert sum(lps, []) == lp.token_logprobs


def test_echo_with_a_completion(live):
    """echo with max_tokens > 0: the prompt's text, then the completion's; with logprobs the prompt's
    tokens come first and text_offset runs on into the completion's (offset by the prompt); the
    completion part equals the same request without echo; streamed alike."""
    prompt = _fresh_prompt()
    n = len(live.tok.encode(prompt))
    kw = dict(model=NAME, prompt=prompt, max_tokens=10, temperature=0, logprobs=2, extra_body={"ignore_eos": True})
    plain = live.client.completions.create(**kw).choices[0]
    c = live.client.completions.create(echo=True, **kw).choices[0]
    assert c.text == prompt + plain.text and c.finish_reason == plain.finish_reason == "length"
    lp, pl = c.logprobs, plain.logprobs
    assert "".join(lp.tokens) == c.text and lp.tokens[n:] == pl.tokens
    assert lp.token_logprobs[n:] == pytest.approx(pl.token_logprobs, abs=1e-5) and lp.token_logprobs[0] is None
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
    assert lp.text_offset[n:] == [len(prompt) + o for o in pl.text_offset]
    body = {k: v for k, v in kw.items() if k != "extra_body"} | {"ignore_eos": True, "echo": True}
    text, tokens, offsets, lps = _stream_completion(live.url, body)
    assert text == c.text and sum(tokens, []) == lp.tokens and sum(offsets, []) == lp.text_offset
    assert len(tokens) > 1   # the prompt came with the first chunk, the completion after it
    # Without logprobs: the text only; with n: every choice echoes.
    e = live.client.completions.create(model=NAME, prompt=prompt, max_tokens=10, temperature=0, echo=True, n=2,
                                       extra_body={"ignore_eos": True})
    assert [ch.text for ch in e.choices] == [prompt + plain.text] * 2 and e.choices[0].logprobs is None


def test_prompt_logprobs_field(live):
    """vLLM's prompt_logprobs extra field: per prompt token None (the first), then {token id:
    {logprob, rank, decoded_token}} with the prompt token first and the k most likely after it, equal
    to a dense forward pass; on each completion choice, once on a chat response; the completion is
    unchanged."""
    prompt = _fresh_prompt()
    ids = live.tok.encode(prompt)
    body = {"model": NAME, "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    plain = httpx.post(f"{live.url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    r = httpx.post(f"{live.url}/v1/completions", json={**body, "prompt_logprobs": 2, "n": 2}, timeout=60).json()
    a, b = sorted(r["choices"], key=lambda c: c["index"])
    assert a["text"] == b["text"] == plain["text"] and "prompt_logprobs" not in plain
    assert a["prompt_logprobs"] == b["prompt_logprobs"]

    def check(plp, ids, k):
        lsm = _dense_log_softmax(live, ids)
        assert len(plp) == len(ids) and plp[0] is None
        for p, d in enumerate(plp[1:]):
            t, row = ids[p + 1], lsm[p]
            keys = list(d)
            assert keys[0] == str(t) and len(d) in (k, k + 1)
            e = d[str(t)]
            assert e["logprob"] == pytest.approx(float(row[t]), abs=1e-4)
            assert int((row > row[t] + 1e-4).sum()) + 1 <= e["rank"] <= int((row >= row[t] - 1e-4).sum())
            assert e["decoded_token"] == live.tok.decode([t])
            tops = sorted((v["rank"], v["logprob"], float(row[int(key)])) for v, key in zip(d.values(), d)
                          if v["rank"] <= k)   # the top k (the prompt token among them when it ranks there)
            assert [x[0] for x in tops] == list(range(1, k + 1))
            for _, got, dense in tops:
                assert got == pytest.approx(dense, abs=1e-4)
            assert not tops or tops[0][1] == pytest.approx(float(row.max()), abs=1e-4)

    check(a["prompt_logprobs"], ids, 2)
    msgs = [{"role": "user", "content": prompt}]
    chat = httpx.post(f"{live.url}/v1/chat/completions", json={"model": NAME, "messages": msgs, "max_tokens": 3,
                                                               "prompt_logprobs": 0}, timeout=60).json()
    check(chat["prompt_logprobs"], live.tok.encode(live.tok.render_chat(msgs)), 0)
    assert all("prompt_logprobs" not in c for c in chat["choices"])


def test_include_stop_str_and_skip_special_tokens(live):
    """include_stop_str_in_output (and SGLang's no_stop_trim) keep the stop string that ended the
    text; skip_special_tokens false spells special tokens out in the text, the logprob tokens and
    the chat bytes."""
    for seed in range(20):
        kw = dict(model=NAME, prompt=PROMPTS[1], max_tokens=24, temperature=1.0, seed=seed)
        ref = live.client.completions.create(extra_body={"ignore_eos": True}, **kw).choices[0].text
        cuts = [i for i in range(2, len(ref)) if ref[i].isascii() and ref[i].isalnum() and ref.find(ref[i]) == i]
        if cuts:
            break
    cut = cuts[0]
    for extra in ({"include_stop_str_in_output": True}, {"no_stop_trim": True},
                  {"no_stop_trim": True, "include_stop_str_in_output": False}):
        keep = extra.get("include_stop_str_in_output", True)
        r = live.client.completions.create(stop=[ref[cut]], extra_body={"ignore_eos": True, **extra}, **kw)
        assert r.choices[0].text == ref[:cut + keep] and r.choices[0].finish_reason == "stop", extra
        chunks = list(live.client.completions.create(stop=ref[cut], stream=True,
                                                     extra_body={"ignore_eos": True, **extra}, **kw))
        assert "".join(c.choices[0].text for c in chunks) == ref[:cut + keep]
    pad = {str(live.tok.PAD): 100}
    kw = dict(model=NAME, prompt=PROMPTS[0], max_tokens=3, temperature=0, logit_bias=pad, logprobs=0)
    hidden = live.client.completions.create(**kw).choices[0]
    shown = live.client.completions.create(extra_body={"skip_special_tokens": False}, **kw).choices[0]
    assert hidden.text == "" and shown.text == "<pad>" * 3
    assert shown.logprobs.tokens == ["<pad>"] * 3 and shown.logprobs.text_offset == [0, 5, 10]
    chat = live.client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                               temperature=0, logit_bias=pad, logprobs=True,
                                               extra_body={"skip_special_tokens": False})
    assert chat.choices[0].message.content == "<pad>" * 2
    assert [t.bytes for t in chat.choices[0].logprobs.content] == [list(b"<pad>")] * 2
    # A final EOS is kept with include_stop_str_in_output (vLLM), spelled out without skipping.
    eos = {str(live.tok.EOS): 100}
    e = live.client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=3, temperature=0, logit_bias=eos,
                                       logprobs=0, extra_body={"skip_special_tokens": False,
                                                               "include_stop_str_in_output": True}).choices[0]
    assert e.text == "<eos>" and e.finish_reason == "stop" and e.logprobs.tokens == ["<eos>"]


def _raw_exchange(url, request: bytes, timeout=10.0) -> bytes:
    """Sends raw bytes on a fresh connection; returns everything the server sends until it closes."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(request)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def test_request_body_limit_is_413_before_reading(live):
    app = build_app(live.aengine, live.tok, model_name=NAME, max_request_bytes=4096)
    with serving(app) as url:
        # A declared 100 MB body: refused from its headers; the server does not wait for the body.
        t0 = time.monotonic()
        out = _raw_exchange(url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: 100000000\r\n\r\n{\"model\"")
        assert time.monotonic() - t0 < 5 and out.startswith(b"HTTP/1.1 413 "), out[:200]
        head, _, payload = out.partition(b"\r\n\r\n")
        assert b"x-request-id: " in head.lower()
        assert json.loads(payload)["error"]["code"] == "request_too_large"
        # A chunked body (no Content-Length) is counted as it arrives.
        r = httpx.post(f"{url}/v1/completions", content=iter([b" " * 2048] * 4),
                       headers={"content-type": "application/json"})
        _check_error(r, 413, None, "larger than this server accepts (4096 bytes)")
        # At the limit: served.
        body = json.dumps({"model": NAME, "prompt": "hi", "max_tokens": 2})
        body = body[:-1] + ', "user": "' + "u" * (4096 - len(body) - 12) + '"}'
        assert len(body) <= 4096
        assert httpx.post(f"{url}/v1/completions", content=body,
                          headers={"content-type": "application/json"}).status_code == 200
    # The default limit (8 MiB) on the live server.
    out = _raw_exchange(live.url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 9000000\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 413 "), out[:200]


class _SpyTokenizer:
    """The tokenizer, recording which thread encodes and renders (and how many characters)."""

    def __init__(self, tok):
        self.tok, self.calls = tok, []

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def encode(self, text):
        self.calls.append(("encode", threading.current_thread(), len(text)))
        return self.tok.encode(text)

    def render_chat(self, messages, **kw):
        self.calls.append(("render_chat", threading.current_thread(), 0))
        return self.tok.render_chat(messages, **kw)


def test_big_prompts_do_not_stall_the_server(live):
    """Parsing, rendering and tokenizing run on worker threads, never on the event loop; a prompt far
    beyond the context is refused without being tokenized; /health answers while an 11.5 MB prompt
    is handled (before: 1-2 s stalls of /health and of every stream)."""
    spy = _SpyTokenizer(live.tok)
    app = build_app(live.aengine, spy, model_name=NAME, max_request_bytes=20 * 2 ** 20)
    with serving(app) as url:
        spy.calls.clear()
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        assert client.completions.create(model=NAME, prompt="hi", max_tokens=2).choices
        assert client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=2).choices
        assert httpx.post(f"{url}/tokenize", json={"prompt": "hi"}).status_code == 200
        assert [c[0] for c in spy.calls] == ["encode", "render_chat", "encode", "encode"]
        # The loop's default executor names its workers asyncio_N (uvloop: uvloop_N); the loop runs elsewhere.
        assert all(c[1].name.startswith(("asyncio_", "uvloop_")) for c in spy.calls), \
            [(c[0], c[1].name) for c in spy.calls]
        spy.calls.clear()
        body = json.dumps({"model": NAME, "prompt": "word " * (11_500_000 // 5), "max_tokens": 4}).encode()
        request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        result, latencies = {}, []
        sender = threading.Thread(target=lambda: result.update(out=_raw_exchange(url, request, timeout=60)))
        with httpx.Client(base_url=url, timeout=30) as c:
            c.get("/health")
            sender.start()
            while sender.is_alive():
                t0 = time.monotonic()
                assert c.get("/health").status_code == 200
                latencies.append(time.monotonic() - t0)
                time.sleep(0.005)
            sender.join()
        out = result["out"]
        assert out.startswith(b"HTTP/1.1 400 ") and b"maximum context length is 2048 tokens" in out, out[:300]
        assert spy.calls == [], "the 11.5 MB prompt must be refused before it is tokenized"
        # Before the fix /health stalled 5.7 s (tokenization on the event loop). Parsing the 11.5 MB
        # JSON body on the worker thread still holds the GIL for about a second, and a loaded CI
        # machine measured 1.77 s once: the bound says "no multi-second stall", not a latency target.
        assert len(latencies) >= 3 and max(latencies) < 3.0, latencies


def test_idle_and_slow_connections_are_closed():
    """A connection that never sends a request, one that sends its head a byte at a time
    (slowloris), and an idle keep-alive connection are all closed within the timeouts."""
    app = FastAPI()

    @app.get("/ping")
    def ping():
        return {"ok": True}

    with serving(app, timeout_header=1.0, timeout_keep_alive=1.0) as url:
        port = int(url.rsplit(":", 1)[1])

        def closed_after(sock, trickle: bytes = b"", limit=6.0):
            """Seconds until the server closes `sock` (sending `trickle` one byte per 0.1 s meanwhile)."""
            sock.settimeout(0.1)
            t0 = time.monotonic()
            i = 0
            while time.monotonic() - t0 < limit:
                if i < len(trickle):
                    try:
                        sock.send(trickle[i:i + 1])
                    except OSError:
                        return time.monotonic() - t0
                    i += 1
                try:
                    data = sock.recv(4096)
                except TimeoutError:
                    continue
                except OSError:
                    return time.monotonic() - t0
                if not data:
                    return time.monotonic() - t0
            raise AssertionError(f"still open after {limit} s")

        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(20)]
        t0 = time.monotonic()
        for s in idle:
            assert closed_after(s, limit=6.0 - (time.monotonic() - t0)) >= 0
        assert 0.5 < time.monotonic() - t0 < 6
        for s in idle:
            s.close()
        with socket.create_connection(("127.0.0.1", port)) as s:   # slowloris
            assert 0.5 < closed_after(s, b"GET /ping HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100) < 4
        with socket.create_connection(("127.0.0.1", port)) as s:   # keep-alive, then idle
            s.sendall(b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n")
            assert s.recv(4096).startswith(b"HTTP/1.1 200 ")
            assert 0.5 < closed_after(s) < 4
        assert httpx.get(f"{url}/ping").json() == {"ok": True}
    # Connection limit: beyond it, requests are refused with 503.
    with serving(app, limit_concurrency=3) as url:
        port = int(url.rsplit(":", 1)[1])
        held = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
        time.sleep(0.2)
        assert httpx.get(f"{url}/ping").status_code == 503
        for s in held:
            s.close()
        time.sleep(0.2)
        assert httpx.get(f"{url}/ping").status_code == 200


def test_health_is_503_until_the_engine_is_attached(live):
    app = build_app(None, None, model_name=NAME)
    with serving(app) as url:
        r = httpx.get(f"{url}/health")
        assert r.status_code == 503 and r.json() == {"status": "loading"} and r.headers["retry-after"] == "1"
        for method, path, body in (("POST", "/v1/completions", {"model": NAME, "prompt": "hi"}),
                                   ("POST", "/v1/chat/completions", {"model": NAME, "messages": []}),
                                   ("GET", "/v1/models", None), ("POST", "/tokenize", {"prompt": "hi"})):
            r = httpx.request(method, f"{url}{path}", json=body)
            _check_error(r, 503, None, "loading")
            assert r.json()["error"]["code"] == "model_loading" and r.headers["retry-after"] == "1"
        assert httpx.get(f"{url}/version").status_code == 200
        m = httpx.get(f"{url}/metrics")
        assert m.status_code == 200 and "jpa_engine_alive 0.0" in m.text
        attach(app, live.aengine, live.tok)
        assert httpx.get(f"{url}/health").json() == {"status": "ok"}
        r = httpx.post(f"{url}/v1/completions", json={"model": NAME, "prompt": PROMPTS[0], **{
            k: v for k, v in GREEDY.items() if k != "extra_body"}, "ignore_eos": True})
        assert r.json()["choices"][0]["text"] == live.reference[PROMPTS[0]].completion
        with pytest.raises(RuntimeError, match="already has an engine"):
            attach(app, live.aengine, live.tok)


# ---------------------------------------------------------------------- endpoints and headers (vLLM's)

def test_tokenize_and_detokenize(live):
    text = "The paged cache: é€"
    r = httpx.post(f"{live.url}/tokenize", json={"model": NAME, "prompt": text})
    assert r.status_code == 200
    ids = live.tok.encode(text)
    assert r.json() == {"count": len(ids), "max_model_len": MAX_LEN, "tokens": ids, "token_strs": None}
    strs = httpx.post(f"{live.url}/tokenize", json={"prompt": text, "return_token_strs": True}).json()["token_strs"]
    assert len(strs) == len(ids) and strs[:3] == ["T", "h", "e"] and strs[-3:] == ["<0xE2>", "<0x82>", "<0xAC>"]
    # A conversation: the chat endpoint's prompt, token for token.
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    chat = httpx.post(f"{live.url}/tokenize", json={"model": NAME, "messages": msgs}).json()
    assert chat["tokens"] == live.tok.encode(live.tok.render_chat(msgs))
    used = live.client.chat.completions.create(model=NAME, messages=msgs, max_tokens=1).usage.prompt_tokens
    assert chat["count"] == used
    no_gen = httpx.post(f"{live.url}/tokenize", json={"messages": msgs, "add_generation_prompt": False}).json()
    assert no_gen["tokens"] == live.tok.encode(live.tok.render_chat(msgs, add_generation_prompt=False))
    assert no_gen["count"] < chat["count"]
    r = httpx.post(f"{live.url}/detokenize", json={"model": NAME, "tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": text}
    assert httpx.post(f"{live.url}/detokenize", json={"tokens": []}).json() == {"prompt": ""}
    for path, body, status, param, fragment in (
            ("/tokenize", {"model": "gpt-4", "prompt": "x"}, 404, "model", "does not exist"),
            ("/tokenize", {"prompt": 5}, 400, "prompt", "valid string"),
            ("/tokenize", {"messages": msgs, "add_special_tokens": True}, 400, "add_special_tokens", "not supported"),
            ("/tokenize", {"messages": msgs, "continue_final_message": True}, 400, "continue_final_message",
             "not supported"),
            ("/tokenize", {"messages": msgs, "chat_template": "{{ x }}"}, 400, "chat_template", "not supported"),
            ("/tokenize", {"messages": []}, 400, "messages", "at least 1 item"),
            ("/tokenize", {}, 400, "prompt", "'prompt' is required"),
            ("/tokenize", {"prompt": "x" * 50_000}, 400, "prompt", "maximum context length"),
            ("/detokenize", {"tokens": [1, 512]}, 400, "tokens", "token ids must be in [0, 512)"),
            ("/detokenize", {"tokens": [-1]}, 400, "tokens", "token ids must be in"),
            ("/detokenize", {"tokens": "1 2"}, 400, "tokens", "valid list"),
            ("/detokenize", {"model": "gpt-4", "tokens": [1]}, 404, "model", "does not exist")):
        _check_error(httpx.post(f"{live.url}{path}", json=body), status, param, fragment)


def test_version(live):
    import jpa
    assert httpx.get(f"{live.url}/version").json() == {"version": jpa.__version__}


def test_request_id_is_echoed(live):
    body = {"model": NAME, "prompt": "hi", "max_tokens": 2}
    r = httpx.post(f"{live.url}/v1/completions", json=body, headers={"X-Request-Id": "trace-42.a_b:c"})
    assert r.headers["x-request-id"] == "trace-42.a_b:c" and r.json()["id"] == "cmpl-trace-42.a_b:c"
    r = httpx.post(f"{live.url}/v1/completions", json=body)
    rid = r.headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", rid) and r.json()["id"] == f"cmpl-{rid}"
    for bad in ("x" * 129, "a b", "é"):     # too long, or characters a header should not carry back
        r = httpx.post(f"{live.url}/v1/completions", json=body, headers={"X-Request-Id": bad.encode()})
        assert re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"])
    # On errors and streams too.
    r = httpx.post(f"{live.url}/v1/completions", json={"model": NAME}, headers={"X-Request-Id": "e1"})
    assert r.status_code == 400 and r.headers["x-request-id"] == "e1"
    with httpx.stream("POST", f"{live.url}/v1/chat/completions", headers={"X-Request-Id": "s1"}, json={
            "model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}) as r:
        assert r.headers["x-request-id"] == "s1"
        first = next(line for line in r.iter_lines() if line.startswith("data: "))
        assert json.loads(first[6:])["id"] == "chatcmpl-s1"


def test_cors(live):
    app = build_app(live.aengine, live.tok, model_name=NAME, allowed_origins=["http://ui.example"], api_key="k")
    with serving(app) as url:
        pre = httpx.options(f"{url}/v1/chat/completions", headers={
            "Origin": "http://ui.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "http://ui.example"
        assert "POST" in pre.headers["access-control-allow-methods"]
        r = httpx.get(f"{url}/v1/models", headers={"Origin": "http://ui.example", "Authorization": "Bearer k"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://ui.example"
        assert "x-request-id" in r.headers["access-control-expose-headers"].lower()
        other = httpx.get(f"{url}/v1/models", headers={"Origin": "http://evil.example", "Authorization": "Bearer k"})
        assert "access-control-allow-origin" not in other.headers
        bad = httpx.options(f"{url}/v1/models", headers={"Origin": "http://evil.example",
                                                         "Access-Control-Request-Method": "GET"})
        assert bad.status_code == 400
    # Without --allowed-origins: no CORS headers at all.
    r = httpx.get(f"{live.url}/v1/models", headers={"Origin": "http://ui.example"})
    assert "access-control-allow-origin" not in r.headers


def test_vllm_metric_names(live):
    """jpa's metrics keep their names; vLLM's, which routers and autoscalers read, are added."""
    live.wait_idle()
    text = httpx.get(f"{live.url}/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
        assert re.search(rf'^{re.escape(name)}{{model_name="{NAME}"}} ', text, re.M), name
    m = live.metrics()
    label = f'{{model_name="{NAME}"}}'
    assert m[f"vllm:num_requests_running{label}"] == m["jpa_num_requests_running"] == 0
    assert m[f"vllm:kv_cache_usage_perc{label}"] == 0
    # A prompt of several pages, twice: the second finds its full pages in the prefix cache.
    prompt = "prefix caching counts " * 4     # 88 tokens: 5 full pages of 16
    before = m
    for _ in range(2):
        live.client.completions.create(model=NAME, prompt=prompt, max_tokens=2)
    after = live.wait_idle()
    q, h = f"vllm:prefix_cache_queries_total{label}", f"vllm:prefix_cache_hits_total{label}"
    assert after[q] - before[q] == 2 * 88
    assert after[h] - before[h] >= 5 * 16
    # While a long request runs: one running, pages in use.
    async def main():
        async with httpx.AsyncClient(base_url=live.url, timeout=30) as client:
            ctx, _lines = await _first_chunk(client, LONG)
            m = live.metrics()
            await ctx.__aexit__(None, None, None)
            return m
    during = asyncio.run(main())
    assert during[f"vllm:num_requests_running{label}"] == 1
    usage = during[f"vllm:kv_cache_usage_perc{label}"]
    assert usage > 0 and usage == pytest.approx(during["jpa_kv_pages_used"] / during["jpa_kv_pages_total"])
    live.wait_idle()


# ---------------------------------------------------------------------- overload, disconnects, keys

LONG = {"model": NAME, "prompt": "a long one", "max_tokens": 2000, "ignore_eos": True, "temperature": 0}


async def _first_chunk(client, body):
    """Opens a stream and returns (its context, its line iterator) after the first data line.
    Keep both: a line iterator that is garbage-collected closes the response (a disconnect)."""
    ctx = client.stream("POST", "/v1/completions", json={**body, "stream": True})
    resp = await ctx.__aenter__()
    assert resp.status_code == 200
    lines = resp.aiter_lines()
    while not (await lines.__anext__()).startswith("data: "):
        pass
    return ctx, lines


def test_overload_is_503_with_retry_after(live):
    """8 slots run, 2 wait (max_waiting 2): the next request is refused with 503 + Retry-After;
    the accepted ones are unaffected and, once closed, leave nothing behind."""
    async def main():
        async with httpx.AsyncClient(base_url=live.url, timeout=30) as client:
            streams = [await _first_chunk(client, LONG) for _ in range(8)]
            waiting = [asyncio.ensure_future(client.post("/v1/completions", json={**LONG, "max_tokens": 4}))
                       for _ in range(2)]
            while live.aengine.snapshot.num_waiting < 2:
                await asyncio.sleep(0.005)
            r = await client.post("/v1/completions", json={**LONG, "max_tokens": 4})
            _check_error(r, 503, None, "overloaded")
            assert r.headers["retry-after"] == "1"
            assert live.aengine.snapshot.num_running == 8
            for ctx, _ in streams:
                await ctx.__aexit__(None, None, None)
            done = await asyncio.gather(*waiting)
            assert [d.status_code for d in done] == [200, 200]

    old, live.aengine.max_waiting = live.aengine.max_waiting, 2
    try:
        asyncio.run(main())
    finally:
        live.aengine.max_waiting = old
    live.wait_idle()
    assert httpx.get(f"{live.url}/health").status_code == 200


def test_disconnect_mid_stream_releases_pages(live):
    before = live.wait_idle()

    async def main():
        async with httpx.AsyncClient(base_url=live.url, timeout=30) as client:
            ctx, _lines = await _first_chunk(client, LONG)
            assert live.metrics()["jpa_kv_pages_used"] > 0
            await ctx.__aexit__(None, None, None)   # the client goes away mid-stream
    asyncio.run(main())
    after = live.wait_idle()
    assert after["jpa_last_abort_release_rounds"] in (0, 1), "pages back within one engine round"
    assert after['jpa_requests_total{finish_reason="abort"}'] == \
        before.get('jpa_requests_total{finish_reason="abort"}', 0) + 1
    assert after["jpa_generation_tokens_total"] - before["jpa_generation_tokens_total"] < LONG["max_tokens"]


def test_disconnect_while_waiting_for_a_non_streamed_answer(live):
    before = live.wait_idle()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{live.url}/v1/completions", json={**LONG, "prompt": "x"}, timeout=0.3)
    after = live.wait_idle()
    assert after['jpa_requests_total{finish_reason="abort"}'] == \
        before.get('jpa_requests_total{finish_reason="abort"}', 0) + 1
    assert after["jpa_generation_tokens_total"] - before["jpa_generation_tokens_total"] < LONG["max_tokens"]


def test_api_key(live):
    app = build_app(live.aengine, live.tok, model_name=NAME, api_key="s3cret")
    with serving(app) as url:
        body = {"model": NAME, "prompt": "hi", "max_tokens": 2}
        _check_error(httpx.post(f"{url}/v1/completions", json=body), 401, None, "API key")
        _check_error(httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer nope"}), 401, None, "API key")
        _check_error(httpx.get(f"{url}/metrics"), 401, None, "API key")
        assert httpx.get(f"{url}/health").status_code == 200
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret", max_retries=0)
        assert client.completions.create(**body).choices[0].finish_reason in ("stop", "length")
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()


# ---------------------------------------------------------------------- load

def test_load_streamed_equals_non_streamed(live):
    """Concurrent clients (JPA_LOAD_CLIENTS, default 16) each stream JPA_LOAD_REQUESTS (default 2)
    greedy requests and fetch the same ones without streaming: no errors, streamed text ==
    non-streamed text (no lost or duplicated tokens), pool whole afterwards, server healthy."""
    clients = int(os.environ.get("JPA_LOAD_CLIENTS", "16"))
    per_client = int(os.environ.get("JPA_LOAD_REQUESTS", "2"))
    words = ["paged", "cache", "jax", "slot", "token", "page", "batch", "stream"]

    async def one(client, c, k):
        prompt = f"{words[c % 8]} {words[k % 8]} request {c}.{k}"
        body = {"model": NAME, "prompt": prompt, "max_tokens": 8 + (c * 7 + k) % 24, "temperature": 0,
                "ignore_eos": True}
        text, reasons, tokens = "", [], 0
        async with client.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                                   "stream_options": {"include_usage": True}}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                if chunk["choices"]:
                    text += chunk["choices"][0]["text"]
                    reasons += [chunk["choices"][0]["finish_reason"]] if chunk["choices"][0]["finish_reason"] else []
                else:
                    tokens = chunk["usage"]["completion_tokens"]
        plain = (await client.post("/v1/completions", json=body)).json()
        assert text == plain["choices"][0]["text"], (prompt, text, plain)
        assert reasons == ["length"] and tokens == body["max_tokens"] == plain["usage"]["completion_tokens"]
        return 1

    async def client_loop(c):
        async with httpx.AsyncClient(base_url=live.url, timeout=120) as client:
            return sum([await one(client, c, k) for k in range(per_client)])

    async def main():
        return await asyncio.gather(*(client_loop(c) for c in range(clients)))

    errors_before = sum(v for k, v in live.metrics().items() if k.startswith("jpa_http_errors_total"))
    old, live.aengine.max_waiting = live.aengine.max_waiting, max(live.aengine.max_waiting, clients)
    try:   # each client has one request in flight: the queue must hold them all (no 503 here)
        assert sum(asyncio.run(asyncio.wait_for(main(), timeout=300))) == clients * per_client
    finally:
        live.aengine.max_waiting = old
    m = live.wait_idle()
    assert m["jpa_kv_pages_used"] == 0 and m["jpa_kv_pool_whole"] == 1
    assert sum(v for k, v in m.items() if k.startswith("jpa_http_errors_total")) == errors_before
    assert httpx.get(f"{live.url}/health").json() == {"status": "ok"}


# ---------------------------------------------------------------------- the script

@pytest.mark.soak
def test_serve_script_bad_flags(capsys):
    """A bad flag is one line on stderr and exit code 2: checked in this process (jpa.cli.serve.main),
    and through the `jpa serve` command for the model name and a busy port (both found after parsing)."""
    from jpa.cli import serve

    sigterm = signal.getsignal(signal.SIGTERM)   # main() installs its own handler
    try:
        for args, msg in ((["--port", "70000"], "--port must be in"), (["--max-seqs", "0"], "--max-seqs must be >= 1"),
                          (["--max-request-bytes", "0"], "--max-request-bytes must be >= 1"),
                          (["--timeout-header", "0"], "--timeout-header must be a positive number"),
                          (["--timeout-keep-alive", "-1"], "--timeout-keep-alive must be a positive number"),
                          (["--limit-concurrency", "0"], "--limit-concurrency must be >= 1"),
                          (["--allowed-origins", "[1]"], "--allowed-origins must be a list of origin strings"),
                          (["--allowed-origins", "[oops"], "--allowed-origins: not a JSON list"),
                          (["--speculative-config", '{"method": "ngram", "k": 4}'], "unknown speculative config key")):
            rc = serve.main(args)
            err = capsys.readouterr().err
            assert rc == 2 and err.strip().count("\n") == 0 and msg in err, (args, err)
    finally:
        signal.signal(signal.SIGTERM, sigterm)
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    for args, msg in ((["--model", "nope"], "--model 'nope' is unknown"),
                      (["--model", "tiny-llama", "--port", str(busy.getsockname()[1])], "Address already in use")):
        r = subprocess.run([sys.executable, "-m", "jpa", "serve", *args], cwd=ROOT, capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
        assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and msg in r.stderr, r.stderr
    busy.close()


@pytest.mark.bench
def test_serve_script_stops_while_loading(tmp_path):
    """SIGTERM while the model loads (JAX busy on the loader thread): a clean exit, code 0."""
    env = fast_compile_env({**os.environ, "PYTHONPATH": str(ROOT), "JPA_CACHE_DIR": str(tmp_path), "JAX_PLATFORMS": "cpu"})
    proc = subprocess.Popen([sys.executable, "-m", "jpa", "serve", "--model", "tiny-llama", "--port", "0",
                             "--max-model-len", "128", "--num-pages", "64"],
                            cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    try:
        assert "serving 'tiny-llama'" in proc.stderr.readline()
        assert "[jpa] loading tiny-llama" in proc.stderr.readline()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert "server stopped (while loading the model)" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_script_allowed_origins():
    from jpa.cli import serve

    assert serve.parse_origins(None) == []
    assert serve.parse_origins("http://a.example, http://b.example") == ["http://a.example", "http://b.example"]
    assert serve.parse_origins('["*"]') == ["*"]
    with pytest.raises(serve.UsageError, match="at least one origin"):
        serve.parse_origins(" , ")


@pytest.mark.bench
def test_serve_script_end_to_end(tmp_path):
    """`jpa serve --port 0` on loopback: listens at once and answers /health 503 (and
    requests 503 with Retry-After) while the model loads and compiles, then 200; serves a request;
    stops cleanly on SIGTERM."""
    env = fast_compile_env({**os.environ, "PYTHONPATH": str(ROOT), "JPA_CACHE_DIR": str(tmp_path), "JAX_PLATFORMS": "cpu"})
    proc = subprocess.Popen([sys.executable, "-m", "jpa", "serve", "--model", "tiny-llama", "--port", "0",
                             "--max-model-len", "128", "--num-pages", "64"],
                            cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    try:
        url = None
        for line in proc.stderr:
            m = re.search(r"serving 'tiny-llama' on (http://127\.0\.0\.1:\d+)", line)
            if m:
                url = m.group(1)
                break
        assert url, "the server did not say where it listens"
        # The loader thread has just started (importing JAX alone takes seconds): still loading.
        r = httpx.get(f"{url}/health", timeout=10)
        assert r.status_code == 503 and r.json() == {"status": "loading"} and r.headers["retry-after"] == "1"
        r = httpx.post(f"{url}/v1/completions", json={"model": "tiny-llama", "prompt": "hi"}, timeout=10)
        _check_error(r, 503, None, "loading")
        assert r.json()["error"]["code"] == "model_loading" and r.headers["retry-after"] == "1"
        t0 = time.monotonic()
        while httpx.get(f"{url}/health", timeout=10).status_code != 200:
            assert proc.poll() is None and time.monotonic() - t0 < 240, "the model never became ready"
            time.sleep(0.1)
        r = httpx.post(f"{url}/v1/completions", json={"model": "tiny-llama", "prompt": "hi", "max_tokens": 3},
                       timeout=120)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert "server stopped" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
