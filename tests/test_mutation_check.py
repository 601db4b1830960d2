"""The mutation check's own machinery (jpa/tools/mutation.py, run as `jpa tools mutation`), on a
tiny git repository (not the full run, which
takes many minutes): patterns that do not apply are reported as broken, a fault the selection
sees is caught, one it does not see is missed, and --dry-run lists today's mutations."""

import json
import subprocess

import pytest


@pytest.fixture(scope="module")
def mc():
    from jpa.tools import mutation

    return mutation


@pytest.fixture
def tiny_repo(tmp_path):
    """A git repository with one module and one test of it (files staged, not committed)."""
    repo = tmp_path / "repo"
    (repo / "tests").mkdir(parents=True)
    (repo / "arith.py").write_text("def add(a, b):\n    return a + b  # sum\n\n\ndef unused():\n    return 1\n")
    (repo / "tests" / "test_arith.py").write_text("from arith import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n")
    (repo / "untracked.txt").write_text("not copied\n")
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run(["git", "-C", str(repo), "add", "arith.py", "tests/test_arith.py"], check=True)
    return repo


def test_a_pattern_that_does_not_apply_is_broken(mc, tiny_repo):
    for old, why in [("return a - b", "found 0 times"), ("return", "found 2 times")]:
        rec = mc.check(mc.Mutation("m", "arith.py", old, "x", ("tests",), "test"), tiny_repo, timeout=60)
        assert rec["status"] == "broken" and why in rec["detail"] and rec["seconds"] == 0.0, rec
    rec = mc.check(mc.Mutation("m", "nope.py", "a", "b", ("tests",), "test"), tiny_repo, timeout=60)
    assert rec["status"] == "broken" and "nope.py: no such file" in rec["detail"]


@pytest.mark.bench
def test_caught_missed_and_broken_on_a_tiny_repo(mc, tiny_repo, tmp_path, capsys):
    mutations = (
        mc.Mutation("times", "arith.py", "return a + b", "return a * b", ("tests/test_arith.py",), "+ becomes *"),
        mc.Mutation("dead", "arith.py", "return 1\n", "return 2\n", ("tests/test_arith.py",), "untested code"),
        mc.Mutation("stale", "arith.py", "return a - b", "return a", ("tests/test_arith.py",), "a stale pattern"),
    )
    out = tmp_path / "r.json"
    rc = mc.main(["--repo", str(tiny_repo), "--json", str(out), "--timeout", "120"], mutations=mutations)
    report = json.loads(out.read_text())
    assert rc == 1
    assert report["baseline"]["status"] == "passed"
    got = {r["name"]: r for r in report["results"]}
    assert [r["status"] for r in report["results"]] == ["caught", "missed", "broken"]
    assert got["times"]["failed"] == ["tests/test_arith.py::test_add"]
    table = capsys.readouterr().out
    assert "times" in table and "tests/test_arith.py::test_add" in table and "found 0 times" in table
    # the repository itself is untouched; untracked files are not copied
    assert "return a + b" in (tiny_repo / "arith.py").read_text()
    assert mc.tracked_files(tiny_repo) == ["arith.py", "tests/test_arith.py"]


def test_dry_run_lists_the_mutations_and_they_apply_to_today_code(mc, tmp_path, capsys):
    out = tmp_path / "dry.json"
    rc = mc.main(["--dry-run", "--json", str(out)])
    listing = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert [r["name"] for r in report["results"]] == [m.name for m in mc.MUTATIONS]
    assert all(m.name in listing for m in mc.MUTATIONS)
    stale = [r["detail"] for r in report["results"] if r["status"] != "applies"]
    assert rc == 0 and not stale, f"update the patterns in jpa/tools/mutation.py: {stale}"


def test_unknown_mutation_name_is_a_usage_error(mc):
    with pytest.raises(SystemExit) as e:
        mc.main(["--only", "no-such-fault", "--dry-run"])
    assert e.value.code == 2
