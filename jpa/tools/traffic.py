"""A memory-traffic model of a compiled GPU program: the bytes each kernel reads and writes.

A decode step on a GPU is bound by memory traffic (the weights at batch 1, the KV cache at large
batches and long contexts), so the bytes the compiled program moves per step are the GPU
performance figure this project can measure without a GPU. `traffic(hlo, spec)` reads XLA's
optimized HLO (a deviceless compile's `compiled.as_text()`) and returns one row per kernel: every
instruction XLA runs as GPU work (fusions, custom calls, async fusion starts, bare copies, scatters
...; bitcasts, tuples, parameters and loop bookkeeping move nothing), with

- `read` and `written` bytes per execution: a fusion reads each operand whole, except an operand
  the fused computation only slices (`dynamic-slice`, `slice`, `gather`: the slices' bytes) or
  updates in place (`dynamic-update-slice`, `scatter` on it: nothing read); it writes its result,
  except a result that is an in-place update of an operand (the update's bytes). A Pallas kernel
  (Mosaic GPU, Triton) reads its page-pool operands by what it really reads: `spec.kv_read_per_call`
  bytes (the live KV of one layer, from the context lengths), not the pool's size; its other
  operands whole. cuBLAS's workspace result is not traffic.
- `executions`: the product of the known trip counts of the enclosing while loops (the scanned
  layers); a loop whose trip count XLA does not know (the engine's decode loop, its ragged blocks)
  counts once: rows are per iteration of it, and `loops` names every enclosing loop.
- `purpose`: weights (an array shaped like a parameter of the model or one layer's slice of a
  stacked one), kv_read / kv_write (a page pool read by a kernel / updated in place), logits
  (an array with a vocabulary axis: the head's output, sampling), pages (integer arrays: page
  tables, slot mappings, allocator state, token ids), other (activations). A kernel's read and
  written bytes are split by the purpose of each operand and of each result. Arrays are matched by
  type, and large ones also by dtype and element count (XLA re-views them: `MATCH_BY_SIZE`); an
  array a kernel makes out of weights alone (a copy, a concatenation) is a weight too, and one a
  kernel makes without reading any weight is not (a weight's size by chance). Pool
  traffic outside the scanned layers and outside attention kernels (copy-on-write of shared
  pages, every layer at once) is page work.
- For a conditional, each branch's kernels are rows of their own (`branch`); `summary` counts, for
  each conditional, its most expensive branch only.

- `state`: a hybrid model's recurrent states (Gated DeltaNet: f32[value heads, value dim, key dim] and the conv's
  last inputs per sequence per layer; `Spec.state_types`), which a decode step reads and writes whole: the
  ideal is every live sequence's state read once and written once per recurrent layer
  (`recurrent_state_ideal`; `hybrid_traffic` models a hybrid's decode step).

`summary(rows, ideal)` groups the rows by purpose against an ideal (every weight read once, the
live KV read once, the new KV written once) and `table` prints that. `engine_traffic` compiles the
engine's unified step (`jpa.tools.engine_checks.engine_steps`) for a target and models one decode
step of it; `jpa tools traffic` prints its table.

Pure text parsing over an HLO module, like `jpa.tools.hlo`: a hand-written or a small compiled
program checks the accounting (tests/test_traffic.py).
"""

import dataclasses
import re
import time

import numpy as np

# The XLA options under which the scanned layers' gemms read their weights in place; the engine
# compiles its GPU step with them (`jpa.core.xla_options`; re-exported here for the tools).
from jpa.core.xla_options import WEIGHTS_IN_PLACE  # noqa: F401
from jpa.tools.hlo import MOSAIC_CALL, TRITON_CALL

ITEMSIZE = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1, "s64": 8,
            "u64": 8, "f64": 8, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "s4": 0.5, "u4": 0.5,
            "token": 0}
INTEGER = ("s8", "u8", "s16", "u16", "s32", "u32", "s64", "u64", "pred", "s4", "u4")
# Ops that move no bytes of their own (views, bookkeeping, control flow: their bodies are rows).
FREE_OPS = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "while", "conditional", "call",
            "after-all", "partition-id", "replica-id", "opt-barrier", "fusion-done", "copy-done", "async-done",
            "send-done", "recv-done", "all-reduce-done", "all-gather-done", "collective-permute-done",
            "add-dependency", "domain", "get-dimension-size", "reshape", "async-start", "async-update"}
PURPOSES = ("weights", "kv_read", "kv_write", "state", "logits", "pages", "other")
SLICING = ("dynamic-slice", "slice", "gather")
IN_PLACE = ("dynamic-update-slice", "scatter")
VIEWS = ("bitcast", "reshape", "copy", "get-tuple-element")


@dataclasses.dataclass
class Instr:
    name: str
    type: str       # the result type as printed: "bf16[8,16]{1,0}" or a tuple "(f32[2]{0}, s32[])"
    op: str
    operands: list  # instruction names
    line: str


def arrays(type_str: str) -> list:
    """[(dtype, dims)] of an HLO type (a tuple's leaves in order)."""
    return [(t, tuple(int(d) for d in dims.split(",") if d))
            for t, dims in re.findall(r"([a-z]\w*)\[([\d,]*)\]", type_str) if t in ITEMSIZE]


def nbytes(type_str: str) -> int:
    return int(sum(ITEMSIZE[t] * int(np.prod(d)) for t, d in arrays(type_str)))


def _array_bytes(t, dims) -> int:
    return int(ITEMSIZE[t] * int(np.prod(dims)))


def _leaves(type_str: str) -> list:
    """The top-level elements of a tuple type as strings (a non-tuple type: itself)."""
    s = type_str.strip()
    if not s.startswith("("):
        return [s]
    out, depth, cur = [], 0, ""
    for ch in s[1:-1]:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


