"""Shared helpers of the engine tests: a context-dependent tiny model, engines shared across tests,
a reference run, a checked driver and output comparisons. Public engine API only.

The reference for every equivalence test is one engine that neither preempts nor shares pages: a
big pool, `prefix_caching=False`, a large token budget, one device, and n samples run as n
separate seeded requests. Engines are cached by their EngineConfig (a compiled step serves every
call with the same config), and checked clean (`check_page_state`, `pool_is_whole`) before reuse.
"""

import copy
import dataclasses

import numpy as np

PAGE_SIZE = 8
MAX_MODEL_LEN = 192
# Every engine of the tests: sizes that the equivalence tests keep the same so that no request
# meets a length limit (prompts + completions stay < MAX_MODEL_LEN and the smallest pool's size).
BASE = dict(max_seqs=4, page_size=PAGE_SIZE, num_pages=96, steps_per_call=4, max_model_len=MAX_MODEL_LEN,
            watermark=0.0, max_num_batched_tokens=32)
# The reference: ample pool for 8 sequences at the length limit, no sharing, budget large.
REFERENCE = dict(max_seqs=8, page_size=PAGE_SIZE, num_pages=8 * MAX_MODEL_LEN // PAGE_SIZE + 8, steps_per_call=4,
                 max_model_len=MAX_MODEL_LEN, watermark=0.0, max_num_batched_tokens=512, prefix_caching=False)

# How the context model's weights are scaled from tiny-llama's (std 0.02) init: attention q/k/v/o
# by QK_VO (attention is far from uniform and its output is a large part of the residual), token
# embeddings by EMB (sharper logits: greedy choices are decided by margins far above f32 noise).
QK_VO, EMB = 8.0, 10.0
LOGPROB_ATOL = 1e-5  # float32


def context_gpt(seed: int = 1):
    """tiny-llama (float32, same shapes and compile cost) whose greedy continuation depends on the
    whole context, not only the last token (the preset's init makes attention nearly uniform and
    small; see test_context_model_depends_on_the_context). Returns (models.GPT, tokenizer)."""
    from jpa import models

    gpt, tok = models.load("tiny-llama", seed=seed)
    for name in ("wq", "wk", "wv", "wo"):  # every layer's (the parameters are stacked)
        p = getattr(gpt.layers, name)
        p.set_value(p.get_value() * QK_VO)
    gpt.tok_embeddings.set_value(gpt.tok_embeddings.get_value() * EMB)
    return gpt, tok


def context_llama(seed: int = 1):
    """context_gpt(seed) as an engine model: (models.GPTForEngine, tokenizer)."""
    from jpa import models

    gpt, tok = context_gpt(seed)
    return models.GPTForEngine(gpt), tok


class Engines:
    """Engines over one model, built once per EngineConfig and handed out clean.

    Args:
      model, tokenizer: what every engine serves.
      base: the EngineConfig fields every engine starts from (default BASE).
    """

    def __init__(self, model, tokenizer, base: dict | None = None):
        self.model, self.tokenizer = model, tokenizer
        self.base = BASE if base is None else base
        self._cache = {}

    def get(self, *, tokenizer=None, **kw):
        """The engine of `base` updated with kw (prefix cache flushed, pool checked whole); tokenizer:
        another tokenizer than the model's (an engine of its own)."""
        from jpa.engine import EngineConfig, LLMEngine

        cfg = EngineConfig(**{**self.base, **kw})
        key = (cfg, id(tokenizer))
        eng = self._cache.get(key)
        if eng is None:
            eng = self._cache[key] = LLMEngine(self.model, tokenizer or self.tokenizer, cfg)
        else:
            settle(eng)
        return eng

    def discard(self, eng) -> None:
        """Drops eng (left in an unknown state, e.g. by a failed test) so that no later test gets it."""
        for key in [k for k, v in self._cache.items() if v is eng]:
            del self._cache[key]

    def reference(self, prompts, params):
        """Outputs of prompts on the reference engine; n > 1 runs as n separate requests (seed + i)."""
        ref = self.get(**REFERENCE)
        flat, groups = [], []
        for p, sp in zip(prompts, params):
            if sp.n == 1:
                groups.append(len(flat))
                flat.append((p, sp))
            else:
                groups.append(list(range(len(flat), len(flat) + sp.n)))
                flat += [(p, dataclasses.replace(sp, n=1, seed=sp.seed + i)) for i in range(sp.n)]
        before = snapshot(ref)
        outs = run(ref, [p for p, _ in flat], [sp for _, sp in flat])
        assert ref.stats.preemptions == before.preemptions, "the reference run must not preempt"
        return [outs[g] if isinstance(g, int) else [outs[i] for i in g] for g in groups]


