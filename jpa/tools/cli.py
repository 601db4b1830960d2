"""`jpa tools COMMAND [args]` (also `python -m jpa.tools COMMAND`): the deviceless GPU compile and traffic
tools and the mutation check, one entry point. Each command is a module of jpa.tools with `main(argv) -> int`
(its docstring is its manual: `jpa tools COMMAND --help`), imported only when run.

The compile and traffic commands compile for a GPU that is not here, on JAX's CPU backend: JAX_PLATFORMS=cpu
unless set, and `deviceless.configure_environment()` before XLA starts. They need the compile-only GPU
packages (`pip install -e ".[gpu]"`; `./run setup` installs them).
"""

import importlib
import os
import sys

# command -> (module, deviceless, one line of help)
COMMANDS = {
    "compile": ("jpa.tools.compile_check", True,
                "compile the kernels and the engine's steps for a GPU that is not here (--target h100, a100, ...)"),
    "compile-offload": ("jpa.tools.offload_check", True, "KV offload's programs compiled for an H100: host copies"),
    "compile-sinks": ("jpa.tools.sinks_check", True, "the decode and ragged kernels with attention sinks vs twins"),
    "compile-hopper-mma": ("jpa.tools.hopper_mma_check", True, "the shapes auto routes to mma.sync on Hopper"),
    "traffic": ("jpa.tools.traffic_report", True, "bytes one decode step of the engine moves on an H100/A100"),
    "traffic-moe": ("jpa.tools.moe_traffic", True, "the same for a mixture of experts (Qwen3-30B-A3B, gpt-oss)"),
    "traffic-hybrid": ("jpa.tools.hybrid_traffic", True,
                       "the same for a hybrid's decode step (Qwen3.5-27B's shapes: Gated DeltaNet states)"),
    "traffic-lora": ("jpa.tools.lora_traffic", True,
                     "the engine step's bytes with LoRA adapters against the ideal (each active adapter read once)"),
    "mutation": ("jpa.tools.mutation", False, "deliberate faults in the engine that the tests must catch"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {text}" for name, (_, _, text) in COMMANDS.items()]
    return ("usage: jpa tools COMMAND [args]   (jpa tools COMMAND --help for its flags)\n\ncommands:\n"
            + "\n".join(lines))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        print(f"jpa tools: error: unknown command {argv[0]!r}\n{usage()}", file=sys.stderr)
        return 2
    module, deviceless, _ = COMMANDS[argv[0]]
    import jax

    if deviceless:
        from jpa.tools.deviceless import configure_environment

        if "JAX_PLATFORMS" not in os.environ:   # jax is imported (jpa imports it): set its option too
            jax.config.update("jax_platforms", "cpu")
        configure_environment()   # sets JAX_PLATFORMS=cpu unless set
    else:
        from jpa.core.platform import cpu_without_gpu

        cpu_without_gpu()   # no NVIDIA driver, JAX_PLATFORMS unset: JAX on the CPU (as ./run does)
    sys.argv[0] = f"jpa tools {argv[0]}"   # argparse's prog in each command's usage line
    return importlib.import_module(module).main(argv[1:])
