"""LLMEngine: continuous batching on the host around the jitted unified step.

A round (`step()`) is three verbs, as nano-vllm's `step()` and vLLM v1's engine core:

    plan = engine.schedule()              # the scheduler plans a token budget
    result = engine.execute(plan)         # make_step_batch -> ONE device call -> StepResult
    outputs = engine.update(plan, result) # tokens, stops, preemption, outputs

`schedule` gives one token to each decoding request, then chunks of partly prefilled and newly
admitted prompts. `execute` turns the plan into the step's typed input (`make_step_batch`, over
the engine's one `EngineShapes` record) and ONE device call first releases the slots the host
released since the last call (`RoundPlan.release`: stop strings, aborts, preemptions), then runs
the ragged step over the plan and then up to `steps_per_call` decode steps (all of them when no
prompt work is pending, none when the next round has prompt work); the new tokens come back
together with the page state (`StepResult`). In `update`, requests the device finished (EOS,
max_new_tokens, length limit) have already released their pages; stop strings are found on the
host by incremental detokenization and those requests are released; if the next step still cannot
get pages, the newest running request is preempted by recompute (its pages released, back to the
front of the queue with its generated tokens kept; on re-admission they are prefilled again and
decoding resumes where it stopped). See `jpa.engine.scheduler` for the policies.

Releases ride in the next round's StepBatch: a round makes one device call whatever it
releases. That next round is planned (admission, preemption, evictions) from the device's figures
of the last call: its free page count plus, per released slot, the pages that slot alone
references (`DeviceCounts.own`, counted on the device from its refcounts, so shared prefix pages
and a forked sample's shared pages are never counted twice: the host keeps no page count of its
own). The sum is exact unless two released slots share uncached pages (`DeviceCounts.shared`: a
forked sample and its leader stopping together); then, and before anything that needs the page
state after the release sooner, the release is a device call of its own (`flush_releases` ->
`ModelRunner.retire`): before KV offload's swap-ins (programs of their own before the step),
`flush_prefix_cache`. So every plan is the one the old order (release, then plan) made. The
queries `check_page_state` and `pool_is_whole` read the device's state after the pending release
(computed on a copy: they change nothing); the first checks that the host's projected free count
is that state's.

Feature hook points (where a feature plugs in; see `jpa.engine.runner` for the device side):
  plan       `Scheduler.plan_round`; a request hook's `plan(req)` (`Scheduler(hooks=...)`:
             structured outputs keep a ragged row per constrained request,
             `jpa.engine.structured.StructuredHook`); prefix caching names evictions
  batch      a record of `StepBatch` per feature (`structured`, `prompt`, ...), filled in `execute`
  device     on the logits in the ragged pass (grammar masks), on acceptance in the verify loop
             (`VerifyLoop.accept`, the proposer of `jpa.engine.speculative`)
  post       `update`: `Scheduler.stepped` / `_on_tokens` (stop strings, prefix cache) and a
             request hook's `post(req, device_done)` (structured outputs: the grammar matcher)
KV offload (EngineConfig.kv_offload_bytes) plugs in at plan and beside the step: the scheduler
decides which preempted requests are swapped out to the host tier (`jpa.kv.offload.HostTier`,
consulted again at admission) and plans their swap-ins (`RoundPlan.swap_in`); `update` copies the
preempted pages out (`ModelRunner.swap_out`, dispatched before the call that releases them) and `execute` copies
them back into new pages (`ModelRunner.swap_in`, page work of its own with the round's evictions)
before the step, which then prefills only the last token. With prefix caching the tier also takes
the pages the prefix cache evicts (`RoundPlan.spill`: `ModelRunner.spill` copies them out before the
round's first call frees them) and gives them back on a later hit (a `SwapIn` with `restore`:
`ModelRunner.restore`). No host round trip: all of them are dispatched asynchronously, and the
swap-ins' all-or-nothing flags are read with the step's result.
LoRA would add per-entry adapter ids (a batch record read by the model passes).

Structured outputs (SamplingParams.structured): each constrained request has a grammar matcher
(`jpa.engine.structured`); `execute` sends the allowed-token bitmask of every entry that samples
under one (`constrained_rows`) with the round; such requests sample only in the ragged step.

A long-lived engine (a server) keeps nothing of a finished request: step() hands each one out
once, in the round it finishes, and the statistics are running sums.
"""

import atexit
import collections
import dataclasses
import itertools
import sys
import time

import jax
import numpy as np

from jpa.kv import pages
from jpa.kv.cache import CacheConfig
from jpa.kv.offload import HostTier, SwapCost
from jpa.engine.batch import StepResult, make_step_batch
from jpa.engine import multihost
from jpa.engine.detokenizer import IncrementalDetokenizer
from jpa.engine.lora import LoRARequest, LoraSlots
from jpa.engine.model import EngineModel, cache_spec_of, check_model, has_hidden
from jpa.engine.request import Phase, Request, RequestOutput, StepOutput
from jpa.engine.runner import ModelRunner
from jpa.engine.sampling import SamplingParams
from jpa.engine.scheduler import RoundPlan, Scheduler
from jpa.engine.speculative import SpeculativeConfig, draft_cache_config, record_spec_counts, spec_summary
from jpa.engine.states import recurrent_names, refuse_options
from jpa.engine.shapes import EngineShapes, step_ladder
from jpa.engine.structured import Grammars, constrained_rows
from jpa.core.sharding import tp_mesh


