"""The traffic table of the engine's decode step, Llama-3-8B's shapes on an H100 (deviceless):
`jpa tools traffic` end to end, at 64 sequences of 1024 tokens, as XLA compiles it by default
and as the engine compiles it, with `jpa.core.xla_options.WEIGHTS_IN_PLACE` (cuBLAS gemms fed the
layer's weights by offset).
Minutes of compiling: CI's bench tier."""

import json
import os
import pathlib
import subprocess
import sys

import pytest
from jpa.tools import deviceless
from test_traffic import engine_step_traffic

pytestmark = [pytest.mark.bench, pytest.mark.soak,
              pytest.mark.skipif(deviceless.missing_packages() is not None, reason=str(deviceless.missing_packages()))]

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run(tmp_path, *args):
    out = tmp_path / "traffic.json"
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", "TF_CPP_VMODULE")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    proc = subprocess.run([sys.executable, "-m", "jpa.tools", "traffic", "--max-seqs", "64",
                           "--json", str(out), *args], capture_output=True, text=True, timeout=1800, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| **total** |" in proc.stdout
    (r,) = json.loads(out.read_text())
    return r


def check_kv(s):
    # The Mosaic decode kernel reads one layer's live K and V per call; the new token's K and V are
    # written in place; no copy of a pool.
    assert s["kv_read"]["total"] == s["kv_read"]["ideal"] > 0
    assert s["kv_write"]["total"] == s["kv_write"]["ideal"] > 0


def test_llama8b_weights_read_in_place(tmp_path):
    r = run(tmp_path)   # as the engine compiles it: with its XLA options
    s = r["summary"]
    check_kv(s)
    assert s["weights"]["total"] <= 1.01 * s["weights"]["ideal"], s["weights"]
    # Nothing weight-shaped of a matrix's size is written (norm scales' 8 KiB slices may be).
    assert all(c["bytes"] / 32 < 2 ** 20 for c in s["weight_copies"]), s["weight_copies"]
    # The GPU sampler reads the [64, 128256] logits about twice (the dense formulation: ~25 times).
    assert r["logit_passes"] <= 3.5, (r["logit_passes"], s["logits"])


def test_llama8b_spec_step_samples_in_two_passes(tmp_path):
    """The speculative step (n-gram, k = 4: a verify pass of 320 rows) at 64 sequences: the sampler
    reads the verify rows' [320, 128256] logits about twice (pass 1: block maxima and sums; pass 2:
    the draw and the log-normalizer), not the ~27 reads of the dense formulation's threshold
    searches and chunk copies (5.9 GB a step before, `BENCHMARKS.md`); the sampler's logits traffic
    under 1 GB; activations under 5 GB (bf16 matmul outputs: 5.8 GB with float32 ones)."""
    r = run(tmp_path, "--which", "spec")
    s = r["summary"]
    check_kv(s)
    assert s["weights"]["total"] <= 1.01 * s["weights"]["ideal"], s["weights"]
    assert r["logit_passes"] <= 3.5, (r["logit_passes"], s["logits"])
    assert s["logits"]["total"] < 1e9 and s["other"]["total"] < 5e9, s
    assert s["total"]["total"] < 1.25 * s["total"]["ideal"], s["total"]


def test_llama8b_default_copies_weights(tmp_path):
    """XLA's Triton gemms read a copy of each layer's weight slice: the model sees it (weights about
    3x the ideal). Fails, telling us so, on the day XLA reads them in place by default."""
    s = run(tmp_path, "--xla-default")["summary"]
    check_kv(s)
    assert s["weights"]["total"] > 2.5 * s["weights"]["ideal"], s["weights"]
    assert sum(c["bytes"] >= 2 ** 20 * 32 for c in s["weight_copies"]) >= 7, s["weight_copies"]


def test_small_engine_step_copies_weights_by_default():
    """tests/test_traffic.py's main-tier program (a 2-layer Llama, the engine's own step for an
    H100) compiled as XLA compiles by default: its weight matrices' layer slices are copied out,
    the failure that test guards against."""
    out = engine_step_traffic(engine_options=False)
    assert out["options"] == {}
    assert len(out["matrix_copies"]) >= 4, out["matrix_copies"]
    assert out["weights"]["read"] > 1.5 * out["weights"]["ideal"], out["weights"]
