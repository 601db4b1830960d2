"""The device side of the engine: ONE compiled program, the unified step, over donated state.

Everything a round needs lives on the device: the KV cache, the PageState, and per-slot state
(`Slots`: pending token, counters, `SlotParams`). A round (`StepBatch` in, `StepResult` out, see
`jpa.engine.batch`) is a ragged step over the scheduler's entries (decode tokens and prompt
chunks back to back, `jpa.ragged_paged_attention` through the model's `ragged`), then up to
`steps_per_call` decode steps inside a `lax.while_loop` (the verify loop, `jpa.engine.verify`:
plain decoding is its no-draft case), allocating pages, sampling, and checking stop conditions
(EOS, max_new_tokens, length limit) on the device; finished sequences release their pages inside
the loop. The loop ends early when every slot is idle or when the pool runs out of pages (the host
then preempts).

Every round reads back, in the same device->host transfer as its tokens, the PageState's free
page count and seq_lens, and per slot the pages only it references (`DeviceCounts.own`: what
releasing it in the next round frees): the scheduler's only source of page counts.

The step is assembled from parts, each in its own module, at named hook points (where features
plug in; KV offload and LoRA are meant to take the same points):

  1. the round's releases (`jpa.engine.ragged_step.release_slots`: slots the host finished or
     preempted since the last call, `StepBatch.pages.release`), then page work
     (`jpa.engine.ragged_step.page_work`): evict, share prefix hits, reserve, fork; all or
     nothing. (KV offload's swap-in is page work of its own beside the step: `swap_in`, a program
     per block size that evicts, shares the hit, reserves and copies host pages in,
     dispatched before the step; `swap_out` copies a preempted slot's pages to host memory before
     the call that releases them. Both are `jpa.kv.offload` programs; the step itself is unchanged.)
  2. the ragged pass (`jpa.engine.ragged_step.RaggedStep`): K/V writes, attention, the sampling
     of decode rows and final chunks. Device hook on logits: structured outputs' grammar mask
     (`StepBatch.structured`, applied by `sample_slots(allowed=...)`); prompt logprobs
     (`StepBatch.prompt`, read back only in rounds that asked). LoRA (`jpa.engine.lora`): each entry's
     adapter slot (`RaggedRows.lora`) goes to the model with the adapter slots, the step's last argument.
  3. before the loop: structured outputs hold their slots out of it
     (`jpa.engine.structured.hold_constrained` / `restore_held`).
  4. the verify loop (`jpa.engine.verify.VerifyLoop`) with its proposer
     (`jpa.engine.speculative.make_proposer`: none / n-gram / draft model); the acceptance hook
     is `VerifyLoop.accept`.
  5. the result (`StepResult`, a record per concern), read back in one transfer; the host's
     post-process is `Scheduler.stepped` (tokens, stops, matchers, prefix cache).

Step shapes (`jpa.engine.ladder`): the step compiles for the full shape (max_seqs entries, the
whole token budget) and, with a ladder (`step_shapes`), for smaller ones in a background thread;
each round runs the shape its StepBatch was made for (`pick`: the smallest ready one that holds
it). Below max_seqs rows the verify loop runs the held slots gathered from the state, scattered
back after it. One program per shape; the state is donated into each.

Public entry points for tools: `lower(num_tokens, rows)` (the jitted step lowered for this runner's
state), `compiled_step` (the full shape's executable once compiled; `compiled_steps` every shape's),
`step_function` (the traced function, for callers that lower it themselves, e.g. for a GPU that is
not attached).

The model is anything that meets `jpa.engine.model.EngineModel`; its params are an argument of
the compiled step (never a closed-over constant) and the cache, page state and slots are donated.

Recurrent state (a model whose cache spec has a recurrent group, `jpa.engine.states`): the cache is a
`StateCache(pool, states)`, the pool of the paged layers and one state slot per sequence slot, donated
with everything else; the model calls get `states` and `state_slots` (the ragged pass: each entry's slot;
the loop: each row's real slot, the ladder's sub-slots included), a parallel sample's slot takes its
leader's states after the leader's final chunk, and KV offload swaps a slot's states with its pages.

Attention backend: the step passes `attention_impl` to the model. With "auto", `jpa.paged_decode`
and `jpa.ragged_paged_attention` pick the kernel for the device the step is compiled for while it
is traced, with its exact shapes (the self-check runs concretely then, once per configuration).
What was picked is read off the compiled program (`attention`), so the summary reports what
actually runs.

Tensor parallelism (`mesh` with a "tp" axis): the cache pools are sharded on their kv-head axis;
page state, slots and every host input are replicated, so page allocation, sampling and stop
checks run identically on every device and the host reads one copy. The model (sharded by its
`shard(mesh)`) runs attention per device. The compiled step pins its outputs to the same
shardings as its inputs, so one executable serves every call.
"""

import collections
import hashlib
import threading
import time
import types

import jax
import jax.numpy as jnp
import numpy as np

