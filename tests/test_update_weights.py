"""Weight updates in place (`update_weights`, issue 53): a served engine given new weights equals, bitwise,
an engine loaded fresh from a checkpoint holding them; updating back gives the first outputs again; no
compile across updates; old buffers are freed; a refused update changes nothing; tokens in flight report
the version of the weights that produced them. Then pause_generation / resume_generation / update_weights
on the AsyncEngine, and the server's POST /pause, /resume and /update_weights behind the API key (one
module: every engine here runs one compiled step)."""

import asyncio
import pathlib
import shutil
import time

import httpx
import jax
import numpy as np
import openai
import pytest
from safetensors.numpy import save_file

from jpa import LLM, SamplingParams
from jpa.engine import AsyncEngine, EngineConfig
from jpa.llm import build_engine
from jpa.models import hf
from server_util import serving

KEY = "sk-admin"

DATA = pathlib.Path(__file__).parent / "data" / "hf" / "llama"
ENGINE = dict(max_seqs=4, page_size=8, num_pages=64, max_num_batched_tokens=32, steps_per_call=4, watermark=0.0)


def perturbed(rng, tensors, scale=0.5):
    """The checkpoint's tensors with random noise added (float32)."""
    return {k: (np.asarray(v, np.float32) * (1 + scale * rng.standard_normal(v.shape))).astype(np.float32)
            for k, v in tensors.items()}