def settle(eng):
    """An engine between uses: nothing running, page state consistent, every page free after the
    prefix cache is flushed."""
    assert not eng.has_unfinished and eng.num_running == 0 and eng.num_waiting == 0
    eng.check_page_state()
    assert eng.pool_is_whole(), "pages leaked by the previous use"
    flush = getattr(eng, "flush_prefix_cache", None)
    if flush is not None:
        flush()
    eng.check_page_state()


def snapshot(eng):
    """A copy of eng.stats (its counters are running sums; tests look at differences)."""
    return copy.copy(eng.stats)


def run(eng, prompts, params, *, check: bool = True):
    """Runs prompts to completion with add_request/step, checking the page state after every round.

    Returns one RequestOutput per prompt (a list of n for a request with n samples), in order.
    Also checks that every request comes out finished exactly once and that its streamed tokens
    and logprobs add up to the final ones.
    """
    if not isinstance(params, (list, tuple)):
        params = [params] * len(prompts)
    tag = object()  # request ids unique to this call
    ids = []
    for k, (p, sp) in enumerate(zip(prompts, params)):
        rid = (tag, k)
        eng.add_request(p, sp, request_id=rid)
        ids.append(rid if sp.n == 1 else [(rid, i) for i in range(sp.n)])
    streamed, final = {}, {}
    while eng.has_unfinished:
        for o in eng.step():
            assert o.request_id not in final, f"request {o.request_id} came out finished twice"
            toks, lps = streamed.get(o.request_id, ((), ()))
            assert len(o.new_logprobs) == len(o.new_token_ids), "one logprob per streamed token"
            streamed[o.request_id] = (toks + tuple(o.new_token_ids), lps + tuple(o.new_logprobs))
            if o.finished:
                final[o.request_id] = o.output
        if check:
            eng.check_page_state()
    want = [i for g in ids for i in (g if isinstance(g, list) else [g])]
    assert set(final) >= set(want), f"{len(set(want) - set(final))} requests never finished"
    for rid in want:
        out = final[rid]
        toks, lps = streamed.get(rid, ((), ()))
        assert toks == out.token_ids, f"streamed tokens != final tokens for {rid}"
        np.testing.assert_array_equal(lps, out.logprobs, err_msg=f"streamed logprobs != final for {rid}")
        assert len(out.logprobs) == len(out.token_ids)
    return [[final[i] for i in g] if isinstance(g, list) else final[g] for g in ids]


def flat(outs):
    """Outputs with n-sample groups flattened."""
    return [o for x in outs for o in (x if isinstance(x, list) else [x])]


# A sampled token's logprob is taken under the top-p-filtered distribution. Logit noise of 1e-6
# (a different batch shape after preemption or chunking) can move a token at the nucleus edge in or
# out of the nucleus, which shifts the normaliser by that token's mass (seen: 1.1e-3, CI of stop 29).
# One such position per request is allowed; a wrong cache or position moves most of them, and far more.
NUCLEUS_EDGE_ATOL = 2e-2


