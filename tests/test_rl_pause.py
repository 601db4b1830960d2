"""pause_generation / resume_generation / update_weights on the AsyncEngine, and the server's POST /pause,
/resume and /update_weights behind the API key (issue 53)."""

import asyncio
import pathlib
import shutil
import time

import httpx
import numpy as np
import openai
import pytest
from safetensors.numpy import save_file

from jpa.engine import AsyncEngine, EngineConfig, SamplingParams
from jpa.llm import build_engine
from jpa.models import hf
from tests.server_util import serving

DATA = pathlib.Path(__file__).parent / "data" / "hf" / "llama"
KEY = "sk-admin"


@pytest.fixture(scope="module")
def aengine():
    from jpa import models

    gpt, tok = models.load(DATA)
    # test_update_weights' engine (the same compiled step, when one process runs both)
    eng = build_engine(gpt, tok, EngineConfig(max_seqs=4, page_size=8, num_pages=64, max_num_batched_tokens=32,
                                              steps_per_call=4, watermark=0.0))
    with AsyncEngine(eng) as a:
        yield a


@pytest.fixture(scope="module")
def tensors():
    return hf.read_tensors(DATA)


def noisy(tensors):
    rng = np.random.default_rng()
    return {k: (np.asarray(v, np.float32) * (1 + 0.5 * rng.standard_normal(v.shape))).astype(np.float32)
            for k, v in tensors.items()}


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
        version = await asyncio.to_thread(aengine.update_weights, noisy(tensors))
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
    new = noisy(tensors)
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
    np.testing.assert_array_equal(np.asarray(aengine.engine.model.params["norm"][...]), new["model.norm.weight"])