_INSTR = re.compile(r"\s*(?:ROOT )?%?([\w.\-]+) = (.*?) ([a-z][\w\-]*)\((.*)$")


def _operands(rest: str) -> tuple:
    """(operand names, attribute text) of the text after `op(`."""
    depth = 1
    for i, ch in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return re.findall(r"%([\w.\-]+)", rest[:i]), rest[i + 1:]
    return re.findall(r"%([\w.\-]+)", rest), ""


def parse(hlo: str) -> tuple:
    """({computation: {instruction name: Instr}} in program order, the entry computation's name)."""
    comps, name, entry = {}, None, None
    for line in hlo.splitlines():
        m = re.match(r"\s*(ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if m and not re.match(r"\s*(?:ROOT )?%?[\w.\-]+ = ", line):
            name = m.group(2)
            comps[name] = {}
            if m.group(1):
                entry = name
            continue
        m = _INSTR.match(line)
        if m and name is not None:
            ops, attrs = _operands(m.group(4))
            comps[name][m.group(1)] = Instr(m.group(1), m.group(2), m.group(3), ops, line)
    return comps, entry


def _calls(ins: Instr) -> str | None:
    m = re.search(r"calls=%?([\w.\-]+)", ins.line)
    return m.group(1) if m else None


# Arrays of at least this many elements are matched to a weight or a pool by dtype and element
# count as well as by shape: XLA re-views them (a split-K gemm reads a [k, n] weight as [s, k/s, n],
# a scatter writes a [L, K, P, S_p, H] pool as [L, K, P*S_p, H]). Smaller ones (norm scales, which
# an activation row could match in size) only by shape.
MATCH_BY_SIZE = 2 ** 20


@dataclasses.dataclass
class Spec:
    """What the arrays of a program are, by their HLO types.

    weight_types: (dtype, dims) of the model's parameters (stacked ones and one layer's slice of
    each, with and without the leading 1: `weight_types_of`); pool_types: the page pools' (dtype,
    dims); vocab_size: an array with that axis is logits / sampling work; kv_read_per_call: the
    bytes a Pallas kernel really reads from one pool operand per call (one layer's live K or V),
    None to count the pool operand whole; stacked_weights: (dtype, dims) of the stacked layer
    weights, of which a Pallas kernel reads one layer (dims[1:]) per call.
    """
    weight_types: set = dataclasses.field(default_factory=set)
    pool_types: set = dataclasses.field(default_factory=set)
    vocab_size: int | None = None
    kv_read_per_call: int | None = None
    # (dtype, dims) of stacked [num_layers, ...] weights: a Pallas kernel that takes one whole (the
    # quantized matmul, `jpa.pallas.mosaic.qmatmul`, with a layer index) reads one layer of it.
    stacked_weights: set = dataclasses.field(default_factory=set)
    # Element counts of the float weights that quantized ones stand for (`dense_sizes_of`): a kernel
    # that makes a float array of such a size out of weights alone writes a dense copy of a weight.
    dense_sizes: set = dataclasses.field(default_factory=set)
    # (dtype, dims) of recurrent states (a hybrid model's GDN states, [layers, slots, ...]): an array of that dtype
    # whose trailing dims (axes of 1 left out) are one sequence's state (dims[2:]) after other axes is "state".
    state_types: set = dataclasses.field(default_factory=set)

    def __post_init__(self):
        self.pool_types = set(self.pool_types)
        self.weight_types = set(self.weight_types)
        # A pool's one-layer slice (what a per-layer copy of it would be) is KV too.
        size = lambda dims: int(np.prod(dims))
        self._pool_sizes = {(t, size(d)) for t, d in self.pool_types} | {(t, size(d[1:])) for t, d in self.pool_types}
        self._weight_sizes = {(t, size(d)) for t, d in self.weight_types if size(d) >= MATCH_BY_SIZE}
        self.state_types = set(self.state_types)
        # one sequence's state shape (dims after [layers, slots]): any array of that dtype ending with it
        self._state_shapes = {(t, tuple(n for n in d[2:] if n != 1)) for t, d in self.state_types}

    def purpose(self, t: str, dims: tuple) -> str:
        n = int(np.prod(dims))
        if (t, dims) in self.pool_types or (t, n) in self._pool_sizes:
            return "kv_read"
        core = tuple(d for d in dims if d != 1)  # XLA's views of a state insert axes of 1 ([B, H, V, 1, 1, K])
        if any(t == st and len(core) > len(sh) and core[-len(sh):] == sh for st, sh in self._state_shapes):
            return "state"
        # dims[1:]: a weight viewed with a leading axis of 1 (a bitcast, the same bytes: the quantized matmul
        # takes one [K, N] weight, a model's head, as a stack of one layer)
        if ((t, dims) in self.weight_types or (t, n) in self._weight_sizes
                or (len(dims) > 1 and dims[0] == 1 and (t, tuple(dims[1:])) in self.weight_types)):
            return "weights"
        if self.vocab_size and self.vocab_size in dims:
            return "logits"
        if t in INTEGER:
            return "pages"
        return "other"


def weight_types_of(params, stacked_axis_sizes=()) -> set:
    """The (dtype, dims) of every leaf of a parameter tree (anything with .shape and .dtype), plus,
    for a leaf whose leading axis is one of stacked_axis_sizes (the scanned layers), one layer's
    slice with and without the leading 1 (what a scan or a dynamic-slice makes of it)."""
    import jax

    from jpa.tools.hlo import hlo_type
    out = set()
    for leaf in jax.tree_util.tree_leaves(params):
        t = hlo_type(leaf.shape, leaf.dtype).split("[")[0]
        dims = tuple(leaf.shape)
        out.add((t, dims))
        if dims and dims[0] in stacked_axis_sizes:
            out.add((t, dims[1:]))
            out.add((t, (1,) + dims[1:]))
    return out


def dense_sizes_of(params, stacked_axis_sizes=()) -> set:
    """Element counts of the float weights the quantized leaves of a parameter tree stand for: an
    8-bit leaf's own count, a uint8 leaf's (two 4-bit codes a byte) twice it; for stacked leaves
    (leading axis in stacked_axis_sizes) one layer's too."""
    import jax

    out = set()
    for leaf in jax.tree_util.tree_leaves(params):
        dt = np.dtype(leaf.dtype)
        if dt.itemsize != 1:
            continue
        per = 2 if dt == np.uint8 else 1
        n = int(np.prod(leaf.shape))
        out.add(per * n)
        if leaf.shape and leaf.shape[0] in stacked_axis_sizes:
            out.add(per * n // leaf.shape[0])
    return out


def stacked_weight_record(rec: dict, weights, num_layers: int) -> dict:
    """What a deviceless compile record (`deviceless.Compiler.compile(..., keep_hlo=True)`) of a program over
    stacked [num_layers, ...] weights (ShapeDtypeStructs) did with them: {ok, problems, mosaic, kernels, read,
    written, copies, stack}: weight bytes read and written, weight-shaped arrays materialized and the stack's
    bytes (the quantized-matmul compile checks compare read with stack / num_layers per layer)."""
    spec = Spec(weight_types=weight_types_of(weights, (num_layers,)),
                stacked_weights={(t, d) for t, d in weight_types_of(weights) if d[0] == num_layers},
                dense_sizes=dense_sizes_of(weights, (num_layers,)))
    s = summary(select(traffic(rec["hlo"], spec)))
    return dict(ok=rec["ok"], problems=rec["problems"], mosaic=rec["mosaic_calls"], kernels=rec["kernels"],
                read=s["weights"]["read"], written=s["weights"]["written"], copies=len(s["weight_copies"]),
                stack=sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in weights))


def _param_reads(comp: dict, comps: dict | None = None, depth: int = 0) -> dict:
    """{parameter number: bytes read, or None for the whole operand} of a fused computation: a
    parameter used only as the sliced operand of slices / gathers reads their bytes; one used only
    as the updated operand of in-place updates reads nothing; views (bitcast, reshape) are followed."""
    users = {}
    for ins in comp.values():
        for i, o in enumerate(ins.operands):
            users.setdefault(o, []).append((ins, i))
    out = {}

    def read_of(name, seen=()):
        total = 0
        for ins, i in users.get(name, []):
            if ins.op in ("bitcast", "reshape") and ins.name not in seen:
                r = read_of(ins.name, seen + (ins.name,))
                if r is None:
                    return None
                total += r
            elif ins.op in SLICING and i == 0:
                total += nbytes(ins.type)
            elif ins.op in IN_PLACE and i == 0:
                pass
            elif ins.op == "fusion" and comps and depth < 4 and _calls(ins) in comps:
                # A nested fusion (a gemm fusion's operand computations): what it reads of its operand.
                r = _param_reads(comps[_calls(ins)], comps, depth + 1).get(i)
                if r is None:
                    return None
                total += r
            else:
                return None
        return total

    for ins in comp.values():
        if ins.op == "parameter":
            n = int(re.search(r"parameter\((\d+)\)", ins.line).group(1))
            out[n] = read_of(ins.name)
    return out


def _root(comp: dict) -> Instr:
    for ins in comp.values():
        if re.match(r"\s*ROOT ", ins.line):
            return ins
    return list(comp.values())[-1]


def _result_writes(comp: dict) -> list:
    """Bytes a fused computation writes for each leaf of its result: an in-place update's update
    bytes (its operand 1 of a dynamic-update-slice, operand 2 of a scatter), otherwise None (the
    leaf whole)."""
    root = _root(comp)
    outs = [comp[o] for o in root.operands] if root.op == "tuple" else [root]
    res = []
    for ins in outs:
        while ins.op in ("bitcast", "reshape") and ins.operands and ins.operands[0] in comp:
            ins = comp[ins.operands[0]]
        if ins.op == "dynamic-update-slice":
            res.append(nbytes(comp[ins.operands[1]].type) if ins.operands[1] in comp else None)
        elif ins.op == "scatter":
            res.append(nbytes(comp[ins.operands[-1]].type) if ins.operands[-1] in comp else None)
        else:
            res.append(None)
    return res


def _loop_structure(comps: dict, entry: str) -> dict:
    """{executed computation: [(loop body, known trip or None, branch label or None), ...] from
    the entry inward}. Executed computations: the entry, while bodies and conditions, conditional
    branches, called and async-wrapped computations (not fused computations or reducers)."""
    out = {entry: []}
    todo = [entry]
    while todo:
        c = todo.pop()
        for ins in comps[c].values():
            kids = []
            if ins.op == "while":
                trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins.line)
                body = re.search(r"body=%?([\w.\-]+)", ins.line).group(1)
                cond = re.search(r"condition=%?([\w.\-]+)", ins.line).group(1)
                kids = [(body, (body, int(trip.group(1)) if trip else None, None)),
                        (cond, (body, int(trip.group(1)) if trip else None, None))]
            elif ins.op == "conditional":
                names = re.findall(r"(?:true_computation|false_computation)=%?([\w.\-]+)", ins.line)
                m = re.search(r"branch_computations=\{([^}]*)\}", ins.line)
                if m:
                    names += [x.strip().lstrip("%") for x in m.group(1).split(",")]
                kids = [(b, ("cond", 1, f"{ins.name}:{i}")) for i, b in enumerate(names)]
            elif ins.op in ("call", "async-start"):
                # The called (or async-wrapped) computation runs as is: its instructions are rows.
                m = re.search(r"(?:to_apply|calls)=%?([\w.\-]+)", ins.line)
                if m:
                    kids = [(m.group(1), None)]
            for k, frame in kids:
                if k in comps and k not in out:
                    out[k] = out[c] + ([frame] if frame else [])
                    todo.append(k)
    return out


