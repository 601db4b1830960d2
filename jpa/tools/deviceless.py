"""Compiling for a GPU that is not here: target descriptions and the abstract-device compile.

XLA compiles for a GPU it does not have when given a target description (GpuTargetConfigProto):
`jax.experimental.topologies.get_topology_desc(..., target_config=...)` yields compile-only
devices, and `jax.jit(f).lower(<ShapeDtypeStructs on such a device>).compile()` runs XLA's whole
GPU pipeline: fusion, buffer assignment, Triton's compilation of Pallas Triton kernels, the CUDA
plugin's compilation of Mosaic GPU kernels (JAX >= 0.9.1 compiles the `mosaic_gpu` custom call to
a cubin when the executable is built, with no driver call), and ptxas on every kernel
(docs/architecture.md, "Compiling for a GPU that is not here").

`Compiler(target).compile(name, fn, args, ...)` does that for one function and returns a record
(a JSON-able dict): compiled or the error; each jpa kernel's grid, threads, shared memory,
registers and spills (`jpa.tools.hlo` reads them from XLA's thunk dump, ptxas's -v log and the
MOSAIC_GPU_DUMP_TO files); whether the page pools reach the kernels uncopied (no pool-shaped copy
in the optimized HLO, donated pools aliased, temporaries far below the pools). `record_line` and
`markdown` print records.

Needs the compile-only GPU packages (`pip install -e ".[gpu]"`: JAX's CUDA plugin and ptxas), and
XLA's logging set up by `configure_environment()` before XLA first logs (the `Compiler` calls it;
a script calls it first thing, before it imports JAX).
"""

import contextlib
import importlib.util
import os
import pathlib
import re
import sys
import tempfile
import time
import warnings

import jax
import numpy as np
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, SingleDeviceSharding

from jpa.tools.hlo import (MOSAIC_CALL, TRITON_CALL, hlo_type, parse_ptxas, parse_thunks, pool_copies,
                           read_mosaic_dump)


def configure_environment() -> bool:
    """Sets the environment a deviceless compile needs; call it before JAX initializes XLA's
    backends (importing JAX is fine; `jax.devices()` or a first computation is too late).

    - XLA's INFO-level log on, with ptxas's -v report in it (`subprocess_compilation=3`): the
      compile reads registers and spills from stderr. The level is set outright: a parent process
      (e.g. pytest after importing JAX's CUDA plugin) may hand down TF_CPP_MIN_LOG_LEVEL=1, and then
      no Triton kernel would have a register or spill reading.
    - The ptxas of the `gpu` extra (CUDA 12, matching the plugin) even when another CUDA toolkit's
      ptxas is on PATH, so results do not depend on what the machine happens to have.
    - JAX_PLATFORMS=cpu unless set (JAX reads it at import: a script sets it before importing jpa).

    Returns whether the log settings changed (they were not yet in place).
    """
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    want = {"TF_CPP_MIN_LOG_LEVEL": "0", "TF_CPP_VMODULE": "subprocess_compilation=3"}
    changed = any(os.environ.get(k) != v for k, v in want.items())
    os.environ.update(want)
    spec = _find_spec("nvidia.cuda_nvcc")
    flags = os.environ.get("XLA_FLAGS", "")
    if spec is not None and spec.submodule_search_locations and "xla_gpu_cuda_data_dir" not in flags:
        root = list(spec.submodule_search_locations)[0]
        os.environ["XLA_FLAGS"] = f"{flags} --xla_gpu_cuda_data_dir={root}".strip()
    return changed


def _find_spec(name: str):
    """`importlib.util.find_spec`, None also where a parent package is absent (find_spec raises
    ModuleNotFoundError for "nvidia.cuda_nvcc" when no `nvidia` package is installed)."""
    try:
        return importlib.util.find_spec(name)
    except ModuleNotFoundError:
        return None


