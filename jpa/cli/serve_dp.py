"""`jpa serve-dp`: data parallelism: N independent jpa servers (replicas) behind vLLM's router, on one machine.

Examples:
  ./run serve-dp --dp 2                                   # SmolLM2 x 2; the API on http://127.0.0.1:8000/v1
  ./run serve-dp --dp 2 --model tiny-llama --max-seqs 8   # any `jpa serve` flag goes to every replica
  ./run serve-dp --dp 4 --policy round_robin --router-args "--balance-abs-threshold 16"

Each replica is `jpa serve` (its own engine, KV pool and devices; replicas share nothing), on
127.0.0.1 at consecutive ports from --port (default 8001; 0: free ports). vllm-router (PyPI
`vllm-router`, the `router` extra) listens on --host:--router-port (default 127.0.0.1:8000) and
forwards every request to one replica by --policy: `cache_aware` (default) sends a prompt to the
replica that served the longest prefix of it (so that replica's prefix cache hits) when the match
covers more than --cache-threshold (0.3) of it, and any other prompt to the replica with the fewest
requests in flight, unless the load is out of balance (--balance-abs-threshold,
--balance-rel-threshold). Pass router flags with --router-args.

The replicas start first; the router starts once every replica's /health is 200 (the model loaded
and compiled), then this script prints one line per replica and the router's URL on stderr and
runs until SIGINT/SIGTERM, which stop the router, then the replicas (each gives requests in flight
up to 5 s to finish, as `jpa serve` does on SIGTERM), and exit 0. If any child dies, the others are
stopped and the script exits 1 naming it. Children's output is copied to stderr, each line
prefixed with the child's name.

GPUs: with NVIDIA GPUs visible (nvidia-smi), replica r gets CUDA_VISIBLE_DEVICES = the GPUs
[r*K, (r+1)*K) of those visible (of $CUDA_VISIBLE_DEVICES when set), K = --devices-per-replica
(default 1), and with K > 1 runs its engine over them (--tp K, unless --tp is given). On a machine
without NVIDIA GPUs nothing is pinned: the replicas share the CPU cores. Bad flags or values print one line on stderr and exit
with code 2.
"""

import argparse
import importlib.util
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable

from jpa.args import Parser, UsageError

SERVE = [sys.executable, "-m", "jpa", "serve"]   # a replica: `jpa serve` on this interpreter
POLICIES = ("cache_aware", "round_robin", "random", "power_of_two", "consistent_hash", "sticky_least_loaded")
ROUTER_LINE = re.compile(r"\[jpa\] router \(policy (\S+)\) on (http://\S+) ")
REPLICA_LINE = re.compile(r"\[jpa\] replica (\d+) ready on (http://\S+)")


def parse_args(argv=None):
    """(this script's flags, the flags every replica gets)."""
    ap = Parser(prog="jpa serve-dp", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False,
                 epilog="Every other flag is `jpa serve`'s (see `./run serve --help`) and goes to every "
                        "replica, e.g. --model, --max-seqs, --num-pages, --api-key.")
    ap.add_argument("--dp", type=int, default=2, help="number of replicas (default 2)")
    ap.add_argument("--host", default="127.0.0.1", help="address the router binds (default 127.0.0.1: this "
                    "machine only); replicas always bind 127.0.0.1")
    ap.add_argument("--port", type=int, default=8001, help="port of replica 0; replica r gets port + r "
                    "(default 8001; 0: each replica picks a free port)")
    ap.add_argument("--router-port", type=int, default=8000, help="the router's port (default 8000; 0: a free one)")
    ap.add_argument("--policy", default="cache_aware", choices=POLICIES, help="the router's load-balancing policy "
                    "(default cache_aware)")
    ap.add_argument("--router-args", default="", metavar="ARGS", help="more vllm-router flags, one string, e.g. "
                    "\"--balance-abs-threshold 16\" (see `python -m vllm_router.launch_router "
                    "--help`)")
    ap.add_argument("--devices-per-replica", type=int, default=1, help="GPUs per replica where NVIDIA GPUs are "
                    "visible (default 1); ignored on a machine without them")
    ap.add_argument("--ready-timeout", type=float, default=1800, help="seconds a replica may take to load and "
                    "compile, and the router to start (default 1800)")
    args, serve_argv = ap.parse_known_args(argv)
    check_args(args, serve_argv)
    return args, serve_argv


