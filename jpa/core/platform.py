"""The JAX platform of a process on a machine without an NVIDIA GPU.

With the compile-only GPU packages installed (the `gpu` extra: JAX's CUDA plugin, for deviceless
compiles) and no NVIDIA driver, JAX tries to start a CUDA backend at its first device query and
prints the plugin's traceback ("Unable to load cuDNN") before it falls back to the CPU. `./run`
sets JAX_PLATFORMS=cpu on such a machine; scripts call `cpu_without_gpu()` at their top to do the
same.
"""

import os
import shutil
import sys


def has_nvidia_driver() -> bool:
    """Whether this machine has an NVIDIA driver: `nvidia-smi` on the PATH or a /dev/nvidia0 device."""
    return shutil.which("nvidia-smi") is not None or os.path.exists("/dev/nvidia0")


def cpu_without_gpu() -> bool:
    """Runs JAX on the CPU where there is no NVIDIA driver and JAX_PLATFORMS is unset (or empty):
    sets JAX_PLATFORMS=cpu, and JAX's `jax_platforms` option when jax is already imported (JAX
    reads the variable at import). Changes nothing where a driver is or JAX_PLATFORMS is set.
    Call it before JAX starts a backend (its first device query, array or jit call): the top of
    a script. Returns whether it chose the CPU."""
    if os.environ.get("JAX_PLATFORMS") or has_nvidia_driver():
        return False
    os.environ["JAX_PLATFORMS"] = "cpu"
    jax = sys.modules.get("jax")
    if jax is not None:
        jax.config.update("jax_platforms", "cpu")
    return True
