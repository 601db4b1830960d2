"""The engine soak's driver: random workloads under page pressure checked against an ample pool.

Random prompts, max_new_tokens, stop strings and sampling parameters go through engines with tiny
page pools (forcing preemptions), driven round by round with step(): requests arrive in waves
between steps and a few are aborted. `compare` checks every result against the same requests run on
an ample pool without prefix caching, where nothing is preempted or shared (tokens, completion,
finish reason, logprobs within LOGPROB_ATOL, stop strings cut right, aborted requests a prefix).

With KV offload (`kv_offload_bytes`: the tiny pools' engines get a host tier) preempted requests
are swapped to host memory and evicted prefix pages spilled there, and the same checks hold; the
per-round page check (`check_pages`) then covers both tiers.

Used by benchmarks/soak_engine.py (the long run), tests/test_engine_random.py (CI size) and
tests/test_bench_offload.py (a short offload soak).
"""

import dataclasses
import time

import numpy as np

from jpa.engine import EngineConfig, LLMEngine, SamplingParams
from jpa.testing.engine import LOGPROB_ATOL, context_llama

# Tiny pools: (max_seqs, page_size, num_pages, steps_per_call). max_model_len = the whole pool.
TINY_POOLS = [(3, 4, 12, 3), (4, 8, 8, 2)]
LETTERS = "abcdefghij klmnop"


def make_workload(rng, n: int, max_len: int, *, max_prompt: int = 30, max_new: int = 40, prefixes=()):
    """n random (prompt, SamplingParams) pairs whose prompts fit in max_len (no stop strings:
    `with_stops` adds them). With `prefixes` (strings), about half the prompts start with one of
    them (prefix-cache hits, and with KV offload host-tier hits once the pages were spilled)."""
    out = []
    for _ in range(n):
        plen = int(rng.integers(1, min(max_prompt, max_len - 1) + 1))
        prompt = "".join(rng.choice(list(LETTERS), plen))
        if prefixes and rng.random() < 0.5:
            prompt = (prefixes[int(rng.integers(len(prefixes)))] + prompt)[: max(plen, min(max_prompt, max_len - 1))]
        greedy = rng.random() < 0.5
        p = dict(max_new_tokens=int(rng.integers(1, max_new + 1)), seed=int(rng.integers(0, 2 ** 31)),
                 ignore_eos=bool(rng.random() < 0.5))
        if greedy:
            p.update(greedy=True)
        else:
            p.update(temperature=float(rng.uniform(0.3, 1.5)), top_k=int(rng.choice([0, 3, 50])),
                     top_p=float(rng.choice([1.0, 0.9, 0.5])))
        out.append((prompt, SamplingParams(**p)))
    return out


def with_stops(rng, workload, ref, p: float = 0.4):
    """The workload with stop strings on a fraction p of its requests: a piece of the request's
    own reference completion (`ref[i]`: request i's output without stops), so that most of them
    hit, plus sometimes a string that does not occur."""
    out = []
    for i, (prompt, params) in enumerate(workload):
        text = ref[i].completion
        pieces = [text[i:i + k] for k in (1, 2, 3) for i in range(len(text) - k + 1)
                  if text[i:i + k].strip() and "\ufffd" not in text[i:i + k]]
        if pieces and rng.random() < p:
            stop = [pieces[int(rng.integers(0, len(pieces)))]]
            if rng.random() < 0.3:
                stop.append("".join(rng.choice(list(LETTERS[:10]), 3)))
            params = dataclasses.replace(params, stop=tuple(stop))
        out.append((prompt, params))
    return out


def check_pages(eng):
    """The device's page state agrees with the scheduler's running set and the prefix cache (no
    leak, no drift): `LLMEngine.check_page_state`. With KV offload also the host tier: every host
    page free, in one swap block or holding one spilled prefix page (`HostTier.check`); every block
    a waiting request's (an aborted or finished request's block is gone); each prefix key on a
    device page or in the host tier, never both (`PrefixCache.check`)."""
    try:
        eng.check_page_state()
    except RuntimeError as e:
        raise AssertionError(str(e)) from None


def run(eng, workload, rng=None, *, abort_p=0.0, wave=None, check=False):
    """Drives eng with step() until all of workload is done.

    Requests arrive in waves of `wave` (all at once if None) between steps; with rng, each round
    aborts a random unfinished request with probability abort_p. Returns (results by workload
    index, {"lost", "duplicated", "stream_mismatch", "rounds"}).
    """
    idx, results, streamed, counts = {}, {}, {}, dict(duplicated=0, stream_mismatch=0, rounds=0)
    pending = list(range(len(workload)))
    while pending or eng.has_unfinished:
        take = pending if wave is None else pending[: max(1, int(rng.integers(0, wave + 1)))]
        for i in take:
            rid = eng.add_request(*workload[i]).request_id
            idx[rid], streamed[rid] = i, ((), "")
        pending = pending[len(take):]
        if rng is not None and abort_p and rng.random() < abort_p:
            live = [r for r in idx if idx[r] not in results]
            if live:
                eng.abort(live[int(rng.integers(0, len(live)))])
        for o in eng.step():
            toks, text = streamed[o.request_id]
            streamed[o.request_id] = (toks + o.new_token_ids, text + o.new_text)
            if o.finished:
                i = idx[o.request_id]
                if i in results:
                    counts["duplicated"] += 1
                results[i] = o.output
                if streamed[o.request_id] != (o.output.token_ids, o.output.completion):
                    counts["stream_mismatch"] += 1
        counts["rounds"] += 1
        if check:
            check_pages(eng)
    counts["lost"] = len(workload) - len(results)
    return results, counts