from jpa.kv import pages
from jpa.kv.cache import CacheConfig, KVCache
from jpa.kv.offload import Mover, bucket, host_memory_kind
from jpa.engine.batch import DeviceCounts, PageUsage, StepBatch, StepResult, make_step_batch
from jpa.engine.device import Slots, Usage, tally
from jpa.engine.model import EngineModel, cache_spec_of, check_model, has_hidden
from jpa.engine.ladder import Ladder, gather_slots, scatter_outputs, scatter_slots
from jpa.engine.ragged_step import RaggedStep, RowLayout, own_pages, page_work, release_slots
from jpa.engine.shapes import EngineShapes, StepShape
from jpa.engine.speculative import DraftPair, SpeculativeConfig, make_proposer
from jpa.engine.states import StateCache, refuse_options
from jpa.engine.structured import hold_constrained, restore_held
from jpa.engine.verify import VerifyLoop
from jpa.core.sharding import REPLICATED, STACKED_POOL, named
from jpa.ops.ragged import rows_independent
from jpa.core.xla_options import step_compiler_options


# Executables served by JAX's persistent compilation cache in this process (a monitoring event
# JAX records on each hit); compile_step compares it before and after its compile.
_CACHE_HITS = [0]


def _without_lead_axis(sharding):
    """The sharding of one entry of an array placed with `sharding` along its leading axis (a LoRA slot of the
    stacked slots): a NamedSharding's spec without its first entry; a one-device sharding as it is."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*sharding.spec[1:]))
    return sharding


def _count_cache_hits(event: str, **_):
    if event == "/jax/compilation_cache/cache_hits":
        _CACHE_HITS[0] += 1


jax.monitoring.register_event_listener(_count_cache_hits)


class ExecutableCache:
    """Compiled unified steps of this process, shared by every engine whose step lowers to the same program.

    jax.jit's own cache is keyed by the traced function, and each runner traces its own bound
    `_step_impl`, so two engines with equal configurations (a server restarting its engine, `LLM(...)`
    built twice, a test module's engines) would compile the same program twice. The key here is the
    program itself: the lowered StableHLO text (shapes, shardings, donation and every constant are in
    it; params are arguments), the compiler options, the backend and the devices it runs on. The
    `size` most recently used executables are kept. Off with JAX's compilation cache
    (`jax_enable_compilation_cache=False`, as benchmarks/bench_compile.py measures cold compiles).
    """

    def __init__(self, size: int = 32):
        self.size = size
        self._exes = collections.OrderedDict()
        self.hits = 0

    def compile(self, lowered, devices, compiler_options=None):
        """(executable, reused): `lowered.compile(compiler_options)`, or the executable an earlier
        identical program got (reused True)."""
        if not jax.config.jax_enable_compilation_cache:
            return lowered.compile(compiler_options), False
        text = lowered.as_text()
        key = (hashlib.sha256(text.encode()).hexdigest(), len(text), tuple(sorted((compiler_options or {}).items())),
               tuple((d.platform, d.id, d.process_index) for d in devices))
        exe = self._exes.get(key)
        if exe is not None:
            self._exes.move_to_end(key)
            self.hits += 1
            return exe, True
        exe = self._exes[key] = lowered.compile(compiler_options)
        while len(self._exes) > self.size:
            self._exes.popitem(last=False)
        return exe, False

    def clear(self) -> None:
        self._exes.clear()


STEP_EXECUTABLES = ExecutableCache()


# Custom-call targets of the Pallas GPU kernels in a compiled program's HLO.
KERNEL_CALLS = (("mosaic", 'custom_call_target="mosaic_gpu'), ("triton", 'custom_call_target="__gpu$xla.gpu.triton"'))
DONATE = (1, 2, 3)  # cache, page state, slots: updated in place by the compiled step
# Prompt logprobs: the head runs over at most this many logits at once (rows x vocab; 16 MiB of
# f32), so a whole-budget block of a big vocabulary never materializes T x vocab logits. XLA
# reserves these buffers in every step, asked for or not: measured on SmolLM2's H100 unified step
# (deviceless compile), temporaries stay at 63 MiB as before prompt logprobs (142 MiB with 1 << 24).
PROMPT_LOGITS_ELEMENTS = 1 << 22


def attention_in(hlo_text: str) -> str:
    """Which attention implementation a compiled program runs: "mosaic", "triton" or "xla"."""
    return next((name for name, call in KERNEL_CALLS if call in hlo_text), "xla")


class ModelRunner:
    """Owns the device state of one engine and the compiled unified step that advances it.

    The sizes come from one `EngineShapes` (`shapes=`), or from the keywords max_seqs,
    pages_per_seq and steps_per_call with the cache config's page size and pool (a record is then
    built from them; `max_model_len` is pages_per_seq * page_size).

    With `allocate=False` the state is abstract (`jax.ShapeDtypeStruct`s, nothing allocated): such
    a runner only serves `state()`, `step_inputs()`, `lower()` and `step_function`, e.g. to compile
    the engine's step for a GPU that is not attached (`jpa tools compile`).
    """

    def __init__(self, model: EngineModel, cache_config: CacheConfig, *, stop_ids, max_seqs: int | None = None,
                 pages_per_seq: int | None = None, steps_per_call: int | None = None, shapes: EngineShapes | None = None,
                 attention_impl: str = "auto", allocate: bool = True, mesh=None, block_tokens: int | None = None,
                 speculative: SpeculativeConfig | None = None, draft=None,
                 draft_cache_config: CacheConfig | None = None, compiler_options: dict | None = None,
                 step_shapes: tuple[StepShape, ...] | None = None, batch_invariant: bool = False):
        check_model(model)
        if shapes is None:
            shapes = EngineShapes(max_seqs=max_seqs, page_size=cache_config.page_size,
                                  num_pages=cache_config.num_pages, pages_per_seq=pages_per_seq,
                                  max_model_len=pages_per_seq * cache_config.page_size, num_tokens=max_seqs,
                                  steps_per_call=steps_per_call, vocab_size=model.config.vocab_size)
        if (shapes.page_size, shapes.num_pages) != (cache_config.page_size, cache_config.num_pages):
            raise ValueError(f"shapes (page_size {shapes.page_size}, num_pages {shapes.num_pages}) must match the "
                             f"cache config ({cache_config.page_size}, {cache_config.num_pages})")
        self.shapes = shapes
        self.spec = speculative
        # The cache the model declares: a recurrent group's states live beside the pool (`jpa.engine.states`).
        self.cache_spec = cache_spec_of(model)
        refuse_options(self.cache_spec, speculative=speculative,
                       tensor_parallel=1 if mesh is None else int(mesh.devices.size))
        if (draft is not None) != (speculative is not None and speculative.method == "draft_model"):
            raise ValueError("a draft model goes with speculative method 'draft_model' (and that method needs one)")
        if draft is not None:
            check_model(draft)
            if mesh is not None:
                raise ValueError("speculative method 'draft_model' runs on one device (tensor_parallel=1); "
                                 "use method 'ngram' with tensor parallelism")
            model = DraftPair(model, draft)
        self.verify_rows = None
        if speculative is not None:
            if not has_hidden(model):
                raise TypeError(f"speculative decoding needs a model with EngineModel's optional ragged_hidden() "
                                f"and head() (every row's logits); {type(model).__name__} lacks them")
            backend = jax.default_backend() if mesh is None else mesh.devices.flat[0].platform
            self.verify_rows = speculative.rows(shapes.max_seqs, backend)
        self.mesh = mesh
        # The platform the step compiles for, and the user's XLA options over the engine's own
        # (`jpa.core.xla_options.step_compiler_options`; None removes one).
        self.platform = jax.default_backend() if mesh is None else mesh.devices.flat[0].platform
        self._compiler_options = dict(compiler_options or {})
        step_compiler_options(self.platform, self._compiler_options)  # a bad option name fails here
        self.model, self.params = model, model.params
        self.batch_invariant = batch_invariant   # `EngineConfig.batch_invariant`: rows independent, one head shape
        self.cache_config = cache_config
        self.attention_impl = attention_impl
        self._block_tokens = block_tokens
        self.block_tokens = None  # rows per model pass of the ragged step, fixed at its compile
        self.prompt_chunk = None  # rows per head pass of prompt logprobs, fixed with block_tokens
        self.step_tokens = None   # the token budget the step was compiled for
        self.attention = None     # the implementation in the compiled step, once compiled
        self._pool = None if mesh is None else named(mesh, STACKED_POOL)
        self._rep = None if mesh is None else named(mesh, REPLICATED)
        self._init_state(draft, draft_cache_config, allocate)
        self.stop_ids = jnp.asarray(sorted(set(stop_ids)) or [-1], jnp.int32)
        self.loop = VerifyLoop(model, shapes, self.stop_ids, attention_impl,
                               make_proposer(speculative, model, shapes.page_size, attention_impl),
                               speculative, self.verify_rows)
        self.width = self.loop.width
        self._loops = {shapes.max_seqs: self.loop}   # VerifyLoop per row count of the ladder
        # The step-shape ladder (`jpa.engine.ladder`): default one shape, (max_seqs, budget).
        full = StepShape(shapes.max_seqs, shapes.num_tokens)
        step_shapes = tuple(step_shapes or (full,))
        if step_shapes[-1] != full or any(not full.holds(s.rows, s.tokens) for s in step_shapes):
            raise ValueError(f"step_shapes must end with the full shape {full} and hold no larger one; "
                             f"got {step_shapes}")
        self.ladder = Ladder(step_shapes, self._compile_shape)
        self._background = threading.local()   # .on: the ladder's thread is tracing (not counted in step_traces)
        self.ladder_traces = 0   # programs the ladder's thread traced
        self.step_traces = 0
        self.cow_copies = 0  # pages copied on write (parallel samples' shared last pages)
        self.step_calls = 0  # unified-step calls that ran or consumed their donated state (see `step`)
        self.compile_seconds = 0.0
        self.step_from_cache = None  # set by compile_step
        self.step_source = None      # set by compile_step: "compiled", "persistent cache" or "process"
        self._step_exe = None
        self.lora = None           # LoRA: the device's adapter slots (`enable_lora`), an argument of the step
        self._install = None
        rep = {} if mesh is None else dict(out_shardings=self._rep)
        self._retire = jax.jit(self._retire_impl, donate_argnums=(0, 1), **rep)
        self._uncache = jax.jit(pages.uncache, donate_argnums=(0,), **rep)
        self._movers = None   # KV offload's swap programs (`jpa.kv.offload.Mover`), made at the first swap

    def _init_state(self, draft, draft_cache_config, allocate):
        s, cc = self.shapes, self.cache_config
        make = lambda f, sharding: self._make(f, sharding, allocate)  # noqa: E731
        if self.cache_spec.has_recurrent:   # the pool of the paged layers and the state slots (one per sequence slot)
            self.cache = make(lambda: StateCache(KVCache.create(cc), self.cache_spec.init_states(s.max_seqs)), None)
        else:
            self.cache = make(lambda: KVCache.create(cc) if draft is None else (
                KVCache.create(cc), KVCache.create(draft_cache_config)), self._pool)
        self.page_state = make(lambda: pages.init(s.num_pages, s.max_seqs, s.pages_per_seq, s.page_size), self._rep)
        self.slots = make(lambda: Slots.empty(s.max_seqs, s.num_pages, s.page_size), self._rep)

    # Sizes, read from the one record.
    max_seqs = property(lambda self: self.shapes.max_seqs)
    pages_per_seq = property(lambda self: self.shapes.pages_per_seq)
    steps_per_call = property(lambda self: self.shapes.steps_per_call)

    @property
    def compiles(self) -> int:
        """Programs compiled so far (the unified step: 1 once it ran)."""
        return self.step_traces

    def _make(self, f, sharding, allocate):
        """f() (device state), created directly in `sharding` under a mesh (never whole on one device)."""
        if not allocate:
            shapes = jax.eval_shape(f)
            if sharding is None:
                return shapes
            return jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
                                          shapes)
        return f() if sharding is None else jax.jit(f, out_shardings=sharding)()

    def _put(self, tree):
        """Host inputs of a compiled call, replicated over the mesh (as they are given without one)."""
        return tree if self.mesh is None else jax.device_put(tree, self._rep)

    # ------------------------------------------------------------------ the traced step

    def _step_impl(self, params, cache, page_state, slots, batch: StepBatch, lora=None):
        """The unified round: page work, the ragged pass, then up to batch.decode_steps verify
        (decode) steps, in one program (the engine's only compiled program). See StepBatch for the
        inputs and StepResult for what it returns besides (cache, page_state, slots), and the
        module docstring for the hook points. lora: the adapter slots (`enable_lora`), or None.
        """
        if getattr(self._background, "on", False):
            self.ladder_traces += 1
        else:
            self.step_traces += 1
        rows, num_tokens = batch.rows.seq_ids.shape[0], batch.rows.tokens.shape[0]
        lay = RowLayout.of(batch)
        page_state, slots = release_slots(page_state, slots, batch.pages.release)         # 1. releases,
        page_state, work = page_work(page_state, batch, lay)                              #    page work
        usage0 = tally(Usage.zero(), 0, page_state)  # the entries' pages reserved
        blocks = (self.block_tokens, self.prompt_chunk) if rows == self.max_seqs else self.blocks_for(num_tokens)
        ragged = RaggedStep(self.model, self.shapes, self.stop_ids, self.attention_impl, *blocks)
        with rows_independent(self.batch_invariant):
            cache, page_state, slots, first = ragged(params, cache, page_state, slots, batch, lay, work, lora)  # 2.
        decode_steps = jnp.where(work.ok, jnp.minimum(batch.decode_steps, self.steps_per_call), 0)
        unconstrained, held_out = hold_constrained(slots)                                   # 3.
        loop = self._loop(rows)
        if rows == self.max_seqs:                                                           # 4. verify loop
            cache, page_state, slots, out, steps, usage, counts = loop(params, cache, page_state, unconstrained,
                                                                       decode_steps, lora=lora)
        else:   # a rung of the ladder: the loop runs the slots holding a request only (`jpa.engine.ladder`)
            idx = batch.loop_slots
            sub_ps, sub_slots = gather_slots(page_state, unconstrained, idx)
            cache, sub_ps, sub_slots, out, steps, usage, counts = loop(params, cache, sub_ps, sub_slots, decode_steps,
                                                                       idx, lora=lora)
            page_state, slots = scatter_slots(page_state, unconstrained, sub_ps, sub_slots, idx)
            out, counts = scatter_outputs(out, counts, idx, self.max_seqs)
        slots = restore_held(slots, held_out)
        more = usage.peak > usage0.peak
        own, shared = own_pages(page_state)  # what releasing each slot in the next round frees
        return cache, page_state, slots, StepResult(                                        # 5.
            first=first.first, loop=out, ok=work.ok, steps=steps,
            state=DeviceCounts(num_free=pages.num_free_pages(page_state), seq_lens=page_state.seq_lens,
                               active=slots.active, tables=first.tables, own=own, shared=shared),
            usage=PageUsage(cow_copies=first.copies + usage.copies, peak_pages=jnp.where(more, usage.peak, usage0.peak),
                            peak_tokens=jnp.where(more, usage.tokens, usage0.tokens)),
            spec=counts, prompt=first.prompt)

    @staticmethod
    def _retire_impl(page_state, slots, seq_ids):
        page_state, slots = release_slots(page_state, slots, seq_ids)
        return page_state, slots, (pages.num_free_pages(page_state), page_state.seq_lens) + own_pages(page_state)

    # ------------------------------------------------------------------ host entry points

    @property
    def step_function(self):
        """The traced function of the unified step, (params, cache, page_state, slots, StepBatch) ->
        (cache, page_state, slots, StepResult), for callers that jit and lower it themselves (with
        `jit_options()`, or their own donation and shardings); `lower` does it for this runner."""
        return self._step_impl

    def compiler_options(self, platform: str | None = None) -> dict:
        """The XLA options the step compiles with for `platform` (default: this runner's):
        `jpa.core.xla_options.WEIGHTS_IN_PLACE` on a GPU (every scanned layer's gemm reads its
        weights in place), none on a CPU; the `compiler_options` given to the runner over them."""
        return step_compiler_options(platform or self.platform, self._compiler_options)

    def jit_options(self, platform: str | None = None) -> dict:
        """jax.jit options of the compiled step: state donated, the XLA options of `platform`
        (`compiler_options`; default: this runner's platform) and, under a mesh, outputs pinned
        (the cache keeps its head sharding, everything else replicated)."""
        opts = dict(donate_argnums=DONATE)
        xla = self.compiler_options(platform)
        if xla:
            opts["compiler_options"] = xla
        if self.mesh is not None:
            opts["out_shardings"] = (self._pool, self._rep, self._rep, self._rep)
        return opts

    def state(self):
        """(params, cache, page_state, slots): the leading arguments of the compiled step."""
        return self.params, self.cache, self.page_state, self.slots

    def set_block_tokens(self, num_tokens: int) -> int:
        """Fixes the ragged step's rows per model pass for a budget of num_tokens (the engine's
        full budget; `blocks_for` gives a smaller shape's): the configured value, else 64 rows on a
        CPU (compute-bound: padding rows cost as much as real ones) and the whole budget elsewhere
        (one pass; a GPU reads the weights once per pass)."""
        self.block_tokens, self.prompt_chunk = self._blocks(num_tokens, num_tokens)
        if self.batch_invariant:   # the sampler's head shape [max_seqs, d_model]: prompt logprobs are its bits
            self.prompt_chunk = self.shapes.max_seqs
        return self.block_tokens

    def _blocks(self, num_tokens: int, budget: int) -> tuple[int, int]:
        default = 64 if jax.default_backend() == "cpu" else budget
        block = min(self._block_tokens or default, num_tokens)
        return block, max(1, min(block, PROMPT_LOGITS_ELEMENTS // self.shapes.vocab_size))

    def blocks_for(self, num_tokens: int) -> tuple[int, int]:
        """(rows per model pass, rows per prompt-logprobs head pass) of a step of num_tokens tokens:
        as `set_block_tokens` fixed them for the full budget, at most num_tokens."""
        if self.block_tokens is None:
            self.set_block_tokens(self.shapes.num_tokens)
        return self._blocks(num_tokens, self.shapes.num_tokens)

    def _loop(self, rows: int) -> VerifyLoop:
        """The verify loop over `rows` slots (a ladder shape's; the engine's own at max_seqs)."""
        loop = self._loops.get(rows)
        if loop is None:
            verify_rows = None if self.spec is None else self.spec.rows(rows, self.platform)
            loop = self._loops[rows] = VerifyLoop(self.model, self.shapes, self.stop_ids, self.attention_impl,
                                                  self.loop.proposer, self.spec, verify_rows)
        return loop

    def step_inputs(self, num_tokens: int, rows: int | None = None):
        """ShapeDtypeStructs of the step's StepBatch for a budget of num_tokens and `rows` entries
        (default max_seqs), for lowering."""
        empty = types.SimpleNamespace(entries=(), evict=(), decode_steps=0, held=())  # only the shapes matter
        shape = StepShape(rows or self.max_seqs, num_tokens)
        batch = make_step_batch(empty, self.shapes.with_budget(max(num_tokens, self.shapes.num_tokens)), shape=shape)
        sharding = {} if self.mesh is None else dict(sharding=self._rep)
        return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, **sharding), batch)

    def _state_avals(self):
        """The step's leading arguments with the donated state as ShapeDtypeStructs (a trace never
        touches the buffers, which the ladder's thread may see donated by a running step)."""
        params, *state = self.state()
        avals = jax.tree_util.tree_map(
            lambda a: a if isinstance(a, jax.ShapeDtypeStruct) else jax.ShapeDtypeStruct(
                a.shape, a.dtype, sharding=a.sharding), tuple(state))
        return (params,) + avals

    def trace(self, num_tokens: int, rows: int | None = None, state=None):
        """The unified step for a budget of num_tokens and `rows` entries (default max_seqs), jitted
        with `jit_options()` and traced over this runner's state (`jax.stages.Traced`; `.lower()`
        then `.compile()`). Fixes the rows per model pass first (`set_block_tokens`) unless
        already fixed."""
        if self.block_tokens is None:
            self.set_block_tokens(max(num_tokens, self.shapes.num_tokens) if rows else num_tokens)
        lora = () if self.lora is None else (jax.tree_util.tree_map(   # LoRA's slots: the last argument
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), self.lora),)
        return jax.jit(self._step_impl, **self.jit_options()).trace(*(state or self.state()),
                                                                    self.step_inputs(num_tokens, rows), *lora)

    def lower(self, num_tokens: int, rows: int | None = None):
        """The unified step lowered for a budget of num_tokens and `rows` entries (default max_seqs;
        `jax.stages.Lowered`): what `compile_step` compiles; e.g. `runner.lower(budget).compile().as_text()`."""
        return self.trace(num_tokens, rows).lower()

    @property
    def compiled_step(self):
        """The compiled unified step of the full shape (max_seqs, budget) (`jax.stages.Compiled`:
        `as_text()`, `memory_analysis()`), or None before the first `step` / `compile_step`."""
        return self._step_exe

    @property
    def compiled_steps(self) -> dict:
        """{StepShape: compiled step} of every shape compiled so far (the ladder's included)."""
        return dict(self.ladder.exes)

    def compile_step(self, num_tokens: int, rows: int | None = None):
        """Compiles the unified step for a token budget and `rows` entries (default max_seqs; done
        by the first `step`). Sets `step_source`: "process" when an earlier engine of this process
        compiled the same program (`STEP_EXECUTABLES`), "persistent cache" when JAX's persistent
        compilation cache served it, else "compiled"; `step_from_cache` is True for either cache."""
        shape = StepShape(rows or self.max_seqs, num_tokens)
        with self.ladder.lock:
            self.ladder.exes[shape] = self._compile_shape(shape)

    def _compile_shape(self, shape: StepShape, background: bool = False):
        """The executable of one step shape. In the foreground (the first step, a shape not ready
        yet): counted in compile_seconds and step_source; the ladder's thread (background=True)
        counts its own (`Ladder`), traced over abstract state."""
        if self.block_tokens is None:
            self.set_block_tokens(self.shapes.num_tokens if shape.rows < self.max_seqs else shape.tokens)
        t0 = time.perf_counter()
        hits = _CACHE_HITS[0]
        state = self._state_avals()
        devices = sorted({d for leaf in jax.tree_util.tree_leaves(state[:2]) for d in leaf.sharding.device_set},
                         key=lambda d: (d.process_index, d.id))
        self._background.on = background
        try:
            lowered = self.trace(shape.tokens, shape.rows, state).lower()
        finally:
            self._background.on = False
        exe, reused = STEP_EXECUTABLES.compile(lowered, devices)
        if background:
            return exe
        self.step_source = "process" if reused else "persistent cache" if _CACHE_HITS[0] > hits else "compiled"
        self.step_from_cache = self.step_source != "compiled"
        self.compile_seconds += time.perf_counter() - t0
        if shape == self.ladder.full:
            self._step_exe, self.step_tokens = exe, shape.tokens
        if self.attention is None:
            self.attention = attention_in(exe.as_text())
        return exe

    def pick(self, rows: int, tokens: int) -> StepShape:
        """The step shape for a round of `rows` entries / held slots and `tokens` rows (`Ladder.pick`)."""
        return self.ladder.pick(rows, tokens)

    def step(self, batch: StepBatch) -> StepResult:
        """Runs one round (StepBatch of numpy arrays) and reads its StepResult back in one transfer.

        The batch's shape (entries, token budget) picks the compiled step (`compiled_steps`): one
        of the step-shape ladder, compiled now if it is not yet. The result's `loop` is cut to the
        steps run. When `ok` is False the round changed nothing on the device. `step_calls` counts
        the calls that changed the device state: one whose count it raised and that raises changed
        it without handing back the result (the caller's host bookkeeping is behind the device;
        `LLMEngine.execute` recovers).
        """
        shape = StepShape(batch.rows.seq_ids.shape[0], batch.rows.tokens.shape[0])
        if shape not in self.ladder.shapes:
            raise ValueError(f"the unified step is compiled for the shapes {list(self.ladder.shapes)}; got a batch "
                             f"of {shape.rows} entries and a token budget of {shape.tokens}")
        exe = self._step_exe if shape == self.ladder.full and self._step_exe is not None else self.ladder.get(shape)
        if self.ladder.full in self.ladder.exes:
            self.ladder.start()   # the other shapes, ahead of need (no-op once started or when there are none)
        state = self.state()
        try:
            self.cache, self.page_state, self.slots, res = exe(
                *state, self._put(jax.tree_util.tree_map(jnp.asarray, batch)), *(() if self.lora is None else
                                                                                  (self.lora,)))
        except BaseException:
            # A call that failed after consuming its donated state left this runner none to run on.
            if any(a.is_deleted() for a in jax.tree_util.tree_leaves(state[1:])):
                self.step_calls += 1
            raise
        self.step_calls += 1
        if not (np.asarray(batch.prompt.targets) >= 0).any():  # nobody asked: not read back
            res = res.replace(prompt=None)
        res = jax.device_get(res)
        rows = int(res.steps) * self.width
        self.cow_copies += int(res.usage.cow_copies)
        return res.replace(loop=jax.tree_util.tree_map(lambda a: a[:rows], res.loop))

    def set_params(self, params) -> None:
        """Swaps the served weights (of the target model, with a draft model beside it) for `params`,
        a pytree of the served one's structure, between calls; the compiled step is unchanged (params
        are an argument of it, so the next call runs the new weights with no compile).

        Each leaf must have the served leaf's shape; a floating leaf of another floating dtype is
        cast to the served dtype (a quantized leaf's dtype must match exactly). Every leaf is placed
        where the served one lives (`device_put` to its sharding: under tensor parallelism, the
        shards per the model's sharding). A leaf that already has the served dtype and placement is
        used as it is (no copy: do not delete or donate it afterwards). Everything is checked before
        anything changes: a ValueError names the first bad leaf and the served weights stay.

        The old weights are freed: the runner drops its references, and deletes the buffers it
        made itself (casts and copies of an earlier update) at once. Peak memory is the served
        weights plus the new ones placed (what was passed in, when it is already in place).
        """
        pair = isinstance(self.model, DraftPair)
        served = self.params[0] if pair else self.params
        old, treedef = jax.tree_util.tree_flatten_with_path(served)
        new, new_def = jax.tree_util.tree_flatten_with_path(params)
        if new_def != treedef:
            want = {jax.tree_util.keystr(p) for p, _ in old}
            got = {jax.tree_util.keystr(p) for p, _ in new}
            missing, extra = sorted(want - got), sorted(got - want)
            raise ValueError(f"params must have the served weights' structure ({len(old)} arrays); "
                             f"missing {missing[:4]}, unexpected {extra[:4]}" if missing or extra else
                             f"params must have the served weights' structure; got {new_def} for {treedef}")
        for (path, cur), (_, x) in zip(old, new):
            name = jax.tree_util.keystr(path)
            shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
            if shape is None or dtype is None:
                raise ValueError(f"params{name} must be an array; got {type(x).__name__}")
            if tuple(shape) != tuple(cur.shape):
                raise ValueError(f"params{name} must have shape {list(cur.shape)}; got {list(shape)}")
            floats = jnp.issubdtype(cur.dtype, jnp.floating) and jnp.issubdtype(dtype, jnp.floating)
            if np.dtype(dtype) != np.dtype(cur.dtype) and not (floats and cur.dtype.itemsize > 1
                                                               and np.dtype(dtype).itemsize > 1):
                raise ValueError(f"params{name} must have dtype {np.dtype(cur.dtype).name} (the served weight's"
                                 f"{', quantized' if cur.dtype.itemsize == 1 else ''}); got {np.dtype(dtype).name}")
        owned = getattr(self, "_owned_params", set())
        leaves = []
        for (_, cur), (_, x) in zip(old, new):
            y = x
            if not (isinstance(x, jax.Array) and x.dtype == cur.dtype and x.sharding == cur.sharding
                    and not x.weak_type):
                y = jax.device_put(jnp.asarray(x, dtype=cur.dtype) if not isinstance(x, jax.Array)
                                   else x.astype(cur.dtype), cur.sharding)
            leaves.append(y)
        tree = jax.tree_util.tree_unflatten(treedef, leaves)
        kept = {id(y) for y in leaves}
        for _, cur in old:   # buffers an earlier update made: nobody else holds them
            if id(cur) in owned and id(cur) not in kept:
                cur.delete()
        self._owned_params = {id(y) for y, (_, x) in zip(leaves, new) if y is not x} | (
            {i for i in owned if i in kept})
        if pair:
            self.params = (tree, self.params[1])
            self.model.target.params = tree
            self.model.params = self.params
        else:
            self.params = self.model.params = tree

    def enable_lora(self, slots) -> None:
        """Serves LoRA adapters from `slots`, the model's stacked adapter slots on the device
        (`EngineModel.lora_slots`), an argument of the step (call before the step compiles). Compiles the
        slot writer (`install_lora`) now, so loading adapters later compiles nothing."""
        if self._step_exe is not None or self.ladder.exes:
            raise RuntimeError("enable_lora must come before the step compiles (the slots are its argument)")

        def install(stack, slot, one):  # stack [max_loras, ...] with stack[slot] = one
            return jax.tree_util.tree_map(lambda s, o: jax.lax.dynamic_update_index_in_dim(s, o.astype(s.dtype),
                                                                                            slot, 0), stack, one)

        # The slots keep their placement (under tensor parallelism: split as their base weights are), and one
        # adapter's host arrays are put on the devices as a slot of them lies (its spec without the max_loras
        # axis), so every install runs the one program compiled here.
        shardings = jax.tree_util.tree_map(lambda a: a.sharding, slots)
        self._install = jax.jit(install, donate_argnums=(0,), out_shardings=shardings)
        self._one_shardings = jax.tree_util.tree_map(_without_lead_axis, shardings)
        self.lora = slots
        self.install_lora(0, jax.tree_util.tree_map(lambda a: np.zeros(a.shape[1:], a.dtype), slots))

    def install_lora(self, slot: int, arrays) -> None:
        """Writes one adapter's arrays (a pytree of the slots' structure without the leading axis) into
        device slot `slot`, in place (the slots are donated), between steps; no compile after the first."""
        self.lora = self._install(self.lora, jnp.int32(slot), jax.device_put(arrays, self._one_shardings))

    def retire(self, seq_ids):
        """Releases slots (finished on the host, aborted or preempted) now, as a call of its own.

        The engine's rounds release such slots at the start of the next step instead
        (`StepBatch.pages.release`); this is for when the host needs the page state after the
        release before then (see `LLMEngine.flush_releases`).

        Returns (free pages, seq_lens i32[max_seqs], own i32[max_seqs], shared bool[max_seqs])
        after the release (`DeviceCounts`' fields of those names).
        """
        ids = np.full((self.max_seqs,), -1, np.int32)
        ids[: len(seq_ids)] = seq_ids
        self.page_state, self.slots, counts = self._retire(self.page_state, self.slots, self._put(jnp.asarray(ids)))
        free, lens, own, shared = jax.device_get(counts)
        return int(free), lens, own, shared

    def swap_out(self, slot: int, size: int):
        """KV offload: the block of slot's first `size` pages, copied to host memory (`jpa.kv.offload.Mover`);
        dispatched asynchronously, before the slot is released. With recurrent state: (the block, the slot's
        states), both in host memory."""
        if isinstance(self.cache, StateCache):
            mover = self._mover()
            return (mover.swap_out(self.cache.pool, self.page_state, slot, size),
                    mover.swap_out_states(self.cache.states, slot))
        return self._mover().swap_out(self.cache, self.page_state, slot, size)

    def swap_in(self, block, evict, slot: int, hit_pages, hit_tokens: int, num_tokens: int):
        """KV offload: evicts `evict`, shares hit_pages into empty `slot`, reserves it up to num_tokens and
        copies the block's pages past the hit into its new pages (all or nothing). Returns ok (bool[],
        on the device: read it with the step's result)."""
        ev = np.full((self.cache_config.num_pages,), -1, np.int32)
        ev[: len(evict)] = list(evict)
        table = np.zeros((self.pages_per_seq,), np.int32)
        table[: len(hit_pages)] = list(hit_pages)
        if isinstance(self.cache, StateCache):   # the block and the slot's recurrent states (`swap_out`)
            block, states = block
            mover = self._mover()
            pool, self.page_state, ok = mover.swap_in(self.cache.pool, self.page_state, block, ev, slot, table,
                                                      hit_tokens, num_tokens)
            self.cache = StateCache(pool, mover.swap_in_states(self.cache.states, states, ok, slot))
            return ok
        self.cache, self.page_state, ok = self._mover().swap_in(self.cache, self.page_state, block, ev, slot, table,
                                                                hit_tokens, num_tokens)
        return ok

    def spill(self, page_ids):
        """KV offload, prefix-cache spill: pages `page_ids` copied to host memory, one pytree per page
        (`jpa.kv.offload.Mover.spill`); dispatched asynchronously, before the call that evicts them."""
        size = bucket(len(page_ids), self.cache_config.num_pages)
        return self._mover().spill(self.cache, page_ids, size)

    def restore(self, data, evict, slot: int, hit_pages, hit_tokens: int):
        """KV offload: a prefix-cache hit partly in the host tier into empty `slot` (hit_pages: device
        pages, -1 where `data`, one spilled page each in order, is restored into fresh cached pages);
        the round's evictions `evict` first. All or nothing; returns ok (bool[], on the device)."""
        ev = np.full((self.cache_config.num_pages,), -1, np.int32)
        ev[: len(evict)] = list(evict)
        table = np.zeros((self.pages_per_seq,), np.int32)
        mask = np.zeros((self.pages_per_seq,), bool)
        hit = np.asarray(hit_pages, np.int32)
        table[: len(hit)] = np.maximum(hit, 0)
        mask[: len(hit)] = hit < 0
        self.cache, self.page_state, ok = self._mover().restore(self.cache, self.page_state, data, ev, slot, table,
                                                                mask, hit_tokens)
        return ok

    def cached_pages(self) -> np.ndarray:
        """The device's cached pages (ids; a host read, for repairs after a failed round)."""
        return np.flatnonzero(np.asarray(jax.device_get(self.page_state.cached)))

    def warm_swaps(self) -> None:
        """Compiles KV offload's swap programs for every block size now (else each compiles at its first use)."""
        sizes = sorted({bucket(n, self.pages_per_seq) for n in range(1, self.pages_per_seq + 1)})
        if isinstance(self.cache, StateCache):
            self.cache = self.cache.replace(pool=self._mover().warm(self.cache.pool, self.page_state, sizes))
        else:
            self.cache = self._mover().warm(self.cache, self.page_state, sizes)

    @property
    def offload_memory_kind(self) -> str | None:
        """Where swapped blocks live ("pinned_host" where the backend has it); None before the first swap."""
        return self._movers.memory_kind if self._movers is not None else None

    def _mover(self):
        if self._movers is None:
            self._movers = Mover(host_memory_kind())
        return self._movers

    def uncache(self, page_ids):
        """Evicts pages from the prefix cache now (`jpa.kv.pages.uncache`); returns (free pages, seq_lens)."""
        ids = np.full((self.cache_config.num_pages,), -1, np.int32)
        ids[: len(page_ids)] = list(page_ids)
        self.page_state = self._uncache(self.page_state, self._put(jnp.asarray(ids)))
        free, lens = jax.device_get((self.page_state.num_free, self.page_state.seq_lens))
        return int(free), lens

    def pool_is_whole(self, cached=(), page_state=None) -> bool:
        """True when no table holds a page and every page is free or one of `cached` (the host's
        prefix cache), held by the cache alone (no leak) — valid when no request is running.
        page_state: the PageState to check (default: this runner's)."""
        ps = jax.device_get(self.page_state if page_state is None else page_state)
        want = np.zeros(self.cache_config.num_pages, bool)
        want[list(cached)] = True
        return (int(ps.num_free) == self.cache_config.num_pages - int(want.sum())
                and np.array_equal(np.asarray(ps.cached), want)
                and np.array_equal(np.asarray(ps.refcounts), want.astype(np.int32)))
