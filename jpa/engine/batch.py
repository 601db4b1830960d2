"""The typed contract between the scheduler's plan and the runner's compiled step.

`make_step_batch(plan, ...)` is the one place a `RoundPlan` becomes device input (`StepBatch`);
the compiled unified step returns a `StepResult`, read back to the host in one transfer and
handed to `Scheduler.stepped`. Shapes use design.md's legend: B = max_seqs (entries of the
ragged step, live entries first, then padding), T = the token budget (max_num_batched_tokens),
P = num_pages, steps = steps_per_call.
"""

import flax.struct
import jax
import numpy as np

from jpa.engine.sampling import SlotParams


@flax.struct.dataclass
class StepBatch:
    """One unified round's device input.

    Attributes:
      seq_ids: i32[B]; the slot of each entry (-1 = padding).
      q_lens: i32[B]; its query rows this round (1 for a decode row, the chunk length for a prompt
        chunk, 0 for a parallel sample that forks).
      decode_row: bool[B]; the entry feeds its slot's pending token (the rest are prompt chunks).
      final: bool[B]; a prompt chunk that ends the prompt (the slot starts decoding after it).
      tokens: i32[T]; the prompt chunks' token ids back to back (decode rows are filled on the device).
      prompt_targets: i32[T]; for a prompt row whose request asks for prompt logprobs, the next
        prompt token (the one the row's logits predict); -1 elsewhere (no prompt logprobs: the
        step skips their work when every row is -1).
      params: SlotParams [B]; a final chunk's request parameters, installed in its slot.
      num_generated: i32[B]; tokens a final chunk's request has generated (> 0: a resumed request).
      resume_token: i32[B]; a resumed request's pending token (-1: sample it from the logits).
      hit_tokens: i32[B]; prefix-cache hit tokens shared into the (empty) slot before its first chunk.
      hit_tables: i32[B, pages_per_seq]; the hit's pages.
      cache_upto: i32[B]; full prompt pages a final chunk puts into the prefix cache (0 = none).
      fork_from: i32[B]; for a parallel sample (q_len 0, final, empty slot) the entry whose final
        chunk it forks; -1 elsewhere.
      evict: i32[P]; cached-idle pages evicted before anything is reserved (-1 = padding).
      allowed: i32[B, ceil(vocab / 32)]; structured outputs: the allowed-token bitmask of an entry
        that samples under a grammar (bit t % 32 of word t // 32 = token t; `jpa.engine.structured`).
      constrained: bool[B]; the entry samples under its `allowed` row (False: no mask).
      run_ragged: i32[]; 1 to run the ragged step, 0 for a decode-only round.
      decode_steps: i32[]; decode steps after it (<= steps_per_call).
    """
    seq_ids: jax.Array
    q_lens: jax.Array
    decode_row: jax.Array
    final: jax.Array
    tokens: jax.Array
    prompt_targets: jax.Array
    params: SlotParams
    num_generated: jax.Array
    resume_token: jax.Array
    hit_tokens: jax.Array
    hit_tables: jax.Array
    cache_upto: jax.Array
    fork_from: jax.Array
    evict: jax.Array
    allowed: jax.Array
    constrained: jax.Array
    run_ragged: jax.Array
    decode_steps: jax.Array