def missing_packages() -> str | None:
    """Why a deviceless compile cannot run here (the `gpu` extra, or part of it, not installed),
    or None: JAX's CUDA plugin and the CUDA 12 ptxas must both be importable."""
    missing = [name for name in ("jax_plugins.xla_cuda12", "nvidia.cuda_nvcc") if _find_spec(name) is None]
    if missing:
        return (f"the compile-only GPU packages are not installed ({', '.join(missing)} missing: "
                f"pip install -e '.[gpu]', with jax-cuda12-plugin/-pjrt of the installed JAX's version)")
    return plugin_mismatch()


def plugin_mismatch() -> str | None:
    """Why JAX will not load the installed CUDA plugin, or None: JAX loads a plugin only when its version
    equals jaxlib's (`jaxlib.plugin_support`: "not compatible with the installed jaxlib version ... so it
    will not be used"), and every deviceless compile then fails inside XLA."""
    from importlib import metadata

    try:
        plugin, jaxlib = metadata.version("jax-cuda12-plugin"), metadata.version("jaxlib")
    except metadata.PackageNotFoundError:
        return None
    if _release(plugin) == _release(jaxlib):
        return None
    return (f"jax-cuda12-plugin {plugin} does not match jaxlib {jaxlib}, so JAX will not load it: install the "
            f"plugin and jax-cuda12-pjrt of jaxlib's version (pip install 'jax-cuda12-plugin=={jaxlib}' "
            f"'jax-cuda12-pjrt=={jaxlib}'), or jax / jaxlib of the plugin's")


def _release(version: str) -> tuple:
    """The dotted numeric prefix of a version string, as jaxlib.plugin_support compares them."""
    import re

    return tuple(int(p) for p in re.match(r"[0-9]+(?:\.[0-9]+)*", version).group(0).split("."))


def _xla_started() -> bool:
    """Whether JAX has initialized XLA's backends in this process (then XLA has read its log
    settings, and those of `configure_environment` come too late)."""
    try:
        from jax._src import xla_bridge  # private: JAX 0.12 has no public "backends initialized?"
        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):
        return False


# ---- Targets: values of XLA's xla/backends/gpu/target_config/specs (docs/architecture.md lists the fields) ----

_COMMON = dict(threads_per_block_limit=1024, threads_per_warp=32, shared_memory_per_block=49152,
               threads_per_core_limit=2048, block_dim_limit_x=2147483647, block_dim_limit_y=65535,
               block_dim_limit_z=65535, registers_per_core_limit=65536, registers_per_block_limit=65536)