def check_args(args, serve_argv):
    if args.dp < 1:
        raise UsageError(f"--dp must be >= 1; got {args.dp}")
    if args.devices_per_replica < 1:
        raise UsageError(f"--devices-per-replica must be >= 1; got {args.devices_per_replica}")
    if not args.ready_timeout > 0:
        raise UsageError(f"--ready-timeout must be a positive number of seconds; got {args.ready_timeout}")
    if not (args.port == 0 or 1 <= args.port and args.port + args.dp - 1 <= 65535):
        raise UsageError(f"--port must be 0 or leave room for {args.dp} consecutive ports below 65536; "
                         f"got {args.port}")
    if not 0 <= args.router_port <= 65535:
        raise UsageError(f"--router-port must be in [0, 65535]; got {args.router_port}")
    if args.port and args.router_port and args.port <= args.router_port < args.port + args.dp:
        raise UsageError(f"--router-port {args.router_port} is one of the replicas' ports "
                         f"{args.port}..{args.port + args.dp - 1}")
    try:
        args.router_args = shlex.split(args.router_args)
    except ValueError as e:
        raise UsageError(f"--router-args: {e}") from None
    from jpa.cli import serve  # light: argparse and checks, no JAX

    try:
        replica = serve.parse_args([*serve_argv, "--port", "0"])   # the replicas' flags, checked once here
    except UsageError as e:
        raise UsageError(f"replica flags: {e}") from None
    if replica.coordinator is not None:
        raise UsageError("replicas are independent servers: --coordinator (one engine over several processes) "
                         "does not go with `jpa serve-dp`")
    if args.devices_per_replica > 1 and "--tp" not in serve_argv:
        serve_argv += ["--tp", str(args.devices_per_replica)]   # each replica shards over its own K devices
    if importlib.util.find_spec("vllm_router") is None:
        raise UsageError("vllm-router is not installed: pip install -e '.[router]' (./run setup installs it)")


# ---------------------------------------------------------------------- pieces (also used by the tests)

def device_assignment(dp: int, per_replica: int, gpus: list[str] | None) -> list[str | None]:
    """Each replica's CUDA_VISIBLE_DEVICES: the GPUs [r*K, (r+1)*K) of `gpus`; None (nothing pinned) without GPUs."""
    if not gpus:
        return [None] * dp
    if dp * per_replica > len(gpus):
        raise UsageError(f"--dp {dp} x --devices-per-replica {per_replica} needs {dp * per_replica} GPUs; "
                         f"{len(gpus)} visible ({','.join(gpus)})")
    return [",".join(gpus[r * per_replica:(r + 1) * per_replica]) for r in range(dp)]


def visible_gpus() -> list[str] | None:
    """The NVIDIA GPUs this process may hand out: $CUDA_VISIBLE_DEVICES when set, else those nvidia-smi
    lists; None on a machine without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        return [g.strip() for g in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if g.strip()]
    r = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
    return [str(i) for i, line in enumerate(l for l in r.stdout.splitlines() if l.startswith("GPU "))]


def router_command(worker_urls: list[str], *, host: str, port: int, policy: str, extra=()) -> list[str]:
    """The command line of vllm-router in front of `worker_urls`."""
    return [sys.executable, "-m", "vllm_router.launch_router", "--host", host, "--port", str(port),
            "--worker-urls", *worker_urls, "--policy", policy, *extra]


def router_env() -> dict:
    """The router's environment: its Rust log at warnings unless $RUST_LOG says otherwise (its own
    --log-level flag does not reach the Rust logger in 0.1.17)."""
    return {**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")}


def http_status(url: str, timeout: float = 2.0) -> int | None:
    """The HTTP status of GET url; None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (OSError, ValueError):
        return None


def metric(url: str, name: str) -> float:
    """The sum over its labels of one metric in url/metrics (Prometheus text)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        text = r.read().decode()
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def wait_healthy(url: str, *, timeout: float, check: Callable[[], None] = lambda: None, what: str = "server"):
    """Polls url/health until it answers 200. `check` runs between polls and raises to give up (e.g. when
    the process died); TimeoutError after `timeout` seconds."""
    t0 = time.monotonic()
    while http_status(f"{url}/health") != 200:
        check()
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"{what} at {url} was not healthy within {timeout:g} s")
        time.sleep(0.2)


def stop(procs: list[subprocess.Popen], grace: float = 30.0) -> None:
    """SIGTERM to every process still running, then SIGKILL to those not gone within `grace` seconds."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_port_free(host: str, port: int, flag: str) -> None:
    try:
        with socket.socket() as s:
            s.bind((host, port))
    except OSError as e:
        raise UsageError(f"{flag}: cannot bind {host}:{port}: {e.strerror}") from None


# ---------------------------------------------------------------------- driving this script (benchmarks, tests)

