"""The typed contract between the scheduler's plan and the runner's compiled step.

`make_step_batch(plan, shapes)` is the one place a `RoundPlan` becomes device input (`StepBatch`);
the compiled unified step returns a `StepResult`, read back to the host in one transfer and
handed to `Scheduler.stepped`. Both are nested records, one per concern, so a feature adds its
own record instead of fields threaded through every layer:

    StepBatch   rows (RaggedRows)  pages (PageOps)  sampling (SamplingInputs)
                structured (GrammarMasks)  prompt (PromptTargets)  run_ragged, decode_steps, loop_slots
    StepResult  first (Sampled [B])  loop (Sampled [steps * width, B])  ok, steps
                state (DeviceCounts)  usage (PageUsage)  spec (SpecCounts)  prompt (PromptLogprobs | None)

Shapes use docs/architecture.md's legend: B = the round's rows (`jpa.engine.shapes.StepShape.rows`, <= max_seqs:
entries of the ragged step, live entries first, then padding; slots of the decode loop), T = the
round's token budget (`StepShape.tokens`, <= max_num_batched_tokens), P = num_pages,
steps = steps_per_call, top_n = min(20, vocab). Arrays over every slot are [max_seqs].
"""

import flax.struct
import jax
import numpy as np

from jpa.engine.sampling import SlotParams
from jpa.engine.structured import GrammarMasks  # noqa: F401  (the structured-outputs record of StepBatch)


@flax.struct.dataclass
class RaggedRows:
    """The ragged step's entries and their rows.

    Attributes:
      seq_ids: i32[B]; the slot of each entry (-1 = padding).
      q_lens: i32[B]; its query rows this round (1 for a decode row, the chunk length for a prompt
        chunk, 0 for a parallel sample that forks).
      decode_row: bool[B]; the entry feeds its slot's pending token (the rest are prompt chunks).
      final: bool[B]; a prompt chunk that ends the prompt (the slot starts decoding after it).
      tokens: i32[T]; the prompt chunks' token ids back to back (decode rows are filled on the device).
      fork_from: i32[B]; for a parallel sample (q_len 0, final, empty slot) the entry whose final
        chunk it forks; -1 elsewhere.
      lora: i32[B]; the device slot of the entry's LoRA adapter (`jpa.engine.lora`); -1: the base model.
    """
    seq_ids: jax.Array
    q_lens: jax.Array
    decode_row: jax.Array
    final: jax.Array
    tokens: jax.Array
    fork_from: jax.Array
    lora: jax.Array


@flax.struct.dataclass
class PageOps:
    """Page work of the round, done first (see `ModelRunner._step_impl`).

    Attributes:
      release: i32[max_seqs]; slots the host finished or preempted since the last device call (stop
        strings, aborts, preemptions: `RoundPlan.release`), released before anything else of the
        round (-1 = padding). Not undone when the rest of the page work fails.
      evict: i32[P]; cached-idle pages evicted before anything is reserved (-1 = padding).
      hit_tokens: i32[B]; prefix-cache hit tokens shared into the (empty) slot before its first chunk.
      hit_tables: i32[B, pages_per_seq]; the hit's pages.
      cache_upto: i32[B]; full prompt pages a final chunk puts into the prefix cache (0 = none).
    """
    release: jax.Array
    evict: jax.Array
    hit_tokens: jax.Array
    hit_tables: jax.Array
    cache_upto: jax.Array


@flax.struct.dataclass
class SamplingInputs:
    """What a final chunk installs in its slot before its first token is sampled.

    Attributes:
      params: SlotParams [B]; a final chunk's request parameters.
      num_generated: i32[B]; tokens a final chunk's request has generated (> 0: a resumed request).
      resume_token: i32[B]; a resumed request's pending token (-1: sample it from the logits).
    """
    params: SlotParams
    num_generated: jax.Array
    resume_token: jax.Array


@flax.struct.dataclass
class PromptTargets:
    """Prompt logprobs (SamplingParams.prompt_logprobs).

    Attributes:
      targets: i32[T]; for a prompt row whose request asks for prompt logprobs, the next prompt
        token (the one the row's logits predict); -1 elsewhere (no prompt logprobs: the step skips
        their work when every row is -1).
    """
    targets: jax.Array


