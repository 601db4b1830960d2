"""Weight updates in place (`update_weights`, issue 53): a served engine given new weights equals, bitwise,
an engine loaded fresh from a checkpoint holding them; updating back gives the first outputs again; no
compile across updates; old buffers are freed; a refused update changes nothing; tokens in flight report
the version of the weights that produced them."""

import pathlib
import shutil

import jax
import numpy as np
import pytest
from safetensors.numpy import save_file

from jpa import LLM, SamplingParams
from jpa.models import hf

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
