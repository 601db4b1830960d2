"""The engine's shapes, fixed once per engine: one frozen record every layer reads.

`EngineShapes` is built once (`EngineShapes.build`, by `LLMEngine` from its config, the model and
the pool it sized) and handed to the scheduler's batch builder (`jpa.engine.batch.make_step_batch`)
and to the runner, instead of `page_size`, `max_seqs`, `pages_per_seq`, ... re-passed as keywords
to each. Names follow docs/architecture.md's legend.
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class EngineShapes:
    """The static sizes of one engine's compiled step (hashable).

    Attributes:
      max_seqs: decode slots (B of the decode loop; entries of the ragged step).
      page_size: tokens per KV page.
      num_pages: pages in the pool.
      pages_per_seq: the most pages one sequence may hold (columns of a block table).
      max_model_len: longest sequence (prompt + completion) the engine serves.
      num_tokens: the token budget of a round (T of the ragged step; `max_num_batched_tokens`).
      steps_per_call: decode (verify) steps per round at most.
      vocab_size: the model's vocabulary (columns of the logits; the grammar bitmask's width).
    """
    max_seqs: int
    page_size: int
    num_pages: int
    pages_per_seq: int
    max_model_len: int
    num_tokens: int
    steps_per_call: int
    vocab_size: int

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"EngineShapes.{f.name} must be an int >= 1; got {v!r}")

    @property
    def mask_words(self) -> int:
        """i32 words of a row's allowed-token bitmask (structured outputs): ceil(vocab_size / 32)."""
        return -(-self.vocab_size // 32)

    def with_budget(self, num_tokens: int) -> "EngineShapes":
        """The same shapes for another token budget (the runner compiles for the budget it is given)."""
        return dataclasses.replace(self, num_tokens=num_tokens)


@dataclasses.dataclass(frozen=True, order=True)
class StepShape:
    """One compiled shape of the unified step (a rung of the step-shape ladder; hashable, ordered by size).

    Attributes:
      rows: entries of the ragged pass and rows of the decode loop (B of the round's `StepBatch`;
        <= max_seqs). The loop runs the slots the host names (`StepBatch.loop_slots`), gathered
        out of the max_seqs slots' state and scattered back; at rows == max_seqs it runs every slot.
      tokens: the ragged pass's token budget (T of the round's `StepBatch`; <= max_num_batched_tokens).
    """
    rows: int
    tokens: int

    def __post_init__(self):
        for f in ("rows", "tokens"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"StepShape.{f} must be an int >= 1; got {v!r}")

    def holds(self, rows: int, tokens: int) -> bool:
        """True when a round of `rows` entries / loop slots and `tokens` prompt and decode rows fits."""
        return rows <= self.rows and tokens <= self.tokens


# Token rows per decode row of the automatic ladder's rungs: rung i is (2^i rows, 16 * 2^i tokens),
# both capped by the engine's sizes. One dimension (rows and tokens grow together), not the
# rows x tokens grid: the grid's 30-odd programs would cost minutes of compilation on a CPU, and a
# round needs a big token rung only while it prefills (one round per chunk), a big row rung while
# many sequences decode.
LADDER_TOKENS_PER_ROW = 16


def step_ladder(spec, max_seqs: int, num_tokens: int) -> tuple[StepShape, ...]:
    """The unified step's shapes, smallest first; the last is always the full shape (max_seqs, num_tokens).

    Args:
      spec: `EngineConfig.step_shapes`: "ladder" (rungs (1, 16), (2, 32), (4, 64), ... doubling,
        each capped at (max_seqs, num_tokens)), "off" (the full shape alone: one program, as a
        batch-invariant mode needs), or a sequence of (rows, tokens) pairs (the full shape is added).
      max_seqs: the engine's slots; num_tokens: its token budget (max_num_batched_tokens).
    """
    full = StepShape(max_seqs, num_tokens)
    if spec == "off":
        return (full,)
    if spec == "ladder":
        rungs, r = set(), 1
        while r < max_seqs:
            rungs.add(StepShape(r, max(r, min(num_tokens, LADDER_TOKENS_PER_ROW * r))))
            r *= 2
    else:
        try:
            rungs = {StepShape(*pair) for pair in spec}
        except (TypeError, ValueError) as e:
            raise ValueError(f"EngineConfig.step_shapes must be 'ladder', 'off' or a sequence of (rows, tokens) "
                             f"pairs of ints >= 1; got {spec!r} ({e})") from None
        bad = [s for s in rungs if s.rows > max_seqs or s.tokens > num_tokens or s.tokens < s.rows]
        if bad:
            raise ValueError(f"EngineConfig.step_shapes: each (rows, tokens) needs rows <= tokens, rows <= max_seqs "
                             f"({max_seqs}) and tokens <= max_num_batched_tokens ({num_tokens}); got "
                             f"{[(s.rows, s.tokens) for s in sorted(bad)]}")
    rungs.add(full)
    return tuple(sorted(rungs))
