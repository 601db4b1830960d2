"""Readers of what XLA and Mosaic GPU leave behind when they compile for a GPU: the thunk
sequence (each kernel's grid, threads and shared memory), ptxas's -v report (registers, spills),
the files of MOSAIC_GPU_DUMP_TO, and the optimized HLO text (copies of the page pools,
collectives, the replica groups they span and which hosts those are on).

Pure text and file parsing: nothing here compiles, so every reader is testable on a hand-written
HLO module (tests/test_gpu_compile.py). `jpa.tools.deviceless.Compiler` calls them after each
compile; the checks of `jpa.tools.kernel_checks` and `jpa.tools.engine_checks` read their results.

To find a Pallas kernel in HLO, look for its custom call (TRITON_CALL, MOSAIC_CALL), not for the
word "triton": XLA compiles some of its own fusions with Triton too.
"""

import pathlib
import re

import numpy as np

TRITON_CALL = 'custom_call_target="__gpu$xla.gpu.triton"'
MOSAIC_CALL = 'custom_call_target="mosaic_gpu'
# Ops that, producing a pool-shaped array, mean the pool was copied or re-laid-out.
COPY_OPS = ("copy", "copy-start", "slice", "dynamic-slice", "transpose", "concatenate", "pad",
            "gather", "reverse")
COLLECTIVE_OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
                  "collective-broadcast")
_ITEMSIZE = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1, "s64": 8,
             "u64": 8, "f64": 8}


# ---- Kernels: XLA's thunk sequence, ptxas -v, Mosaic GPU's dump ----

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


def read_mosaic_dump(dump_dir) -> dict:
    """{kernel name: {registers, spill_stores, spill_loads, stack, shared_memory, threads, ptx_targets,
    modules, ptxas_reports}} from a MOSAIC_GPU_DUMP_TO directory; several modules of one kernel name (e.g.
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
        text = ptx.read_text()
        t = re.search(r"\.maxntid (\d+), (\d+), (\d+)", text)
        if t:
            entry(ptx, ".ptx")["threads"] = [int(x) for x in t.groups()]
        target = re.search(r"^\s*\.target\s+(\w+)", text, re.MULTILINE)
        if target:  # the GPU the PTX is for, e.g. sm_80 or sm_90a
            entry(ptx, ".ptx").setdefault("ptx_targets", [])
            k = entry(ptx, ".ptx")
            if target.group(1) not in k["ptx_targets"]:
                k["ptx_targets"].append(target.group(1))
    for rep in sorted(dump_dir.glob("*.ptxas")):
        k = entry(rep, ".ptxas")
        for info in parse_ptxas(rep.read_text()).values():
            k["ptxas_reports"] += 1
            for f in ("registers", "spill_stores", "spill_loads", "stack"):
                k[f] = max(k.get(f, 0), info[f])
    return out


# ---- The optimized HLO: copies of the page pools ----

def hlo_type(shape, dtype) -> str:
    """The HLO spelling of an array type, e.g. (8, 16) bfloat16 -> "bf16[8,16]"."""
    names = {"bfloat16": "bf16", "float16": "f16", "float32": "f32", "int8": "s8",
             "float8_e4m3fn": "f8e4m3fn", "float8_e5m2": "f8e5m2", "int32": "s32", "uint8": "u8",
             "int4": "s4", "uint4": "u4", "uint32": "u32"}
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


# ---- The optimized HLO: collectives ----

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


def moves_heads_or_pool(c: dict, head_dim: int, num_pages: int, page_size: int) -> bool:
    """Whether a collective moves heads (K/V, q, attention outputs: [..., heads, head_dim], last axis
    head_dim; rank 2 counts too, for a head axis of 1 that XLA dropped), part of the pool (the pool's
    consecutive [..., num_pages, page_size, ...] axes: K/V pages or their scales), or is an
    all-to-all/permute (the shape of a head or page exchange). Shapes are matched axis by axis, not
    a number anywhere in the type: a sampling all-gather f32[num_pages, 20] is neither."""
    dims = [int(d) for d in re.fullmatch(r"\w+\[([\d,]*)\]", c["type"]).group(1).split(",") if d]
    heads = len(dims) >= 2 and dims[-1] == head_dim
    pool = any(dims[i:i + 2] == [num_pages, page_size] for i in range(len(dims) - 1))
    return heads or pool or c["op"] in ("all-to-all", "collective-permute")


def cross_host_problems(items: list, *, d_model: int, head_dim: int, num_pages: int, page_size: int,
                        max_tokens: int) -> list:
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
        if moves_heads_or_pool(c, head_dim, num_pages, page_size):
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
        return "row-parallel sum (after wo / w_down, or a mixture of experts' psum)"
    if c["op"] == "all-reduce" and c["type"].startswith("bf16[") and c["type"].endswith(f",{d_model}]"):
        return "embedding lookup (vocabulary-parallel)"
    return "sampling / logprobs over the vocabulary shards"