ATTENTION_IMPLS = ("auto", "xla", "triton", "mosaic")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Engine sizes and policies (hashable).

    Attributes:
      max_seqs: decode slots (sequences decoded together).
      page_size: tokens per KV page.
      num_pages: pages in the pool; if None, derived from kv_memory_bytes.
      kv_memory_bytes: KV cache budget used when num_pages is None.
      max_model_len: longest sequence (prompt + completion); None = the model's max_seq_len.
      steps_per_call: decode steps per host round trip.
      watermark: fraction of the pool kept free at admission (vLLM's watermark), so running
        requests can grow before anyone is preempted.
      max_num_batched_tokens: the token budget T of a round (vLLM's name; >= max_seqs). Every
        round is ONE compiled program, the unified step: a ragged batch of decode tokens and
        prompt chunks over this budget (`jpa.ragged_paged_attention`), then the multi-step decode
        loop; prompts longer than the budget span rounds, and running sequences keep decoding
        while a long prompt is prefilled.
      prefix_caching: automatic prefix caching: full
        prompt pages stay cached after their request (cached-idle, evicted least recently used
        first when the pool runs short), and a request whose prompt starts with cached pages
        shares them (refcounts) and prefills only the rest. See `jpa.kv.prefix_cache`. None (the
        default): on, unless the model's cache has a recurrent group (a hit would need the state at
        the cached block's boundary, which the engine does not keep): then off, with a notice. True
        with such a model is refused.
      ragged_block_tokens: rows the ragged step runs through the model per pass (a loop over
        the live rows only, so a round costs its live rows, not the budget). None: 64 on a CPU,
        the whole budget on a GPU.
      cache_dtype: KV cache dtype; None = the model's dtype.
      attention_impl: attention backend of the decode loop and the ragged step ("auto", "xla",
        "triton", "mosaic"); "auto" picks the Pallas kernel for the GPU the program is compiled
        for, after a one-time self-check at its exact shapes, and the plain-JAX path elsewhere.
        The summary's "attention" field says what the compiled program runs.
      tensor_parallel: devices the model and the KV pool are sharded over (a "tp" mesh of the
        first N of jax.devices()); the model must offer `shard(mesh)` (models.GPTForEngine
        does). kv_memory_bytes is then the budget of EACH device (each holds its heads of every
        page). See docs/multi-host.md, "Tensor parallelism".
      speculative: speculative decoding (`jpa.engine.speculative.SpeculativeConfig`, or its dict or
        JSON string as vLLM's --speculative-config spells it); None = off. The decode loop then
        verifies up to k drafts per sequence per step; outputs are identical to decoding without
        it (greedy and seeded sampling alike). See docs/engine.md, "Speculative decoding".
      peer_timeout: several processes (`jax.distributed`, see `jpa.engine.multihost`): seconds a
        device call may wait for the other processes before this one gives up on them and exits.
      step_shapes: the compiled step's shapes (`jpa.engine.ladder`): "off" (one program, max_seqs
        entries and the whole token budget in every round, as a batch-invariant mode needs),
        "ladder" (rungs of 1, 2, 4, ... rows and 16 tokens a row, each round on the smallest
        compiled one that holds it; the full shape compiles first, the others in a background
        thread), or a sequence of (rows, tokens) pairs (the full shape is added). Outputs are the
        same at every shape.
      kv_offload_bytes: KV offload: bytes of host memory for a tier of KV pages (0 = off). A
        preempted request's pages are copied there (swap out) and back on resume (swap in)
        instead of being recomputed, when the cost rule prefers the copy and the tier has room; with
        prefix caching, pages the prefix cache evicts are kept there too and copied back on a
        later hit (see `jpa.kv.offload`). vLLM's --swap-space / --kv-offloading-size.
      batch_invariant: a request's tokens and logprobs are bitwise the same whatever else runs
        (batch size, slot, neighbours, prefill chunking, steps_per_call, preemption and recompute,
        prefix-cache hits), and the prompt logprobs of prompt + completion equal a greedy sampler's
        logprobs (scoring parity): vLLM's VLLM_BATCH_INVARIANT, SGLang's deterministic mode, for RL.
        How: every token is a row of the ragged pass (no decode loop: one token per request per
        round, `steps_per_call` unused), whose model passes always have one shape (`block_tokens`
        rows; the head [max_seqs, d_model] for sampling and prompt logprobs alike), and attention
        computes each row as a decode query of its own in plain JAX (`jpa.ops.ragged.rows_independent`).
        So the step must keep ONE compiled shape in this mode: a ladder of step shapes (batch-size
        buckets) must use its single full-budget shape when batch_invariant is set (step_shapes "off";
        any other is a ValueError, and `--batch-invariant` turns the CLI's default ladder off). Not with
        speculative decoding. Proven on CPU (tests/test_batch_invariant.py); on a GPU the GEMMs'
        algorithm is then fixed per program (one shape), which remains to be checked there
        (scripts/gpu_validate.py).
      enable_lora: serve LoRA adapters (`jpa.engine.lora`; docs/lora.md): a request names one with
        `add_request(..., lora_request=LoRARequest(name, int_id, path))`; each row of a step runs its own
        adapter (or the base model). Needs a model with EngineModel's optional `lora_slots` / `read_lora`
        (models.GPTForEngine); under tensor_parallel the adapters are split as their base weights are.
      max_loras: adapters on the device at once (vLLM's --max-loras); more wait on the host and swap in,
        least recently used first.
      max_lora_rank: the largest adapter rank served (vLLM's --max-lora-rank); every slot is this wide.
    """
    max_seqs: int = 16
    page_size: int = 16
    num_pages: int | None = None
    kv_memory_bytes: int = 256 * 2 ** 20
    max_model_len: int | None = None
    steps_per_call: int = 8
    watermark: float = 0.01
    cache_dtype: str | None = None
    attention_impl: str = "auto"
    tensor_parallel: int = 1
    max_num_batched_tokens: int = 512
    ragged_block_tokens: int | None = None
    prefix_caching: bool | None = None
    speculative: SpeculativeConfig | None = None
    peer_timeout: float = 60.0
    kv_offload_bytes: int = 0
    batch_invariant: bool = False
    step_shapes: str | tuple = "off"
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16

    def __post_init__(self):
        if self.speculative is not None:
            object.__setattr__(self, "speculative", SpeculativeConfig.parse(self.speculative))
        for name in ("max_seqs", "page_size", "steps_per_call", "tensor_parallel", "max_num_batched_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"EngineConfig.{name} must be an int >= 1; got {v!r}")
        for name in ("num_pages", "max_model_len", "ragged_block_tokens"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"EngineConfig.{name} must be an int >= 1 or None; got {v!r}")
        if self.num_pages is None and (not isinstance(self.kv_memory_bytes, int) or self.kv_memory_bytes < 1):
            raise ValueError(f"EngineConfig.kv_memory_bytes must be an int >= 1; got {self.kv_memory_bytes!r}")
        if not isinstance(self.peer_timeout, (int, float)) or isinstance(self.peer_timeout, bool) \
                or not self.peer_timeout > 0:
            raise ValueError(f"EngineConfig.peer_timeout must be a number of seconds > 0; got {self.peer_timeout!r}")
        if not isinstance(self.kv_offload_bytes, int) or isinstance(self.kv_offload_bytes, bool) \
                or self.kv_offload_bytes < 0:
            raise ValueError(f"EngineConfig.kv_offload_bytes must be an int >= 0 (0 = off); "
                             f"got {self.kv_offload_bytes!r}")
        if self.kv_offload_bytes and self.tensor_parallel > 1:
            raise ValueError("EngineConfig.kv_offload_bytes needs tensor_parallel=1 (the host tier of a sharded pool "
                             "is not built yet)")
        if not 0 <= self.watermark < 1:
            raise ValueError(f"EngineConfig.watermark must be in [0, 1); got {self.watermark!r}")
        if not isinstance(self.batch_invariant, bool):
            raise ValueError(f"EngineConfig.batch_invariant must be a bool; got {self.batch_invariant!r}")
        if self.batch_invariant and self.speculative is not None:
            raise ValueError("EngineConfig.batch_invariant does not go with speculative decoding (its verify rows "
                             "are batched per step); turn one off")
        if self.prefix_caching is not None and not isinstance(self.prefix_caching, bool):
            raise ValueError(f"EngineConfig.prefix_caching must be a bool or None; got {self.prefix_caching!r}")
        if self.max_num_batched_tokens < self.max_seqs:
            raise ValueError(f"EngineConfig.max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                             f"max_seqs ({self.max_seqs}): every decoding sequence takes one token of the budget")
        if not isinstance(self.step_shapes, str):   # hashable, and checked against the sizes here
            object.__setattr__(self, "step_shapes", tuple(tuple(p) if isinstance(p, (list, tuple)) else p
                                                          for p in self.step_shapes))
        step_ladder(self.step_shapes, self.max_seqs, self.max_num_batched_tokens)
        if self.batch_invariant and self.step_shapes != "off":
            raise ValueError(f"EngineConfig.batch_invariant needs one compiled step shape (step_shapes='off'); got "
                             f"step_shapes={self.step_shapes!r}")
        if not isinstance(self.enable_lora, bool):
            raise ValueError(f"EngineConfig.enable_lora must be a bool; got {self.enable_lora!r}")
        for name in ("max_loras", "max_lora_rank"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"EngineConfig.{name} must be an int >= 1; got {v!r}")
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"EngineConfig.attention_impl must be one of {ATTENTION_IMPLS}; "
                             f"got {self.attention_impl!r}")


@dataclasses.dataclass
class EngineStats:
    """Counters of one engine (cumulative running sums: constant memory in a long-lived engine)."""
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0      # wall time of the rounds that computed prompt tokens (one program
                                      # also runs their decode rows and steps: an upper bound)
    decode_tokens: int = 0
    decode_seconds: float = 0.0       # wall time of every device call (dispatch + device work + readback)
    host_seconds: float = 0.0         # Python bookkeeping between device calls (tokens, stops, preemption)
    compile_seconds: float = 0.0
    decode_calls: int = 0
    decode_steps: int = 0
    preemptions: int = 0
    peak_pages_used: int = 0
    util_sum: float = 0.0             # sum over device calls of tokens stored / slots allocated
    util_count: int = 0
    peak_shared_pages: int = 0        # prefix caching: most pages held by two or more running requests
    spec_draft_tokens: int = 0        # speculative decoding: draft tokens verified
    spec_accepted_tokens: int = 0     # of them, accepted
    spec_drafts: int = 0              # (sequence, verify step) pairs that had drafts (vLLM's num_drafts)
    spec_accepted_per_pos: list = dataclasses.field(default_factory=list)  # accepted drafts by position
    swapped_out: int = 0              # KV offload: preemptions whose pages went to the host tier
    swapped_in: int = 0               # admissions whose pages came back from it
    swap_out_pages: int = 0           # pages copied device -> host (block buckets)
    swap_in_pages: int = 0            # pages copied host -> device
    swap_out_bytes: int = 0
    swap_in_bytes: int = 0
    recompute_avoided_tokens: int = 0  # tokens restored from the host instead of prefilled again
    spill_pages: int = 0              # prefix-cache pages copied device -> host when evicted
    spill_bytes: int = 0
    restored: int = 0                 # admissions whose prefix hit came (partly) from the host tier
    restore_pages: int = 0            # spilled pages copied host -> device (host-tier prefix hits)
    restore_bytes: int = 0

    @property
    def kv_utilization(self) -> float:
        return self.util_sum / self.util_count if self.util_count else float("nan")

    @property
    def host_overhead(self) -> float:
        total = self.decode_seconds + self.host_seconds
        return self.host_seconds / total if total else float("nan")


class RaggedRowsHook:
    """Batch-invariant mode (`EngineConfig.batch_invariant`) at the scheduler's request hook points: every
    decoding request takes a ragged row every round (`schedule` then plans no decode-loop step)."""

    @staticmethod
    def plan(req) -> bool:
        return True

    @staticmethod
    def post(req, device_done: bool):
        return None


def _is_named(weights) -> bool:
    """A flat mapping of tensor names (dotted strings) to arrays, not a parameter pytree."""
    import collections.abc

    return (isinstance(weights, collections.abc.Mapping) and not hasattr(weights, "flat_state") and bool(weights)
            and all(isinstance(k, str) and "." in k for k in weights))


class LLMEngine:
    """Continuous-batching generation with a paged KV cache.

    Use `generate()` offline, or drive it round by round (a server): `add_request()` and `abort()`
    between rounds, `step()` for one round, which returns a StepOutput per request that got new
    tokens or finished. Not thread-safe: call all three from one thread (or event loop).

    Args:
      model: an EngineModel (e.g. `models.GPTForEngine(gpt)`): config sizes, dtype, params,
        ragged and decode.
      tokenizer: with encode/decode, eos_token_id and (optionally) stop_token_ids.
      config: EngineConfig.
    """

    def __init__(self, model: EngineModel, tokenizer, config: EngineConfig = EngineConfig(), *,
                 draft_model: EngineModel | None = None):
        check_model(model)
        declared = cache_spec_of(model)
        if config.prefix_caching is None:   # the default: on where the model's cache allows it
            config = dataclasses.replace(config, prefix_caching=not declared.has_recurrent)
            if declared.has_recurrent:
                print(f"[jpa] prefix caching is off: the model keeps recurrent state "
                      f"({recurrent_names(declared)}), which a prefix-cache hit would need at the cached block's "
                      f"boundary", file=sys.stderr)
        # A recurrent group's state slots (jpa.engine.states): the options the engine cannot serve with them.
        refuse_options(declared, prefix_caching=config.prefix_caching, speculative=config.speculative,
                       tensor_parallel=config.tensor_parallel)
        spec = config.speculative
        if (draft_model is not None) != (spec is not None and spec.method == "draft_model"):
            raise ValueError("speculative method 'draft_model' needs the draft model (LLMEngine(..., draft_model=...)), "
                             "and a draft model needs that method")
        self.mesh = None
        if config.tensor_parallel > 1:
            if not callable(getattr(model, "shard", None)):
                raise TypeError(f"EngineConfig.tensor_parallel={config.tensor_parallel} needs a model with "
                                f"shard(mesh) (models.GPTForEngine has it); {type(model).__name__} has none")
            self.mesh = tp_mesh(config.tensor_parallel)
            model = model.shard(self.mesh)
            check_model(model)
        self.model, self.tokenizer, self.config = model, tokenizer, config
        mc = model.config  # under tensor parallelism: the head counts the shards hold
        self.max_model_len = min(config.max_model_len or mc.max_seq_len, mc.max_seq_len)
        self.pages_per_seq = -(-self.max_model_len // config.page_size)
        # The cache the model declares, per group of layers (jpa.kv.spec): what the pool is sized from and what
        # the start-up summary reports.
        self.cache_spec = cache_spec_of(model)
        self.cache_config, self.draft_cache_config = self._cache_configs(model, draft_model, config, self.cache_spec)
        self.num_pages = self.cache_config.num_pages
        # A sequence must be able to reach its length limit alone in the pool, or preemption
        # could never make room for it.
        self.max_model_len = min(self.max_model_len, self.num_pages * config.page_size)
        stop_ids = set(getattr(tokenizer, "stop_token_ids", ()) or ()) | {tokenizer.eos_token_id}
        self.stop_ids = frozenset(i for i in stop_ids if i is not None)
        # The engine's sizes, fixed once: every layer reads them from this record.
        self.shapes = EngineShapes(max_seqs=config.max_seqs, page_size=config.page_size, num_pages=self.num_pages,
                                   pages_per_seq=self.pages_per_seq, max_model_len=self.max_model_len,
                                   num_tokens=config.max_num_batched_tokens, steps_per_call=config.steps_per_call,
                                   vocab_size=mc.vocab_size)
        self.runner = ModelRunner(model, self.cache_config, shapes=self.shapes, stop_ids=self.stop_ids,
                                  attention_impl=config.attention_impl, mesh=self.mesh,
                                  block_tokens=config.ragged_block_tokens, speculative=config.speculative,
                                  draft=draft_model, draft_cache_config=self.draft_cache_config,
                                  batch_invariant=config.batch_invariant,
                                  step_shapes=step_ladder(config.step_shapes if jax.process_count() == 1 else "off",
                                                          config.max_seqs, config.max_num_batched_tokens))
        # Several processes: process 0 leads (its device calls are sent to the others), the others follow.
        self.process_index, self.num_processes = jax.process_index(), jax.process_count()
        self._follower = None
        if self.num_processes > 1:
            if config.tensor_parallel != jax.device_count():
                raise ValueError(f"a job of {self.num_processes} processes runs one engine over all of its "
                                 f"{jax.device_count()} devices: tensor_parallel must be {jax.device_count()}; got "
                                 f"{config.tensor_parallel} (for independent replicas, run one job per replica)")
            lockstep = dict(peer_timeout=config.peer_timeout)
            if self.process_index == 0:
                self.runner = multihost.Leader(self.runner, **lockstep)
                atexit.register(self.close, ok=False)   # an exit without close(): the followers stop too
            else:
                self._follower = multihost.Follower(self.runner, **lockstep)
        self.host_tier = self.swap_cost = None
        self._spilled = {}   # KV offload: this round's spilled pages' data (execute -> update)
        self._lost = None    # why the engine cannot go on (its device state was lost with a failed round)
        if config.kv_offload_bytes:
            if self.num_processes > 1:
                raise ValueError("EngineConfig.kv_offload_bytes needs a single process (the host tier of a "
                                 "multi-process engine is not built yet)")
            per_page = self.cache_config.bytes_per_page + (
                self.draft_cache_config.bytes_per_page if self.draft_cache_config else 0)
            if config.kv_offload_bytes < per_page:
                raise ValueError(f"EngineConfig.kv_offload_bytes={config.kv_offload_bytes} holds no page: one page "
                                 f"costs {per_page} bytes for this model and page_size")
            self.host_tier = HostTier(config.kv_offload_bytes // per_page, per_page)
            params = sum(int(np.prod(a.shape)) for a in jax.tree_util.tree_leaves(model.params))
            platform = jax.devices()[0].platform
            self.swap_cost = SwapCost.for_model(mc, params, per_page // config.page_size, platform,
                                                state_bytes=self.cache_spec.state_bytes_per_sequence())
        self.scheduler = Scheduler.for_shapes(self.shapes, watermark=config.watermark, stop_ids=self.stop_ids,
                                              prefix_caching=config.prefix_caching, host_tier=self.host_tier,
                                              swap_cost=self.swap_cost,
                                              state_pages=self._state_pages(),
                                              extra_hooks=(RaggedRowsHook,) if config.batch_invariant else ())
        self.loras = None   # LoRA adapters (`jpa.engine.lora`): the host's record of the device's adapter slots
        if config.enable_lora:
            if not (callable(getattr(model, "lora_slots", None)) and callable(getattr(model, "read_lora", None))):
                raise TypeError(f"EngineConfig.enable_lora needs a model with EngineModel's optional lora_slots() and "
                                f"read_lora() (models.GPTForEngine has them); {type(model).__name__} lacks them")
            if self.num_processes > 1:
                raise ValueError("EngineConfig.enable_lora needs a single process")
            self.loras = LoraSlots(lambda path: model.read_lora(path, config.max_lora_rank), config.max_loras)
            self.runner.enable_lora(model.lora_slots(config.max_loras, config.max_lora_rank))
            self.scheduler.lora = self.loras
        self.stats = EngineStats()
        # Structured outputs: the tokenizer as llguidance reads it, built with the first constrained request.
        self.grammars = Grammars(tokenizer, model.config.vocab_size, self.stop_ids)
        self._outbox: list[StepOutput] = []    # finished outside a round (errors, aborts)
        # Ids not handed out as finished yet: each request's, and a parallel-sampling request's own
        # id R too (with how many of its samples (R, i) are live), so no id can be reused while any
        # sample of it runs.
        self._live_ids: set = set()
        self._live_samples: dict = {}
        self._ids = itertools.count()
        # Weight updates: the version served (0 = the weights it was built with), and the converter of
        # named weights (a mapping of checkpoint tensor names, or a safetensors path) into `model.params`,
        # set by the composition root (`jpa.llm.build_engine`: `jpa.models.hf.params_from_hf`).
        self.weight_version = 0
        self.weight_converter = None

    @staticmethod
    def _cache_configs(model, draft_model, config: EngineConfig, spec):
        """(the pool's CacheConfig, the draft model's or None) for the model's cache spec (`spec.check_served`:
        its paged attention groups share one stacked pool of one head shape, over `spec.paged_layers()`):
        num_pages as configured, else as many as kv_memory_bytes holds (with a draft model, a page costs the
        target's bytes plus the draft's: `jpa.engine.speculative.draft_cache_config`). A recurrent group's
        state slots (max_seqs of them) are paid from kv_memory_bytes first, the pages from the rest; a spec
        with no paged group gets a placeholder pool of one layer of one head of width 1 (the page state still
        counts every sequence's tokens in pages). A latent spec (MLA) has a zero-wide V pool."""
        num_kv_heads, head_dim = spec.check_served() or (1, 1)
        num_layers = len(spec.paged_layers()) or 1
        v_head_dim = 0 if spec.latent else None   # a latent pool: the values are read out of the latents
        dtype = config.cache_dtype or np.dtype(model.dtype).name
        draft_cfg = draft_cache_config(draft_model, config.page_size, dtype)
        target = CacheConfig(num_layers, num_kv_heads, head_dim, config.num_pages or 1, config.page_size, dtype,
                             v_head_dim)
        if config.num_pages is None:
            states = spec.state_bytes_per_sequence() * config.max_seqs
            budget = config.kv_memory_bytes * config.tensor_parallel - states
            if states and budget < target.bytes_per_page:
                raise ValueError(f"EngineConfig.kv_memory_bytes={config.kv_memory_bytes} holds the recurrent states "
                                 f"of max_seqs={config.max_seqs} sequences ({states} bytes) and no page "
                                 f"({target.bytes_per_page} bytes)")
            if draft_cfg is not None:
                budget = budget * target.bytes_per_page // (target.bytes_per_page + draft_cfg.bytes_per_page)
            target = CacheConfig.from_memory(budget, num_layers=num_layers, num_kv_heads=num_kv_heads,
                                             head_dim=head_dim, page_size=config.page_size, dtype=dtype,
                                             v_head_dim=v_head_dim)
        if draft_cfg is not None:
            draft_cfg = dataclasses.replace(draft_cfg, num_pages=target.num_pages)
        return target, draft_cfg

    # ------------------------------------------------------------------ requests

    def add_request(self, prompt, params: SamplingParams | dict | None = None, *,
                    request_id=None, lora_request: LoRARequest | None = None) -> Request:
        """Queues a prompt (text, or a list of token ids) with its SamplingParams (or a dict of them).

        Safe between steps. Invalid requests (bad sampling values, empty or too long prompts)
        finish at once with finish_reason "error" and a message; the next step() hands them out.
        They never stop other requests.

        Args:
          prompt: str or list of token ids.
          params: SamplingParams, a dict of its fields, or None for the defaults.
          request_id: any hashable id not used by an unfinished request; default: a counter.
          lora_request: the LoRA adapter to run it with (`jpa.engine.lora.LoRARequest`; the engine needs
            enable_lora); None: the base model. Its directory is read on first use (`load_lora`).

        Returns:
          The Request (its request_id identifies it in step() outputs and abort()).

        An adapter that cannot be served (a missing or corrupt file, a rank above max_lora_rank, a target the
        model lacks) finishes the request with finish_reason "error" and the reason, as other invalid requests.

        Raises:
          ValueError: lora_request on an engine without enable_lora.
        """
        self._leader_only("add_request")
        if lora_request is not None and self.loras is None:
            raise ValueError("lora_request needs an engine with enable_lora=True (jpa serve --enable-lora)")
        n = params.get("n", 1) if isinstance(params, dict) else getattr(params, "n", 1)
        taken = lambda rid: rid in self._live_ids or (  # noqa: E731  (its samples' ids too)
            isinstance(n, int) and n > 1 and any((rid, i) in self._live_ids for i in range(n)))
        if request_id is None:
            request_id = next(self._ids)
            while taken(request_id):
                request_id = next(self._ids)
        elif taken(request_id):
            raise ValueError(f"request_id {request_id!r} is already used by an unfinished request")
        self._live_ids.add(request_id)
        text = prompt if isinstance(prompt, str) else ""
        req = Request(request_id, text, [], SamplingParams())
        if isinstance(params, dict):
            try:
                params = SamplingParams(**params)
            except (TypeError, ValueError) as e:
                return self._fail(req, f"invalid sampling parameters: {e}")
        req.params = params or SamplingParams()
        req.weight_version = self.weight_version
        if lora_request is not None:
            try:
                self.load_lora(lora_request)
            except ValueError as e:
                return self._fail(req, f"LoRA adapter: {e}")
        req.lora_request = lora_request
        req.lora_cache_key = None if lora_request is None else self.loras.cache_key(lora_request.lora_int_id)
        try:
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        except Exception as e:  # a tokenizer failure is this request's problem, not the batch's
            return self._fail(req, f"could not tokenize the prompt: {e}")
        req.prompt_ids = ids
        vocab = self.model.config.vocab_size
        if not ids:
            return self._fail(req, "empty prompt: nothing to condition on")
        if any(not 0 <= t < vocab for t in ids):
            return self._fail(req, f"prompt token ids must be in [0, {vocab})")
        if any(t >= vocab for t in req.params.token_ids_used):
            return self._fail(req, f"logit_bias and stop_token_ids must name token ids in [0, {vocab})")
        limit = self.max_model_len
        if len(ids) >= limit:
            return self._fail(req, f"prompt has {len(ids)} tokens; this engine holds at most {limit} "
                                   f"tokens per sequence (max_model_len {self.max_model_len}, pool "
                                   f"{self.num_pages} pages x {self.config.page_size}), and one must be left "
                                   f"for the completion")
        if req.params.n > self.config.max_seqs:
            return self._fail(req, f"n = {req.params.n} samples need one decode slot each; this engine has "
                                   f"max_seqs {self.config.max_seqs}")
        if req.params.prompt_logprobs is not None:
            if not has_hidden(self.model):
                return self._fail(req, f"prompt_logprobs needs a model with EngineModel's optional ragged_hidden() "
                                       f"and head() (models.GPTForEngine has them); {type(self.model).__name__} "
                                       f"lacks them")
            req.prompt_lp = {}
        if req.params.structured is not None:
            try:
                req.matcher = self.grammars.matcher(req.params.structured)
            except ValueError as e:
                return self._fail(req, str(e))
        if req.params.n > 1:
            return self._add_samples(req)
        req.detokenizer = self._detokenizer(req.params)
        self.scheduler.add(req)
        return req

    def _leader_only(self, what: str) -> None:
        if self._follower is not None:
            raise RuntimeError(f"process {self.process_index} of {self.num_processes} follows process 0, which owns "
                               f"the requests: call follow() here, not {what}()")

    def follow(self) -> bool:
        """A process other than 0 of a multi-process job: runs process 0's device calls until it
        closes its engine (`close()`). Returns True when process 0 closed it normally, False when it
        stopped on an error or exited without closing. See `jpa.engine.multihost`."""
        if self._follower is None:
            raise RuntimeError("follow() is for processes other than 0 of a multi-process job (jax.distributed); "
                               f"this is process {self.process_index} of {self.num_processes}")
        return self._follower.run()

    def close(self, ok: bool = True) -> None:
        """Process 0 of a multi-process job: releases the other processes from follow() (idempotent;
        a single-process engine has nothing to release). `ok=False` tells them it stopped on an error."""
        if isinstance(self.runner, multihost.Leader):
            self.runner.close(ok)

    def _detokenizer(self, params: SamplingParams) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.tokenizer, params.stop, include_stop=params.include_stop_str_in_output,
                                      skip_special_tokens=params.skip_special_tokens)

    def _add_samples(self, req: Request) -> Request:
        """Parallel sampling: sample i of request R is the request (R, i) with seed + i. The prompt
        is computed once: the samples wait with the first one (their leader), take their slots
        with it, and fork its pages when its last chunk is computed (copy-on-write of the shared
        last page on the first divergent write). R stays live until every sample is handed out.
        Prompt logprobs are computed once, by the leader, into a dict every sample shares."""
        samples = []
        for i in range(req.params.n):
            params = dataclasses.replace(req.params, n=1, seed=req.params.seed + i)
            r = Request((req.request_id, i), req.prompt, list(req.prompt_ids), params, self._detokenizer(params),
                        prompt_lp=req.prompt_lp,   # prompt logprobs: computed once (by the leader), shared
                        matcher=req.matcher.copy() if req.matcher is not None else None,   # each its own
                        lora_request=req.lora_request, lora_cache_key=req.lora_cache_key)
            self._live_ids.add(r.request_id)
            samples.append(r)
        self._live_samples[req.request_id] = len(samples)
        leader = samples[0]
        leader.num_samples = len(samples)
        leader.siblings = samples[1:]
        for s in samples[1:]:
            s.leader = leader
        self.scheduler.add(leader)
        return leader

    def load_lora(self, lora_request: LoRARequest) -> None:
        """Reads a LoRA adapter into host memory (vLLM's load_lora_adapter); it takes a device slot when a
        request first runs with it. No compile. Idempotent for the same LoRARequest.

        Raises:
          ValueError: an engine without enable_lora; a name or int id already taken by another adapter; an
            adapter that cannot be served (missing or corrupt files, rank above max_lora_rank, a target the
            model lacks), naming the rule.
        """
        if self.loras is None:
            raise ValueError("lora_request needs an engine with enable_lora=True (jpa serve --enable-lora)")
        self.loras.add(lora_request)

    def update_lora(self, name: str, path: str) -> LoRARequest:
        """Replaces loaded LoRA adapter `name`'s weights by the PEFT directory at `path`, in place (its id and
        device slot kept; no compile): an RL trainer's adapter update. Requests after it run the new weights;
        the prefix cache never serves KV computed with the old ones.

        Raises:
          ValueError: no such adapter; unfinished requests still use it; a bad adapter at `path` (nothing changed).
        """
        req = self._idle_lora(name, "update")
        new = LoRARequest(req.lora_name, req.lora_int_id, str(path))
        self.loras.update(new)
        return new

    def _idle_lora(self, name: str, what: str) -> LoRARequest:
        """The loaded adapter `name`, which no unfinished request uses (ValueError otherwise)."""
        if self.loras is None:
            raise ValueError(f"to {what} a LoRA adapter the engine needs enable_lora=True")
        req = self.loras.by_name(name)
        if req is None:
            raise ValueError(f"no LoRA adapter named {name!r} is loaded (loaded: {self.lora_names()})")
        users = [r.request_id for r in (*self.scheduler.waiting, *self.scheduler.running.values())
                 if r.lora_request is not None and r.lora_request.lora_int_id == req.lora_int_id]
        if users:
            raise ValueError(f"LoRA adapter {name!r} is used by {len(users)} unfinished request(s); {what} it when "
                             f"they finish")
        return req

    def unload_lora(self, name: str) -> LoRARequest:
        """Forgets the LoRA adapter `name` (vLLM's unload_lora_adapter): host copy and device slot. No compile.

        Raises:
          ValueError: no such adapter, or unfinished requests still use it.
        """
        req = self._idle_lora(name, "unload")
        self.loras.remove(req.lora_int_id)
        return req

    def lora_names(self) -> list[str]:
        """Names of the LoRA adapters loaded (empty without enable_lora)."""
        return [] if self.loras is None else sorted(r.lora_name for r, _ in self.loras.known.values())

    def _fail(self, req: Request, message: str) -> Request:
        req.phase, req.finish_reason, req.error = Phase.FINISHED, "error", message
        self._outbox.append(StepOutput(req.request_id, (), "", True, req.to_output()))
        return req

    def abort(self, request_id) -> bool:
        """Cancels an unfinished request (safe between steps); the next round's step releases its
        pages before anything else (its slot is free to admit into in that round).

        The next step() hands it out with finish_reason "abort" and the tokens it had. Returns
        False if no unfinished request has this id (unknown, or already handed out as finished).
        """
        aborted = self.scheduler.abort(request_id)
        if not aborted:
            return False
        if not self.scheduler.release_is_exact():   # the next round's step releases its slots
            self.flush_releases()
        for req in aborted:   # the request, then samples that had not forked from it
            self._outbox.append(StepOutput(req.request_id, (), req.detokenizer.take_delta(True), True,
                                           req.to_output()))
        return True

    def update_weights(self, weights) -> int:
        """Serves new weights from the next round on, with no compile (vLLM's `update_weights`).

        Safe between rounds. Requests in flight keep their KV (computed from the old weights) and go on
        with the new ones; each output token's version is recorded (`RequestOutput.weight_version`,
        `weight_versions`). The prefix cache never serves KV of older weights again. See
        `ModelRunner.set_params` for casting, placement, and what is freed.

        Args:
          weights: the model's own parameter pytree (`model.params`' structure, leaves of its shapes;
            floating leaves are cast to the served dtype; quantized leaves as served), or named
            weights, a mapping of checkpoint tensor names to arrays or a safetensors file or directory,
            when the engine has a `weight_converter` (`jpa.llm.build_engine` sets one: Hugging Face
            names, quantized as the served model is).

        Returns:
          The new weight version (1 after the first update).

        Raises:
          ValueError: a wrong name, shape or dtype, naming the tensor; the served weights stay.
        """
        self._leader_only("update_weights")
        self._usable()
        if self.num_processes > 1:
            raise RuntimeError("update_weights needs a single-process engine (the other processes' copies of the "
                               "weights are not updated yet)")
        if isinstance(weights, (str, bytes)) or hasattr(weights, "__fspath__") or _is_named(weights):
            if self.weight_converter is None:
                raise ValueError("update_weights: named weights (checkpoint tensor names or a safetensors path) "
                                 "need the engine's weight_converter (jpa.llm.build_engine sets one); pass the "
                                 "model's parameter pytree")
            weights = self.weight_converter(weights)
        complete = getattr(self.model, "complete_params", None)   # weights the model derives from the others
        if complete is not None:
            weights = complete(weights)
        self.runner.set_params(weights)
        prefix = self.scheduler.prefix
        if prefix is not None:
            for req in self.scheduler.running.values():
                if req.kv_epoch is None:   # its pages hold KV of the old weights: never cache them under the new
                    req.kv_epoch = prefix.epoch
            prefix.epoch += 1
        self.weight_version += 1
        return self.weight_version

    @property
    def has_unfinished(self) -> bool:
        """True while some request has not been handed out by step() as finished."""
        return bool(self._live_ids)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    # ------------------------------------------------------------------ the round

    def schedule(self) -> RoundPlan:
        """Verb 1 of a round: the scheduler's plan over the token budget (decode rows, prompt
        chunks, admissions, evictions, and the slots released on the host since the last device call,
        which the round's step releases first)."""
        self._usable()
        if not self.scheduler.release_is_exact():   # the plan counts exactly what the release frees
            self.flush_releases()
        plan = self.scheduler.plan_round(self.config.max_num_batched_tokens)
        if self.config.batch_invariant and plan.decode_steps:   # every token a row of the ragged pass
            plan = dataclasses.replace(plan, decode_steps=0)
        if not plan.entries and not self.scheduler.running and self.scheduler.waiting:
            # An idle engine admits any request that passed add_request's checks, so this is a bug;
            # the requests stay queued.
            raise RuntimeError(f"the scheduler admitted none of {self.num_waiting} waiting requests into an "
                               f"idle engine ({self.scheduler.free_pages} free pages)")
        return plan

    def execute(self, plan: RoundPlan) -> StepResult:
        """Verb 2: the plan as a StepBatch, ONE device call (page work, ragged pass, verify loop),
        its StepResult read back. A failed call or reservation leaves the plan undone; a call that
        ran but failed before its result was recorded is recovered from (`_recover`)."""
        self._usable()
        if plan.release and plan.swap_in:
            # KV offload: swap-ins are programs of their own before the step; they need the pages
            # the release frees, so it is made first, as a call of its own.
            self.flush_releases()
            plan = dataclasses.replace(plan, release=())
        # Structured outputs (batch fields): the grammar mask of each entry that samples under one.
        constrained = constrained_rows(plan)
        # The smallest compiled step shape that holds the round (`jpa.engine.ladder`).
        shape = self.runner.pick(max(len(plan.entries), len(plan.held)), sum(e.q_len for e in plan.entries))
        batch = make_step_batch(plan, self.shapes, masks=self.grammars.masks(constrained) if constrained else None,
                                shape=shape)
        t0, c0 = time.perf_counter(), self.runner.compile_seconds
        swapped = []
        calls = self.runner.step_calls
        if self.loras is not None:   # adapters this round's admissions brought into device slots
            for slot, arrays in self.loras.take_installs():
                self.runner.install_lora(slot, arrays)
        try:
            self._spill(plan)
            self._swap_in(plan, swapped)
            result = self.runner.step(batch)
        except BaseException:
            if self.runner.step_calls != calls:   # the call ran: the device is ahead of the host
                self._recover(plan)
            else:
                self._undo_swap_ins(plan, swapped)
                self.scheduler.unplan(plan)   # the call did not happen: admitted requests go back, in order
            raise
        if swapped and not all(bool(ok) for ok in jax.device_get(swapped)):
            self._undo_swap_ins(plan, swapped)
            self.scheduler.unplan(plan)
            raise RuntimeError(f"a swap-in could not reserve the pages the scheduler counted "
                               f"{self.scheduler.free_pages} free pages for (a bug); admitted requests are back "
                               f"in the queue")
        if not result.ok:
            # The scheduler plans only what the device's free page count holds, with the rule the
            # device applies, so this cannot happen; if it does, the device changed nothing but the
            # round's release.
            free = self.scheduler.free_pages
            st = result.state
            self.scheduler.set_pages(st.num_free, st.seq_lens, st.own, st.shared, released=plan.release)
            self._undo_swap_ins(plan, swapped)
            self.scheduler.unplan(plan)
            raise RuntimeError(f"the unified step could not reserve pages for {len(plan.entries)} entries the "
                               f"scheduler counted {free} free pages for (a bug); the device state is unchanged "
                               f"(but for the round's release) and admitted requests are back in the queue")
        # The first call compiles; compile time is reported on its own. The call's own dispatch is
        # counted as device time: on a CPU backend JAX may run the program inline in the call.
        self._record_call(plan, result, time.perf_counter() - t0 - (self.runner.compile_seconds - c0))
        return result

    def _spill(self, plan: RoundPlan) -> None:
        """KV offload: copies the evicted pages the plan spills to host memory, before any call of
        the round evicts them (asynchronously); `update` hands them to the prefix cache."""
        self._spilled = {}
        if plan.spill:
            self._spilled = dict(zip(plan.spill, self.runner.spill(plan.spill)))
            self.stats.spill_pages += len(plan.spill)
            self.stats.spill_bytes += len(plan.spill) * self.host_tier.bytes_per_page

    def _swap_in(self, plan: RoundPlan, oks: list) -> None:
        """KV offload: the plan's swap-ins, before its step (the first carries the round's evictions,
        which the step then does not repeat). Appends their ok flags to oks (device scalars, read
        with the step's result). The host pages of a swap block are free once the copies are
        dispatched; restored spilled pages leave the host tier when the round is recorded (`update`)."""
        st, ps = self.stats, self.config.page_size
        for i, s in enumerate(plan.swap_in):
            if s.restore:   # a prefix hit through spilled pages
                data = [self.host_tier.spilled[kid].data for kid in s.restore]
                oks.append(self.runner.restore(data, plan.evict if i == 0 else (), s.slot, s.hit_pages, s.num_tokens))
                st.restored += 1
                st.restore_pages += len(s.restore)
                st.restore_bytes += len(s.restore) * self.host_tier.bytes_per_page
                st.recompute_avoided_tokens += len(s.restore) * ps
                continue
            block = self.host_tier.take(s.request.request_id)
            oks.append(self.runner.swap_in(block.data, plan.evict if i == 0 else (), s.slot, s.hit_pages,
                                           len(s.hit_pages) * ps, s.num_tokens))
            size = len(block.host_pages)
            st.swapped_in += 1
            st.swap_in_pages += size
            st.swap_in_bytes += size * self.host_tier.bytes_per_page
            st.recompute_avoided_tokens += s.num_tokens - len(s.hit_pages) * ps

    def _undo_swap_ins(self, plan: RoundPlan, oks: list) -> None:
        """Releases the slots the first len(oks) swap-ins filled when their round did not happen
        (their swap blocks are gone: those requests recompute), and evicts the pages restores cached
        that the host's prefix cache does not know (their spilled copies stay in the host tier)."""
        self._spilled = {}
        if oks:
            self.scheduler.set_pages(*self.runner.retire([s.slot for s in plan.swap_in[: len(oks)]]))
            self._reconcile_prefix()

    def _reconcile_prefix(self) -> None:
        """After device page work the host did not record (a failed round): the host's prefix cache
        forgets the pages the device evicted, and the device evicts the pages it cached that the host
        does not know (their contents are never looked up)."""
        prefix = self.scheduler.prefix
        if prefix is not None:
            on_device = {int(p) for p in self.runner.cached_pages()}
            prefix.forget([p for p in prefix.lru if p not in on_device])   # evicted by a call that ran
            unknown = sorted(on_device - set(prefix.lru))
            if unknown:
                self.scheduler.set_pages(*self.runner.uncache(unknown))

    def _recover(self, plan: RoundPlan) -> None:
        """A round whose unified step ran (the device state changed) but raised before the host
        recorded its result (a failed read-back, an interrupt): the device is ahead of the host
        (tokens, seq_lens, the round's release, pages reserved, cached or evicted). Brings both back
        to one state, as a preemption of everyone would: the round's admissions go back to the
        queue, every running request is preempted to be recomputed (its generated tokens kept), every
        slot is released on the device, the pending release with them, and the prefix cache is
        reconciled. If the device state cannot be read (lost with the failed call), the engine
        refuses further rounds (`_lost`)."""
        self._spilled = {}
        self.scheduler.unplan(plan)
        preempted = self.scheduler.requeue_running()
        try:
            jax.device_get(self.runner.page_state.num_free)   # the state is there to go on with
            self.scheduler.set_pages(*self.runner.retire(range(self.config.max_seqs)))
            self._reconcile_prefix()
        except Exception as e:
            self._lost = (f"the engine's device state was lost with a failed round ({type(e).__name__}: {e}); "
                          f"make a new engine")
            return
        self.stats.preemptions += len(preempted)

    def _usable(self) -> None:
        if self._lost is not None:
            raise RuntimeError(self._lost)

    def update(self, plan: RoundPlan, result: StepResult | None) -> list[StepOutput]:
        """Verb 3: the host's post-process. Tokens, stops and the device's page counts go to the
        scheduler (`stepped`); then the end of the round (`end_round`: host-finished requests and
        preemptions, whose pages the next round's step releases first); then the outputs."""
        t_host = time.perf_counter()
        events = []
        if result is not None:
            events = self.scheduler.stepped(plan, result, self._spilled)
            self._spilled = {}
            self._record_pages(int(result.usage.peak_pages), int(result.usage.peak_tokens))
            if self.scheduler.prefix is not None:
                held = collections.Counter(p for r in self.scheduler.running.values() for p in r.cache_refs)
                self.stats.peak_shared_pages = max(self.stats.peak_shared_pages,
                                                   sum(1 for c in held.values() if c > 1))
        # The release rides in the next round's StepBatch: that round is planned from the device's
        # counts plus what the release frees (exact, else `flush_releases` makes it a call now).
        _, preempted = self.scheduler.end_round(flush=self.flush_releases)
        self._swap_outs()
        if not self.scheduler.release_is_exact():
            self.flush_releases()
        self.stats.preemptions += len(preempted)
        outputs, self._outbox = self._outbox, []
        for ev in events:
            req = ev.request
            req.note_tokens(len(ev.new_token_ids), self.weight_version)
            text = req.detokenizer.take_delta(ev.finished)
            prompt_lps = req.take_prompt_logprobs()
            if ev.new_token_ids or text or ev.finished or prompt_lps is not None:
                outputs.append(StepOutput(req.request_id, ev.new_token_ids, text, ev.finished,
                                          req.to_output() if ev.finished else None, ev.new_logprobs,
                                          ev.new_top_logprobs, prompt_lps))
        for o in outputs:
            if o.finished:
                self._handed_out(o.request_id)
        if result is not None:
            self.stats.host_seconds += time.perf_counter() - t_host
        return outputs

    def _swap_outs(self) -> None:
        """KV offload: copies the pages of the requests end_round preempted to the host tier
        (dispatched asynchronously, before any call releases them)."""
        for slot, req, size in self.scheduler.take_swap_outs():
            self.host_tier.attach(req.request_id, self.runner.swap_out(slot, size))
            self.stats.swapped_out += 1
            self.stats.swap_out_pages += size
            self.stats.swap_out_bytes += size * self.host_tier.bytes_per_page

    def flush_releases(self) -> None:
        """Releases now, as a device call of its own (`ModelRunner.retire`), the slots the host
        finished or preempted since the last device call, which the next round's step would
        release first: for when the host needs the page state after the release sooner (a count
        the device's last figures do not make exact, page moves of their own, checks, an idle
        engine's cleanup). KV offload's swap-outs are dispatched first."""
        self._usable()
        self._swap_outs()
        release = self.scheduler.take_releases()
        if release:
            self.scheduler.set_pages(*self.runner.retire(release))

    def _record_call(self, plan: RoundPlan, result: StepResult, seconds: float) -> None:
        """The statistics of one device call."""
        st = self.stats
        st.decode_seconds += seconds
        if plan.num_prompt_tokens:
            st.prefill_seconds += seconds
        st.decode_calls += 1
        st.decode_steps += int(result.steps)
        if self.config.speculative is not None:
            record_spec_counts(st, result.spec)
        st.prefill_tokens += plan.num_prompt_tokens
        st.decode_tokens += int((result.loop.tokens >= 0).sum()) + sum(e.decode for e in plan.entries)

    @property
    def num_cached_idle(self) -> int:
        """Pages held by the prefix cache alone (cached-idle: evictable, not in use)."""
        prefix = self.scheduler.prefix
        return prefix.num_idle(self.scheduler.held_cached_pages()) if prefix is not None else 0

    @property
    def pages_in_use(self) -> int:
        """Pages held by requests (cached-idle pages are not in use: eviction frees them)."""
        return self.num_pages - self.scheduler.free_pages - self.num_cached_idle

    def _record_pages(self, used: int, tokens: int) -> None:
        """The round's peak (the device's count: pages held by sequences at the round's fullest
        moment, and the tokens they held then)."""
        self.stats.peak_pages_used = max(self.stats.peak_pages_used, used)
        if used:
            self.stats.util_sum += tokens / (used * self.config.page_size)
            self.stats.util_count += 1

    def step(self) -> list[StepOutput]:
        """One round, three verbs: schedule -> execute -> update (admission and prefill chunks,
        the device call with its decode steps, then tokens, stops and preemption).

        Returns:
          One StepOutput per request that got tokens or finished this round (plus requests that
          failed validation or were aborted since the last round). A finished request appears
          exactly once, with its RequestOutput; the engine keeps nothing of it afterwards.
        """
        self._leader_only("step")
        plan = self.schedule()
        result = self.execute(plan) if plan.entries or self.scheduler.running else None
        return self.update(plan, result)

    def _handed_out(self, request_id) -> None:
        """A finished request left the engine: its id (and, with its last sample, its group's) is free."""
        self._live_ids.discard(request_id)
        group = request_id[0] if isinstance(request_id, tuple) and len(request_id) == 2 else None
        if group in self._live_samples:
            self._live_samples[group] -= 1
            if not self._live_samples[group]:
                del self._live_samples[group]
                self._live_ids.discard(group)

    def generate(self, prompts, params=None, *, progress: bool = False, lora_request=None) -> list[RequestOutput]:
        """Runs prompts to completion with continuous batching; outputs in submission order.

        A thin loop over add_request() and step(). Outputs of requests added by others on the same
        engine are not returned here (drive step() yourself when mixing).

        Args:
          prompts: list of str (or token-id lists).
          params: one SamplingParams (or dict) for all, or a list with one per prompt.
          progress: show a progress bar on stderr.
          lora_request: one `LoRARequest` for all, a list with one per prompt (None: the base model), or None.

        Returns:
          One RequestOutput per prompt, in order; for a prompt with n > 1 samples, a list of n
          RequestOutputs (sample i has request_id (R, i) and seed + i).
        """
        if params is None or isinstance(params, (SamplingParams, dict)):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"params must be one SamplingParams or one per prompt ({len(prompts)}); "
                             f"got {len(params)}")
        loras = lora_request if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"lora_request must be one LoRARequest or one per prompt ({len(prompts)}); got "
                             f"{len(loras)}")
        groups = []   # per prompt: the request ids of its outputs (n of them with parallel sampling)
        for p, sp, lr in zip(prompts, params, loras):
            req = self.add_request(p, sp, lora_request=lr)
            n = req.num_samples
            groups.append([req.request_id] if n == 1 else [(req.request_id[0], i) for i in range(n)])
        ids = [i for g in groups for i in g]
        results: dict = {}
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=len(ids), file=sys.stderr, unit="req", dynamic_ncols=True, desc="generating")
        wanted = set(ids)
        while len(results) < len(ids):
            for o in self.step():
                if o.finished and o.request_id in wanted:
                    results[o.request_id] = o.output
                    if bar is not None:
                        bar.update(1)
            if bar is not None:
                s = self.stats
                bar.set_postfix(running=self.num_running, waiting=self.num_waiting,
                                tok_s=f"{s.decode_tokens / max(s.decode_seconds + s.host_seconds, 1e-9):.1f}",
                                refresh=False)
        if bar is not None:
            bar.close()
        self.stats.compile_seconds = self.runner.compile_seconds
        return [results[g[0]] if len(g) == 1 else [results[i] for i in g] for g in groups]

    def _page_state_after_release(self):
        """The device's PageState once the pending release is done, as the next round starts from
        it (computed on a copy: the device's state and the pending release are unchanged)."""
        release = self.scheduler.pending_release
        return pages.release(self.runner.page_state, list(release)) if release else self.runner.page_state

    def pool_is_whole(self) -> bool:
        """True when no request holds a page and every page is free or held by the prefix cache
        alone, exactly the pages the host's cache knows (check after generate(): nothing leaked;
        `flush_prefix_cache()` then frees every page). A query: it reads the state after the
        pending release without making it."""
        self._usable()
        prefix = self.scheduler.prefix
        host = self.host_tier
        # The host tier: no swap block left, every page free or holding one spilled prefix page.
        return (not self.scheduler.running
                and self.runner.pool_is_whole(prefix.cached if prefix else (), self._page_state_after_release())
                and (host is None or (not host.blocks and host.num_free + len(host.spilled) == host.num_pages
                                      and not host.check() and not self.scheduler.waiting
                                      and not (prefix.check() if prefix else host.spilled))))

    def check_page_state(self) -> None:
        """Raises RuntimeError naming the first disagreement between the device's page state and
        the host's bookkeeping (a debugging aid; tests and the soak call it after every round):
        every page is exactly one of free, cached-idle or held by a sequence; refcounts equal the
        block-table references plus the prefix cache's; the device's cached pages are the host
        cache's; each running request's cached token count matches its progress; with KV offload,
        every host page is free, in one block or holding one spilled prefix page, every block belongs
        to a waiting request, and each prefix key names a page in exactly one tier."""
        self._usable()
        release = self.scheduler.pending_release
        ps = jax.device_get(self._page_state_after_release())   # the state the next round starts from
        n, size = self.num_pages, self.config.page_size
        free = np.asarray(ps.free_pages)[: int(ps.num_free)]
        ref, cached = np.asarray(ps.refcounts), np.asarray(ps.cached)
        tables, lens = np.asarray(ps.block_tables), np.asarray(ps.seq_lens)
        counts = np.zeros(n, np.int64)
        for b in range(tables.shape[0]):
            np.add.at(counts, tables[b, : -(-int(lens[b]) // size)], 1)
        is_free = np.zeros(n, bool)
        is_free[free] = True
        kinds = is_free.astype(int) + (cached & (counts == 0)).astype(int) + (counts > 0).astype(int)
        problems = []
        if int(ps.num_free) != self.scheduler.free_pages:
            problems.append(f"the host plans from {self.scheduler.free_pages} free pages, the device has "
                            f"{int(ps.num_free)} after releasing slots {list(release)}")
        if len(set(free.tolist())) != len(free):
            problems.append("a page is in the free stack twice")
        if not np.array_equal(ref, counts + cached):
            problems.append(f"refcounts != table references + cache references at pages "
                            f"{np.flatnonzero(ref != counts + cached)[:8].tolist()}")
        if (kinds != 1).any():
            problems.append(f"pages neither or more than one of free / cached-idle / referenced: "
                            f"{np.flatnonzero(kinds != 1)[:8].tolist()}")
        prefix = self.scheduler.prefix
        host = np.zeros(n, bool)
        host[list(prefix.cached if prefix is not None else ())] = True
        if not np.array_equal(host, cached):
            problems.append(f"host prefix cache != device cached pages at {np.flatnonzero(host != cached)[:8].tolist()}")
        for slot in range(self.config.max_seqs):
            lo, hi = self.scheduler.expected_seq_len(slot)
            req = self.scheduler.running.get(slot)
            if not lo <= lens[slot] <= hi:
                problems.append(f"slot {slot}: the device holds {int(lens[slot])} tokens, the host expects "
                                f"{lo}..{hi} ({'no request' if req is None else req.phase.value})")
            elif req is not None and req.num_computed_tokens != lens[slot]:
                problems.append(f"slot {slot}: the host's num_computed_tokens {req.num_computed_tokens} != the "
                                f"device's {int(lens[slot])}")
        if self.host_tier is not None:   # KV offload: the host tier's pages, and a block per swapped request
            problems += self.host_tier.check()
            waiting = {r.request_id for r in self.scheduler.waiting}
            stray = [k for k in self.host_tier.blocks if k not in waiting]
            if stray:
                problems.append(f"host tier: blocks of requests not waiting: {stray[:4]}")
            if prefix is not None:
                problems += prefix.check()
            elif self.host_tier.spilled:
                problems.append("host tier: spilled prefix pages without a prefix cache")
        if problems:
            raise RuntimeError("page state check failed: " + "; ".join(problems))

    def flush_prefix_cache(self) -> int:
        """Evicts every cached page (an idle engine only); returns how many were freed."""
        prefix = self.scheduler.prefix
        if prefix is None:
            return 0
        if self.scheduler.running:
            raise RuntimeError("flush_prefix_cache() needs an idle engine (no running request)")
        self.flush_releases()
        evicted = prefix.clear()
        if evicted:
            self.scheduler.set_pages(*self.runner.uncache(evicted))
        return len(evicted)

    def cache_report(self) -> str:
        """The start-up line on the cache: the model's groups (`jpa.kv.spec.CacheSpec.describe`), bytes per token
        and per sequence at max_model_len as the pool holds them."""
        cc, spec = self.cache_config, self.cache_spec
        per_seq = spec.bytes_per_sequence(self.max_model_len, cc.dtype, cc.page_size)
        line = (f"cache groups: {spec.describe(cc.dtype, cc.page_size)}; in all {spec.bytes_per_token(cc.dtype):,.0f} "
                f"B/token, {per_seq / 2**20:,.1f} MiB per sequence at max_model_len {self.max_model_len}")
        if spec.has_recurrent:
            line += (f"; recurrent state slots {self.state_bytes / 2**20:,.1f} MiB ({self.config.max_seqs} x "
                     f"{spec.state_bytes_per_sequence():,} B), pages {cc.nbytes / 2**20:,.1f} MiB")
        return line

    def _state_pages(self) -> int | None:
        """KV offload with recurrent state: host pages a swapped sequence's states take beside its KV pages
        (None without a recurrent group)."""
        if not self.cache_spec.has_recurrent:
            return None
        return -(-self.cache_spec.state_bytes_per_sequence() // self.cache_config.bytes_per_page)

    @property
    def state_bytes(self) -> int:
        """Bytes of the recurrent state slots (max_seqs of them; 0 without a recurrent group)."""
        return self.cache_spec.state_bytes_per_sequence() * self.config.max_seqs

    def summary(self) -> dict:
        """The run's figures, for the script's summary line and --json consumers."""
        s = self.stats
        wall = s.decode_seconds + s.host_seconds
        return {
            "prefill_tokens": s.prefill_tokens,
            "kv_offload": None if self.host_tier is None else {
                "host_pages": self.host_tier.num_pages, "host_pages_free": self.host_tier.num_free,
                "memory_kind": self.runner.offload_memory_kind,
                "swapped_out": s.swapped_out, "swapped_in": s.swapped_in,
                "pages_out": s.swap_out_pages, "pages_in": s.swap_in_pages,
                "bytes_out": s.swap_out_bytes, "bytes_in": s.swap_in_bytes,
                "recompute_avoided_tokens": s.recompute_avoided_tokens,
                "spilled_pages": s.spill_pages, "spill_bytes": s.spill_bytes,
                "restored": s.restored, "restored_pages": s.restore_pages, "restore_bytes": s.restore_bytes,
                "host_spilled_pages": len(self.host_tier.spilled), "host_spill_evictions": self.host_tier.spill_evictions,
                "host_hit_tokens": self.scheduler.prefix.host_hit_tokens if self.scheduler.prefix else 0,
                "host_query_tokens": self.scheduler.prefix.host_query_tokens if self.scheduler.prefix else 0,
                "recomputed_by_rule": self.scheduler.recomputed_by_rule,
                "cost_rule": self.swap_cost.describe()},
            "prefill_tok_s": s.prefill_tokens / s.prefill_seconds if s.prefill_seconds else float("nan"),
            "decode_tokens": s.decode_tokens,
            "decode_tok_s": s.decode_tokens / wall if wall else float("nan"),
            "decode_seconds": wall,
            "host_overhead": s.host_overhead,
            "compile_seconds": self.runner.compile_seconds,
            "step_compiles": self.runner.step_traces,    # the unified step: 1 once it ran (the ladder's not counted)
            # The step-shape ladder: its shapes, those compiled, what its background thread took.
            "step_shapes": [(s.rows, s.tokens) for s in self.runner.ladder.shapes],
            "step_shapes_ready": [(s.rows, s.tokens) for s in sorted(self.runner.ladder.exes)],
            "ladder_compiles": self.runner.ladder.background_compiles,
            "ladder_compile_seconds": self.runner.ladder.background_seconds,
            "step_from_cache": self.runner.step_from_cache,  # served by a compilation cache (step_source says which)
            "step_source": self.runner.step_source,  # "compiled", "persistent cache" or "process" (runner.STEP_EXECUTABLES)
            "token_budget": self.config.max_num_batched_tokens,
            "ragged_block_tokens": self.runner.block_tokens,  # rows per model pass (set at compile)
            "steps_per_call": self.config.steps_per_call,
            "decode_steps": s.decode_steps,
            "peak_pages_used": s.peak_pages_used,
            "num_pages": self.num_pages,
            "kv_utilization": s.kv_utilization,
            "preemptions": s.preemptions,
            "kv_cache": self.cache_config.describe() + (
                f"; draft model: {self.draft_cache_config.describe()}" if self.draft_cache_config else ""),
            "cache_spec": self.cache_spec.describe(self.cache_config.dtype, self.cache_config.page_size),
            "state_bytes": self.state_bytes,        # recurrent state slots (0 without a recurrent group)
            "pool_bytes": self.cache_config.nbytes,  # the paged pool
            "attention": self.runner.attention,  # what the compiled decode loop runs (None before)
            "prefix_caching": self.scheduler.prefix is not None,
            "prefix_hit_tokens": self.scheduler.prefix.hit_tokens if self.scheduler.prefix else 0,
            "prefix_hit_rate": (self.scheduler.prefix.hit_tokens / self.scheduler.prefix.query_tokens
                                if self.scheduler.prefix and self.scheduler.prefix.query_tokens else float("nan")),
            "cached_pages": len(self.scheduler.prefix.cached) if self.scheduler.prefix else 0,
            "peak_shared_pages": s.peak_shared_pages,
            "cow_copies": self.runner.cow_copies,
            "tensor_parallel": self.config.tensor_parallel,
            "speculative": spec_summary(self.config.speculative, s, self.runner.verify_rows),
            # Structured outputs (llguidance): grammar compilations, masks computed (one per constrained
            # token) and their host time.
            "grammar_compiles": self.grammars.compiles,
            "grammar_compile_seconds": self.grammars.compile_seconds,
            "grammar_masks": self.grammars.masks_computed,
            "grammar_mask_seconds": self.grammars.mask_seconds,
            "head_plan": (getattr(self.model, "head_plan", None).describe()
                          if getattr(self.model, "head_plan", None) is not None else None),
        }
