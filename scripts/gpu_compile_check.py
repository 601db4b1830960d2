"""Deviceless GPU compile tier: compile jpa's kernels and jitted steps for an H100 or A100 that is not here.

XLA compiles for a GPU it does not have when given a target description (GpuTargetConfigProto):
`jax.experimental.topologies.get_topology_desc(..., target_config=...)` yields compile-only
devices, and `jax.jit(f).lower(<ShapeDtypeStructs on such a device>).compile()` runs XLA's whole
GPU pipeline: fusion, buffer assignment, Triton's compilation of Pallas Triton kernels, the
CUDA plugin's compilation of Mosaic GPU kernels (JAX >= 0.9.1 compiles the `mosaic_gpu` custom
call to a cubin when the executable is built, with no driver call), and ptxas on every kernel.
This script does that for

1. every decode-kernel configuration of a covering grid that the kernel's `unsupported_reason`
   accepts for the target (page sizes 8-256, head dims 64-256, q_per_kv 1-16, 16-bit, int8 and
   fp8 caches, every option, split-K on and off);
2. the ragged kernels (`jpa.ragged_paged_attention`) at a serving size: five dtype/shape configs
   ("fast"), plus every head dim with a 16-bit, int8, fp8 and float32 cache ("full");
   after each of 1. and 2. (or alone: `--only stacked`), stacked page pools: the kernels called
   in a loop over layers on ONE [L, K, P, S_p, H] pool per K/V (carried and written each layer,
   donated) with the loop index as the layer, as the layer-scanned model calls them: one ragged
   config of 40 layers, 5 GiB per pool ("fast"), plus decode and ragged configs of 4-32 layers
   ("full"), each next to the registers of its per-layer twin;
3. the engine's jitted decode loop and a prefill call for SmolLM2-135M in bfloat16 with a pool
   of >= 1 GiB, attention chosen by `impl="auto"` for the target.

For each it reports: compiled or the error; each kernel's grid, threads and shared memory and
registers and spills: Triton kernels from XLA's thunk sequence and ptxas -v in XLA's log, Mosaic
GPU kernels from the files each leaves in MOSAIC_GPU_DUMP_TO (set per compile: `.ptxas`, ptxas
-v; `.resources.txt`, the SMEM scratch; `.ptx`, the threads); whether the page pools reach the
kernels uncopied (no copy/slice of a pool-shaped array in the optimized HLO; donated pools aliased
to outputs; temporaries far below the pool size). A jpa kernel that spills registers fails its
record. It exits non-zero on any failure.

Not covered here (needs a GPU): numerics and speed of compiled code (`scripts/gpu_validate.py`);
Mosaic GPU for an A100 (scripts/mosaic_ampere_spike.py: jpa's Mosaic kernels are Hopper-only).

Needs the compile-only GPU packages: `pip install -e ".[gpu]"` (./run test installs them).

    python scripts/gpu_compile_check.py --target h100 [--subset fast|full] [--json PATH]
    python scripts/gpu_compile_check.py --target h100 --only stacked [--subset fast|full]
    python scripts/gpu_compile_check.py --target h100 --only tp --tp 8   # 3. below
    python scripts/gpu_compile_check.py --target h100 --only tp --tp 16 --hosts 2 --model llama3-70b \
        --pool-gib 56 --max-seqs 128 --max-model-len 8192

3. (`--only tp`) tensor parallelism: the engine's unified step of a Llama-shaped model
   (`--model`: Llama-3-8B's or -70B's shapes, random abstract weights, bf16) sharded over N
   compile-only GPUs: collectives per step and per layer (exactly two row-parallel all-reduces per
   layer and model pass, nothing with a head axis or a pool dimension moved), the kernels once per
   layer body on every device, the donated pool shards aliased, per-device memory within the
   GPU's. With `--hosts H` the GPUs are spread over H hosts (topology "Hx1x(N/H)") and every
   collective is classified by the hosts its replica groups span: in a layer only the
   row-parallel all-reduces may cross hosts, outside the layers only the embedding lookup's and
   sampling's fixed few per step.
"""

import os

# Before JAX loads XLA: CPU as the runtime platform, and ptxas's -v report in XLA's log (read
# from stderr during each compile for registers and spills).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# ptxas -v reaches us only through XLA's INFO-level log: set the level outright (a parent process,
# e.g. pytest after importing JAX's CUDA plugin, may hand down TF_CPP_MIN_LOG_LEVEL=1, and then no
# Triton kernel would have a register or spill reading).
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "0"
os.environ["TF_CPP_VMODULE"] = "subprocess_compilation=3"


def _pin_ptxas():
    """Uses the ptxas of the `gpu` extra (CUDA 12, matching the plugin) even when another CUDA
    toolkit's ptxas is on PATH, so results do not depend on what the machine happens to have."""
    import importlib.util
    spec = importlib.util.find_spec("nvidia.cuda_nvcc")
    flags = os.environ.get("XLA_FLAGS", "")
    if spec is not None and spec.submodule_search_locations and "xla_gpu_cuda_data_dir" not in flags:
        root = list(spec.submodule_search_locations)[0]
        os.environ["XLA_FLAGS"] = f"{flags} --xla_gpu_cuda_data_dir={root}".strip()


_pin_ptxas()

import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, SingleDeviceSharding  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from jpa import dispatch  # noqa: E402
from jpa.pallas.spec import DecodeSpec  # noqa: E402

# ---- Targets: values of XLA's xla/backends/gpu/target_config/specs (see shared/design.md) ----
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
}
TRITON_CALL = 'custom_call_target="__gpu$xla.gpu.triton"'
MOSAIC_CALL = 'custom_call_target="mosaic_gpu'
# Ops that, producing a pool-shaped array, mean the pool was copied or re-laid-out.
COPY_OPS = ("copy", "copy-start", "slice", "dynamic-slice", "transpose", "concatenate", "pad",
            "gather", "reverse")


