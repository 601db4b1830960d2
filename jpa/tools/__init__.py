"""Tools: compiling jpa for a GPU that is not here, and reading what the compiler made of it.

    jpa.tools.deviceless      target configs (H100, A100), `configure_environment`, `Compiler`: the
                              abstract-device compile and its record (kernels, memory, pool copies)
    jpa.tools.hlo             readers: XLA's thunk sequence, ptxas -v, MOSAIC_GPU_DUMP_TO, the optimized
                              HLO (pool copies, collectives, replica groups, the hosts they span)
    jpa.tools.kernel_checks   the decode-kernel grid, the ragged kernels, kernels over stacked pools
    jpa.tools.engine_checks   the engine's unified step on one GPU and tensor-parallel over several
    jpa.tools.traffic         a memory-traffic model of a compiled GPU program: bytes each kernel reads
                              and writes, by purpose, against the ideal (`engine_traffic`: one decode step)

`jpa tools compile` is the command line over these; `jpa tools traffic` over the
traffic model. A process that compiles must call
`deviceless.configure_environment()` before JAX first initializes XLA (the `Compiler` calls it):
it turns on the XLA log that carries ptxas's register report.

Layering: tools may import every layer below the application (core, pallas, ops, kv, models,
engine, testing); nothing in the library imports jpa.tools.
"""

from jpa.tools.deviceless import TARGETS, Compiler, configure_environment, markdown, record_line, target_config
from jpa.tools.engine_checks import MODEL_SHAPES, check_engine, check_tp, engine_steps, step_program, tp_engine_steps
from jpa.tools.hlo import collective_summary, collectives, cross_host_problems, host_collectives, replica_groups
from jpa.tools.kernel_checks import (KernelConfig, check_kernels, check_ragged, check_stacked_kernels,
                                     check_stacked_ragged, kernel_call)
from jpa.tools.traffic import WEIGHTS_IN_PLACE, engine_traffic

__all__ = ["MODEL_SHAPES", "TARGETS", "WEIGHTS_IN_PLACE", "Compiler", "KernelConfig", "check_engine", "check_kernels",
           "check_ragged", "check_stacked_kernels", "check_stacked_ragged", "check_tp", "collective_summary",
           "collectives", "configure_environment", "cross_host_problems", "engine_steps", "engine_traffic",
           "host_collectives", "kernel_call", "markdown", "record_line", "replica_groups", "step_program",
           "target_config", "tp_engine_steps"]
