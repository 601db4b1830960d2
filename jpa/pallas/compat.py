"""The Pallas calls that differ between the JAX versions jpa supports (0.11.2 to 0.12.x).

Everything version-specific goes through here, so a kernel file reads the same on every
supported JAX. Differences found so far:

- `plgpu.InterpretGPUParams(on_race=...)` (what the GPU interpreter's race detector does on a
  race: "raise" makes it an exception) exists from JAX 0.12; 0.11.2 has `detect_races` only.
"""

import inspect

import jax
from jax.experimental.pallas import mosaic_gpu as plgpu

JAX_VERSION = tuple(int(x) for x in jax.__version__.split(".")[:3] if x.isdigit())

# Whether the GPU interpreter can raise on a race (InterpretGPUParams's `on_race` keyword).
RAISE_ON_RACE = "on_race" in inspect.signature(plgpu.InterpretGPUParams).parameters
RAISE_ON_RACE_MISSING = (f"JAX {jax.__version__} has no InterpretGPUParams(on_race=...): its race "
                         f"detector cannot raise on a race (JAX >= 0.12 can)")


def gpu_interpret_params(*, detect_races: bool = False, raise_on_race: bool = False):
    """`plgpu.InterpretGPUParams` for Mosaic GPU interpret mode.

    Args:
      detect_races: track happens-before of every SMEM/GMEM access, TMA and barrier.
      raise_on_race: make a detected race an exception (needs JAX >= 0.12; see RAISE_ON_RACE).

    Raises:
      NotImplementedError: raise_on_race on a JAX without `on_race` (RAISE_ON_RACE_MISSING).
    """
    if raise_on_race:
        if not RAISE_ON_RACE:
            raise NotImplementedError(RAISE_ON_RACE_MISSING)
        return plgpu.InterpretGPUParams(detect_races=True, on_race="raise")
    return plgpu.InterpretGPUParams(detect_races=detect_races)