def target_config(name: str) -> str:
    """The GpuTargetConfigProto text of a target."""
    t = {**_COMMON, **TARGETS[name]}
    fields = "\n".join(f"  {k}: {v}" for k, v in t.items() if k not in ("kind", "cc"))
    major, minor = t["cc"]
    return (f"gpu_device_info {{\n{fields}\n  cuda_compute_capability {{ major: {major} minor: {minor} }}\n}}\n"
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


def parse_thunks(dump_dir: pathlib.Path) -> dict:
    """{kernel name: {grid, threads, shared_memory}} from XLA's thunk sequence dump."""
    kernels = {}
    for f in dump_dir.glob("*thunk_sequence.txt"):
        for m in re.finditer(r"kCustomKernel.*?\]\s+(\S+) grid: \[([\d, ]+)\] threads: \[([\d, ]+)\]\s+"
                             r"shared_memory: (\d+) bytes", f.read_text()):
            kernels[m.group(1)] = dict(grid=[int(x) for x in m.group(2).split(",")],
                                       threads=[int(x) for x in m.group(3).split(",")],
                                       shared_memory=int(m.group(4)))
    return kernels


def parse_ptxas(log: str) -> dict:
    """{kernel name: {registers, spill_stores, spill_loads, stack}} from ptxas -v output."""
    out = {}
    for m in re.finditer(r"Function properties for (\S+)\s+(\d+) bytes stack frame, (\d+) bytes spill stores, "
                         r"(\d+) bytes spill loads\s+ptxas info\s+: Used (\d+) registers", log):
        out[m.group(1)] = dict(stack=int(m.group(2)), spill_stores=int(m.group(3)),
                               spill_loads=int(m.group(4)), registers=int(m.group(5)))
    return out


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


def read_mosaic_dump(dump_dir) -> dict:
    """{kernel name: {registers, spill_stores, spill_loads, stack, shared_memory, threads, modules,
    ptxas_reports}} from a MOSAIC_GPU_DUMP_TO directory; several modules of one kernel name (e.g.
    one per layer) report their worst registers and spills. A generic hook: any section that
    compiles Mosaic kernels under `mosaic_dump` can call it.

    Files are `<kernel>_<n>.<ext>`, but the lowering (`.resources.txt`) and the compile (`.ptx`,
    `.ptxas`) number modules with separate counters, so they are matched by kernel name only."""
    dump_dir = pathlib.Path(dump_dir)
    out = {}

    def entry(path, ext):
        name = re.sub(r"_\d+$", "", path.name[: -len(ext)])
        return out.setdefault(name, dict(modules=0, ptxas_reports=0))

    for res in sorted(dump_dir.glob("*.resources.txt")):
        k = entry(res, ".resources.txt")
        k["modules"] += 1
        m = re.search(r"smem_scratch_bytes=(\d+)", res.read_text())
        if m:
            k["shared_memory"] = max(k.get("shared_memory", 0), int(m.group(1)))
    for ptx in sorted(dump_dir.glob("*.ptx")):
        t = re.search(r"\.maxntid (\d+), (\d+), (\d+)", ptx.read_text())
        if t:
            entry(ptx, ".ptx")["threads"] = [int(x) for x in t.groups()]
    for rep in sorted(dump_dir.glob("*.ptxas")):
        k = entry(rep, ".ptxas")
        for info in parse_ptxas(rep.read_text()).values():
            k["ptxas_reports"] += 1
            for f in ("registers", "spill_stores", "spill_loads", "stack"):
                k[f] = max(k.get(f, 0), info[f])
    return out


def hlo_type(shape, dtype) -> str:
    names = {"bfloat16": "bf16", "float16": "f16", "float32": "f32", "int8": "s8",
             "float8_e4m3fn": "f8e4m3fn", "float8_e5m2": "f8e5m2", "int32": "s32"}
    return f"{names[np.dtype(dtype).name]}[{','.join(map(str, shape))}]"


def pool_copies(hlo: str, pool_types) -> list:
    """Instructions of the optimized HLO that produce a pool-shaped array by copying or slicing."""
    bad = []
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?[\w.-]+ = (\S+?)(?:\{[^}]*\})? ([\w-]+)\(", line)
        if m and m.group(1) in pool_types and m.group(2) in COPY_OPS:
            bad.append(line.strip()[:200])
        # A fusion that only copies is named for it by XLA.
        if m and m.group(1) in pool_types and m.group(2) == "fusion" and re.search(r"calls=%?(wrapped_)?copy", line):
            bad.append(line.strip()[:200])
    return bad


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
            from jpa.sharding import tp_mesh
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
                jit_options=None) -> dict:
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
                with captured_stderr() as log, mosaic_dump(mdump):
                    with jax.sharding.use_abstract_mesh(self.mesh):
                        opts = jit_options or dict(donate_argnums=donate_argnums)
                        lowered = jax.jit(fn, **opts).lower(
                            *self.place(args), **self.place(kwargs or {}))
                    rec["lower_seconds"] = round(time.perf_counter() - t0, 2)  # trace + lower
                    compiled = lowered.compile({"xla_dump_to": dump})
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
        unreported = [k for k, v in mosaic_kernels.items() if v["ptxas_reports"] == 0]
        if unreported:
            # Compiled earlier in this process (the plugin's cache): no new ptxas report.
            rec["mosaic_ptxas_cached"] = unreported
        rec["problems"] = problems
        rec["ok"] = not problems
        if keep_hlo:
            rec["hlo"] = hlo
        return rec


# ---- 1. Kernel configurations ----

