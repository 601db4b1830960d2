"""The layering of docs/architecture.md, checked on the source: every `import` in the package (at module level
or inside a function) goes from a layer to itself or to a layer it may use. A wrong arrow (the
engine importing the models layer, a kernel importing an op, the library importing a script) fails
here with the file and line."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).parents[1]

# layer -> the layers its modules may import (itself included). The engine never imports the models
# layer: it takes a model through jpa.engine.EngineModel and the application layer wires one in.
ALLOWED = {
    "core": {"core"},
    "pallas": {"core", "pallas"},
    "ops": {"core", "pallas", "ops"},
    "kv": {"core", "ops", "kv"},
    "models": {"core", "ops", "kv", "models"},
    "engine": {"core", "ops", "kv", "engine"},
    "server": {"core", "engine", "server"},
    "testing": {"core", "pallas", "ops", "kv", "models", "engine", "testing"},
    # tools sit on top, beside the application (scripts, tests and `jpa tools` use them; nothing in jpa imports them:
    # jpa/cli/main.py names jpa.tools.cli as a string, run only by `jpa tools`)
    "tools": {"core", "pallas", "ops", "kv", "models", "engine", "testing", "tools", "app"},
    "app": {"core", "pallas", "ops", "kv", "models", "engine", "server", "app"},
}
APP = {"cli", "llm", "args", "__main__"}


def layer_of_module(name: str) -> str | None:
    """The layer of a dotted module name inside jpa (None: outside jpa, or the package facade)."""
    parts = name.split(".")
    if parts[0] != "jpa" or len(parts) == 1:
        return None
    return "app" if parts[1] in APP else parts[1]


def sources():
    """(path, module name) of every file of the installed package: jpa/ and models/ (as jpa.models)."""
    for path in sorted((ROOT / "jpa").rglob("*.py")):
        yield path, "jpa." + ".".join(path.relative_to(ROOT / "jpa").with_suffix("").parts)
    for path in sorted((ROOT / "models").rglob("*.py")):
        yield path, "jpa.models." + ".".join(path.relative_to(ROOT / "models").with_suffix("").parts)


def imports(path: pathlib.Path, module: str):
    """(line, absolute module name) of every import in the file."""
    package = module.rsplit(".", 1)[0] if not path.name == "__init__.py" else module
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            yield node.lineno, mod
            for a in node.names:  # `from jpa import engine` names a module too
                yield node.lineno, f"{mod}.{a.name}"


def test_every_import_follows_the_layers():
    wrong, seen = [], set()
    for path, module in sources():
        own = layer_of_module(module.replace(".__init__", ""))
        if own is None:
            continue  # jpa/__init__.py: the facade re-exports the public names
        seen.add(own)
        for line, target in imports(path, module):
            if target.split(".")[0] in ("models", "scripts", "tests"):
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {target} (outside the package)")
                continue
            to = layer_of_module(target)
            if to is not None and to in ALLOWED and to not in ALLOWED[own]:
                wrong.append(f"{path.relative_to(ROOT)}:{line}: {own} imports {target} ({to})")
    assert seen == set(ALLOWED), f"layers found {sorted(seen)}; the table names {sorted(ALLOWED)}"
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def test_the_checker_sees_a_wrong_arrow(tmp_path):
    """The rule is not vacuous: an engine module importing the models layer, inside a function, and a
    relative import reaching up from a kernel are both found."""
    src = tmp_path / "runner.py"
    src.write_text("def f():\n    from jpa.models import gpt\n")
    found = [t for _, t in imports(src, "jpa.engine.runner")]
    assert "jpa.models" in found and layer_of_module("jpa.models.gpt") not in ALLOWED["engine"]
    src.write_text("from ...ops import reference\n")
    found = [t for _, t in imports(src, "jpa.pallas.mosaic.decode")]
    assert "jpa.ops.reference" in found and "ops" not in ALLOWED["pallas"]


def test_no_test_or_script_edits_sys_path_or_imports_a_script():
    """Scripts and tests import the installed package (jpa, jpa.models, jpa.testing, jpa.tools), never each
    other, and never a top-level `models` (it exists only in a checkout, not in an installed jpa)."""
    wrong = []
    for path in sorted(p for d in ("scripts", "benchmarks", "tests") for p in (ROOT / d).glob("*.py")):
        if path.name == "test_layers.py":
            continue
        text = path.read_text(encoding="utf-8")
        if "sys.path" in text:
            wrong.append(f"{path.relative_to(ROOT)} edits sys.path")
        for line, target in imports(path, "x.x"):
            top = target.split(".")[0]
            if top in ("scripts", "benchmarks", "tests", "models") or (path.parent.name == "tests" and any(
                    (ROOT / d / f"{top}.py").exists() for d in ("scripts", "benchmarks"))):
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert not wrong, "\n".join(wrong)


def test_no_module_imports_itself_through_others():
    """No import circle between the package's modules (imports inside functions count too): a circle means two
    modules that cannot be read, tested or moved apart."""
    mods = dict((m.replace(".__init__", ""), p) for p, m in sources())
    graph = {m: set() for m in mods}
    for m, path in mods.items():
        for _, target in imports(path, m if not path.name == "__init__.py" else m + ".__init__"):
            while target and target not in mods:  # `from a.b import c` names a.b.c; a package names its __init__
                target = target.rpartition(".")[0]
            if target and target != m and not (m.startswith(target + ".") and mods[target].name == "__init__.py"):
                graph[m].add(target)
    # Tarjan's strongly connected components: a component of more than one module is a circle.
    index, low, stack, on, circles, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in circles)
