"""LoRA adapters in the engine (jpa.engine.lora): LLM(enable_lora=True) with LoRARequest per request against
transformers + peft, a batch mixing adapters and the base against each run alone, LRU swapping beyond
max_loras, the prefix cache keyed by adapter, loading and unloading with no compile, and the errors."""

import json
import pathlib
import shutil

import jax
import numpy as np
import pytest

from jpa import LLM, LoRARequest, SamplingParams
from jpa.engine import EngineConfig

from lora_data import ADAPTERS, DATA, GOLDEN, GREEDY, LORAS, NAMES  # noqa: E402
TOL = 2e-3


class Compiles:
    """Counts XLA backend compiles of this process while alive (JAX's monitoring event)."""

    def __init__(self):
        self.n = 0
        jax.monitoring.register_event_duration_secs_listener(self._on)

    def _on(self, event, _secs, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            self.n += 1


COMPILES = Compiles()


@pytest.fixture(scope="module")
def llm():
    # two device slots for four adapters: every mixed batch below swaps adapters in and out (LRU)
    return LLM(str(DATA / "llama"), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8, max_seqs=8,
               max_num_batched_tokens=64, num_pages=96, page_size=8, steps_per_call=4)


def _prompts():
    return [p["ids"] for p in GOLDEN["prompts"].values()], list(GOLDEN["prompts"])


def _check(out, who, key):
    g = GOLDEN["greedy"][who][key]
    assert list(out.token_ids) == g["ids"], (who, key)
    np.testing.assert_allclose(out.logprobs, g["logprobs"], atol=TOL, err_msg=f"{who} {key}")


def test_mixed_batch_matches_peft_and_each_alone_with_lru_swaps(llm):
    """Every adapter and the base over every prompt in ONE generate call (4 adapters, 2 device slots: they
    swap in LRU while the batch runs): each output is transformers + peft's greedy tokens with logprobs
    within 2e-3, and equal to the same request run alone."""
    ids, keys = _prompts()
    whos = ["base"] + NAMES
    prompts = [p for _ in whos for p in ids]
    loras = [None if w == "base" else LORAS[w] for w in whos for _ in ids]
    loads = llm.engine.loras.loads
    outs = llm.generate(prompts, GREEDY, lora_request=loras)
    assert llm.engine.loras.loads - loads >= len(NAMES) > llm.engine.config.max_loras   # swapped in and out
    for i, out in enumerate(outs):
        _check(out, whos[i // len(ids)], keys[i % len(ids)])
    for who in ("all_r8_rs", "base"):
        alone = llm.generate([ids[0]], GREEDY, lora_request=None if who == "base" else LORAS[who])[0]
        mixed = outs[whos.index(who) * len(ids)]
        assert alone.token_ids == mixed.token_ids
        np.testing.assert_allclose(alone.logprobs, mixed.logprobs, atol=1e-5)
    assert llm.engine.pool_is_whole()


def test_prefix_cache_hit_never_crosses_adapters(llm):
    """A long prompt computed with one adapter is a prefix-cache hit for the same adapter only: another
    adapter (and the base) recompute it and still give their own golden-consistent tokens."""
    long = list(range(200, 240))   # a prompt no other test computes
    first = llm.generate([long], GREEDY, lora_request=LORAS["qv_r4"])[0]
    again = llm.generate([long], GREEDY, lora_request=LORAS["qv_r4"])[0]
    other = llm.generate([long], GREEDY, lora_request=LORAS["mlp_r2"])[0]
    base = llm.generate([long], GREEDY)[0]
    assert again.num_cached_tokens > 0 and again.token_ids == first.token_ids
    assert other.num_cached_tokens == 0 and base.num_cached_tokens == 0
    assert other.token_ids != first.token_ids


def test_load_and_unload_never_compile(llm, tmp_path):
    """After the step is compiled, loading a new adapter, running it beside others, and unloading it runs
    no XLA compile at all (the step's trace count and the process's backend compiles unchanged)."""
    ids, _ = _prompts()
    llm.generate([ids[0]], GREEDY, lora_request=LORAS["ko_r6"])   # compiled (and warm) before counting
    shutil.copytree(ADAPTERS / "ko_r6", tmp_path / "copy")
    new = LoRARequest("ko_copy", 99, str(tmp_path / "copy"))
    traces, compiles = llm.engine.runner.step_traces, COMPILES.n
    llm.engine.load_lora(new)
    outs = llm.generate([ids[0], ids[1], ids[0]], GREEDY, lora_request=[new, LORAS["qv_r4"], None])
    llm.engine.unload_lora("ko_copy")
    assert (llm.engine.runner.step_traces, COMPILES.n) == (traces, compiles)
    _check(outs[0], "ko_r6", "plain")
    assert "ko_copy" not in llm.engine.lora_names()


def test_update_adapter_in_place_no_compile_and_no_stale_prefix(llm, tmp_path):
    """`update_lora` replaces a loaded adapter's weights in its slot (an RL trainer's update): the next request
    runs the new weights (another adapter's golden tokens), nothing compiles, the prefix cache does not serve KV
    of the old weights, and an adapter in use is refused."""
    ids, keys = _prompts()
    shutil.copytree(ADAPTERS / "mlp_r2", tmp_path / "rl")
    rl = LoRARequest("rl", 77, str(tmp_path / "rl"))
    long = ids[1] + list(range(100, 130))
    before = llm.generate([ids[1], long], GREEDY, lora_request=rl)
    _check(before[0], "mlp_r2", keys[1])
    traces, compiles = llm.engine.runner.step_traces, COMPILES.n
    llm.engine.update_lora("rl", str(ADAPTERS / "qv_r4"))
    after = llm.generate([ids[1], long], GREEDY, lora_request=rl)   # the old LoRARequest: same id, new weights
    assert (llm.engine.runner.step_traces, COMPILES.n) == (traces, compiles)
    _check(after[0], "qv_r4", keys[1])
    assert after[1].num_cached_tokens == 0   # the long prompt's pages were computed with the old weights
    llm.engine.add_request(ids[0], GREEDY, lora_request=rl)
    with pytest.raises(ValueError, match="used by 1 unfinished request"):
        llm.engine.update_lora("rl", str(ADAPTERS / "mlp_r2"))
    while llm.engine.has_unfinished:
        llm.engine.step()
    with pytest.raises(ValueError, match="above max_lora_rank=8"):
        big = tmp_path / "big"
        shutil.copytree(ADAPTERS / "qv_r4", big)
        cfg = json.loads((big / "adapter_config.json").read_text())
        (big / "adapter_config.json").write_text(json.dumps({**cfg, "r": 12}))
        llm.engine.update_lora("rl", str(big))
    _check(llm.generate([ids[1]], GREEDY, lora_request=rl)[0], "qv_r4", keys[1])   # unchanged by the failure
    llm.engine.unload_lora("rl")


def test_lora_errors(llm, tmp_path):
    out = llm.generate([[1, 2, 3]], GREEDY, lora_request=LoRARequest("big", 60, str(tmp_path / "big")))[0]
    assert out.finish_reason == "error" and "must be a directory holding adapter_config.json" in out.error
    with pytest.raises(ValueError, match="needs an engine with enable_lora=True"):
        LLM(str(DATA / "llama"), dtype="float32", num_pages=16, max_seqs=2).generate(
            ["x"], GREEDY, lora_request=LORAS["qv_r4"])
    with pytest.raises(ValueError, match="lora_int_id 1 is adapter"):
        llm.engine.load_lora(LoRARequest("other", 1, str(ADAPTERS / "mlp_r2")))
    with pytest.raises(ValueError, match="no LoRA adapter named 'nope'"):
        llm.engine.unload_lora("nope")
    with pytest.raises(ValueError, match="has no adapter_config.json"):
        llm.engine.load_lora(LoRARequest("empty", 50, str(tmp_path)))
    with pytest.raises(ValueError, match="lora_int_id must be an int >= 1"):
        LoRARequest("x", 0, "/p")
    with pytest.raises(ValueError, match="max_loras must be an int >= 1"):
        EngineConfig(enable_lora=True, max_loras=0)


def test_parallel_samples_and_structured_outputs_with_an_adapter(llm):
    """n = 2 greedy samples with an adapter both give peft's tokens; a structured (choice) request with an
    adapter gives one of the choices."""
    ids, keys = _prompts()
    out = llm.generate([ids[1]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, n=2),
                       lora_request=LORAS["all_r8_rs"])[0]
    for sample in out.outputs:
        assert list(sample.token_ids) == GOLDEN["greedy"]["all_r8_rs"][keys[1]]["ids"]
    choices = ["red", "blue"]
    text = llm.generate(["Name a color:"], SamplingParams(max_tokens=8, temperature=0,
                                                          structured={"choice": choices}),
                        lora_request=LORAS["mlp_r2"])[0]
    assert text.completion in choices


@pytest.mark.bench
def test_ngram_speculation_with_adapters():
    """Speculative decoding (n-gram) with adapters: the verify passes run each row's adapter, so the outputs
    are still transformers + peft's (4 adapters and the base mixed, 2 device slots). A prompt that repeats
    itself gives the n-gram proposer drafts to verify."""
    spec = dict(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3, verify_rows=16)
    llm = LLM(str(DATA / "llama"), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8, max_seqs=8,
              max_num_batched_tokens=64, num_pages=96, page_size=8, steps_per_call=4, speculative=spec)
    ids, keys = _prompts()
    whos = ["base"] + NAMES
    outs = llm.generate([p for _ in whos for p in ids], GREEDY,
                        lora_request=[None if w == "base" else LORAS[w] for w in whos for _ in ids])
    for i, out in enumerate(outs):
        _check(out, whos[i // len(ids)], keys[i % len(ids)])
    assert llm.engine.stats.spec_draft_tokens > 0   # the verify passes ran (with their adapters)


def test_server_adapters_by_model_name_load_unload_and_errors(llm, tmp_path):
    """The OpenAI server over the module's engine (no compile of its own): `model` names an adapter (the real
    openai client), /v1/models lists the adapters, POST /v1/load_lora_adapter and /v1/unload_lora_adapter
    (behind the API key) change them while serving with no compile, and bad requests are clear 4xx."""
    import httpx
    import openai
    from server_util import serving

    from jpa.engine import AsyncEngine
    from jpa.server import build_app

    key, ids = "sekret", _prompts()[0]
    tok = llm.tokenizer
    eng = llm.engine
    for name in list(eng.lora_names()):
        eng.unload_lora(name)
    eng.load_lora(LORAS["qv_r4"])
    with AsyncEngine(eng, max_waiting=16) as aengine, serving(build_app(aengine, tok, model_name="llama",
                                                                       api_key=key)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key)
        raw = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60)

        def complete(model, key_="plain"):
            r = client.completions.create(model=model, prompt=GOLDEN["prompts"][key_]["ids"], max_tokens=8,
                                          temperature=0, logprobs=1, extra_body={"ignore_eos": True})
            g = GOLDEN["greedy"][model if model != "llama" else "base"][key_]
            assert r.choices[0].text == tok.decode(g["ids"]) and r.model == model, model
            np.testing.assert_allclose(r.choices[0].logprobs.token_logprobs, g["logprobs"], atol=TOL)

        assert [m.id for m in client.models.list().data] == ["llama", "qv_r4"]
        complete("qv_r4")
        complete("llama")
        traces, compiles = eng.runner.step_traces, COMPILES.n
        r = raw.post("/v1/load_lora_adapter", json={"lora_name": "mlp_r2", "lora_path": str(ADAPTERS / "mlp_r2")})
        assert r.status_code == 200, r.text
        complete("mlp_r2", "code")
        r = raw.post("/v1/load_lora_adapter", json={"lora_name": "mlp_r2", "lora_path": str(ADAPTERS / "ko_r6"),
                                                    "load_inplace": True})
        assert r.status_code == 200, r.text
        complete_as = client.completions.create(model="mlp_r2", prompt=GOLDEN["prompts"]["code"]["ids"],
                                                max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
        assert complete_as.choices[0].text == tok.decode(GOLDEN["greedy"]["ko_r6"]["code"]["ids"])
        assert raw.post("/v1/unload_lora_adapter", json={"lora_name": "qv_r4"}).status_code == 200
        assert (eng.runner.step_traces, COMPILES.n) == (traces, compiles)
        assert [m.id for m in client.models.list().data] == ["llama", "mlp_r2"]

        bad = tmp_path / "bad"
        shutil.copytree(ADAPTERS / "qv_r4", bad)
        (bad / "adapter_model.safetensors").write_bytes(b"\x08\x00\x00\x00garbage!")
        big = tmp_path / "big"
        shutil.copytree(ADAPTERS / "qv_r4", big)
        cfg = json.loads((big / "adapter_config.json").read_text())
        (big / "adapter_config.json").write_text(json.dumps({**cfg, "r": 12}))
        lmh = tmp_path / "lmh"
        shutil.copytree(ADAPTERS / "qv_r4", lmh)
        (lmh / "adapter_config.json").write_text(json.dumps({**cfg, "target_modules": ["q_proj", "lm_head"]}))
        for body, status, text in [
                ({"lora_name": "x", "lora_path": str(bad)}, 400, "cannot be read as safetensors"),
                ({"lora_name": "x", "lora_path": str(big)}, 400, "above max_lora_rank=8"),
                ({"lora_name": "x", "lora_path": str(lmh)}, 400, "targets ['lm_head']"),
                ({"lora_name": "x", "lora_path": str(tmp_path / "none")}, 400, "does not exist"),
                ({"lora_name": "mlp_r2", "lora_path": str(bad)}, 400, "is taken"),
                ({"lora_path": str(bad)}, 400, "'lora_name' must be a non-empty string")]:
            r = raw.post("/v1/load_lora_adapter", json=body)
            assert r.status_code == status and text in r.json()["error"]["message"], (body, r.text)
        r = raw.post("/v1/unload_lora_adapter", json={"lora_name": "qv_r4"})
        assert r.status_code == 404 and "no LoRA adapter named 'qv_r4'" in r.json()["error"]["message"]
        r = raw.post("/v1/completions", json={"model": "qv_r4", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 404 and "'qv_r4' does not exist" in r.json()["error"]["message"]
        r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "y", "lora_path": str(bad)})
        assert r.status_code == 401


def test_serve_lora_flags():
    """`jpa serve --enable-lora --lora-modules NAME=PATH ... --max-loras N --max-lora-rank R` parse into the
    engine config and the adapters to load; malformed or inconsistent flags are one-line usage errors."""
    from jpa.args import UsageError
    from jpa.cli.serve import parse_args

    args = parse_args(["--model", "tiny-llama", "--enable-lora", "--lora-modules", "a=/x", "b=/y/z",
                       "--max-loras", "3", "--max-lora-rank", "8"])
    cfg = args.engine.engine_config()
    assert (cfg.enable_lora, cfg.max_loras, cfg.max_lora_rank) == (True, 3, 8)
    assert args.lora_modules == [("a", "/x"), ("b", "/y/z")]
    for argv, match in [(["--lora-modules", "a=/x"], "--lora-modules needs --enable-lora"),
                        (["--enable-lora", "--lora-modules", "a"], "NAME=PATH pairs"),
                        (["--enable-lora", "--lora-modules", "a=/x", "a=/y"], "names 'a' twice"),
                        (["--enable-lora", "--max-loras", "0"], "--max-loras must be >= 1"),
                        (["--enable-lora", "--max-lora-rank", "0"], "--max-lora-rank must be >= 1")]:
        with pytest.raises(UsageError, match=match):
            parse_args(["--model", "tiny-llama", *argv])


@pytest.mark.bench
def test_jpa_serve_command_with_lora_modules():
    """`jpa serve --enable-lora --lora-modules` as a process: the adapter is listed and served by name."""
    import os
    import subprocess
    import sys
    import time

    import httpx

    from jpa.testing.procs import fast_compile_env

    root = pathlib.Path(__file__).parents[1]
    proc = subprocess.Popen([sys.executable, "-m", "jpa", "serve", "--model", str(DATA / "llama"), "--port", "0",
                             "--dtype", "float32", "--num-pages", "64", "--max-seqs", "4", "--step-shapes", "off",
                             "--enable-lora", "--max-lora-rank", "8", "--lora-modules",
                             f"qv_r4={ADAPTERS / 'qv_r4'}", "--no-compile-cache"],
                            cwd=root, env={**os.environ, **fast_compile_env()}, stderr=subprocess.PIPE, text=True)
    try:
        url = None
        t0 = time.monotonic()
        while url is None and time.monotonic() - t0 < 120:
            line = proc.stderr.readline()
            if "http://" in line:
                url = "http://" + line.split("http://", 1)[1].split()[0].rstrip(".,")
        assert url, "the server did not say where it listens"
        while time.monotonic() - t0 < 300 and httpx.get(f"{url}/health").status_code != 200:
            time.sleep(0.5)
        assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == ["llama", "qv_r4"]
        g = GOLDEN["greedy"]["qv_r4"]["plain"]
        r = httpx.post(f"{url}/v1/completions", json={"model": "qv_r4", "prompt": GOLDEN["prompts"]["plain"]["ids"],
                                                      "max_tokens": 8, "temperature": 0, "ignore_eos": True},
                       timeout=120)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == len(g["ids"]), r.text
    finally:
        proc.terminate()
        proc.wait(60)
