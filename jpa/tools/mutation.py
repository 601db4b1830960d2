"""Shows that the test suite catches deliberate faults in the engine (mutation testing, by hand).

Each mutation below is one exact text substitution in one file and the pytest selection that
must catch it. For each, the repository's tracked files (`git ls-files`, as they are in the
working tree) are copied into a temporary directory, the substitution is applied there, and
`python -m pytest -x -q <selection>` runs in that copy under a time limit. Outcomes:

  caught   pytest failed (some test saw the fault)
  missed   pytest passed: the suite does not catch this fault
  broken   the old text is not in the file exactly once (the code changed: update the pattern)
  error    pytest could not run the selection (exit code 2-5: collection error, no tests, ...)
  timeout  the run exceeded --timeout

First, unless --no-baseline, every selection runs once on an unmutated copy: a selection that
fails without a fault proves nothing. The exit code is 1 if the baseline fails or
any mutation is not caught, else 0.

The command is `jpa tools mutation` (this module's `main`); tests/test_mutation_check.py tests
the machinery on a tiny repository. When the engine code changes, update `old` (and `new`) of the
mutations here: each is the exact
text of today's code, kept short, so `--dry-run` (which applies every pattern but runs nothing)
points at the one that went stale.

Examples:
  jpa tools mutation --dry-run
  jpa tools mutation --json results/mutation_check.json
  jpa tools mutation --only skipped-copy-on-write --all-failures
"""

import argparse
import dataclasses
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

# The source checkout this module sits in (jpa/tools/mutation.py): the clone whose tests run.
REPO = pathlib.Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True)
class Mutation:
    """One deliberate fault: replace `old` (exactly once in `file`) by `new`; `selection` (pytest
    arguments: paths, node ids, -k) must fail on the result."""
    name: str
    file: str
    old: str
    new: str
    selection: tuple[str, ...]
    why: str


MUTATIONS = (
    Mutation(
        name="reversed-recompute",
        file="jpa/engine/scheduler.py",
        old="return req.prompt_ids + req.output_ids[:-1]\n",
        new="return req.prompt_ids + req.output_ids[:-1][::-1]\n",
        selection=("tests/test_engine.py", "tests/test_chunked_prefill.py", "tests/test_prefix_cache.py",
                   "tests/test_parallel_sampling.py", "-k", "preempt"),
        why="a preempted request re-prefills its generated tokens in reversed order",
    ),
    Mutation(
        name="slot-off-by-one",
        file="jpa/engine/ragged_step.py",
        old="slot_mapping = jnp.where(lay.row_live, page * ps_ + pos % ps_, -1)",
        new="slot_mapping = jnp.where(lay.row_live, page * ps_ + (pos + 1) % ps_, -1)",
        selection=("tests/test_engine.py::test_engine_logprobs_match_the_dense_model",
                   "tests/test_chunked_prefill.py::test_chunks_equal_the_reference_at_any_budget"),
        why="the unified step writes each row's K/V one slot further into its page",
    ),
    Mutation(
        name="skipped-copy-on-write",
        file="jpa/engine/device.py",
        old="lax.while_loop(lambda c: c[0] * size < n, copy,",
        new="lax.while_loop(lambda c: c[0] * size < 0 * n, copy,",
        selection=("tests/test_parallel_sampling.py", "-k", "n_samples_equal"),
        why="a page shared by forked samples is never copied before a divergent write (counted as copied)",
    ),
    Mutation(
        name="prefix-hit-next-page",
        file="jpa/kv/prefix_cache.py",
        old="page = self.page_of.get(kid)\n            if page is None:\n",   # lookup (the device tier's)
        new="page = self.page_of.get(kid + 1)\n            if page is None:\n",
        selection=("tests/test_prefix_cache.py", "-k", "outputs_equal or warm_cache"),
        why="a prefix-cache hit returns the page of the next key (hit pages shifted by one)",
    ),
)

STATUSES = ("caught", "missed", "broken", "error", "timeout")