@flax.struct.dataclass
class StepResult:
    """What one unified round returns to the host (besides the donated state).

    Attributes:
      tokens: i32[B]; each entry's sampled (or resumed) token where it is a decode row or a final
        chunk.
      logprobs: f32[B]; their log-probabilities (NaN for a resumed request's pending token).
      top_ids: i32[B, top_n]; the most likely tokens of the distribution each was drawn from, when
        some row asked for top_logprobs (-1 otherwise); top_n = min(20, vocab).
      top_logprobs: f32[B, top_n]; their log-probabilities.
      ok: bool[]; False when the pool could not hold the entries' rows: then the round changed
        nothing on the device (no eviction, no reservation, no decode step).
      out: i32[steps * width, max_seqs]; tokens of the decode steps (-1 = none), in order per slot;
        width = 1, or k + 1 with speculative decoding (row i * width + j: the j-th token a slot
        emitted in verify step i).
      out_logprobs: f32[steps * width, max_seqs].
      out_top_ids: i32[steps * width, max_seqs, top_n]; out_top_logprobs: the same, f32.
      steps: i32[]; decode steps run (rows of `out` past it are -1).
      num_free: i32[]; free pages after the round.
      seq_lens: i32[max_seqs]; tokens cached per slot after the round.
      active: bool[max_seqs]; slots still decoding (False: finished and released on the device).
      tables: i32[B, pages_per_seq]; the entries' block-table rows once the final chunks' prompt
        pages were cached (the host's prefix cache reads their page ids).
      cow_copies: i32[]; pages copied on write this round.
      prompt_logprobs: f32[T]; where batch.prompt_targets >= 0, the target's log-probability under
        the row's raw logits (log_softmax); NaN elsewhere.
      prompt_ranks: i32[T]; the target's rank there (tokens at least as likely; 1 = the top).
      prompt_top_ids: i32[T, top_n]; the row's most likely tokens (-1 where not asked);
        prompt_top_logprobs: f32[T, top_n], their log-probabilities. The host reads these four
        back only in rounds that asked (`ModelRunner.step`; None on the host otherwise).
      spec_drafted: i32[max_seqs]; draft tokens each slot verified this round (speculative decoding;
        zeros without it).
      spec_accepted: i32[max_seqs]; of them, accepted.
      spec_steps: i32[max_seqs]; verify steps in which the slot had drafts.
      spec_accepted_per_pos: i32[k]; accepted drafts by position (vLLM's per-position count).
      peak_pages: i32[]; the most pages sequences held at once during the round (after its
        reservations, before its releases; prefix-cached pages nobody holds are not counted).
      peak_tokens: i32[]; tokens cached in the sequences' pages at that moment (a page shared by
        several sequences counted once).
    """
    tokens: jax.Array
    logprobs: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array
    ok: jax.Array
    out: jax.Array
    out_logprobs: jax.Array
    out_top_ids: jax.Array
    out_top_logprobs: jax.Array
    steps: jax.Array
    num_free: jax.Array
    seq_lens: jax.Array
    active: jax.Array
    tables: jax.Array
    cow_copies: jax.Array
    prompt_logprobs: jax.Array | None = None
    prompt_ranks: jax.Array | None = None
    prompt_top_ids: jax.Array | None = None
    prompt_top_logprobs: jax.Array | None = None
    spec_drafted: jax.Array | None = None
    spec_accepted: jax.Array | None = None
    spec_steps: jax.Array | None = None
    spec_accepted_per_pos: jax.Array | None = None
    peak_pages: jax.Array | None = None
    peak_tokens: jax.Array | None = None


def make_step_batch(plan, *, max_seqs: int, num_tokens: int, pages_per_seq: int, num_pages: int,
                    page_size: int, max_model_len: int, vocab_size: int, masks=None) -> StepBatch:
    """The StepBatch (numpy arrays) of a `scheduler.RoundPlan` for a budget of num_tokens; masks:
    {entry index: i32[ceil(vocab_size / 32)] allowed-token bitmask} of the entries that sample under
    a grammar (`jpa.engine.structured.Grammars.masks`)."""
    entries, b = plan.entries, max_seqs
    if len(entries) > b or sum(e.q_len for e in entries) > num_tokens:
        raise ValueError(f"a plan of {len(entries)} entries and {sum(e.q_len for e in entries)} rows does not fit "
                         f"{b} entries and a budget of {num_tokens} tokens")
    index = {e.slot: i for i, e in enumerate(entries)}
    col = lambda fill, dt=np.int32: np.full((b,), fill, dt)  # noqa: E731
    seq_ids, q_lens, num_generated, resume = col(-1), col(0), col(0), col(-1)
    decode_row, final = col(False, bool), col(False, bool)
    hit_tokens, cache_upto, fork_from = col(0), col(0), col(-1)
    hit_tables = np.zeros((b, pages_per_seq), np.int32)
    tokens = np.zeros((num_tokens,), np.int32)
    targets = np.full((num_tokens,), -1, np.int32)
    rows = [None] * b
    at = 0
    for i, e in enumerate(entries):
        seq_ids[i], q_lens[i], decode_row[i], final[i] = e.slot, e.q_len, e.decode, e.final
        hit_tokens[i], cache_upto[i] = len(e.hit_pages) * page_size, e.cache_upto
        hit_tables[i, : len(e.hit_pages)] = e.hit_pages
        fork_from[i] = index[e.fork_of] if e.fork_of >= 0 else -1
        tokens[at: at + len(e.tokens)] = e.tokens
        targets[at: at + len(e.targets)] = e.targets
        at += e.q_len
        if e.final:
            out = e.request.output_ids
            rows[i] = SlotParams.row(e.request.params, max_model_len, len(e.request.prompt_ids))
            num_generated[i], resume[i] = len(out), (out[-1] if out else -1)
    evict = np.full((num_pages,), -1, np.int32)
    evict[: len(plan.evict)] = plan.evict
    allowed = np.full((b, -(-vocab_size // 32)), -1, np.int32)   # all ones: no row is masked by default
    constrained = col(False, bool)
    for i, row in (masks or {}).items():
        allowed[i], constrained[i] = row, True
    return StepBatch(seq_ids=seq_ids, q_lens=q_lens, decode_row=decode_row, final=final, tokens=tokens,
                     prompt_targets=targets,
                     params=SlotParams.from_rows(rows, b), num_generated=num_generated, resume_token=resume,
                     hit_tokens=hit_tokens, hit_tables=hit_tables, cache_upto=cache_upto, fork_from=fork_from,
                     evict=evict, allowed=allowed, constrained=constrained, run_ragged=np.int32(len(entries) > 0), decode_steps=np.int32(plan.decode_steps))
