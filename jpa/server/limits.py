"""Limits on structured-output constraints, checked before llguidance sees them, and the bounded
worker that compiles them.

Why: llguidance (Rust) compiles grammars recursively. A Lark grammar whose rules chain ~3000 deep,
or a JSON schema whose `$defs` chain ~1000 objects deep, overflows an 8 MiB thread stack: SIGSEGV,
the whole server gone, no log line. A GBNF grammar of 5000 rules spends 25 s converting. Choice
lists past llguidance's row limit (2000), counted repetitions such as `a{1000000}` and schemas with
no finite instance (a recursive property that is required) compile, then fail in the middle of
generation. Two guards make all of that a 400 naming the request field:

1. `check_constraint` (cheap, pure Python, no recursion on the input): size, rule count, nesting
   depth (brackets, schema nesting, `$ref` chains), counted repetitions and choice counts are
   bounded by `ConstraintLimits`, and a JSON schema must have a finite instance. The bounds sit far
   below what overflows an 8 MiB stack (measured: Lark chains of 2500 rules and `$defs` chains of
   800 objects still compile there), so the engine thread, which compiles the request's matcher
   again with the default stack, is safe too.
2. `CompileGuard`: the compile itself (grammar text, validation, a matcher over the tokenizer and its
   first mask) runs on a few worker threads of their own with a large stack (`threading.stack_size`),
   never on the event loop; a caller waits at most `compile_timeout` seconds (then 400), and when
   every worker is busy and the queue is full, a request is refused (503) rather than queued without
   bound.
"""

import concurrent.futures
import dataclasses
import json
import queue
import re
import threading
import time
import urllib.parse

import numpy as np

from jpa.server.protocol import APIError


@dataclasses.dataclass(frozen=True)
class ConstraintLimits:
    """Bounds on one request's constraint (see the module doc).

    Attributes:
      max_chars: characters of a grammar, a regex, a JSON schema's JSON text, or all choices together.
      max_rules: rules of a grammar (Lark or GBNF); subschemas (objects) of a JSON schema / 10.
      max_depth: nesting depth: brackets in a grammar or regex, subschemas in a JSON schema (through
        `$ref`s: the longest chain of schema objects a compile walks).
      max_choices: options of a `choice` list.
      max_repeat: the largest counted repetition (`{n}`, `{n,m}`, product of nested ones in a regex)
        and the largest minLength / minItems / minProperties of a schema.
      compile_timeout: seconds a request waits for its constraint to compile (then a 400).
      workers: compile threads; queue: compiles that may wait for one (beyond: 503).
      stack_bytes: stack of each compile thread.
    """
    max_chars: int = 256 * 1024
    max_rules: int = 1000
    max_depth: int = 128
    max_choices: int = 1000
    max_repeat: int = 10_000
    compile_timeout: float = 10.0
    workers: int = 2
    queue: int = 16
    stack_bytes: int = 256 * 2 ** 20

    def __post_init__(self):
        for name in ("max_chars", "max_rules", "max_depth", "max_choices", "max_repeat", "workers", "queue"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"ConstraintLimits.{name} must be an int >= 1; got {v!r}")
        if not (isinstance(self.compile_timeout, (int, float)) and 0 < self.compile_timeout < float("inf")):
            raise ValueError(f"ConstraintLimits.compile_timeout must be a positive number of seconds; got "
                             f"{self.compile_timeout!r}")
        if self.stack_bytes < 32 * 2 ** 20:
            raise ValueError(f"ConstraintLimits.stack_bytes must be >= 32 MiB; got {self.stack_bytes!r}")


# ---------------------------------------------------------------------- checks before llguidance

def _fail(param: str, what: str) -> APIError:
    return APIError(400, f"'{param}': {what}"[:600], param=param.split(".")[0], code="constraint_too_complex")


_RULE = re.compile(r"^[ \t]*[?!@]?[A-Za-z_][\w.-]*(?:\.-?\d+)?[ \t]*(?::|::=)", re.M)
_COUNT = re.compile(r"\{[ \t]*(\d+)[ \t]*(?:,[ \t]*(\d*)[ \t]*)?\}")


