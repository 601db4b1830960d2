"""Leaf helpers every layer may import (they import nothing of jpa): cache dtypes and quantization
(`quant`), the tensor-parallel vocabulary (`sharding`), shared numeric constants (`numerics`) and
the XLA options the engine's step compiles with per platform (`xla_options`)."""