def traffic(hlo: str, spec: Spec) -> list:
    """One row per kernel of an optimized HLO module (see `_traffic`). A kernel that reads nothing
    but weights (and indices) makes a weight too: a copy or a concatenation of weights (XLA merges
    the q, k and v gemms into one over [wq | wk | wv]). The types of such results are added to the
    spec's weights (when in a weights' dtype and of at least MATCH_BY_SIZE elements: not a gemm's
    f32 output, not an activation) and the module read again, so that what it writes, and what
    later reads it, counts as weights."""
    rows = _traffic(hlo, spec)
    derived, dtypes = set(), {t for t, _ in spec.weight_types}
    for r in rows:
        moved = sum(r["read"].values())
        # (Not a lookup: a gather of embedding rows makes activations.)
        if r["read"]["weights"] and r["read"]["weights"] >= 0.99 * moved and not r["gathers"]:
            for leaf in _leaves(r["result"]):
                for t, dims in arrays(leaf):
                    n = int(np.prod(dims))
                    dense = t in ("bf16", "f16", "f32") and n in spec.dense_sizes  # a dequantized weight
                    if spec.purpose(t, dims) == "other" and (t in dtypes or dense) and n >= MATCH_BY_SIZE:
                        derived.add((t, dims))
    if not derived:
        return rows
    return _traffic(hlo, dataclasses.replace(spec, weight_types=spec.weight_types | derived))


