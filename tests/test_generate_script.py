"""`jpa generate` (and scripts/generate.py, its thin caller) end to end on a tiny random model: JSONL in,
JSON lines out, bad lines reported."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from jpa.testing.procs import fast_compile_env

SCRIPT = pathlib.Path(__file__).parents[1] / "scripts" / "generate.py"


def load_script():
    from jpa.cli import generate

    return generate


@pytest.mark.bench
def test_jsonl_prompts_to_json_lines(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("JPA_CACHE_DIR", str(tmp_path / "cache"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join([
        json.dumps({"prompt": "hello there", "max_new_tokens": 5, "greedy": True}),
        "{not json",
        "a plain line",
        json.dumps({"prompt": "bad sampling", "top_p": 0.0}),
        "",
        json.dumps({"prompt": "three samples", "max_new_tokens": 4, "n": 2, "seed": 9}),
    ]) + "\n")
    rc = load_script().main(["--model", "tiny-llama", "--prompts-file", str(prompts), "--json",
                             "--no-progress", "--max-new-tokens", "7", "--max-seqs", "2", "--no-compile-cache"])
    out, err = capsys.readouterr()
    *recs, summary = [json.loads(line) for line in out.splitlines()]
    assert summary["summary"]["step_compiles"] == 1
    assert {"prefix_hit_rate", "peak_shared_pages", "cow_copies"} <= set(summary["summary"])
    assert [r["index"] for r in recs] == [0, 1, 2, 3, 4, 4]
    assert [r["sample"] for r in recs[4:]] == [0, 1] and all(len(r["token_ids"]) == 4 for r in recs[4:])
    assert len(recs[0]["token_ids"]) == 5 and recs[0]["error"] is None
    assert "invalid JSON" in recs[1]["error"]
    assert len(recs[2]["token_ids"]) <= 7 and recs[2]["prompt"] == "a plain line"
    assert "top_p must be in (0, 1]" in recs[3]["error"]
    assert rc == 1  # some requests failed
    assert "5 requests (3 ok, 2 failed)" in err and "pool whole after run: True" in err
    assert "unified step compiled 1x" in err
    assert not (tmp_path / "cache" / "xla").exists()  # --no-compile-cache


@pytest.mark.soak
def test_prompt_logprobs_and_text_flags(tmp_path, capsys):
    """--prompt-logprobs K scores every prompt (JSON: a 'prompt_logprobs' list, None first; text: the
    sum), a JSONL line can turn it off; --no-skip-special-tokens / --include-stop-str-in-output pass
    through to SamplingParams."""
    gen = load_script()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hello there", "greedy": True}) + "\n"
                       + json.dumps({"prompt": "no scores", "prompt_logprobs": None}) + "\n")
    rc = gen.main(["--model", "tiny-llama", "--prompts-file", str(prompts), "--json", "--no-progress",
                   "--max-new-tokens", "2", "--prompt-logprobs", "2", "--no-compile-cache"])
    out, _ = capsys.readouterr()
    a, b, _ = [json.loads(line) for line in out.splitlines()]
    assert rc == 0 and a["prompt_logprobs"][0] is None and len(a["prompt_logprobs"]) == a["num_prompt_tokens"] == 11
    assert all(len(e["top"]) == 2 and e["rank"] >= 1 and e["logprob"] <= 0 for e in a["prompt_logprobs"][1:])
    assert a["prompt_token_ids"] == list(b"hello there") and "prompt_logprobs" not in b
    rc = gen.main(["--model", "tiny-llama", "--no-progress", "--max-new-tokens", "2", "--prompt-logprobs", "0",
                   "--no-compile-cache", "hi there"])
    assert rc == 0 and "(prompt logprob -" in capsys.readouterr().out
    args = gen.parse_args(["--no-skip-special-tokens", "--include-stop-str-in-output", "x"])
    p = gen.sampling_flags(args, 0)
    assert (p["skip_special_tokens"], p["include_stop_str_in_output"], p["prompt_logprobs"]) == (False, True, None)


@pytest.mark.parametrize("argv,msg", [
    (["--page-size", "0"], "--page-size must be >= 1; got 0"),
    (["--prompts-file", "/no/such/prompts.jsonl"], "no such file"),
    (["--model", "gpt-17"], "--model 'gpt-17' is unknown; choose one of smollm2-135m, tiny-gpt2, tiny-llama"),
    (["--kv-memory", "-5"], "--kv-memory must be a positive number of MiB; got -5.0"),
    (["--kv-memory", "nan"], "--kv-memory must be a positive number of MiB"),
    (["--num-pages", "0"], "--num-pages must be >= 1"),
    (["--max-seqs", "two"], "argument --max-seqs: invalid int value: 'two'"),
    (["--steps-per-call", "-1"], "--steps-per-call must be >= 1"),
    (["--top-p", "1.5"], "top_p must be in (0, 1]"),
    (["--temperature", "-1"], "temperature must be a finite number >= 0"),
    (["--prompt-logprobs", "21"], "prompt_logprobs must be None (off) or an int in [0, 20]"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--model", "tiny-llama", "--kv-memory", "0.001", "--no-compile-cache", "x"], "holds no page"),
    (["--tp", "0"], "--tp must be >= 1; got 0"),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 99}'],
     "--speculative-config: num_speculative_tokens must be an int in [1, 16]; got 99"),
    (["--speculative-config", "{oops"], "--speculative-config: speculative config is not valid JSON"),
    (["--coordinator", "h:1"], "--coordinator, --num-processes and --process-id go together"),
    (["--coordinator", "h:1", "--num-processes", "2", "--process-id", "2"], "--process-id must be in [0, "),
    (["--model", "tiny-llama", "--tp", "64", "--no-compile-cache", "x"], "tensor_parallel=64 needs 64 devices"),
])
def test_bad_flags_are_one_line_and_exit_2(argv, msg, capsys):
    rc = load_script().main(argv + ["--no-progress"])
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if not line.startswith("[jpa] loading")]
    assert rc == 2 and out == ""
    assert len(lines) == 1 and lines[0].startswith("jpa generate: error: ") and msg in lines[0], err
    assert "Traceback" not in err


def test_bad_checkpoint_directory_is_one_line_and_exit_2(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"model_type": "bert"}')
    (tmp_path / "tokenizer.json").write_text("{}")
    rc = load_script().main(["--model", str(tmp_path), "--no-progress", "--no-compile-cache", "hi"])
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if not line.startswith("[jpa] loading")]
    assert rc == 2 and out == "" and "Traceback" not in err
    assert len(lines) == 1 and lines[0].startswith(f"jpa generate: error: --model {tmp_path}"), err


@pytest.mark.soak
def test_compile_cache_is_on_by_default(tmp_path):
    env = fast_compile_env(dict(os.environ, JPA_CACHE_DIR=str(tmp_path), JAX_PLATFORMS="cpu"))
    r = subprocess.run([sys.executable, str(SCRIPT), "--model", "tiny-llama", "--max-new-tokens", "2",
                        "--no-progress", "hi"], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    entries = [p.name for p in (tmp_path / "xla").iterdir()]
    assert any(name.startswith("jit__step_impl") for name in entries), entries
