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