def assert_same(got, want, msg=""):
    """Same token ids, finish reasons and completions, and per-token logprobs within LOGPROB_ATOL
    (but for at most one position per request within NUCLEUS_EDGE_ATOL: a top-p edge flip)."""
    got, want = flat(got), flat(want)
    assert len(got) == len(want)
    for k, (g, w) in enumerate(zip(got, want)):
        where = f"{msg} request {k}"
        assert g.token_ids == w.token_ids, f"{where}: token ids differ\n got  {g.token_ids}\n want {w.token_ids}"
        assert (g.finish_reason, g.completion) == (w.finish_reason, w.completion), where
        gl, wl = np.asarray(g.logprobs, np.float64), np.asarray(w.logprobs, np.float64)
        assert gl.shape == wl.shape, where
        off = np.abs(gl - wl) > LOGPROB_ATOL
        if off.sum() == 1 and np.abs(gl - wl)[off].max() <= NUCLEUS_EDGE_ATOL:
            continue
        np.testing.assert_allclose(gl, wl, rtol=0, atol=LOGPROB_ATOL, err_msg=where)


def random_prompts(rng, n: int, lo: int = 1, hi: int = 100, vocab: int = 256):
    """n token-id prompts of random lengths in [lo, hi], tokens in [3, vocab)."""
    return [rng.integers(3, vocab, int(rng.integers(lo, hi + 1))).tolist() for _ in range(n)]


def mixed_params(rng, n: int, lo: int = 1, hi: int = 30, *, greedy_every: int = 2):
    """n SamplingParams: every greedy_every-th greedy, the others seeded samples (random
    temperature, top-k, top-p, seed); random max_new_tokens in [lo, hi]; EOS ignored."""
    from jpa.engine import SamplingParams

    out = []
    for i in range(n):
        new = int(rng.integers(lo, hi + 1))
        if i % greedy_every == 0:
            out.append(SamplingParams(max_new_tokens=new, greedy=True, ignore_eos=True))
        else:
            out.append(SamplingParams(max_new_tokens=new, temperature=float(rng.uniform(0.6, 1.4)),
                                      top_k=int(rng.choice([0, 20])), top_p=float(rng.choice([1.0, 0.9])),
                                      seed=int(rng.integers(0, 2 ** 30)), ignore_eos=True))
    return out


def fresh_seed() -> int:
    """A fresh seed per run (printed by the caller so a failure can be reproduced)."""
    return int(np.random.SeedSequence().entropy % 2 ** 31)


def compiled_once(eng) -> bool:
    """One compiled program (the unified step) served every call of this engine."""
    s = eng.summary()
    return s["step_compiles"] == 1 and not s.get("decode_compiles") and not s.get("prefill_compiles")


def gap_inputs(config, rng):
    """Random prefill chunks and a decode token per sequence over a shared random block table, for comparing a
    sharded model's logits with one device's (tests/tp_check.py, quant_tp_check.py, moe_ep_check.py):
    ((num_pages, page_size), prefill args, decode args) of `models.prefill` / `models.decode`."""
    import jax.numpy as jnp

    batch, width, page_size, pages_per_seq, num_pages = 3, 8, 4, 4, 32
    tables = rng.permutation(num_pages)[: batch * pages_per_seq].reshape(batch, pages_per_seq)
    lens = rng.integers(1, width + 1, batch)  # prompt chunk lengths; the decode token goes at lens
    slot = lambda b, p: tables[b, p // page_size] * page_size + p % page_size  # noqa: E731
    slots = np.array([[slot(b, p) if p < lens[b] else -1 for p in range(width)] for b in range(batch)])
    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    tokens = i32(rng.integers(0, config.vocab_size, (batch, width)))
    new_tok = i32(rng.integers(0, config.vocab_size, batch))
    pre_args = (tokens, i32(np.zeros(batch)), i32(lens), i32(slots), i32(tables))
    dec_args = (new_tok, i32(lens + 1), i32([slot(b, lens[b]) for b in range(batch)]), i32(tables))
    return (num_pages, page_size), pre_args, dec_args
