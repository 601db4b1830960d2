"""AsyncEngine: the always-running engine thread behind the server (tiny random llama)."""

import asyncio
import time

import pytest

from jpa import models
from jpa.engine import AsyncEngine, EngineConfig, EngineDead, EngineOverloaded, LLMEngine, SamplingParams

pytestmark = pytest.mark.bench

PROMPTS = ["The paged cache", "hello", "a much longer prompt that spans several pages of the cache", "x",
           "continuous batching keeps slots busy", "jax"]
GREEDY = SamplingParams(max_new_tokens=24, greedy=True, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny():
    model, tok = models.load("tiny-llama", seed=1)
    return models.GPTForEngine(model), tok


@pytest.fixture(scope="module")
def eng(tiny):
    """One LLMEngine for the module (its compiled steps are reused); each test wraps it in a fresh
    AsyncEngine and leaves it with nothing unfinished."""
    return LLMEngine(tiny[0], tiny[1], EngineConfig(max_seqs=4, page_size=8, num_pages=48, steps_per_call=4,
                                                    max_model_len=160))


@pytest.fixture(scope="module")
def offline(eng):
    return eng.generate(PROMPTS, GREEDY)


async def collect(group):
    """(finished outputs by index, streamed text by index, streamed token ids by index)."""
    done, text, ids = {}, {}, {}
    async for i, out in group:
        text[i] = text.get(i, "") + out.new_text
        ids[i] = ids.get(i, ()) + tuple(out.new_token_ids)
        if out.finished:
            done[i] = out.output
    return done, text, ids


def wait_for(pred, timeout=10.0):
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout:
            raise AssertionError("condition not reached in time")
        time.sleep(0.005)


def test_streams_equal_offline_generate(eng, offline):
    """Concurrent streamed requests (in two groups, added while others run) give exactly what the
    offline generate() gives; the pool is whole afterwards."""
    async def main(aeng):
        g1 = aeng.submit([(p, GREEDY) for p in PROMPTS[:3]])
        await asyncio.sleep(0.01)
        g2 = aeng.submit([(p, GREEDY) for p in PROMPTS[3:]])
        return await asyncio.gather(collect(g1), collect(g2))

    with AsyncEngine(eng) as aeng:
        (d1, t1, i1), (d2, t2, i2) = asyncio.run(main(aeng))
        done = [d1[0], d1[1], d1[2], d2[0], d2[1], d2[2]]
        texts = [t1[0], t1[1], t1[2], t2[0], t2[1], t2[2]]
        ids = [i1[0], i1[1], i1[2], i2[0], i2[1], i2[2]]
        assert [o.token_ids for o in done] == [o.token_ids for o in offline]
        assert texts == [o.completion for o in offline] and ids == [o.token_ids for o in offline]
        wait_for(lambda: aeng.snapshot.pool_whole is True)
        assert aeng.snapshot.num_running == 0 and aeng.snapshot.pages_used == 0


def test_abort_releases_pages_within_one_round(eng):
    """Leaving a stream early aborts its request: its pages come back before the next round."""
    long = SamplingParams(max_new_tokens=150, greedy=True, ignore_eos=True)

    async def main(aeng):
        other = aeng.submit([(PROMPTS[1], GREEDY)])
        async with aeng.submit([(PROMPTS[2], long)]) as group:
            async for _, out in group:
                if len(out.new_token_ids):
                    # The snapshot is published before outputs go out: it shows the pages held.
                    assert aeng.snapshot.pages_used > 0
                    break   # the client goes away mid-stream
        done, _, _ = await collect(other)   # the other request is unaffected
        return done[0]

    with AsyncEngine(eng) as aeng:
        out = asyncio.run(main(aeng))
        assert out.finish_reason == "length" and len(out.token_ids) == GREEDY.max_new_tokens
        wait_for(lambda: aeng.snapshot.pool_whole is True)
        assert 0 <= aeng.snapshot.last_abort_rounds <= 1
        assert aeng.snapshot.generation_tokens < 150   # the long one did not run on


def test_sleeps_when_idle_and_wakes_on_arrival(eng):
    with AsyncEngine(eng) as aeng:
        out = asyncio.run(aeng.generate(PROMPTS[0], GREEDY))
        assert len(out.token_ids) == 24
        wait_for(lambda: aeng.snapshot.pool_whole is True)
        rounds = aeng.snapshot.rounds
        time.sleep(0.3)
        assert aeng.snapshot.rounds == rounds, "an idle engine must not spin"
        assert asyncio.run(aeng.generate(PROMPTS[1], GREEDY)).finish_reason == "length"
        assert aeng.snapshot.rounds > rounds


def test_overload_is_refused_whole(eng):
    """Beyond max_waiting waiting requests a submission is refused at once and nothing is queued;
    accepted requests still finish, and a later submission is accepted again."""
    long = SamplingParams(max_new_tokens=100, greedy=True, ignore_eos=True)

    async def main(aeng):
        # 4 slots: 4 run, the waiting queue holds 3.
        running = [aeng.submit([(p, long)]) for p in PROMPTS[:3]]   # 3 waiting: at the limit
        while aeng.snapshot.num_running < 3:
            await asyncio.sleep(0.005)
        running.append(aeng.submit([(PROMPTS[3], long)]))
        while aeng.snapshot.num_running < 4:
            await asyncio.sleep(0.005)
        with pytest.raises(EngineOverloaded, match="overloaded"):
            aeng.submit([(p, long) for p in PROMPTS[:4]])   # 4 > 3: none of them is queued
        waiting = aeng.submit([(p, long) for p in PROMPTS[3:6]])
        with pytest.raises(EngineOverloaded, match="3 requests are waiting"):
            aeng.submit([(PROMPTS[0], long)])
        results = await asyncio.gather(*map(collect, running + [waiting]))
        assert [sorted(done) for done, _, _ in results] == [[0]] * 4 + [[0, 1, 2]]
        return await aeng.generate(PROMPTS[0], GREEDY)

    with AsyncEngine(eng, max_waiting=3) as aeng:
        assert asyncio.run(main(aeng)).finish_reason == "length"
        wait_for(lambda: aeng.snapshot.pool_whole is True)


def test_bad_request_fails_alone(eng, offline):
    async def main(aeng):
        group = aeng.submit([("", GREEDY), (PROMPTS[0], GREEDY), ([1] * 500, GREEDY)])
        done, _, _ = await collect(group)
        return done

    with AsyncEngine(eng) as aeng:
        done = asyncio.run(main(aeng))
        assert done[0].finish_reason == "error" and "empty prompt" in done[0].error
        assert done[2].finish_reason == "error" and "tokens per sequence" in done[2].error
        assert done[1].token_ids == offline[0].token_ids


def test_survives_a_failing_round(eng, offline):
    """An exception inside a round fails the requests in flight (the stream raises), the engine
    takes them out and goes on serving."""
    real_step, calls = eng.step, {"n": 0}

    def flaky_step():
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected")
        return real_step()

    eng.step = flaky_step
    try:
        with AsyncEngine(eng) as aeng:
            with pytest.raises(RuntimeError, match="internal engine error: injected"):
                asyncio.run(aeng.generate(PROMPTS[0], GREEDY))
            assert asyncio.run(aeng.generate(PROMPTS[0], GREEDY)).token_ids == offline[0].token_ids
            wait_for(lambda: aeng.snapshot.pool_whole is True)
            assert aeng.alive
    finally:
        del eng.step   # the instance attribute goes; the method is back


def test_shutdown_ends_requests(eng):
    long = SamplingParams(max_new_tokens=150, greedy=True, ignore_eos=True)

    async def main(aeng):
        group = aeng.submit([(PROMPTS[0], long)])
        async for _, out in group:
            if out.new_token_ids:
                break
        await asyncio.to_thread(aeng.shutdown)
        rest = [out async for _, out in group]
        return rest

    aeng = AsyncEngine(eng).start()
    rest = asyncio.run(main(aeng))
    assert rest[-1].finished and rest[-1].output.finish_reason == "abort"
    assert not aeng.alive and aeng.snapshot.pool_whole is True

    async def late():
        aeng.submit([(PROMPTS[0], GREEDY)])
    with pytest.raises(EngineDead):
        asyncio.run(late())