def start(argv: list[str], *, log_path: str, env: dict | None = None) -> subprocess.Popen:
    """Runs `jpa serve-dp` with `argv` in a process group of its own (so `stop_group` reaches every child),
    its output in log_path."""
    with open(log_path, "w") as log:
        return subprocess.Popen([sys.executable, "-m", "jpa", "serve-dp", *argv], env=env, stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_started(proc: subprocess.Popen, log_path: str, timeout: float) -> tuple[str, list[str]]:
    """(router URL, replica URLs in order) once `proc` (from `start`) says the router is up; RuntimeError
    with the log's tail if it exits or `timeout` seconds pass first."""
    t0 = time.monotonic()
    while not (m := ROUTER_LINE.search(text := open(log_path).read())):
        if proc.poll() is not None or time.monotonic() - t0 > timeout:
            why = f"exited with code {proc.returncode}" if proc.poll() is not None else f"not up in {timeout:g} s"
            raise RuntimeError(f"jpa serve-dp {why}; its log:\n{text[-3000:]}")
        time.sleep(0.2)
    return m.group(2), [url for _, url in sorted((int(r), url) for r, url in REPLICA_LINE.findall(text))]


def stop_group(proc: subprocess.Popen, grace: float = 60.0) -> None:
    """SIGTERM to `proc` (from `start`), which stops its children, then SIGKILL to whatever is left of its
    process group after `grace` seconds or once it has exited."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:   # the whole group is gone
        pass
    proc.wait()


# ---------------------------------------------------------------------- the children

class _Child:
    """A child process whose output (stdout and stderr) is copied to our stderr, each line prefixed."""

    def __init__(self, name: str, cmd: list[str], env: dict):
        self.name, self.lines, self.url = name, [], None
        self.url_seen = threading.Event()
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, errors="replace")
        self._pump_thread = threading.Thread(target=self._pump, name=f"pump-{name}", daemon=True)
        self._pump_thread.start()

    def _pump(self):
        for line in self.proc.stdout:
            self.lines = [*self.lines[-19:], line.rstrip()]
            m = re.search(r"\[jpa\] serving '[^']*' on (http://\S+) ", line)
            if m and self.url is None:
                self.url = m.group(1)
                self.url_seen.set()
            sys.stderr.write(f"[{self.name}] {line}")
            sys.stderr.flush()

    def died(self) -> str | None:
        """A sentence naming this child and how it ended, or None while it runs."""
        rc = self.proc.poll()
        if rc is None:
            return None
        self._pump_thread.join(2)   # its last lines, which usually say why
        how = f"was killed by signal {-rc}" if rc < 0 else f"exited with code {rc}"
        last = next((l for l in reversed(self.lines) if l.strip()), None)
        return f"{self.name} (pid {self.proc.pid}) {how}" + (f"; its last line: {last}" if last else "")


class ChildDied(Exception):
    """A replica or the router ended by itself."""


class _Stop(Exception):
    """SIGINT or SIGTERM: a requested stop."""


def run(args, serve_argv) -> int:
    gpus = visible_gpus()
    pins = device_assignment(args.dp, args.devices_per_replica, gpus)
    router_port = args.router_port or free_port(args.host)
    check_port_free(args.host, router_port, "--router-port")
    for r in range(args.dp if args.port else 0):
        check_port_free("127.0.0.1", args.port + r, "--port")
    stopping = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: stopping.set())
    children: list[_Child] = []

    def check():
        if stopping.is_set():
            raise _Stop
        for c in children:
            if (msg := c.died()) is not None:
                raise ChildDied(msg)

    try:
        for r in range(args.dp):
            env = dict(os.environ)
            if pins[r] is not None:
                env["CUDA_VISIBLE_DEVICES"] = pins[r]
            port = args.port + r if args.port else 0
            children.append(_Child(f"replica {r}", [*SERVE, *serve_argv, "--host", "127.0.0.1",
                                                    "--port", str(port)], env))
        t0 = time.monotonic()
        for c in children:
            while not c.url_seen.wait(0.2):
                check()
                if time.monotonic() - t0 > args.ready_timeout:
                    raise TimeoutError(f"{c.name} did not say where it listens within {args.ready_timeout:g} s")
            wait_healthy(c.url, timeout=args.ready_timeout - (time.monotonic() - t0), check=check, what=c.name)
        for r, c in enumerate(children):
            pin = f" (CUDA_VISIBLE_DEVICES={pins[r]})" if pins[r] is not None else ""
            print(f"[jpa] replica {r} ready on {c.url}{pin}", file=sys.stderr, flush=True)
        host = f"[{args.host}]" if ":" in args.host else args.host
        router_url = f"http://{host}:{router_port}"
        children.append(_Child("router", router_command([c.url for c in children], host=args.host, port=router_port,
                                                        policy=args.policy, extra=args.router_args), router_env()))
        wait_healthy(router_url.replace("0.0.0.0", "127.0.0.1"), timeout=args.ready_timeout, check=check,
                     what="the router")
        print(f"[jpa] router (policy {args.policy}) on {router_url} -> {args.dp} replica(s); OpenAI API at /v1",
              file=sys.stderr, flush=True)
        while True:
            check()
            time.sleep(0.2)
    except _Stop:
        print("[jpa] stopping the replicas and the router", file=sys.stderr, flush=True)
        return 0
    except ChildDied as e:
        print(f"[jpa] {e}; stopping the others", file=sys.stderr, flush=True)
        return 1
    except TimeoutError as e:
        print(f"[jpa] {e}; stopping everything", file=sys.stderr, flush=True)
        return 1
    finally:
        stop([c.proc for c in children if c.name == "router"])   # first: no new requests reach a stopping replica
        stop([c.proc for c in children])


def main(argv=None):
    try:
        args, serve_argv = parse_args(argv)
        return run(args, serve_argv)
    except UsageError as e:
        print(f"jpa serve-dp: error: {e}", file=sys.stderr)
        return 2

