"""Leaf helpers every layer may import (they import nothing of jpa): cache dtypes and quantization
(`quant`), the tensor-parallel vocabulary (`sharding`) and shared numeric constants (`numerics`)."""