@flax.struct.dataclass
class StepBatch:
    """One unified round's device input: a record per concern (see the module docstring).

    Attributes:
      rows: RaggedRows; pages: PageOps; sampling: SamplingInputs; structured: GrammarMasks;
      prompt: PromptTargets.
      run_ragged: i32[]; 1 to run the ragged step, 0 for a decode-only round.
      decode_steps: i32[]; decode steps after it (<= steps_per_call).
      loop_slots: i32[B]; the slots the decode loop runs when B < max_seqs (every slot holding a
        request: the loop's state is gathered from them and scattered back; -1 = padding). At
        B == max_seqs the loop runs every slot and this is not read.
    """
    rows: RaggedRows
    pages: PageOps
    sampling: SamplingInputs
    structured: GrammarMasks
    prompt: PromptTargets
    run_ragged: jax.Array
    decode_steps: jax.Array
    loop_slots: jax.Array


@flax.struct.dataclass
class Sampled:
    """Sampled tokens with their log-probabilities and top alternatives ([n] leading axes).

    Attributes:
      tokens: i32[n]; -1 = none.
      logprobs: f32[n]; their log-probabilities (NaN for a resumed request's pending token).
      top_ids: i32[n, top_n]; the most likely tokens of the distribution each was drawn from, when
        some row asked for top_logprobs (-1 otherwise).
      top_logprobs: f32[n, top_n]; their log-probabilities.
    """
    tokens: jax.Array
    logprobs: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array


@flax.struct.dataclass
class DeviceCounts:
    """The device's page and slot state after the round (the scheduler's only source of counts).

    Attributes:
      num_free: i32[]; free pages after the round.
      seq_lens: i32[max_seqs]; tokens cached per slot after the round.
      active: bool[max_seqs]; slots still decoding (False: finished and released on the device).
      tables: i32[B, pages_per_seq]; the entries' block-table rows once the final chunks' prompt
        pages were cached (the host's prefix cache reads their page ids).
      own: i32[max_seqs]; pages each slot alone references (refcount 1: neither cached nor shared
        with another slot), i.e. what releasing that slot alone frees (`ragged_step.own_pages`).
        The scheduler plans the next round from num_free plus own of the slots it releases in
        that round's step. None where unknown (a host model of the device in unit tests).
      shared: bool[max_seqs]; the slot references a page that is not cached and that another slot
        references too (a forked sample's prompt pages or its shared last page): releasing two such
        slots together may free pages neither `own` counts. None where unknown.
    """
    num_free: jax.Array
    seq_lens: jax.Array
    active: jax.Array
    tables: jax.Array
    own: jax.Array | None = None
    shared: jax.Array | None = None


@flax.struct.dataclass
class PageUsage:
    """Page figures of the round.

    Attributes:
      cow_copies: i32[]; pages copied on write this round.
      peak_pages: i32[]; the most pages sequences held at once during the round (after its
        reservations, before its releases; prefix-cached pages nobody holds are not counted).
      peak_tokens: i32[]; tokens cached in the sequences' pages at that moment (a page shared by
        several sequences counted once).
    """
    cow_copies: jax.Array
    peak_pages: jax.Array
    peak_tokens: jax.Array


@flax.struct.dataclass
class SpecCounts:
    """Speculative decoding's counters of the round (zeros without it).

    Attributes:
      drafted: i32[max_seqs]; draft tokens each slot verified.
      accepted: i32[max_seqs]; of them, accepted.
      steps: i32[max_seqs]; verify steps in which the slot had drafts.
      accepted_per_pos: i32[max(k, 1)]; accepted drafts by position (vLLM's per-position count).
    """
    drafted: jax.Array
    accepted: jax.Array
    steps: jax.Array
    accepted_per_pos: jax.Array


@flax.struct.dataclass
class PromptLogprobs:
    """Prompt logprobs of the rows that asked (where batch.prompt.targets >= 0; NaN / -1 elsewhere).

    Attributes:
      logprobs: f32[T]; the target's log-probability under the row's raw logits (log_softmax).
      ranks: i32[T]; the target's rank there (tokens at least as likely; 1 = the top).
      top_ids: i32[T, top_n]; the row's most likely tokens; top_logprobs: f32[T, top_n].
    """
    logprobs: jax.Array
    ranks: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array


@flax.struct.dataclass
class StepResult:
    """What one unified round returns to the host (besides the donated state).

    Attributes:
      first: Sampled [B]; each entry's sampled (or resumed) token where it is a decode row or a
        final chunk.
      loop: Sampled [steps * width, max_seqs]; tokens of the decode steps (-1 = none), in order per
        slot; width = 1, or k + 1 with speculative decoding (row i * width + j: the j-th token a
        slot emitted in verify step i). The host cuts it to the steps run.
      ok: bool[]; False when the pool could not hold the entries' rows: then the round changed
        nothing on the device but its release (no eviction, no reservation, no decode step).
      steps: i32[]; decode steps run (rows of `loop` past it are -1).
      state: DeviceCounts; usage: PageUsage; spec: SpecCounts.
      prompt: PromptLogprobs; read back only in rounds that asked (`ModelRunner.step`; None on the
        host otherwise).
    """
    first: Sampled
    loop: Sampled
    ok: jax.Array
    steps: jax.Array
    state: DeviceCounts
    usage: PageUsage
    spec: SpecCounts | None = None
    prompt: PromptLogprobs | None = None


