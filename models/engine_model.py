"""The adapter that lets `jpa.engine` serve a `models.GPT` (it satisfies `jpa.engine.EngineModel`).

The engine cannot import this layer; scripts build `GPTForEngine(gpt)` and hand it to the engine.
The GPT is split once into a static graph and a parameter pytree; `prefill`/`decode` merge them
back inside the engine's jit, so the weights are jit arguments, not constants.
"""

import types

import jax
from flax import nnx

from jpa.models import lora
from jpa.models.gpt import (GPT, cache_spec, decode, dense_head_of, dense_head_wanted, prefill, ragged, ragged_hidden,
                            set_dense_head, set_embeddings_layout, tied_head_served)
from jpa.models.linear import format_of


class GPTForEngine:
    """A models.GPT seen through the engine's model protocol.

    Args:
      model: the GPT.
      mesh: None (one device), or the tensor-parallel mesh the model's params are already placed
        on (use `shard(mesh)`, which plans heads and places params, rather than passing it here).
      lora_method: how the LoRA matmuls of a step group their rows (`models.lora.LORA_METHODS`).
      **decode_options: keyword arguments passed on to every `models.decode` call (for options
        that models.decode accepts, e.g. an attention backend).
    """

    def __init__(self, model: GPT, *, mesh=None, lora_method: str = lora.DEFAULT_METHOD, **decode_options):
        if not isinstance(model, GPT):
            raise ValueError(f"model must be a models.GPT; got {type(model).__name__}")
        if mesh is None and tied_head_served(model):
            # a tied quantized head on a GPU the Mosaic matmul serves: the table kept [d_model, vocab] (in
            # place, one copy), so the head reads its codes as stored instead of a dense bf16 copy a step
            set_embeddings_layout(model, True)
        elif mesh is None and dense_head_wanted(model):
            # a tied quantized head on a CPU: one float [d_model, vocab] copy (in place) that every compiled
            # step's dot reads, instead of each step dequantizing the whole table into a temporary of its own
            set_dense_head(model, True)
        # the tied table's format where the model keeps a dense copy of it as its head (`complete_params`)
        self.dense_head_format = format_of(model, "tok_embeddings") if model.head_dense else None
        self.config = model.config
        self.dtype = model.dtype
        self.quantization = model.quantization  # weight-only quantization (None, "int8", "fp8")
        self.graphdef, self.params = nnx.split(model)
        self.mesh = mesh
        self.head_plan = None
        self.lora_config = model.config   # the shapes PEFT adapters of this model have (before any head plan)
        self.lora_method = lora_method
        if self.lora_method not in lora.LORA_METHODS:
            raise ValueError(f"lora_method must be one of {lora.LORA_METHODS}; got {self.lora_method!r}")
        self.decode_options = dict(decode_options)

    def shard(self, mesh, **options) -> "GPTForEngine":
        """This model on a tensor-parallel mesh (EngineModel's optional `shard`): heads planned,
        params placed by models.sharding's rules, attention run per device. options: those of
        `models.sharding.shard` (embeddings=)."""
        from jpa.models import sharding

        gpt = set_dense_head(nnx.merge(self.graphdef, self.params), False)  # the rules plan the table, not a copy
        gpt, plan = sharding.shard(gpt, mesh, **options)  # table in rows
        out = GPTForEngine(gpt, mesh=mesh, lora_method=self.lora_method, **self.decode_options)
        out.head_plan = plan
        out.lora_config = self.lora_config   # adapters are read at the original shapes, then planned
        return out

    def complete_params(self, params):
        """EngineModel's optional hook for `update_weights`: `params` (this model's parameter pytree, or the
        model's as loaded, without the copy) with the weights the served model derives from others made from
        them: a CPU's dense head (`models.gpt.set_dense_head`), `output`, is the new table's, never a stale
        copy. Others as given."""
        fmt = self.dense_head_format
        if fmt is None:
            return params
        table = types.SimpleNamespace(**{"tok_embeddings" + sx: params["tok_embeddings" + sx] for sx in fmt.parts})
        head = dense_head_of(fmt, table, self.dtype)
        out = nnx.State(dict(params.raw_mapping)) if isinstance(params, nnx.State) else dict(params)  # nested as given
        out["output"] = nnx.Param(head) if isinstance(params["tok_embeddings"], nnx.Variable) else head
        return out

    def cache_spec(self):
        """The cache this model's layers keep (EngineModel's optional `cache_spec`; `GPT.cache_spec`), with the
        head count the pool holds (under tensor parallelism, `config` is the sharded model's)."""
        return cache_spec(self.config)

    def prefill(self, params, cache, tokens, start, chunk_lens, slot_mapping, block_tables):
        model = nnx.merge(self.graphdef, params)
        return prefill(model, cache, tokens, start, chunk_lens, slot_mapping, block_tables, mesh=self.mesh)

    def decode(self, params, cache, tokens, seq_lens, slot_mapping, block_tables, *, impl="auto", lora=None):
        model = nnx.merge(self.graphdef, params)
        return decode(model, cache, tokens, seq_lens, slot_mapping, block_tables, impl=impl, mesh=self.mesh,
                      lora=self._lora(lora), **self.decode_options)

    def ragged(self, params, cache, tokens, positions, slot_mapping, block_tables, seq_lens, cu_q_lens, num_seqs,
               *, impl="auto", lora=None):
        model = nnx.merge(self.graphdef, params)
        return ragged(model, cache, tokens, positions, slot_mapping, block_tables, seq_lens, cu_q_lens, num_seqs,
                      impl=impl, mesh=self.mesh, lora=self._lora(lora))

    def ragged_hidden(self, params, cache, tokens, positions, slot_mapping, block_tables, seq_lens, cu_q_lens,
                      num_seqs, *, impl="auto", lora=None):
        """EngineModel's optional pair, with `head`: `ragged` as (hidden f32[T, d_model], cache)."""
        model = nnx.merge(self.graphdef, params)
        return ragged_hidden(model, cache, tokens, positions, slot_mapping, block_tables, seq_lens, cu_q_lens,
                             num_seqs, impl=impl, mesh=self.mesh, lora=self._lora(lora))

    def lora_slots(self, max_loras: int, max_lora_rank: int):
        """EngineModel's optional LoRA pair, with `read_lora`: the stacked adapter slots on the device, all
        empty (`models.lora.empty_slots`: {name: {"a": [max_loras, L, in, R], "b": [max_loras, L, R, out]}}).
        Under a tensor-parallel mesh they are at the planned head counts and placed on the mesh split as their
        base weights are (`models.sharding.lora_specs`)."""
        slots = lora.empty_slots(self.config, max_loras, max_lora_rank, self.dtype)
        if self.mesh is None:
            return slots
        from jax.sharding import NamedSharding

        from jpa.models import sharding

        specs = sharding.lora_specs(slots)
        return {name: {k: jax.device_put(x, NamedSharding(self.mesh, specs[name][k])) for k, x in ab.items()}
                for name, ab in slots.items()}

    def read_lora(self, path, max_lora_rank: int):
        """One PEFT adapter directory as the host arrays of one slot (`models.lora.read_adapter`; ValueError
        for a bad directory, a rank above max_lora_rank or a target this model lacks); under a tensor-parallel
        mesh, at the planned head counts (`models.sharding.plan_lora`)."""
        one = lora.read_adapter(path, self.lora_config, max_lora_rank, self.dtype)
        if self.head_plan is None:
            return one
        from jpa.models import sharding

        return sharding.plan_lora(one, self.lora_config, self.head_plan)

    def _lora(self, pair):
        """The engine's lora=(slots, index) with this model's `lora_method`."""
        return None if pair is None else (*pair, self.lora_method)

    def head(self, params, hidden):
        """hidden f32[..., d_model] -> logits f32[..., vocab] (final norm and output layer)."""
        return nnx.merge(self.graphdef, params).logits(hidden, self.mesh)
