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
