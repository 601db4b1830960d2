"""jpa.core.platform.cpu_without_gpu: JAX on the CPU where there is no NVIDIA driver (as ./run does),
nothing changed where there is one or JAX_PLATFORMS is set; every script that imports JAX calls it."""

import os
import pathlib
import re

import jax

from jpa.core import platform

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_cpu_without_gpu_only_without_a_driver_and_a_choice(monkeypatch):
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setattr(platform, "has_nvidia_driver", lambda: True)   # a GPU machine: nothing changes
    assert not platform.cpu_without_gpu() and "JAX_PLATFORMS" not in os.environ
    monkeypatch.setattr(platform, "has_nvidia_driver", lambda: False)
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")                        # the user's choice stands
    assert not platform.cpu_without_gpu() and os.environ["JAX_PLATFORMS"] == "cuda"
    monkeypatch.delenv("JAX_PLATFORMS")
    assert platform.cpu_without_gpu() and os.environ["JAX_PLATFORMS"] == "cpu"
    assert jax.config.jax_platforms == "cpu"   # jax was imported: its option is set too


def test_a_driver_is_nvidia_smi_or_dev_nvidia0(monkeypatch):
    for which, dev, want in [(None, False, False), ("/usr/bin/nvidia-smi", False, True), (None, True, True)]:
        monkeypatch.setattr(platform.shutil, "which", lambda name, which=which: which if name == "nvidia-smi" else None)
        monkeypatch.setattr(platform.os.path, "exists", lambda p, dev=dev: dev and p == "/dev/nvidia0")
        assert platform.has_nvidia_driver() is want


def test_every_script_that_imports_jax_chooses_its_platform():
    """A script importing jax, jpa or models (at any depth) calls cpu_without_gpu() or sets
    JAX_PLATFORMS in its own environment (the compile-only scripts: cpu always)."""
    missing = []
    for path in sorted([*(ROOT / "scripts").glob("*.py"), *(ROOT / "benchmarks").glob("*.py")]):
        src = path.read_text()
        imports_jax = re.search(r"^\s*(?:import|from) (?:jax|jpa|models)\b", src, re.M)
        chooses = (re.search(r"^\s*cpu_without_gpu\(\)", src, re.M)
                   or re.search(r"os\.environ(?:\.setdefault\(|\[)\"JAX_PLATFORMS\"", src))
        if imports_jax and not chooses:
            missing.append(path.name)
    assert not missing, f"scripts importing JAX without choosing a platform: {missing}"
