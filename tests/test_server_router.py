"""A jpa server behind vllm-router (vLLM's Rust load balancer), on loopback.

The router rewrites requests before forwarding them: it adds fields of its own (`no_stop_trim`,
`skip_special_tokens`, `separate_reasoning`, `return_hidden_states`, ...), which a server that
refuses unknown fields answers with 400 for every request (issue 23). The router is installed from
the package registry into a cache folder of its own (not the test environment: it is a 24 MB wheel
with its own dependencies); the test is skipped, with the reason, when that cannot be done.
"""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")

import models  # noqa: E402
from jpa.engine import AsyncEngine, EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from jpa.server import build_app  # noqa: E402

from test_server import serving  # noqa: E402

ROUTER = os.environ.get("JPA_VLLM_ROUTER", "vllm-router==0.1.17")   # the version this test was written against
NAME = "tiny"


def _router_dir() -> Path:
    """A folder holding the vllm_router package (pip install --target), installed once."""
    base = Path(os.environ.get("JPA_CACHE_DIR", Path.home() / ".cache" / "jpa"))
    target = base / ("router-" + ROUTER.replace("=", "").replace("/", "_"))
    if (target / "vllm_router" / "launch_router.py").is_file():
        return target
    try:
        r = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                            "--target", str(target), ROUTER], capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"cannot install {ROUTER} from the package registry: {e}")
    if r.returncode != 0 or not (target / "vllm_router").is_dir():
        pytest.skip(f"cannot install {ROUTER} from the package registry: {(r.stderr or r.stdout).strip()[-400:]}")
    return target


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def through_router():
    target = _router_dir()
    model, tok = models.load("tiny-llama", seed=1)
    eng = LLMEngine(models.GPTForEngine(model), tok, EngineConfig(max_seqs=4, page_size=16, num_pages=128,
                                                                  steps_per_call=4, max_model_len=256))
    ref = eng.generate(["hello there"], SamplingParams(max_new_tokens=12, greedy=True, ignore_eos=True))[0]
    with AsyncEngine(eng, max_waiting=16) as aengine, serving(build_app(aengine, tok, model_name=NAME)) as url:
        port = _free_port()
        env = {**os.environ, "PYTHONPATH": str(target), "PYTHONNOUSERSITE": "1"}
        proc = subprocess.Popen([sys.executable, "-m", "vllm_router.launch_router", "--host", "127.0.0.1",
                                 "--port", str(port), "--worker-urls", url, "--policy", "round_robin",
                                 "--disable-retries", "--log-level", "warning"],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        router = f"http://127.0.0.1:{port}"
        try:
            t0 = time.monotonic()
            while True:
                if proc.poll() is not None:
                    pytest.skip(f"{ROUTER} did not start: {proc.stdout.read()[-400:]}")
                try:
                    if httpx.get(f"{router}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() - t0 < 60, "the router did not come up within 60 s"
                time.sleep(0.2)
            yield router, ref
        finally:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_requests_through_vllm_router(through_router):
    router, ref = through_router
    client = openai.OpenAI(base_url=f"{router}/v1", api_key="unused", max_retries=0, timeout=60)
    r = client.completions.create(model=NAME, prompt="hello there", max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == ref.completion and r.usage.completion_tokens == 12
    msgs = [{"role": "user", "content": "Name a river."}]
    chat = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=8, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens <= 8
    chunks = list(client.chat.completions.create(model=NAME, messages=msgs, max_tokens=8, temperature=0,
                                                 stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=NAME, prompt="hello there", max_tokens=12, temperature=0, stream=True, extra_body={"ignore_eos": True}))
    assert streamed == ref.completion
    # A few at once, through the router's round robin (one worker): all served.
    with httpx.Client(base_url=router, timeout=60) as c:
        for i in range(4):
            r = c.post("/v1/completions", json={"model": NAME, "prompt": f"request {i}", "max_tokens": 4})
            assert r.status_code == 200, r.text
        # Sampling controls pass through the router to the engine.
        r = c.post("/v1/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 4, "presence_penalty": 0.5})
        assert r.status_code == 200, r.text
        # A request the router forwards but jpa refuses comes back as jpa's 400 naming the field.
        # (The router answers some bad values itself, e.g. max_tokens -1 with its own 422.)
        r = c.post("/v1/completions", json={"model": NAME, "prompt": "hi", "min_tokens": 50, "max_tokens": 4})
        assert r.status_code == 400 and json.loads(r.text)["error"]["param"] == "min_tokens", r.text