def _traffic(hlo: str, spec: Spec) -> list:
    """One row per kernel of an optimized HLO module: dict(name, op, computation, loops
    ([(body, trip or None)] outermost first), branch (the innermost conditional branch it is in, or
    None), executions (product of the known trips), read / written ({purpose: bytes} per execution),
    target (a custom call's target, a fusion's kind), kernel ("mosaic", "triton", "cublas" or None))."""
    comps, entry = parse(hlo)
    structure = _loop_structure(comps, entry)
    rows = []
    for cname, frames in structure.items():
        comp = comps[cname]
        loops = [(b, t) for b, t, br in frames if br is None]
        branches = [br for _, _, br in frames if br is not None]
        executions = int(np.prod([t for _, t in loops if t is not None] or [1]))
        for ins in comp.values():
            if ins.op in FREE_OPS or ins.op.endswith("-done"):
                continue
            read, written = _kernel_bytes(ins, comp, comps, spec)
            kernel = None
            if ins.op == "custom-call":
                kernel = ("mosaic" if MOSAIC_CALL in ins.line else "triton" if TRITON_CALL in ins.line
                          else "cublas" if "cublas" in ins.line else "custom")
            if kernel not in ("mosaic", "triton") and not any(t for _, t in loops):
                # Pool traffic outside the scanned layers and outside attention: page work
                # (copy-on-write of shared pages, across every layer at once).
                for d in (read, written):
                    d["pages"] += d.pop("kv_read") + d.pop("kv_write")
                    d["kv_read"] = d["kv_write"] = 0
            rows.append(dict(name=ins.name, op=ins.op, computation=cname, loops=loops,
                             branch=branches[-1] if branches else None, branches=branches,
                             executions=executions, read=read, written=written, kernel=kernel,
                             fused=_calls(ins) if ins.op in ("fusion", "fusion-start") else None,
                             type=ins.type[:120], result=_result_type(ins),
                             gathers=ins.op == "gather" or _calls(ins) in comps and any(
                                 i.op == "gather" for i in comps[_calls(ins)].values())))
    return rows


def _result_type(ins: Instr) -> str:
    """The type of what a kernel produces (an async fusion start: its result, not its context)."""
    if ins.op == "fusion-start":
        leaves = _leaves(ins.type)
        return leaves[1] if len(leaves) > 1 else ins.type
    return ins.type


def _operand_type(name: str, comp: dict) -> str:
    ins = comp.get(name)
    return ins.type if ins is not None else ""


def _kernel_bytes(ins: Instr, comp: dict, comps: dict, spec: Spec) -> tuple:
    """({purpose: bytes read}, {purpose: bytes written}) of one execution of a kernel."""
    read = dict.fromkeys(PURPOSES, 0)
    written = dict.fromkeys(PURPOSES, 0)
    op_types = [_operand_type(o, comp) for o in ins.operands]
    result = _result_type(ins)  # an async fusion start's type is ((operands), result, context)
    fused = comps.get(_calls(ins)) if ins.op in ("fusion", "fusion-start") else None
    param_reads = _param_reads(fused, comps) if fused else {}
    writes = _result_writes(fused) if fused else None
    pallas = ins.op == "custom-call" and (MOSAIC_CALL in ins.line or TRITON_CALL in ins.line)
    # A cuBLAS call (bare, or in a dynamic-slice fusion that feeds it the slice's address) returns
    # its workspace as a last s8 result: scratch, not traffic.
    cublas = "__cublas" in ins.line or bool(fused) and any("__cublas" in i.line for i in fused.values())
    # Operands.
    for i, t in enumerate(op_types):
        for k, (dt, dims) in enumerate(arrays(t)):
            whole = _array_bytes(dt, dims)
            p = spec.purpose(dt, dims)
            if pallas and p == "kv_read" and spec.kv_read_per_call is not None:
                read["kv_read"] += spec.kv_read_per_call
                continue
            if pallas and p == "weights" and (dt, dims) in spec.stacked_weights:
                # One layer of the stack, by its index, counted once from HBM also when the call has several
                # row tiles (x over 64 rows: a ragged prompt pass, a verify pass): each tile's programs read the
                # layer's weight tiles again, but from L2, since the programs of one weight column tile are
                # launched together (jpa.pallas.mosaic.qmatmul, the note at ROW_TILE). This counts HBM bytes.
                read["weights"] += whole // dims[0]
                continue
            if ins.op in IN_PLACE and i == 0:
                continue  # a bare in-place update reads nothing of the updated array
            if fused is not None and i in param_reads and param_reads[i] is not None:
                read[p] += param_reads[i]
                continue
            read[p] += whole
    # Results.
    leaves = _leaves(result)
    for k, leaf in enumerate(leaves):
        if cublas and k > 0 and k == len(leaves) - 1 and leaf.startswith(("s8", "u8")):
            continue  # cuBLAS's workspace
        for dt, dims in arrays(leaf):
            p = spec.purpose(dt, dims)
            n = _array_bytes(dt, dims)
            if ins.op in IN_PLACE:
                n = nbytes(op_types[1] if ins.op == "dynamic-update-slice" else op_types[-1])
            elif writes is not None and k < len(writes) and writes[k] is not None:
                n = writes[k]
            if p == "kv_read":
                p = "kv_write"
                if pallas:
                    n = 0  # the pool passed through (aliased): the kernel writes no page of it
            written[p] += n
    if written["weights"] and not read["weights"]:
        # Weight-sized by chance (MATCH_BY_SIZE: e.g. the copy-on-write gather of 8 sequences' last
        # pages, [8, 32, 8, 1, 16, 128], is wk's 4096 x 1024 elements): made from no weight, no copy.
        written["other"] += written["weights"]
        written["weights"] = 0
    return read, written


