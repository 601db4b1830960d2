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


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """A test marked `soak` is in the bench tier too: `-m "not bench"` (the main tier) leaves it out. Runs
    before `-m` deselects (tryfirst)."""
    for item in items:
        if item.get_closest_marker("soak"):
            item.add_marker(pytest.mark.bench)


def pytest_xdist_make_scheduler(config, log):
    """`./run test`'s `--dist loadfile`, with the files whose module `pytestmark` names an `xdist_group` one unit of
    work per group (a worker compiles the engine programs those files share once). Kept because xdist's own
    `--dist loadgroup` does not group under pytest 9.2 (pytest-dev/pytest-xdist#1386; measured here: a file's
    tests marked with one group ran on both of 2 workers); the units are handed out largest first (xdist's order)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    from marks import file_group

    class FileGroups(LoadFileScheduling):
        def _split_scope(self, nodeid):
            return file_group(config.rootpath, nodeid.split("::", 1)[0])

    return FileGroups(config, log)
