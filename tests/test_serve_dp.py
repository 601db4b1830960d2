"""`jpa serve-dp`: two tiny-llama replicas behind vllm-router (cache_aware), on loopback.

Through the router, every greedy answer equals one in-process engine's, both replicas serve, and
prompts that share a long prefix all land on one replica, whose prefix cache then hits. A dying
replica stops everything (exit 1, naming it); SIGTERM stops everything (exit 0); nothing is left
running. Skipped, with the reason, without the `router` extra.
"""

import os
import random
import re
import signal
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from jpa.testing.procs import fast_compile_env

openai = pytest.importorskip("openai")

from router_util import ROOT, require_router, serve_dp, serve_dp_running  # noqa: E402

# Small engines: each replica compiles its step in about 20 s on this CPU. The same EngineConfig
# in-process gives the reference answers (the same compiled program, hence the same numerics).
ENGINE = dict(max_seqs=8, page_size=16, num_pages=256, max_model_len=512, max_num_batched_tokens=256,
              steps_per_call=4)
REPLICA_FLAGS = ["--model", "tiny-llama", *(x for k, v in ENGINE.items() for x in (f"--{k.replace('_', '-')}", str(v)))]
MAX_TOKENS = 8


def _prompts(n: int) -> list[str]:
    """n distinct short prompts that end in varied characters (tiny-llama's greedy text mostly
    continues the last character, so varied endings give varied answers)."""
    rng = random.Random(0)
    words = "river mountain cloud stone apple violet ocean quartz lantern maple thunder pixel harbor".split()
    return [f"{i} {rng.choice(words)} {rng.choice(words)}{rng.choice('abcdefghijklmnopqrstuvwxyz.,!?;:')}"
            for i in range(n)]


def _reference(prompts: list[str]) -> list[str]:
    from jpa import models
    from jpa.engine import EngineConfig, LLMEngine, SamplingParams

    model, tok = models.load("tiny-llama")   # seed 0, as `jpa serve` loads it
    engine = LLMEngine(models.GPTForEngine(model), tok, EngineConfig(**ENGINE))
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=MAX_TOKENS, greedy=True, ignore_eos=True))
    return [o.completion for o in outs]


def _counts(replicas: list[str]) -> list[tuple[float, float]]:
    """(requests ended, prefix cache hit tokens) of each replica."""
    return [(serve_dp.metric(u, "jpa_requests_total"), serve_dp.metric(u, "vllm:prefix_cache_hits_total"))
            for u in replicas]


def _env(tmp_path):
    return fast_compile_env({**os.environ, "PYTHONPATH": str(ROOT), "JPA_CACHE_DIR": str(tmp_path), "JAX_PLATFORMS": "cpu"})


def _group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.soak
def test_two_replicas_behind_the_router(tmp_path):
    prompts = _prompts(64)
    argv = ["--dp", "2", "--port", "0", "--router-port", str(serve_dp.free_port()), *REPLICA_FLAGS]
    # The cache-aware policy balances load instead of following prefixes only when the replicas'
    # in-flight requests differ by more than --balance-abs-threshold (default 64) and by a factor
    # over --balance-rel-threshold (1.5). At most 16 requests are in flight here, so the defaults
    # keep it sticky; no threshold flag is needed.
    with ThreadPoolExecutor(1) as ex:
        ref_future = ex.submit(_reference, prompts)   # computed while the replicas load and compile
        with serve_dp_running(argv, log_path=tmp_path / "serve_dp.log", env=_env(tmp_path)) as (proc, url, replicas):
            ref = ref_future.result()
            assert len(set(ref)) >= 16, "the reference answers must tell the prompts apart"
            assert len(replicas) == 2 and url not in replicas
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)

            def complete(prompt: str) -> str:
                r = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=MAX_TOKENS,
                                              temperature=0, extra_body={"ignore_eos": True})
                assert r.usage.completion_tokens == MAX_TOKENS
                return r.choices[0].text

            before = _counts(replicas)
            with ThreadPoolExecutor(16) as pool:   # 64 requests, at most 16 in flight
                answers = list(pool.map(complete, prompts))
            assert [i for i, (a, b) in enumerate(zip(answers, ref)) if a != b] == [], (answers, ref)
            mid = _counts(replicas)
            served = [m[0] - b[0] for m, b in zip(mid, before)]
            assert sum(served) == 64 and min(served) > 0, f"requests per replica: {served}"

            # A prefix of 400 characters (25 full pages of tiny-llama's byte tokens): the first request
            # alone caches it, then 7 more at once; cache_aware sends all 8 to that replica.
            prefix = "".join(random.Random(1).choice("abcdefghij klmnopqrstuvwxyz") for _ in range(400))
            shared = [f"{prefix} question {i}?" for i in range(8)]
            complete(shared[0])
            with ThreadPoolExecutor(7) as pool:
                list(pool.map(complete, shared[1:]))
            after = _counts(replicas)
            served = [a[0] - m[0] for a, m in zip(after, mid)]
            hits = [a[1] - m[1] for a, m in zip(after, mid)]
            assert sorted(served) == [0, 8], f"shared-prefix requests per replica: {served}"
            one = served.index(8)
            assert hits[one] >= 7 * 384 and hits[1 - one] == 0, f"prefix cache hit tokens per replica: {hits}"

            # SIGTERM: the router and both replicas stop, the script exits 0 and leaves nothing behind.
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 0
            assert _group_gone(proc.pid), "a child of jpa serve-dp outlived it"
    log = (tmp_path / "serve_dp.log").read_text()
    assert "[jpa] stopping the replicas and the router" in log and log.count("[jpa] server stopped") == 2, log[-3000:]