def checkpoint(tmp_path, tensors, name="b"):
    """DATA's checkpoint directory with `tensors` as its weights."""
    dst = tmp_path / name
    shutil.copytree(DATA, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json", "golden*"))
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def workload(rng, n=6):
    """Prompts that share prefixes (a stale prefix-cache hit would show) with greedy and seeded sampling."""
    base = rng.integers(3, 300, 20).tolist()
    prompts = [base[: int(rng.integers(9, 20))] + rng.integers(3, 300, int(rng.integers(1, 6))).tolist()
               for _ in range(n)]
    params = [SamplingParams(max_tokens=int(rng.integers(4, 12)), temperature=0.0 if i % 2 else 1.0,
                             seed=int(rng.integers(1 << 30)), logprobs=1, ignore_eos=True) for i in range(n)]
    return prompts, params


def result(outs):
    return [(o.token_ids, o.logprobs) for o in outs]


@pytest.fixture(scope="module")
def tensors():
    return hf.read_tensors(DATA)


def test_update_equals_a_fresh_engine_and_back(tmp_path, tensors):
    rng = np.random.default_rng()
    new = perturbed(rng, tensors)
    prompts, params = workload(rng)
    llm = LLM(DATA, **ENGINE)
    first = llm.generate(prompts, params)
    assert {o.weight_version for o in first} == {0}
    path = checkpoint(tmp_path, new)
    assert llm.update_weights(path) == 1     # a safetensors directory of Hugging Face names
    got = llm.generate(prompts, params)
    fresh = LLM(path, **ENGINE).generate(prompts, params)
    assert result(got) == result(fresh) and result(got) != result(first)
    assert {o.weight_version for o in got} == {1} and all(o.weight_versions is None for o in got)
    assert llm.update_weights(dict(tensors)) == 2   # a mapping of names: back to the first weights
    assert result(llm.generate(prompts, params)) == result(first)
    assert llm.engine.summary()["step_compiles"] == 1
    assert llm.engine.pool_is_whole()


@pytest.mark.bench   # a compile of its own (the int8 step): about 10 s
def test_int8_served_model_is_quantized_the_same_way(tmp_path, tensors):
    rng = np.random.default_rng()
    new = perturbed(rng, tensors)
    prompts, params = workload(rng, 4)
    llm = LLM(DATA, quantization="int8", **ENGINE)
    llm.update_weights(new)
    fresh = LLM(checkpoint(tmp_path, new), quantization="int8", **ENGINE)
    assert result(llm.generate(prompts, params)) == result(fresh.generate(prompts, params))
    assert llm.engine.runner.params["layers"]["wq"][...].dtype == np.int8


def test_partial_update_and_pytree_update(tensors):
    """Some tensors only: the others keep their values. The model's own pytree works as well (cast to
    the served dtype), and a pytree leaf already in place is used without a copy."""
    rng = np.random.default_rng()
    llm = LLM(DATA, **ENGINE)
    eng = llm.engine
    before = jax.tree.map(np.asarray, eng.model.params)
    name = "model.layers.1.mlp.down_proj.weight"
    w = rng.standard_normal(tensors[name].shape).astype(np.float32)
    llm.update_weights({name: w})
    after = jax.tree.map(np.asarray, eng.model.params)
    np.testing.assert_array_equal(after["layers"]["w_down"][...][1], w.T)
    np.testing.assert_array_equal(after["layers"]["w_down"][...][0], before["layers"]["w_down"][...][0])
    np.testing.assert_array_equal(after["layers"]["wq"][...], before["layers"]["wq"][...])
    tree = jax.tree.map(lambda a: np.asarray(a, np.float64), before)   # float64 leaves: cast to float32
    assert llm.update_weights(tree) == 2
    same = jax.tree.map(lambda a, b: np.array_equal(a, b), jax.tree.map(np.asarray, eng.model.params), before)
    assert all(jax.tree.leaves(same))
    placed = jax.tree.map(lambda a: jax.device_put(np.asarray(a)), before)
    llm.update_weights(placed)
    assert all(a is b for a, b in zip(jax.tree.leaves(eng.runner.params), jax.tree.leaves(placed)))


def test_old_buffers_are_freed_and_nothing_compiles(tensors):
    llm = LLM(DATA, **ENGINE)
    prompts, params = workload(np.random.default_rng(), 2)
    llm.generate(prompts, params)
    live = lambda: sum(a.nbytes for a in jax.live_arrays())   # noqa: E731
    base = live()
    rng = np.random.default_rng()
    for _ in range(3):
        llm.update_weights(perturbed(rng, tensors))
        llm.generate(prompts, params)
        assert live() <= base
    assert llm.engine.summary()["step_compiles"] == 1


def bad_updates(tensors):
    name, kname = "model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight"
    return [
        ({"model.layers.0.self_attn.qq_proj.weight": tensors[name]}, "qq_proj"),
        ({name: tensors[name][:, :8]}, name + " must have shape"),
        ({name: tensors[name].astype(np.int32)}, name + " must hold floats"),
        # a good tensor first, then a bad one: nothing of it is applied
        ({"model.norm.weight": tensors["model.norm.weight"] * 2, kname: tensors[kname].T.copy()}, kname),
    ]


def test_a_refused_update_changes_nothing(tensors):
    llm = LLM(DATA, **ENGINE)
    prompts, params = workload(np.random.default_rng(), 3)
    first = result(llm.generate(prompts, params))
    params_before = jax.tree.map(np.asarray, llm.engine.model.params)
    tree = jax.tree.map(np.asarray, llm.engine.model.params)
    wrong_shape = jax.tree.map(lambda a: a, tree)
    wrong_shape["layers"]["wk"].set_value(tree["layers"]["wk"][...][:, :, :4])
    wrong_dtype = jax.tree.map(lambda a: a, tree)
    wrong_dtype["norm"].set_value(tree["norm"][...].astype(np.int8))
    missing = jax.tree.map(lambda a: a, tree)
    del missing["layers"]["wv"]
    cases = bad_updates(tensors) + [
        (wrong_shape, r"\['layers'\]\['wk'\].* must have shape"), (wrong_dtype, r"\['norm'\].* must have dtype float32"),
        (missing, r"missing \[\"\['layers'\]\['wv'\]")]
    for weights, match in cases:
        with pytest.raises(ValueError, match=match):
            llm.update_weights(weights)
    assert llm.engine.weight_version == 0
    same = jax.tree.map(np.array_equal, jax.tree.map(np.asarray, llm.engine.model.params), params_before)
    assert all(jax.tree.leaves(same))
    llm.engine.flush_prefix_cache()   # the same rounds as the first run (prefix hits change the chunking)
    assert result(llm.generate(prompts, params)) == first


def test_tokens_in_flight_report_their_weight_version(tensors):
    """An update between rounds: running requests keep their KV and go on with the new weights; each
    token's version is reported, and their prompt pages (KV of the old weights) are never reused."""
    llm = LLM(DATA, **ENGINE)
    eng = llm.engine
    rng = np.random.default_rng()
    prompt = rng.integers(3, 300, 17).tolist()
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    eng.add_request(prompt, sp, request_id="a")
    outs = {}
    while not any(len(o.new_token_ids) for o in eng.step()):   # until it has a token
        pass
    eng.update_weights(perturbed(rng, tensors))
    while eng.has_unfinished:
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o.output
    a = outs["a"]
    k = a.weight_versions.index(1)
    assert a.weight_version == 1 and 0 < k and set(a.weight_versions[:k]) == {0} and set(a.weight_versions[k:]) == {1}
    again = llm.generate([prompt], sp)[0]
    assert again.num_cached_tokens == 0 and again.weight_version == 1 and again.weight_versions is None
    assert llm.generate([prompt], sp)[0].num_cached_tokens > 0   # cached again, under the new weights


# ---------------------------------------------------------------- the async engine and the server

@pytest.fixture(scope="module")
def engine_thread():
    from jpa import models

    gpt, tok = models.load(DATA)
    eng = build_engine(gpt, tok, EngineConfig(**ENGINE))   # the step the tests above compiled: reused
    with AsyncEngine(eng) as a:
        yield a


@pytest.fixture
def aengine(engine_thread):
    yield engine_thread
    engine_thread.resume_generation()   # a failed test leaves no pause behind


def long_request(rng, max_tokens=40):
    return rng.integers(3, 300, 12).tolist(), SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


async def drain(group):
    outs = {}
    async for i, o in group:
        if o.finished:
            outs[i] = o.output
    return [outs[i] for i in sorted(outs)]


def test_keep_mode_goes_on_with_the_new_weights(aengine, tensors):
    rng = np.random.default_rng()

    async def main():
        group = aengine.submit([long_request(rng), long_request(rng)])
        async for _, o in group:   # until a token came
            if o.new_token_ids:
                break
        await asyncio.to_thread(aengine.pause_generation, "keep")
        rounds = aengine.snapshot.rounds
        await asyncio.sleep(0.3)
        assert aengine.snapshot.rounds == rounds and aengine.paused and not group.finished   # nothing ran
        version = await asyncio.to_thread(aengine.update_weights, perturbed(np.random.default_rng(), tensors))
        aengine.resume_generation()
        return version, await drain(group)

    version, outs = asyncio.run(main())
    for o in outs:
        assert o.finish_reason == "length" and o.weight_version == version
        vs = o.weight_versions
        k = vs.index(version)
        assert k > 0 and set(vs[:k]) == {version - 1} and set(vs[k:]) == {version}


def test_wait_mode_finishes_what_runs_and_holds_new_requests(aengine):
    rng = np.random.default_rng()

    async def main():
        group = aengine.submit([long_request(rng, 10)])
        await asyncio.to_thread(aengine.pause_generation, "wait")
        assert aengine.engine.num_running == 0
        first = await drain(group)
        later = aengine.submit([long_request(rng, 4)])   # accepted, waits for the resume
        await asyncio.sleep(0.2)
        assert not later.finished and aengine.snapshot.paused
        aengine.resume_generation()
        return first, await drain(later)

    first, later = asyncio.run(main())
    assert first[0].finish_reason == "length" and len(first[0].token_ids) == 10
    assert later[0].finish_reason == "length" and len(later[0].token_ids) == 4


def test_abort_mode_ends_requests_in_flight(aengine):
    rng = np.random.default_rng()

    async def main():
        group = aengine.submit([long_request(rng, 200), long_request(rng, 200)])
        await asyncio.to_thread(aengine.pause_generation, "abort")
        outs = await drain(group)
        aengine.resume_generation()
        return outs

    outs = asyncio.run(main())
    assert [o.finish_reason for o in outs] == ["abort", "abort"]
    assert aengine.snapshot.pool_whole


def test_bad_pause_mode_is_refused(aengine):
    with pytest.raises(ValueError, match="mode must be one of abort, wait, keep; got 'later'"):
        aengine.pause_generation("later")
    assert not aengine.paused


def test_server_admin_endpoints(aengine, tensors, tmp_path):
    from jpa.server import build_app

    ckpt = tmp_path / "ckpt"
    shutil.copytree(DATA, ckpt, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json", "golden*"))
    new = perturbed(np.random.default_rng(), tensors)
    save_file(new, str(ckpt / "model.safetensors"))
    bad = tmp_path / "bad.safetensors"
    save_file({"model.layers.0.mlp.up_proj.weight": np.zeros((3, 3), np.float32)}, str(bad))
    auth = {"Authorization": f"Bearer {KEY}"}
    app = build_app(aengine, aengine.engine.tokenizer, model_name="tiny", api_key=KEY)
    with serving(app) as url, httpx.Client(base_url=url, timeout=60) as http:
        assert http.post("/pause").status_code == 401
        assert http.post("/update_weights", json={"path": str(ckpt)}).status_code == 401
        r = http.post("/pause", params={"mode": "soon"}, headers=auth)
        assert r.status_code == 400 and r.json()["error"]["param"] == "mode"
        assert http.post("/pause", params={"mode": "keep"}, headers=auth).json() == {"paused": True, "mode": "keep"}
        before = http.get("/weight_version", headers=auth).json()
        assert before["paused"]
        r = http.post("/update_weights", json={"path": str(bad)}, headers=auth)
        assert r.status_code == 400 and "model.layers.0.mlp.up_proj.weight must have shape" in r.json()["error"]["message"]
        r = http.post("/update_weights", json={"path": str(tmp_path / "nowhere")}, headers=auth)
        assert r.status_code == 400
        assert http.post("/update_weights", json={}, headers=auth).status_code == 400
        assert http.get("/weight_version", headers=auth).json()["weight_version"] == before["weight_version"]
        r = http.post("/update_weights", json={"path": str(ckpt)}, headers=auth)
        assert r.status_code == 200 and r.json() == {"weight_version": before["weight_version"] + 1}
        assert http.post("/resume", headers=auth).json() == {"paused": False}
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        t0 = time.monotonic()
        out = client.completions.create(model="tiny", prompt="hello", max_tokens=4, temperature=0)
        assert out.choices[0].finish_reason in ("length", "stop") and time.monotonic() - t0 < 60
        # each answer names the weights it was sampled with: the update's version, in both APIs and the stream
        assert out.model_extra["weight_version"] == before["weight_version"] + 1
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=2, temperature=0)
        assert chat.model_extra["weight_version"] == before["weight_version"] + 1
        last = list(client.completions.create(model="tiny", prompt="hello", max_tokens=2, temperature=0, stream=True,
                                              stream_options={"include_usage": True}))[-1]
        assert last.usage is not None and last.model_extra["weight_version"] == before["weight_version"] + 1
    np.testing.assert_array_equal(np.asarray(aengine.engine.model.params["norm"][...]), new["model.norm.weight"])