TARGETS = {
    "h100": dict(kind="NVIDIA H100 80GB HBM3", cc=(9, 0), core_count=132, fpus_per_core=128,
                 shared_memory_per_core=233472, shared_memory_per_block_optin=232448,
                 memory_bandwidth=3352320000000, l2_cache_size=52428800, clock_rate_ghz=1.98,
                 device_memory_size=84929347584),
    "a100": dict(kind="NVIDIA A100-SXM4-80GB", cc=(8, 0), core_count=108, fpus_per_core=64,
                 shared_memory_per_core=167936, shared_memory_per_block_optin=166912,
                 memory_bandwidth=2039040000000, l2_cache_size=41943040, clock_rate_ghz=1.41,
                 device_memory_size=85100068864),
    # XLA's a6000.txtpb (sm_86: A10 / A40 / RTX A6000 / RTX 30xx share its 99 KiB SMEM per block).
    "a6000": dict(kind="NVIDIA RTX A6000", cc=(8, 6), core_count=84, fpus_per_core=128,
                  threads_per_core_limit=1536, shared_memory_per_core=102400,
                  shared_memory_per_block_optin=101376, memory_bandwidth=768096000000,
                  l2_cache_size=6291456, clock_rate_ghz=1.8, device_memory_size=51041271808),
    # sm_89: XLA ships no Ada spec; NVIDIA L4's datasheet values (58 SMs, 300 GB/s, 48 MiB L2,
    # 24 GB) with Ada's SMEM and thread limits (as sm_86's).
    "l4": dict(kind="NVIDIA L4", cc=(8, 9), core_count=58, fpus_per_core=128,
               threads_per_core_limit=1536, shared_memory_per_core=102400,
               shared_memory_per_block_optin=101376, memory_bandwidth=300000000000,
               l2_cache_size=50331648, clock_rate_ghz=2.04, device_memory_size=24152899584),
    # XLA's rtx6000pro.txtpb (sm_120: RTX PRO 6000 Blackwell; RTX 50xx share the arch).
    "rtx6000pro": dict(kind="NVIDIA RTX PRO 6000 Blackwell", cc=(12, 0), core_count=188,
                       fpus_per_core=128, threads_per_core_limit=1536, shared_memory_per_core=131072,
                       shared_memory_per_block_optin=101376, memory_bandwidth=1792000000000,
                       l2_cache_size=134217728, clock_rate_ghz=2.6, device_memory_size=103079215104,
                       # XLA's spec says NONE; Mosaic GPU emits sm_120a PTX (arch-specific features
                       # from sm_90 on), which ptxas builds only for sm_120a.
                       feature_extension="ACCELERATED_FEATURES"),
    # XLA's b200.txtpb (sm_100a).
    "b200": dict(kind="NVIDIA B200", cc=(10, 0), core_count=148, fpus_per_core=128,
                 shared_memory_per_core=233472, shared_memory_per_block_optin=232448,
                 memory_bandwidth=7672320000000, l2_cache_size=132644864, clock_rate_ghz=1.965,
                 device_memory_size=191514411008),
}


@contextlib.contextmanager
def mosaic_arch(cc):
    """Mosaic GPU lowers for the GPU it infers from the local device, or from the abstract device
    of an AOT compile, which carries no compute capability: then it assumes sm_90 whatever the
    target (an sm_80 compile of such code aborts in LLVM on `nvvm.elect.sync`). This sets the
    arch Mosaic lowers for to the target's for the duration. JAX 0.12 has no public override:
    it replaces the private `jax.experimental.mosaic.gpu.utils._infer_arch` (restored after)."""
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    saved = mgpu_utils._infer_arch
    mgpu_utils._infer_arch = lambda: tuple(cc)
    try:
        yield
    finally:
        mgpu_utils._infer_arch = saved


def ptx_target(target: str) -> str:
    """The `.target` a kernel's PTX must name for `target`, e.g. "sm_80" (sm_90a / sm_100a: the
    arch-specific feature sets Mosaic uses from Hopper on)."""
    major, minor = TARGETS[target]["cc"]
    return f"sm_{major}{minor}" + ("a" if major >= 9 else "")
def compute_capability(target: str) -> float:
    """The target's CUDA compute capability as the dispatch takes it, e.g. 9.0 for "h100"."""
    return float(".".join(map(str, TARGETS[target]["cc"])))


def target_config(name: str) -> str:
    """The GpuTargetConfigProto text of a target."""
    t = {**_COMMON, **TARGETS[name]}
    fields = "\n".join(f"  {k}: {v}" for k, v in t.items() if k not in ("kind", "cc", "feature_extension"))
    major, minor = t["cc"]
    ext = f" feature_extension: {t['feature_extension']}" if "feature_extension" in t else ""
    return (f"gpu_device_info {{\n{fields}\n  cuda_compute_capability {{ major: {major} minor: {minor}{ext} }}\n}}\n"
            f'platform_name: "CUDA"\ndnn_version_info {{ major: 9 minor: 7 }}\n'
            f'runtime_version {{ major: 12 minor: 8 }}\ndevice_description_str: "{t["kind"]}"\n')


# ---- Compiling for a target ----