def compare(workload, ref, got, tokenizer):
    """Mismatch counts of got against the ample-pool reference (aborted requests: prefix only)."""
    m = dict(greedy_mismatch=0, sampled_mismatch=0, logprob_mismatch=0, aborted=0, abort_not_prefix=0, bad_stop=0,
             errors=0)
    for i, (_, params) in enumerate(workload):
        g, r = got[i], ref[i]
        m["errors"] += g.error is not None
        if g.finish_reason == "abort":
            m["aborted"] += 1
            n = len(g.token_ids)
            m["abort_not_prefix"] += g.token_ids != r.token_ids[:n]
            m["logprob_mismatch"] += not _close(g.logprobs, r.logprobs[:n])
            continue
        if (g.token_ids, g.completion, g.finish_reason) != (r.token_ids, r.completion, r.finish_reason):
            m["greedy_mismatch" if params.is_greedy else "sampled_mismatch"] += 1
        elif not _close(g.logprobs, r.logprobs):
            m["logprob_mismatch"] += 1
        if params.stop and g.finish_reason == "stop" and g.token_ids and g.token_ids[-1] < 256:
            text = lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True)
            hits = lambda t: any(s in t for s in params.stop)
            if any(s in g.completion for s in params.stop) or not hits(text(g.token_ids)) \
                    or hits(text(g.token_ids[:-1])):
                m["bad_stop"] += 1
    return m


def _close(a, b) -> bool:
    return len(a) == len(b) and bool(np.all(np.abs(np.asarray(a) - np.asarray(b)) <= LOGPROB_ATOL))


def engine(model, tok, pool, *, ample=False, kv_offload_bytes=0):
    """The tiny pool's engine (with a host tier of kv_offload_bytes if > 0), or (ample) the
    reference: 8x the pages, no prefix caching, no offload."""
    max_seqs, page_size, num_pages, steps = pool
    return LLMEngine(model, tok, EngineConfig(
        max_seqs=max_seqs, page_size=page_size, num_pages=num_pages * (8 if ample else 1),
        steps_per_call=steps, max_model_len=num_pages * page_size, watermark=0.0, prefix_caching=not ample,
        kv_offload_bytes=0 if ample else kv_offload_bytes))


OFFLOAD_COUNTS = ("swapped_out", "swapped_in", "spill_pages", "restore_pages")


def soak(n_requests: int, time_limit: float, seed: int, *, pools=TINY_POOLS, check=False, abort_p=0.01,
         kv_offload_bytes: int = 0):
    """Runs batches of random requests through each tiny pool until n_requests or time_limit
    (seconds); returns the totals (mismatch and leak counts must be 0). kv_offload_bytes > 0 gives
    the tiny pools' engines a host tier of that size; the totals then count its swaps and spills."""
    model, tok = context_llama(seed)
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    total = dict(requests=0, preemptions=0, lost=0, duplicated=0, leaked_runs=0, stream_mismatch=0,
                 greedy=0, sampled=0, greedy_mismatch=0, sampled_mismatch=0, logprob_mismatch=0, aborted=0,
                 abort_not_prefix=0, bad_stop=0, errors=0, stop_finishes=0, rounds=0, reference_preemptions=0)
    if kv_offload_bytes:
        total.update(dict.fromkeys(OFFLOAD_COUNTS, 0), kv_offload_bytes=kv_offload_bytes)
    # With offload, shared prompt prefixes: evicted prefix pages are spilled and later hit in the host tier.
    prefixes = tuple("".join(rng.choice(list(LETTERS), 16)) for _ in range(3)) if kv_offload_bytes else ()
    engines = {pool: (engine(model, tok, pool, kv_offload_bytes=kv_offload_bytes), engine(model, tok, pool, ample=True))
               for pool in pools}
    batch = max(1, n_requests // (4 * len(pools)))
    k = 0
    while total["requests"] < n_requests and time.perf_counter() - t0 < time_limit:
        pool = pools[k % len(pools)]
        k += 1
        tiny, ample = engines[pool]
        n = min(batch, n_requests - total["requests"])
        workload = make_workload(rng, n, pool[1] * pool[2], prefixes=prefixes)
        workload = with_stops(rng, workload, run(ample, workload)[0])
        r0 = ample.stats.preemptions
        ref, _ = run(ample, workload)
        total["reference_preemptions"] += ample.stats.preemptions - r0
        p0 = tiny.stats.preemptions
        o0 = {key: getattr(tiny.stats, key) for key in OFFLOAD_COUNTS}
        got, counts = run(tiny, workload, rng, abort_p=abort_p, wave=max(1, n // 4), check=check)
        total["preemptions"] += tiny.stats.preemptions - p0
        if kv_offload_bytes:
            for key in OFFLOAD_COUNTS:
                total[key] += getattr(tiny.stats, key) - o0[key]
        total["leaked_runs"] += not (tiny.pool_is_whole() and ample.pool_is_whole())
        for key in ("lost", "duplicated", "stream_mismatch", "rounds"):
            total[key] += counts[key]
        for key, v in compare(workload, ref, got, tok).items():
            total[key] += v
        total["greedy"] += sum(p.is_greedy for _, p in workload)
        total["sampled"] += sum(not p.is_greedy for _, p in workload)
        total["stop_finishes"] += sum(bool(p.stop) and got[i].finish_reason == "stop"
                                      for i, (_, p) in enumerate(workload))
        total["requests"] += n
    total["seconds"] = round(time.perf_counter() - t0, 1)
    total["compile_seconds"] = round(sum(e.runner.compile_seconds for pair in engines.values() for e in pair), 1)
    return total