def tracked_files(repo: pathlib.Path) -> list[str]:
    """Paths (relative) of the files git tracks in `repo` that exist in its working tree."""
    out = subprocess.run(["git", "-C", str(repo), "ls-files", "-z"], capture_output=True, check=True).stdout
    return [p for p in out.decode().split("\0") if p and os.path.lexists(repo / p)]


def copy_tree(repo: pathlib.Path, dest: pathlib.Path) -> None:
    """The working-tree contents of `repo`'s tracked files, copied under `dest` (links as links)."""
    for rel in tracked_files(repo):
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(repo / rel, target, follow_symlinks=False)


def apply(mutation: Mutation, root: pathlib.Path) -> str | None:
    """Applies `mutation` under `root`; returns None, or why it does not apply (then nothing changed)."""
    path = root / mutation.file
    if not path.is_file():
        return f"{mutation.file}: no such file"
    text = path.read_text(encoding="utf-8")
    count = text.count(mutation.old)
    if count != 1:
        return (f"{mutation.file}: the old text {mutation.old.strip()!r} is found {count} times "
                f"(needs exactly 1); update the pattern in jpa/tools/mutation.py")
    path.write_text(text.replace(mutation.old, mutation.new), encoding="utf-8")
    return None


def run_pytest(root: pathlib.Path, selection, *, timeout: float, stop_first: bool = True) -> dict:
    """`python -m pytest -q [-x] <selection>` in `root` (its own copy of jpa and models first on
    the path). Returns {"rc": exit code or None on timeout, "seconds", "failed": [test ids], "tail"}."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider",
           *(["-x"] if stop_first else []), *selection]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), *filter(None, [os.environ.get("PYTHONPATH")])]),
               PYTHONDONTWRITEBYTECODE="1")
    env.setdefault("JAX_PLATFORMS", "cpu")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the pytest process we started and its children
        out, _ = proc.communicate()
        rc = None
    failed = re.findall(r"^(?:FAILED|ERROR) (.+?)(?: - .*)?$", out, re.M)
    return {"rc": rc, "seconds": round(time.perf_counter() - t0, 1), "failed": failed,
            "tail": out.strip().splitlines()[-1] if out.strip() else ""}


def check(mutation: Mutation, repo: pathlib.Path, *, timeout: float, stop_first: bool = True) -> dict:
    """Copies repo, applies the mutation, runs its selection: a result record with its status."""
    rec = {"name": mutation.name, "file": mutation.file, "why": mutation.why,
           "selection": " ".join(mutation.selection), "status": None, "seconds": 0.0, "failed": [], "detail": ""}
    with tempfile.TemporaryDirectory(prefix=f"jpa-mutant-{mutation.name}-") as tmp:
        root = pathlib.Path(tmp)
        copy_tree(repo, root)
        problem = apply(mutation, root)
        if problem is not None:
            return {**rec, "status": "broken", "detail": problem}
        r = run_pytest(root, mutation.selection, timeout=timeout, stop_first=stop_first)
    status = ("timeout" if r["rc"] is None else "caught" if r["rc"] == 1 else "missed" if r["rc"] == 0
              else "error")
    detail = r["tail"] if status != "timeout" else f"no result within {timeout:g} s"
    return {**rec, "status": status, "seconds": r["seconds"], "failed": r["failed"], "detail": detail}


def baseline(mutations, repo: pathlib.Path, *, timeout: float) -> dict:
    """Every distinct selection, one pytest run each, on one unmutated copy: all must pass."""
    rec = {"status": "passed", "seconds": 0.0, "failed": [], "detail": ""}
    with tempfile.TemporaryDirectory(prefix="jpa-mutant-baseline-") as tmp:
        root = pathlib.Path(tmp)
        copy_tree(repo, root)
        seen = set()
        for m in mutations:
            if m.selection in seen:
                continue
            seen.add(m.selection)
            r = run_pytest(root, m.selection, timeout=timeout)
            rec["seconds"] = round(rec["seconds"] + r["seconds"], 1)
            if r["rc"] != 0:
                return {**rec, "status": "failed", "failed": r["failed"],
                        "detail": f"{' '.join(m.selection)}: " + (r["tail"] if r["rc"] is not None
                                                                  else f"no result within {timeout:g} s")}
    return rec


def table(rows) -> str:
    """A plain-text table of result records."""
    head = ("mutation", "status", "seconds", "caught by / detail")
    body = [(r["name"], r["status"], f"{r['seconds']:.1f}",
             ", ".join(r["failed"]) if r["status"] == "caught" and r["failed"] else r["detail"]) for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    fmt = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt(head), fmt(["-" * w for w in widths]), *map(fmt, body)])


def git_describe(repo: pathlib.Path) -> dict:
    def git(*a):
        return subprocess.run(["git", "-C", str(repo), *a], capture_output=True, text=True).stdout.strip()
    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def parse_args(argv=None, names=tuple(m.name for m in MUTATIONS)):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repo", type=pathlib.Path, default=REPO, help="the repository to copy (default: the checkout jpa is imported from)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per pytest run (default 900)")
    ap.add_argument("--only", action="append", default=[], metavar="NAME", help="run this mutation only (repeatable)")
    ap.add_argument("--dry-run", action="store_true", help="list the mutations and check that each pattern "
                    "applies; run no tests")
    ap.add_argument("--no-baseline", action="store_true", help="skip the unmutated run of the selections")
    ap.add_argument("--all-failures", action="store_true", help="run each selection to the end (no -x) and list "
                    "every test that catches the fault")
    ap.add_argument("--json", metavar="PATH", help="write the results here")
    args = ap.parse_args(argv)
    unknown = [n for n in args.only if n not in names]
    if unknown:
        ap.error(f"--only {', '.join(unknown)}: unknown; the mutations are {', '.join(sorted(names))}")
    if args.timeout <= 0:
        ap.error(f"--timeout must be > 0; got {args.timeout}")
    return args


def main(argv=None, mutations=MUTATIONS) -> int:
    args = parse_args(argv, [m.name for m in mutations])
    repo = args.repo.resolve()
    chosen = [m for m in mutations if not args.only or m.name in args.only]
    report = {"repo": str(repo), **git_describe(repo), "timeout": args.timeout, "dry_run": args.dry_run,
              "baseline": None, "results": []}
    if args.dry_run:
        for m in chosen:
            with tempfile.TemporaryDirectory(prefix="jpa-mutant-dry-") as tmp:
                root = pathlib.Path(tmp)
                (root / m.file).parent.mkdir(parents=True, exist_ok=True)
                if (repo / m.file).is_file():
                    shutil.copy2(repo / m.file, root / m.file)
                problem = apply(m, root)
            report["results"].append({"name": m.name, "file": m.file, "why": m.why, "selection": " ".join(m.selection),
                                      "status": "broken" if problem else "applies", "seconds": 0.0, "failed": [],
                                      "detail": problem or f"{m.why}; pytest {' '.join(m.selection)}"})
        print(table(report["results"]))
    else:
        if not args.no_baseline:
            print("[mutation_check] baseline: the selections on the unmutated code...", file=sys.stderr, flush=True)
            report["baseline"] = baseline(chosen, repo, timeout=args.timeout)
            print(f"[mutation_check] baseline {report['baseline']['status']} in {report['baseline']['seconds']:.1f} s"
                  + (f": {report['baseline']['detail']}" if report["baseline"]["status"] != "passed" else ""),
                  file=sys.stderr, flush=True)
        for m in chosen:
            print(f"[mutation_check] {m.name}: {m.why}...", file=sys.stderr, flush=True)
            rec = check(m, repo, timeout=args.timeout, stop_first=not args.all_failures)
            print(f"[mutation_check] {m.name}: {rec['status']} in {rec['seconds']:.1f} s", file=sys.stderr, flush=True)
            report["results"].append(rec)
        print(table(report["results"]))
    if args.json:
        pathlib.Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.json).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    ok_status = "applies" if args.dry_run else "caught"
    bad = [r for r in report["results"] if r["status"] != ok_status]
    base_bad = report["baseline"] is not None and report["baseline"]["status"] != "passed"
    return 1 if bad or base_bad else 0


if __name__ == "__main__":
    sys.exit(main())