# ---- Summing rows: one iteration of a loop, the costliest branch of each conditional ----

def select(rows: list, loop: str | None = None, exclusive=()) -> list:
    """The rows of one iteration of the while loop whose body is `loop` (None: the whole program,
    each unknown-trip loop counted once), keeping for each conditional only its costliest branch,
    and for each set of loop bodies in `exclusive` (loops the program runs one of: the engine's
    verify pass and plain decode pass, each a loop of 0 or 1 iterations) only the costliest."""
    if loop is not None:
        rows = [r for r in rows if any(b == loop for b, _ in r["loops"])]
    cost = lambda r: r["executions"] * (sum(r["read"].values()) + sum(r["written"].values()))
    for group in exclusive:
        per = {b: sum(cost(r) for r in rows if any(x == b for x, _ in r["loops"])) for b in group}
        keep = max(per, key=per.get)
        rows = [r for r in rows if not any(x in group and x != keep for x, _ in r["loops"])]
    spent = {}
    for r in rows:
        for br in r["branches"]:
            spent[br] = spent.get(br, 0) + cost(r)
    best = {}
    for br, c in spent.items():
        cond = br.rsplit(":", 1)[0]
        if cond not in best or c > spent[best[cond]]:
            best[cond] = br
    return [r for r in rows if all(best[br.rsplit(":", 1)[0]] == br for br in r["branches"])]


def summary(rows: list, ideal: dict | None = None) -> dict:
    """{purpose: dict(read, written, total, ideal)} plus "total", summed over rows (bytes times
    executions). ideal: {purpose: bytes} (missing purposes: 0). Also "weight_copies": the kernels
    that write a weight-shaped array (a materialized weight slice), with their bytes."""
    ideal = ideal or {}
    out = {p: dict(read=0, written=0, total=0, ideal=ideal.get(p, 0)) for p in PURPOSES}
    for r in rows:
        for p in PURPOSES:
            out[p]["read"] += r["read"][p] * r["executions"]
            out[p]["written"] += r["written"][p] * r["executions"]
    for p in PURPOSES:
        out[p]["total"] = out[p]["read"] + out[p]["written"]
    out["total"] = dict(read=sum(out[p]["read"] for p in PURPOSES), written=sum(out[p]["written"] for p in PURPOSES),
                        total=sum(out[p]["total"] for p in PURPOSES), ideal=sum(ideal.values()))
    out["weight_copies"] = [dict(name=r["name"], type=r["type"], result=r["result"][:120],
                                 bytes=r["written"]["weights"] * r["executions"])
                            for r in rows if r["written"]["weights"]]
    return out


def table(s: dict, unit: float = 1e9, unit_name: str = "GB") -> str:
    """A markdown table of a `summary`: per purpose, bytes read, written, total, ideal, total / ideal."""
    lines = [f"| purpose | read ({unit_name}) | written ({unit_name}) | total ({unit_name}) | ideal ({unit_name}) "
             f"| total / ideal |", "|---|---:|---:|---:|---:|---:|"]
    for p in PURPOSES + ("total",):
        r = s[p]
        ratio = f"{r['total'] / r['ideal']:.2f}" if r["ideal"] else "-"
        name = f"**{p}**" if p == "total" else p
        lines.append(f"| {name} | {r['read'] / unit:.3f} | {r['written'] / unit:.3f} | {r['total'] / unit:.3f} | "
                     f"{r['ideal'] / unit:.3f} | {ratio} |")
    return "\n".join(lines) + "\n"


def top_kernels(rows: list, n: int = 10) -> list:
    """The n rows that move the most bytes (times executions), as short dicts for a log."""
    tot = lambda r: (sum(r["read"].values()) + sum(r["written"].values())) * r["executions"]
    out = []
    for r in sorted(rows, key=tot, reverse=True)[:n]:
        out.append(dict(name=r["name"], op=r["op"], what=r["kernel"] or r["fused"] or "", executions=r["executions"],
                        bytes=tot(r), read={k: v * r["executions"] for k, v in r["read"].items() if v},
                        written={k: v * r["executions"] for k, v in r["written"].items() if v}, type=r["type"]))
    return out


# ---- The engine's unified step ----