def _bracket_depth(text: str) -> int:
    """Deepest nesting of ( [ { outside quoted strings (escapes skipped), in one linear pass."""
    depth = best = 0
    quote, i, n = None, 0, len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if quote is not None:
            if c == quote:
                quote = None
        elif c in "\"'" and quote is None:
            quote = c
        elif c in "([{":
            depth += 1
            best = max(best, depth)
        elif c in ")]}":
            depth = max(depth - 1, 0)
        i += 1
    return best


def _repeats(text: str):
    """The counts of every `{n}` / `{n,m}` in text (m, else n)."""
    for m in _COUNT.finditer(text):
        lo, hi = m.group(1), m.group(2)
        yield max(int(lo[:12]), int(hi[:12]) if hi else 0)


def _regex_expansion(pattern: str) -> tuple[int, int]:
    """(nesting depth of groups, largest product of nested counted repetitions) of a regex."""
    stack = [1]          # per open group: the largest repetition product inside it
    last = 1             # the product of the atom just read (a quantifier multiplies it)
    depth = best_depth = 0
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            last, i = 1, i + 2
            continue
        if c == "[":             # a class: one atom (skip to its closing bracket)
            j = i + 1
            if j < n and pattern[j] == "^":
                j += 1
            if j < n and pattern[j] == "]":
                j += 1
            while j < n and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            last, i = 1, j + 1
            stack[-1] = max(stack[-1], 1)
            continue
        if c == "(":
            stack.append(1)
            depth += 1
            best_depth = max(best_depth, depth)
            i += 1
            continue
        if c == ")":
            inner = stack.pop() if len(stack) > 1 else 1
            depth = max(depth - 1, 0)
            last = inner
            stack[-1] = max(stack[-1], last)
            i += 1
            continue
        if c == "{":
            m = _COUNT.match(pattern, i)
            if m:
                k = max(int(m.group(1)[:12]), int(m.group(2)[:12]) if m.group(2) else 0)
                last *= max(k, 1)
                stack[-1] = max(stack[-1], last)
                i = m.end()
                continue
        last = 1
        i += 1
    return best_depth, max(stack)


def _check_text(param: str, text: str, limits: ConstraintLimits, what: str) -> None:
    if len(text) > limits.max_chars:
        raise _fail(param, f"the {what} has {len(text)} characters; at most {limits.max_chars} are accepted")
    depth = _bracket_depth(text)
    if depth > limits.max_depth:
        raise _fail(param, f"the {what} nests brackets {depth} deep; at most {limits.max_depth} is accepted")
    big = max(_repeats(text), default=0)
    if big > limits.max_repeat:
        raise _fail(param, f"the {what} repeats something {big} times; at most {limits.max_repeat} is accepted")


def check_regex(param: str, pattern: str, limits: ConstraintLimits) -> None:
    _check_text(param, pattern, limits, "regex")
    _, product = _regex_expansion(pattern)
    if product > limits.max_repeat:
        raise _fail(param, f"the regex's nested repetitions multiply to {product}; at most {limits.max_repeat} "
                           f"is accepted")


def check_grammar(param: str, grammar: str, limits: ConstraintLimits) -> None:
    _check_text(param, grammar, limits, "grammar")
    rules = len(_RULE.findall(grammar))
    if rules > limits.max_rules:
        raise _fail(param, f"the grammar has {rules} rules; at most {limits.max_rules} are accepted")


def check_choice(param: str, choice, limits: ConstraintLimits) -> None:
    if not isinstance(choice, (list, tuple)):
        return   # StructuredOutputs names the type error
    if len(choice) > limits.max_choices:
        raise _fail(param, f"{len(choice)} choices; at most {limits.max_choices} are accepted")
    chars = sum(len(c) for c in choice if isinstance(c, str))
    if chars > limits.max_chars:
        raise _fail(param, f"the choices have {chars} characters; at most {limits.max_chars} are accepted")


_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_SUBSCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
                  "unevaluatedProperties", "unevaluatedItems", "additionalItems")


