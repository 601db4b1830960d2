"""A server no client can take down (issue 37's defects), each reproduced against a live server.

Structured-output attacks, slow bodies and SIGTERM run against `scripts/serve.py` as a real
subprocess (tiny random llama): a crash there is a dead process the test sees, not a dead pytest.
The rest uses the in-process server of tests/server_util.py. Every load or adversarial loop is
bounded in count and time and stops by itself.
"""

import json
import os
import random
import re
import signal
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
pytest.importorskip("llguidance")

ROOT = Path(__file__).resolve().parents[1]
MODEL = "tiny-llama"
MSGS = [{"role": "user", "content": "hi"}]


class Proc:
    """scripts/serve.py in a subprocess, with the worktree's code."""

    def __init__(self, tmp, *args, ready=True):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "JPA_CACHE_DIR": str(tmp), "JAX_PLATFORMS": "cpu"}
        self.proc = subprocess.Popen([sys.executable, "scripts/serve.py", "--model", MODEL, "--port", "0",
                                      "--max-model-len", "256", "--num-pages", "96", "--max-seqs", "4", *args],
                                     cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
        self.url = None
        self.lines = []
        for line in self.proc.stderr:
            self.lines.append(line)
            m = re.search(r"serving '.*' on (http://127\.0\.0\.1:(\d+))", line)
            if m:
                self.url, self.port = m.group(1), int(m.group(2))
                break
        assert self.url, "".join(self.lines)
        if ready:
            t0 = time.monotonic()
            while True:
                try:
                    if httpx.get(f"{self.url}/health", timeout=10).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert self.proc.poll() is None and time.monotonic() - t0 < 300, "the model never became ready"
                time.sleep(0.2)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def post(self, path, body, timeout=60):
        return httpx.post(f"{self.url}{path}", json={"model": MODEL, **body}, timeout=timeout)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.stderr.read()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    p = Proc(tmp_path_factory.mktemp("cache"), "--grammar-compile-timeout", "5")
    try:
        yield p
    finally:
        p.stop()


def _err(r, status, param):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    return err["message"]


# ---------------------------------------------------------------------- defect 1: grammars that crash

def _lark_chain(n):
    return "\n".join(["start: r0"] + [f'r{i}: "a{i}" r{i + 1}' for i in range(n)] + [f'r{n}: "z"'])


def _gbnf_chain(n):
    return "\n".join(["root ::= r0"] + [f'r{i} ::= "a{i}" r{i + 1}' for i in range(n)] + [f'r{n} ::= "z"'])


def _defs_chain(n):
    defs = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}, "required": ["x"]}
            for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def test_grammars_that_overflowed_the_stack_are_400s(server):
    """Before: the 3000-rule Lark grammar and the 1000-deep $defs chain (as response_format and as a
    forced tool's parameters) killed the process with SIGSEGV; the 5000-rule GBNF spun 20+ s.
    Now: 400s naming the field, quickly, and the server serves the next request."""
    cases = [
        ({"structured_outputs": {"grammar": _lark_chain(3000)}}, "structured_outputs", "rules"),
        ({"structured_outputs": {"grammar": _gbnf_chain(5000)}}, "structured_outputs", "rules"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": _defs_chain(1000)}}},
         "response_format", "deep"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": _defs_chain(1000)}}],
          "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools", "deep"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": _defs_chain(1000)}}],
          "tool_choice": "required"}, "tools", "'tools'"),
    ]
    for body, param, word in cases:
        t0 = time.monotonic()
        r = server.post("/v1/chat/completions", {"messages": MSGS, "max_tokens": 4, **body})
        assert server.alive(), "the server died"
        assert word in _err(r, 400, param)
        assert time.monotonic() - t0 < 10
    r = server.post("/v1/completions", {"prompt": "x", "max_tokens": 3, "structured_outputs": {"grammar":
                                                                                              _lark_chain(50)}})
    assert r.status_code == 200, r.text


def _random_constraint(rng: random.Random, size: int):
    """One random (field body, param) of growing size/depth: a grammar, a schema or a regex."""
    kind = rng.choice(["lark", "gbnf", "defs", "nest", "anyof", "regex", "regex_rep", "choice", "lark_parens"])
    if kind == "lark":
        return {"structured_outputs": {"grammar": _lark_chain(size)}}, "structured_outputs"
    if kind == "gbnf":
        return {"structured_outputs": {"grammar": _gbnf_chain(size)}}, "structured_outputs"
    if kind == "lark_parens":
        return {"structured_outputs": {"grammar": "start: " + "(" * size + '"a"' + ")" * size}}, "structured_outputs"
    if kind == "defs":
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema":
                                                                           _defs_chain(size)}}}, "response_format"
    if kind in ("nest", "anyof"):
        s = {"type": "integer"}
        for _ in range(min(size, 300)):   # the JSON body itself is bounded by the parser's depth
            s = ({"type": "object", "properties": {"a": s}, "required": ["a"]} if kind == "nest"
                 else {"anyOf": [s, {"type": "null"}]})
        return {"structured_outputs": {"json": s}}, "structured_outputs"
    if kind == "regex":
        return {"structured_outputs": {"regex": "(" * size + "a" + ")" * size}}, "structured_outputs"
    if kind == "regex_rep":
        return {"structured_outputs": {"regex": "(a{%d}){%d}" % (size, rng.randint(1, size))}}, "structured_outputs"
    return {"structured_outputs": {"choice": [f"opt{i}" for i in range(size * 5)]}}, "structured_outputs"


def test_adversarial_constraints_never_kill_or_stall_the_server(server):
    """Seeded random grammars, schemas, regexes and choices of growing size and depth (bounded:
    JPA_ADVERSARIAL_CASES, default 30; 240 s in all): each answers 200 or a 400 naming its field
    within the compile deadline (5 s here) plus slack, and the process never dies."""
    rng = random.Random(37)
    cases = int(os.environ.get("JPA_ADVERSARIAL_CASES", "30"))
    t_end = time.monotonic() + 240
    sizes = [int(10 * 1.4 ** i) for i in range(cases)]   # 10 ... ~200k
    for i, size in enumerate(sizes):
        if time.monotonic() > t_end:
            break
        body, param = _random_constraint(rng, min(size, 6000))
        t0 = time.monotonic()
        r = server.post("/v1/chat/completions", {"messages": MSGS, "max_tokens": 2, **body}, timeout=60)
        took = time.monotonic() - t0
        assert server.alive(), f"case {i} ({list(body)}, size {size}) killed the server"
        assert r.status_code in (200, 400), (i, r.status_code, r.text[:300])
        if r.status_code == 400:
            assert r.json()["error"]["param"] == param, r.text[:300]
            assert "panicked" not in r.text and "backtrace" not in r.text
        assert took < 5 + 10, (i, list(body), size, took)
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