def decode_loop(rows: list) -> str | None:
    """The body of the engine's decode (verify) loop among the rows of `traffic`: the last
    top-level loop with no known trip count that reaches a Pallas kernel (the ragged pass's loop
    comes before it: the decode loop reads the cache the ragged pass wrote)."""
    order, kernels = [], set()
    for r in rows:
        if r["loops"] and r["loops"][0][1] is None:
            if r["loops"][0][0] not in order:
                order.append(r["loops"][0][0])
            if r["kernel"] in ("mosaic", "triton"):
                kernels.add(r["loops"][0][0])
    found = [b for b in order if b in kernels]
    return found[-1] if found else None


def decode_step(rows: list) -> list | None:
    """The rows of one decode step of the engine's unified step (`traffic` rows of its program):
    one iteration of its decode loop (`decode_loop`), each conditional's costliest branch; in a
    speculative step, its verify pass, not the plain decode pass it runs instead when no sequence
    has a draft (each is a loop of 0 or 1 iterations with attention kernel calls in it; the verify
    pass is the one that moves the most bytes: k + 1 rows a sequence). None if the program has no
    decode loop."""
    loop = decode_loop(rows)
    if loop is None:
        return None
    passes = {r["loops"][1][0] for r in rows
              if len(r["loops"]) > 1 and r["loops"][0][0] == loop and r["loops"][1][1] is None
              and r["kernel"] in ("mosaic", "triton")}
    if len(passes) > 1:
        moved = {b: sum((sum(r["read"].values()) + sum(r["written"].values())) * r["executions"]
                        for r in rows if any(x == b for x, _ in r["loops"])) for b in passes}
        verify = max(moved, key=moved.get)
        rows = [r for r in rows if not any(b in passes and b != verify for b, _ in r["loops"])]
    return select(rows, loop)


def passes(rows: list, purpose: str, nbytes: int) -> float:
    """The bytes of `purpose` that the kernels of `rows` (a `decode_step`) read, in units of nbytes
    (one read of an array of that size, e.g. the step's [rows, vocab] float32 logits: passes over
    it), leaving out the step's data-dependent loops: loops of unknown trip count that hold no
    attention kernel (the GPU sampler's whole-row search, which runs for the rows that need it,
    an eighth of the batch an iteration; `jpa.engine.sampling._sample_candidates`). Loops of known
    trip count count every trip."""
    model_loops = {b for r in rows if r["kernel"] in ("mosaic", "triton") for b, t in r["loops"] if t is None}
    return sum(r["read"][purpose] * r["executions"] for r in rows
               if all(t is not None or b in model_loops for b, t in r["loops"])) / nbytes