@contextlib.contextmanager
def captured_stderr():
    """Captures the process's fd 2 (XLA's C++ log, where ptxas -v is reported) into a list."""
    sys.stderr.flush()
    saved = os.dup(2)
    out = []
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield out
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            out.append(tmp.read().decode(errors="replace"))


MOSAIC_DUMP_ENV = "MOSAIC_GPU_DUMP_TO"


@contextlib.contextmanager
def mosaic_dump(dump_dir):
    """Sets MOSAIC_GPU_DUMP_TO=dump_dir for the duration, restoring the previous value after.

    Mosaic GPU kernels are `mosaic_gpu` custom calls, compiled to a cubin by the CUDA plugin when
    XLA builds the executable (JAX >= 0.9.1; no driver call, so this works deviceless). The
    lowering reads this variable and records it in each kernel's module: the lowering writes
    `<kernel>_<n>.resources.txt` (SMEM scratch), the compile `<kernel>_<n>.ptx` and `.ptxas` (ptxas
    -v: registers, spill bytes). A kernel module already compiled in this process is taken from
    the plugin's cache and leaves no `.ptxas` the second time.
    """
    old = os.environ.get(MOSAIC_DUMP_ENV)
    os.environ[MOSAIC_DUMP_ENV] = str(dump_dir)
    try:
        yield pathlib.Path(dump_dir)
    finally:
        if old is None:
            os.environ.pop(MOSAIC_DUMP_ENV, None)
        else:
            os.environ[MOSAIC_DUMP_ENV] = old