def _children(node: dict):
    """(key, subschema) pairs of a schema object."""
    for k in _SUBSCHEMA_ONE:
        v = node.get(k)
        if isinstance(v, dict):
            yield k, v
        elif k == "items" and isinstance(v, list):
            yield from ((k, x) for x in v if isinstance(x, dict))
    for k in _SUBSCHEMA_LISTS:
        v = node.get(k)
        if isinstance(v, list):
            yield from ((k, x) for x in v if isinstance(x, dict))
    for k in _SUBSCHEMA_MAPS:
        v = node.get(k)
        if isinstance(v, dict):
            yield from ((k, x) for x in v.values() if isinstance(x, dict))


def _resolve(root: dict, ref):
    """The subschema a local `$ref` ("#", "#/$defs/x", ...) points to, or None."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        return None
    node = root
    for part in ref[1:].split("/")[1:] if ref != "#" else []:
        part = urllib.parse.unquote(part).replace("~1", "/").replace("~0", "~")   # a URI fragment's pointer
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node if isinstance(node, dict) else None


def _json_depth(value, limit: int) -> int:
    """Nesting depth of a JSON value (iterative; stops counting past limit)."""
    best, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            best = max(best, d)
            if best > limit:
                return best
            stack.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return best


def check_schema(param: str, schema, limits: ConstraintLimits) -> None:
    """Size, depth (through $refs), repetition bounds and a finite instance of a JSON schema."""
    if isinstance(schema, str):
        if len(schema) > limits.max_chars:
            raise _fail(param, f"the schema has {len(schema)} characters; at most {limits.max_chars} are accepted")
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError):
            return   # StructuredOutputs names it
    if not isinstance(schema, dict):
        return
    depth = _json_depth(schema, 2 * limits.max_depth)
    if depth > 2 * limits.max_depth:
        raise _fail(param, f"the schema nests more than {2 * limits.max_depth} JSON levels deep")
    text = json.dumps(schema)
    if len(text) > limits.max_chars:
        raise _fail(param, f"the schema has {len(text)} characters of JSON; at most {limits.max_chars} are accepted")
    # Every schema object once, with the $refs among them.
    nodes, order, todo = {}, [], [schema]
    while todo:
        node = todo.pop()
        if id(node) in nodes:
            continue
        nodes[id(node)] = node
        order.append(node)
        todo.extend(c for _, c in _children(node))
    if len(nodes) > 10 * limits.max_rules:
        raise _fail(param, f"the schema has {len(nodes)} subschemas; at most {10 * limits.max_rules} are accepted")
    for node in order:
        for key in ("minLength", "minItems", "minProperties", "maxLength", "maxItems", "maxProperties"):
            v = node.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and key.startswith("min") and v > limits.max_repeat:
                raise _fail(param, f"'{key}' {v} in the schema; at most {limits.max_repeat} is accepted")
        if isinstance(node.get("pattern"), str):
            check_regex(param, node["pattern"], limits)
        if "$ref" in node and node["$ref"] != "#" and _resolve(schema, node["$ref"]) is None \
                and isinstance(node["$ref"], str) and node["$ref"].startswith("#"):
            raise _fail(param, f"'$ref' {node['$ref'][:100]!r} points to nothing in the schema")
    _check_ref_depth(param, schema, nodes, limits)
    _check_finite(param, schema, order, limits)


def _edges(root: dict, node: dict):
    """Subschemas a compile of node walks into: its children and its $ref's target."""
    out = [c for _, c in _children(node)]
    target = _resolve(root, node.get("$ref"))
    if target is not None:
        out.append(target)
    return out


def _check_ref_depth(param: str, root: dict, nodes: dict, limits: ConstraintLimits) -> None:
    """The longest chain of schema objects (children and $ref targets, a cycle counted once): an
    iterative depth-first search with memoized heights."""
    height: dict[int, int] = {}
    on_stack: set[int] = set()
    stack = [(root, iter(_edges(root, root)), 0)]
    on_stack.add(id(root))
    while stack:
        node, it, best = stack[-1]
        child = next(it, None)
        if child is None:
            stack.pop()
            on_stack.discard(id(node))
            height[id(node)] = best + 1
            if best + 1 > limits.max_depth:
                raise _fail(param, f"the schema nests subschemas (through $ref) more than {limits.max_depth} deep")
            if stack:
                p, pit, pbest = stack[-1]
                stack[-1] = (p, pit, max(pbest, best + 1))
            continue
        if id(child) in on_stack:
            continue
        if id(child) in height:
            stack[-1] = (node, it, max(best, height[id(child)]))
            continue
        if len(stack) > limits.max_depth:
            raise _fail(param, f"the schema nests subschemas (through $ref) more than {limits.max_depth} deep")
        on_stack.add(id(child))
        stack.append((child, iter(_edges(root, child)), 0))