def engine_spec(params, config, pools, *, max_seqs: int, context: int, page_size: int, rows_per_seq: int = 1):
    """(Spec, ideal) of one decode step of the engine over `params` (the abstract model params),
    `config` (its ModelConfig), `pools` ([(shape, dtype)] of the stacked K and V pools), max_seqs
    sequences of `context` tokens each, writing rows_per_seq new tokens each (k + 1 when verifying
    k drafts). The ideal: every weight read once (the embedding table: only the rows looked up,
    unless tied to the head), the live KV (context rounded up to whole pages) read once, the new
    KV written once."""
    import jax

    from jpa.tools.hlo import hlo_type
    from jpa.models.gpt import layer_period
    L = config.num_layers
    spec_pools = {(hlo_type(s, d).split("[")[0], tuple(s)) for s, d in pools}
    shape, dtype = pools[0]
    itemsize = np.dtype(dtype).itemsize
    live = -(-context // page_size) * page_size
    kv_per_call = max_seqs * live * config.num_kv_heads * config.head_dim * itemsize
    stacked = {(hlo_type(x.shape, x.dtype).split("[")[0], tuple(x.shape)) for x in jax.tree_util.tree_leaves(params)
               if len(x.shape) >= 2 and x.shape[0] == L}
    spec = Spec(weight_types=weight_types_of(params, (L, L // layer_period(config))), pool_types=spec_pools,
                vocab_size=config.vocab_size, kv_read_per_call=kv_per_call, stacked_weights=stacked,
                dense_sizes=dense_sizes_of(params, (L,)))
    leaves = jax.tree_util.tree_leaves(params)
    weights = sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in leaves)
    if not config.tie_embeddings:
        # The table's own storage (int8 / fp8 when quantized: a leaf's dtype is not the table's).
        table = [x for x in leaves if tuple(x.shape) == (config.vocab_size, config.d_model)]
        w_item = np.dtype((table or leaves)[0].dtype).itemsize
        weights -= config.vocab_size * config.d_model * w_item
        weights += max_seqs * rows_per_seq * config.d_model * w_item
    ideal = dict(weights=weights, kv_read=len(pools) * L * kv_per_call,
                 kv_write=len(pools) * L * max_seqs * rows_per_seq * config.num_kv_heads * config.head_dim * itemsize)
    return spec, ideal


# The abstract quantized models engine_traffic compiles (no weights read) live in jpa.tools.abstract (also read by
# jpa.tools.engine_checks, which this module calls: a module of their own keeps the two apart).
from jpa.tools.abstract import ABSTRACT_FORMATS, HEAD_FORMS, PACKED_FORMS, abstract_model  # noqa: E402,F401


def engine_traffic(target: str = "h100", config=None, *, max_seqs: int = 64, context: int = 1024,
                   pool_gib: float = 8.0, page_size: int = 16, which: str = "plain", compiler_options=None,
                   label: str = "Llama-3-8B", hlo: str | None = None, engine_options: bool = True,
                   budget: int = 512, quantization: str | None = None,
                   embeddings_columns: bool | None = None, tensor_parallel: int = 1) -> dict:
    """Compiles the engine's unified step (`engine_steps`: a ragged pass, then the decode loop;
    "spec": with n-gram speculation, k = 4) for a deviceless target and models one iteration of its
    decode loop: a decode step at `max_seqs` sequences of `context` tokens (a verify step of
    k + 1 rows per sequence under "spec": its verify pass, not the plain decode pass it runs when
    no sequence has a draft). config: a ModelConfig or dict (default Llama-3-8B's shapes). The
    program is the engine's as it compiles it for a GPU (`step_program`: its jit options, with the
    XLA options of `ModelRunner.compiler_options`; a ragged pass of `budget` tokens first);
    engine_options=False drops those XLA options
    (XLA's defaults); compiler_options: more XLA options over them. hlo: the
    optimized HLO of this same program, saved from an earlier call: modelled without compiling.
    Returns dict(name, summary (`summary` against the ideal), top (`top_kernels`), seconds and
    cpu_seconds (the compile: wall, and this process's CPU time; None given hlo), temp_bytes, rows
    (every row of the decode step), hlo, matrix_copies (`matrix_copies` of the whole program) and
    checks (the compile record's ok, problems, pool_copies, pool and alias bytes, kernel calls)).
    quantization: the model's weights stored in that format (`abstract_model`); None: bfloat16.
    embeddings_columns: a tied quantized table's layout (`abstract_model`). tensor_parallel: N > 1 compiles the
    step tensor-parallel over N compile-only GPUs (`engine_checks.tp_engine_steps`, the model sharded by
    models.sharding, pool_gib per device) and models ONE device's program: its shards of the weights and the
    pool, its heads, its vocabulary shard (the ideal is that device's bytes)."""
    from jpa.models import ModelConfig
    from jpa.tools.deviceless import Compiler
    from jpa.tools.engine_checks import LLAMA_SHAPED, engine_steps

    config = ModelConfig(**(config or LLAMA_SHAPED)) if not isinstance(config, ModelConfig) else config
    max_model_len = max(2048, -(-context // page_size) * page_size)
    compiler = None
    if tensor_parallel > 1:
        import jax

        from jpa.tools.engine_checks import tp_engine_steps
        if which != "plain":
            raise ValueError("tensor_parallel > 1 models the plain step only (which='plain')")
        compiler = Compiler(target, num_devices=tensor_parallel)
        (step,), details = tp_engine_steps(compiler, config, pool_gib_per_device=pool_gib, max_seqs=max_seqs,
                                           page_size=page_size, max_model_len=max_model_len, budget=budget,
                                           quantization=quantization)
        name, fn, args, jit_options, pools = step[:5]
        name = f"{label} {name}"
        tp = tensor_parallel
        # one device's program: its shard of every parameter, its heads, its vocabulary shard
        local = lambda x: jax.ShapeDtypeStruct(x.sharding.shard_shape(x.shape), x.dtype)
        spec_params = jax.tree_util.tree_map(local, args[0])
        split_vocab = details["embeddings"] == "vocab"
        spec_config = dataclasses.replace(
            config, num_q_heads=details["num_q_heads"] // tp, num_kv_heads=details["num_kv_heads"] // tp,
            vocab_size=config.vocab_size // tp if split_vocab else config.vocab_size, bos_token_id=0, eos_token_id=0)
    else:
        (name, fn, args, jit_options, pools, _), = engine_steps(
            pool_gib=pool_gib, max_seqs=max_seqs, page_size=page_size, max_model_len=max_model_len, config=config,
            label=label, which=(which,), budget=budget, quantization=quantization,
            embeddings_columns=embeddings_columns)
        spec_params, spec_config = args[0], config
    jit_options = dict(jit_options)
    options = {**(jit_options.pop("compiler_options", {}) if engine_options else {}), **(compiler_options or {})}
    jit_options.pop("compiler_options", None)
    cpu0 = time.process_time()
    if hlo is None:
        rec = (compiler or Compiler(target)).compile(name, fn, args, jit_options=jit_options, pool_shapes=pools,
                                                     keep_hlo=True, compiler_options=options)
        if "error" in rec:
            raise RuntimeError(f"{name}: {rec['error']}")
    else:
        rec = dict(hlo=hlo, seconds=None, temp_bytes=None)
    spec, ideal = engine_spec(spec_params, spec_config, pools, max_seqs=max_seqs, context=context,
                              page_size=page_size, rows_per_seq=5 if which == "spec" else 1)
    all_rows = traffic(rec["hlo"], spec)
    step = decode_step(all_rows)
    if step is None:
        raise RuntimeError(f"{name}: no decode loop found in the compiled program")
    return dict(name=name, target=target, max_seqs=max_seqs, context=context, which=which,
                compiler_options=options, summary=summary(step, ideal), top=top_kernels(step, 12),
                seconds=rec["seconds"], cpu_seconds=round(time.process_time() - cpu0, 1) if hlo is None else None,
                temp_bytes=rec["temp_bytes"], rows=step, hlo=rec["hlo"],
                # The whole program (not only the decode step): weight matrices copied anywhere,
                # and the compile's own checks (pool copies, donated pools aliased, kernel calls).
                matrix_copies=matrix_copies(summary(all_rows)),
                checks={k: rec.get(k) for k in ("ok", "problems", "pool_copies", "pool_bytes", "alias_bytes",
                                                "mosaic_calls", "triton_calls")})


def matrix_copies(s: dict) -> list:
    """The `weight_copies` of a summary that are matrices (an array with two or more axes longer
    than 1: a weight matrix or one layer's slice of one), not a norm scale's vector."""
    return [c for c in s["weight_copies"]
            if any(sum(d > 1 for d in dims) >= 2 for _, dims in arrays(c.get("result", c["type"])))]


def projection(s: dict, target: str, num_seqs: int, *, efficiency: float = 0.8, kv_bytes: int | None = None,
               weight_bytes: int | None = None, memory_fraction: float = 0.9) -> dict:
    """A projected decode rate from a decode step's `summary` (labelled a projection: no GPU ran
    it): the step moves s["total"]["total"] bytes at `efficiency` x the target's HBM peak
    (`jpa.tools.deviceless.TARGETS`' memory_bandwidth), one token per sequence a step. Returns
    dict(step_ms, tokens_per_s, bandwidth, fits): fits, given kv_bytes (the live KV of every
    sequence) and weight_bytes, whether both fit in memory_fraction of the target's memory (vLLM's
    default gpu_memory_utilization, 0.9; None when not given)."""
    from jpa.tools.deviceless import TARGETS
    t = TARGETS[target]
    bw = t["memory_bandwidth"] * efficiency
    step = s["total"]["total"] / bw
    fits = (None if kv_bytes is None or weight_bytes is None
            else kv_bytes + weight_bytes <= memory_fraction * t["device_memory_size"])
    return dict(step_ms=step * 1e3, tokens_per_s=num_seqs / step, bandwidth=bw, fits=fits)


# ---- Hybrid models (models.hybrid: Gated DeltaNet layers beside paged attention) ----

def recurrent_state_ideal(cache_spec, num_seqs: int) -> int:
    """Bytes one decode step must move for the recurrent states of `cache_spec` (a jpa.kv.spec.CacheSpec): every
    recurrent layer reads and writes each of num_seqs sequences' state once. For a GDN layer that is
    num_seqs x value heads x key dim x value dim x 4 B (f32) x 2, plus the conv state's (conv_dim x (kernel - 1) x 4 B
    x 2)."""
    return 2 * num_seqs * sum(len(g.layers) * g.layout.bytes_per_sequence() for g in cache_spec.groups if not g.paged)


def hybrid_traffic(target: str = "h100", config=None, *, num_seqs: int = 1, context: int = 1024,
                   page_size: int = 16, dtype="bfloat16", hlo: str | None = None) -> dict:
    """Compiles a hybrid model's decode step (`models.hybrid.HybridModel.decode`: the GDN layers' recurrent
    update, the attention layers' paged decode) for a deviceless target (or models `hlo`, the optimized HLO of
    this program compiled before, or for the CPU in tests) at num_seqs sequences of `context` tokens and
    returns dict(summary (`summary` against the ideal: every weight once, the attention layers' live KV once and
    new KV once, the states once each way), top (`top_kernels`), hlo, rows, seconds (the compile's; None given
    hlo)). config: a models.hybrid.HybridConfig
    (default `models.hybrid.QWEN35_27B_SHAPED`)."""
    import jax
    import jax.numpy as jnp

    from jpa.models import hybrid
    from jpa.tools.hlo import hlo_type

    c = config or hybrid.QWEN35_27B_SHAPED
    model = hybrid.HybridModel(c, hybrid.abstract_params(c, dtype), dtype)
    pages_per_seq = -(-context // page_size)
    num_pages = num_seqs * pages_per_seq + 1
    cache_cfg = model.cache_config(num_pages, page_size)
    pool = (cache_cfg.num_layers, c.num_kv_heads, num_pages, page_size, c.head_dim)
    states = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                          jax.eval_shape(lambda: model.init_states(num_seqs)))
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    cache = jax.eval_shape(lambda: __import__("jpa").KVCache.create(cache_cfg))
    args = (model.params, cache, i32(num_seqs), i32(num_seqs), i32(num_seqs), i32(num_seqs, pages_per_seq),
            states, i32(num_seqs))

    def step(params, cache, tokens, seq_lens, slot_mapping, block_tables, states, slots):
        return model.decode(params, cache, tokens, seq_lens, slot_mapping, block_tables, states=states,
                            state_slots=slots)

    seconds = None
    if hlo is None:
        from jpa.tools.deviceless import Compiler

        # compiled as the engine compiles its GPU step: with the XLA options that keep the scanned layers' weights
        # in place (`WEIGHTS_IN_PLACE`)
        rec = Compiler(target).compile(f"hybrid decode x{num_seqs}", step, args, donate_argnums=(1, 6),
                                       pool_shapes=[(pool, cache_cfg.dtype)] * 2, keep_hlo=True,
                                       compiler_options=dict(WEIGHTS_IN_PLACE))
        if "error" in rec:
            raise RuntimeError(f"hybrid decode: {rec['error']}")
        hlo, seconds = rec["hlo"], rec["seconds"]
    leaves = jax.tree_util.tree_leaves(model.params)
    spec_types = lambda xs: {(hlo_type(x.shape, x.dtype).split("[")[0], tuple(x.shape)) for x in xs}
    layers = c.num_layers // c.period
    itemsize = np.dtype(cache_cfg.dtype).itemsize
    live = pages_per_seq * page_size
    spec = Spec(weight_types=weight_types_of(model.params, (layers,)), pool_types=spec_types(
        [jax.ShapeDtypeStruct(pool, cache_cfg.dtype)]), vocab_size=c.vocab_size,
        kv_read_per_call=num_seqs * live * c.num_kv_heads * c.head_dim * itemsize,
        state_types=spec_types(jax.tree_util.tree_leaves(states)))
    w_item = np.dtype(dtype).itemsize
    weights = sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in leaves)
    if not c.tie_embeddings:  # the table: only the looked-up rows
        weights -= c.vocab_size * c.d_model * w_item - num_seqs * c.d_model * w_item
    per_token = 2 * c.num_kv_heads * c.head_dim * itemsize * cache_cfg.num_layers
    ideal = dict(weights=weights, kv_read=num_seqs * live * per_token, kv_write=num_seqs * per_token,
                 state=recurrent_state_ideal(model.cache_spec(), num_seqs))
    rows = traffic(hlo, spec)
    return dict(summary=summary(rows, ideal), top=top_kernels(rows, 12), hlo=hlo, rows=rows, seconds=seconds)