@dataclasses.dataclass(frozen=True)
class KernelConfig:
    impl: str
    q_dtype: str = "bfloat16"
    cache_dtype: str = "bfloat16"
    page_size: int = 16
    head_dim: int = 128
    num_kv_heads: int = 8
    q_per_kv: int = 4
    soft_cap: bool = False
    alibi: bool = False
    sliding_window: bool = False
    split_k: bool = False   # long contexts and few sequences (several partitions per sequence)
    num_pages: int = 8192

    @property
    def num_seqs(self) -> int:
        return 4 if self.split_k else 64

    @property
    def pages_per_seq(self) -> int:
        return -(-(8192 if self.split_k else 512) // self.page_size)

    def spec(self) -> DecodeSpec:
        return DecodeSpec(self.q_dtype, self.cache_dtype, self.num_kv_heads * self.q_per_kv,
                          self.num_kv_heads, self.head_dim, self.page_size, self.pages_per_seq,
                          self.soft_cap, self.alibi, self.sliding_window,
                          self.cache_dtype in ("int8", "float8_e4m3fn", "float8_e5m2"),
                          self.num_seqs, self.num_pages)

    @property
    def name(self) -> str:
        opts = "+".join(o for o in ("soft_cap", "alibi", "sliding_window", "split_k") if getattr(self, o))
        return (f"{self.impl} q={self.q_dtype} kv={self.cache_dtype} ps={self.page_size} "
                f"hd={self.head_dim} G={self.q_per_kv}" + (f" {opts}" if opts else ""))


PAGE_SIZES = (8, 16, 32, 64, 128, 256)
HEAD_DIMS = (64, 80, 96, 128, 192, 256)
Q_PER_KV = (1, 2, 4, 8, 16)
DTYPES = (("bfloat16", "bfloat16"), ("float16", "float16"), ("bfloat16", "int8"),
          ("bfloat16", "float8_e4m3fn"), ("float16", "float8_e5m2"), ("float32", "float32"))
OPTIONS = ("soft_cap", "alibi", "sliding_window")


def covering_grid(impl: str, subset: str = "full") -> list:
    """Kernel configurations covering every axis value, every page size x head dim pair (the
    tile and SMEM sizes), each with a 16-bit and a 1-byte cache, and every option with split-K
    on and off. "fast" is a spread-out subset for CI."""
    base = KernelConfig(impl)
    out = []
    for ps in PAGE_SIZES:
        for hd in HEAD_DIMS:
            for q_dtype, cache_dtype in (DTYPES[0], DTYPES[2]):
                out.append(dataclasses.replace(base, page_size=ps, head_dim=hd, q_dtype=q_dtype,
                                               cache_dtype=cache_dtype))
    out += [dataclasses.replace(base, q_per_kv=g) for g in Q_PER_KV]
    out += [dataclasses.replace(base, q_dtype=q, cache_dtype=c) for q, c in DTYPES]
    for split in (False, True):
        for opt in OPTIONS:
            out.append(dataclasses.replace(base, split_k=split, **{opt: True}))
        out.append(dataclasses.replace(base, split_k=split, soft_cap=True, alibi=True, sliding_window=True,
                                       cache_dtype="int8", q_per_kv=8, head_dim=80))
    out = list(dict.fromkeys(out))
    if subset == "fast":
        out = out[::9] + [c for c in out if c.split_k][:2]
        out = list(dict.fromkeys(out))
    return out


def random_grid(impl: str, count: int, seed: int) -> list:
    """`count` configurations drawn from the full product of the grid's axes (with options and
    split-K at random), for the property "whatever unsupported_reason accepts compiles"."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        q_dtype, cache_dtype = DTYPES[rng.integers(len(DTYPES))]
        out.append(KernelConfig(
            impl, q_dtype=q_dtype, cache_dtype=cache_dtype, page_size=int(rng.choice(PAGE_SIZES)),
            head_dim=int(rng.choice(HEAD_DIMS)), num_kv_heads=int(rng.choice((1, 2, 8))),
            q_per_kv=int(rng.choice(Q_PER_KV)), soft_cap=bool(rng.random() < 0.5),
            alibi=bool(rng.random() < 0.3), sliding_window=bool(rng.random() < 0.3),
            split_k=bool(rng.random() < 0.5), num_pages=int(rng.choice((64, 1024, 8192)))))
    return out


def kernel_call(cfg: KernelConfig):
    """(fn, args, kwargs, pool shapes) of one paged_decode call with cfg's shapes, impl forced."""
    spec = cfg.spec()
    sds = jax.ShapeDtypeStruct
    pool = (spec.num_kv_heads, spec.num_pages, spec.page_size, spec.head_dim)
    args = (sds((spec.num_seqs, spec.num_q_heads, spec.head_dim), spec.q_dtype), sds(pool, spec.cache_dtype),
            sds(pool, spec.cache_dtype), sds((spec.num_seqs, spec.pages_per_seq), jnp.int32),
            sds((spec.num_seqs,), jnp.int32))
    kwargs = {}
    if spec.alibi:
        kwargs["alibi_slopes"] = sds((spec.num_q_heads,), jnp.float32)
    if spec.quantized:
        kwargs["k_scales"] = kwargs["v_scales"] = sds(pool[:3], jnp.float32)
    import jpa
    fn = functools.partial(jpa.paged_decode, impl=cfg.impl, soft_cap=30.0 if spec.soft_cap else None,
                           sliding_window=1024 if spec.sliding_window else None)
    return fn, args, kwargs, [(pool, spec.cache_dtype)] * 2


def check_kernels(compiler: Compiler, impls, subset: str, log=print, random: int = 0, seed: int = 0) -> list:
    cc = float(".".join(map(str, TARGETS[compiler.target]["cc"])))
    records = []
    for impl in impls:
        grid = random_grid(impl, random, seed) if random else covering_grid(impl, subset)
        for cfg in grid:
            reason = dispatch.unsupported_reason(impl, cfg.spec(), cc)
            if reason is not None:
                records.append(dict(name=cfg.name, target=compiler.target, kind="kernel", ok=True,
                                    refused=reason, config=dataclasses.asdict(cfg)))
                continue
            fn, args, kwargs, pools = kernel_call(cfg)
            rec = compiler.compile(cfg.name, fn, args, kwargs=kwargs, pool_shapes=pools)
            rec.update(kind="kernel", config=dataclasses.asdict(cfg))
            want = "triton_calls" if impl == "triton" else "mosaic_calls"
            if rec["ok"] and rec[want] != 1:
                rec["ok"] = False
                rec["problems"].append(f"expected one {impl} kernel call, found {rec[want]}")
            if impl == "mosaic" and rec["ok"]:
                from jpa.pallas import mosaic_decode
                q_item = np.dtype(jnp.dtype(cfg.q_dtype)).itemsize
                c_item = np.dtype(jnp.dtype(cfg.cache_dtype)).itemsize
                rec["mosaic_smem_planned"] = mosaic_decode.smem_bytes(cfg.head_dim, cfg.page_size, q_item, c_item)
                # Before the register-accumulator path (p through SMEM, as interpret mode still runs).
                rec["mosaic_smem_interpret_path"] = mosaic_decode.smem_bytes(
                    cfg.head_dim, cfg.page_size, q_item, c_item, register_acc=False)
            records.append(rec)
            log(_line(rec))
    return records


# ---- 2. Ragged paged attention (prefill chunks and decode tokens in one call) ----

# (q dtype, cache dtype, q_per_kv, head_dim, page_size) at a serving size: a 512-token budget, 64
# sequences of up to 4096 tokens, 8 kv heads; soft cap and sliding window on.
RAGGED_CONFIGS = (("bfloat16", "bfloat16", 4, 128, 16), ("bfloat16", "bfloat16", 1, 256, 16),
                  ("float16", "int8", 3, 64, 32), ("float32", "float32", 8, 128, 16),
                  ("bfloat16", "float8_e5m2", 8, 80, 128))
RAGGED_SIZES = dict(num_tokens=512, max_num_seqs=64, num_kv_heads=8, num_pages=4096, max_tokens=4096)


def ragged_grid(subset: str = "full") -> list:
    """RAGGED_CONFIGS ("fast") plus, for "full", every head dim with a 16-bit, an int8, an fp8 and
    a float32 cache, q_per_kv and page size cycling through the grid's values."""
    out = list(RAGGED_CONFIGS)
    if subset == "full":
        pairs = (("bfloat16", "bfloat16"), ("bfloat16", "int8"), ("float16", "float8_e5m2"),
                 ("float32", "float32"))
        i = 0
        for hd in HEAD_DIMS:
            for q_dtype, cache_dtype in pairs:
                out.append((q_dtype, cache_dtype, Q_PER_KV[i % len(Q_PER_KV)], hd,
                            PAGE_SIZES[(i * 7) % len(PAGE_SIZES)]))
                i += 1
    return list(dict.fromkeys(out))


def ragged_call(impl, q_dtype, cache_dtype, q_per_kv, head_dim, page_size):
    """(spec, fn, args, pool shapes) of one ragged_paged_attention call with the impl forced."""
    import jpa
    from jpa.ragged import ragged_spec
    z = RAGGED_SIZES
    sds = jax.ShapeDtypeStruct
    k, n, b = z["num_kv_heads"], z["num_kv_heads"] * q_per_kv, z["max_num_seqs"]
    pool = (k, z["num_pages"], page_size, head_dim)
    quantized = cache_dtype in ("int8", "float8_e4m3fn", "float8_e5m2")
    args = (sds((z["num_tokens"], n, head_dim), q_dtype), sds(pool, cache_dtype), sds(pool, cache_dtype),
            sds((b, z["max_tokens"] // page_size), jnp.int32), sds((b,), jnp.int32), sds((b + 1,), jnp.int32),
            sds((), jnp.int32)) + ((sds(pool[:3], jnp.float32),) * 2 if quantized else ())

    def fn(q, k_pages, v_pages, tables, lens, cu, num_seqs, *scales):
        return jpa.ragged_paged_attention(q, k_pages, v_pages, tables, lens, cu, num_seqs, soft_cap=30.0,
                                          sliding_window=1024, k_scales=scales[0] if scales else None,
                                          v_scales=scales[1] if scales else None, impl=impl)
    spec = ragged_spec(args[0], args[1], args[3], soft_cap=30.0, alibi_slopes=None, sliding_window=1024)
    return spec, fn, args, [(pool, cache_dtype)] * 2


def check_ragged(compiler: Compiler, impls, log=print, subset: str = "fast") -> list:
    """Each ragged kernel over RAGGED_CONFIGS: the ragged kernel plus the decode kernel that serves
    every sequence's last row, both in the one program."""
    from jpa import ragged
    cc = float(".".join(map(str, TARGETS[compiler.target]["cc"])))
    records = []
    for impl in impls:
        for cfg in ragged_grid(subset):
            spec, fn, args, pools = ragged_call(impl, *cfg)
            name = f"ragged {impl} q={cfg[0]} kv={cfg[1]} G={cfg[2]} hd={cfg[3]} ps={cfg[4]}"
            reason = ragged.unsupported_reason(impl, spec, cc)
            if reason is not None:
                records.append(dict(name=name, target=compiler.target, kind="ragged", ok=True, refused=reason))
                continue
            rec = compiler.compile(name, fn, args, pool_shapes=pools)
            rec.update(kind="ragged")
            calls = rec.get("triton_calls" if impl == "triton" else "mosaic_calls", 0)
            if rec["ok"] and calls != 2:
                rec["ok"] = False
                rec["problems"].append(f"expected two {impl} kernel calls (ragged + decode), found {calls}")
            records.append(rec)
            log(_line(rec))
    return records


# ---- 2b. Stacked page pools: a loop over layers, the layer a traced index ----

# The layer-scanned model's shape of a call: ONE pool per K and V, [L, K, P, S_p, H] (scales
# f32[L, K, P, S_p]), carried through a loop over layers; each layer writes its new tokens into the
# carried pool, then calls the kernel on the WHOLE pool with the loop index as its layer. Checked:
# it compiles, the kernel is in the loop body once, no pool-shaped copy (of the stacked shape), the
# donated pools aliased, temporaries far below the pools, and the kernel's registers and spills
# against its per-layer twin (the same configuration over a [K, P, S_p, H] pool): taken from the
# records of the grid compiled before it in the same run, or (full subset) compiled here.
#
# The fast subset is one ragged configuration per kernel family: the ragged op runs both kernels
# (the tile kernel and the decode kernel of the last rows) over the stacked pool. Its 40 bf16
# layers make each pool 5 GiB, over 2**32 bytes: Pallas Triton's 64-bit offsets.
#
# (decode KernelConfig overrides, num_layers). The 4-layer bf16 pool is 1 GiB per K/V (32-bit
# offsets in Triton); the 32-layer one 8 GiB (64-bit offsets; the Llama-3-8B shape of pool).
STACKED_KERNEL_CONFIGS = (
    ({}, 4),
    ({}, 32),
    (dict(cache_dtype="int8", page_size=32), 4),
    (dict(split_k=True, soft_cap=True, alibi=True, sliding_window=True), 4),
    (dict(q_dtype="float16", cache_dtype="float8_e5m2", head_dim=64, q_per_kv=3, num_kv_heads=3), 30),
)
# (RAGGED_CONFIGS entry, num_layers, in the fast subset).
STACKED_RAGGED_CONFIGS = (
    (RAGGED_CONFIGS[0], 40, True),
    (RAGGED_CONFIGS[0], 4, False),
    (RAGGED_CONFIGS[2], 4, False),
    (RAGGED_CONFIGS[4], 4, False),
)


def _stacked_loop(call, num_layers: int, num_extra: int, quantized: bool):
    """fn(q, k_pages, v_pages, block_tables, seq_lens, *extra, *scales) -> (k_pages, v_pages,
    *scales, out): `num_layers` iterations of "write one token per sequence into layer l of the
    carried pools (the model's cache write), then `call(q, k, v, tables, lens, *extra, k_scales,
    v_scales, layer=l)`", the outputs summed. `extra` are num_extra index arrays (ragged: cu_q_lens,
    num_seqs)."""
    from jax import lax

    def fn(q, k_pages, v_pages, tables, lens, *rest):
        extra, scales = rest[:num_extra], rest[num_extra:]
        num_seqs, page_size = tables.shape[0], k_pages.shape[3]
        num_kv_heads, num_pages = k_pages.shape[1], k_pages.shape[2]
        pos = jnp.maximum(lens - 1, 0)
        page = jnp.clip(tables[jnp.arange(num_seqs), pos // page_size], 0, num_pages - 1)  # i32[B]
        off = pos % page_size  # i32[B]

        def body(layer, carry):
            k, v, *sc, out = carry
            new = q[:num_seqs, :num_kv_heads].astype(k.dtype)  # [B, K, H]
            k = k.at[layer, :, page, off].set(new)
            v = v.at[layer, :, page, off].set(new)
            sc = [s.at[layer, :, page, off].set(1.0) for s in sc]
            o = call(q, k, v, tables, lens, *extra, k_scales=sc[0] if quantized else None,
                     v_scales=sc[1] if quantized else None, layer=layer)
            return (k, v, *sc, out + o.astype(jnp.float32))

        init = (k_pages, v_pages, *scales, jnp.zeros(q.shape, jnp.float32))
        return lax.fori_loop(0, num_layers, body, init)

    return fn


def _stacked_args(q_shape, q_dtype, pool, cache_dtype, num_layers, index_args, quantized):
    sds = jax.ShapeDtypeStruct
    stacked = (num_layers, *pool)
    args = (sds(q_shape, q_dtype), sds(stacked, cache_dtype), sds(stacked, cache_dtype), *index_args)
    scale_shapes = [(stacked[:4], "float32")] * 2 if quantized else []
    args += tuple(sds(s, d) for s, d in scale_shapes)
    donate = (1, 2) + tuple(range(len(args) - len(scale_shapes), len(args)))
    return args, donate, [(stacked, cache_dtype)] * 2 + scale_shapes


def _kernel_twin(records, name):
    """{kernel: {registers, spill_stores, shared_memory}} of an already compiled record `name`."""
    for r in records:
        if r.get("name") == name and "kernels" in r:
            return {k: {f: v.get(f) for f in ("registers", "spill_stores", "shared_memory")}
                    for k, v in r["kernels"].items()}
    return None


def _compare_twin(rec, twin):
    """Records the per-layer twin's kernel resources next to the stacked ones; more registers than
    the twin is reported in `register_growth` (a problem only when it brings spills, which
    `Compiler.compile` already fails)."""
    rec["per_layer_kernels"] = twin
    if not twin or not rec.get("kernels"):
        return
    growth = {}
    for k, v in rec["kernels"].items():
        t = twin.get(k)
        if t and v.get("registers") is not None and t.get("registers") is not None:
            growth[k] = v["registers"] - t["registers"]
            if v.get("spill_stores", 0) > (t.get("spill_stores") or 0):
                rec["problems"].append(f"{k} spills {v['spill_stores']} B over a stacked pool, "
                                       f"{t.get('spill_stores') or 0} B per layer")
                rec["ok"] = False
    rec["register_growth"] = growth


def check_stacked_kernels(compiler: Compiler, impls, subset: str, records=(), log=print) -> list:
    """Each decode kernel over a stacked pool in a loop over layers (STACKED_KERNEL_CONFIGS, full
    subset only); the per-layer twin is taken from `records` (the grid) or compiled here."""
    from jpa.pallas import mosaic_decode, triton_decode
    cc = float(".".join(map(str, TARGETS[compiler.target]["cc"])))
    modules = dict(triton=triton_decode, mosaic=mosaic_decode)
    out, records = [], list(records)
    for impl in impls:
        for overrides, num_layers in STACKED_KERNEL_CONFIGS:
            if subset == "fast":
                continue
            cfg = dataclasses.replace(KernelConfig(impl), **overrides)
            spec = cfg.spec()._replace(num_layers=num_layers)
            name = f"{cfg.name} stacked L={num_layers}"
            reason = modules[impl].unsupported_reason(spec, cc)
            if reason is not None:
                out.append(dict(name=name, target=compiler.target, kind="stacked", ok=True, refused=reason))
                continue
            twin = _kernel_twin(records, cfg.name)
            if twin is None and dispatch.unsupported_reason(impl, cfg.spec(), cc) is None:
                fn, args, kwargs, pools = kernel_call(cfg)
                trec = compiler.compile(cfg.name, fn, args, kwargs=kwargs, pool_shapes=pools)
                records.append(trec)
                twin = _kernel_twin(records, cfg.name)
            pool = (spec.num_kv_heads, spec.num_pages, spec.page_size, spec.head_dim)
            index_args = (jax.ShapeDtypeStruct((spec.num_seqs, spec.pages_per_seq), jnp.int32),
                          jax.ShapeDtypeStruct((spec.num_seqs,), jnp.int32))
            args, donate, pools = _stacked_args((spec.num_seqs, spec.num_q_heads, spec.head_dim), spec.q_dtype,
                                                pool, spec.cache_dtype, num_layers, index_args, spec.quantized)
            call = functools.partial(modules[impl].paged_decode, scale=spec.head_dim ** -0.5,
                                     soft_cap=30.0 if spec.soft_cap else None,
                                     sliding_window=1024 if spec.sliding_window else None)
            if spec.alibi:
                slopes = 2.0 ** -jnp.linspace(0.5, 8, spec.num_q_heads)
                call = functools.partial(call, alibi_slopes=slopes)
            fn = _stacked_loop(call, num_layers, 0, spec.quantized)
            rec = compiler.compile(name, fn, args, donate_argnums=donate, pool_shapes=pools)
            rec.update(kind="stacked", num_layers=num_layers, config=dataclasses.asdict(cfg))
            want = "triton_calls" if impl == "triton" else "mosaic_calls"
            if rec["ok"] and rec[want] != 1:
                rec["ok"] = False
                rec["problems"].append(f"expected one {impl} kernel call (in the loop body), found {rec[want]}")
            _compare_twin(rec, twin)
            out.append(rec)
            log(_line(rec) + _growth(rec))
    return out


def check_stacked_ragged(compiler: Compiler, impls, subset: str, records=(), log=print) -> list:
    """Each ragged kernel (its tile kernel and the decode kernel of the last rows) over a stacked
    pool in a loop over layers (STACKED_RAGGED_CONFIGS); twins from `records` or (full subset)
    compiled here."""
    from jpa import ragged
    from jpa.pallas import mosaic_ragged, triton_ragged
    cc = float(".".join(map(str, TARGETS[compiler.target]["cc"])))
    modules = dict(triton=triton_ragged, mosaic=mosaic_ragged)
    out, records = [], list(records)
    for impl in impls:
        for cfg, num_layers, fast in STACKED_RAGGED_CONFIGS:
            if subset == "fast" and not fast:
                continue
            spec, twin_fn, twin_args, twin_pools = ragged_call(impl, *cfg)
            twin_name = f"ragged {impl} q={cfg[0]} kv={cfg[1]} G={cfg[2]} hd={cfg[3]} ps={cfg[4]}"
            name = f"{twin_name} stacked L={num_layers}"
            reason = modules[impl].unsupported_reason(spec._replace(num_layers=num_layers), cc)
            if reason is not None:
                out.append(dict(name=name, target=compiler.target, kind="stacked", ok=True, refused=reason))
                continue
            twin = _kernel_twin(records, twin_name)
            if twin is None and subset == "full" and ragged.unsupported_reason(impl, spec, cc) is None:
                records.append(compiler.compile(twin_name, twin_fn, twin_args, pool_shapes=twin_pools))
                twin = _kernel_twin(records, twin_name)
            pool = twin_args[1].shape
            args, donate, pools = _stacked_args(twin_args[0].shape, spec.q_dtype, pool, spec.cache_dtype,
                                                num_layers, twin_args[3:7], spec.quantized)
            call = functools.partial(modules[impl].ragged_paged_attention, scale=spec.head_dim ** -0.5,
                                     soft_cap=30.0, sliding_window=1024)
            fn = _stacked_loop(call, num_layers, 2, spec.quantized)
            rec = compiler.compile(name, fn, args, donate_argnums=donate, pool_shapes=pools)
            rec.update(kind="stacked", num_layers=num_layers)
            calls = rec.get("triton_calls" if impl == "triton" else "mosaic_calls", 0)
            if rec["ok"] and calls != 2:
                rec["ok"] = False
                rec["problems"].append(f"expected two {impl} kernel calls (ragged + decode, in the loop body), "
                                       f"found {calls}")
            _compare_twin(rec, twin)
            out.append(rec)
            log(_line(rec) + _growth(rec))
    return out


def _growth(rec) -> str:
    g = rec.get("register_growth")
    return (" | registers vs per-layer: " + ", ".join(f"{k} {v:+d}" for k, v in g.items())) if g else ""


# ---- 3. The engine's jitted steps, SmolLM2-135M in bfloat16 ----

def engine_steps(pool_gib: float = 1.5, max_seqs: int = 64, page_size: int = 16, max_model_len: int = 2048,
                 steps_per_call: int = 8, budget: int = 512, config=None, label: str = "SmolLM2",
                 which=("plain", "spec")):
    """[(name, fn, args, donate_argnums, pool shapes, expected kernel calls)] of the engine's one
    program, the unified step: a ragged step over `budget` tokens in one pass, then the decode loop
    ("plain"), and the same with n-gram speculation ("spec"); `which` picks.

    config: the models.ModelConfig (or a dict of its fields) to compile, named `label` in the
    record; default SmolLM2-135M's. The model and the engine's state are abstract (nnx.eval_shape;
    a runner with allocate=False): no weights are read and no pool is allocated, so this runs
    without the model package.
    """
    from flax import nnx

    from jpa.cache import CacheConfig
    from jpa.engine.runner import DONATE, ModelRunner
    from models import GPT, PRESETS, GPTForEngine, ModelConfig
    from models.gpt import layer_period

    config = PRESETS["smollm2-135m"] if config is None else config
    config = ModelConfig(**config) if isinstance(config, dict) else config
    model = GPTForEngine(nnx.eval_shape(lambda: GPT(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))))
    cache_cfg = CacheConfig.from_memory(int(pool_gib * 2 ** 30), num_layers=config.num_layers,
                                        num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                                        page_size=page_size, dtype="bfloat16")
    from jpa.engine.speculative import SpeculativeConfig

    def runner_for(spec=None):
        r = ModelRunner(model, cache_cfg, max_seqs=max_seqs, pages_per_seq=max_model_len // page_size,
                        steps_per_call=steps_per_call, stop_ids=(config.eos_token_id,), allocate=False,
                        block_tokens=budget, speculative=spec)
        r.set_block_tokens(budget)   # the GPU default: the whole budget in one pass
        return r

    runner = runner_for()
    # Speculative decoding as a GPU runs it: k = 4 n-gram drafts, a verify pass of max_seqs x (k + 1)
    # rows (the GPU default; set explicitly: this machine's backend is the CPU).
    k = 4
    spec = runner_for(SpeculativeConfig(method="ngram", num_speculative_tokens=k, prompt_lookup_max=4,
                                        verify_rows=max_seqs * (k + 1)))
    pool = ((config.num_layers, config.num_kv_heads, cache_cfg.num_pages, page_size, config.head_dim), "bfloat16")
    pools = [pool] * 2  # the stacked K and V pools (jpa.KVCache)
    steps = [
        # The ragged op is two kernel calls (prompt tiles + the last rows' decode kernel) per layer,
        # the decode loop one; the layers are a scan, so the program holds one layer body of each
        # (layer_period() layers: 1 for SmolLM2).
        (f"engine unified step ({label} bf16, {budget}-token budget + {steps_per_call} decode steps, "
         f"{max_seqs} seqs, {cache_cfg.num_pages} pages)",
         runner.step_function, runner.state() + (runner.step_inputs(budget),), DONATE, pools,
         3 * layer_period(config)),
        # With speculation the decode loop holds the verify pass (a ragged op over k + 1 rows per
        # sequence: two kernel calls) and the plain decode pass of steps without drafts (one).
        (f"engine unified step, n-gram speculation k={k} ({label} bf16, verify pass of {max_seqs * (k + 1)} rows, "
         f"{max_seqs} seqs, {cache_cfg.num_pages} pages)",
         spec.step_function, spec.state() + (spec.step_inputs(budget),), DONATE, pools,
         5 * layer_period(config)),
    ]
    return [s for s, kind in zip(steps, ("plain", "spec")) if kind in which]


def check_engine(compiler: Compiler, log=print, **sizes) -> list:
    """Compiles the engine's unified step with impl="auto": it must hold the target's kernels (Mosaic
    on an H100, Triton on an A100) three times per layer of the scanned body (ragged tiles, last rows,
    decode loop), five with speculation (the verify pass's two besides)."""
    from jpa.engine.runner import attention_in
    records = []
    expected = "mosaic" if TARGETS[compiler.target]["cc"][0] == 9 else "triton"
    for name, fn, args, donate, pools, kernel_calls in engine_steps(**sizes):
        rec = compiler.compile(name, fn, args, donate_argnums=donate, pool_shapes=pools, keep_hlo=True)
        hlo = rec.pop("hlo", "")
        rec.update(kind="engine", attention=attention_in(hlo) if kernel_calls else None)
        if rec["ok"] and kernel_calls:
            n = rec[f"{expected}_calls"]
            if rec["attention"] != expected or n != kernel_calls:
                rec["ok"] = False
                rec["problems"].append(f"expected {kernel_calls} {expected} kernel calls; "
                                       f"found attention {rec['attention']} with {n}")
        records.append(rec)
        log(_line(rec))
    return records


# ---- 3. Tensor parallelism: a Llama-shaped model over N GPUs of one host ----

# Llama-3-8B's shapes (random weights: nothing is read, only shapes matter to the compiler).
LLAMA_SHAPED = dict(family="llama", vocab_size=128256, d_model=4096, num_layers=32, num_q_heads=32,
                    num_kv_heads=8, head_dim=128, ffn_dim=14336, max_seq_len=8192, rope_base=500000.0,
                    tie_embeddings=False, bos_token_id=0, eos_token_id=1)
# Llama-3-70B's shapes (its config.json: 80 layers, hidden 8192, 64 heads, 8 kv heads, head_dim 128,
# intermediate 28672, vocab 128256, rope_theta 500000, 8192 positions, untied head).
LLAMA3_70B_SHAPED = dict(LLAMA_SHAPED, d_model=8192, num_layers=80, num_q_heads=64, ffn_dim=28672)
MODEL_SHAPES = {"llama3-8b": LLAMA_SHAPED, "llama3-70b": LLAMA3_70B_SHAPED}
COLLECTIVE_OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
                  "collective-broadcast")
_ITEMSIZE = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1, "s64": 8,
             "u64": 8, "f64": 8}


def _computations(hlo: str) -> dict:
    """{computation name: its instruction lines} of an HLO module's text."""
    comps, name = {}, None
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ENTRY )?%?([\w.-]+) .*\{\s*$", line)
        if m and not re.match(r"\s*(?:ROOT )?%?[\w.-]+ = ", line):
            name = m.group(1)
            comps[name] = []
        elif name is not None:
            comps[name].append(line)
    return comps


def collectives(hlo: str) -> dict:
    """Collectives of an optimized HLO module: {"step": [...], "outside": [...]}, each entry
    {op, type, bytes}, where "step" are those inside while-loop bodies (once per decode step of
    the engine's loop) and bytes is the size of the collective's result on one device
    (the larger array of an async start op's (operand, result) tuple)."""
    comps = _computations(hlo)
    called = lambda lines: {c for line in lines for c in re.findall(
        r"(?:calls|body|condition|to_apply|branch_computations)=\{?%?([\w.-]+)", line)}
    bodies = {b for lines in comps.values() for line in lines for b in re.findall(r"body=%?([\w.-]+)", line)}
    in_loop, todo = set(), list(bodies)
    while todo:
        c = todo.pop()
        if c in in_loop or c not in comps:
            continue
        in_loop.add(c)
        todo += called(comps[c])
    out = {"step": [], "outside": []}
    for cname, line, op, typ, nbytes in _collective_lines(comps):
        out["step" if cname in in_loop else "outside"].append(dict(op=op, type=typ, bytes=nbytes))
    return out


def _collective_lines(comps: dict):
    """(computation, line, op, type of its largest array, that array's bytes) of every collective
    instruction in `comps` (from `_computations`)."""
    ops = "|".join(COLLECTIVE_OPS)
    for cname, lines in comps.items():
        for line in lines:
            m = re.match(rf"\s*(?:ROOT )?%?[\w.-]+ = (.+?) ({ops})(-start)?\(", line)
            if not m:
                continue
            arrays = [(t, [int(d) for d in dims.split(",") if d]) for t, dims in re.findall(r"(\w+)\[([\d,]*)\]", m.group(1))]
            sizes = [_ITEMSIZE.get(t, 4) * int(np.prod(d or [1])) for t, d in arrays]
            big = int(np.argmax(sizes))
            t, d = arrays[big]
            yield cname, line, m.group(2), f"{t}[{','.join(map(str, d))}]", sizes[big]


def collective_summary(items: list, num_layers: int) -> dict:
    """{op: {count, bytes, per_layer, types}} of a list from `collectives`."""
    out = {}
    for c in items:
        o = out.setdefault(c["op"], dict(count=0, bytes=0, types=[]))
        o["count"] += 1
        o["bytes"] += c["bytes"]
        if c["type"] not in o["types"]:
            o["types"].append(c["type"])
    for o in out.values():
        o["per_layer"] = o["count"] / num_layers
    return out


# ---- Which collectives cross hosts ----

def _braced(text: str, start: int) -> str:
    """The balanced {...} of text that opens at text[start]."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i + 1]
    raise ValueError(f"unbalanced braces: {text[start:start + 80]!r}")


def _mesh_axes_groups(axes: str, device_ids: str | None, grouped: str, num_partitions: int) -> list:
    """Groups of XLA's mesh-axes spelling (xla/hlo/ir/replica_group.cc, MeshAxesReplicaGroupList):
    the devices of the mesh that differ only along the grouped axes (or sub-axes) form a group."""
    mesh = [(n.strip("'\""), int(z)) for n, z in re.findall(r"([^=,\s]+)=(\d+)", axes)]
    names, sizes = [n for n, _ in mesh], [z for _, z in mesh]
    n = int(np.prod(sizes))
    ids = [int(x) for x in re.findall(r"\d+", device_ids)][-n:] if device_ids else list(range(n))
    refs = []  # (mesh dim, pre_size, size) in the order written
    for name, pre, size in re.findall(r"([^,:()\s]+)(?::\((\d+)\)(\d+))?", grouped):
        d = names.index(name.strip("'\""))
        refs.append((d, int(pre), int(size)) if pre else (d, 1, sizes[d]))
    shape, where = [], {}  # each mesh dim split into factors; where[ref index] = its factor's axis
    for d, full in enumerate(sizes):
        mine = sorted((i for i, r in enumerate(refs) if r[0] == d), key=lambda i: refs[i][1])
        prefix = 1
        for i in mine:
            _, pre, size = refs[i]
            if pre != prefix:
                shape.append(pre // prefix)
                prefix = pre
            where[i] = len(shape)
            shape.append(size)
            prefix *= size
        if prefix != full or not mine:
            shape.append(full // prefix)
    group_axes = [where[i] for i in range(len(refs))]
    order = [a for a in range(len(shape)) if a not in group_axes] + group_axes
    size = int(np.prod([shape[a] for a in group_axes])) if group_axes else 1
    return np.asarray(ids).reshape(shape).transpose(order).reshape(-1, size).tolist()


def replica_groups(line: str, num_partitions: int) -> list:
    """The device groups of one collective instruction of an optimized HLO, as lists of ids.

    In a GSPMD program (one replica, use_global_device_ids) an id is a partition: the position of
    a device in the program's device assignment (the mesh's devices, flattened). Reads the
    spellings XLA prints:

    - lists: `replica_groups={{0,1},{2,3}}`; `{}` is one group of every partition;
    - iota: `replica_groups=[2,8]<=[16]`, `[8,2]<=[2,8]T(1,0)`: iota(16) reshaped to the dims
      after `<=`, transposed by T, reshaped to [groups, group size];
    - mesh axes: `replica_groups=mesh['x'=2,'tp'=8] {'tp'}` (plus `, device_ids=(...)` for a mesh
      that is not an iota; a sub-axis is written 'tp':(1)2): devices differing only along the
      named axes form a group;
    - a collective-permute's `source_target_pairs={{0,1},...}`: each pair is a group.
    No attribute at all means one group of every partition.
    """
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(([^)]*)\))? \{([^}]*)\}", line)
    if m:
        return _mesh_axes_groups(m.group(1), m.group(2), m.group(3), num_partitions)
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if m:
        dims = [int(x) for x in m.group(3).split(",")]
        ids = np.arange(int(np.prod(dims))).reshape(dims)
        if m.group(4):
            ids = ids.transpose([int(x) for x in m.group(4).split(",")])
        return ids.reshape(int(m.group(1)), int(m.group(2))).tolist()
    for attr in ("replica_groups", "source_target_pairs"):
        i = line.find(f"{attr}={{")
        if i >= 0:
            text = _braced(line, i + len(attr) + 1)
            groups = [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", text[1:-1])]
            return groups or [list(range(num_partitions))]
    return [list(range(num_partitions))]


def _loops(comps: dict) -> tuple:
    """({computation: [(while body, known trip count or None), ...] of its enclosing loops,
    outermost first}, {computation: the computations it calls other than as a while body})."""
    parent, calls = {}, {}
    for cname, lines in comps.items():
        for line in lines:
            trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
            for b in re.findall(r"body=%?([\w.-]+)", line):
                parent.setdefault(b, (cname, (b, int(trip.group(1)) if trip else None)))
            others = re.findall(r"(?:calls|condition|to_apply|true_computation|false_computation)=%?([\w.-]+)", line)
            for branches in re.findall(r"branch_computations=\{([^}]*)\}", line):
                others += [x.strip().lstrip("%") for x in branches.split(",")]
            for c in others:
                parent.setdefault(c, (cname, None))
                calls.setdefault(cname, set()).add(c)
    memo = {}

    def chain(c, seen=()):
        if c not in memo:
            up = parent.get(c)
            memo[c] = [] if up is None or up[0] in seen else chain(up[0], seen + (c,)) + ([up[1]] if up[1] else [])
        return memo[c]

    return {c: chain(c) for c in comps}, calls


def host_collectives(hlo: str, partition_hosts: list) -> list:
    """Every collective of an optimized HLO module with the hosts it spans.

    partition_hosts[p]: the host (process_index) of partition p's device. Each entry: op, type,
    bytes (as in `collectives`), group_size, num_groups, hosts_per_group (the most hosts one
    group spans), cross_host (a group spans more than one host), loops (the known trip counts of
    the enclosing while loops, outermost first; None where XLA knows none), layer_body (its
    innermost loop is a layer scan: a loop whose body calls the attention kernel outside any
    inner loop) and executions (the product of loops, None if one is unknown).
    """
    comps = _computations(hlo)
    nesting, calls = _loops(comps)
    kernel = {c for c, lines in comps.items() if any(TRITON_CALL in x or MOSAIC_CALL in x for x in lines)}

    def reaches_kernel(c, seen=frozenset()):
        return c in kernel or any(reaches_kernel(d, seen | {c}) for d in calls.get(c, ()) if d not in seen)

    layer_bodies = {b for chain in nesting.values() for b, _ in chain if reaches_kernel(b)}
    out = []
    for cname, line, op, typ, nbytes in _collective_lines(comps):
        groups = replica_groups(line, len(partition_hosts))
        spans = [len({partition_hosts[p] for p in g}) for g in groups]
        loops = [trip for _, trip in nesting.get(cname, [])]
        out.append(dict(op=op, type=typ, bytes=nbytes, group_size=max(map(len, groups)), num_groups=len(groups),
                        hosts_per_group=max(spans), cross_host=max(spans) > 1, loops=loops,
                        layer_body=bool(nesting.get(cname)) and nesting[cname][-1][0] in layer_bodies,
                        executions=None if None in loops else int(np.prod(loops or [1]))))
    return out


def host_table(items: list, layers_per_body: int) -> list:
    """Rows of `host_collectives` entries grouped by (op, type, where, enclosing loops, hosts
    spanned): count in the program text, per layer (layer-body entries: count / layers_per_body),
    executions per call (None when a loop's trip count is data: the engine's decode loop and
    ragged blocks). where: "layer" (in a layer scan's body), "loop" (in another loop) or "once"."""
    rows = {}
    for c in items:
        where = "layer" if c["layer_body"] else ("loop" if c["loops"] else "once")
        key = (c["op"], c["type"], where, tuple(c["loops"]), c["cross_host"], c["hosts_per_group"], c["group_size"])
        r = rows.setdefault(key, dict(op=c["op"], type=c["type"], where=where, cross_host=c["cross_host"],
                                      hosts_per_group=c["hosts_per_group"], group_size=c["group_size"],
                                      bytes_each=c["bytes"], count=0, executions=0, loops=c["loops"]))
        r["count"] += 1
        r["executions"] = None if r["executions"] is None or c["executions"] is None else r["executions"] + c["executions"]
    for r in rows.values():
        r["per_layer"] = r["count"] / layers_per_body if r["where"] == "layer" else None
    return sorted(rows.values(), key=lambda r: (r["where"] != "layer", r["op"], -r["bytes_each"]))


def moves_heads_or_pool(c: dict, head_dim: int, num_pages: int) -> bool:
    """Whether a collective moves something with a head axis (K/V, q, attention outputs) or a pool
    dimension, or is an all-to-all/permute (the shape of a head or page exchange)."""
    return (f",{head_dim}]" in c["type"] or f"{num_pages}," in c["type"]
            or c["op"] in ("all-to-all", "collective-permute"))


def cross_host_problems(items: list, *, d_model: int, head_dim: int, num_pages: int, max_tokens: int) -> list:
    """What is wrong with the cross-host collectives of `host_collectives` entries, under the rule
    of a tensor-parallel model spread over hosts: in a layer only the row-parallel f32[tokens,
    d_model] all-reduces (after wo and w_down) cross hosts; outside the layers only a fixed few
    per step do, all-reduces and all-gathers no bigger than the embedding lookup's bf16[tokens,
    d_model] (the lookup itself and sampling over the vocabulary shards); nothing with a head
    axis or a pool dimension ever does. Returns [] when the rule holds."""
    problems = []
    lookup_bytes = max_tokens * d_model * 2
    for c in items:
        if not c["cross_host"]:
            continue
        what = f"{c['op']} {c['type']} over {c['hosts_per_group']} hosts"
        row = c["op"] == "all-reduce" and c["type"].startswith("f32[") and c["type"].endswith(f",{d_model}]")
        if moves_heads_or_pool(c, head_dim, num_pages):
            problems.append(f"{what} moves heads, K/V or the pool across hosts")
        elif c["layer_body"] and not row:
            problems.append(f"{what} in a layer crosses hosts (only the row-parallel all-reduces may)")
        elif not c["layer_body"] and not row and (c["op"] not in ("all-reduce", "all-gather")
                                                   or c["bytes"] > lookup_bytes):
            problems.append(f"{what} ({c['bytes']} bytes) crosses hosts outside the layers: not a lookup or "
                            f"sampling collective (all-reduce/all-gather of at most {lookup_bytes} bytes)")
    return problems


def cross_host_role(c: dict, d_model: int) -> str:
    """What a collective is for in the engine's tensor-parallel step, read from its op and type."""
    if c["op"] == "all-reduce" and c["type"].startswith("f32[") and c["type"].endswith(f",{d_model}]"):
        return "row-parallel sum (after wo / w_down)"
    if c["op"] == "all-reduce" and c["type"].startswith("bf16[") and c["type"].endswith(f",{d_model}]"):
        return "embedding lookup (vocabulary-parallel)"
    return "sampling / logprobs over the vocabulary shards"


def tp_engine_steps(compiler: Compiler, config: dict | None = None, pool_gib_per_device: float = 8.0,
                    max_seqs: int = 64, page_size: int = 16, max_model_len: int = 4096, steps_per_call: int = 8,
                    budget: int = 512, embeddings: str = "vocab"):
    """The engine's unified step (a `budget`-token ragged pass, then the decode loop) of a
    tensor-parallel model on compiler.tp_mesh.

    The model is abstract (nnx.eval_shape) and sharded by models.sharding (params become
    ShapeDtypeStructs carrying their NamedShardings); the runner's state is abstract and sharded
    as the engine shards it. Returns (records' inputs, details): [(name, fn, args, jit_options,
    per-device pool shapes, expected kernel calls, model passes)] and a dict of the sizes.
    """
    from flax import nnx

    from jpa.cache import CacheConfig
    from jpa.engine.runner import ModelRunner
    from models import GPT, GPTForEngine, ModelConfig
    from models.gpt import layer_period

    mesh = compiler.tp_mesh
    tp = mesh.shape["tp"]
    config = ModelConfig(**(config or LLAMA_SHAPED))
    model = GPTForEngine(nnx.eval_shape(lambda: GPT(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))))
    model = model.shard(mesh, embeddings=embeddings)
    mc = model.config
    cache_cfg = CacheConfig.from_memory(int(pool_gib_per_device * 2 ** 30 * tp), num_layers=mc.num_layers,
                                        num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
                                        page_size=page_size, dtype="bfloat16")
    runner = ModelRunner(model, cache_cfg, max_seqs=max_seqs, pages_per_seq=max_model_len // page_size,
                         steps_per_call=steps_per_call, stop_ids=(mc.eos_token_id,), allocate=False, mesh=mesh,
                         block_tokens=budget)
    runner.set_block_tokens(budget)   # the GPU default: the whole budget in one pass
    local_pool = ((mc.num_layers, mc.num_kv_heads // tp, cache_cfg.num_pages, page_size, mc.head_dim), "bfloat16")
    pools = [local_pool] * 2  # the stacked K and V pools, each device's heads
    param_bytes = sum(int(np.prod(x.sharding.shard_shape(x.shape))) * np.dtype(x.dtype).itemsize
                      for x in jax.tree_util.tree_leaves(model.params))
    details = dict(tp=tp, head_plan=model.head_plan.describe(), embeddings=model.head_plan.embeddings,
                   head_plan_mode=model.head_plan.mode, orig_kv_heads=model.head_plan.orig_kv_heads,
                   budget=budget, max_model_len=max_model_len, pool_gib_per_device=pool_gib_per_device,
                   num_layers=mc.num_layers, layers_per_body=layer_period(mc),
                   d_model=mc.d_model, num_q_heads=mc.num_q_heads,
                   num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim, vocab_size=mc.vocab_size,
                   num_pages=cache_cfg.num_pages, max_seqs=max_seqs, steps_per_call=steps_per_call,
                   param_bytes_per_device=param_bytes, pool_bytes_per_device=cache_cfg.nbytes // tp,
                   pool_spec=str(runner.cache.k.sharding.spec),
                   param_specs={n: str(model.params["layers"][n].sharding.spec)
                                for n in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")})
    # Two model passes (the ragged pass and the decode loop's body), each with the kernel calls of
    # a ragged op (2 per layer) or a decode (1 per layer).
    steps = [
        (f"tp={tp} unified step ({budget}-token budget + {steps_per_call} decode steps, {max_seqs} seqs, "
         f"{cache_cfg.num_pages} pages)", runner.step_function, runner.state() + (runner.step_inputs(budget),),
         runner.jit_options(), pools, 3, 2),
    ]
    return steps, details


def check_hosts(rec: dict, hlo: str, compiler: Compiler, details: dict) -> list:
    """The cross-host analysis of a tensor-parallel record over several hosts: adds the collective
    table (each kind with its role, where it runs, whether it crosses hosts) and the hosts of
    each kv head's copies to rec; returns the problems of `cross_host_problems`."""
    partition_hosts = [d.process_index for d in compiler.tp_mesh.devices.flat]
    items = host_collectives(hlo, partition_hosts)
    table = host_table(items, details["layers_per_body"])
    for r in table:
        r["role"] = cross_host_role(r, details["d_model"])
    tp, orig_k = details["tp"], details["orig_kv_heads"]
    # Which hosts hold each of the model's kv heads (informational: a copy is computed on its device
    # from replicated wk/wv columns, so copies on two hosts would move nothing either). Device i
    # holds pool heads [i*K'/tp, (i+1)*K'/tp); under "replicate" pool head j is a copy of kv head
    # j // (K'/K), under "split" it is head j; "pad" appends zero heads (not listed).
    kv_hosts = None
    if details["head_plan_mode"] in ("split", "replicate"):
        per_dev, copies = details["num_kv_heads"] // tp, details["num_kv_heads"] // orig_k
        kv_hosts = [sorted({partition_hosts[i] for i in range(tp) for j in range(i * per_dev, (i + 1) * per_dev)
                            if j // copies == k}) for k in range(orig_k)]
    rec.update(topology=compiler.topology, hosts=compiler.hosts, devices_per_host=tp // compiler.hosts,
               partition_hosts=partition_hosts, kv_head_hosts=kv_hosts, host_collectives=table,
               cross_host_collectives=sum(r["count"] for r in table if r["cross_host"]),
               within_host_collectives=sum(r["count"] for r in table if not r["cross_host"]))
    problems = cross_host_problems(items, d_model=details["d_model"], head_dim=details["head_dim"],
                                   num_pages=details["num_pages"], max_tokens=details["budget"])
    return problems


def check_tp(compiler: Compiler, log=print, **sizes) -> list:
    """Compiles a Llama-shaped model's unified step over compiler.tp_mesh and checks the data
    movement: exactly two f32[tokens, d_model] all-reduces per layer and model pass (after wo and
    w_down; the ragged pass and the decode loop) plus a fixed few for sampling, no
    all-gather/all-to-all, the target's kernels three times per layer, the donated pool shards
    aliased and no pool copy."""
    records = []
    expected = "mosaic" if TARGETS[compiler.target]["cc"][0] == 9 else "triton"
    steps, details = tp_engine_steps(compiler, **sizes)
    # The layers are a scan: the program text holds one body of layer_period() layers (1 here), so
    # per-layer counts are read per body (an XLA pass that unrolled the loop would show up as more).
    num_layers = details["layers_per_body"]
    for name, fn, args, opts, pools, kernel_calls, passes in steps:
        rec = compiler.compile(name, fn, args, jit_options=opts, pool_shapes=pools, keep_hlo=True)
        hlo = rec.pop("hlo", "")
        rec.update(kind="tp", **details)
        if "error" not in rec:
            coll = collectives(hlo)
            rec["collectives_per_step"] = collective_summary(coll["step"], num_layers)
            rec["collectives_outside_loop"] = collective_summary(coll["outside"], num_layers)
            items = coll["step"] + coll["outside"]
            # The row-parallel sums: f32[tokens..., d_model] all-reduces, two per layer.
            row = [c for c in items if c["op"] == "all-reduce" and c["type"].startswith("f32[")
                   and c["type"].endswith(f",{details['d_model']}]")]
            rec["row_parallel_all_reduces"] = len(row)
            rec["other_collectives"] = collective_summary([c for c in items if c not in row], num_layers)
            if len(row) != 2 * passes * num_layers:
                rec["problems"].append(f"expected 2 row-parallel all-reduces per layer and model pass "
                                       f"({2 * passes * num_layers}); found {len(row)}")
            # Nothing with a head axis (K/V, q, attention outputs) or a pool dimension may move.
            h, pages = details["head_dim"], details["num_pages"]
            moved = [c for c in items if moves_heads_or_pool(c, h, pages)]
            if moved:
                rec["problems"].append(f"K/V, heads or pool moved between devices: {moved[:3]}")
            if compiler.hosts > 1:
                rec["problems"] += check_hosts(rec, hlo, compiler, details)
            if rec["temp_bytes"] + rec["argument_bytes"] + rec["output_bytes"] - rec["alias_bytes"] > \
                    TARGETS[compiler.target]["device_memory_size"]:
                rec["problems"].append("arguments + outputs + temporaries exceed the device's memory")
            if kernel_calls and rec[f"{expected}_calls"] != kernel_calls:
                rec["problems"].append(f"expected {kernel_calls} {expected} kernel calls; found {rec[f'{expected}_calls']}")
            rec["ok"] = not rec["problems"]
        records.append(rec)
        log(_line(rec))
        for key in ("collectives_per_step", "collectives_outside_loop"):
            if key in rec:
                log(f"      {key}: " + "; ".join(f"{op} x{v['count']} ({v['per_layer']:.2f}/layer) {v['types']} "
                                                  f"{v['bytes'] / 2**20:.2f} MiB" for op, v in rec[key].items()))
        for r in rec.get("host_collectives", []):
            loops = "x".join("?" if t is None else str(t) for t in r["loops"])
            where = (f"{r['per_layer']:g} per layer" if r["where"] == "layer"
                     else f"x{r['count']} ({'in loops ' + loops if loops else 'once'})")
            log(f"      {'CROSS-HOST' if r['cross_host'] else 'in-host   '} {r['op']} {r['type']} {where}, "
                f"{r['bytes_each'] / 2**20:.3f} MiB each, groups of {r['group_size']} over {r['hosts_per_group']} "
                f"host(s): {r['role']}")
    return records


def _line(rec) -> str:
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", choices=sorted(TARGETS))
    p.add_argument("--subset", choices=("fast", "full"), default="full",
                   help="fast: a spread-out subset of the kernel grid (CI); full: the covering grid")
    p.add_argument("--only", choices=("kernels", "ragged", "stacked", "engine", "all", "tp"), default="all",
                   help="stacked: only the stacked-pool configurations of kernels and ragged (a loop over "
                        "layers, one [L, K, P, S_p, H] pool, the layer a traced index); "
                        "tp: the engine's unified step of a Llama-shaped model (--model) tensor-parallel over --tp "
                        "GPUs of --hosts hosts (not part of 'all')")
    p.add_argument("--engine-steps", default="plain,spec", help="the engine programs of --only engine: plain "
                   "and/or spec (n-gram speculative decoding), comma-separated")
    p.add_argument("--tp", type=int, default=8, help="GPUs of the tensor-parallel compile (--only tp)")
    p.add_argument("--embeddings", choices=("replicated", "vocab"), default="vocab",
                   help="how --only tp places the embeddings and the output head")
    p.add_argument("--layers", type=int, default=None, help="--only tp: layers of the Llama-shaped model "
                   "(default: the --model's)")
    p.add_argument("--model", choices=sorted(MODEL_SHAPES), default="llama3-8b",
                   help="--only tp: the model shapes (random abstract bf16 weights)")
    p.add_argument("--hosts", type=int, default=1, help="--only tp: spread the --tp GPUs over this many hosts "
                   "(topology HOSTSx1x(TP/HOSTS): one NVLink domain per host) and report which collectives "
                   "cross hosts")
    p.add_argument("--pool-gib", type=float, default=8.0, help="--only tp: KV pool per device, GiB")
    p.add_argument("--max-seqs", type=int, default=64, help="--only tp: sequences of the decode loop")
    p.add_argument("--max-model-len", type=int, default=4096, help="--only tp: tokens per sequence at most")
    p.add_argument("--random", type=int, default=0, metavar="N",
                   help="instead of the covering grid, N random configurations per kernel")
    p.add_argument("--seed", type=int, default=0, help="seed of --random")
    p.add_argument("--json", type=pathlib.Path, help="write every record to this file")
    p.add_argument("--markdown", type=pathlib.Path, nargs="+", metavar="JSON",
                   help="print a markdown table of these JSON reports and exit (no compiling)")
    args = p.parse_args(argv)
    if args.markdown:
        print(markdown([json.loads(f.read_text()) for f in args.markdown]), end="")
        return 0
    if args.target is None:
        p.error("--target is required (h100 or a100)")
    try:
        compiler = Compiler(args.target, *((args.tp, args.hosts) if args.only == "tp" else (1, 1)))
    except Exception as e:
        print(f"gpu_compile_check: cannot get a compile-only {args.target} device ({type(e).__name__}: "
              f"{str(e).splitlines()[0] if str(e) else ''}). Install the compile-only GPU packages: "
              f"pip install -e '.[gpu]'", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    impls = ("triton", "mosaic") if TARGETS[args.target]["cc"][0] == 9 else ("triton",)
    records = []
    if args.only in ("kernels", "all"):
        records += check_kernels(compiler, impls, args.subset, random=args.random, seed=args.seed)
    if args.only in ("kernels", "stacked", "all") and not args.random:
        records += check_stacked_kernels(compiler, impls, args.subset, records)
    if args.only in ("ragged", "all"):
        records += check_ragged(compiler, impls, subset=args.subset)
    if args.only in ("ragged", "stacked", "all"):
        records += check_stacked_ragged(compiler, impls, args.subset, records)
    if args.only in ("engine", "all"):
        records += check_engine(compiler, which=tuple(args.engine_steps.split(",")))
    if args.only == "tp":
        config = dict(MODEL_SHAPES[args.model], **({"num_layers": args.layers} if args.layers else {}))
        records += check_tp(compiler, config=config, embeddings=args.embeddings, pool_gib_per_device=args.pool_gib,
                            max_seqs=args.max_seqs, max_model_len=args.max_model_len)
    failed = [r for r in records if not r["ok"]]
    compiled = [r for r in records if "refused" not in r]
    summary = dict(target=args.target, device_kind=TARGETS[args.target]["kind"],
                   subset=f"random {args.random} (seed {args.seed})" if args.random else args.subset,
                   jax=jax.__version__, ptxas=compiler.ptxas, topology=compiler.topology,
                   records=len(records), compiled=len(compiled),
                   refused=len(records) - len(compiled), failed=len(failed),
                   seconds=round(time.perf_counter() - t0, 1))
    print(f"\n{args.target}: {summary['compiled']} compiled, {summary['refused']} refused by "
          f"unsupported_reason, {summary['failed']} failed ({summary['seconds']} s)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(dict(summary=summary, records=records), indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