class Compiler:
    """Compiles jitted functions for one deviceless target and inspects the result.

    num_devices > 1 gives that many compile-only GPUs of the target and `tp_mesh`, a "tp" mesh
    over them, for tensor-parallel programs: arguments that carry a NamedSharding on it keep it.
    hosts spreads them over that many hosts of num_devices // hosts GPUs each.

    The CUDA plugin's topology string is "<slices>x<hosts per slice>x<devices per host>", a slice
    being one NVLink domain (XLA's GpuTopologyProto). One host is "1x1xN" (one DGX/HGX box);
    H hosts are "Hx1x(N/H)": H NVLink domains of one host each, joined by the inter-host network
    (InfiniBand/Ethernet), as H HGX boxes are. ("1xHx(N/H)" would be one NVLink domain spanning
    H hosts, a multi-node NVLink rack.) Each compile-only device's `process_index` is its host:
    devices [h*G, (h+1)*G) are host h's, and the tp mesh takes them in that order.
    """

    def __init__(self, target: str, num_devices: int = 1, hosts: int = 1):
        from jax.experimental import topologies
        if configure_environment() and _xla_started():
            warnings.warn("XLA started before jpa.tools.deviceless.configure_environment(): ptxas's report is "
                          "not in its log, so records will lack registers and spills. Call it before JAX's "
                          "first computation (`jpa tools compile` does).", RuntimeWarning, stacklevel=2)
        t = TARGETS[target]
        if hosts < 1 or num_devices % hosts:
            raise ValueError(f"num_devices ({num_devices}) must be a multiple of hosts ({hosts})")
        self.target = target
        self.ptxas = None  # version and path, once XLA reports it
        self.hosts = hosts
        self.topology = f"{hosts}x1x{num_devices // hosts}"
        topo = topologies.get_topology_desc("jpa", "cuda", target_config=target_config(target),
                                            topology=self.topology)
        self.devices = topo.devices
        found = sorted({d.process_index for d in self.devices})
        if len(self.devices) != num_devices or found != list(range(hosts)):
            raise RuntimeError(f"topology {self.topology} gave {len(self.devices)} devices on hosts {found}; "
                               f"expected {num_devices} on {hosts}")
        self.device = topo.devices[0]
        self.sharding = SingleDeviceSharding(self.device)
        abstract = AbstractDevice(device_kind=self.device.device_kind, num_cores=t["core_count"], platform="cuda")
        self.mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=abstract)
        self.tp_mesh = None
        if num_devices > 1:
            from jpa.core.sharding import tp_mesh
            self.tp_mesh = tp_mesh(num_devices, self.devices)
            # shard_map inside the program must see the context mesh it was given; the concrete
            # mesh of compile-only devices knows their kind, which is what dispatch reads.
            self.mesh = self.tp_mesh.abstract_mesh

    def place(self, tree):
        """ShapeDtypeStructs (or arrays) -> ShapeDtypeStructs on the target device (or, when they
        carry a NamedSharding on the compiler's tp mesh, on that)."""
        def one(a):
            sh = getattr(a, "sharding", None)
            if self.tp_mesh is not None and getattr(sh, "mesh", None) is self.tp_mesh:
                return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh)
            return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=self.sharding)
        return jax.tree_util.tree_map(one, tree)

    def compile(self, name, fn, args, *, donate_argnums=(), pool_shapes=(), kwargs=None, keep_hlo=False,
                jit_options=None, compiler_options=None) -> dict:
        """Compiles fn(*args) for the target. pool_shapes: [(shape, dtype)] of the page pools as one
        device holds them (its shard under a tp mesh). jit_options: jax.jit options instead of
        donate_argnums (e.g. a runner's `jit_options`, with output shardings)."""
        rec = dict(name=name, target=self.target, ok=False)
        pool_types = {hlo_type(s, d) for s, d in pool_shapes}
        pool_bytes = sum(int(np.prod(s)) * np.dtype(d).itemsize for s, d in pool_shapes)
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as dump, warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # Pallas Triton's deprecation notice
            warnings.simplefilter("ignore", UserWarning)  # dispatch's "compiling for an absent GPU"
            mdump = pathlib.Path(dump) / "mosaic"
            mdump.mkdir()
            try:
                with captured_stderr() as log, mosaic_dump(mdump), mosaic_arch(TARGETS[self.target]["cc"]):
                    with jax.sharding.use_abstract_mesh(self.mesh):
                        opts = jit_options or dict(donate_argnums=donate_argnums)
                        lowered = jax.jit(fn, **opts).lower(
                            *self.place(args), **self.place(kwargs or {}))
                    rec["lower_seconds"] = round(time.perf_counter() - t0, 2)  # trace + lower
                    compiled = lowered.compile({**(compiler_options or {}), "xla_dump_to": dump})
            except Exception as e:  # the point of the tier: report, never crash
                text = str(e).strip()
                rec.update(error=f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"[:500],
                           seconds=round(time.perf_counter() - t0, 2))
                return rec
            kernels = parse_thunks(pathlib.Path(dump))
            mosaic_kernels = read_mosaic_dump(mdump)
        ptx = parse_ptxas(log[0])
        m = re.search(r"Using (\S*ptxas) with version ([\d.]+)", log[0])
        if m:
            self.ptxas = f"{m.group(2)} ({m.group(1)})"
        for kname, info in kernels.items():
            info.update(ptx.get(kname, {}))
        for kname, info in mosaic_kernels.items():  # opaque to XLA's thunk dump: no grid there
            kernels[kname] = dict(grid=None, **info)
        hlo = compiled.as_text()
        mem = compiled.memory_analysis()
        copies = pool_copies(hlo, pool_types)
        rec.update(
            seconds=round(time.perf_counter() - t0, 2),
            triton_calls=hlo.count(TRITON_CALL), mosaic_calls=hlo.count(MOSAIC_CALL),
            # Pallas kernels only: XLA's own fusions are kernels too, named after their fusion.
            kernels={k: v for k, v in kernels.items() if k.startswith("jpa_")},
            xla_kernels=len([k for k in kernels if not k.startswith("jpa_")]),
            pool_bytes=pool_bytes, pool_copies=copies,
            argument_bytes=mem.argument_size_in_bytes, output_bytes=mem.output_size_in_bytes,
            alias_bytes=mem.alias_size_in_bytes, temp_bytes=mem.temp_size_in_bytes)
        problems = []
        if copies:
            problems.append(f"{len(copies)} copies/slices of a page pool: {copies[0]}")
        # A copy of the pools would need temporaries of their size. Below 256 MiB of pools the
        # call's own buffers (q, outputs, split-K partials) are comparable, and the HLO scan above
        # is the check.
        if pool_bytes >= 2 ** 28 and mem.temp_size_in_bytes > pool_bytes // 4:
            problems.append(f"temporaries ({mem.temp_size_in_bytes} bytes) are not far below the pools "
                            f"({pool_bytes} bytes)")
        donated = donate_argnums or (jit_options or {}).get("donate_argnums")
        if pool_bytes and donated and mem.alias_size_in_bytes < pool_bytes:
            problems.append(f"donated pools not aliased: {mem.alias_size_in_bytes} of {pool_bytes} bytes")
        spills = {k: v["spill_stores"] for k, v in rec["kernels"].items() if v.get("spill_stores")}
        if spills:
            # A jpa kernel that spills is a failure: every configuration an unsupported_reason
            # accepts must compile without spills (re-tile it or refuse it there).
            rec["spills"] = spills
            problems.append("ptxas spills registers: " + ", ".join(f"{k} {v} B" for k, v in spills.items()))
        want_ptx = ptx_target(self.target)
        wrong = {k: v["ptx_targets"] for k, v in mosaic_kernels.items()
                 if any(t != want_ptx for t in v.get("ptx_targets", ()))}
        if wrong:
            # A Mosaic kernel lowered for another GPU (e.g. sm_90a code in an A100 executable)
            # would not load on the target.
            problems.append(f"Mosaic PTX for the wrong GPU (want {want_ptx}): {wrong}")
        unreported = [k for k, v in mosaic_kernels.items() if v["ptxas_reports"] == 0]
        if unreported:
            # Compiled earlier in this process (the plugin's cache): no new ptxas report.
            rec["mosaic_ptxas_cached"] = unreported
        rec["problems"] = problems
        rec["ok"] = not problems
        if keep_hlo:
            rec["hlo"] = hlo
        return rec


