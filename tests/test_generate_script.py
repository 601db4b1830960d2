"""scripts/generate.py end to end on a tiny random model: JSONL in, JSON lines out, bad lines reported."""

import importlib.util
import json
import pathlib

SCRIPT = pathlib.Path(__file__).parents[1] / "scripts" / "generate.py"


def load_script():
    spec = importlib.util.spec_from_file_location("generate_script", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_jsonl_prompts_to_json_lines(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join([
        json.dumps({"prompt": "hello there", "max_new_tokens": 5, "greedy": True}),
        "{not json",
        "a plain line",
        json.dumps({"prompt": "bad sampling", "top_p": 0.0}),
        "",
    ]) + "\n")
    rc = load_script().main(["--model", "tiny-llama", "--prompts-file", str(prompts), "--json",
                             "--no-progress", "--max-new-tokens", "7", "--max-seqs", "2"])
    out, err = capsys.readouterr()
    recs = [json.loads(line) for line in out.splitlines()]
    assert [r["index"] for r in recs] == [0, 1, 2, 3]
    assert len(recs[0]["token_ids"]) == 5 and recs[0]["error"] is None
    assert "invalid JSON" in recs[1]["error"]
    assert len(recs[2]["token_ids"]) <= 7 and recs[2]["prompt"] == "a plain line"
    assert "top_p must be in (0, 1]" in recs[3]["error"]
    assert rc == 1  # some requests failed
    assert "4 requests (2 ok, 2 failed)" in err and "pool whole after run: True" in err
    assert "decode step compiled 1x" in err
