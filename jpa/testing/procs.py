"""Processes in tests and benchmarks: a free loopback port, and an environment with JAX on the CPU."""

import os
import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 free at the time of asking."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_env(devices: int = 1) -> dict:
    """This environment with JAX on the CPU and `devices` simulated devices (for child processes)."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "force_host_platform_device_count" not in f]
    return {**os.environ, "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])}


def fast_compile_env(env: dict | None = None) -> dict:
    """env (default: this environment) for a test's child process that compiles CPU programs only (a
    server, a CLI run, simulated-device runs): XLA's CPU backend at optimization level 0, as
    tests/conftest.py compiles the test process's own CPU programs (the HLO passes unchanged, the
    machine code of each CPU kernel less optimized; the inputs are tiny and compiling is most of the
    time). Not for a child that compiles for a GPU (its registers and spills are what the GPU tests
    check) nor for a benchmark (its speed is what it measures)."""
    env = dict(os.environ if env is None else env)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_backend_optimization_level")]
    env["XLA_FLAGS"] = " ".join(flags + ["--xla_backend_optimization_level=0"])
    return env
