"""What `pip install jpa` gives a user: the wheel holds the package (models/ as jpa.models, no
top-level `models`), the `jpa` console script, and `python -m jpa` runs the commands."""

import pathlib
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).parents[1]


def test_the_wheel_installs_models_as_jpa_models_and_the_jpa_command(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    (wheel,) = tmp_path.glob("jpa-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"jpa"}, top   # no top-level `models`
    for src in (ROOT / "models").rglob("*.py"):   # every model file, under jpa/models/
        assert f"jpa/models/{src.relative_to(ROOT / 'models').as_posix()}" in names, src
    for src in (ROOT / "jpa").rglob("*.py"):      # every package file (no folder forgotten in pyproject)
        assert src.relative_to(ROOT).as_posix() in names, src
    entry = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "jpa = jpa.cli.main:main" in entry


@pytest.mark.bench
def test_python_m_jpa_lists_and_runs_the_commands(tmp_path):
    run = lambda *a: subprocess.run([sys.executable, "-m", "jpa", *a], capture_output=True, text=True, timeout=120,
                                    cwd=tmp_path, env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    r = run("--help")
    assert r.returncode == 0 and all(c in r.stdout for c in ("generate", "serve", "serve-dp")), r.stderr
    r = run("serve", "--help")
    assert r.returncode == 0 and "--max-num-batched-tokens" in r.stdout and "--api-key" in r.stdout
    r = run("nonsense")
    assert r.returncode == 2 and "unknown command 'nonsense'" in r.stderr
    # outside the repository nothing named `models` is importable: only jpa.models
    r = subprocess.run([sys.executable, "-c", "import jpa.models, importlib.util, sys; "
                        "sys.exit(importlib.util.find_spec('models') is not None)"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120, env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
