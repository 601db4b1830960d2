"""The adapter that lets `jpa.engine` serve a `models.GPT` (it satisfies `jpa.engine.EngineModel`).

The engine cannot import this layer; scripts build `GPTForEngine(gpt)` and hand it to the engine.
The GPT is split once into a static graph and a parameter pytree; `prefill`/`decode` merge them
back inside the engine's jit, so the weights are jit arguments, not constants.
"""

from flax import nnx

from models.gpt import GPT, decode, prefill


class GPTForEngine:
    """A models.GPT seen through the engine's model protocol.

    Args:
      model: the GPT.
      **decode_options: keyword arguments passed on to every `models.decode` call (for options
        that models.decode accepts, e.g. an attention backend).
    """

    def __init__(self, model: GPT, **decode_options):
        if not isinstance(model, GPT):
            raise ValueError(f"model must be a models.GPT; got {type(model).__name__}")
        self.config = model.config
        self.dtype = model.dtype
        self.graphdef, self.params = nnx.split(model)
        self.decode_options = dict(decode_options)

    def prefill(self, params, cache, tokens, start, chunk_lens, slot_mapping, block_tables):
        model = nnx.merge(self.graphdef, params)
        return prefill(model, cache, tokens, start, chunk_lens, slot_mapping, block_tables)

    def decode(self, params, cache, tokens, seq_lens, slot_mapping, block_tables):
        model = nnx.merge(self.graphdef, params)
        return decode(model, cache, tokens, seq_lens, slot_mapping, block_tables, **self.decode_options)