# ---- Printing records ----

def record_line(rec) -> str:
    """One line of a record for a log: ok or FAIL, its kernels' resources, its memory."""
    if "error" in rec:
        return f"FAIL  {rec['name']}: {rec['error']}"
    if not rec["ok"]:
        return f"FAIL  {rec['name']}: {'; '.join(rec['problems'])}"
    ks = "; ".join(f"{k}" + (f" grid {v['grid']}" if v.get("grid") else "")
                   + f" smem {v.get('shared_memory', '?')} regs {v.get('registers', '?')}"
                   + (f" SPILLS {v['spill_stores']}B" if v.get("spill_stores") else "")
                   for k, v in rec.get("kernels", {}).items())
    return (f"ok    {rec['name']} [{rec['seconds']}s] {ks} | temp {rec['temp_bytes']} alias {rec['alias_bytes']}"
            f" pools {rec['pool_bytes']}")


def markdown(reports) -> str:
    """A BENCHMARKS.md table of compiled records: config, kernel, grid, threads, SMEM, registers."""
    lines = ["| target | config | kernel | grid | threads | SMEM (bytes) | registers | spills |",
             "|---|---|---|---|---|---|---|---|"]
    for rep in reports:
        for r in rep["records"]:
            if "refused" in r or not r["ok"]:
                continue
            for k, v in r.get("kernels", {}).items():
                threads = v.get("threads") or ["?"]
                lines.append(f"| {r['target']} | {r['name']} | {k} | {v.get('grid') or '-'} | {threads[0]} | "
                             f"{v.get('shared_memory', '?')} | {v.get('registers', '?')} | "
                             f"{v.get('spill_stores', '?')} |")
    return "\n".join(lines) + "\n"