def _types(node: dict) -> set | None:
    t = node.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list):
        return {x for x in t if isinstance(x, str)}
    return None


def _check_finite(param: str, root: dict, order: list, limits: ConstraintLimits) -> None:
    """400 when the schema has no finite instance (e.g. a property that is the schema itself and is
    required): a least fixpoint of "has a finite instance" over the schema objects. Conservative: a
    construct it does not model counts as finite (llguidance then judges)."""
    finite: set[int] = set()

    def ok(node) -> bool:
        return id(node) in finite

    def can_be_finite(node: dict) -> bool:
        if node.get("$ref") is not None:
            target = _resolve(root, node["$ref"])
            if target is not None and not ok(target):
                return False
        if any(isinstance(node.get(k), list) and node[k] and not any(ok(x) for x in node[k] if isinstance(x, dict))
               for k in ("anyOf", "oneOf")):
            return False
        if isinstance(node.get("allOf"), list) and not all(ok(x) for x in node["allOf"] if isinstance(x, dict)):
            return False
        types = _types(node)
        props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        required = node.get("required") if isinstance(node.get("required"), list) else []
        objects = types is None or "object" in types
        object_ok = all(ok(props[r]) for r in required if isinstance(r, str) and isinstance(props.get(r), dict))
        items = node.get("items")
        min_items = node.get("minItems", 0)
        arrays = types is None or "array" in types
        array_ok = not (isinstance(items, dict) and isinstance(min_items, int) and min_items > 0 and not ok(items))
        if types is not None:
            other = types - {"object", "array"}
            return bool(other) or (objects and object_ok) or (arrays and array_ok)
        # No type: the keywords say what it is (properties -> object, items -> array), else anything.
        if props or required:
            return object_ok
        if isinstance(items, dict):
            return array_ok
        return True

    changed = True
    rounds = 0
    while changed and rounds <= len(order) + 1:
        changed, rounds = False, rounds + 1
        for node in order:
            if id(node) not in finite and can_be_finite(node):
                finite.add(id(node))
                changed = True
    if not ok(root):
        raise _fail(param, "the schema has no finite instance (a required property or item refers back to the "
                           "schema itself); no output could ever complete")


def check_constraint(param: str, kind: str, value, limits: ConstraintLimits) -> None:
    """400 naming the field when a constraint of `kind` (json, regex, choice, grammar) is beyond the
    limits; param: the request field that holds it (e.g. "structured_outputs.regex")."""
    if kind == "json":
        check_schema(param, value, limits)
    elif kind == "regex" and isinstance(value, str):
        check_regex(param, value, limits)
    elif kind == "grammar" and isinstance(value, str):
        check_grammar(param, value, limits)
    elif kind == "choice":
        check_choice(param, value, limits)


# ---------------------------------------------------------------------- the compile worker