@pytest.mark.bench
def test_a_dying_replica_stops_everything(tmp_path):
    """A replica that exits (here: its model directory holds no checkpoint) stops the others; the
    script exits 1 and names it, with the replica's own last line."""
    empty = tmp_path / "no-checkpoint"
    empty.mkdir()
    argv = ["--dp", "2", "--port", "0", "--router-port", "0", "--model", str(empty), "--max-model-len", "64"]
    require_router()
    proc = serve_dp.start(argv, log_path=str(tmp_path / "log"), env=_env(tmp_path))
    try:
        assert proc.wait(120) == 1
        assert _group_gone(proc.pid), "a child of jpa serve-dp outlived it"
    finally:
        serve_dp.stop_group(proc)
    log = (tmp_path / "log").read_text()
    m = re.search(r"\[jpa\] replica (\d) \(pid \d+\) exited with code 2; its last line: jpa serve: error: --model "
                  r".*; stopping the others", log)
    assert m, log[-3000:]


@pytest.mark.bench
@pytest.mark.parametrize("args, msg", [
    (["--dp", "0"], "--dp must be >= 1; got 0"),
    (["--port", "65535"], "--port must be 0 or leave room for 2 consecutive ports"),
    (["--port", "9000", "--router-port", "9001"], "--router-port 9001 is one of the replicas' ports 9000..9001"),
    (["--policy", "fastest"], "argument --policy: invalid choice: 'fastest'"),
    (["--router-args", "'unclosed"], "--router-args: No closing quotation"),
    (["--devices-per-replica", "0"], "--devices-per-replica must be >= 1"),
    (["--max-seqs", "0"], "replica flags: --max-seqs must be >= 1; got 0"),
    (["--model", "nope"], "replica flags: --model 'nope' is unknown"),
    (["--no-such-flag"], "replica flags: unrecognized arguments: --no-such-flag"),
])
def test_bad_flags(args, msg):
    r = subprocess.run([sys.executable, "-m", "jpa", "serve-dp", *args], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and msg in r.stderr, r.stderr


@pytest.mark.bench
def test_busy_router_port():
    require_router()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "jpa", "serve-dp", "--router-port", str(port),
                            "--model", "tiny-llama"], capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
    assert r.returncode == 2 and f"--router-port: cannot bind 127.0.0.1:{port}: Address already in use" in r.stderr


def test_device_assignment():
    assert serve_dp.device_assignment(2, 1, None) == [None, None]   # no GPUs: nothing pinned
    assert serve_dp.device_assignment(2, 1, ["0", "1", "2"]) == ["0", "1"]
    assert serve_dp.device_assignment(2, 2, ["4", "5", "6", "7"]) == ["4,5", "6,7"]
    with pytest.raises(serve_dp.UsageError, match="--dp 3 x --devices-per-replica 2 needs 6 GPUs; 4 visible"):
        serve_dp.device_assignment(3, 2, ["0", "1", "2", "3"])
