"""Which tests run where: the main tier (`./run test`, <= 10 minutes from a clean clone) and CI's
bench tier (`./run test -m bench`, after it in .ci/run).

Files named tests/test_bench_*.py are bench-tier by their own `pytestmark`. BENCH below moves single
tests (or single parametrizations) of main-tier files to the bench tier: each entry says what it
costs (seconds on the 2-core CI VM, quiet) and which main-tier test keeps the same property fast.
A test is moved when it is a second or third case of a property the main tier already checks, a
grid, or a long end-to-end run; never the only test of a property.

tests/test_layers.py checks that every entry still names a test.
"""

BENCH = {
    # --- multihost: jpa generate over 2 processes (test_generate_over_two_processes_equals_one) stays
    "tests/test_multihost.py::test_serve_over_two_processes_and_a_hung_peer":
        "45 s: jpa serve over 2 processes, SIGSTOP of a peer; the watchdog stays in "
        "test_followers_only_follow_and_watchdog",
}


def moved(nodeid: str, table: dict = BENCH) -> bool:
    """Whether nodeid (`path::test` or `path::test[param]`) is named by an entry of table."""
    base = nodeid.split("[", 1)[0]
    return nodeid in table or base in table