def make_step_batch(plan, shapes, masks=None, shape=None) -> StepBatch:
    """The StepBatch (numpy arrays) of a `scheduler.RoundPlan` for `shapes` (`EngineShapes`: its
    budget, slots and sizes); masks: {entry index: i32[ceil(vocab_size / 32)] allowed-token bitmask}
    of the entries that sample under a grammar (`jpa.engine.structured.Grammars.masks`); shape: the
    `StepShape` (rung of the step-shape ladder) to fill, default the full (max_seqs, budget)."""
    b, num_tokens = (shapes.max_seqs, shapes.num_tokens) if shape is None else (shape.rows, shape.tokens)
    entries, held = plan.entries, getattr(plan, "held", None)
    if len(entries) > b or sum(e.q_len for e in entries) > num_tokens:
        raise ValueError(f"a plan of {len(entries)} entries and {sum(e.q_len for e in entries)} rows does not fit "
                         f"{b} entries and a budget of {num_tokens} tokens")
    if b < shapes.max_seqs and (held is None or len(held) > b):
        raise ValueError(f"a step of {b} < max_seqs ({shapes.max_seqs}) rows needs the plan's held slots, at most "
                         f"{b} of them; got {held!r}")
    index = {e.slot: i for i, e in enumerate(entries)}
    col = lambda fill, dt=np.int32: np.full((b,), fill, dt)  # noqa: E731
    seq_ids, q_lens, num_generated, resume = col(-1), col(0), col(0), col(-1)
    decode_row, final = col(False, bool), col(False, bool)
    hit_tokens, cache_upto, fork_from, lora = col(0), col(0), col(-1), col(-1)
    hit_tables = np.zeros((b, shapes.pages_per_seq), np.int32)
    tokens = np.zeros((num_tokens,), np.int32)
    targets = np.full((num_tokens,), -1, np.int32)
    rows = [None] * b
    at = 0
    for i, e in enumerate(entries):
        seq_ids[i], q_lens[i], decode_row[i], final[i] = e.slot, e.q_len, e.decode, e.final
        hit_tokens[i], cache_upto[i] = len(e.hit_pages) * shapes.page_size, e.cache_upto
        hit_tables[i, : len(e.hit_pages)] = e.hit_pages
        fork_from[i] = index[e.fork_of] if e.fork_of >= 0 else -1
        lora[i] = getattr(e.request, "lora_slot", -1)
        tokens[at: at + len(e.tokens)] = e.tokens
        targets[at: at + len(e.targets)] = e.targets
        at += e.q_len
        if e.final:
            out = e.request.output_ids
            rows[i] = SlotParams.row(e.request.params, shapes.max_model_len, len(e.request.prompt_ids),
                                     getattr(e.request, "lora_slot", -1))
            num_generated[i], resume[i] = len(out), (out[-1] if out else -1)
    release = np.full((shapes.max_seqs,), -1, np.int32)
    release[: len(getattr(plan, "release", ()))] = getattr(plan, "release", ())
    loop_slots = col(-1)
    if b < shapes.max_seqs:
        loop_slots[: len(held)] = held
    evict = np.full((shapes.num_pages,), -1, np.int32)
    if not getattr(plan, "swap_in", ()):   # KV offload: the first swap-in did the round's evictions
        evict[: len(plan.evict)] = plan.evict
    allowed = np.full((b, shapes.mask_words), -1, np.int32)   # all ones: no row is masked by default
    constrained = col(False, bool)
    for i, row in (masks or {}).items():
        allowed[i], constrained[i] = row, True
    return StepBatch(
        rows=RaggedRows(seq_ids=seq_ids, q_lens=q_lens, decode_row=decode_row, final=final, tokens=tokens,
                        fork_from=fork_from, lora=lora),
        pages=PageOps(release=release, evict=evict, hit_tokens=hit_tokens, hit_tables=hit_tables,
                      cache_upto=cache_upto),
        sampling=SamplingInputs(params=SlotParams.from_rows(rows, b), num_generated=num_generated,
                                resume_token=resume),
        structured=GrammarMasks(allowed=allowed, constrained=constrained),
        prompt=PromptTargets(targets=targets),
        run_ragged=np.int32(len(entries) > 0), decode_steps=np.int32(plan.decode_steps), loop_slots=loop_slots)