class CompileGuard:
    """Compiles constraints on worker threads with a large stack, with a deadline per request.

    `run(param, fn)` runs fn() on a worker and returns its result; fn raising ValueError is a 400
    naming `param`. It is called from a request's worker thread (not the event loop) and blocks it
    at most `limits.compile_timeout` seconds. A compile past the deadline goes on on its worker (a
    thread cannot be stopped) but its request is answered 400 at once; compiles past the deadline
    occupy workers, so at most `limits.queue` more may wait, then requests get 503.
    """

    def __init__(self, limits: ConstraintLimits = ConstraintLimits()):
        self.limits = limits
        self._jobs: queue.Queue = queue.Queue(maxsize=limits.queue)
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self.timeouts = 0

    def _start(self) -> None:
        with self._lock:
            if self._threads:
                return
            old = threading.stack_size()
            try:
                # Threads take the stack size in force when they start: set it, start them, restore.
                threading.stack_size(self.limits.stack_bytes)
                for i in range(self.limits.workers):
                    t = threading.Thread(target=self._work, name=f"jpa-grammar-{i}", daemon=True)
                    t.start()
                    self._threads.append(t)
            finally:
                threading.stack_size(old)

    def _work(self) -> None:
        while True:
            fn, future = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as e:  # handed to the waiting request
                future.set_exception(e)

    def run(self, param: str, fn):
        self._start()
        future: concurrent.futures.Future = concurrent.futures.Future()
        try:
            self._jobs.put_nowait((fn, future))
        except queue.Full:
            raise APIError(503, "too many structured-output constraints are compiling; try again shortly",
                           type="server_error", code="overloaded", headers={"Retry-After": "1"}) from None
        t0 = time.monotonic()
        try:
            return future.result(timeout=self.limits.compile_timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            self.timeouts += 1
            raise _fail(param, f"the constraint did not compile within {self.limits.compile_timeout:g} s "
                               f"({time.monotonic() - t0:.1f} s)") from None


DRY_RUN_STEPS = 48
_ROW = re.compile(r"row has (\d+) items; max is (\d+)")
# Tokens a dry run prefers, in order: those that open structures (where a grammar's rows are widest:
# an object with hundreds of optional properties right after its `{`), close strings, and separate.
_DRY_RUN_PREFERRED = '{[":,}]0'


def dry_run(grammars, matcher, steps: int = DRY_RUN_STEPS) -> str | None:
    """Walks `matcher` (a fresh llguidance LLMatcher) `steps` tokens into its grammar, each step the
    first allowed of `_DRY_RUN_PREFERRED` (else the allowed token of lowest id); returns llguidance's
    error (shortened) if one of its limits is hit on the way (e.g. "Current row has 2207 items; max is
    2000": an object with ~550 optional properties, right after its `{`), else None. Such grammars
    compile and pass the first mask, then failed in the middle of generation."""
    from jpa.engine.structured import Matcher, _short

    llt = grammars.llg_tokenizer()
    preferred = []
    for c in _DRY_RUN_PREFERRED:
        ids = llt.tokenize_str(c)
        if len(ids) == 1:
            preferred.append(ids[0])
    row = np.zeros((grammars.words,), np.int32)
    wrapped = Matcher(matcher)
    for _ in range(steps):
        if matcher.is_stopped() or matcher.is_error():
            break
        row[:] = 0
        wrapped.fill(row)
        if matcher.is_error():
            break
        bits = row.view(np.uint32)
        allowed = lambda t: bool((bits[t >> 5] >> (t & 31)) & 1)  # noqa: E731
        token = next((t for t in preferred if allowed(t)), None)
        if token is None:
            nz = np.flatnonzero(bits)
            if not len(nz):
                break
            word = int(nz[0])
            token = word * 32 + (int(bits[word]) & -int(bits[word])).bit_length() - 1
        if not matcher.consume_token(token):
            break
    return _short(matcher.get_error()) if matcher.is_error() else None


def first_mask_allows_something(grammars, spec) -> str | None:
    """Builds spec's matcher over the tokenizer (as the engine will) and computes its first mask;
    returns an error message (llguidance's, shortened) or None. `grammars`: a
    jpa.engine.structured.Grammars owned by the server (only its tokenizer is used)."""
    import llguidance as llg

    from jpa.engine.structured import Matcher, _short

    m = llg.LLMatcher(grammars.llg_tokenizer(), spec.grammar_text(), log_level=0)
    if m.is_error():
        return _short(m.get_error())
    row = np.zeros((grammars.words,), np.int32)
    Matcher(m).fill(row)
    if m.is_error():
        return _short(m.get_error())
    if not row.any():
        return "no token can start an output that matches it"
    error = dry_run(grammars, llg.LLMatcher(grammars.llg_tokenizer(), spec.grammar_text(), log_level=0))
    if error:
        m = _ROW.search(error)
        if m:   # llguidance's max_items_in_row, named (an object with hundreds of optional properties)
            return (f"the constraint's parser needs {m.group(1)} items in one row a few tokens in; llguidance "
                    f"allows {m.group(2)} (its row limit, max_items_in_row): use fewer optional properties or "
                    f"alternatives at one place")
        return f"the constraint exceeds a limit of llguidance a few tokens in: {error}"
    return None
