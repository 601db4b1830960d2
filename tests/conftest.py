"""Test-session setup: the tests run on the CPU.

With the `gpu` extra installed (CUDA compile-only packages, no driver), JAX would try to start a
CUDA backend and log a cuDNN error on every import; the deviceless compile tier does not need
one (it asks for a compile-only topology explicitly).
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402


def _cpu_programs_at_llvm_o0():
    """The tests compile their CPU programs with XLA's backend (LLVM) optimization level 0:
    XLA's HLO passes are unchanged, only the machine code of each CPU kernel is less optimized.
    Compiling the suite's programs is most of its CPU time and their inputs are tiny, so this cuts
    the suite's CPU time by about a third (measured on tests/test_engine.py and test_ragged.py:
    148 -> 104 CPU seconds). Only CPU compiles: a deviceless GPU compile keeps its options (its
    registers and spills are what the GPU tier checks). JPA_TEST_CPU_OPT=1 keeps XLA's default.
    Subprocesses (servers, the CLI) are not affected."""
    if os.environ.get("JPA_TEST_CPU_OPT") == "1":
        return
    from jax._src import compiler  # one call site (pxla) compiles every jitted program

    compile_or_get_cached = compiler.compile_or_get_cached

    def compile_cpu_at_o0(backend, computation, devices, compile_options, *args, **kwargs):
        if backend.platform == "cpu":
            compile_options.executable_build_options.debug_options.xla_backend_optimization_level = 0
        return compile_or_get_cached(backend, computation, devices, compile_options, *args, **kwargs)

    compiler.compile_or_get_cached = compile_cpu_at_o0


_cpu_programs_at_llvm_o0()


@pytest.fixture(autouse=True)
def _persistent_cache_stays_with_its_test():
    """A test that runs `jpa generate`/`serve` in-process turns JAX's persistent compilation cache on for
    the whole process (a global): turn it off again after that test, so no later test writes its programs
    to a cache directory it did not ask for (one such write aborted a full-suite run inside XLA's
    executable serialization while another process used the same ~/.cache/jpa/xla)."""
    import jax

    before = jax.config.jax_compilation_cache_dir
    yield
    if jax.config.jax_compilation_cache_dir != before:
        from jax._src import compilation_cache  # no public reset; the cache object is made once per process

        jax.config.update("jax_compilation_cache_dir", before)
        compilation_cache.reset_cache()


@pytest.fixture(scope="session")
def ctx_model():
    """(GPTForEngine, tokenizer): tiny-llama whose greedy output depends on the context
    (tests/engine_util.context_llama), the model of the engine equivalence tests."""
    from jpa.testing.engine import context_llama

    return context_llama(seed=1)


@pytest.fixture(scope="session")
def engines(ctx_model):
    """Engines over ctx_model shared by the whole session, one per EngineConfig (each compiles
    its step once): `engines.get(**config)`, `engines.reference(prompts, params)`."""
    from jpa.testing.engine import Engines

    return Engines(*ctx_model)


def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` (`./run test`), with tests/tiers.py's SHARED groups of files each one unit of work (a
    worker compiles the engine programs a group shares once), and the units handed out in collection order
    (SLOW_FIRST's files first) rather than pytest-xdist's default of the unit with most tests first."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    from tiers import scope

    class SharedEngines(LoadFileScheduling):
        def _split_scope(self, nodeid):
            return scope(nodeid)

    config.option.loadscopereorder = False
    return SharedEngines(config, log)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Tests named in tests/tiers.py's BENCH run in CI's bench tier (`./run test -m bench`), not in
    `./run test`: this runs before `-m 'not bench'` deselects (tryfirst). An entry names a test
    (every parametrization) or one parametrization by its node id."""
    from tiers import BENCH, SOAK, moved, slow_first

    for item in items:
        if moved(item.nodeid, BENCH):
            item.add_marker(pytest.mark.bench)
        if moved(item.nodeid, SOAK):
            item.add_marker(pytest.mark.bench)
            item.add_marker(pytest.mark.soak)
    items.sort(key=lambda item: slow_first(item.nodeid))   # stable: each file keeps its own order
    # An entry naming one parametrization must name one that exists: checked wherever its test was
    # collected with more than one parametrization (not when a single node id was asked for).
    ids = {item.nodeid for item in items}
    counts = {}
    for nodeid in ids:
        base = nodeid.split("[", 1)[0]
        counts[base] = counts.get(base, 0) + 1
    stale = [n for n in {**BENCH, **SOAK} if "[" in n and counts.get(n.split("[", 1)[0], 0) > 1 and n not in ids]
    if stale:
        raise pytest.UsageError(f"tests/tiers.py names parametrizations that were not collected: {stale}")
