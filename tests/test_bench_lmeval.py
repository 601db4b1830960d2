"""lm-eval's `local-completions` with `tokenizer_backend=remote` against `jpa serve` (issue 37).

lm-eval (PyPI `lm_eval`, no PyTorch needed for API models) runs two local tasks (JSON files written
here, nothing downloaded) against the tiny random llama served by `python -m jpa serve`: a
multiple-choice task (loglikelihood: token-id prompts with `echo` + `logprobs`) and a generate_until
task. Its remote tokenizer reads `GET /tokenizer_info` and tokenizes through `POST /tokenize`. The
scores of a random model mean nothing; the test checks that the run completes with every request
answered and scores in range. Bench tier (`./run test -m bench`): it starts a server and lm-eval.

    python -m jpa serve --model tiny-llama --port 8000 &
    lm_eval --model local-completions --include_path <dir of task yaml> --tasks <task> --model_args \
        model=tiny-llama,base_url=http://127.0.0.1:8000/v1/completions,tokenizer_backend=remote,num_concurrent=2
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("httpx")

pytestmark = [pytest.mark.bench, pytest.mark.soak]

MC = [{"question": "The sky is", "choices": [" blue", " green", " loud"], "answer": 0},
      {"question": "Two plus two is", "choices": [" four", " five"], "answer": 0},
      {"question": "Water is", "choices": [" wet", " dry", " square", " é"], "answer": 0}]
GEN = [{"question": "Say hi:", "answer": "hi"}, {"question": "Count: 1 2 3", "answer": "4"}]
TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: {kind}
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
{extra}"""
MC_EXTRA = """doc_to_choice: "{{choices}}"
metric_list:
  - metric: acc
"""
GEN_EXTRA = """generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
"""


def test_lm_eval_local_completions_with_the_remote_tokenizer(tmp_path):
    from test_server_hardening import MODEL, Proc

    tasks = tmp_path / "tasks"
    tasks.mkdir()
    for name, rows, kind, extra in [("jpa_tiny_mc", MC, "multiple_choice", MC_EXTRA),
                                    ("jpa_tiny_gen", GEN, "generate_until", GEN_EXTRA)]:
        data = tmp_path / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        (tasks / f"{name}.yaml").write_text(TASK.format(name=name, data=data, kind=kind, extra=extra))
    server = Proc(tmp_path / "cache")
    try:
        env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE":
               str(tmp_path / "hf"), "HF_HOME": str(tmp_path / "hf"), "JAX_PLATFORMS": "cpu"}
        args = (f"model={MODEL},base_url={server.url}/v1/completions,tokenizer_backend=remote,"
                f"num_concurrent=2,max_retries=1,timeout=120")
        r = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", args,
                            "--include_path", str(tasks), "--tasks", "jpa_tiny_mc,jpa_tiny_gen",
                            "--output_path", str(tmp_path / "out")],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
        assert server.alive()
    finally:
        log = server.stop()
    (results,) = list((tmp_path / "out").rglob("results_*.json"))
    res = json.loads(results.read_text())["results"]
    assert 0 <= res["jpa_tiny_mc"]["acc,none"] <= 1 and 0 <= res["jpa_tiny_gen"]["exact_match,none"] <= 1, res
    assert "Traceback" not in log, log[-3000:]
