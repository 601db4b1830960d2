"""What every benchmark script shares: the machine description and writing its JSON result."""

import json
import os
import platform

import jax


def machine() -> dict:
    """The machine a figure was measured on (stored with every result)."""
    d = jax.devices()[0]
    return dict(platform=platform.platform(), processor=platform.processor() or platform.machine(),
                cpu_count=os.cpu_count(), jax_version=jax.__version__, device=f"{d.platform}:{d.device_kind}")


def write_json(path: str, obj, indent: int = 2) -> None:
    """Writes obj to path (creating its folder) and says so on stdout."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=indent)
    print(f"wrote {path}")
